"""Model, parallelism and hardware specs: the single source of truth for shapes, mesh degrees and ceilings.

Stdlib only, so every other room (torch_impl, jax_impl, analysis, the calculator) can import it for free.

* ``ModelSpec`` — the CS336 "basics" Transformer LM (RoPE, RMSNorm, SwiGLU, untied LM head, no biases)
  or, with ``arch="ffn_only"``, the FFN-only analysis model of the CS336 parallelism handout (blocks of
  two bias-free linear layers d_model -> d_ff -> d_model).
* ``ParallelSpec`` — data-parallel, FSDP and tensor-parallel degrees; validates itself against a world size.
* ``HardwareSpec`` — dense peak FLOP/s, memory size and bandwidth, interconnect bandwidth, each with its source.

References: CS336 (Stanford, 2025) assignment 1 (architecture) and assignment 2 (model-size table);
"How to Scale Your Model" (the TPU Scaling Book, 2025) for the TPU v5p numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

GB = 1e9
TB = 1e12
TFLOPS = 1e12

Arch = Literal["transformer", "ffn_only"]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of one language model. ``d_ff`` is the SwiGLU hidden width (three d_model x d_ff matrices)."""

    name: str
    vocab_size: int
    context_length: int
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    arch: Arch = "transformer"

    def __post_init__(self) -> None:
        if self.arch not in ("transformer", "ffn_only"):
            raise ValueError(f"ModelSpec {self.name!r}: arch={self.arch!r}; accepted: 'transformer', 'ffn_only'")
        for field in ("d_model", "d_ff", "n_layers"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelSpec {self.name!r}: {field}={getattr(self, field)} must be >= 1")
        if self.arch == "transformer":
            for field in ("vocab_size", "context_length", "n_heads"):
                if getattr(self, field) < 1:
                    raise ValueError(f"ModelSpec {self.name!r}: {field}={getattr(self, field)} must be >= 1")
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"ModelSpec {self.name!r}: d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
                )
            if self.d_head % 2:
                raise ValueError(f"ModelSpec {self.name!r}: head dim {self.d_head} must be even for RoPE")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def replace(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (validated again), e.g. ``MODELS['small'].replace(context_length=256)``."""
        return dataclasses.replace(self, **changes)

    def check_seq_len(self, seq_len: int) -> None:
        """A ValueError if a sequence is longer than the context the model (its RoPE table) was built for."""
        if seq_len > self.context_length:
            raise ValueError(
                f"sequence length {seq_len} exceeds context_length {self.context_length} of spec "
                f"{self.name!r}; build the model from spec.replace(context_length={seq_len})"
            )

    def n_params_per_layer(self) -> int:
        """Parameters of one block."""
        ffn = 2 * self.d_model * self.d_ff  # W1 (d_ff x d), W2 (d x d_ff)
        if self.arch == "ffn_only":
            return ffn
        attention = 4 * self.d_model * self.d_model  # W_Q, W_K, W_V, W_O, each d x d, no biases
        swiglu_gate = self.d_model * self.d_ff  # W3, the gate of SwiGLU
        norms = 2 * self.d_model  # RMSNorm gains before attention and before the FFN
        return attention + ffn + swiglu_gate + norms

    def n_params(self) -> int:
        """All parameters: embedding + blocks + final norm + untied LM head (FFN-only: blocks alone)."""
        blocks = self.n_layers * self.n_params_per_layer()
        if self.arch == "ffn_only":
            return blocks
        embedding = self.vocab_size * self.d_model
        final_norm = self.d_model
        lm_head = self.d_model * self.vocab_size  # untied from the embedding
        return embedding + blocks + final_norm + lm_head


def _cs336(name: str, d_model: int, d_ff: int, n_layers: int, n_heads: int) -> ModelSpec:
    # CS336 assignment 2 (2025), table 1: vocabulary 10,000; context 1,024 is our default, the
    # benchmarks override it per run (RoPE is computed for any length up to context_length).
    return ModelSpec(name, vocab_size=10_000, context_length=1024, d_model=d_model, d_ff=d_ff,
                     n_layers=n_layers, n_heads=n_heads)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        # For tests: head dim 16, every code path exercised in milliseconds on a CPU.
        ModelSpec("tiny", vocab_size=512, context_length=64, d_model=64, d_ff=176, n_layers=2, n_heads=4),
        _cs336("small", 768, 3072, 12, 12),
        _cs336("medium", 1024, 4096, 24, 16),
        _cs336("large", 1280, 5120, 36, 20),
        _cs336("xl", 1600, 6400, 48, 25),
        _cs336("2.7B", 2560, 10240, 32, 32),
        _cs336("10B", 4608, 12288, 50, 36),
        # An 8B-class LM with a large vocabulary and long context (Qwen-style vocabulary of 151,936).
        ModelSpec("lm8b", vocab_size=151_936, context_length=32_768, d_model=4096, d_ff=11_008,
                  n_layers=34, n_heads=32),
        # CS336 parallelism handout: the FFN-only XXL model, 126 blocks of d_model -> d_ff -> d_model.
        ModelSpec("xxl", vocab_size=0, context_length=0, d_model=16_384, d_ff=53_248, n_layers=126,
                  n_heads=0, arch="ffn_only"),
    ]
}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name``, or a ValueError listing the presets."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; accepted: {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class ParallelSpec:
    """Degrees of data parallelism (dp), fully sharded data parallelism (fsdp) and tensor parallelism (tp).

    At most one degree may be -1: it is filled in by ``resolve(world_size)`` so that dp * fsdp * tp equals
    the world size. A spec with no -1 is already resolved; ``world_size`` is then the product.
    """

    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        degrees = self.degrees()
        for axis, degree in degrees.items():
            if degree == 0 or degree < -1:
                raise ValueError(f"ParallelSpec: {axis}={degree}; accepted: a positive integer, or -1 to fill in")
        if list(degrees.values()).count(-1) > 1:
            raise ValueError(f"ParallelSpec: at most one degree may be -1, got {degrees}")

    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp}

    @property
    def is_resolved(self) -> bool:
        return -1 not in self.degrees().values()

    @property
    def world_size(self) -> int:
        if not self.is_resolved:
            raise ValueError(f"ParallelSpec {self.degrees()} has a -1 degree: call resolve(world_size) first")
        return self.dp * self.fsdp * self.tp

    def resolve(self, world_size: int) -> "ParallelSpec":
        """This spec with its -1 degree filled in for ``world_size`` devices; checks the product."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        degrees = self.degrees()
        known = 1
        for degree in degrees.values():
            if degree != -1:
                known *= degree
        if self.is_resolved:
            if known != world_size:
                raise ValueError(f"ParallelSpec {degrees}: dp*fsdp*tp = {known} != world size {world_size}")
            return self
        if world_size % known:
            raise ValueError(f"ParallelSpec {degrees}: world size {world_size} is not divisible by {known}")
        return ParallelSpec(**{axis: (world_size // known if d == -1 else d) for axis, d in degrees.items()})

    @classmethod
    def parse(cls, text: str) -> "ParallelSpec":
        """Parse ``"dp=2,fsdp=4,tp=1"`` (missing axes are 1)."""
        degrees = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            axis, sep, value = part.partition("=")
            if not sep or axis.strip() not in ("dp", "fsdp", "tp"):
                raise ValueError(f"cannot parse mesh {text!r}; accepted: e.g. 'dp=2,fsdp=4,tp=1'")
            try:
                degrees[axis.strip()] = int(value)
            except ValueError:
                raise ValueError(f"mesh degree {part!r} is not an integer") from None
        return cls(**degrees)


@dataclass(frozen=True)
class HardwareSpec:
    """Peak rates of one accelerator. FLOP/s are dense (no 2:4 sparsity); bandwidths are bytes/s.

    ``interconnect_bw`` is the one-direction bandwidth a device can drive into its scale-up fabric (NVLink
    or ICI), the W of the ring-collective formulas: a ring all-gather of B bytes takes about B / W.
    """

    name: str
    bf16_flops: float
    fp32_flops: float | None  # None where the chip has no separate fp32 rate worth quoting
    memory_bytes: float
    memory_bw: float
    interconnect_bw: float
    device_name_patterns: tuple[str, ...] = ()  # substrings of torch/jax device names that mean this chip


HARDWARE: dict[str, HardwareSpec] = {
    hw.name: hw
    for hw in [
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS *with sparsity* -> 989.5 dense;
        # FP32 (non-tensor) 67 TFLOPS; 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s total = 450 GB/s per direction.
        HardwareSpec("h100", bf16_flops=989.5 * TFLOPS, fp32_flops=67 * TFLOPS, memory_bytes=80 * GB,
                     memory_bw=3.35 * TB, interconnect_bw=450 * GB, device_name_patterns=("H100",)),
        # NVIDIA H200 datasheet (SXM): same compute as the H100 SXM; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
        HardwareSpec("h200", bf16_flops=989.5 * TFLOPS, fp32_flops=67 * TFLOPS, memory_bytes=141 * GB,
                     memory_bw=4.8 * TB, interconnect_bw=450 * GB, device_name_patterns=("H200",)),
        # NVIDIA HGX B200 datasheet, per GPU (8-GPU board / 8): BF16 4.5 PFLOPS sparse -> 2.25 dense;
        # FP32 75 TFLOPS; 180 GB HBM3e at 7.7 TB/s; NVLink 5 1.8 TB/s total = 900 GB/s per direction.
        HardwareSpec("b200", bf16_flops=2250 * TFLOPS, fp32_flops=75 * TFLOPS, memory_bytes=180 * GB,
                     memory_bw=7.7 * TB, interconnect_bw=900 * GB, device_name_patterns=("B200",)),
        # TPU Scaling Book, "All about TPUs" table: v5p 4.59e14 bf16 FLOP/s, 95 GB HBM (96 GiB-class) at
        # 2.8e12 B/s; ICI 9e10 B/s one way per link, a bidirectional ring on one axis gets 2 x 9e10.
        # The MXU has no separate fp32 rate in that table.
        HardwareSpec("tpu_v5p", bf16_flops=4.59e14, fp32_flops=None, memory_bytes=95 * GB,
                     memory_bw=2.8e12, interconnect_bw=2 * 9e10, device_name_patterns=("v5p", "TPU v5")),
    ]
}


def get_hardware(name: str) -> HardwareSpec:
    """The preset called ``name``, or a ValueError listing the presets."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; accepted: {', '.join(HARDWARE)}") from None


def hardware_for_device(device_name: str) -> HardwareSpec | None:
    """The preset whose pattern occurs in a device name (e.g. 'NVIDIA H100 80GB HBM3'), else None (CPU)."""
    for hw in HARDWARE.values():
        if any(pattern in device_name for pattern in hw.device_name_patterns):
            return hw
    return None
