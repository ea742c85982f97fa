"""Training memory of the models in ``specs``: state bytes per parameter, activations saved for backward,
and what one device holds under DDP, ZeRO-1/2/3, FSDP and FSDP x TP.

These are the predictions the measured peak memory of our runs is checked against, so the activation
accounting describes *our* PyTorch model (``torch_impl.model.TransformerLM``) tensor by tensor, not a
textbook Transformer. It was checked, tensor for tensor, against ``torch.autograd.graph.saved_tensors_hooks``
on the real model (``tests/test_calc_memory.py``): byte for byte on CPU in fp32, pure bf16 and bf16 autocast
once the batch-independent tensors listed below are added, and per token on an H200 (torch 2.11) under CUDA
autocast and pure bf16, for naive attention and for flash SDPA. Where our model differs from the
textbook count, the difference is real and named in ``ActivationBreakdown.terms``:

* RMSNorm computes in float32 whatever the model dtype (``x.to(promote(x.dtype, fp32))``): it saves its
  input in fp32 (the fp32 residual stream itself, or an fp32 copy of a bf16 one) and the fp32 rsqrt per token,
  as ``F.rms_norm``'s fused CUDA kernel does (CUDA memory snapshots of the xl and 2.7B steps, notes/fidelity.md,
  session 40); written out (the CPU's ``F.rms_norm``, ``fused_norm=False``) it also keeps the normalized value
  ``x * rsqrt(mean(x^2) + eps)`` before the gain (fp32, for the gain's gradient).
* Under autocast (fp32 parameters, bf16 compute) every product casts its input itself, so the fp32 output of
  a norm is not kept but each of its consumers keeps its own bf16 copy (the q, k, v product: 1, as
  ``torch_impl.qkv_projection`` makes them one; w1, w3: 2; lm_head: 1), and every matmul keeps a bf16 copy of
  its weight (``MemoryBreakdown.cast_weights``; autocast caches casts
  of leaf tensors only and our ``Linear`` multiplies by ``weight.T``, a view). On CUDA, autocast runs softmax
  in fp32, so naive attention keeps fp32 probabilities and the bf16 copy the value product casts.
  Stage-3 sharding (ZeRO-3 / FSDP) instead gathers the weights in the compute dtype and frees them after
  each unit's forward (our ``FSDP(compute_dtype=)``, torch FSDP2 with ``MixedPrecisionPolicy(param_dtype=)``):
  the cast is a no-op and no weight copy lives from forward to backward (``per_device_memory``).
* Not counted (batch-independent, O(T d_head + T^2) per layer): the RoPE cos/sin rows (four fp32 (T, d_head/2)
  tensors per layer), naive attention's (T, T) bool causal mask, the loss's scalar total weight. They are
  about 1% of the tiny test model at batch 2 and vanish against the per-token terms at real batch sizes.

References: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(16 bytes of mixed-precision state per parameter; stages 1-3); Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (per-layer activation terms, selective recomputation, TP);
Shoeybi et al. 2019 (Megatron-LM tensor parallelism); CS336 (Stanford, 2025) assignment 2, the XXL
FFN-only analysis. Byte counts are exact integers where they can be; sharded state is a float (P / N).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping

from parallelism_calc.specs import ModelSpec, ParallelSpec

FP32 = 4  # bytes of a float32: RMSNorm internals, log-softmax, log-sum-exp
INT64 = 8  # bytes of an int64: the token ids the embedding's backward keeps

CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("naive", "flash")
# How the loss is computed (torch_impl.linear_cross_entropy.LOSSES, the CLIs' --loss): "plain", the LM head's logits
# then the cross-entropy of their fp32 copy; "fused", the head and the loss chunked over tokens, never the logits.
LOSSES = ("plain", "fused")
# The fused loss's chunk: the largest power of two of tokens whose fp32 logits fit this (default_loss_chunk)
DEFAULT_LOSS_CHUNK_BYTES = 512 * 2**20
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp_tp")
# A mesh's sharding strategies (``parallelism_calc.scaling.STRATEGIES``, jax_impl.sharding's rules) as the strategies
# above, with their meshes: the batch goes over dp x fsdp; "tp" is DP x TP (the model's state split over tp only).
_MESH_STRATEGY = {"dp": "ddp", "fsdp": "fsdp", "tp": "fsdp_tp", "fsdp_tp": "fsdp_tp"}
GATHER_UNITS = ("block", "layer")  # what stage-3 sharding all-gathers at once (see per_device_memory)
# What a stage-3 gradient reduce-scatter in flight holds beside its rank-major input (see per_device_memory):
# "kept", its output piece until it is waited on, after the next one is launched, and lands in the sharded gradient
# (our FSDP's ``_land_grads``); "landed", nothing more: its output is cast into the sharded gradient as it is
# launched and the oldest input is released before the next launch (FSDP2's ``foreach_reduce``).
REDUCE_SCATTER_OUTPUTS = ("kept", "landed")
# How per_device_memory places the peak: "sum" adds every term as if all were alive at once (an upper bound);
# "timeline" takes the largest of the step's moments (forward's end, each block's backward, backward's end).
PEAK_MODELS = ("sum", "timeline")
# The libraries' workspaces of a PyTorch step on a Hopper GPU, as measured: two 32 MiB blocks (cuBLAS's, 32 MiB a
# handle and stream on sm90; which two handles or streams is not read from the snapshots), allocated through torch's
# caching allocator at the first matmuls and kept, in every allocator snapshot of our steps on H100 and H200
# (notes/fidelity.md, session 40): per_device_memory's ``workspaces`` for a PyTorch step on a GPU.
CUDA_LIBRARY_WORKSPACES = 2 * 32 * 2**20


# --------------------------------------------------------------------------------------------------------
# Precision policies


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each piece of training state, and bytes per activation element.

    ``param_bytes`` is also the dtype of the model itself, hence of its residual stream (an fp32 stream
    stays fp32 when bf16 branch outputs are added to it under autocast).
    """

    name: str
    param_bytes: int  # the weights the forward reads
    grad_bytes: int  # the gradients backward writes
    master_bytes: int  # a separate fp32 copy of the weights the optimizer updates (0: none)
    optimizer_bytes: int  # AdamW first and second moments
    activation_bytes: int  # the compute dtype of matmul inputs and outputs (autocast dtype)

    def __post_init__(self) -> None:
        for field in ("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes", "activation_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"Precision {self.name!r}: {field}={getattr(self, field)} must be >= 0")
        if self.param_bytes < 1 or self.activation_bytes < 1:
            raise ValueError(f"Precision {self.name!r}: param_bytes and activation_bytes must be >= 1")

    @property
    def autocast(self) -> bool:
        """True when compute runs in a narrower dtype than the weights (casts happen inside each op)."""
        return self.activation_bytes != self.param_bytes


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in [
        # Plain fp32 training: fp32 weights and grads, AdamW m + v in fp32, fp32 activations.
        Precision("fp32", param_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8, activation_bytes=4),
        # Our PyTorch bf16 default: fp32 weights, grads and AdamW; torch.autocast(bfloat16) activations.
        Precision("bf16_autocast", param_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8,
                  activation_bytes=2),
        # ZeRO paper's mixed precision: bf16 weights and grads; fp32 master weights, m and v.
        Precision("bf16_mixed", param_bytes=2, grad_bytes=2, master_bytes=4, optimizer_bytes=8,
                  activation_bytes=2),
    ]
}


def get_precision(precision: str | Precision) -> Precision:
    """A ``Precision`` itself, or the preset of that name (ValueError listing the presets)."""
    if isinstance(precision, Precision):
        return precision
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; accepted: {', '.join(PRECISIONS)}") from None


def state_bytes_per_param(precision: str | Precision) -> int:
    """Bytes of training state per parameter: param + grad + master + optimizer (16 for every preset:
    fp32 4 + 4 + 0 + 8; bf16_mixed 2 + 2 + 4 + 8, the ZeRO paper's "16 Psi")."""
    p = get_precision(precision)
    return p.param_bytes + p.grad_bytes + p.master_bytes + p.optimizer_bytes


def state_bytes(spec: ModelSpec, precision: str | Precision = "fp32") -> int:
    """Training state of the whole model: P x state_bytes_per_param (XXL: 16 P = 3,517,578,215,424 bytes)."""
    return spec.n_params() * state_bytes_per_param(precision)


# --------------------------------------------------------------------------------------------------------
# Activations saved for backward


@dataclass(frozen=True)
class ActivationBreakdown:
    """Bytes saved for backward, per token.

    ``total_bytes = n_layers * per_layer_bytes + recompute_bytes + extra_bytes``. ``terms`` names every
    contribution in bytes per token (``layer.*`` per layer, ``extra.*`` once, ``recompute`` once).
    """

    per_layer_bytes: int
    n_layers: int
    extra_bytes: int  # once per token outside the blocks: final norm, loss, token ids
    recompute_bytes: int  # full checkpointing: one block's activations, live while it is recomputed
    total_bytes: int
    terms: Mapping[str, int]

    def for_tokens(self, tokens: int) -> int:
        """Bytes saved for ``tokens`` tokens (batch x sequence)."""
        return self.total_bytes * tokens


def _check_choice(what: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"unknown {what} {value!r}; accepted: {', '.join(accepted)}")


def _transformer_block_terms(spec: ModelSpec, seq_len: int, precision: Precision, attention: str,
                             selective: bool, tp: int, compute_dtype_stream: bool = False,
                             fused_norm: bool = True, qkv_product: bool = True) -> dict[str, int]:
    """Bytes per token one ``TransformerBlock`` saves for backward (see ``activation_bytes_per_token``)."""
    d, f, h, p = spec.d_model, spec.d_ff, spec.n_heads, precision.activation_bytes
    # Consumers of each norm's output: the q, k, v product reads RMSNorm1's; w1, w3 read RMSNorm2's. In the model
    # dtype they share one saved tensor; under autocast each consuming product keeps its own cast copy.
    # A residual stream already in the compute dtype (compute_dtype_stream) gives norm outputs in it: shared too.
    norm_output_copies = (1 if qkv_product else 3) + 2 if precision.autocast and not compute_dtype_stream else 2
    terms = {
        # RMSNorm1 and RMSNorm2 inputs, in fp32 (the norm upcasts; replicated under TP).
        "layer.norm_inputs": 2 * d * FP32,
        # rsqrt(mean(x^2) + eps), one fp32 per token per norm.
        "layer.norm_rsqrt": 2 * FP32,
        # Norm outputs = inputs of q/k/v and of w1/w3, in p bytes (replicated: column-parallel inputs).
        "layer.norm_outputs": norm_output_copies * d * p,
        # q and k after RoPE and v (inputs of the attention core), split over heads by TP.
        "layer.qkv": 3 * d * p // tp,
        # Attention output, transposed back to (B, T, D): the input of output_proj (row-parallel).
        "layer.attn_out": d * p // tp,
        # SwiGLU: a = w1 x (SiLU's input), SiLU(a), b = w3 x (multiply), SiLU(a) * b (w2's input).
        "layer.ffn": 4 * f * p // tp,
    }
    if not fused_norm:  # the written-out formula also keeps x * rsqrt(...) before the gain, fp32, for its gradient
        terms["layer.norm_normalized"] = 2 * d * FP32
    if selective:  # Korthikanti et al.: the attention core is recomputed, keeping only q, k, v
        return terms
    if attention == "naive":
        # softmax probabilities, H x T per token (T = seq_len keys; causal entries are stored too).
        # CUDA autocast runs softmax in fp32 and the value product keeps its own bf16 cast: 4 + p bytes.
        prob_bytes = FP32 + p if precision.autocast else p
        terms["layer.attn_probs"] = h * seq_len * prob_bytes // tp
    else:
        # flash: the kernel keeps one fp32 log-sum-exp per head per token, and its output O, which is
        # output_proj's input above: the model lays q out as (B, T, H, d_head) and the kernels return O with
        # q's strides, so merging the heads is a view (a model rotating q as (B, H, T, d_head) keeps a copy).
        terms["layer.attn_lse"] = h * FP32 // tp
    return terms


def _compiled_block_terms(spec: ModelSpec, precision: Precision, tp: int) -> dict[str, int]:
    """Bytes per token one ``TransformerBlock`` compiled by Inductor saves for backward, flash attention, no
    checkpointing: ``torch.compile``'s partitioner keeps the block's input and recomputes the norms' fp32
    intermediates and SiLU from it and from what else it keeps. Measured with saved-tensor hooks (CPU, ``small``,
    fp32, bf16 autocast and bf16 weights: these terms to the byte, notes/fidelity.md)."""
    d, f, h, p = spec.d_model, spec.d_ff, spec.n_heads, precision.activation_bytes
    return {
        "layer.block_input": d * precision.param_bytes,  # the residual stream entering the block
        "layer.norm_rsqrt": 2 * FP32,
        "layer.norm_outputs": 2 * d * p,  # each norm's output once, in the compute dtype (replicated under TP)
        "layer.qkv": 3 * d * p // tp,
        "layer.attn_out": 2 * d * p // tp,  # the kernel's output (B, H, T, d_head) and its merged-heads copy
        "layer.attn_lse": h * FP32 // tp,
        "layer.ffn": 3 * f * p // tp,  # w1 x, w3 x and SiLU(w1 x) * w3 x
    }


def _transformer_extra_terms(spec: ModelSpec, precision: Precision, loss: str = "plain",
                             fused_norm: bool = True) -> dict[str, int]:
    """Bytes per token saved once outside the blocks (no vocabulary-parallel loss: replicated under TP)."""
    d, p = spec.d_model, precision.activation_bytes
    # plain: cross_entropy on logits.float() keeps the log-softmax of the logits in fp32, V per token;
    # fused (torch_impl.linear_cross_entropy): only the fp32 log-sum-exp, one per token.
    loss_term = {"extra.loss_log_softmax": spec.vocab_size * FP32} if loss == "plain" else {"extra.loss_lse": FP32}
    return {
        # Final RMSNorm: fp32 input (and, written out, the fp32 normalized value), fp32 rsqrt, and its output
        # (lm_head's input) in p (under autocast the LM head's bf16 copy of it, made by F.linear or the fused loss).
        "extra.final_norm": (1 if fused_norm else 2) * d * FP32 + FP32 + d * p,
        **loss_term,
        # The embedding's backward keeps the int64 token ids.
        "extra.token_ids": INT64,
    }


def default_loss_chunk(vocab_size: int, chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES) -> int:
    """Tokens per chunk of the fused loss: the largest power of two c with c x V x 4 bytes (one chunk's fp32
    logits) <= ``chunk_bytes``, at least 1 (lm8b, V = 151,936: 512 tokens, 311 MB). ``torch_impl.
    linear_cross_entropy`` chunks by it."""
    if vocab_size < 1 or chunk_bytes < 1:
        raise ValueError(f"default_loss_chunk: vocab_size={vocab_size} and chunk_bytes={chunk_bytes} must be >= 1")
    fits = max(1, chunk_bytes // (FP32 * vocab_size))
    return 1 << (fits.bit_length() - 1)


@dataclass(frozen=True)
class LossBuffers:
    """Bytes the loss holds for a moment beyond what it saves for backward (``activation_bytes_per_token``'s
    extras), for ``tokens`` tokens on one device: at its forward and at its backward."""

    forward: float
    backward: float

    @property
    def peak(self) -> float:
        return max(self.forward, self.backward)


def loss_buffer_bytes(spec: ModelSpec, tokens: int, precision: str | Precision = "bf16_autocast",
                      loss: str = "plain", chunk: int | None = None) -> LossBuffers:
    """The loss's working buffers (notes/train_step.md, "The fused LM head + cross-entropy"), N = ``tokens``,
    V = vocab, d = d_model, p = precision.activation_bytes (the logits' dtype), w = 4 if p < 4 else 0 (the fp32
    copy the loss makes of narrower logits):

    * plain, eager: forward the logits and their fp32 copy beside the saved log-softmax, N V (p + w); backward
      nll's dense gradient and log-softmax's input gradient beside it, N V (4 + 4);
    * fused, chunk c = min(``chunk`` or ``default_loss_chunk(V)``, N): forward a chunk's fp32 logits and
      logsumexp's fp32 temporary, c V (4 + 4) (c V (p + 4) while widening, no more); backward a chunk's fp32 logits
      (softmax minus one-hot formed in place) and G in p, c V (4 + w p / 4), plus dW's fp32 accumulator V d 4, alive
      for the whole loop (CUDA: cuBLAS writes the fp32 product; a CPU widens G too, c V 4 more, not counted).

    Not under TP (no vocabulary-parallel loss). ``spec`` must be a transformer."""
    _check_choice("loss", loss, LOSSES)
    if spec.arch != "transformer":
        raise ValueError(f"loss buffers: {spec.name!r} is {spec.arch!r}, it has no LM head")
    if tokens < 1 or chunk is not None and chunk < 1:
        raise ValueError(f"tokens={tokens} and chunk={chunk} must be >= 1")
    p, v, d = get_precision(precision).activation_bytes, spec.vocab_size, spec.d_model
    wide = FP32 if p < FP32 else 0  # the fp32 copy of narrower logits (none when they are fp32 already)
    if loss == "plain":
        return LossBuffers(forward=float(tokens * v * (p + wide)), backward=float(tokens * v * (FP32 + FP32)))
    c = min(chunk or default_loss_chunk(v), tokens)
    return LossBuffers(forward=float(c * v * (FP32 + FP32)),
                       backward=float(c * v * (FP32 + (p if wide else 0)) + v * d * FP32))


def activation_bytes_per_token(spec: ModelSpec, seq_len: int, precision: str | Precision = "fp32",
                               checkpointing: str = "none", attention: str = "naive",
                               tp: int = 1, compiled: bool = False,
                               compute_dtype_stream: bool = False, loss: str = "plain",
                               fused_norm: bool = True, qkv_product: bool = True) -> ActivationBreakdown:
    """Bytes saved for backward per token of a forward over sequences of ``seq_len`` tokens.

    Transformer (``spec.arch == "transformer"``), per layer per token, p = precision.activation_bytes,
    D = d_model, F = d_ff, H = n_heads, T = seq_len (each term is named in ``terms``):

    * two RMSNorms, each: fp32 input (4 D) and fp32 rsqrt (4), as the fused kernel of ``F.rms_norm`` on CUDA
      keeps them (``fused_norm``; the formula written out, as on the CPU or in JAX, also keeps the fp32 normalized
      value before the gain, 4 D: ``fused_norm=False``); each norm's output in p bytes (D p; under autocast one
      cast copy per consuming product: D p + 2 D p, the q, k, v product one (``qkv_product``; three products,
      ``qkv_product=False`` as our model had them before torch_impl.qkv_projection: 3 D p + 2 D p));
    * q and k after RoPE, v, and the attention output (output_proj's input): 4 D p;
    * SwiGLU: w1 output a, SiLU(a), w3 output b, SiLU(a) * b: 4 F p;
    * attention core: "naive" keeps the softmax probabilities, H T elements per token, p bytes each
      (4 + p under autocast: CUDA autocast's fp32 softmax plus the value product's cast); "flash" keeps
      instead the fp32 log-sum-exp (4 H); its output O is output_proj's input (q is laid out as
      (B, T, H, d_head) and O follows it, so merging heads is a view).

    Once per token outside the blocks: the final RMSNorm (4 D + 4, + 4 D unfused; output D p), the fp32
    log-softmax of the logits for the loss (4 V; ``loss="fused"``: only its fp32 log-sum-exp, 4) and the int64
    token ids (8). What the loss holds for a moment on top of that: ``loss_buffer_bytes``.

    Checkpointing: "none"; "selective" (Korthikanti et al. 2022: the attention core is recomputed, so
    the probabilities, or flash's O and LSE, are not kept); "full" (each block recomputed from its input:
    keep its input, D x param_bytes (the residual stream's dtype), per layer, plus one block's full
    activations while it is recomputed; an upper bound, since the loss's tensors are freed before the last
    block is recomputed).

    Tensor parallelism ``tp`` (Megatron-style, no sequence parallelism): norm inputs, outputs and stats
    stay replicated; q, k, v, the attention output, the 4 F terms and the attention core's tensors are
    divided by tp; the extras are replicated (no vocabulary-parallel loss). tp must divide H and F.

    FFN-only (``arch == "ffn_only"``, blocks x -> x W1 -> (x W1) W2, no nonlinearity): each block keeps the
    inputs of its two linears, (D + F / tp) p per token; "full" keeps D p per block plus one block;
    "selective" equals "none" (no attention); no extras.

    ``compiled``: the blocks compiled by ``torch.compile`` (Inductor), which saves less: per layer per token, w =
    param_bytes (the residual stream's dtype), w D + 2 x 4 + 2 D p + 5 D p / tp + 4 H / tp + 3 F p / tp
    (``_compiled_block_terms``; 0.64x the eager count for xl under bf16 autocast). Measured for flash attention
    without checkpointing only; the extras outside the blocks stay as above.

    ``compute_dtype_stream``: the residual stream in the compute dtype under autocast (stage-3 wrappers that gather
    the embedding in it, ``per_device_memory``): each norm's output is one shared tensor, 2 D p, not 5 D p (eager
    count; the rest, autocast's fp32 softmax included, unchanged).

    Not counted: batch-independent tensors (RoPE cos/sin rows, the (T, T) causal mask, scalars).
    """
    prec = get_precision(precision)
    _check_choice("checkpointing", checkpointing, CHECKPOINTING)
    _check_choice("attention", attention, ATTENTION)
    _check_choice("loss", loss, LOSSES)
    if seq_len < 1 or tp < 1:
        raise ValueError(f"seq_len={seq_len} and tp={tp} must be >= 1")
    if compiled and (spec.arch != "transformer" or attention != "flash" or checkpointing != "none"):
        raise ValueError(f"compiled=True: measured for a transformer with flash attention and no checkpointing; got "
                         f"arch={spec.arch!r}, attention={attention!r}, checkpointing={checkpointing!r}")
    d, f, p = spec.d_model, spec.d_ff, prec.activation_bytes
    if spec.arch == "ffn_only":
        if f % tp:
            raise ValueError(f"tp={tp} must divide d_ff={f} of {spec.name!r}")
        block = {"layer.linear_inputs": d * p + f * p // tp}  # inputs of W1 (D, replicated) and W2 (F / tp)
        extra: dict[str, int] = {}
    else:
        if spec.n_heads % tp or f % tp:
            raise ValueError(f"tp={tp} must divide n_heads={spec.n_heads} and d_ff={f} of {spec.name!r}")
        block = (_compiled_block_terms(spec, prec, tp) if compiled else
                 _transformer_block_terms(spec, seq_len, prec, attention, checkpointing == "selective", tp,
                                          compute_dtype_stream, fused_norm, qkv_product))
        extra = _transformer_extra_terms(spec, prec, loss, fused_norm)
    block_bytes = sum(block.values())
    if checkpointing == "full":
        # Only each block's input (the residual stream, model dtype; FFN-only: p) survives the forward.
        kept = d * (prec.param_bytes if spec.arch == "transformer" else p)
        layer_terms, recompute = {"layer.block_input": kept}, block_bytes
    else:
        layer_terms, recompute = block, 0
    per_layer = sum(layer_terms.values())
    extra_bytes = sum(extra.values())
    terms = {**layer_terms, **extra, **({"recompute": recompute} if recompute else {})}
    total = spec.n_layers * per_layer + recompute + extra_bytes
    return ActivationBreakdown(per_layer, spec.n_layers, extra_bytes, recompute, total, terms)


# --------------------------------------------------------------------------------------------------------
# Per-device memory under a data-parallel / sharding strategy


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one device holds at the peak of a training step (``total`` is the sum of the parts)."""

    strategy: str
    params: float
    grads: float
    master: float
    optimizer: float
    activations: float
    gathered: float  # ZeRO-3 / FSDP: all-gathered full parameters alive at once, in the compute dtype
    cast_weights: float  # autocast under ddp / zero1 / zero2: each linear's bf16 weight copy, saved for backward
    total: float
    formulas: Mapping[str, str]
    # Where the peak falls: "sum" (every term at once) or, for peak_model="timeline", the moment of the step
    # ("forward's end", "backward, block i" (0 = the first block), "backward's end"; see step_peak_memory).
    peak_at: str = "sum"
    buckets: float = 0.0  # DDP's persistent flat gradient buffers (gradient_buckets bytes a parameter)
    # Stage 3: the gradient reduce-scatters in flight during the backward, their inputs and kept output pieces
    # (pending_reduce_scatters; see per_device_memory); the timeline's value is the peak moment's
    reduce_scatter: float = 0.0
    # The loss's working buffers (loss_buffer_bytes: the fused loss's; the plain loss's in the timeline)
    loss_buffers: float = 0.0
    # The device's library workspaces, held from the first matmul on (``workspaces``; see per_device_memory)
    workspaces: float = 0.0


def _mesh(strategy: str, n_devices: int | ParallelSpec) -> ParallelSpec:
    """The mesh a strategy runs on: an int N means dp=N for "ddp", fsdp=N for the sharded strategies."""
    if isinstance(n_devices, ParallelSpec):
        if not n_devices.is_resolved:
            raise ValueError(f"ParallelSpec {n_devices.degrees()} has a -1 degree: resolve it first")
        if n_devices.tp != 1 and strategy != "fsdp_tp":
            raise ValueError(f"strategy {strategy!r} has no tensor parallelism (tp={n_devices.tp}); use 'fsdp_tp'")
        return n_devices
    if n_devices < 1:
        raise ValueError(f"n_devices={n_devices} must be >= 1")
    if strategy == "fsdp_tp":
        raise ValueError("strategy 'fsdp_tp' needs a ParallelSpec(dp=, fsdp=, tp=), not a device count")
    return ParallelSpec(dp=n_devices) if strategy == "ddp" else ParallelSpec(fsdp=n_devices)


def _gather_working_set(spec: ModelSpec, gather_unit: str, reshard_root: bool) -> tuple[int, int]:
    """Parameters of stage-3 sharding's gathered working set: (resident, largest unit).

    ``resident``: parameters that stay gathered for the whole step (the root when it is not resharded after
    forward: embedding V D + final norm D + LM head D V). ``largest unit``: the largest unit the window of
    (1 + prefetch) units in flight is made of (see ``per_device_memory``).
    """
    d, f = spec.d_model, spec.d_ff
    if spec.arch == "ffn_only":  # blocks D -> F -> D, no embedding, norm or LM head: no root
        return 0, (2 * d * f if gather_unit == "block" else d * f)
    root = 2 * spec.vocab_size * d + d  # embedding + final norm gain + untied LM head
    if gather_unit == "block":
        block = spec.n_params_per_layer()  # 4 D^2 + 3 D F + 2 D (the norm gains go with their block)
        # Resharded root: the embedding and the LM head are gathered as units of their own, V D each.
        return (0, max(block, spec.vocab_size * d)) if reshard_root else (root, block)
    # "layer": each weight matrix is a unit; a block's largest is W1 / W2 / W3 (D F) or, if F < D, a D x D.
    matrix = d * max(d, f)
    return (0, max(matrix, spec.vocab_size * d)) if reshard_root else (root, matrix)


@dataclass(frozen=True)
class ReduceScatterQueue:
    """Stage 3's gradient reduce-scatters over the backward (``per_device_memory``'s ``pending_reduce_scatters``).

    ``units``: the parameters of each unit in the order the backward reduce-scatters them (our FSDP: the LM head,
    blocks L-1 .. 0, the embedding; FSDP2: blocks L-1 .. 0, then its root); block L-1's first unit is at
    ``first_block``, each block has ``units_per_block``. At most ``in_flight`` k stay in flight between launches;
    launching another holds ``at_launch`` (k + 1 until the oldest is waited on; k if the oldest is released first).
    Each holds ``held_bytes`` a parameter (its rank-major input, u p, and a kept output piece, u p / N_shard) and
    keeps ``unlanded_bytes`` a parameter of the sharded gradient unwritten until it lands (a kept piece's; 0 when
    the output lands at launch).
    """

    in_flight: int
    at_launch: int
    units: tuple[int, ...]
    first_block: int
    units_per_block: int
    held_bytes: float
    unlanded_bytes: float

    def after(self, done: int, launching: bool = False) -> tuple[float, float]:
        """(bytes held in flight, sharded-gradient bytes not landed yet) once the first ``done`` units are
        launched: the last k of them; ``launching``: the moment the ``done``-th is launched, the last
        ``at_launch``."""
        window = sum(self.units[max(0, done - (self.at_launch if launching else self.in_flight)):done])
        return window * self.held_bytes, window * self.unlanded_bytes

    def most_held(self) -> float:
        """The most bytes ever held in flight (``at_launch`` consecutive units): the "sum" model's."""
        return max(self.after(done, True)[0] for done in range(1, len(self.units) + 1))


def reduce_scatter_queue(spec: ModelSpec, pending_reduce_scatters: int, n_shard: int,
                         precision: str | Precision = "bf16_autocast", gather_unit: str = "block",
                         reshard_root: bool = True, output: str = "kept", tp: int = 1,
                         grad_bytes_per_param: float | None = None) -> ReduceScatterQueue:
    """Stage 3's gradient reduce-scatters as ``per_device_memory`` places them (its ``pending_reduce_scatters`` k and
    ``reduce_scatter_output``), p = ``precision.activation_bytes``:

        held a parameter:      p (1 / tp + 1 / N_shard)  (kept: input and output piece)    p / tp  (landed)
        unlanded a parameter:  grad_bytes / N_shard      (kept; ``grad_bytes_per_param``)   0       (landed)
        at a launch:           k + 1 units               (kept: the oldest waited after)    max(k, 1)  (landed)

    The units are ``_gather_working_set``'s in the backward's order (see ``ReduceScatterQueue``); "layer" counts each
    of a block's weight matrices (7; FFN-only 2) as its largest, D max(D, F), an upper bound as the window's."""
    _check_choice("gather_unit", gather_unit, GATHER_UNITS)
    _check_choice("reduce_scatter_output", output, REDUCE_SCATTER_OUTPUTS)
    if pending_reduce_scatters < 0 or n_shard < 1 or tp < 1:
        raise ValueError(f"pending_reduce_scatters={pending_reduce_scatters} >= 0, n_shard={n_shard} and tp={tp} >= 1")
    prec, kept, in_flight = get_precision(precision), output == "kept", pending_reduce_scatters
    at_launch = in_flight + 1 if kept else max(in_flight, 1)
    held_bytes = prec.activation_bytes * (1 / tp + (1 / n_shard if kept else 0))  # N_shard counts tp already
    unlanded_bytes = (prec.grad_bytes / n_shard if grad_bytes_per_param is None else grad_bytes_per_param) if kept \
        else 0.0
    d, f = spec.d_model, spec.d_ff
    per_block = 1 if gather_unit == "block" else (2 if spec.arch == "ffn_only" else 7)
    unit = spec.n_params_per_layer() if gather_unit == "block" else d * max(d, f)
    blocks = (unit,) * (per_block * spec.n_layers)
    if spec.arch == "ffn_only":  # no embedding, norm or LM head
        return ReduceScatterQueue(in_flight, at_launch, blocks, 0, per_block, held_bytes, unlanded_bytes)
    vd = spec.vocab_size * d
    # Resharded root: the LM head's unit right after the loss, the embedding's last; else the root (embedding, final
    # norm, LM head) reduce-scattered at the end, with the root module's backward.
    head, last = ((vd,), (vd,)) if reshard_root else ((), (2 * vd + d,))
    return ReduceScatterQueue(in_flight, at_launch, head + blocks + last, len(head), per_block, held_bytes,
                              unlanded_bytes)


def _norm_gains(spec: ModelSpec) -> int:
    """Parameters of the RMSNorm gains: two per block and the final norm, D each (none in FFN-only models)."""
    return 0 if spec.arch == "ffn_only" else (2 * spec.n_layers + 1) * spec.d_model


def _cast_params(spec: ModelSpec) -> int:
    """Parameters of the matmul weights autocast copies: all but the embedding table and the norm gains."""
    if spec.arch == "ffn_only":
        return spec.n_params()
    return spec.n_params() - spec.vocab_size * spec.d_model - _norm_gains(spec)


def mesh_memory_strategy(mesh_strategy: str, dp: int, fsdp: int, tp: int) -> tuple[str, ParallelSpec]:
    """(the ``STRATEGIES`` name, its ``ParallelSpec``) for ``per_device_memory`` of a dp x fsdp x tp mesh sharded by
    ``mesh_strategy`` (``parallelism_calc.scaling.STRATEGIES``): "dp" is "ddp" over dp x fsdp ranks, "fsdp" is
    "fsdp" over fsdp (dp replicating), "tp" is "fsdp_tp" with fsdp = 1 (dp x fsdp data ranks), "fsdp_tp" itself.
    ValueError for "dp" or "fsdp" on a mesh with tp > 1 (the tp axis replicates the work: not modelled)."""
    if mesh_strategy not in _MESH_STRATEGY:
        raise ValueError(f"mesh strategy {mesh_strategy!r}; accepted: {', '.join(_MESH_STRATEGY)}")
    if mesh_strategy in ("dp", "fsdp") and tp > 1:
        raise ValueError(f"strategy {mesh_strategy!r} with tp={tp} replicates work; not modelled")
    parallel = {"dp": ParallelSpec(dp=dp * fsdp), "fsdp": ParallelSpec(dp=dp, fsdp=fsdp),
                "tp": ParallelSpec(dp=dp * fsdp, tp=tp), "fsdp_tp": ParallelSpec(dp=dp, fsdp=fsdp, tp=tp)}
    return _MESH_STRATEGY[mesh_strategy], parallel[mesh_strategy]


def per_device_memory(spec: ModelSpec, strategy: str, n_devices: int | ParallelSpec, batch_tokens: int,
                      seq_len: int, precision: str | Precision = "bf16_autocast", checkpointing: str = "none",
                      attention: str = "naive", prefetch_layers: int = 1, gather_unit: str = "block",
                      reshard_root: bool = True, peak_model: str = "sum", checkpoint_every: int | None = None,
                      nested_checkpoint: bool = False, gradient_buckets: int = 0,
                      compiled: bool = False, pending_reduce_scatters: int | None = None,
                      compute_dtype_stream: bool = False, loss: str = "plain",
                      loss_chunk: int | None = None, kept_attention: bool = False,
                      fused_norm: bool = True, compiled_loss: bool = False,
                      workspaces: float = 0.0, reduce_scatter_output: str = "kept",
                      grad_accum: int = 1, qkv_product: bool = True) -> MemoryBreakdown:
    """Bytes per device of a training step with AdamW (ZeRO paper, Rajbhandari et al. 2020).

    P = spec.n_params(); per-parameter bytes from ``precision``; N_shard = the sharding degree.

    * "ddp": everything replicated: P (param + grad + master + optimizer) bytes;
    * "zero1": optimizer state, fp32 master included, sharded: (master + optimizer) / N_shard;
    * "zero2": gradients sharded too; "zero3": parameters too, plus the all-gathered working set;
    * "fsdp": the same accounting as "zero3" (FSDP is ZeRO-3 by another name);
    * "fsdp_tp": state sharded over fsdp x tp, except the norm gains G = (2 L + 1) D, which have no TP
      dimension (Megatron replicates them over tp) and are split over fsdp only: (P - G) / (fsdp tp) +
      G / fsdp per byte of state; activations with the TP split of ``activation_bytes_per_token``; the
      gathered working set divided by tp.

    ``n_devices``: an int N means dp=N for "ddp" and fsdp=N otherwise; a ``ParallelSpec`` gives
    N_shard = fsdp (x tp for "fsdp_tp"), its dp axis replicating (HSDP); "fsdp_tp" needs one, the others
    need tp=1. Data-parallel ranks = dp x fsdp; each holds the activations of batch_tokens / (dp x fsdp)
    tokens (``batch_tokens`` is the global batch, batch x seq_len; it must divide evenly).

    Gathered working set (zero3, fsdp, fsdp_tp), with reshard-after-forward semantics: each unit is
    all-gathered in the compute dtype (``precision.activation_bytes``: bf16 under autocast, as our
    ``FSDP(compute_dtype=bfloat16)`` and FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16)`` do), freed
    after its forward and gathered again for its backward; at most the unit in use plus ``prefetch_layers``
    units gathered ahead are alive:

        gathered = (resident + (1 + prefetch_layers) x largest unit) x activation_bytes / tp

    ``gather_unit`` "block" (FSDP2 ``fully_shard`` per block, ZeRO-3 by block): a unit is a block,
    4 D^2 + 3 D F + 2 D parameters, or the V x D embedding or LM head; "layer" (our ``FSDP``: every Linear /
    Embedding weight on its own): a unit is one weight matrix, the largest being max(V D, D F, D^2).
    FFN-only: a block is 2 D F, a layer D F. ``reshard_root=False`` (FSDP2's root, ``fully_shard(model)``
    over per-block units, is not resharded after forward): the embedding, final norm and LM head,
    resident = 2 V D + D, stay gathered from the forward to the end of the backward, and the window holds
    the blocks' units only. An upper bound: the window's units need not all be the largest (our FSDP on
    ``tiny``: the LM head + two D F matrices at most, 0.56 x the bound). Each unit's own shard is also
    counted in ``params`` (a 1 / N_shard overcount).

    Autocast (``precision.autocast``) under ddp, zero1, zero2: every linear keeps a bf16 copy of its weight
    for backward; the copies of all layers live from forward to backward: ``cast_weights`` =
    (P - V D - norm gains) x activation_bytes / tp. Stage 3 gathers in bf16 already (the cast is a no-op)
    and frees the gathered weights after each unit's forward: ``cast_weights`` = 0. (A stage-3 wrapper that
    gathered fp32 under autocast would keep those copies too: not modelled.)

    ``compiled``: the blocks compiled by Inductor, which saves fewer activations (``activation_bytes_per_token``).

    ``gradient_buckets``: bytes a parameter of flat gradient buffers kept from step to step, replicated at stages 0
    and 1: bucketed DDP's and torch DDP's all-reduce buckets hold every gradient in the dtype it travels in (4 for
    fp32 gradients, 2 sent in bf16); DDP that reduces each gradient in place holds none (0, the default). At stage 2
    they are sharded like the gradients: ``torch_impl.distributed.ZeRO2`` keeps each rank's slice of the averaged
    gradient in fp32 (4) and, unless the gradients travel in fp32, the slice its reduce-scatter lands in (2 for
    bf16). ``buckets`` = P x gradient_buckets (/ N_shard at stage 2), alive throughout the step.

    Communication buffers of the data-parallel wrappers (tests/test_calc_memory.py holds small cases by hand):

    * ``gradient_buckets`` G_b (above) is also where torch DDP's ``bf16_compress_hook`` goes: its fp32 buckets (4)
      plus the bf16 copy it compresses each bucket into (2; ``torch.distributed.algorithms.ddp_comm_hooks.
      default_hooks.bf16_compress_hook``: ``bucket.buffer().to(torch.bfloat16)``, freed only once its all-reduce
      has run on NCCL's stream, the allocator's ``record_stream``), counted from step to step: G_b = 6
      (``analysis.data_parallel.memory_terms``). Checked against one reserved-peak record (the copies come from
      segments the CUDA graph pool's freed activations cannot give), where it brings 0.86 to 0.93, as the same
      run without the hook (notes/fidelity.md, session 23).
    * ``pending_reduce_scatters`` k (stage 3; None: not modelled, 0 and up: k reduce-scatters in flight): once a
      unit's backward is done its full-size gradient (u p, p = activation_bytes: the gradients are reduced in the
      compute dtype) is copied into a rank-major reduce-scatter input (u p) and launched, and up to k reduce-scatters
      stay in flight, each holding its input and, with ``reduce_scatter_output="kept"``, its output piece
      (u p / N_shard), landed in the sharded gradient (``grads``) only when waited on; "landed": the output is cast
      into the sharded gradient as the reduce-scatter is launched and the input alone is held. A unit in flight:

          r(u) = u p (1 / tp + 1 / N_shard)  (kept)        r(u) = u p / tp  (landed)

      (N_shard counts tp already: the output piece is u p / N_shard; the old formula divided it by tp again.)

      The units go in the backward's order (``ReduceScatterQueue``: the LM head's first when the root is resharded,
      the blocks', the embedding's or the root's last; each the size it has, "layer" a block's matrices at the
      largest). ``peak_model="timeline"`` places them: at block i's backward (its activations all alive, its weights
      gathered) the last k units launched before it are in flight, R_i = sum of their r(u), their kept pieces not
      yet in the gradients written so far; at its reduce-scatter (its activations freed, its gradient where its
      gathered weights were) one more, k + 1 units (landed: the oldest released first, max(k, 1)); at the backward's
      end
      the last units launched (``finish_gradient_synchronization`` lands ours). So the k units in flight coexist with
      all of a block's activations only from block L - 1 - k on: the peak is at block L - 1 (nothing but the LM head
      in flight) or at block L - 1 - k, whichever the activations a block frees (T b) and the buffers a unit holds
      (r(u), less its sharded gradient when kept) make larger. "sum" adds the most ever in flight (the largest run
      of units held at a launch) to the total. Our ``FSDP``: k = ``MAX_PENDING_REDUCE_SCATTERS`` = 2, kept
      (torch_impl/distributed/fsdp.py, ``_reduce_scatter_grads``: the unit's gradients copied rank-major into
      ``flat``, its ``piece``, ``_pending_grads``, ``_land_grads``); FSDP2: k = 1, landed
      (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, ``foreach_reduce``: ``reduce_scatter_input``,
      copied from the unsharded gradients, its output cast by ``_to_dtype_if_needed``, and the previous group's
      ``reduce_scatter_state``, dropped at the next group's post-backward). CUDA allocator snapshots of both at 2.7B
      4 x 512 on 2 H200s (notes/fidelity.md, session 42 (helper)) hold exactly that at their peaks: ours at block
      L - 3 (two blocks' ``flat`` and ``piece``, no unsharded gradient of the unit in use), FSDP2 at block L - 2
      (one ``reduce_scatter_input``). Not counted: the gradients flowing between a block's nodes (activation
      gradients and the unit's weight gradients as they are made, 0.2 GiB there), as for one process. (Before:
      u p (1 + (k + 1) (1 + 1 / N_shard)) / tp at every backward moment, the largest unit's unsharded gradient and
      k + 1 inputs and pieces beside all of block L - 1's activations, where only the LM head's is in flight: 0.87
      and 1.0 GiB too much at 2.7B 4 x 512 on 4 and 2 ranks.)
    * ``compute_dtype_stream``: the stage-3 wrappers gather the embedding in the compute dtype too (our
      ``FSDP(compute_dtype=bfloat16)``, FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16)``), so under autocast
      the residual stream, hence each RMSNorm's output (``.to(x.dtype)``), is already bf16: the q, k, v and w1, w3
      linears share it instead of casting a copy each, 2 D p a layer per token instead of 3 D p (5 D p with three
      q, k, v products)
      (``activation_bytes_per_token(compute_dtype_stream=True)``; the norms' fp32 internals and autocast's fp32
      softmax are unchanged). Off for the JAX meshes, whose FSDP rows this was not checked against.

    ``fused_norm``: each RMSNorm keeps its fp32 input and rsqrt, as ``F.rms_norm``'s fused CUDA kernel does (the
    default: the torch step on a GPU; checked by CUDA memory snapshots, notes/fidelity.md, session 40); False: the
    formula written out keeps its normalized value too (the CPU's ``F.rms_norm``, the JAX model's RMSNorm).
    ``qkv_product``: q, k and v as one product (``torch_impl.qkv_projection``: under autocast one cast copy of the
    norm's output for the three); False: three products, a copy each.

    ``loss``: "plain" (the default) counts the fp32 log-softmax the loss saves (in the activations) and, in the
    timeline, its logits' working buffers (N V (p + 4) forward, N V 8 backward: ``loss_buffer_bytes``; lm8b at
    32,768 tokens a device, 50 and 40 GB; the "sum" model leaves them out, as before: the JAX rows it serves were
    not checked for them; so does ``compiled_loss``, the plain loss compiled by Inductor, as the e2e benchmark's
    ``--compile`` runs it: one graph whose buffers were not measured apart); "fused"
    (``torch_impl.linear_cross_entropy``, chunk ``loss_chunk``) saves an fp32 log-sum-exp a token and holds a chunk
    of logits and dW's fp32 accumulator. ``loss_buffers`` = ``loss_buffer_bytes(...).peak`` in the
    "sum" model; in the timeline, the forward buffers at the forward's end and the backward buffers at the loss's
    backward (CUDA memory snapshots of eager steps: the peak there, notes/fidelity.md, session 40).

    ``workspaces``: bytes the device's libraries hold from the first matmul on, at every moment of the step:
    ``CUDA_LIBRARY_WORKSPACES`` for a PyTorch step on a GPU (0, the default, elsewhere).

    ``peak_model``: "sum" (the default) adds every term above as if all were alive at once, an upper bound;
    "timeline" places the peak in the step (``step_peak_memory``: weights, masters, AdamW state and the
    gathered set always; the saved activations and autocast copies at the forward's end; the gradients written
    so far, one block's (or recomputed segment's) activations and the checkpoints left during the backward),
    which is what the measured single-GPU PyTorch peaks follow (notes/fidelity.md). ``checkpoint_every`` K
    (``torch_impl.activation_checkpointing``: segments of K blocks recomputed in the backward, each block too
    if ``nested_checkpoint``) needs "timeline" and ``checkpointing="none"``. ``grad_accum`` micro-batches a step
    (``batch_tokens`` is one micro-batch's): beyond one, the timeline holds every gradient at every moment (the
    later micro-batches add into them: ``step_peak_memory``'s ``accumulated``); the sum model counts them anyway;
    not with zero2 (refused: the implementations differ).
    """
    _check_choice("strategy", strategy, STRATEGIES)
    _check_choice("gather_unit", gather_unit, GATHER_UNITS)
    _check_choice("peak_model", peak_model, PEAK_MODELS)
    if checkpoint_every is not None and (peak_model != "timeline" or checkpointing != "none"):
        raise ValueError(f"checkpoint_every={checkpoint_every} needs peak_model='timeline' and checkpointing='none' "
                         f"(got {peak_model!r}, {checkpointing!r}); the sum model takes the per-block policies")
    prec = get_precision(precision)
    mesh = _mesh(strategy, n_devices)
    if compiled and checkpoint_every is not None:
        raise ValueError(f"compiled=True with checkpoint_every={checkpoint_every}: the compiled count was measured "
                         "without checkpointing")
    if gradient_buckets < 0 or gradient_buckets and strategy not in ("ddp", "zero1", "zero2"):
        raise ValueError(f"gradient_buckets={gradient_buckets}: bytes a parameter >= 0, with strategy ddp, zero1 or "
                         f"zero2 (whole gradients kept); got {strategy!r}")
    _check_choice("reduce_scatter_output", reduce_scatter_output, REDUCE_SCATTER_OUTPUTS)
    if pending_reduce_scatters is not None and (pending_reduce_scatters < 0 or strategy not in ("zero3", "fsdp",
                                                                                                 "fsdp_tp")):
        raise ValueError(f"pending_reduce_scatters={pending_reduce_scatters}: reduce-scatters in flight >= 0, with "
                         f"a stage-3 strategy (zero3, fsdp, fsdp_tp); got {strategy!r}")
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum}: micro-batches a step, an integer >= 1")
    if grad_accum > 1 and strategy == "zero2":
        raise ValueError("grad_accum > 1 with zero2: how its micro-batches' gradients are held (whole, or reduced "
                         "to slices each time) depends on the implementation; not modelled")
    if batch_tokens < 1 or seq_len < 1 or prefetch_layers < 0:
        raise ValueError(f"batch_tokens={batch_tokens}, seq_len={seq_len} must be >= 1, "
                         f"prefetch_layers={prefetch_layers} >= 0")
    ranks = mesh.dp * mesh.fsdp  # data-parallel ranks: each sees a different slice of the batch
    if batch_tokens % ranks:
        raise ValueError(f"batch_tokens={batch_tokens} is not divisible by dp x fsdp = {ranks}")
    tp = mesh.tp
    n_shard = mesh.fsdp * tp if strategy == "fsdp_tp" else (1 if strategy == "ddp" else mesh.fsdp)
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "fsdp_tp": 3}[strategy]
    n = spec.n_params()

    # Under fsdp_tp the norm gains have no TP dimension (Megatron replicates them over tp): split over fsdp only.
    gains = _norm_gains(spec) if strategy == "fsdp_tp" else 0

    def shard(bytes_per_param: int, from_stage: int) -> float:
        # Sharded over N_shard from this ZeRO stage on, replicated before it.
        if stage < from_stage:
            return n * bytes_per_param
        return ((n - gains) / n_shard + gains / mesh.fsdp) * bytes_per_param

    params = shard(prec.param_bytes, 3)
    grads = shard(prec.grad_bytes, 2)
    master = shard(prec.master_bytes, 1)
    optimizer = shard(prec.optimizer_bytes, 1)
    tokens = batch_tokens // ranks
    # The residual stream in the compute dtype (stage-3 wrappers gathering the embedding in it): activations as with
    # weights in that dtype (one shared norm output, no autocast copy per consuming linear).
    stream = compute_dtype_stream and stage == 3 and prec.autocast
    act = activation_bytes_per_token(spec, seq_len, prec, checkpointing, attention, tp, compiled, stream, loss,
                                     fused_norm, qkv_product)
    activations = float(act.total_bytes * tokens)
    resident, unit = _gather_working_set(spec, gather_unit, reshard_root)
    # Stage 3: the resident root + the unit in use + prefetch_layers units ahead, gathered in the compute
    # dtype (activation_bytes), each matrix split over tp.
    gathered = (resident + (1 + prefetch_layers) * unit) * prec.activation_bytes / tp if stage == 3 else 0.0
    # Autocast's bf16 weight copies, saved for backward: only where the forward reads fp32 weights (not stage 3).
    cast_weights = _cast_params(spec) * prec.activation_bytes / tp if prec.autocast and stage < 3 else 0.0
    buckets = shard(gradient_buckets, 2)
    k_rs = pending_reduce_scatters
    kept = reduce_scatter_output == "kept"
    # Stage 3's reduce-scatters in flight (see the docstring): a parameter's input (p) and, kept, its output piece
    # (p / N_shard), whose sharded gradient (grads / P a parameter, as the timeline spreads it) lands only when waited.
    queue = (reduce_scatter_queue(spec, k_rs, n_shard, prec, gather_unit, reshard_root, reduce_scatter_output, tp,
                                  grads / n) if k_rs is not None and stage == 3 else None)
    reduce_scatter = queue.most_held() if queue else 0.0
    counted = spec.arch == "transformer" and (loss == "fused" or (peak_model == "timeline" and not compiled_loss))
    loss_buffers = loss_buffer_bytes(spec, tokens, prec, loss, loss_chunk) if counted else LossBuffers(0.0, 0.0)
    if workspaces < 0:
        raise ValueError(f"workspaces={workspaces}: bytes >= 0")
    total = (params + grads + master + optimizer + activations + gathered + cast_weights + buckets + reduce_scatter
             + loss_buffers.peak + workspaces)
    s = "N_shard" if n_shard > 1 else "1"
    if gains:
        s = f"N_shard [norm gains G = {gains:,}: (P - G) / N_shard + G / fsdp]"
    formulas = {
        "params": f"P * {prec.param_bytes}" + (f" / {s}" if stage >= 3 else ""),
        "grads": f"P * {prec.grad_bytes}" + (f" / {s}" if stage >= 2 else ""),
        "master": f"P * {prec.master_bytes}" + (f" / {s}" if stage >= 1 else ""),
        "optimizer": f"P * {prec.optimizer_bytes}" + (f" / {s}" if stage >= 1 else ""),
        "activations": f"{act.total_bytes} bytes/token * batch_tokens / (dp * fsdp) [tp={tp}"
                       + (", compiled]" if compiled else "]"),
        "gathered": (f"({'root + ' if resident else ''}(1 + {prefetch_layers}) * largest unit [{gather_unit}]) * "
                     f"{prec.activation_bytes} / tp" if stage == 3 else "0"),
        "cast_weights": f"P_matmul * {prec.activation_bytes} / tp" if prec.autocast and stage < 3 else "0",
        "buckets": f"P * {gradient_buckets}" + (f" / {s}" if stage >= 2 else ""),
        "reduce_scatter": (f"sum over the units in flight [k = {k_rs}, {gather_unit}, {reduce_scatter_output}] "
                           f"u * {prec.activation_bytes} * (1 / tp" + (f" + 1 / {n_shard}" if kept else "") + ")"
                           if reduce_scatter else "0"),
        "N_shard": str(n_shard),
        "loss_buffers": ("0" if not loss_buffers.peak else "fused loss: max(c V (4 + 4), c V (4 + p) + V d 4)"
                         if loss == "fused" else "plain loss: max(N V (p + w), N V (4 + 4))"),
        "workspaces": f"{workspaces / 2**20:g} MiB (the libraries' workspaces)" if workspaces else "0",
    }
    if stream:
        formulas["activations"] += " (residual stream in the compute dtype)"
    breakdown = MemoryBreakdown(strategy, params, grads, master, optimizer, activations, gathered, cast_weights,
                                total, formulas, buckets=buckets, reduce_scatter=reduce_scatter,
                                loss_buffers=loss_buffers.peak, workspaces=workspaces)
    if peak_model == "timeline":
        return step_peak_memory(spec, breakdown, tokens, seq_len, prec, checkpointing, attention, tp,
                                checkpoint_every, nested_checkpoint, compiled, stream, loss, loss_buffers,
                                kept_attention, fused_norm, reduce_scatters=queue, accumulated=grad_accum > 1,
                                qkv_product=qkv_product)
    if kept_attention:
        raise ValueError("kept attention outputs are counted by the timeline peak model only (peak_model='timeline')")
    return breakdown


# --------------------------------------------------------------------------------------------------------
# Where the peak of a training step falls (peak_model="timeline")


def step_peak_memory(spec: ModelSpec, state: MemoryBreakdown, tokens: int, seq_len: int,
                     precision: str | Precision = "bf16_autocast", checkpointing: str = "none",
                     attention: str = "naive", tp: int = 1, checkpoint_every: int | None = None,
                     nested_checkpoint: bool = False, compiled: bool = False,
                     compute_dtype_stream: bool = False, loss: str = "plain",
                     loss_buffers: LossBuffers | None = None, kept_attention: bool = False,
                     fused_norm: bool = True, reduce_scatters: ReduceScatterQueue | None = None,
                     accumulated: bool = False, qkv_product: bool = True) -> MemoryBreakdown:
    """The peak of one training step over its moments, from the terms of ``state`` (a "sum" breakdown of
    ``per_device_memory``, whose sharding of gradients and optimizer state it keeps) for ``tokens`` tokens per
    device. ``per_device_memory(..., peak_model="timeline")`` calls it; notes/fidelity.md has the evidence.

    The step frees gradients before its forward (``zero_grad(set_to_none=True)``, torch_impl/step.py), so no
    gradient exists while activations accumulate, and its backward frees each block's saved activations (and
    the autocast weight copies saved with them) as it writes that block's gradients. With S = params + master
    + optimizer + gathered + buckets + workspaces (alive throughout), R = state.reduce_scatter (stage 3's
    reduce-scatter buffers, during the backward only; placed moment by moment with a queue, below), per token
    b = one block's saved activations, a = one block input (the residual stream: a checkpoint), e = the extras
    outside the blocks (final norm, fp32 log-softmax, token ids), c = one block's autocast weight copies, c_head =
    the LM head's, g = one block's gradients, g_top = the LM head's and final norm's (written before any block's),
    G = all gradients, L blocks, T = tokens:

        peak = S + max(forward's end, backward at block i for i = L-1 .. 0, backward's end)
        forward's end      = T (L b + e) + L c + c_head           no checkpointing
                           = T (ceil(L / K) a + e) + c_head        checkpointing every K blocks
        backward, block i  = g_top + (L - 1 - i) g + R + T live_i + copies_i   (gradients written so far + live)
        backward's end     = G + R                                            (- unlanded: see below)

    with block i in segment s = floor(i / K) and, at the moment block i's backward starts:

        no checkpointing:  live_i = (i + 1) b,                             copies_i = (i + 1) c
        every K, flat:     live_i = (s + 1) a + (i - s K + 1) b,           copies_i = (i - s K + 1) c
        every K, nested:   live_i = (s + 1) a + (i - s K) a + b,           copies_i = c

    (flat: the segment's inputs left plus the recomputed blocks of segment s not yet back-propagated; nested: the
    segment inputs left, the block inputs the recomputed segment checkpointed again, one block recomputed).

    Without checkpointing every backward moment lies between the forward's end and the backward's end (each
    block trades T b + c for g), so the peak is S + max(T (L b + e) + L c + c_head, g_top + T L b + L c, G):
    ``max(activations + autocast copies, gradients)`` of notes/fidelity.md. ``checkpointing="full"`` is K = 1
    flat; "selective" uses its smaller b. FFN-only models have no extras, head or g_top.

    Stage 3's reduce-scatters (``reduce_scatters``, a ``ReduceScatterQueue``; ``per_device_memory``'s
    ``pending_reduce_scatters``): R above is then what the queue holds at that moment, R_i = the last k units
    launched before block i (the LM head's, blocks L-1 .. i+1's), and the kept pieces among them are taken out of
    the gradients written so far (``unlanded``); each block adds one more moment, its reduce-scatter:

        block i's reduce-scatter = g_top + (L - i) g - unlanded' + R'_i + T (live_i - b) + copies_i - c

    with R'_i the queue's ``at_launch`` units up to block i's own (k + 1 kept; the oldest released first,
    max(k, 1), landed), its gradient standing where its gathered weights were (in S); the backward's end holds the last
    ``at_launch`` units launched. Without a queue R = ``state.reduce_scatter`` at every backward moment.

    ``kept_attention`` (checkpointing every K, flat; ``torch_impl.activation_checkpointing``'s keep_attention):
    each block's attention output and fp32 log-sum-exp, o = D p + 4 H a token (over tp), stay from the forward
    to the block's recomputation, where they are among b's tensors: the forward's end adds L o, block i's
    backward s K o (the blocks of the segments not yet recomputed).

    ``accumulated`` (a step of several micro-batches, ``per_device_memory``'s ``grad_accum`` > 1): from the second
    micro-batch on, every gradient is alive at every moment (each backward adds into it in place), so G stands for
    the gradients written by then: peak = S + G + max(the activations, copies, buffers of each moment).

    ``loss_buffers`` (``loss_buffer_bytes``): its forward buffers are added to the forward's end, and one more
    moment, the loss's backward (before any block's), holds the forward's end activations with its backward buffers
    (the plain loss's two fp32 N x V gradients; the fused loss's dW accumulator and a chunk) and no gradient yet.

    Simplifications: the extras are counted at the forward's end only (the loss's tensors and the final norm's
    are freed before the blocks' backward; the int64 token ids, 8 bytes a token, are not counted there); the
    embedding's gradient is written last (in G only); gradients are spread over the parameters evenly
    (``state.grads / P`` a parameter: exact unless fsdp_tp shards the norm gains differently); the block
    input a checkpoint keeps is also that block's first norm input, counted in b as well (one D-sized fp32
    tensor a recomputed segment, 0.2% of the 2.7B peak); transients (the gradient flowing down the residual
    stream, the allocator's rounding and caching; the libraries' workspaces only as ``state.workspaces`` gives them)
    are not modelled. Checked against the
    2.7B single-H100 records (results/memory_h100.jsonl, results/checkpointing_h100.jsonl;
    tests/test_memory_records.py); the reduce-scatter queue against CUDA allocator snapshots of our FSDP and FSDP2
    (notes/fidelity.md, session 42 (helper)) and our FSDP's buffers on CPU (tests/test_fsdp_memory_model.py); not
    validated for the gradient buckets of the DDP wrappers moment by moment, or XLA's buffer assignment.
    """
    prec = get_precision(precision)
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint every {checkpoint_every} blocks: must be >= 1")
    if checkpointing == "full":  # each block recomputed from its input: K = 1, flat
        checkpointing, checkpoint_every, nested_checkpoint = "none", 1, False
    n_layers, d = spec.n_layers, spec.d_model
    saved = activation_bytes_per_token(spec, seq_len, prec, checkpointing, attention, tp, compiled,
                                       compute_dtype_stream, loss, fused_norm, qkv_product)
    b, e = saved.per_layer_bytes, saved.extra_bytes  # one block's saved activations; the extras, per token
    # One checkpoint: a block's input, the residual stream in the model dtype (FFN-only: the compute dtype).
    a = d * (prec.param_bytes if spec.arch == "transformer" else prec.activation_bytes)
    if kept_attention and (checkpoint_every is None or nested_checkpoint):
        raise ValueError("kept attention outputs need flat checkpointing every K blocks (checkpoint_every, not nested)")
    o = (d * prec.activation_bytes + 4 * spec.n_heads) / tp if kept_attention else 0.0  # kept a block and token
    # Autocast copies (state.cast_weights: 0 without autocast or under stage 3): per block its matmul weights
    # (4 D^2 + 3 D F; FFN-only 2 D F), the rest (the LM head) once.
    block_matmul = spec.n_params_per_layer() - (0 if spec.arch == "ffn_only" else 2 * d)
    cast_total = state.cast_weights
    c = cast_total * block_matmul / _cast_params(spec) if cast_total else 0.0
    c_head = cast_total - n_layers * c
    # Gradient bytes a parameter as sharded (state.grads / P); a block's, and the LM head + final norm's.
    per_param = state.grads / spec.n_params()
    g = spec.n_params_per_layer() * per_param
    g_top = 0.0 if spec.arch == "ffn_only" else (spec.vocab_size * d + d) * per_param
    persistent = (state.params + state.master + state.optimizer + state.gathered + state.buckets
                  + state.workspaces)  # S

    # Each moment: (where, gradients, activations, autocast copies, reduce-scatter buffers, loss buffers) alive
    # beside S.
    k = checkpoint_every
    rs = state.reduce_scatter  # R: during the backward only
    lb = loss_buffers or LossBuffers(0.0, 0.0)
    if k is None:
        forward_end = ("forward's end", 0.0, tokens * (n_layers * b + e), n_layers * c + c_head, 0.0, lb.forward)
    else:
        forward_end = ("forward's end", 0.0, tokens * (math.ceil(n_layers / k) * a + n_layers * o + e), c_head, 0.0,
                       lb.forward)
    moments = [forward_end]
    if lb.backward:
        moments.append(("loss backward", *forward_end[1:5], lb.backward))
    queue = reduce_scatters

    def in_flight(done: int, launching: bool = False) -> tuple[float, float]:
        # (R, the kept pieces' gradient bytes not landed) once ``done`` units are launched (see the docstring)
        return queue.after(done, launching) if queue else (rs, 0.0)

    for i in reversed(range(n_layers)):  # the backward runs from the last block to the first
        if k is None:
            live, copies = (i + 1) * b, (i + 1) * c
        else:
            s = i // k  # block i's segment; segments s + 1 .. are back-propagated, their inputs freed
            if nested_checkpoint:
                live, copies = (s + 1) * a + (i - s * k) * a + b, c
            else:
                live, copies = (s + 1) * a + s * k * o + (i - s * k + 1) * b, (i - s * k + 1) * c
        done = queue.first_block + (n_layers - 1 - i) * queue.units_per_block if queue else 0
        held, unlanded = in_flight(done)
        # the gradients written so far, less the kept pieces' not landed (never below 0: "layer" overcounts units)
        written = max(g_top + (n_layers - 1 - i) * g - unlanded, 0.0)
        moments.append((f"backward, block {i}", written, tokens * live, copies, held, 0.0))
        if queue:  # block i's units launched: its activations freed, its gradient written (or in flight)
            held, unlanded = in_flight(done + queue.units_per_block, launching=True)
            moments.append((f"backward, block {i}'s reduce-scatter", max(g_top + (n_layers - i) * g - unlanded, 0.0),
                            tokens * (live - b), copies - c, held, 0.0))
    held, unlanded = in_flight(len(queue.units), launching=True) if queue else (rs, 0.0)
    moments.append(("backward's end", max(state.grads - unlanded, 0.0), 0.0, 0.0, held, 0.0))
    if accumulated:  # a later micro-batch: the gradients accumulated so far are alive throughout
        moments = [(where, state.grads, *rest) for where, _, *rest in moments]
    where, grads, activations, copies, rs_then, lb_then = max(moments, key=lambda m: sum(m[1:]))
    total = persistent + grads + activations + copies + rs_then + lb_then
    policy = ("none" if k is None else f"every {k}" + (" nested" if nested_checkpoint else "")
              + (", attention kept" if kept_attention else ""))
    formulas = {**state.formulas,
                "peak": f"S + max(forward's end, backward at each block, backward's end) [checkpointing {policy}]",
                "grads": ("every gradient (accumulated over micro-batches)" if accumulated
                          else f"gradients written by then ({where})"),
                "activations": f"saved activations alive then ({where})",
                "cast_weights": f"autocast copies alive then ({where})"}
    if rs:
        formulas["reduce_scatter"] += f" (in flight then: {where})" if queue else " (during the backward only)"
    return dataclasses.replace(state, grads=grads, activations=float(activations), cast_weights=float(copies),
                               total=total, formulas=formulas, peak_at=where, reduce_scatter=float(rs_then),
                               loss_buffers=float(lb_then))


# --------------------------------------------------------------------------------------------------------
# The CS336 XXL questions (FFN-only model; the CLI report uses these)


def handout_activation_bytes_per_token(spec: ModelSpec) -> int:
    """bf16 activations saved per token by the handout's FFN-only model, no checkpointing:
    n_layers x (D + F) x 2 (XXL: 126 x (16,384 + 53,248) x 2 = 17,547,264 bytes per token)."""
    if spec.arch != "ffn_only":
        raise ValueError(f"the handout's activation count is for arch='ffn_only'; {spec.name!r} is {spec.arch!r}")
    return activation_bytes_per_token(spec, 1, "bf16_mixed").total_bytes


def devices_needed(total_bytes: float, device_bytes: float = 80e9) -> int:
    """How many devices ``total_bytes`` fills: ceil(total / device) (XXL state: ceil(3.5176e12 / 80e9) = 44)."""
    if device_bytes <= 0:
        raise ValueError(f"device_bytes={device_bytes} must be > 0")
    return math.ceil(total_bytes / device_bytes)


def fsdp_half_activation_bytes(spec: ModelSpec, batch_tokens: int, n_fsdp: int) -> float:
    """Per-device bytes when weights, grads, optimizer state and HALF the activations are sharded over N:

        (16 P + A / 2) / N + A / 2,   A = batch_tokens x handout_activation_bytes_per_token(spec)

    (the handout's assumption: half the saved activations shard with FSDP, the other half does not).
    """
    if n_fsdp < 1 or batch_tokens < 0:
        raise ValueError(f"n_fsdp={n_fsdp} must be >= 1 and batch_tokens={batch_tokens} >= 0")
    a = batch_tokens * handout_activation_bytes_per_token(spec)
    return (state_bytes(spec, "fp32") + a / 2) / n_fsdp + a / 2


def min_fsdp_degree(spec: ModelSpec, batch_tokens: int, budget_bytes: float) -> int | None:
    """Smallest integer N with ``fsdp_half_activation_bytes(spec, batch_tokens, N) <= budget_bytes``.

    (S + A/2) / N + A/2 <= B  <=>  N >= (S + A/2) / (B - A/2) = (2S + A) / (2B - A), so N = ceil of that
    (at least 1), computed exactly with fractions. Returns None when A / 2 alone is at least the budget:
    then no N fits, however many devices the state is sharded over.
    """
    if budget_bytes <= 0 or batch_tokens < 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be > 0 and batch_tokens={batch_tokens} >= 0")
    s = Fraction(state_bytes(spec, "fp32"))
    a = Fraction(batch_tokens * handout_activation_bytes_per_token(spec))
    budget = Fraction(budget_bytes)
    if 2 * budget <= a:
        return None
    return max(1, math.ceil((2 * s + a) / (2 * budget - a)))
