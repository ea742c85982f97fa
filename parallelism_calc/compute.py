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


ATTENTION_PASSES = {"forward": 1.0, "backward": 2.5, "forward_backward": 3.5}


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool, pass_: str) -> float:
    """FLOPs of one attention pass over (batch, heads, seq_len, head_dim) q, k, v, as the CS336 and
    FlashAttention benchmarks count them (unlike ``forward_flops``, causal work is halved here):

    forward  = 2 products (S = Q K^T, O = P V) x 2 FLOPs per multiply-add x B H N^2 d, halved when causal;
    backward = 2.5 x forward: five products (S recomputed, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q);
    forward_backward = 3.5 x forward.
    """
    if pass_ not in ATTENTION_PASSES:
        raise ValueError(f"pass {pass_!r}; accepted: {', '.join(ATTENTION_PASSES)}")
    forward = 2 * 2 * batch * heads * seq_len * seq_len * head_dim  # two (N x N x d) products
    if causal:
        forward /= 2  # only the lower triangle of the N x N matrices is work
    return ATTENTION_PASSES[pass_] * forward
