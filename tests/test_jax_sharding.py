"""jax_impl.sharding on 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS before jax is imported).

Checked: meshes for every mesh the issue names (1 device, dp=8, fsdp=8, fsdp=4 x tp=2, dp=2 x fsdp=2 x tp=2)
with explicit Auto axis types; each strategy's rules give the expected PartitionSpec for every parameter
kind (written out by hand below, not derived from RULES); after ``shard_params`` and
``create_sharded_model`` each sharded parameter holds total / ways bytes per device and replicated ones
are whole; a jitted forward of the sharded ``tiny`` model equals the unsharded one (float32, highest
matmul precision, rtol 1e-5); bad inputs raise ValueError; the sharding checker rejects an unsharded model.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_impl.model import TransformerLM  # noqa: E402
from jax_impl.sharding import (  # noqa: E402
    RULES,
    STRATEGIES,
    assert_params_sharded,
    batch_sharding,
    create_sharded_model,
    expected_bytes_per_device,
    logical_to_spec,
    make_mesh,
    param_bytes_per_device,
    param_shardings,
    shard_params,
    strategy_for,
)
from parallelism_calc.specs import MODELS, ParallelSpec  # noqa: E402

N = 8
TINY = MODELS["tiny"]  # vocab 512, d_model 64, d_ff 176, 4 heads, 2 layers
TINY1 = TINY.replace(name="tiny1", n_layers=1)  # same shapes, one block: half the compile time


def _cpu_devices(n: int = N) -> list:
    try:
        devices = jax.devices("cpu")
    except RuntimeError as e:
        pytest.skip(f"no JAX CPU backend ({e})")
    if len(devices) < n:
        msg = f"need {n} JAX CPU devices, got {len(devices)} (tests/conftest.py sets XLA_FLAGS)"
        if jax.default_backend() == "cpu":
            pytest.fail(msg)
        pytest.skip(msg)
    return devices[:n]


MESHES = {  # id -> (ParallelSpec, number of devices)
    "1": (ParallelSpec(), 1),
    "dp8": (ParallelSpec(dp=-1), 8),
    "fsdp8": (ParallelSpec(fsdp=8), 8),
    "fsdp4xtp2": (ParallelSpec(fsdp=4, tp=2), 8),
    "dp2xfsdp2xtp2": (ParallelSpec(dp=2, fsdp=2, tp=2), 8),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_make_mesh(name):
    parallel, n = MESHES[name]
    devices = _cpu_devices(n)
    mesh = make_mesh(parallel, devices)
    resolved = parallel.resolve(n)
    assert mesh.axis_names == ("dp", "fsdp", "tp")
    assert dict(mesh.shape) == {"dp": resolved.dp, "fsdp": resolved.fsdp, "tp": resolved.tp}
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
    assert set(mesh.devices.flat) == set(devices)


def test_make_mesh_from_string_and_fill_in():
    mesh = make_mesh("fsdp=-1,tp=2", _cpu_devices())
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 4, "tp": 2}


def test_make_mesh_bad_degrees():
    with pytest.raises(ValueError, match="!= world size 8"):
        make_mesh(ParallelSpec(dp=2, tp=2), _cpu_devices())
    with pytest.raises(ValueError, match="not divisible"):
        make_mesh(ParallelSpec(dp=-1, tp=3), _cpu_devices())


# Expected specs written by hand per parameter kind (JAX layout: kernels (in, out)).
KINDS = {  # kind -> logical names
    "q_kernel": ("embed", "heads"),
    "output_proj": ("heads", "embed"),
    "w1": ("embed", "mlp"),
    "w2": ("mlp", "embed"),
    "embedding": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "norm_scale": ("embed",),
}
EXPECTED = {
    "dp": dict(q_kernel=P(), output_proj=P(), w1=P(), w2=P(), embedding=P(), lm_head=P(), norm_scale=P()),
    "fsdp": dict(q_kernel=P("fsdp"), output_proj=P(None, "fsdp"), w1=P("fsdp"), w2=P(None, "fsdp"),
                 embedding=P(None, "fsdp"), lm_head=P("fsdp"), norm_scale=P("fsdp")),
    "tp": dict(q_kernel=P(None, "tp"), output_proj=P("tp"), w1=P(None, "tp"), w2=P("tp"),
               embedding=P("tp"), lm_head=P(None, "tp"), norm_scale=P()),
    "fsdp_tp": dict(q_kernel=P("fsdp", "tp"), output_proj=P("tp", "fsdp"), w1=P("fsdp", "tp"),
                    w2=P("tp", "fsdp"), embedding=P("tp", "fsdp"), lm_head=P("fsdp", "tp"), norm_scale=P("fsdp")),
}
BATCH = {"dp": P(("dp", "fsdp")), "fsdp": P(("dp", "fsdp")), "tp": P(("dp", "fsdp")), "fsdp_tp": P(("dp", "fsdp"))}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rules_give_expected_specs(strategy):
    assert set(EXPECTED) == set(RULES)
    assert tuple(RULES) == STRATEGIES  # one table per strategy of parallelism_calc.scaling, in its order
    for kind, names in KINDS.items():
        assert logical_to_spec(names, strategy) == EXPECTED[strategy][kind], (strategy, kind)
    assert logical_to_spec(("batch", None), strategy) == BATCH[strategy]


def test_axis_used_once_per_array():
    # ("embed", "embed") under fsdp: the second dim cannot reuse "fsdp".
    assert logical_to_spec(("embed", "embed"), "fsdp") == P("fsdp")
    assert logical_to_spec(("unknown_name", "mlp"), "tp") == P(None, "tp")


def _stacked(spec: P) -> P:
    """The spec of a parameter stacked on a leading, unsharded "layers" axis (trailing Nones dropped)."""
    return P(None, *spec) if len(spec) else P()


@pytest.mark.parametrize("scan_layers", [True, False])
def test_model_params_follow_rules(scan_layers):
    """Every parameter of the real model gets the hand-written spec of its kind."""
    mesh = make_mesh(ParallelSpec(dp=2, fsdp=2, tp=2), _cpu_devices())
    model = TransformerLM(TINY, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    layer = model.layers if scan_layers else model.layers[0]
    in_layers = {"q_kernel", "output_proj", "w1", "w2", "norm_scale"}
    kinds = {
        "q_kernel": layer.attn.q_proj.kernel, "output_proj": layer.attn.output_proj.kernel,
        "w1": layer.ffn.w1.kernel, "w2": layer.ffn.w2.kernel, "embedding": model.token_embeddings.embedding,
        "lm_head": model.lm_head.kernel, "norm_scale": layer.ln1.scale,
    }
    for strategy in STRATEGIES:
        shard_params(model, mesh, strategy)
        for kind, param in kinds.items():
            got = param.get_value().sharding.spec
            want = EXPECTED[strategy][kind]
            assert got == (_stacked(want) if scan_layers and kind in in_layers else want), (strategy, kind, got)
        assert model.rope.cos.get_value().sharding.spec == P()


def _per_param_check(model, mesh, strategy):
    assert_params_sharded(model, mesh, strategy)
    per_device = param_bytes_per_device(model)
    assert set(per_device) == set(mesh.devices.flat)
    want = expected_bytes_per_device(model, mesh, strategy)
    assert set(per_device.values()) == {want}, (per_device, want)
    return want


@pytest.mark.parametrize("mesh_name,strategy", [
    ("1", "dp"), ("dp8", "dp"), ("fsdp8", "fsdp"), ("fsdp4xtp2", "fsdp_tp"), ("fsdp4xtp2", "tp"),
    ("dp2xfsdp2xtp2", "fsdp_tp"),
])
def test_shard_params_bytes_and_forward(mesh_name, strategy):
    parallel, n = MESHES[mesh_name]
    mesh = make_mesh(parallel, _cpu_devices(n))
    seed = secrets.randbelow(2**31)
    reference = TransformerLM(TINY1, rngs=nnx.Rngs(seed))
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(reference, nnx.Param)))
    model = TransformerLM(TINY1, rngs=nnx.Rngs(seed))
    shard_params(model, mesh, strategy)
    per_device = _per_param_check(model, mesh, strategy)

    # The bulk really is split: FSDP over 8 -> exactly total / 8 (every param has an "embed" dim).
    if strategy == "fsdp":
        assert per_device * 8 == total
    if strategy == "dp":
        assert per_device == total

    tokens_np = np.random.default_rng(seed).integers(0, TINY.vocab_size, size=(8, 16))
    tokens = jax.device_put(jnp.asarray(tokens_np, dtype=jnp.int32), batch_sharding(mesh, strategy))
    forward = nnx.jit(lambda m, t: m(t))
    with jax.default_matmul_precision("highest"):
        want = np.asarray(forward(reference, jnp.asarray(tokens_np, dtype=jnp.int32)))
        got_arr = forward(model, tokens)
    assert {s.device for s in got_arr.addressable_shards} == set(mesh.devices.flat)
    np.testing.assert_allclose(np.asarray(got_arr), want, rtol=1e-5, atol=1e-5,
                               err_msg=f"sharded forward differs (seed={seed})")
    # The forward did not move the parameters.
    assert_params_sharded(model, mesh, strategy)


@pytest.mark.parametrize("mesh_name", ["fsdp8", "dp2xfsdp2xtp2"])
def test_create_sharded_model(mesh_name):
    parallel, n = MESHES[mesh_name]
    mesh = make_mesh(parallel, _cpu_devices(n))
    strategy = strategy_for(parallel.resolve(n))
    seed = secrets.randbelow(2**31)
    model = create_sharded_model(TINY1, mesh, strategy, seed=seed)
    _per_param_check(model, mesh, strategy)
    reference = TransformerLM(TINY1, rngs=nnx.Rngs(seed))
    ref_state = nnx.state(reference)
    got_state = nnx.state(model)
    for (path, ref_var), (_, got_var) in zip(nnx.to_flat_state(ref_state), nnx.to_flat_state(got_state)):
        np.testing.assert_array_equal(np.asarray(got_var.get_value()), np.asarray(ref_var.get_value()),
                                      err_msg=f"{path} (seed={seed})")


def test_strategy_for():
    assert strategy_for(ParallelSpec(dp=8)) == "dp"
    assert strategy_for(ParallelSpec(fsdp=8)) == "fsdp"
    assert strategy_for(ParallelSpec(tp=8)) == "tp"
    assert strategy_for(ParallelSpec(dp=2, fsdp=2, tp=2)) == "fsdp_tp"


def test_checker_rejects_unsharded_model():
    mesh = make_mesh(ParallelSpec(fsdp=8), _cpu_devices())
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    shard_params(model, mesh, "dp")  # replicated over the mesh
    with pytest.raises(AssertionError, match="sharding"):
        assert_params_sharded(model, mesh, "fsdp")
    unplaced = TransformerLM(TINY, rngs=nnx.Rngs(0))  # on one device
    with pytest.raises(AssertionError):
        assert_params_sharded(unplaced, mesh, "dp")


def test_bad_inputs():
    devices = _cpu_devices()
    mesh = make_mesh(ParallelSpec(tp=8), devices)
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="n_heads=4"):  # tp=8 does not divide 4 heads
        shard_params(model, mesh, "tp")
    with pytest.raises(ValueError, match="n_heads=4"):
        create_sharded_model(TINY, mesh, "tp")
    with pytest.raises(ValueError, match="unknown sharding strategy 'zero9'"):
        shard_params(model, mesh, "zero9")
    with pytest.raises(ValueError, match="unknown sharding strategy"):
        param_shardings(model, mesh, "ddp")
    with pytest.raises(ValueError, match="!= world size"):
        make_mesh(ParallelSpec(dp=3), devices)
    # A dim the mesh axis does not divide.
    odd = TINY.replace(name="odd", d_model=36, d_ff=96, n_heads=2)  # 36 is not divisible by 8
    fsdp_mesh = make_mesh(ParallelSpec(fsdp=8), devices)
    with pytest.raises(ValueError, match="not divisible by 8"):
        shard_params(TransformerLM(odd, rngs=nnx.Rngs(0)), fsdp_mesh, "fsdp")


def test_sharded_grads_follow_params():
    """Loss and gradients of the sharded model equal the unsharded ones; constrained to ``param_shardings``
    (what a train step does, so gradients and optimizer state are sharded like the parameters), every
    gradient lands on its parameter's sharding. (Left to GSPMD alone, some come back replicated.)"""
    from jax_impl.model import cross_entropy

    parallel, n = MESHES["dp2xfsdp2xtp2"]
    mesh = make_mesh(parallel, _cpu_devices(n))
    seed = secrets.randbelow(2**31)
    model = create_sharded_model(TINY1, mesh, "fsdp_tp", seed=seed)
    reference = TransformerLM(TINY1, rngs=nnx.Rngs(seed))
    shardings = param_shardings(nnx.state(model, nnx.Param), mesh, "fsdp_tp")
    tokens = np.random.default_rng(seed).integers(0, TINY1.vocab_size, size=(8, 17)).astype(np.int32)

    def loss_fn(m, t):
        return cross_entropy(m(t[:, :-1]), t[:, 1:])

    @nnx.jit
    def sharded_grads(m, t):
        loss, grads = nnx.value_and_grad(loss_fn)(m, t)
        return loss, jax.lax.with_sharding_constraint(grads, shardings)

    plain_grads = nnx.jit(nnx.value_and_grad(loss_fn))
    with jax.default_matmul_precision("highest"):
        loss, grads = sharded_grads(model, jax.device_put(tokens, batch_sharding(mesh, "fsdp_tp")))
        want_loss, want_grads = plain_grads(reference, jnp.asarray(tokens))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    flat = zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads), nnx.to_flat_state(shardings))
    for (path, got), (_, want), (_, sharding) in flat:
        got = got.get_value()
        assert got.sharding.is_equivalent_to(sharding, got.ndim), (path, got.sharding.spec, sharding.spec)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want.get_value()), rtol=1e-5, atol=1e-7,
                                   err_msg=f"{path} (seed={seed})")
