"""jax_impl.per_block: the host runs the blocks, one compiled forward and backward per span of blocks.

Checked against the scanned one-program step (``jax_impl.train.make_train_step``), the independent reference
here: from the same initial weights (an unrolled model is drawn by the scanned model's initializer, so the
same seed gives the same weights, checked too), 3 AdamW steps give the same losses and final weights, on one
device and on an fsdp=2 mesh, under remat policies, with spans of 1, 2 and 3 blocks over 3 blocks (a shorter
last span), with gradient accumulation, and through the ahead-of-time compiled programs; the evaluation loss
matches; the step's loss is ready only when the update is (it leaves the update's program); bad arguments raise
one-line ValueErrors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jax_impl.bench.e2e import main as e2e_main  # noqa: E402
from jax_impl.model import to_numpy_weights  # noqa: E402
from jax_impl.per_block import PerBlockStep  # noqa: E402
from jax_impl.sharding import create_sharded_model, make_mesh  # noqa: E402
from jax_impl.train import ShardedTrainer  # noqa: E402
from parallelism_calc.cli import BadInput  # noqa: E402
from parallelism_calc.specs import MODELS, ParallelSpec  # noqa: E402

SPEC = MODELS["tiny"].replace(name="tiny3", n_layers=3)
BATCH, SEQ, STEPS = 4, 16, 3
# eps 1e-3 keeps the comparison well conditioned: Adam moves a weight by up to lr * dg / eps for a gradient error dg
# near a zero gradient, and the two programs reassociate float sums differently (dg ~ 1e-8). With eps 1e-5 the
# worst weight of 12 seeds sat at 0.15-0.35 of atol and one CI run's at 1.02; with 1e-3, 0.003-0.008 of it.
HP = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)


def _devices(n: int) -> list:
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"need {n} JAX CPU devices, got {len(devices)} (tests/conftest.py sets XLA_FLAGS)")
    return devices[:n]


def _batches(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, SPEC.vocab_size, size=(BATCH, SEQ + 1), dtype=np.int32) for _ in range(STEPS)]


def _run(trainer: ShardedTrainer, batches) -> tuple[list[float], dict]:
    with jax.default_matmul_precision("highest"):
        losses = [float(trainer.step(b)) for b in batches]
    return losses, to_numpy_weights(trainer.model)


def _pair(mesh, strategy, seed, **kw):
    scanned = ShardedTrainer(SPEC, mesh, strategy, seed=seed, **HP, **kw)
    per_block = ShardedTrainer(SPEC, mesh, strategy, seed=seed, block_loop="per_block",
                               blocks_per_program=kw.pop("blocks_per_program", 1), **HP, **kw)
    return scanned, per_block


def _assert_same_steps(scanned, per_block, batches, rtol=1e-5):
    before = to_numpy_weights(scanned.model)
    (losses_s, weights_s), (losses_p, weights_p) = _run(scanned, batches), _run(per_block, batches)
    np.testing.assert_allclose(losses_p, losses_s, rtol=rtol)
    assert max(np.abs(weights_s[n] - before[n]).max() for n in before) > 100 * HP["lr"] * 1e-3  # they moved
    for name, value in weights_s.items():
        np.testing.assert_allclose(weights_p[name], value, rtol=rtol, atol=HP["lr"] * 1e-3, err_msg=name)


def test_unrolled_model_draws_the_scanned_weights():
    seed = int(np.random.default_rng().integers(2**31))
    mesh = make_mesh(ParallelSpec(), _devices(1))
    scanned = to_numpy_weights(create_sharded_model(SPEC, mesh, "dp", seed=seed))
    unrolled = create_sharded_model(SPEC, mesh, "dp", seed=seed, scan_layers=False)
    assert not unrolled.scan_layers
    for name, value in to_numpy_weights(unrolled).items():
        np.testing.assert_array_equal(value, scanned[name], err_msg=name)


@pytest.mark.parametrize("remat,span", [("none", 1), ("qkv_mlp_norms", 2), ("dots_attention", 3),
                                        ("qkv_mlp_norms_product", 2)])
def test_per_block_takes_the_scanned_steps(remat, span):
    seed = int(np.random.default_rng().integers(2**31))
    scanned, per_block = _pair(make_mesh(ParallelSpec(), _devices(1)), "dp", seed, remat=remat,
                               blocks_per_program=span)
    assert isinstance(per_block.train_step, PerBlockStep) and per_block.train_step.blocks_per_program == span
    _assert_same_steps(scanned, per_block, _batches(seed))


def test_per_block_on_an_fsdp_mesh_with_accumulation_and_bf16_weights():
    mesh = make_mesh(ParallelSpec(fsdp=2), _devices(2))
    scanned, per_block = _pair(mesh, "fsdp", 1, remat="qkv_mlp", grad_accum=2, blocks_per_program=2,
                               param_dtype=jnp.bfloat16)
    _assert_same_steps(scanned, per_block, _batches(1), rtol=2e-2)  # bf16 weights: a bf16 unit per step


def test_compiled_programs_step_and_evaluate_as_the_scan():
    scanned, per_block = _pair(make_mesh(ParallelSpec(), _devices(1)), "dp", 2, blocks_per_program=2)
    for trainer in (scanned, per_block):
        assert trainer.compile(BATCH, SEQ) > 0
    # spans of 2 and 1 over 3 blocks: a forward and a backward for the first span (the embedding in front) and
    # for the span of 1, the head's program and the update's
    assert len(per_block.train_step._compiled) == 6
    assert "HloModule" in per_block.train_step.as_text()
    batches = _batches(2)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(float(per_block.eval_loss(batches[0])), float(scanned.eval_loss(batches[0])),
                                   rtol=1e-6)
    _assert_same_steps(scanned, per_block, batches)


def test_the_loss_is_ready_only_with_the_update(monkeypatch):
    """The step's loss is an output of the update's program (a benchmark that waits on it times the step)."""
    trainer = ShardedTrainer(SPEC, make_mesh(ParallelSpec(), _devices(1)), "dp", block_loop="per_block", **HP)
    step = trainer.train_step
    update, outputs = step._update, []

    def recording(*args):
        out = update(*args)
        outputs.append(out[-1])
        return out

    monkeypatch.setattr(step, "_update", recording)
    loss = trainer.step(_batches(3)[0])
    assert outputs and loss is outputs[-1]


def test_bad_arguments_raise():
    mesh = make_mesh(ParallelSpec(), _devices(1))
    with pytest.raises(ValueError, match="accepted: scan, unrolled, per_block"):
        ShardedTrainer(SPEC, mesh, "dp", block_loop="python", **HP)
    with pytest.raises(ValueError, match="blocks_per_program=0 must be >= 1"):
        ShardedTrainer(SPEC, mesh, "dp", block_loop="per_block", blocks_per_program=0, **HP)
    scanned = create_sharded_model(SPEC, mesh, "dp")
    with pytest.raises(ValueError, match="scan_layers=False"):
        PerBlockStep(scanned, None, None, None, None)


def test_e2e_runs_per_block_and_rejects_other_modes(tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    args = ["--model", "tiny", "--batch-size", "2", "--seq-len", "16", "--dtype", "fp32", "--warmup", "1",
            "--steps", "2", "--block-loop", "per_block", "--blocks-per-program", "2", "--out", str(out)]
    assert e2e_main(args) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["status"] == "ok" and row["implementation"].endswith("per_block")
    assert row["metrics"]["block_loop"] == "per_block" and row["metrics"]["blocks_per_program"] == 2
    with pytest.raises(BadInput, match="times --mode train_step only, not forward"):
        e2e_main([*args, "--mode", "forward"])
