"""Attention backends for the Flax model, by name: each maps q, k, v (B, T, H, D) -> (B, T, H, D), causal.

* ``naive`` — softmax(q k^T / sqrt(D) + causal mask) v written out: the (B, H, T, T) score matrix is
  materialized, the softmax runs in float32 and the weights are cast back to v's dtype for the last matmul.
  It mirrors ``torch_impl.attention.naive`` step by step, so it is the parity reference.
* ``dot_product`` — ``jax.nn.dot_product_attention(..., is_causal=True)`` with JAX's default implementation,
  which in JAX 0.10-0.11 is always XLA's (the scores are materialized; no fused kernel is picked on a GPU).
* ``dot_product_cudnn`` — the same with ``implementation="cudnn"``: cuDNN's fused flash attention, GPU only,
  bf16 / fp16 inputs (elsewhere JAX raises while tracing: "cuDNN is not detected").
* ``pallas_flash`` — the FlashAttention forward and backward JAX ships in Pallas
  (``jax.experimental.pallas.ops.gpu.attention.mha``, lowered through Triton), where the installed JAX still
  ships it: compiled on a GPU, run by the Pallas interpreter on other platforms
  (``jax.lax.platform_dependent`` picks per lowering platform), so CPU tests check the same kernel code.
  Its tiles need the sequence length to be a multiple of min(128, T) forward and of 32 backward. One
  device only for now: XLA cannot partition a compiled Pallas call over a sharded mesh (it asks for a
  ``shard_map``), so sharded runs use ``dot_product_cudnn``.

The layout is JAX's (B, T, H, D) (batch, sequence, heads, head dim), the one ``jax.nn.dot_product_attention``
takes, so no backend needs a transpose. ``TransformerLM(spec, attention=name)`` looks its backend up with
``get_attention``; a new kernel adds an entry to ``ATTENTION_BACKENDS``.

Caveat: causal masking is top-left aligned (query i sees keys 0..i), which equals bottom-right alignment
here because self-attention always has as many queries as keys.

References: Vaswani et al. 2017 (scaled dot-product attention); the JAX docs of
``jax.nn.dot_product_attention``; Dao 2023 (FlashAttention-2) and JAX's Pallas ``ops/gpu/attention.py``.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def causal_mask(n_queries: int, n_keys: int) -> jax.Array:
    """(n_queries, n_keys) bool, True where query i may attend key j (j <= i)."""
    return jnp.tril(jnp.ones((n_queries, n_keys), dtype=bool))


def naive_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention with the score matrix written out; q, k, v (B, T, H, D) -> (B, T, H, D)."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (B, H, T, T), compute dtype
    scores = scores.astype(jnp.float32)
    scores = jnp.where(causal_mask(q.shape[1], k.shape[1]), scores, -jnp.inf)  # mask broadcasts over (B, H)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # (B, H, T, T)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)  # (B, T, H, D)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention`` with ``is_causal=True``; q, k, v (B, T, H, D) -> (B, T, H, D)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def dot_product_cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """cuDNN's fused attention through ``jax.nn.dot_product_attention``; q, k, v (B, T, H, D), bf16 / fp16."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _pallas_mha():
    """JAX's Pallas FlashAttention ``mha``, or a ValueError where this JAX no longer ships it."""
    try:
        from jax.experimental.pallas.ops.gpu import attention
    except ImportError as err:
        raise ValueError(f"attention backend 'pallas_flash' needs jax.experimental.pallas.ops.gpu.attention, "
                         f"which this JAX ({jax.__version__}) does not ship: {err}") from None
    return attention.mha


def pallas_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Pallas FlashAttention, causal; q, k, v (B, T, H, D) -> (B, T, H, D). Compiled on GPUs, interpreted elsewhere."""
    mha = _pallas_mha()
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run(interpret: bool):
        return lambda q, k, v: mha(q, k, v, None, sm_scale=scale, causal=True, interpret=interpret)

    return jax.lax.platform_dependent(q, k, v, cuda=run(False), default=run(True))


ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "naive": naive_attention,
    "dot_product": dot_product_attention,
    "dot_product_cudnn": dot_product_cudnn_attention,
    "pallas_flash": pallas_flash_attention,
}
# Backends whose forward primitive returns its output as a residual of its own backward, which the remat
# policies save by primitive (``jax_impl.train``): the model does not also tag their output by name, which
# would make it a second residual of the same value (XLA copied it, 26 MB a block at xl 4 x 2,048).
KEEP_THEIR_OUTPUT = frozenset({"dot_product_cudnn"})


def get_attention(name: str) -> AttentionFn:
    """The backend called ``name``, or a ValueError listing the accepted ones."""
    try:
        backend = ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; accepted: {', '.join(sorted(ATTENTION_BACKENDS))}"
        ) from None
    if backend is pallas_flash_attention:
        _pallas_mha()  # fail at model construction, not inside a trace
    return backend
