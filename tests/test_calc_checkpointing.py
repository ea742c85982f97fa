"""parallelism_calc.checkpointing against hand counts from the per-block terms, and its limits.

a = one block input, b = one block's saved activations, e = extras (each checked against
``activation_bytes_per_token`` and, there, against what the real model saves: tests/test_calc_memory.py).
"""

import math

import pytest

from parallelism_calc.checkpointing import best_checkpoint_every, checkpointed_activation_bytes
from parallelism_calc.memory import activation_bytes_per_token
from parallelism_calc.specs import MODELS

SPEC = MODELS["2.7B"]  # 32 blocks


def _abe(precision="bf16_autocast", attention="flash", seq=2048):
    none = activation_bytes_per_token(SPEC, seq, precision, "none", attention)
    full = activation_bytes_per_token(SPEC, seq, precision, "full", attention)
    return full.per_layer_bytes, none.per_layer_bytes, none.extra_bytes


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 31, 32, 40])
def test_flat_and_nested_by_hand(k):
    a, b, e = _abe()
    assert a == SPEC.d_model * 4  # the residual stream between blocks, fp32 under autocast
    segments, largest = math.ceil(32 / k), min(k, 32)
    flat = checkpointed_activation_bytes(SPEC, 2048, "bf16_autocast", k, False, "flash")
    nested = checkpointed_activation_bytes(SPEC, 2048, "bf16_autocast", k, True, "flash")
    assert flat.total_bytes == segments * a + largest * b + e
    assert nested.total_bytes == segments * a + (largest - 1) * a + b + e
    assert flat.for_tokens(8192) == 8192 * flat.total_bytes
    assert nested.total_bytes <= flat.total_bytes


def test_limits_match_the_uniform_policies():
    full = activation_bytes_per_token(SPEC, 2048, "fp32", "full", "naive").total_bytes
    none = activation_bytes_per_token(SPEC, 2048, "fp32", "none", "naive")
    assert checkpointed_activation_bytes(SPEC, 2048, "fp32", 1, False, "naive").total_bytes == full
    # One segment of everything keeps what no checkpointing keeps, plus that segment's input.
    a = activation_bytes_per_token(SPEC, 2048, "fp32", "full", "naive").per_layer_bytes
    assert checkpointed_activation_bytes(SPEC, 2048, "fp32", 32, False, "naive").total_bytes == none.total_bytes + a


def test_best_k_by_brute_force():
    # Blocks keep ~13.5x their input, under the 16x that makes k = 2 cost more than k = 1 (32 a + b against
    # 16 a + 2 b), so flat checkpointing is best at k = 2; nested near sqrt(32) ~ 5.7.
    a, b, e = _abe()
    brute_flat = min(range(1, 33), key=lambda k: (math.ceil(32 / k) * a + k * b, k))
    brute_nested = min(range(1, 33), key=lambda k: (math.ceil(32 / k) * a + (k - 1) * a + b, k))
    assert 13 < b / a < 14
    assert best_checkpoint_every(SPEC, 2048, "bf16_autocast", False, "flash") == brute_flat == 2
    assert best_checkpoint_every(SPEC, 2048, "bf16_autocast", True, "flash") == brute_nested
    assert 4 <= brute_nested <= 8


def test_bad_k():
    with pytest.raises(ValueError, match="must be >= 1"):
        checkpointed_activation_bytes(SPEC, 2048, every=0)


def test_kept_attention_adds_the_outputs_of_the_blocks_not_yet_recomputed():
    """The timeline peak with each block's attention output (D bf16 values) and log-sum-exp (H fp32 values) kept
    per token, checkpoints at every block: at the last block's backward (lm8b's peak either way) the 33 blocks
    before it keep theirs."""
    from parallelism_calc.memory import per_device_memory
    from parallelism_calc.roofline import causal_core_flops, recompute_flops

    spec, tokens, seq = MODELS["lm8b"], 32_768, 32_768
    common = dict(attention="flash", checkpoint_every=1, loss="fused", peak_model="timeline")
    plain = per_device_memory(spec, "fsdp", 2, 2 * tokens, seq, **common)
    kept = per_device_memory(spec, "fsdp", 2, 2 * tokens, seq, kept_attention=True, **common)
    last = spec.n_layers - 1
    assert plain.peak_at == kept.peak_at == f"backward, block {last}"
    assert kept.total - plain.total == pytest.approx(last * tokens * (spec.d_model * 2 + 4 * spec.n_heads))
    recomputed = recompute_flops(spec, 1, seq, 1, loss="fused") - recompute_flops(spec, 1, seq, 1, loss="fused",
                                                                                  kept_attention=True)
    assert recomputed == pytest.approx(causal_core_flops(spec, 1, seq))
    with pytest.raises(ValueError, match="not nested"):
        per_device_memory(spec, "fsdp", 2, 2 * tokens, seq, **{**common, "nested_checkpoint": True},
                          kept_attention=True)
    with pytest.raises(ValueError, match="timeline"):
        per_device_memory(spec, "fsdp", 2, 2 * tokens, seq, attention="flash", checkpoint_every=1, kept_attention=True)
