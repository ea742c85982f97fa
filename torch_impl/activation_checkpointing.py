"""Activation checkpointing applied from outside the model: every k blocks, optionally nested.

``apply_activation_checkpointing(model, every=k)`` groups the Transformer blocks into segments of k and
recomputes each segment's activations in the backward from its input, so only the segment inputs stay saved
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": k ~ sqrt(L) balances the saved inputs
against the one segment being recomputed). ``nested=True`` also checkpoints each block inside a segment, so
the segment's recomputation itself keeps only block inputs (two levels: the peak is about L/k + k block
inputs plus one block's activations).

``keep_attention=True`` makes it selective (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"; torchtitan's op-level SAC keeps the same outputs): each block's attention output and
log-sum-exp are kept through the checkpoint, and the recomputation in the backward takes them instead of running
the attention forward again, so a checkpointed step recomputes the projections but not the quadratic core. The
kept bytes are the attention output (the model dtype, d_model a token) and the fp32 log-sum-exp (4 bytes a head
and token) of every block. Our FlashAttention (``flash_triton``) takes them (``kept_attention``); checkpoint's own
selective mode (``create_selective_checkpoint_contexts``) would see no op of a block compiled inside a checkpoint:
Dynamo runs a compiled region eagerly under a Python dispatch mode.

Like torchtitan's ``apply_ac``, this rewrites the model from outside: ``model.layers`` becomes a ModuleList of
segments, so parameter names gain a level (``layers.{s}.blocks.{j}....``); export or load weights before
applying it. Uses non-reentrant ``torch.utils.checkpoint``.

Not ``torch_impl.checkpoint``, which saves and loads training state; ``torch_impl.checkpointing`` is this
module's old name, kept as a re-export for one release.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointedSegment", "KeptAttention", "apply_activation_checkpointing", "kept_attention"]


class KeptAttention:
    """A segment's attention outputs, kept from its forward for its recomputation: ``take(key, compute)`` runs
    ``compute()`` while ``recording`` and keeps a copy of what it returns, and hands the copies back in the same
    order after, checking that each call's ``key`` (its inputs' shapes) is the one it was kept for. Copies (~0.1 ms
    a block at lm8b's 32,768 tokens), so that nothing the block does with its outputs afterwards reaches them."""

    def __init__(self) -> None:
        self._kept: deque[tuple[object, tuple[torch.Tensor, ...]]] = deque()
        self.recording = True

    def start(self) -> None:
        """A new forward: what an earlier one kept (a forward whose backward never ran) is dropped."""
        self._kept.clear()
        self.recording = True

    def take(self, key: object, compute: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        if self.recording:
            outputs = compute()
            self._kept.append((key, tuple(t.detach().clone() for t in outputs)))
            return outputs
        if not self._kept:
            raise RuntimeError("checkpoint recomputation called the attention more often than the forward did")
        kept_key, outputs = self._kept.popleft()
        if kept_key != key:
            raise RuntimeError(f"checkpoint recomputation called the attention with {key}, the forward with "
                               f"{kept_key}: the blocks must recompute what they computed")
        return outputs


KEEPS = ("flash_triton",)  # the attention backends that take kept outputs (``kept_attention``)
_ACTIVE: list[KeptAttention] = []  # the segment whose blocks run now (forward or recomputation), innermost last


def kept_attention() -> KeptAttention | None:
    """The running segment's ``KeptAttention``, or None where no segment keeps the attention (the attention
    computes as usual)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def _active(kept: KeptAttention | None) -> Iterator[None]:
    if kept is None:
        yield
        return
    _ACTIVE.append(kept)
    try:
        yield
    finally:
        _ACTIVE.pop()


class CheckpointedSegment(nn.Module):
    """k consecutive blocks whose activations are recomputed in the backward (each block too if nested)."""

    def __init__(self, blocks: list[nn.Module], nested: bool, keep_attention: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.nested = nested
        self.kept = KeptAttention() if keep_attention else None

    def _run(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        # in the forward and again in the backward's recomputation; without grad nothing is recomputed or kept
        with _active(self.kept if torch.is_grad_enabled() else None):
            for block in self.blocks:
                x = checkpoint(block, x, *args, use_reentrant=False) if self.nested else block(x, *args)
        return x

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        """x: the residual stream; args: what every block takes besides it (positions, RoPE tables)."""
        if self.kept is not None:
            self.kept.start()
        out = checkpoint(self._run, x, *args, use_reentrant=False)
        if self.kept is not None:
            self.kept.recording = False  # from here on the recomputation takes what the forward kept
        return out


def apply_activation_checkpointing(model: nn.Module, every: int, nested: bool = False,
                                   keep_attention: bool = False) -> nn.Module:
    """Replace ``model.layers`` by segments of ``every`` blocks (the last may be shorter); returns the model.
    ``keep_attention``: the segments keep their blocks' attention outputs for the recomputation (module doc)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("activation checkpointing needs a model with a ModuleList of blocks in .layers")
    if every < 1:
        raise ValueError(f"checkpoint every {every} blocks: must be >= 1")
    others = sorted({m.attention_name for m in model.modules() if hasattr(m, "attention_name")} - set(KEEPS))
    if keep_attention and others:
        raise ValueError(f"keeping the attention outputs through checkpoints needs an attention that takes them "
                         f"({', '.join(KEEPS)}); the model's is {', '.join(others)}")
    if keep_attention and nested:
        raise ValueError("keeping the attention outputs with nested checkpoints: each block would be recomputed "
                         "twice from what was kept once; use one of the two")
    blocks = list(layers)
    model.layers = type(layers)(CheckpointedSegment(blocks[i:i + every], nested, keep_attention)
                                 for i in range(0, len(blocks), every))
    return model
