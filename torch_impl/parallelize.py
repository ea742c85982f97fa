"""Turning a single-device model into a fast or a parallel one, from outside: one ``apply_*`` per technique.

The order is torchtitan's ``parallelize_llama``: activation checkpointing, then compilation, then the
data-parallel wrapper. The trainer and every benchmark call these, so a fix made here reaches all of them.

* ``apply_activation_checkpointing(model, every, nested)``: ``torch_impl.checkpointing``.
* ``apply_compile(model, cuda_graphs)``: regional compilation, ``torch.compile`` of each Transformer block in
  place (torchtitan's ``apply_compile``; PyTorch's "regional compilation" recipe). The blocks are identical, so
  one graph serves all of them: xl's 48 blocks compile in the time of one (seconds), where compiling the whole
  model as one graph took 87-169 s on an H100 (notes/train_step.md). The embedding, the final norm and the LM
  head stay eager (the e2e benchmark compiles its loss function on its own). ``cuda_graphs`` adds Inductor's
  CUDA graph trees (``mode="reduce-overhead"``): each block's forward and backward kernels are replayed as one
  graph, for steps whose host cannot launch kernels as fast as the device runs them (xl at 4 x 512).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_impl.checkpointing import apply_activation_checkpointing

__all__ = ["apply_activation_checkpointing", "apply_compile"]


def apply_compile(model: nn.Module, cuda_graphs: bool = False, options: dict | None = None) -> nn.Module:
    """``torch.compile`` every block of ``model.layers`` in place (``fullgraph``: a graph break is an error,
    not a silent slowdown), with CUDA graph trees if ``cuda_graphs`` and Inductor ``options`` (its config
    names, as ``torch.compile`` takes them); parameter names do not change. Returns the model."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("regional compilation needs a model with a ModuleList of blocks in .layers")
    # torch.compile takes a mode or options, not both: reduce-overhead is the option triton.cudagraphs
    how = ({"options": {**options, "triton.cudagraphs": cuda_graphs}} if options
           else {"mode": "reduce-overhead" if cuda_graphs else None})
    for block in layers:
        block.compile(fullgraph=True, dynamic=False, **how)
    return model
