"""A training step's time floor on measured ceilings: each part at its ceiling, none of them overlapping.

    T_step >= F_matmul / C  +  F_attention / C_attention  +  (B_optimizer + B_casts + B_elementwise) / W  +  T_comm

with C the device's measured matrix-product rate, C_attention its fused attention kernel's measured rate (when
known; else attention's products are in F_matmul at C) and W its measured copy bandwidth (``torch_impl.bench.ceilings``
records them; datasheet peaks are never reached). The parts, for a ``transformer`` spec:

* F_matmul: ``compute.forward_flops`` (x 3 for a train or forward-backward step: the backward is two products per
  forward product), except that causal attention's score and value products count half: a fused kernel skips the
  masked tiles (``compute`` counts them in full, as MFU conventionally does); plus what the backward recomputes
  (``recompute_flops``: checkpointed blocks, the fused loss's logits).
* F_attention, where the ceilings carry an attention rate: the causal score and value products of the step's
  forward and backward (taken out of F_matmul) as ``compute.attention_flops`` counts them for a fused kernel
  (forward x 3.5: the backward recomputes the scores), at the rate the attention benchmark measured for that kernel
  (under half the products' rate at d_head 64 on an H100). What the backward recomputes stays in F_matmul.
* B_optimizer: AdamW's traffic per parameter (per parameter of the device's shard under ``fsdp``, as B_casts), train
  steps only: it reads the gradient, the fp32 weight (or master),
  both fp32 moments and writes weight (or master) and moments; with ``bf16_mixed`` it also writes the bf16 weight:
  fp32 4 + 4 + 8 + 4 + 8 = 28 bytes; bf16_mixed 2 + 4 + 8 + (4 + 2) + 8 = 28 bytes.
* B_casts: under autocast (``Precision.autocast``) every weight is read in fp32 and written in bf16 each forward
  (6 bytes), and its bf16 gradient read and accumulated into the fp32 one each backward (2 + 4 bytes): 12 bytes a
  parameter (6 for a forward alone).
* B_elementwise: the memory-bound kernels between the products, each at its fused minimum, per token and block, in
  the activation dtype: forward, two RMSNorms each fused with its residual add (read the stream and the branch
  output, write the new stream and the normalised copy: 4 d each), RoPE of q and k (read 2 d, write 2 d), the
  SwiGLU product (read 2 d_ff, write d_ff): 12 d + 3 d_ff; backward, the SwiGLU derivative (read a, b and the
  product's gradient, write both input gradients: 5 d_ff), the FFN norm's (read its two input gradients, its input
  and the residual gradient, write one: 5 d), RoPE's (4 d), the attention norm's (three input gradients, its input
  and the residual gradient in, one out: 6 d): 15 d + 5 d_ff. The embedding, the LM head's softmax and the
  attention kernels' own reads are left out (small, or inside C's work).
* T_comm: data-parallel gradients all-reduced (``ddp``: one ring all-reduce of the gradients, bus bandwidth
  ``bus_bw``), or sharded (``fsdp``: the weights all-gathered for the forward and again for the backward in the
  compute dtype, the gradients reduce-scattered), at the measured bus bandwidth, all exposed (serialized): a run
  that overlaps its communication beats this part of the floor by what it hides.

What the floor leaves out is what a measurement above it shows: kernels below their ceilings (attention, where
its rate is not given), gaps between kernels, host-bound steps, communication not overlapped.
References: Williams et al. 2009 (the roofline model); notes/train_step.md (the xl step's kernels against it).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelism_calc.collectives import ring_all_gather_time, ring_all_reduce_time, ring_reduce_scatter_time
from parallelism_calc.compute import MODES, attention_flops, forward_flops
from parallelism_calc.memory import get_precision, Precision
from parallelism_calc.specs import ModelSpec

ADAMW_BYTES = 28  # fp32: read g, w, m, v (16), write w, m, v (12); bf16_mixed: read g, master, m, v (14), write 14
STRATEGY_COMMS = ("none", "ddp", "fsdp")  # what T_comm models


@dataclass(frozen=True)
class Ceilings:
    """What one device sustains, measured: ``matmul_flops`` (FLOP/s of a large product in the compute dtype),
    ``memory_bw`` (bytes/s of a device copy, read + written), ``bus_bw`` (bytes/s, NCCL-tests' bus bandwidth of a
    large collective between the devices; None on one device), ``attention_flops`` (FLOP/s of the step's fused
    causal attention kernel, forward and backward, as ``compute.attention_flops`` counts them; None: attention's
    products at ``matmul_flops``)."""

    matmul_flops: float
    memory_bw: float
    bus_bw: float | None = None
    attention_flops: float | None = None

    def __post_init__(self) -> None:
        if not (self.matmul_flops > 0 and self.memory_bw > 0
                and all(rate is None or rate > 0 for rate in (self.bus_bw, self.attention_flops))):
            raise ValueError(f"Ceilings need positive rates; got {self}")


@dataclass(frozen=True)
class StepFloor:
    """Seconds of each part of ``step_time_floor`` and their sum."""

    matmul_s: float
    optimizer_s: float
    casts_s: float
    elementwise_s: float
    comm_s: float
    attention_s: float = 0.0  # the attention core at its own rate, where the ceilings have one (else in matmul_s)

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.optimizer_s + self.casts_s + self.elementwise_s + self.comm_s + self.attention_s


def causal_core_flops(spec: ModelSpec, batch_size: float, seq_len: int) -> float:
    """One forward's attention-core FLOPs in all layers, causal: the unmasked half of the score and value products,
    2 B S^2 d a layer (each product is 2 B S^2 d in full)."""
    return spec.n_layers * 2 * batch_size * seq_len * seq_len * spec.d_model


def matmul_flops(spec: ModelSpec, batch_size: int, seq_len: int, mode: str) -> float:
    """F_matmul: the step's product FLOPs with causal attention's masked half not counted."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; accepted: {', '.join(MODES)}")
    forward = forward_flops(spec, batch_size, seq_len)
    if spec.arch == "transformer":
        forward -= causal_core_flops(spec, batch_size, seq_len)  # the masked half is the same amount
    return forward * (1 if mode == "forward" else 3)


def recompute_flops(spec: ModelSpec, batch_size: float, seq_len: int, recompute_blocks: int = 0,
                    selective: bool = False, loss: str = "plain", kept_attention: bool = False) -> float:
    """Product FLOPs a train step's backward recomputes, causal attention's masked half not counted:
    ``recompute_blocks`` forwards of every block (1: full checkpointing or checkpoints every K blocks, each block
    recomputed once; 2: nested, the segment and then each block again); ``selective``: the attention core's score
    and value products once (Korthikanti et al.); ``kept_attention``: the recomputed blocks take the attention
    core's outputs kept from the forward (``torch_impl.activation_checkpointing``), so their core is not
    recomputed; ``loss="fused"``: the LM head's logits, 2 N d V (``torch_impl.linear_cross_entropy``'s backward)."""
    if recompute_blocks < 0:
        raise ValueError(f"recompute_blocks={recompute_blocks} must be >= 0")
    if spec.arch != "transformer":
        return recompute_blocks * matmul_flops(spec, batch_size, seq_len, "forward")
    tokens = batch_size * seq_len
    head = 2 * tokens * spec.d_model * spec.vocab_size
    blocks = matmul_flops(spec, batch_size, seq_len, "forward") - head
    core = causal_core_flops(spec, batch_size, seq_len)
    blocks -= core if kept_attention else 0.0
    return recompute_blocks * blocks + (core if selective else 0.0) + (head if loss == "fused" else 0.0)


def elementwise_bytes(spec: ModelSpec, tokens: int, mode: str, precision: str | Precision) -> float:
    """B_elementwise (see the module's doc): (12 d + 3 d_ff) forward and (15 d + 5 d_ff) backward elements a token
    and block, in the activation dtype; 0 for the FFN-only model, whose blocks have no norms or RoPE."""
    if spec.arch != "transformer":
        return 0.0
    d, ff = spec.d_model, spec.d_ff
    elements = 12 * d + 3 * ff + (0 if mode == "forward" else 15 * d + 5 * ff)
    return float(elements * get_precision(precision).activation_bytes * tokens * spec.n_layers)


def comm_seconds(spec: ModelSpec, strategy: str, n_devices: int, precision: str | Precision,
                 bus_bw: float | None) -> float:
    """T_comm of one train step (see the module's doc); 0 on one device. ``bus_bw`` is NCCL-tests' bus bandwidth,
    which the ring formulas of ``collectives`` take as their link bandwidth W (an all-reduce of V bytes: V x 2 (n - 1)
    / n / bus_bw; an all-gather or reduce-scatter: V x (n - 1) / n / bus_bw)."""
    if strategy not in STRATEGY_COMMS:
        raise ValueError(f"strategy {strategy!r}; the time floor models {', '.join(STRATEGY_COMMS)}")
    if n_devices < 1:
        raise ValueError(f"n_devices={n_devices}: needs >= 1")
    if n_devices == 1 or strategy == "none":
        return 0.0
    if bus_bw is None:
        raise ValueError(f"{n_devices} devices with {strategy}: the floor needs the measured bus bandwidth")
    p = get_precision(precision)
    params = spec.n_params()
    if strategy == "ddp":  # gradients all-reduced in their own dtype
        return ring_all_reduce_time(params * p.grad_bytes, n_devices, bus_bw)
    # fsdp: all-gather the weights for the forward and again for the backward in the compute dtype, then
    # reduce-scatter the gradients
    return (2 * ring_all_gather_time(params * p.activation_bytes, n_devices, bus_bw)
            + ring_reduce_scatter_time(params * p.grad_bytes, n_devices, bus_bw))


def step_time_floor(spec: ModelSpec, batch_size: float, seq_len: int, mode: str, precision: str | Precision,
                    ceilings: Ceilings, strategy: str = "none", n_devices: int = 1, recompute_blocks: int = 0,
                    selective: bool = False, loss: str = "plain", kept_attention: bool = False) -> StepFloor:
    """The floor of one step (see the module's doc); ``batch_size`` sequences per device, ``n_devices`` ranks of
    ``strategy`` (``STRATEGY_COMMS``); ``recompute_blocks``, ``selective``, ``loss``, ``kept_attention``: what the
    backward recomputes (``recompute_flops``; a forward-only step recomputes nothing)."""
    p = get_precision(precision)
    train = mode == "train_step"
    tokens = batch_size * seq_len
    # fsdp: each device updates, and casts, its own 1 / N of the parameters (the gathers are in T_comm)
    params = spec.n_params() / (n_devices if strategy == "fsdp" else 1)
    casts = (6 if mode == "forward" else 12) * params if p.autocast else 0
    products = matmul_flops(spec, batch_size, seq_len, mode) + (0.0 if mode == "forward" else recompute_flops(
        spec, batch_size, seq_len, recompute_blocks, selective, loss, kept_attention))
    attention_s = 0.0
    if ceilings.attention_flops is not None and spec.arch == "transformer":
        # the attention core at the kernel's rate, its recomputed forwards (unless kept) too
        recomputed = 0 if mode == "forward" or kept_attention else recompute_blocks
        products -= causal_core_flops(spec, batch_size, seq_len) * ((1 if mode == "forward" else 3) + recomputed)
        head_dim = spec.d_model // spec.n_heads
        kernel = attention_flops(batch_size, spec.n_heads, seq_len, head_dim, True,
                                 "forward" if mode == "forward" else "forward_backward")
        kernel += recomputed * attention_flops(batch_size, spec.n_heads, seq_len, head_dim, True, "forward")
        attention_s = spec.n_layers * kernel / ceilings.attention_flops
    return StepFloor(
        matmul_s=products / ceilings.matmul_flops,
        optimizer_s=ADAMW_BYTES * params / ceilings.memory_bw if train else 0.0,
        casts_s=casts / ceilings.memory_bw,
        elementwise_s=elementwise_bytes(spec, tokens, mode, p) / ceilings.memory_bw,
        comm_s=comm_seconds(spec, strategy, n_devices, p, ceilings.bus_bw) if train else 0.0,
        attention_s=attention_s,
    )
