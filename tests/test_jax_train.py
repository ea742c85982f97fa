"""jax_impl.train on 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS before jax is imported).

Checked: 3 AdamW steps of ``tiny`` (one block) on meshes dp=8, fsdp=8, fsdp=4 x tp=2, dp=4 x tp=2 and
dp=2 x fsdp=2 x tp=2 give
the same losses and final parameters as the same trainer on a 1-device mesh (float32, highest matmul
precision, rtol 1e-5); afterwards parameters are placed as the rules say and each AdamW moment has its
parameter's sharding; donated buffers are really consumed (and the steps after still work); every remat policy
gives the same steps; bf16 compute keeps fp32 master weights; bf16 weights step float32 masters (AdamW
against float64); scanned (stacked) and unrolled blocks take the
same steps from the same weights; every block's input and output is pinned to the
batch sharding in the lowered step; bad batches raise ValueError.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jax_impl.sharding import assert_params_sharded, make_mesh  # noqa: E402
from jax_impl.model import to_numpy_weights  # noqa: E402
from jax_impl.train import REMAT_POLICIES, ShardedTrainer, make_loss_fn  # noqa: E402
from parallelism_calc.specs import MODELS, ParallelSpec  # noqa: E402

TINY1 = MODELS["tiny"].replace(name="tiny1", n_layers=1)  # one block: half the compile time
BATCH, SEQ, STEPS = 8, 16, 3
# A large lr so 3 steps move the weights visibly. eps 1e-5 (torch's default is 1e-8) keeps the comparison
# well conditioned: Adam's first update is lr * g / (|g| + eps), about lr * sign(g), so a gradient entry near
# zero whose float reassociation differs across meshes by ~1e-9 moves its weight by up to lr * 1e-9 / eps.
HP = dict(lr=1e-2, weight_decay=0.1, seed=0, eps=1e-5)

MESHES = {  # id -> (ParallelSpec, strategy)
    "dp8": (ParallelSpec(dp=8), "dp"),
    "fsdp8": (ParallelSpec(fsdp=8), "fsdp"),
    "fsdp4xtp2": (ParallelSpec(fsdp=4, tp=2), "fsdp_tp"),
    "dp4xtp2": (ParallelSpec(dp=4, tp=2), "tp"),
    "dp2xfsdp2xtp2": (ParallelSpec(dp=2, fsdp=2, tp=2), "fsdp_tp"),
}


def _cpu_devices(n: int) -> list:
    try:
        devices = jax.devices("cpu")
    except RuntimeError as e:
        pytest.skip(f"no JAX CPU backend ({e})")
    if len(devices) < n:
        pytest.skip(f"need {n} JAX CPU devices, got {len(devices)} (tests/conftest.py sets XLA_FLAGS)")
    return devices[:n]


def _batches(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY1.vocab_size, size=(BATCH, SEQ + 1), dtype=np.int32) for _ in range(STEPS)]


def _run(trainer: ShardedTrainer, batches) -> tuple[list[float], dict]:
    with jax.default_matmul_precision("highest"):
        losses = [float(trainer.step(b)) for b in batches]
    params = {".".join(map(str, path)): np.asarray(jax.device_get(v.get_value()))
              for path, v in nnx.to_flat_state(trainer.params)}
    return losses, params


@pytest.fixture(scope="module")
def reference():
    """The same 3 steps on a 1-device mesh."""
    mesh = make_mesh(ParallelSpec(), _cpu_devices(1))
    return _run(ShardedTrainer(TINY1, mesh, "dp", **HP), _batches())


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_steps_match_single_device(name, reference):
    parallel, strategy = MESHES[name]
    mesh = make_mesh(parallel, _cpu_devices(8))
    trainer = ShardedTrainer(TINY1, mesh, strategy, **HP)
    old_param, old_moment = jax.tree.leaves(trainer.params)[0], jax.tree.leaves(trainer.opt_state)[-1]
    losses, params = _run(trainer, _batches())  # steps 2 and 3 run on the state step 1 returned
    ref_losses, ref_params = reference

    # Donation: the first step consumed the initial buffers (jax >= 0.4.30 donates on CPU too).
    assert old_param.is_deleted() and old_moment.is_deleted()

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains
    assert params.keys() == ref_params.keys()
    for key in params:
        # rtol 1e-5 plus 0.1% of one step's size for the near-zero-gradient entries (see HP above).
        np.testing.assert_allclose(params[key], ref_params[key], rtol=1e-5, atol=HP["lr"] * 1e-3, err_msg=key)

    # Placement after the steps: parameters as the rules say, each AdamW moment like its parameter.
    assert_params_sharded(trainer.model, mesh, strategy)
    adam = [s for s in jax.tree.leaves(trainer.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1
    flat_params = dict(nnx.to_flat_state(trainer.params))
    for moments in (adam[0].mu, adam[0].nu):
        flat = dict(nnx.to_flat_state(moments))
        assert flat.keys() == flat_params.keys()
        for path, moment in flat.items():
            p, m = flat_params[path].get_value(), moment.get_value()
            assert m.dtype == jnp.float32
            assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (path, m.sharding, p.sharding)
    assert adam[0].count.sharding.is_fully_replicated


@pytest.mark.parametrize("remat", [r for r in REMAT_POLICIES if r != "none"])
def test_every_remat_policy_gives_the_same_steps(remat, reference):
    # One device: remat is a mesh-independent code path, and a 1-device compile is the cheapest.
    mesh = make_mesh(ParallelSpec(), _cpu_devices(1))
    losses, params = _run(ShardedTrainer(TINY1, mesh, "dp", remat=remat, **HP), _batches())
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    for key in params:
        np.testing.assert_allclose(params[key], reference[1][key], rtol=1e-5, atol=HP["lr"] * 1e-3, err_msg=key)


def test_bf16_compute_keeps_fp32_master_weights(reference):
    mesh = make_mesh(ParallelSpec(), _cpu_devices(1))
    trainer = ShardedTrainer(TINY1, mesh, "dp", compute_dtype=jnp.bfloat16, remat="full", **HP)
    losses, _ = _run(trainer, _batches())
    assert trainer.model.dtype == jnp.bfloat16
    for leaf in jax.tree.leaves(trainer.params):  # fp32 master weights
        assert leaf.dtype == jnp.float32
    np.testing.assert_allclose(losses, reference[0], rtol=2e-2)  # bf16 matmuls, fp32 loss


def test_bf16_weights_step_their_float32_masters():
    """``param_dtype=bf16`` (``--dtype bf16_mixed``): bf16 parameters, float32 masters sharded like them; one
    step moves the masters as float64 AdamW on the gradient taken at the bf16 weights, and the new parameters
    are the new masters rounded to bf16; loaded weights become the masters exactly."""
    mesh = make_mesh(ParallelSpec(fsdp=2), _cpu_devices(2))
    trainer = ShardedTrainer(TINY1, mesh, "fsdp", param_dtype=jnp.bfloat16, remat="dots", **HP)
    rng = np.random.default_rng(1)
    weights = {name: rng.standard_normal(w.shape).astype(np.float32) * 0.1
               for name, w in to_numpy_weights(trainer.master_model).items()}
    trainer.load_weights(weights)
    assert to_numpy_weights(trainer.master_model).keys() == weights.keys()
    for name, master in to_numpy_weights(trainer.master_model).items():
        np.testing.assert_array_equal(master, weights[name], err_msg=name)
    assert trainer.model.dtype == jnp.bfloat16
    for param, master in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(trainer.opt_state.master)):
        assert param.dtype == jnp.bfloat16 and master.dtype == jnp.float32
        assert master.sharding.is_equivalent_to(param.sharding, param.ndim)
        np.testing.assert_array_equal(np.asarray(param), np.asarray(master.astype(jnp.bfloat16)))

    tokens = trainer.place_batch(_batches()[0])
    loss_fn = make_loss_fn(trainer.graphdef, trainer.batch_sharding, remat="dots")
    grads = jax.jit(jax.grad(loss_fn))(trainer.params, trainer.rest, tokens)  # at the bf16 weights
    before = {k: np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(trainer.opt_state.master)}
    trainer.step(np.asarray(jax.device_get(tokens)))
    b1, b2, lr, eps, wd = 0.9, 0.999, HP["lr"], HP["eps"], HP["weight_decay"]
    masters, params = dict(nnx.to_flat_state(trainer.opt_state.master)), dict(nnx.to_flat_state(trainer.params))
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g.get_value(), np.float64)
        m_hat, v_hat = (1 - b1) * g / (1 - b1), (1 - b2) * g * g / (1 - b2)  # Adam's first, bias-corrected step
        expected = before[path] - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * before[path])
        master = masters[path].get_value()
        np.testing.assert_allclose(np.asarray(master), expected, rtol=1e-5, atol=1e-7, err_msg=str(path))
        np.testing.assert_array_equal(np.asarray(params[path].get_value()), np.asarray(master.astype(jnp.bfloat16)))


@pytest.mark.parametrize("remat,compute_dtype,rtol", [("none", None, 1e-6), ("dots", None, 1e-6),
                                                     ("dots_attention", jnp.bfloat16, 1e-3)])
def test_scanned_and_unrolled_blocks_take_the_same_steps(remat, compute_dtype, rtol):
    """The same weights, stacked and scanned or as separate blocks in a loop: the same losses and weights
    (in bf16 the scan casts all layers' kernels at once, the loop each layer's: the same values)."""
    spec = TINY1.replace(n_layers=3)
    mesh = make_mesh(ParallelSpec(fsdp=2), _cpu_devices(2))
    scanned = ShardedTrainer(spec, mesh, "fsdp", remat=remat, compute_dtype=compute_dtype, **HP)
    unrolled = ShardedTrainer(spec, mesh, "fsdp", remat=remat, compute_dtype=compute_dtype, block_loop="unrolled",
                              **HP)
    assert scanned.model.scan_layers and not unrolled.model.scan_layers
    unrolled.load_weights(to_numpy_weights(scanned.model))
    scanned_losses, _ = _run(scanned, _batches())
    unrolled_losses, _ = _run(unrolled, _batches())
    np.testing.assert_allclose(scanned_losses, unrolled_losses, rtol=rtol)
    after_scanned, after_unrolled = to_numpy_weights(scanned.model), to_numpy_weights(unrolled.model)
    for name in after_scanned:
        np.testing.assert_allclose(after_scanned[name], after_unrolled[name], rtol=1e-5, atol=HP["lr"] * 1e-3,
                                   err_msg=name)


def test_block_activations_are_pinned_to_the_batch_sharding():
    spec = TINY1.replace(n_layers=2)
    mesh = make_mesh(ParallelSpec(dp=2, fsdp=2, tp=2), _cpu_devices(8))
    trainer = ShardedTrainer(spec, mesh, "fsdp_tp", **HP)
    tokens = trainer.place_batch(_batches()[0])
    text = trainer.train_step.lower(trainer.params, trainer.opt_state, trainer.rest, tokens).as_text()
    activation = f"tensor<{BATCH}x{SEQ}x{spec.d_model}x"  # a (B, T, d) block input or output
    # Shardy (sdy.sharding_constraint ... [{"dp", "fsdp"}, {}, {}]) or GSPMD (@Sharding, mhlo.sharding attr).
    pinned = [line for line in text.splitlines() if activation in line and (
        ('sharding_constraint' in line and '[{"dp", "fsdp"}, {}, {}]' in line) or "@Sharding" in line)]
    assert len(pinned) >= 2 * spec.n_layers, text[:2000]


def test_bad_batches_raise():
    mesh = make_mesh(ParallelSpec(dp=4, tp=2), _cpu_devices(8))
    trainer = ShardedTrainer(TINY1, mesh, "tp", **HP)
    assert trainer.data_parallel_degree == 4
    tokens = np.zeros((6, SEQ + 1), np.int32)
    with pytest.raises(ValueError, match="not divisible by the data-parallel degree 4"):
        trainer.step(tokens)
    with pytest.raises(ValueError, match="integers"):
        trainer.step(np.zeros((4, SEQ + 1), np.float32))
    with pytest.raises(ValueError, match=r"\(batch, seq \+ 1\)"):
        trainer.step(np.zeros((4,), np.int32))
    with pytest.raises(ValueError):
        trainer.step(np.zeros((4, TINY1.context_length + 2), np.int32))  # longer than the context
