"""Where a step spends its time: ``torch.profiler`` kernels grouped into matmul / reduction-softmax /
elementwise / other, the numbers behind "what fraction of the step is GEMM".

``profile_steps(step, n, out_dir, tag)`` runs ``n`` calls of ``step`` under the profiler, writes a Chrome trace
(open it in chrome://tracing or ui.perfetto.dev) and returns the kernel table. On a GPU the rows are CUDA
kernels timed on the device; on a CPU, the aten operators' own CPU time. Categories come from kernel names
(cuBLAS / CUTLASS / Triton GEMMs, softmax and norm reductions, vectorized elementwise kernels): the
framework-free half (categories, tables) is ``analysis.kernels``, which the JAX benchmark's profile uses too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from analysis.kernels import CATEGORIES, KernelRow, categorize, markdown  # noqa: F401 (re-exported)
from analysis.kernels import kernel_table as rows_by_category


def is_kernel(event) -> bool:
    """A device-side kernel or copy: not the host operator that launched it (``aten::mm`` carries its
    kernels' device time too), not a user annotation drawn on the device timeline (``Optimizer.step#...``),
    not a profiler marker (``Command Buffer Full``): each of those would count the same time twice."""
    return (event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation
            and event.key not in _MARKERS and event.self_device_time_total > 0)


_MARKERS = ("Command Buffer Full",)


def kernel_table(prof: profile, n_steps: int, calls: dict[str, float] | None = None) -> list[KernelRow]:
    """Per-step time by category: device kernels where CUDA ran, else CPU aten operators (self time); ``calls``,
    if given, gets each kernel's launches per step."""
    events = prof.key_averages()
    on_device = any(is_kernel(e) for e in events)
    times: dict[str, float] = {}
    for e in events:
        if on_device and not is_kernel(e) or not on_device and not e.key.startswith("aten::"):
            continue
        us = e.self_device_time_total if on_device else e.self_cpu_time_total
        if us > 0:
            times[e.key] = times.get(e.key, 0.0) + us / 1e3
            if calls is not None:
                calls[e.key] = calls.get(e.key, 0.0) + e.count / n_steps
    return rows_by_category(times, n_steps)


def kernel_intervals(prof: profile) -> list[tuple[str, float, float]]:
    """``(name, start us, duration us)`` of each device kernel or copy the profiler saw, for
    ``analysis.kernels.gpu_idle``: where, between which kernels, the device waits."""
    return [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events() if is_kernel(e)]


PROFILED_KERNELS = 30  # how many of the largest kernels a record names (the kernel table has all of them)


def profile_metrics(rows: list[KernelRow], calls: dict[str, float]) -> dict[str, object]:
    """A record's metrics from ``profile_steps``' table: each category's share, the kernels' sum (ms per step, to
    set against the timed step) and the ``PROFILED_KERNELS`` largest kernels' ms and launches per step."""
    largest = sorted((kernel for row in rows for kernel in row.kernels), key=lambda k: -k[1])[:PROFILED_KERNELS]
    return {**{f"time_share.{row.category}": row.fraction for row in rows},
            "profiled_kernel_ms": sum(row.time_ms for row in rows),
            "kernel_ms": dict(largest), "kernel_calls": {name: calls.get(name) for name, _ in largest}}


def profile_steps(step: Callable[[], object], n_steps: int, out_dir: str | Path | None, tag: str,
                  calls: dict[str, float] | None = None, host: bool = True) -> list[KernelRow]:
    """Profile ``n_steps`` calls of ``step``; write ``<tag>_trace.json`` and ``<tag>_kernels.md`` in ``out_dir``
    (None: the kernel table alone, nothing written); ``calls``, if given, gets each kernel's launches per step.
    ``host=False`` records the GPU's activity alone where there is CUDA (no host ops in the trace): the profiler's
    host cost per op, which slows a host-bound step, mostly left out."""
    cuda = torch.cuda.is_available()
    activities = ([ProfilerActivity.CPU] if host or not cuda else []) + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(n_steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rows = kernel_table(prof, n_steps, calls)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"{tag}_trace.json"))
        (out / f"{tag}_kernels.md").write_text(markdown(rows, f"{tag}: time per step by kernel category") + "\n")
    return rows


SNAPSHOT_ENTRIES = 1_000_000  # allocator events kept (a step of xl or 2.7B makes ~10^5)


@contextlib.contextmanager
def memory_history(path: str | Path) -> Iterator[None]:
    """Record the CUDA allocator's history over the block (Python stacks; C++ ones are ten times larger) and write
    its snapshot to ``path`` on leaving it, gzipped if ``path`` ends in ``.gz``: read it with ``python -m
    analysis.snapshot`` or https://pytorch.org/memory_viz. Allocations older than the block appear as the
    snapshot's segments."""
    import gzip
    import pickle

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks="python")
    try:
        yield
        torch.cuda.synchronize()
        data = pickle.dumps(torch.cuda.memory._snapshot())
        path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
