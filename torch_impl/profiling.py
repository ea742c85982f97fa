"""Where a step spends its time: ``torch.profiler`` kernels grouped into matmul / reduction-softmax /
elementwise / other, the numbers behind "what fraction of the step is GEMM".

``profile_steps(step, n, out_dir, tag)`` runs ``n`` calls of ``step`` under the profiler, writes a Chrome trace
(open it in chrome://tracing or ui.perfetto.dev) and returns the kernel table. On a GPU the rows are CUDA
kernels timed on the device; on a CPU, the aten operators' own CPU time. Categories come from kernel names
(cuBLAS / CUTLASS / Triton GEMMs, softmax and norm reductions, vectorized elementwise kernels).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = ("matmul", "reduction-softmax", "elementwise", "other")
_PATTERNS = (  # checked in order: a GEMM kernel named "..._reduce..." is still a GEMM
    ("other", r"nccl|allreduce|allgather|reducescatter|memcpy|memset"),  # communication and copies
    ("matmul", r"gemm|matmul|\bmm\b|addmm|bmm|cutlass|xmma|wgmma|gemv|cublas|nvjet|linear|_attn_fwd|flash|sdpa"),
    ("reduction-softmax", r"softmax|reduce|reduction|\bsum\b|mean|norm|\bmax\b|\bmin\b|logsumexp|cross_entropy|nll"),
    ("elementwise", r"elementwise|vectorized|unrolled|\badd|\bmul|\bdiv|\bsub|silu|sigmoid|\bexp|pow|rsqrt|copy|"
                    r"cast|fill|where|masked|\bneg|\bcat\b|stack|index|embedding|clone|_to_copy|foreach|adam|sqrt|lerp|"
                    r"tril|triu|addc"),
)


def categorize(name: str) -> str:
    """The category of a kernel or operator name."""
    lowered = name.lower()
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


def is_kernel(event) -> bool:
    """A device-side kernel or copy: not the host operator that launched it (``aten::mm`` carries its
    kernels' device time too), not a user annotation drawn on the device timeline (``Optimizer.step#...``),
    not a profiler marker (``Command Buffer Full``): each of those would count the same time twice."""
    return (event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation
            and event.key not in _MARKERS and event.self_device_time_total > 0)


_MARKERS = ("Command Buffer Full",)


def kernel_table(prof: profile, n_steps: int) -> list[KernelRow]:
    """Per-step time by category: device kernels where CUDA ran, else CPU aten operators (self time)."""
    events = prof.key_averages()
    on_device = any(is_kernel(e) for e in events)
    times: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
    for e in events:
        if on_device and not is_kernel(e) or not on_device and not e.key.startswith("aten::"):
            continue
        us = e.self_device_time_total if on_device else e.self_cpu_time_total
        if us <= 0:
            continue
        times[categorize(e.key)][e.key] = us / 1e3 / n_steps
    total = sum(sum(kernels.values()) for kernels in times.values()) or 1.0
    rows = []
    for category in CATEGORIES:
        kernels = sorted(times[category].items(), key=lambda kv: -kv[1])
        time_ms = sum(ms for _, ms in kernels)
        top = "; ".join(f"{name[:60]} {ms:.3f}" for name, ms in kernels[:3])
        rows.append(KernelRow(category, time_ms, time_ms / total, top, tuple(kernels)))
    return rows


def markdown(rows: list[KernelRow], title: str) -> str:
    lines = [f"### {title}", "", "| category | ms / step | share | largest (ms / step) |", "|:--|--:|--:|:--|"]
    lines += [f"| {r.category} | {r.time_ms:.3f} | {r.fraction:.1%} | {r.top} |" for r in rows]
    largest = sorted(((ms, name, r.category) for r in rows for name, ms in r.kernels), reverse=True)
    lines += ["", f"The {min(len(largest), 40)} largest:", "", "| ms / step | category | kernel |", "|--:|:--|:--|"]
    lines += [f"| {ms:.3f} | {category} | `{name[:110]}` |" for ms, name, category in largest[:40]]
    return "\n".join(lines)


def profile_steps(step: Callable[[], object], n_steps: int, out_dir: str | Path, tag: str) -> list[KernelRow]:
    """Profile ``n_steps`` calls of ``step``; write ``<tag>_trace.json`` and ``<tag>_kernels.md`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(n_steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"{tag}_trace.json"))
    rows = kernel_table(prof, n_steps)
    (out / f"{tag}_kernels.md").write_text(markdown(rows, f"{tag}: time per step by kernel category") + "\n")
    return rows
