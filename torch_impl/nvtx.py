"""NVTX ranges that cost nothing without CUDA.

``with nvtx.range("forward"):`` marks a region for ``nsys profile`` (filter with ``--capture-range=nvtx``);
on a CPU-only build (no NVTX) it is a no-op, so model code can annotate itself unconditionally.
"""

from __future__ import annotations

import contextlib

import torch


def range(name: str):  # noqa: A001 - mirrors torch.cuda.nvtx.range
    """Context manager: an NVTX range on CUDA builds with a GPU, else a no-op."""
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()
