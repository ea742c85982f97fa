"""Attention backends by name: each takes q, k, v shaped (..., n, d) and returns (..., n_queries, d).

``TransformerLM(spec, attention=name)`` looks its backend up here. Backends register themselves with
``@register_attention(name)``; later kernels (FlashAttention-2 in PyTorch and Triton) add theirs.
"""

from torch_impl.attention.registry import ATTENTION_BACKENDS, AttentionFn, get_attention, register_attention
from torch_impl.attention import naive as _naive  # noqa: F401  (registers "naive" and "sdpa")
from torch_impl.attention.flash_torch import FlashAttention2Torch  # registers "flash_torch"
from torch_impl.attention.flash_triton import FlashAttention2Triton  # registers "flash_triton"

__all__ = ["ATTENTION_BACKENDS", "AttentionFn", "FlashAttention2Torch", "FlashAttention2Triton", "get_attention",
           "register_attention"]
