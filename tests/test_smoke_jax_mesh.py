"""Smoke test: real JAX sharding over a 4x2 ("data", "model") mesh of 8 CPU devices.

tests/conftest.py sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before jax is imported, so the
CPU backend has 8 devices. The mesh is always built from ``jax.devices("cpu")``: on the GPU machine the
default backend is CUDA (with fewer than 8 GPUs) but the CPU backend is still there with its 8 devices.

Checked, on fresh random inputs against a numpy float64 reference:
* ``x @ w`` under ``jit`` with x sharded over "data" (rows) and w over "model" (columns), for both
  Explicit axis types (the output sharding P("data", "model") is inferred, and must be) and Auto axis types
  (output sharding requested through ``out_shardings``);
* that the sharding really happened: every device holds one shard of the expected shape, per-device bytes
  are total / (number of ways the array is split), and the shards tile the global array exactly;
* a ``shard_map`` matmul with the contraction dim split over "model" and a ``psum`` over "model".
Negative checks: the shard checker rejects a replicated array, and the numeric checker rejects the
shard_map matmul with the ``psum`` left out (each device keeps its partial sum).
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MESH_SHAPE = (4, 2)
AXES = ("data", "model")
N_DEVICES = MESH_SHAPE[0] * MESH_SHAPE[1]
M, K, N = 12, 20, 6  # x: (M, K), w: (K, N); M % 4 == 0, N % 2 == 0, K % 2 == 0


def _cpu_devices() -> list:
    try:
        devices = jax.devices("cpu")
    except RuntimeError as e:  # e.g. JAX_PLATFORMS=cuda on a GPU machine: no CPU backend at all
        pytest.skip(f"no JAX CPU backend ({e}); unset JAX_PLATFORMS or include 'cpu' in it")
    if len(devices) < N_DEVICES:
        msg = (f"need {N_DEVICES} JAX CPU devices, got {len(devices)}: XLA_FLAGS must contain "
               f"--xla_force_host_platform_device_count={N_DEVICES} before jax is first imported "
               f"(tests/conftest.py does this; was jax imported earlier?)")
        if jax.default_backend() == "cpu":
            pytest.fail(msg)  # CPU CI must really run this test, so a missing flag is an error here
        pytest.skip(msg)
    return devices[:N_DEVICES]


def _make_mesh(axis_type: AxisType):
    devices = _cpu_devices()
    axis_types = (axis_type,) * len(AXES)
    try:
        mesh = jax.make_mesh(MESH_SHAPE, AXES, axis_types=axis_types, devices=devices)
    except TypeError:  # a jax without the devices= keyword
        mesh = jax.sharding.Mesh(np.asarray(devices).reshape(MESH_SHAPE), AXES, axis_types=axis_types)
    assert mesh.shape == dict(zip(AXES, MESH_SHAPE))
    assert tuple(mesh.axis_types) == axis_types
    assert {d.platform for d in mesh.devices.flat} == {"cpu"}
    return mesh


def _inputs():
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    return seed, x, w


def _matches_reference(got, x: np.ndarray, w: np.ndarray) -> bool:
    """float32 matmul with K=20 terms vs the float64 product of the same float32 inputs."""
    ref = x.astype(np.float64) @ w.astype(np.float64)
    got = np.asarray(jax.device_get(got), dtype=np.float64)
    return got.shape == ref.shape and bool(np.allclose(got, ref, rtol=1e-5, atol=1e-5))


def _assert_sharded(arr, mesh, shard_shape: tuple[int, ...], ways: int) -> None:
    """arr is split `ways` ways: each of the mesh's devices holds one shard of `shard_shape`, per-device
    bytes are total / ways, and the shards tile the global array exactly (like MaxText's
    assert_params_sufficiently_sharded, but exact)."""
    shards = arr.addressable_shards
    assert len(shards) == mesh.devices.size, f"{len(shards)} shards for {mesh.devices.size} devices"
    assert {s.device for s in shards} == set(mesh.devices.flat), "shards are not on the mesh's devices"
    for s in shards:
        assert s.data.shape == shard_shape, f"shard on {s.device} has shape {s.data.shape}, want {shard_shape}"
        assert s.data.nbytes * ways == arr.nbytes, (
            f"per-device bytes {s.data.nbytes} != total {arr.nbytes} / {ways}")
    full = np.asarray(arr)
    covered = np.zeros(arr.shape, dtype=np.int64)
    for s in shards:
        np.testing.assert_array_equal(np.asarray(s.data), full[s.index])
        covered[s.index] += 1
    replicas = mesh.devices.size // ways
    assert (covered == replicas).all(), f"each element should be held by {replicas} device(s)"


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_matmul_on_4x2_mesh(axis_type):
    mesh = _make_mesh(axis_type)
    seed, x_np, w_np = _inputs()
    x_sharding = NamedSharding(mesh, P("data", None))  # rows over "data", replicated over "model"
    w_sharding = NamedSharding(mesh, P(None, "model"))  # columns over "model", replicated over "data"
    out_sharding = NamedSharding(mesh, P("data", "model"))
    x = jax.device_put(x_np, x_sharding)
    w = jax.device_put(w_np, w_sharding)

    _assert_sharded(x, mesh, (M // 4, K), ways=4)
    _assert_sharded(w, mesh, (K, N // 2), ways=2)

    if axis_type == AxisType.Explicit:
        # Sharding is part of the type: the output's P("data", "model") must be inferred, not requested.
        out = jax.jit(jnp.matmul)(x, w)
    else:
        out = jax.jit(jnp.matmul, out_shardings=out_sharding)(x, w)

    assert out.sharding.is_equivalent_to(out_sharding, out.ndim), f"output sharding {out.sharding}"
    _assert_sharded(out, mesh, (M // 4, N // 2), ways=8)
    assert _matches_reference(out, x_np, w_np), f"sharded x @ w != float64 reference (seed={seed})"

    # Negative checks: a replicated w must fail the shard checker; a wrong product the numeric one.
    w_replicated = jax.device_put(w_np, NamedSharding(mesh, P()))
    with pytest.raises(AssertionError):
        _assert_sharded(w_replicated, mesh, (K, N // 2), ways=2)
    assert not _matches_reference(out, x_np, w_np + np.float32(1e-3)), "numeric checker too loose"


def _shard_map_matmul(mesh, with_psum: bool):
    """x @ w with the contraction dim K split over "model": each device multiplies its K-slices, and the
    partial products must be summed over "model" (the psum). Without it each device keeps a partial sum."""

    def local(x_blk, w_blk):  # x_blk: (M/4, K/2), w_blk: (K/2, N)
        partial = x_blk @ w_blk  # (M/4, N)
        return jax.lax.psum(partial, "model") if with_psum else partial

    kwargs = dict(mesh=mesh, in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))
    if not with_psum:
        kwargs["check_vma"] = False  # otherwise jax itself refuses the unreduced output at trace time
    return jax.jit(jax.shard_map(local, **kwargs))


def test_shard_map_psum_over_model_axis():
    mesh = _make_mesh(AxisType.Explicit)
    seed, x_np, w_np = _inputs()
    x = jax.device_put(x_np, NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(w_np, NamedSharding(mesh, P("model", None)))
    _assert_sharded(x, mesh, (M // 4, K // 2), ways=8)
    _assert_sharded(w, mesh, (K // 2, N), ways=2)

    out = _shard_map_matmul(mesh, with_psum=True)(x, w)
    _assert_sharded(out, mesh, (M // 4, N), ways=4)
    assert _matches_reference(out, x_np, w_np), f"shard_map x @ w with psum != reference (seed={seed})"

    broken = _shard_map_matmul(mesh, with_psum=False)(x, w)
    assert not _matches_reference(broken, x_np, w_np), f"checker missed the missing psum (seed={seed})"
