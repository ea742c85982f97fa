"""Reference attention backends: ``naive`` (the n x n score matrix, materialized) and ``sdpa`` (PyTorch's).

``naive`` is softmax(q k^T / sqrt(d) + causal mask) v written out step by step, each step inside an NVTX
range so a profile shows where the time goes; ``sdpa`` is ``torch.nn.functional.scaled_dot_product_attention``,
which dispatches to FlashAttention / cuDNN / memory-efficient kernels on a GPU. With is_causal and
n_queries != n_keys, query i attends to keys 0..i (top-left aligned), as the CS336 reference does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torch_impl import nvtx
from torch_impl.attention.registry import register_attention


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(n_queries, n_keys) bool, True where query i may attend key j (j <= i)."""
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril()


@register_attention("naive")
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    with nvtx.range("attention scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., n_q, n_k)
        if is_causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    with nvtx.range("attention softmax"):
        weights = torch.softmax(scores, dim=-1)
    with nvtx.range("attention output"):
        return weights @ v  # (..., n_q, d)


@register_attention("sdpa")
def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    if is_causal and q.shape[-2] != k.shape[-2]:
        # SDPA's is_causal is also top-left aligned, but say so explicitly with a mask.
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
