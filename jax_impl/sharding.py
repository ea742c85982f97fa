"""Device meshes and logical-axis sharding rules for the Flax model: DP, FSDP, TP (Megatron) and FSDP x TP.

The model (``jax_impl.model``) names every parameter dimension logically ("vocab", "embed", "heads", "mlp");
this module owns the mesh and one rules table per strategy mapping those names (plus the activation name
"batch") to mesh axes, MaxText style (``logical_axis_rules``, ``pure-fsdp.yml``). Switching strategy
changes the table, never the model.

Public names:
* ``make_mesh(parallel, devices=None) -> Mesh``: axes ("dp", "fsdp", "tp") with the ParallelSpec's degrees
  (a -1 degree is filled in from the device count; 1 device works). Axis types are explicitly ``Auto``
  (see "Axis types" below).
* ``RULES[strategy]``: ``((logical_name, mesh_axes), ...)`` for strategy in ``STRATEGIES`` = ("dp", "fsdp",
  "tp", "fsdp_tp"); mesh_axes is a mesh axis name, a tuple of them, or None (replicated). The same tuples
  can be handed to ``nnx.logical_axis_rules`` / ``flax.linen.logical_axis_rules``.
* ``strategy_for(parallel)``: the natural strategy for a mesh's degrees (tp and fsdp > 1 -> "fsdp_tp", ...).
* ``logical_to_spec(names, strategy)``: a PartitionSpec from logical names (a mesh axis is used at most
  once per array: a later dim asking for an axis already taken stays replicated, as in MaxText).
* ``batch_spec(strategy, ndim=2)`` / ``batch_sharding(mesh, strategy, ndim=2)``: the activation sharding
  of a (batch, ...) array, e.g. token ids (B, T).
* ``param_shardings(model_or_state, mesh, strategy)``: a State of NamedShardings, one per variable
  (parameters from their logical names; variables without names, e.g. the RoPE tables, replicated).
* ``shard_params(model, mesh, strategy) -> model``: places the model's variables with those shardings
  (in place; also returns the model). Checks divisibility first (ValueError), including that tp divides
  ``n_heads`` when heads are split (Megatron splits whole heads).
* ``create_sharded_model(spec, mesh, strategy, seed=0, **model_kwargs)``: builds the model directly
  sharded: ``nnx.eval_shape`` for the structure, then a jitted initializer with ``out_shardings``, so no
  device ever holds a full copy of a sharded parameter.
* ``param_bytes_per_device(model) -> dict[device, int]`` and ``assert_params_sharded(model, mesh,
  strategy)``: every parameter's per-device bytes equal total / (product of the mesh-axis sizes its
  dims are split over), and replicated parameters are whole on every device (MaxText's
  ``assert_params_sufficiently_sharded``, made exact per parameter).

Axis types: the mesh uses ``AxisType.Auto`` on all three axes, explicitly (recent JAX defaults
``jax.make_mesh`` to Explicit). With Explicit axes, shardings are part of array types and every matmul
whose operands disagree (FSDP: kernel split over "fsdp" on its contracting "embed" dim, activations split
over "fsdp" on batch) is a trace-time error unless the model code states an ``out_sharding``; the model is
single-device code by design, so we let GSPMD propagate shardings from the parameters and the inputs
(what MaxText does) and pin activations with ``jax.lax.with_sharding_constraint`` where needed. Parameter
placement is exact either way: ``NamedSharding``s are given explicitly.

Caveats:
* The batch goes over ("dp", "fsdp") in every strategy: a "dp" strategy on a mesh with fsdp > 1 treats
  fsdp as more data parallelism, and the "tp" strategy on a mesh with fsdp > 1 is DP x TP. A "tp" axis
  that the strategy does not use for parameters ("dp", "fsdp") replicates the work; ``strategy_for``
  picks the strategy that uses every axis of size > 1.
* Gradients follow the parameters only if told: under Auto axes GSPMD may return some gradients
  replicated (seen for row-parallel kernels, norm gains and the embedding under "fsdp_tp"), so a train
  step should ``jax.lax.with_sharding_constraint(grads, param_shardings(nnx.state(model, nnx.Param),
  mesh, strategy))`` (the optimizer state, created from sharded parameters, then follows).
* Flax 0.12 shards variables eagerly when a mesh is in context (``jax.set_mesh``); ``create_sharded_model``
  builds under no mesh context and places through ``out_shardings`` instead, which works on
  jax 0.10-0.11 / flax 0.12 alike.

References: MaxText ``configs/base.yml`` logical_axis_rules and ``max_utils.assert_params_sufficiently_sharded``;
Shoeybi et al. 2019 (Megatron-LM tensor parallelism); Rajbhandari et al. 2020 (ZeRO-3 / FSDP); the Flax
NNX "Scale up on multiple devices" guide; the JAX "Explicit sharding" docs (axis types).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.model import TransformerLM, axis_names, copy_weights
from parallelism_calc.scaling import STRATEGIES  # the calculator's names: RULES has a table for each
from parallelism_calc.specs import ModelSpec, ParallelSpec

MESH_AXES = ("dp", "fsdp", "tp")
AXIS_TYPES = (AxisType.Auto,) * len(MESH_AXES)  # see "Axis types" in the module docstring

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# One table per strategy. Logical names: parameters "vocab", "embed", "heads", "mlp" (jax_impl.model);
# activations "batch". A name missing from a table is replicated.
RULES: dict[str, Rules] = {
    # Data parallel: every parameter replicated, the batch split over "dp" (and "fsdp": an fsdp axis > 1
    # with this strategy is just more data parallelism).
    "dp": (
        ("batch", ("dp", "fsdp")),
        ("vocab", None),
        ("embed", None),
        ("heads", None),
        ("mlp", None),
    ),
    # FSDP / ZeRO-3: every parameter split over "fsdp" on its "embed" dim (each matrix and norm gain has one);
    # gradients and optimizer state take the parameters' shardings. Batch over dp x fsdp.
    "fsdp": (
        ("batch", ("dp", "fsdp")),
        ("vocab", None),
        ("embed", "fsdp"),
        ("heads", None),
        ("mlp", None),
    ),
    # Megatron TP: q/k/v (embed, heads) and w1/w3 (embed, mlp) column-parallel, output_proj (heads, embed)
    # and w2 (mlp, embed) row-parallel, embedding (vocab, embed) and lm_head (embed, vocab) vocab-parallel;
    # norm gains replicated. Batch over dp x fsdp.
    "tp": (
        ("batch", ("dp", "fsdp")),
        ("vocab", "tp"),
        ("embed", None),
        ("heads", "tp"),
        ("mlp", "tp"),
    ),
    # 2-D: TP as above inside, FSDP over "embed" across.
    "fsdp_tp": (
        ("batch", ("dp", "fsdp")),
        ("vocab", "tp"),
        ("embed", "fsdp"),
        ("heads", "tp"),
        ("mlp", "tp"),
    ),
}


def _check_strategy(strategy: str) -> Rules:
    try:
        return RULES[strategy]
    except KeyError:
        raise ValueError(f"unknown sharding strategy {strategy!r}; accepted: {', '.join(STRATEGIES)}") from None


def strategy_for(parallel: ParallelSpec) -> str:
    """The strategy that uses a resolved ParallelSpec's axes: fsdp & tp -> "fsdp_tp", tp -> "tp", fsdp -> "fsdp"."""
    if parallel.tp > 1:
        return "fsdp_tp" if parallel.fsdp > 1 else "tp"
    return "fsdp" if parallel.fsdp > 1 else "dp"


def make_mesh(parallel: ParallelSpec | str, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes ("dp", "fsdp", "tp") of the spec's degrees over ``devices`` (default: ``jax.devices()``).

    A -1 degree is filled in from the device count; degrees that do not multiply to the device count raise
    a ValueError. Axis types are explicitly Auto (module docstring). ``parallel`` may be a string
    "dp=2,fsdp=4" (ParallelSpec.parse).
    """
    if isinstance(parallel, str):
        parallel = ParallelSpec.parse(parallel)
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh: no devices given")
    try:
        resolved = parallel.resolve(len(devices))
    except ValueError as e:
        raise ValueError(f"make_mesh: {e} (devices: {len(devices)} x {devices[0].platform})") from None
    shape = (resolved.dp, resolved.fsdp, resolved.tp)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=AXIS_TYPES, devices=devices)
    except TypeError:  # a jax without make_mesh(devices=)
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=AXIS_TYPES)


def logical_to_spec(names: Sequence[str | None], strategy: str) -> P:
    """PartitionSpec for an array whose dims have logical ``names`` under ``strategy``'s rules.

    Each mesh axis is used at most once: a dim whose rule asks for an axis an earlier dim already took
    stays replicated (MaxText resolves rules the same way). Unknown names are replicated.
    """
    rules = dict(_check_strategy(strategy))
    used: set[str] = set()
    out: list[MeshAxes] = []
    for name in names:
        axes = rules.get(name) if name is not None else None
        axes_tuple = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if not axes_tuple or used.intersection(axes_tuple):
            out.append(None)
            continue
        used.update(axes_tuple)
        out.append(axes_tuple[0] if len(axes_tuple) == 1 else axes_tuple)
    while out and out[-1] is None:  # P("fsdp", None) == P("fsdp"); keep specs short and comparable
        out.pop()
    return P(*out)


def batch_spec(strategy: str, ndim: int = 2) -> P:
    """PartitionSpec of an activation (batch, ...) with ``ndim`` dims: batch split, the rest replicated."""
    return logical_to_spec(("batch",) + (None,) * (ndim - 1), strategy)


def batch_sharding(mesh: Mesh, strategy: str, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(strategy, ndim))


def _ways(mesh: Mesh, spec: P) -> int:
    """Into how many pieces ``spec`` splits an array on ``mesh``."""
    ways = 1
    for axes in spec:
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            ways *= mesh.shape[axis]
    return ways


def _spec_for(variable: nnx.Variable, mesh: Mesh, strategy: str, where: str) -> P:
    names = axis_names(variable)
    shape = tuple(variable.get_value().shape)
    if not names:
        return P()  # e.g. the RoPE tables: replicated
    if len(names) != len(shape):
        raise ValueError(f"{where}: logical names {names} do not match shape {shape}")
    spec = logical_to_spec(names, strategy)
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        degree = _ways(mesh, P(axes))
        if size % degree:
            raise ValueError(
                f"{where}: dim {dim} ({names[dim]!r}, size {size}) is not divisible by {degree} "
                f"(mesh axes {axes} of {dict(mesh.shape)}, strategy {strategy!r})")
    return spec


def _check_model_fits(spec: ModelSpec | None, mesh: Mesh, strategy: str) -> None:
    """Whole heads per device: Megatron splits attention by heads, so tp must divide n_heads."""
    if spec is None:
        return
    head_axes = logical_to_spec(("heads",), strategy)
    degree = _ways(mesh, head_axes)
    if spec.n_heads % degree:
        raise ValueError(f"strategy {strategy!r} splits heads {degree} ways ({dict(mesh.shape)}), "
                         f"which does not divide n_heads={spec.n_heads} of model {spec.name!r}")


def param_shardings(model_or_state, mesh: Mesh, strategy: str) -> nnx.State:
    """A State shaped like ``nnx.state(model)`` with one NamedSharding per variable."""
    _check_strategy(strategy)
    if isinstance(model_or_state, nnx.Module):
        _check_model_fits(getattr(model_or_state, "spec", None), mesh, strategy)
        state = nnx.state(model_or_state)
    else:
        state = model_or_state

    def one(path, variable):
        where = ".".join(str(p) for p in path)
        return NamedSharding(mesh, _spec_for(variable, mesh, strategy, where))

    return nnx.map_state(one, state)


def shard_params(model: nnx.Module, mesh: Mesh, strategy: str) -> nnx.Module:
    """Place every variable of ``model`` with the sharding ``strategy``'s rules give (in place; returns model)."""
    state = nnx.state(model)
    shardings = param_shardings(model, mesh, strategy)
    placed = jax.tree.map(
        lambda v, s: v.replace(jax.device_put(v.get_value(), s)),
        state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(model, placed)
    return model


def create_sharded_model(spec: ModelSpec, mesh: Mesh, strategy: str, seed: int = 0, **model_kwargs):
    """A ``TransformerLM(spec, rngs=nnx.Rngs(seed), **model_kwargs)`` built directly in its sharded placement.

    The structure comes from ``nnx.eval_shape`` (no memory); the values from one jitted initializer whose
    ``out_shardings`` are the rules' shardings, so each device only ever materializes its own shards. The
    values equal those of the same model built unsharded with the same seed; an unrolled model
    (``scan_layers=False``) gets the scanned model's values, drawn by its vmapped initializer and sliced
    per layer, so its initializer does not grow with depth either.
    """
    _check_strategy(strategy)
    _check_model_fits(spec, mesh, strategy)

    def build():
        return TransformerLM(spec, rngs=nnx.Rngs(seed), **model_kwargs)

    abstract = nnx.eval_shape(build)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract_state, mesh, strategy)

    if not model_kwargs.get("scan_layers", True):  # drawn stacked (one vmapped initializer), then sliced
        stacked = create_sharded_model(spec, mesh, strategy, seed, **{**model_kwargs, "scan_layers": True})
        stacked_def, stacked_state = nnx.split(stacked)

        def unstack(stacked_state):  # slices only: drawing inside this program made XLA compile for minutes
            model = nnx.merge(graphdef, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_state))
            copy_weights(nnx.merge(stacked_def, stacked_state), model)
            return nnx.state(model)

        return nnx.merge(graphdef, jax.jit(unstack, out_shardings=shardings)(stacked_state))

    def init_state():
        return nnx.state(build())

    state = jax.jit(init_state, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def param_bytes_per_device(model_or_state) -> dict[Any, int]:
    """Bytes of ``nnx.Param`` data held by each device (shards counted where they live)."""
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    totals: dict[Any, int] = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals


def assert_params_sharded(model: nnx.Module, mesh: Mesh, strategy: str) -> None:
    """Every parameter is placed as the rules say and really split: on each mesh device, its shard holds
    total / ways bytes (ways = product of the sizes of the mesh axes its dims are split over), so replicated
    parameters are whole everywhere. Raises AssertionError naming the first offender."""
    state = nnx.state(model, nnx.Param)
    expected = param_shardings(state, mesh, strategy)
    mesh_devices = set(mesh.devices.flat)
    for (path, variable), (_, sharding) in zip(nnx.to_flat_state(state), nnx.to_flat_state(expected)):
        where = ".".join(str(p) for p in path)
        array = variable.get_value()
        if not array.sharding.is_equivalent_to(sharding, array.ndim):
            raise AssertionError(f"{where}: sharding {array.sharding} != rules' {sharding.spec}")
        ways = _ways(mesh, sharding.spec)
        shards = array.addressable_shards
        if {s.device for s in shards} != mesh_devices:
            raise AssertionError(f"{where}: shards live on {len(shards)} devices, not the mesh's {len(mesh_devices)}")
        for s in shards:
            if s.data.nbytes * ways != array.nbytes:
                raise AssertionError(f"{where}: {s.data.nbytes} bytes on {s.device}, want {array.nbytes} / {ways}")


def expected_bytes_per_device(model: nnx.Module, mesh: Mesh, strategy: str) -> int:
    """Sum over parameters of total bytes / ways: what each device should hold under ``strategy``."""
    state = nnx.state(model, nnx.Param)
    shardings = param_shardings(state, mesh, strategy)
    total = 0
    for (_, variable), (_, sharding) in zip(nnx.to_flat_state(state), nnx.to_flat_state(shardings)):
        array = variable.get_value()
        total += math.prod(array.shape) * array.dtype.itemsize // _ways(mesh, sharding.spec)
    return total
