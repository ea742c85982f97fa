"""Activation memory with checkpointing every k blocks, flat or nested, and the k that minimizes it.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"), as ``torch_impl.activation_checkpointing``
applies it: the L blocks are grouped into segments of k (the last may be shorter); the forward keeps only each
segment's input, and the backward recomputes one segment at a time. Per token, with
``a = activation_bytes_per_token(..., "full").per_layer_bytes`` (one block input, the residual stream),
``b = activation_bytes_per_token(..., "none").per_layer_bytes`` (one block's saved activations) and ``e`` the
extras outside the blocks (final norm, loss, token ids):

* flat:   peak = ceil(L / k) a + min(k, L) b + e
  (every segment input, plus the k blocks of the segment being recomputed, all saved at once);
* nested: peak = ceil(L / k) a + (min(k, L) - 1) a + b + e
  (the recomputed segment checkpoints each of its blocks again: its other k - 1 block inputs, plus the one
  block being recomputed; its first block's input is the segment input, already counted).

k = 1 (flat) is ``activation_bytes_per_token(..., "full")`` exactly; k >= L (flat) keeps everything, plus
the one segment input. Flat is minimized near k = sqrt(L a / b), nested near k = sqrt(L); since a block
keeps ~10-20x its input (b >> a), flat checkpointing is usually best at k = 1 or 2. An upper bound in the
same sense as the "full" policy: the loss's tensors are freed before the last segment is recomputed.
Batch-independent memory (weights, gradients, optimizer state) is not here: add
``parallelism_calc.memory.per_device_memory`` 's other terms for a device's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallelism_calc.memory import Precision, activation_bytes_per_token
from parallelism_calc.specs import ModelSpec


@dataclass(frozen=True)
class CheckpointedActivations:
    """Bytes per token saved at the peak of the backward under checkpointing every ``every`` blocks."""

    every: int
    nested: bool
    segment_inputs_bytes: int  # ceil(L / k) a
    recompute_bytes: int  # flat: min(k, L) b; nested: (min(k, L) - 1) a + b
    extra_bytes: int  # e
    total_bytes: int

    def for_tokens(self, tokens: int) -> int:
        return self.total_bytes * tokens


def checkpointed_activation_bytes(spec: ModelSpec, seq_len: int, precision: str | Precision = "fp32",
                                  every: int = 1, nested: bool = False,
                                  attention: str = "naive", fused_norm: bool = True) -> CheckpointedActivations:
    """Peak saved activations per token when checkpointing every ``every`` blocks (module docstring; ``fused_norm``
    as ``memory.activation_bytes_per_token`` takes it)."""
    if every < 1:
        raise ValueError(f"checkpoint every {every} blocks: must be >= 1")
    block = activation_bytes_per_token(spec, seq_len, precision, "none", attention, fused_norm=fused_norm)
    kept = activation_bytes_per_token(spec, seq_len, precision, "full", attention,
                                      fused_norm=fused_norm).per_layer_bytes  # a
    k = min(every, spec.n_layers)
    segments = math.ceil(spec.n_layers / every)
    inputs = segments * kept
    recompute = (k - 1) * kept + block.per_layer_bytes if nested else k * block.per_layer_bytes
    total = inputs + recompute + block.extra_bytes
    return CheckpointedActivations(every, nested, inputs, recompute, block.extra_bytes, total)


def best_checkpoint_every(spec: ModelSpec, seq_len: int, precision: str | Precision = "fp32",
                          nested: bool = False, attention: str = "naive") -> int:
    """The k in 1..L with the smallest ``checkpointed_activation_bytes`` (the smallest such k on ties)."""
    return min(range(1, spec.n_layers + 1),
               key=lambda k: (checkpointed_activation_bytes(spec, seq_len, precision, k, nested,
                                                            attention).total_bytes, k))
