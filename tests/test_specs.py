"""Specs: exact parameter counts, validation, presets, and the calculator's import hygiene and CLI."""

import subprocess
import sys

import pytest

from parallelism_calc.specs import HARDWARE, MODELS, ModelSpec, ParallelSpec, get_hardware, get_model, hardware_for_device

# The counts the CS336 assignment 2 table implies (the numbers).
CS336_COUNTS = {"small": 128_625_408, "medium": 423_183_360, "large": 969_411_840, "xl": 1_998_235_200,
                "2.7B": 3_406_809_600}


@pytest.mark.parametrize("name,count", CS336_COUNTS.items())
def test_cs336_parameter_counts_are_exact(name, count):
    assert MODELS[name].n_params() == count


def hand_count(vocab, d, ff, layers):
    """Written out independently: per block 4 d^2 (attention) + 3 d ff (SwiGLU) + 2 d (norms)."""
    return vocab * d + layers * (4 * d * d + 3 * d * ff + 2 * d) + d + d * vocab


def test_other_presets_against_hand_counts():
    assert MODELS["10B"].n_params() == hand_count(10_000, 4608, 12288, 50)
    assert MODELS["lm8b"].n_params() == hand_count(151_936, 4096, 11_008, 34)
    assert MODELS["xxl"].n_params() == 126 * 2 * 16_384 * 53_248  # FFN-only: two matrices per block
    assert (MODELS["lm8b"].context_length, MODELS["lm8b"].n_heads) == (32_768, 32)


def test_model_spec_validation():
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        ModelSpec("bad", vocab_size=10, context_length=8, d_model=30, d_ff=8, n_layers=1, n_heads=4)
    with pytest.raises(ValueError, match="arch"):
        ModelSpec("bad", vocab_size=10, context_length=8, d_model=32, d_ff=8, n_layers=1, n_heads=4, arch="moe")
    with pytest.raises(ValueError, match="n_layers"):
        MODELS["tiny"].replace(n_layers=0)
    with pytest.raises(ValueError, match="accepted: tiny"):
        get_model("huge")
    assert MODELS["small"].replace(context_length=4096).context_length == 4096


def test_parallel_spec_resolves_and_validates():
    assert ParallelSpec(fsdp=16, tp=4).world_size == 64
    assert ParallelSpec(dp=-1, tp=2).resolve(8) == ParallelSpec(dp=4, tp=2)
    assert ParallelSpec.parse("dp=2, fsdp=4") == ParallelSpec(dp=2, fsdp=4, tp=1)
    with pytest.raises(ValueError, match="!= world size"):
        ParallelSpec(fsdp=4).resolve(8)
    with pytest.raises(ValueError, match="not divisible"):
        ParallelSpec(fsdp=-1, tp=3).resolve(8)
    with pytest.raises(ValueError, match="at most one"):
        ParallelSpec(dp=-1, fsdp=-1)
    with pytest.raises(ValueError, match="positive integer"):
        ParallelSpec(tp=0)
    with pytest.raises(ValueError, match="resolve"):
        ParallelSpec(dp=-1).world_size
    with pytest.raises(ValueError, match="cannot parse"):
        ParallelSpec.parse("pp=2")


def test_hardware_presets_and_lookup():
    assert set(HARDWARE) == {"h100", "h200", "b200", "tpu_v5p"}
    assert get_hardware("tpu_v5p").bf16_flops == 4.59e14
    assert hardware_for_device("NVIDIA H100 80GB HBM3").name == "h100"
    assert hardware_for_device("NVIDIA H200").name == "h200"
    assert hardware_for_device("cpu") is None
    for hw in HARDWARE.values():  # dense bf16 is the faster rate, and memory bandwidth beats the fabric's
        assert hw.bf16_flops > (hw.fp32_flops or 0) and hw.memory_bw > hw.interconnect_bw


def test_calculator_imports_no_framework():
    code = ("import sys, parallelism_calc, parallelism_calc.specs, parallelism_calc.compute, "
            "parallelism_calc.__main__, parallelism_calc.collectives, parallelism_calc.scaling; "
            "print(sorted(m for m in ('torch', 'jax', 'pandas', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
