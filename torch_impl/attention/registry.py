"""The registry of attention backends: name -> function(q, k, v, is_causal) -> output; and, for a backend that also
takes the model's input and its q, k, v projections' weights with RoPE's tables (making the one q, k, v product,
applying RoPE and splitting it itself, its backward writing the product's gradient: ``flash_triton``), name ->
function(x, weights, cos, sin, n_heads) -> output, causal."""

from __future__ import annotations

import importlib
from typing import Callable, Protocol

import torch


class AttentionFn(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
        """q: (..., n_queries, d), k and v: (..., n_keys, d) -> (..., n_queries, d)."""


class PackedAttentionFn(Protocol):
    def __call__(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor,
                 n_heads: int) -> torch.Tensor:
        """x (B, T, d), the weights (W_q, W_k, W_v) (H d, d), cos and sin (T, d / 2) -> causal attention (B, H, T, d)
        of q and k rotated by RoPE and v, the three parts of the product x [W_q; W_k; W_v]^T."""


ATTENTION_BACKENDS: dict[str, AttentionFn] = {}
PACKED_ATTENTION: dict[str, PackedAttentionFn] = {}  # backend name -> its attention of the product
_LAZY_MODULES: dict[str, str] = {}  # backend name -> the module that registers it when imported


def register_attention(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator: make a function available as ``TransformerLM(..., attention=name)``."""

    def register(fn: AttentionFn) -> AttentionFn:
        if name in ATTENTION_BACKENDS and _LAZY_MODULES.pop(name, None) is None:  # only a lazy entry is replaced
            raise ValueError(f"attention backend {name!r} is already registered")
        ATTENTION_BACKENDS[name] = fn  # in a lazy entry's place: the order of names is kept
        return fn

    return register


def register_lazy_attention(name: str, module: str) -> None:
    """Name a backend now and import ``module``, which registers it, on first use (e.g. Triton kernels: Triton
    reads ``TRITON_INTERPRET`` when first imported, so importing the model must not import it)."""
    register_attention(name)(lambda q, k, v, is_causal=True: get_attention(name)(q, k, v, is_causal))
    _LAZY_MODULES[name] = module


def get_attention(name: str) -> AttentionFn:
    """The backend called ``name`` (its module imported if lazy), or a ValueError listing the registered ones."""
    if name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; accepted: {', '.join(sorted(ATTENTION_BACKENDS))}"
        ) from None


def register_packed_attention(name: str) -> Callable[[PackedAttentionFn], PackedAttentionFn]:
    """Decorator: backend ``name`` also takes the input and the q, k, v weights (``get_packed_attention``)."""

    def register(fn: PackedAttentionFn) -> PackedAttentionFn:
        PACKED_ATTENTION[name] = fn
        return fn

    return register


def get_packed_attention(name: str) -> PackedAttentionFn | None:
    """Backend ``name``'s attention of the input and the q, k, v weights (its module imported if lazy), or None."""
    get_attention(name)
    return PACKED_ATTENTION.get(name)
