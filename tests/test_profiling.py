"""Kernel categories and the e2e benchmark's profile, checkpointing and compile flags on a tiny model."""

import json

import pytest

from analysis.records import read_records
from torch_impl.bench import e2e
from torch_impl.profiling import CATEGORIES, categorize

FLAGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--steps", "2", "--device", "cpu"]


@pytest.mark.parametrize("name,category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel__5x_cublas",
     "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "matmul"),
    ("aten::mm", "matmul"),
    ("_attn_fwd", "matmul"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "reduction-softmax"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "reduction-softmax"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("aten::silu", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
])
def test_categorize(name, category):
    assert categorize(name) == category


def test_e2e_profile_checkpoint_and_fused_flags(tmp_path):
    out, prof = tmp_path / "runs.jsonl", tmp_path / "prof"
    assert e2e.main([*FLAGS, "--ac-every", "1", "--fused-adamw", "off", "--profile", str(prof),
                     "--out", str(out)]) == 0
    record, = read_records(out)
    assert record.implementation == "eager naive, ckpt 1" and record.metrics["fused_adamw"] is False
    shares = [record.metrics[f"time_share.{c}"] for c in CATEGORIES]
    assert sum(shares) == pytest.approx(1.0) and record.metrics["time_share.matmul"] > 0
    trace = json.loads((prof / "tiny_2x16_train_step_fp32_trace.json").read_text())
    assert trace["traceEvents"]
    assert "| matmul |" in (prof / "tiny_2x16_train_step_fp32_kernels.md").read_text()
    with pytest.raises(SystemExit, match="needs --ac-every"):
        e2e.main([*FLAGS, "--nested-checkpoint"])


def test_records_carry_the_predicted_activation_memory(tmp_path):
    from parallelism_calc.memory import activation_bytes_per_token
    from parallelism_calc.specs import MODELS

    out = tmp_path / "runs.jsonl"
    long = ["--seq-len", "64"]
    for extra in ([], ["--mode", "forward"], ["--ac-every", "2"], long, [*long, "--attention", "sdpa"]):
        assert e2e.main([*FLAGS, *extra, "--out", str(out)]) == 0
    records = read_records(out)
    plain, forward, segments, naive64, sdpa64 = (r.metrics["predicted_activation_bytes"] for r in records)
    tiny = MODELS["tiny"]
    assert plain == activation_bytes_per_token(tiny, 16, "fp32", "none", "naive").total_bytes * 2 * 16
    assert forward is None  # nothing saved for backward
    # tiny has 2 blocks: one segment of 2 keeps its input and both blocks' activations while recomputed.
    a = activation_bytes_per_token(tiny, 16, "fp32", "full", "naive").per_layer_bytes
    assert segments == plain + a * 2 * 16
    assert 0 < sdpa64 < naive64  # at 64 tokens the n x n probabilities outweigh a fused kernel's extra O
    # The train step's predicted peak: those activations plus weights, gradients and AdamW state (16 B/param).
    assert records[0].metrics["predicted_peak_bytes"] == plain + 16 * tiny.n_params()
    assert records[1].metrics["predicted_peak_bytes"] is None
