"""Where a step's GPU time goes, whichever framework ran it: kernels grouped into matmul / reduction-softmax /
elementwise / other, the numbers behind "what fraction of the step is GEMM".

* ``categorize(name)``: the category of a kernel name: cuBLAS / CUTLASS / Triton GEMMs and attention kernels
  (torch.profiler's names), XLA's fusion kinds (``loop_*_fusion``, ``input_reduce_fusion``, ``gemm_fusion``,
  ``cublas`` custom calls, cuDNN's fused attention).
* ``kernel_table(times_ms, n_steps)``: ``{kernel name: total ms}`` -> one ``KernelRow`` per category (ms per
  step, share, largest kernels); ``markdown(rows, title)``: that table and the 40 largest kernels.
* ``hlo_kernel_details(compiled.as_text())``: what each XLA kernel computes (result type, fusion kind, the
  JAX operation), for ``markdown``'s largest-kernel list.
* ``trace_kernel_times(path)``: ``{kernel name: total ms}`` of the device events of a Chrome-format trace
  (``*.trace.json.gz`` that ``jax.profiler.trace`` writes; torch.profiler's are read by
  ``torch_impl.profiling``): events of the "Stream #N" threads of processes named ``/device:GPU:N``. A kernel
  of an XLA program is named with its program, ``loop_add_fusion [jit_forward]``: several programs (the
  per-block step's) each have a ``loop_add_fusion`` of their own.
* ``gpu_idle(kernels)``: the GPU's busy and idle time among ``(name, start, duration)`` kernels, its largest gaps
  each with the kernels either side, and the gaps summed per pair of neighbours (``GpuIdle``): whether the host or
  the device sets the step's pace, and where it waits; ``trace_gpu_idle(path)``: the same of a trace's kernels.

Never imports torch or jax. References: the torch.profiler and JAX profiling docs (trace formats).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("matmul", "reduction-softmax", "elementwise", "other")
# A record's GPU time a step in one category, as a metric: "time_ms.<category>" (the JAX e2e benchmark's --profile)
KERNEL_TIME_PREFIX = "time_ms."
_PATTERNS = (  # checked in order: a GEMM kernel named "..._reduce..." is still a GEMM
    ("other", r"nccl|allreduce|allgather|reducescatter|all-reduce|all-gather|reduce-scatter|memcpy|memset"),
    ("matmul", r"gemm|matmul|\bmm\b|addmm|bmm|cutlass|xmma|wgmma|gemv|cublas|nvjet|linear|_attn_fwd|flash|sdpa|"
               r"cudnn|\bdot\b|dot_general|convolution"),
    ("reduction-softmax", r"softmax|reduce|reduction|\bsum\b|mean|norm|\bmax\b|\bmin\b|logsumexp|cross_entropy|nll"),
    ("elementwise", r"elementwise|vectorized|unrolled|\badd|\bmul|\bdiv|\bsub|silu|sigmoid|\bexp|pow|rsqrt|copy|"
                    r"cast|fill|where|masked|\bneg|\bcat\b|stack|index|embedding|clone|_to_copy|foreach|adam|sqrt|lerp|"
                    r"tril|triu|addc|^loop_|dynamic.update.slice|dynamic.slice|transpose|convert|broadcast|select|"
                    r"concatenate|scatter|gather|iota|rotate|_pack_kernel|_split_kernel"),  # RoPE's passes
)


_PROGRAM = re.compile(r" \[[\w.\-]+\]$")  # the " [jit_forward]" that names a kernel's XLA program


def categorize(name: str) -> str:
    """The category of a kernel or operator name (``loop_add_fusion [jit_forward]`` as ``loop_add_fusion``)."""
    lowered = _PROGRAM.sub("", name).lower()
    for category, pattern in _PATTERNS:
        if re.search(pattern, lowered):
            return category
    return "other"


@dataclass(frozen=True)
class KernelRow:
    category: str
    time_ms: float
    fraction: float
    top: str  # the largest kernels of the category, with their times
    kernels: tuple[tuple[str, float], ...] = ()  # every kernel of the category, (name, ms / step), largest first


def kernel_table(times_ms: dict[str, float], n_steps: int) -> list[KernelRow]:
    """Per-step time by category from total milliseconds per kernel name over ``n_steps`` steps."""
    per_category: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
    for name, ms in times_ms.items():
        if ms > 0:
            per_category[categorize(name)][name] = ms / n_steps
    total = sum(sum(kernels.values()) for kernels in per_category.values()) or 1.0
    rows = []
    for category in CATEGORIES:
        kernels = sorted(per_category[category].items(), key=lambda kv: -kv[1])
        time_ms = sum(ms for _, ms in kernels)
        top = "; ".join(f"{name[:60]} {ms:.3f}" for name, ms in kernels[:3])
        rows.append(KernelRow(category, time_ms, time_ms / total, top, tuple(kernels)))
    return rows


def markdown(rows: list[KernelRow], title: str, details: dict[str, str] | None = None) -> str:
    """The table by category, then the 40 largest kernels (each with ``details[name]`` where given)."""
    lines = [f"### {title}", "", "| category | ms / step | share | largest (ms / step) |", "|:--|--:|--:|:--|"]
    lines += [f"| {r.category} | {r.time_ms:.3f} | {r.fraction:.1%} | {r.top} |" for r in rows]
    largest = sorted(((ms, name, r.category) for r in rows for name, ms in r.kernels), reverse=True)
    header = "| ms / step | category | kernel |" + (" what it computes |" if details else "")
    lines += ["", f"The {min(len(largest), 40)} largest:", "", header, "|--:|:--|:--|" + ("--|" if details else "")]
    for ms, name, category in largest[:40]:
        extra = f" {details.get(name, '')} |" if details else ""
        lines.append(f"| {ms:.3f} | {category} | `{name[:110]}` |{extra}")
    return "\n".join(lines)


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+[\w\-]+\(")  # name = type opcode(
_HLO_MODULE = re.compile(r"^HloModule ([\w.\-]+)")


def _kernel_key(name: str, program: str | None) -> str:
    """A kernel's name in the tables: ``loop_add_fusion [jit_forward]`` in an XLA program, else the name."""
    return f"{name} [{program}]" if program else name


def hlo_kernel_details(hlo_text: str) -> dict[str, str]:
    """What each instruction of optimized HLO modules (``compiled.as_text()``, one or several one after another)
    computes, keyed by the name its GPU kernel gets in a trace (``loop_add_fusion.7`` of module ``jit_forward``
    runs as ``loop_add_fusion_7 [jit_forward]``): result type (layouts dropped), fusion kind, and the tail of
    the JAX operation it came from (``metadata={op_name=...}``)."""
    details, program = {}, None
    for line in hlo_text.splitlines():
        module = _HLO_MODULE.match(line)
        if module:
            program = module.group(1)
            continue
        match = _HLO_INSTRUCTION.match(line)
        if not match:
            continue
        name, result = match.groups()
        result = re.sub(r"\{[^{}]*\}", "", result)[:70]  # f32[48,1600,6400]{2,1,0} -> f32[48,1600,6400]
        kind = re.search(r"kind=k(\w+)", line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        details[_kernel_key(re.sub(r"[.\-]", "_", name), program)] = " ".join(filter(None, (
            result, kind and kind.group(1), op_name and "..." + op_name.group(1)[-70:])))
    return details


def _stream_kernels(path: str | os.PathLike) -> list[tuple[str, float, float]]:
    """``(name, start us, duration us)`` of every kernel on the GPU stream timelines of a Chrome-format trace
    (``.json`` or ``.json.gz``), of its first GPU (by name, ``/device:GPU:0``) where it holds several: a program
    over a mesh runs the same kernels on each, and one device's time a step is what a step takes. ValueError if the
    trace has no GPU timeline."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])

    def named(kind: str, prefix: str) -> dict[tuple, str]:
        """{(pid, tid): name} of the ``kind`` metadata events (process or thread names) starting ``prefix``."""
        return {(e["pid"], e.get("tid")): str(e["args"]["name"]) for e in events if e.get("ph") == "M"
                and e.get("name") == kind and str(e.get("args", {}).get("name", "")).startswith(prefix)}

    gpus = named("process_name", "/device:GPU")
    first = min(gpus, key=lambda key: _device_order(gpus[key]))[0] if gpus else None
    # Kernels are on the "Stream #N" threads; the same process's "XLA Ops" / "XLA Modules" threads repeat
    # their time per HLO op and per program, so counting those too would count it twice.
    streams = {key for key in named("thread_name", "Stream") if key[0] == first}
    if not streams:
        raise ValueError(f"{path}: no GPU stream timeline in the trace (was it recorded on a GPU?)")
    return [(_kernel_key(e["name"], e.get("args", {}).get("hlo_module")), float(e["ts"]), float(e["dur"]))
            for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams and e.get("dur")]


def _device_order(name: str) -> tuple[int, str]:
    """``/device:GPU:10 ...`` after ``/device:GPU:2``: the device's number, then its name."""
    match = re.match(r"/device:GPU:(\d+)", name)
    return (int(match.group(1)) if match else 1 << 30, name)


def trace_kernel_times(path: str | os.PathLike) -> dict[str, float]:
    """Total milliseconds per kernel name on the GPU timelines of a Chrome-format trace (``.json`` or
    ``.json.gz``). A kernel's name is the event's ``name`` (XLA names fusions after their HLO instruction,
    e.g. ``loop_multiply_fusion_3``; numbered copies of one fusion kind are kept apart: ``hlo_kernel_details``
    says what each computes), followed by its XLA program's where the event names one
    (``loop_multiply_fusion_3 [jit_backward]``). ValueError if the trace has no GPU timeline."""
    times: dict[str, float] = {}
    for name, _, dur in _stream_kernels(path):
        times[name] = times.get(name, 0.0) + dur / 1e3  # us -> ms
    return times


@dataclass(frozen=True)
class GpuIdle:
    """When the GPU ran no kernel between the first kernel and the last: ``window_ms`` (first start to last end),
    ``busy_ms`` (the union of the kernels' intervals, overlapping streams counted once), ``idle_ms`` = window -
    busy, the largest gaps as ``(ms, kernel before, kernel after)``, and ``pairs``: the gaps summed per pair of
    neighbours, ``(ms, gaps, kernel before, kernel after)``, largest first (many short gaps between the same two
    kernels add up where no single one is large)."""

    window_ms: float
    busy_ms: float
    idle_ms: float
    gaps: tuple[tuple[float, str, str], ...]
    pairs: tuple[tuple[float, int, str, str], ...] = ()

    def markdown(self, n_steps: int) -> str:
        """The idle time per step, the largest gaps and the pairs' sums per step, for the kernel table's file."""
        lines = [f"GPU busy {self.busy_ms / n_steps:.3f} ms and idle {self.idle_ms / n_steps:.3f} ms per step "
                 f"(window {self.window_ms:.3f} ms over {n_steps} steps, the gaps between steps included).",
                 "", "| gap ms | kernel before | kernel after |", "|--:|:--|:--|"]
        lines += [f"| {ms:.3f} | `{before[:60]}` | `{after[:60]}` |" for ms, before, after in self.gaps]
        lines += ["", "| idle ms per step | gaps per step | kernel before | kernel after |", "|--:|--:|:--|:--|"]
        lines += [f"| {ms / n_steps:.3f} | {count / n_steps:g} | `{before[:60]}` | `{after[:60]}` |"
                  for ms, count, before, after in self.pairs]
        return "\n".join(lines)


def gpu_idle(kernels: list[tuple[str, float, float]], largest: int = 20) -> GpuIdle:
    """The GPU's idle time (``GpuIdle``) among kernels given as ``(name, start us, duration us)``, on any streams:
    does the host, or the device, set the step's pace, and between which kernels does the device wait?"""
    kernels = sorted(kernels, key=lambda k: k[1])
    if not kernels:
        raise ValueError("no kernels on the GPU timeline")
    gaps, busy, pairs = [], 0.0, {}
    name, start, dur = kernels[0]
    end, last = start + dur, name
    busy_start = start
    for name, start, dur in kernels[1:]:
        if start > end:
            busy += end - busy_start
            gaps.append(((start - end) / 1e3, last, name))
            total, count = pairs.get((last, name), (0.0, 0))
            pairs[(last, name)] = (total + (start - end) / 1e3, count + 1)
            busy_start = start
        if start + dur >= end:
            end, last = start + dur, name
    busy += end - busy_start
    window = (end - kernels[0][1]) / 1e3
    by_pair = sorted(((ms, count, before, after) for (before, after), (ms, count) in pairs.items()), reverse=True)
    return GpuIdle(window, busy / 1e3, window - busy / 1e3, tuple(sorted(gaps, reverse=True)[:largest]),
                   tuple(by_pair[:largest]))


def trace_gpu_idle(path: str | os.PathLike, largest: int = 20) -> GpuIdle:
    """``gpu_idle`` of the kernels on a Chrome-format trace's GPU timeline (``_stream_kernels``, whose ValueError
    already names the trace)."""
    kernels = _stream_kernels(path)
    if not kernels:
        raise ValueError(f"{path}: no kernels on the GPU timeline")
    return gpu_idle(kernels, largest)
