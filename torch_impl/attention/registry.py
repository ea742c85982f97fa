"""The registry of attention backends: name -> function(q, k, v, is_causal) -> output."""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class AttentionFn(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
        """q: (..., n_queries, d), k and v: (..., n_keys, d) -> (..., n_queries, d)."""


ATTENTION_BACKENDS: dict[str, AttentionFn] = {}


def register_attention(name: str) -> Callable[[AttentionFn], AttentionFn]:
    """Decorator: make a function available as ``TransformerLM(..., attention=name)``."""

    def register(fn: AttentionFn) -> AttentionFn:
        if name in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {name!r} is already registered")
        ATTENTION_BACKENDS[name] = fn
        return fn

    return register


def get_attention(name: str) -> AttentionFn:
    """The backend called ``name``, or a ValueError listing the registered ones."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; accepted: {', '.join(sorted(ATTENTION_BACKENDS))}"
        ) from None
