"""Attention backends by name: each takes q, k, v shaped (..., n, d) and returns (..., n_queries, d).

``TransformerLM(spec, attention=name)`` looks its backend up here. Backends register themselves with
``@register_attention(name)``; later kernels (FlashAttention-2 in PyTorch and Triton) add theirs. The Triton
kernels load on first use (``get_attention("flash_triton")`` or ``FlashAttention2Triton``), not with the model.
"""

from torch_impl.attention.registry import (ATTENTION_BACKENDS, AttentionFn, PackedAttentionFn, get_attention,
                                           get_packed_attention, register_attention, register_lazy_attention,
                                           register_packed_attention)
from torch_impl.attention import naive as _naive  # noqa: F401  (registers "naive" and "sdpa")
from torch_impl.attention.flash_torch import FlashAttention2Torch  # registers "flash_torch"

register_lazy_attention("flash_triton", "torch_impl.attention.flash_triton")


def __getattr__(name: str):
    if name != "FlashAttention2Triton":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torch_impl.attention.flash_triton import FlashAttention2Triton
    return FlashAttention2Triton


__all__ = ["ATTENTION_BACKENDS", "AttentionFn", "FlashAttention2Torch", "FlashAttention2Triton", "PackedAttentionFn",
           "get_attention", "get_packed_attention", "register_attention", "register_lazy_attention",
           "register_packed_attention"]
