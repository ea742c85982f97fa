"""The step-time floor (``parallelism_calc.roofline``) against a hand count of one small model's products and
bytes, written out term by term."""

import pytest

from parallelism_calc.roofline import Ceilings, StepFloor, comm_seconds, matmul_flops, step_time_floor
from parallelism_calc.specs import ModelSpec

SPEC = ModelSpec(name="hand", d_model=64, d_ff=128, n_layers=2, n_heads=4, vocab_size=100, context_length=8)
BATCH, SEQ = 2, 8
TOKENS = BATCH * SEQ


def hand_forward_products() -> int:
    """Every product of one forward as (rows, inner, columns), 2 FLOPs per multiply-add; causal attention's
    score and value products over half of the T x T matrix."""
    per_layer = [(TOKENS, 64, 64)] * 4  # q, k, v, output projections
    per_layer += [(TOKENS, 64, 128)] * 2 + [(TOKENS, 128, 64)]  # W1, W3, W2
    attention = 2 * (2 * BATCH * SEQ * SEQ * 64) // 2  # QK^T and PV over all heads, the unmasked half
    head = 2 * TOKENS * 64 * 100
    return 2 * (sum(2 * m * k * n for m, k, n in per_layer) + attention) + head


def test_matmul_flops_count_the_unmasked_half_of_causal_attention():
    assert hand_forward_products() == 2_859_008
    assert matmul_flops(SPEC, BATCH, SEQ, "forward") == 2_859_008
    assert matmul_flops(SPEC, BATCH, SEQ, "train_step") == 3 * 2_859_008


def test_every_part_of_the_floor_by_hand():
    ceilings = Ceilings(matmul_flops=1e12, memory_bw=1e11, bus_bw=1e9)
    params = SPEC.n_params()
    # elements a token and block: forward 12 d + 3 d_ff = 1,152; backward 15 d + 5 d_ff = 1,600
    elementwise = (12 * 64 + 3 * 128 + 15 * 64 + 5 * 128) * 2 * TOKENS * 2  # bf16, 16 tokens, 2 blocks
    assert elementwise == 176_128
    floor = step_time_floor(SPEC, BATCH, SEQ, "train_step", "bf16_autocast", ceilings, "ddp", 2)
    assert floor.matmul_s == pytest.approx(3 * 2_859_008 / 1e12)
    assert floor.optimizer_s == pytest.approx(28 * params / 1e11)  # AdamW: 16 bytes read, 12 written
    assert floor.casts_s == pytest.approx(12 * params / 1e11)  # fp32 -> bf16 weights, bf16 -> fp32 gradients
    assert floor.elementwise_s == pytest.approx(elementwise / 1e11)
    assert floor.comm_s == pytest.approx(2 * (1 / 2) * params * 4 / 1e9)  # ring all-reduce of fp32 gradients
    assert floor.total_s == pytest.approx(sum(vars(floor).values()))
    mixed = step_time_floor(SPEC, BATCH, SEQ, "train_step", "bf16_mixed", ceilings)
    assert (mixed.casts_s, mixed.comm_s) == (0.0, 0.0)  # bf16 weights: no casts; one device: no communication
    forward = step_time_floor(SPEC, BATCH, SEQ, "forward", "fp32", ceilings)
    assert forward == StepFloor(2_859_008 / 1e12, 0.0, 0.0, (12 * 64 + 3 * 128) * 4 * TOKENS * 2 / 1e11, 0.0)


def test_a_measured_attention_rate_times_the_attention_core_apart():
    # the causal score and value products of one forward: 2 x (2 B S^2 d) / 2 a layer = 16,384; the attention
    # benchmark counts a fused kernel's forward and backward as 3.5 forwards (the backward recomputes the scores)
    core = 2 * BATCH * SEQ * SEQ * 64
    assert core == 16_384
    plain = Ceilings(matmul_flops=1e12, memory_bw=1e11)
    timed = Ceilings(matmul_flops=1e12, memory_bw=1e11, attention_flops=4e11)
    for mode, passes, forwards in (("train_step", 3.5, 3), ("forward", 1.0, 1)):
        without = step_time_floor(SPEC, BATCH, SEQ, mode, "bf16_autocast", plain)
        floor = step_time_floor(SPEC, BATCH, SEQ, mode, "bf16_autocast", timed)
        assert without.attention_s == 0.0  # no rate: attention's products stay in matmul_s
        assert floor.matmul_s == pytest.approx((forwards * 2_859_008 - forwards * 2 * core) / 1e12)
        assert floor.attention_s == pytest.approx(passes * 2 * core / 4e11)
        assert floor.total_s == pytest.approx(without.total_s - forwards * 2 * core / 1e12 + passes * 2 * core / 4e11)


def test_a_recomputed_attention_is_timed_at_its_rate_and_a_kept_one_not_at_all():
    """Checkpointed blocks recompute their forward (the LM head's product aside) in the backward: with a measured
    attention rate, the recomputed core (2 layers x one forward, 2 x 16,384) is timed in attention_s, not matmul_s;
    kept attention outputs (``kept_attention``) take it out of both."""
    core = 2 * BATCH * SEQ * SEQ * 64
    timed = Ceilings(matmul_flops=1e12, memory_bw=1e11, attention_flops=4e11)
    plain = step_time_floor(SPEC, BATCH, SEQ, "train_step", "bf16_autocast", timed)
    recomputed = step_time_floor(SPEC, BATCH, SEQ, "train_step", "bf16_autocast", timed, recompute_blocks=1)
    kept = step_time_floor(SPEC, BATCH, SEQ, "train_step", "bf16_autocast", timed, recompute_blocks=1,
                           kept_attention=True)
    head = 2 * TOKENS * 64 * 100  # not in a block: not recomputed
    assert recomputed.matmul_s == pytest.approx(plain.matmul_s + (2_859_008 - head - 2 * core) / 1e12)
    assert kept.matmul_s == pytest.approx(recomputed.matmul_s)
    assert recomputed.attention_s == pytest.approx(plain.attention_s + 2 * core / 4e11)
    assert kept.attention_s == pytest.approx(plain.attention_s)


def test_fsdp_gathers_twice_and_reduce_scatters():
    seconds = comm_seconds(SPEC, "fsdp", 4, "bf16_mixed", bus_bw=1e9)
    assert seconds == pytest.approx((3 / 4) * SPEC.n_params() * (2 + 2 + 2) / 1e9)


@pytest.mark.parametrize("call, message", [
    (lambda: Ceilings(0.0, 1e9), "positive rates"),
    (lambda: Ceilings(1e12, 1e9, attention_flops=0.0), "positive rates"),
    (lambda: comm_seconds(SPEC, "tp", 2, "fp32", 1e9), "models none, ddp, fsdp"),
    (lambda: comm_seconds(SPEC, "ddp", 2, "fp32", None), "needs the measured bus bandwidth"),
    (lambda: matmul_flops(SPEC, 1, 8, "backward"), "accepted: forward"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
