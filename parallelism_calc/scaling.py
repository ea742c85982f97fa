"""When does a sharded FFN stack stay compute-bound? The TPU Scaling Book's analysis, as functions.

Notation of "How to Scale Your Model" (Austin et al. 2025), chapter "Training": B tokens in the global
batch, D = d_model, F = d_ff, X = data-parallel / FSDP degree, Y = tensor-parallel degree, N = X Y,
C = FLOP/s per chip, W = W_ici the bidirectional bandwidth of one mesh axis, M_X and M_Y the numbers of
mesh axes X and Y span (each extra axis adds a ring's worth of bandwidth), alpha = C / W.

One block is ``n_matrices`` D x F weight matrices (2 for the CS336 XXL model's D -> F -> D, 3 for SwiGLU);
activations, weights and gradients cross the network in bf16 (2 bytes); a collective of V bytes over an
axis takes V / (M W) (the book's approximation of the ring time, (n - 1) / n ~ 1). Per block:

* math, forward: n_matrices * 2 B D F / (N C) (each chip multiplies B/X tokens by D x F/Y); backward 2x;
* FSDP, forward: all-gather the block's weights, n_matrices * 2 D F / Y bytes over X: 2 n D F / (Y W M_X);
  backward: all-gather again and reduce-scatter the gradients, twice that;
* DP (weights replicated over X): nothing forward; backward all-reduces the gradients, the same bytes as
  FSDP's backward;
* TP, forward: all-gather the block's input and reduce-scatter its output, 2 x 2 B D / X bytes over Y:
  4 B D / (X W M_Y); backward: the mirror collectives, the same time (gathered inputs saved, not re-gathered).

Every cost is linear in B (math = a B, TP = t B) or constant (FSDP/DP = f), so the smallest compute-bound
batch has a closed form under both readings of the book: collectives overlapped (math >= max(f, t B)) or
serialized (math >= f + t B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallelism_calc.specs import HardwareSpec

BF16 = 2
STRATEGIES = ("dp", "fsdp", "tp", "fsdp_tp")  # how a dp x fsdp x tp mesh shards (jax_impl.sharding's rules)


@dataclass(frozen=True)
class Roofline:
    """The Scaling Book's constants: chip FLOP/s C, axis bandwidth W_ici, mesh axes spanned by X and Y."""

    flops: float  # C
    bandwidth: float  # W_ici, bytes/s, both directions of one axis
    axes_x: int = 1  # M_X
    axes_y: int = 1  # M_Y

    def __post_init__(self) -> None:
        if self.flops <= 0 or self.bandwidth <= 0 or self.axes_x < 1 or self.axes_y < 1:
            raise ValueError(f"Roofline needs C > 0, W > 0, M_X >= 1, M_Y >= 1; got {self}")

    @property
    def alpha(self) -> float:
        """C / W_ici: FLOPs a chip does in the time one byte crosses an axis."""
        return self.flops / self.bandwidth

    @classmethod
    def from_hardware(cls, hw: HardwareSpec, axes_x: int = 1, axes_y: int = 1) -> "Roofline":
        return cls(hw.bf16_flops, hw.interconnect_bw, axes_x, axes_y)


# CS336 (2025) assignment 2, the XXL question: TPU v5p as the Scaling Book rounds it, a 3D mesh with FSDP
# over two axes (M_X = 2) and TP over one (M_Y = 1).
CS336_V5P = Roofline(flops=4.6e14, bandwidth=2 * 9e10, axes_x=2, axes_y=1)


@dataclass(frozen=True)
class BlockCosts:
    """Seconds per block for one pass: math = a B, FSDP/DP collectives f, TP collectives t B."""

    math_per_token: float  # a
    weight_comm: float  # f (FSDP all-gathers / reduce-scatters, or DP all-reduce)
    tp_comm_per_token: float  # t
    batch_tokens: float

    @property
    def math(self) -> float:
        return self.math_per_token * self.batch_tokens

    @property
    def tp_comm(self) -> float:
        return self.tp_comm_per_token * self.batch_tokens

    @property
    def comm_overlapped(self) -> float:
        return max(self.weight_comm, self.tp_comm)

    @property
    def comm_serial(self) -> float:
        return self.weight_comm + self.tp_comm

    def compute_bound(self, overlapped: bool) -> bool:
        return self.math >= (self.comm_overlapped if overlapped else self.comm_serial)

    def min_batch(self, overlapped: bool) -> float | None:
        """Smallest B with math >= comm: f / a if overlapped, f / (a - t) if serial; None if TP alone already
        costs more than the math (a <= t), which no batch fixes."""
        a, f, t = self.math_per_token, self.weight_comm, self.tp_comm_per_token
        if t >= a:
            return None
        return f / a if overlapped else f / (a - t)


def block_costs(d_model: int, d_ff: int, batch_tokens: float, roofline: Roofline, *, x: int = 1, y: int = 1,
                shard_weights: bool = True, backward: bool = False, n_matrices: int = 2) -> BlockCosts:
    """Costs of one block (module docstring) for X = ``x`` data ranks (FSDP if ``shard_weights``, else DP)
    and Y = ``y`` tensor-parallel ranks; forward, or backward with ``backward=True``."""
    if min(d_model, d_ff, x, y, n_matrices) < 1 or batch_tokens <= 0:
        raise ValueError(f"block_costs needs positive sizes; got D={d_model}, F={d_ff}, B={batch_tokens}, X={x}, Y={y}")
    if d_ff % y:
        raise ValueError(f"TP degree {y} does not divide d_ff={d_ff}")
    r, n = roofline, x * y
    passes = 2 if backward else 1  # backward: input and weight gradients, two products per forward product
    math_per_token = passes * n_matrices * 2 * d_model * d_ff / (n * r.flops)
    if x == 1:
        weight_comm = 0.0
    elif shard_weights:  # FSDP: forward all-gather; backward all-gather + reduce-scatter of the gradients
        weight_comm = passes * n_matrices * BF16 * d_model * d_ff / (y * r.bandwidth * r.axes_x)
    else:  # DP: backward all-reduce of the gradients (= reduce-scatter + all-gather)
        weight_comm = 2 * n_matrices * BF16 * d_model * d_ff / (y * r.bandwidth * r.axes_x) if backward else 0.0
    tp_comm_per_token = 0.0 if y == 1 else 2 * BF16 * d_model / (x * r.bandwidth * r.axes_y)
    return BlockCosts(math_per_token, weight_comm, tp_comm_per_token, batch_tokens)


def max_tp_degree(d_ff: int, roofline: Roofline, backward: bool = False, n_matrices: int = 2) -> float:
    """Y beyond which TP alone is communication-bound: math > TP comm <=> Y < (n/2) * passes * F M_Y / alpha."""
    passes = 2 if backward else 1
    return passes * n_matrices / 2 * d_ff * roofline.axes_y / roofline.alpha


def min_batch_per_data_rank(roofline: Roofline) -> float:
    """FSDP (forward or backward) and DP (backward): compute-bound iff B / X > alpha / M_X."""
    return roofline.alpha / roofline.axes_x


def min_batch_per_device_2d(d_ff: int, roofline: Roofline, overlapped: bool, n_matrices: int = 2) -> float:
    """FSDP x TP with the best split of N = X Y (forward): B / N > k alpha^2 / (M_X M_Y F (n/2)), with k = 1
    overlapped (at Y = the largest TP degree) and k = 4 serialized (at X_opt, where both collectives cost
    the same and each may take only half the math)."""
    k = 1 if overlapped else 4
    return k * roofline.alpha**2 / (roofline.axes_x * roofline.axes_y * d_ff * n_matrices / 2)


def optimal_fsdp_degree(batch_tokens: float, d_ff: int, n_devices: int, roofline: Roofline,
                        n_matrices: int = 2) -> float:
    """X minimizing the serialized forward comm time for N = X Y devices: X_opt = sqrt(B N M_X / (F' M_Y)),
    F' = (n/2) F (the book's formula for two matrices)."""
    return math.sqrt(batch_tokens * n_devices * roofline.axes_x / (d_ff * n_matrices / 2 * roofline.axes_y))
