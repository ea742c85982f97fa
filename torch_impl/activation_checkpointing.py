"""Activation checkpointing applied from outside the model: every k blocks, optionally nested.

``apply_activation_checkpointing(model, every=k)`` groups the Transformer blocks into segments of k and
recomputes each segment's activations in the backward from its input, so only the segment inputs stay saved
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": k ~ sqrt(L) balances the saved inputs
against the one segment being recomputed). ``nested=True`` also checkpoints each block inside a segment, so
the segment's recomputation itself keeps only block inputs (two levels: the peak is about L/k + k block
inputs plus one block's activations).

Like torchtitan's ``apply_ac``, this rewrites the model from outside: ``model.layers`` becomes a ModuleList of
segments, so parameter names gain a level (``layers.{s}.blocks.{j}....``); export or load weights before
applying it. Uses non-reentrant ``torch.utils.checkpoint``.

Not ``torch_impl.checkpoint``, which saves and loads training state; ``torch_impl.checkpointing`` is this
module's old name, kept as a re-export for one release.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointedSegment", "apply_activation_checkpointing"]


class CheckpointedSegment(nn.Module):
    """k consecutive blocks whose activations are recomputed in the backward (each block too if nested)."""

    def __init__(self, blocks: list[nn.Module], nested: bool):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.nested = nested

    def _run(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, *args, use_reentrant=False) if self.nested else block(x, *args)
        return x

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        """x: the residual stream; args: what every block takes besides it (positions, RoPE tables)."""
        return checkpoint(self._run, x, *args, use_reentrant=False)


def apply_activation_checkpointing(model: nn.Module, every: int, nested: bool = False) -> nn.Module:
    """Replace ``model.layers`` by segments of ``every`` blocks (the last may be shorter); returns the model."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("activation checkpointing needs a model with a ModuleList of blocks in .layers")
    if every < 1:
        raise ValueError(f"checkpoint every {every} blocks: must be >= 1")
    blocks = list(layers)
    model.layers = type(layers)(CheckpointedSegment(blocks[i:i + every], nested)
                                 for i in range(0, len(blocks), every))
    return model
