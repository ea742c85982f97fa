"""Reference attention backends: ``naive`` (the n x n score matrix, materialized) and ``sdpa`` (PyTorch's).

Also ``sdpa_cudnn``, ``sdpa_flash`` and ``sdpa_efficient``: SDPA with one kernel forced through
``torch.nn.attention.sdpa_kernel`` (which ``torch.compile`` traces without a graph break), so a model can run
exactly the kernel a benchmark names (e.g. "stock PyTorch's best": cuDNN attention + compile + fused AdamW).
A forced kernel that cannot run the inputs (a CPU tensor, an unsupported head dim) raises PyTorch's
"No available kernel" RuntimeError rather than silently falling back.

``naive`` is softmax(q k^T / sqrt(d) + causal mask) v written out step by step, each step inside an NVTX
range so a profile shows where the time goes; ``sdpa`` is ``torch.nn.functional.scaled_dot_product_attention``,
which dispatches to FlashAttention / cuDNN / memory-efficient kernels on a GPU. With is_causal and
n_queries != n_keys, query i attends to keys 0..i (top-left aligned), as the CS336 reference does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_impl import nvtx
from torch_impl.attention.registry import register_attention


def future_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(n_queries, n_keys) bool, True where key j lies after query i (j > i): what causal attention hides."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).triu(diagonal=1)


@register_attention("naive")
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True,
                    future: torch.Tensor | None = None) -> torch.Tensor:
    """``future``: ``future_mask(n_q, n_k)`` made once by the caller (the benchmark, not to time it), else here."""
    with nvtx.range("attention scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., n_q, n_k)
        if is_causal:
            future = future_mask(q.shape[-2], k.shape[-2], q.device) if future is None else future
            scores = scores.masked_fill(future, float("-inf"))
    with nvtx.range("attention softmax"):
        weights = torch.softmax(scores, dim=-1)
    with nvtx.range("attention output"):
        return weights @ v  # (..., n_q, d)


@register_attention("sdpa")
def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    if is_causal and q.shape[-2] != k.shape[-2]:
        # SDPA's is_causal is also top-left aligned, but say so explicitly with a mask.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~future_mask(q.shape[-2], k.shape[-2], q.device))
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _forced_sdpa(name: str, backend: SDPBackend) -> None:
    @register_attention(name)
    def forced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return sdpa_attention(q, k, v, is_causal)

    forced.__name__ = forced.__qualname__ = f"{name}_attention"


for _name, _backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
    _forced_sdpa(_name, _backend)
