"""The sharded JAX train step's per-device state against ``parallelism_calc.memory.per_device_memory``.

XLA's ``memory_analysis()`` of the compiled step (8 fake CPU devices) reports each device's argument bytes:
parameters, AdamW moments and step count, the RoPE tables and its slice of the token batch. The calculator
predicts the state (params + master + optimizer) per device for the same strategy; the rest is counted here
by hand. DP, FSDP and FSDP x TP (where the norm gains, with no TP dimension, are split over fsdp only) agree
to the byte.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jax_impl.sharding import make_mesh  # noqa: E402
from jax_impl.train import ShardedTrainer  # noqa: E402
from parallelism_calc.memory import per_device_memory  # noqa: E402
from parallelism_calc.specs import MODELS, ParallelSpec  # noqa: E402

SPEC = MODELS["tiny"]
B, T = 8, 32
FP32, ADAM_COUNT = 4, 4  # bytes per fp32 value; optax's int32 step count


@pytest.mark.parametrize("mesh_text, strategy, calc_strategy", [
    ("dp=8", "dp", "ddp"), ("fsdp=8", "fsdp", "fsdp"), ("fsdp=4,tp=2", "fsdp_tp", "fsdp_tp")])
def test_compiled_state_bytes_match_the_calculator(mesh_text, strategy, calc_strategy):
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs 8 JAX CPU devices (tests/conftest.py sets XLA_FLAGS)")
    mesh = make_mesh(mesh_text, jax.devices("cpu")[:8])
    trainer = ShardedTrainer(SPEC, mesh, strategy, lr=1e-3)
    tokens = trainer.place_batch(np.zeros((B, T + 1), np.int32))
    compiled = trainer.train_step.lower(trainer.params, trainer.opt_state, trainer.rest, tokens).compile()
    arguments = compiled.memory_analysis().argument_size_in_bytes

    parallel = ParallelSpec.parse(mesh_text)
    predicted = per_device_memory(SPEC, calc_strategy, parallel, B * T, T, "fp32")
    state = predicted.params + predicted.master + predicted.optimizer  # 4 + 0 + 8 bytes per parameter, sharded
    rope = 2 * SPEC.context_length * (SPEC.d_head // 2) * FP32  # cos and sin tables, replicated
    batch = B * (T + 1) * FP32 // (parallel.dp * parallel.fsdp)  # int32 token ids, split over dp x fsdp
    assert arguments == state + rope + batch + ADAM_COUNT
