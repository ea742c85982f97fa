"""FLOP counts of the models in ``specs``: every benchmark's TFLOP/s and MFU come from here.

Conventions (those of Megatron-LM and PaLM's MFU, Chowdhery et al. 2022, appendix B):
* a multiply-add is 2 FLOPs; only matrix products are counted (norms, softmax, RoPE are O(T d), negligible);
* causal attention is counted as full T x T score and value products, as MFU conventionally does (a kernel
  that skips masked tiles does about half that work, so its true utilization is higher than reported);
* the backward pass costs twice the forward (one product for input gradients, one for weight gradients),
  so a training step is 3 x forward.
"""

from __future__ import annotations

from parallelism_calc.specs import ModelSpec

MODES = ("forward", "forward_backward", "train_step")


def forward_flops(spec: ModelSpec, batch_size: int, seq_len: int) -> float:
    """FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens."""
    tokens = batch_size * seq_len
    d, ff = spec.d_model, spec.d_ff
    if spec.arch == "ffn_only":
        return spec.n_layers * 2 * tokens * (2 * d * ff)  # two d x ff matrices per block
    qkvo = 2 * tokens * 4 * d * d  # Q, K, V and output projections
    scores = 2 * batch_size * seq_len * seq_len * d  # Q K^T over all heads: H * T^2 * d_head = T^2 d
    values = 2 * batch_size * seq_len * seq_len * d  # softmax(S) V
    swiglu = 2 * tokens * 3 * d * ff  # W1, W3 (d -> ff) and W2 (ff -> d)
    lm_head = 2 * tokens * d * spec.vocab_size  # the embedding lookup is a gather: no FLOPs
    return spec.n_layers * (qkvo + scores + values + swiglu) + lm_head


def step_flops(spec: ModelSpec, batch_size: int, seq_len: int, mode: str) -> float:
    """FLOPs of one step: forward (1x), forward_backward or train_step (3x; the optimizer is O(params))."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; accepted: {', '.join(MODES)}")
    multiplier = 1 if mode == "forward" else 3  # backward = 2 x forward
    return multiplier * forward_flops(spec, batch_size, seq_len)
