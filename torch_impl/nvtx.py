"""NVTX ranges that cost nothing without CUDA, and nothing inside ``torch.compile``.

``with nvtx.range("forward"):`` marks a region for ``nsys profile`` (filter with ``--capture-range=nvtx``);
on a CPU-only build (no NVTX) it is a no-op, so model code can annotate itself unconditionally. While
``torch.compile`` traces, it is a no-op too: an NVTX push/pop inside a compiled region is an opaque call that
breaks the graph (measured on an H100: 7 graph breaks in the xl model, a 2x slower step; notes/train_step.md).
"""

from __future__ import annotations

import contextlib

import torch


def range(name: str):  # noqa: A001 - mirrors torch.cuda.nvtx.range
    """Context manager: an NVTX range on CUDA builds with a GPU, outside compiled code; else a no-op."""
    if torch.cuda.is_available() and not torch.compiler.is_compiling():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()
