"""FSDP by hand (ZeRO-3 for the matmul weights): ``FSDP(module, compute_dtype=None, gather_unit="block")``.

What is sharded: the 2-D ``weight`` of every ``torch.nn.Linear`` / ``torch.nn.Embedding`` and of every module
whose class is *named* ``Linear`` or ``Embedding`` (our ``torch_impl.model`` layers). Each such weight is
flattened, zero-padded to a multiple of the world size N, and split in N contiguous pieces; rank r keeps
piece r as an ``nn.Parameter`` registered under the *same name* (``module.weight`` becomes a 1-D shard), in
fp32 (the master weights: ``promote(dtype, float32)``), which is what the optimizer sees. Tied weights
(one Parameter in two layers) become one shard. Every other parameter (norm gains, biases) is replicated and
its gradient is all-reduced (averaged) in ``finish_gradient_synchronization()``. At construction rank 0's
parameters and buffers are broadcast to every rank. Build the optimizer *after* wrapping.

Units: the weights one all-gather brings and one reduce-scatter returns. ``gather_unit="block"`` (the default, as
FSDP2's ``fully_shard`` per block): the weights of each block (an element of an ``nn.ModuleList``, the innermost one
holding the layer, so a block inside an activation-checkpointed segment) form one unit, gathered by the block's
forward pre-hook; weights outside every block (embedding, LM head) or tied across blocks are units of their own,
gathered by their layers' hooks. ``"layer"``: every weight its own unit. A unit's gather copies its shards (cast to
the compute dtype) side by side into one buffer, all-gathers it (rank-major: rank r's pieces of every weight in a
row) and copies each weight's rows out into one buffer where every weight is whole (``split_with_sizes_copy``, as
FSDP2's copy-out; a one-weight unit needs none).

Forward: the unit's owner (the block, or the layer) all-gathers the unit in its forward pre-hook and shadows each
layer's shard with its full weight for the duration of the owner's forward (``layer.__dict__["weight"]``; the
post-hook removes it, so ``named_parameters()`` never changes). The gather is ``_GatherUnit``, an
``autograd.Function`` whose forward returns the unit's full weights and whose backward reduce-scatters their
gradients. Prefetch: once a unit's weights are in hand, the gathers of the next ``prefetch_layers`` units in
execution order start (recorded in the previous forward; registration order in the first one), so communication
overlaps the current unit's compute: at most 1 + ``prefetch_layers`` units are gathered at a time (plus, during a
copy-out, the unit's rank-major buffer). In the first forward a unit prefetched out of order stays gathered until
it runs.

Freeing after use, and gathering again for backward: ``FSDP.forward`` runs the module under
``torch.autograd.graph.saved_tensors_hooks``. When autograd saves a tensor that lives in a unit's gathered buffer
(e.g. ``W.T`` saved by the matmul for the input gradient), the pack hook stores only (unit, size, stride, offset)
instead, so the gathered weights are freed by the post-forward hook. When backward needs one, the unpack hook
all-gathers the unit again (or takes the prefetched gather) and rebuilds the same view with ``as_strided``; it
also starts the gathers of the next ``prefetch_layers`` units in backward order (reverse forward order of the units
that saved a weight). A unit's backward gather is kept until its ``_GatherUnit`` node runs, which autograd runs once
every node that used the weights is done (a block's nodes run one after another: freed with the last one, its
weights would be gathered again for the next). This needs no change to the layers' forward code and no
recomputation.

Gradients: ``_GatherUnit.backward`` lays the unit's gradients out rank-major (padded; zeros for a weight that got
none) and launches one asynchronous reduce-scatter in ``reduce_dtype`` (the compute dtype by default, like torch
FSDP2's ``MixedPrecisionPolicy``), averaging over the ranks: NCCL averages fp32 and bf16 as it sums
(``ReduceOp.AVG``, ``process_group.nccl_averages``); fp16 (whose sums could overflow) and gloo (which has no AVG) get
the buffer divided first. ``PREMUL_SUM`` zeroed every bf16 gradient of a first try on 2 H200s (pytorch/pytorch#190745).
At most ``MAX_PENDING_REDUCE_SCATTERS`` (2) are in flight: launching another first waits for the oldest and lands it,
so the full-size gradient buffers alive at once are bounded by two units' (``pending_gradient_bytes()``), not all of
them (the rate limit of Zhao et al.). Landing casts the unit's piece to the master dtype once and accumulates each
weight's part into its shard's ``.grad`` (so gradients arrive fp32, in the master dtype);
``finish_gradient_synchronization()`` lands the rest and all-reduces the replicated parameters' gradients (a
parameter with no gradient on any rank keeps ``None``). Call it once after the backward(s) of a step, before
``optimizer.step()``.

``compute_dtype`` (e.g. ``torch.bfloat16``/``torch.float16``): each shard is cast *before* the all-gather (so
the gather moves half the bytes) and the layer computes in that dtype: its floating-point inputs and its
other direct parameters (an ``nn.Linear`` bias) are cast on the way in (autograd carries their gradients back
to fp32). Replicated layers (RMSNorm) are not cast. Master weights, optimizer state and ``.grad`` stay fp32.

Checkpoints: ``shard_of(param)`` tells where a shard lies in its full weight, so ``torch_impl.checkpoint`` saves
full weights (and full AdamW moments) whatever the world size, and loads them into any other.

``gather_full_params()`` (a collective) returns every parameter as a full fp32 tensor keyed like
``fsdp.module.named_parameters()``. ``gathered_bytes()`` / ``peak_gathered_bytes`` report the memory of
all-gathered weights alive now / at most so far, to check that gathered weights really are freed (a backend
may hold a finished collective's buffer a moment after ``wait()``: gloo's worker thread does, for ms).

Caveats: a sharded weight may only be used inside its owner's forward (outside it, ``module.weight`` is the 1-D
shard). Every rank must run the same units in the same order (data-dependent skipping of a block on one rank would
deadlock the collectives, as in any FSDP). A weight of a block unit that the block's forward did not use gets a
zero gradient, not ``None``. Calling ``fsdp.module(x)`` directly bypasses the saved-tensor hooks: still correct,
but gathered weights then stay alive until backward.

References: Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (flat
parameters, forward/backward prefetch, rate limiting, mixed precision); Rajbhandari et al. 2020, ZeRO stage 3
(P_os+g+p); torch FSDP2 ``fully_shard`` (per-parameter sharding, ``MixedPrecisionPolicy``, copy-in / copy-out
around one all-gather per module); CS336 (Stanford, 2025) assignment 2.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_impl.distributed.interface import DataParallelWrapper
from torch_impl.distributed.process_group import all_gather_flat, nccl_averages, reduce_scatter_flat

SHARDED_CLASS_NAMES = ("Linear", "Embedding")
GATHER_UNITS = ("block", "layer")  # what one all-gather brings: a block's weights, or one weight
DEFAULT_PREFETCH = {"block": 1, "layer": 2}  # units gathered ahead by default (FSDP2 prefetches one block)
MAX_PREFETCH_LAYERS = 2
MAX_PENDING_REDUCE_SCATTERS = 2  # gradient reduce-scatters in flight (each holds a unit's full-size gradients)

# module globals, so that tests can count or redirect FSDP's collectives
_all_gather_flat, _reduce_scatter_flat = all_gather_flat, reduce_scatter_flat


def is_sharded_layer(module: nn.Module) -> bool:
    """True for the layers FSDP shards: nn.Linear / nn.Embedding or a class named Linear / Embedding,
    with a 2-D ``weight`` Parameter of its own."""
    weight = module._parameters.get("weight")
    named = isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ in SHARDED_CLASS_NAMES
    return named and isinstance(weight, nn.Parameter) and weight.dim() == 2


def _block_of(module: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each submodule -> the innermost block holding it (an element of an ``nn.ModuleList``), where one does."""
    block_of: dict[nn.Module, nn.Module] = {}

    def visit(parent: nn.Module, block: nn.Module | None) -> None:
        for child in parent.children():
            inner = child if isinstance(parent, nn.ModuleList) else block
            if inner is not None:
                block_of[child] = inner
            visit(child, inner)

    visit(module, None)
    return block_of


@dataclass(eq=False)
class _Weight:
    """One sharded weight (shared by every layer that holds it): rank r's piece of it, flattened and zero-padded
    to N x ``chunk`` elements."""

    name: str  # its first name in module.named_parameters()
    shape: torch.Size
    numel: int
    chunk: int  # elements a rank keeps
    shard: nn.Parameter  # this rank's piece, (chunk,), master dtype
    layers: list[nn.Module] = field(default_factory=list)


@dataclass(eq=False)
class _Unit:
    """Weights brought by one all-gather and returned by one reduce-scatter (a block's, or one weight)."""

    index: int
    weights: list[_Weight]
    pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (work, gathered, source) in flight
    fwd_key: int | None = None  # storage pointer of the gathered weights of the forward in progress
    bwd_gathered: torch.Tensor | None = None  # the gathered weights backward uses, until the unit's backward

    @property
    def chunks(self) -> list[int]:
        return [w.chunk for w in self.weights]

    @property
    def chunk(self) -> int:
        """Elements a rank keeps of the whole unit."""
        return sum(self.chunks)


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps instead of a view of gathered weights: enough to rebuild it after a re-gather."""

    unit: _Unit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _GatherUnit(torch.autograd.Function):
    """shards -> the unit's full weights (views of one gathered buffer); backward reduce-scatters their
    gradients."""

    @staticmethod
    def forward(ctx, unit: _Unit, fsdp: "FSDP", *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        gathered = fsdp._take_gather(unit)  # (N x unit.chunk,) compute dtype, each weight whole
        unit.fwd_key = gathered.untyped_storage().data_ptr()
        fsdp._live[unit.fwd_key] = unit
        ctx.unit, ctx.fsdp = unit, fsdp
        ctx.set_materialize_grads(False)
        n = fsdp.world_size
        full = [part[:w.numel].view(w.shape)
                for w, part in zip(unit.weights, gathered.split([n * c for c in unit.chunks]))]
        ctx.mark_non_differentiable(*(t for w, t in zip(unit.weights, full) if not w.shard.requires_grad))
        return tuple(full)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.unit.bwd_gathered = None  # every node that used the weights has run: free them
        ctx.fsdp._reduce_scatter_grads(ctx.unit, grads)
        return (None, None, *(None for _ in grads))  # the shards' .grad are filled as the reduce-scatters land


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class FSDP(nn.Module, DataParallelWrapper):
    """Fully sharded data parallel for the Linear / Embedding weights (see the module docstring), and the
    trainer's ``DataParallelWrapper`` (sharded state, a synchronization per backward, evaluation through itself).

    ``compute_dtype``: dtype of the gathers and of the sharded layers' compute (None: the master dtype).
    ``reduce_dtype``: dtype of the gradient reduce-scatter (None: the compute dtype). ``gather_unit``: one of
    GATHER_UNITS, "block" (a block's weights per collective) or "layer" (one weight per collective).
    ``prefetch_layers``: how many units ahead to gather asynchronously, 0 to MAX_PREFETCH_LAYERS (None:
    DEFAULT_PREFETCH of the unit). ``process_group``: default the world.
    """

    mesh_axis, sync_every_backward, sharded_state = "fsdp", True, True

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, *,
                 reduce_dtype: torch.dtype | None = None, gather_unit: str = "block",
                 prefetch_layers: int | None = None, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if gather_unit not in GATHER_UNITS:
            raise ValueError(f"gather_unit={gather_unit!r}; accepted: {', '.join(GATHER_UNITS)}")
        prefetch_layers = DEFAULT_PREFETCH[gather_unit] if prefetch_layers is None else prefetch_layers
        if not 0 <= prefetch_layers <= MAX_PREFETCH_LAYERS:
            raise ValueError(f"prefetch_layers={prefetch_layers}; accepted: 0 to {MAX_PREFETCH_LAYERS}")
        for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"{name}={dtype} is not a floating-point dtype")
        self.module = module
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.gather_unit = gather_unit
        self.prefetch_layers = prefetch_layers
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
            self._nccl = dist.get_backend(process_group) == "nccl"
        else:
            self.rank, self.world_size, self._nccl = 0, 1, False

        self._broadcast_from_rank0()
        self._weights = self._shard_params()
        self._weight_by_shard = {id(w.shard): w for w in self._weights}
        self._shard_ids = frozenset(self._weight_by_shard)  # the global gradient norm sums these over the ranks
        self._replicated = [p for p in module.parameters() if id(p) not in self._shard_ids]
        # owner module -> [(unit, [(layer, index of its weight in the unit)])]: what its forward pre-hook gathers
        self._owned: dict[nn.Module, list[tuple[_Unit, list[tuple[nn.Module, int]]]]] = {}
        self._units = self._make_units(gather_unit)

        self._live: dict[int, _Unit] = {}  # storage pointer -> unit, for weights gathered in a running forward
        self._fwd_order: list[_Unit] = list(self._units)  # prefetch order of the next forward
        self._fwd_seen: list[_Unit] = []  # execution order of the forward in progress
        self._fwd_done: set[_Unit] = set()  # (the same, as a set)
        self._fwd_pos: dict[_Unit, int] = {}
        self._bwd_order: list[_Unit] = []  # units that saved a weight, last first
        self._bwd_pos: dict[_Unit, int] = {}
        self._bwd_done: set[_Unit] = set()  # units whose weights backward has gathered already
        self._pending_grads: list[tuple[Any, torch.Tensor, _Unit, torch.Tensor]] = []
        self._gathered: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self.peak_gathered_bytes = 0
        self._handles = []
        for owner in self._owned:
            self._handles.append(owner.register_forward_pre_hook(self._pre_forward))
            self._handles.append(owner.register_forward_hook(self._post_forward, always_call=True))
        if compute_dtype is not None:
            for layer in dict.fromkeys(layer for w in self._weights for layer in w.layers):
                self._handles.append(layer.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
                if any(name != "weight" and p is not None for name, p in layer._parameters.items()):
                    self._handles.append(layer.register_forward_hook(self._uncast_params, always_call=True))

    # ------------------------------------------------------------------------------------------------
    # Construction

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        if self.world_size == 1:
            return
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        for tensor in list(self.module.parameters()) + list(self.module.buffers()):
            dist.broadcast(tensor.data, src=src, group=self.process_group)

    @torch.no_grad()
    def _shard_params(self) -> list[_Weight]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        by_weight: dict[int, _Weight] = {}
        for layer in self.module.modules():
            if not is_sharded_layer(layer):
                continue
            weight = layer._parameters["weight"]
            sharded = by_weight.get(id(weight))
            if sharded is None:
                numel = weight.numel()
                chunk = math.ceil(numel / self.world_size)
                master_dtype = torch.promote_types(weight.dtype, torch.float32)
                flat = torch.zeros(chunk * self.world_size, dtype=master_dtype, device=weight.device)
                flat[:numel] = weight.reshape(-1)
                shard = nn.Parameter(flat[self.rank * chunk:(self.rank + 1) * chunk].clone(),
                                     requires_grad=weight.requires_grad)
                sharded = by_weight[id(weight)] = _Weight(names[id(weight)], weight.shape, numel, chunk, shard)
            layer._parameters["weight"] = sharded.shard  # same name, now the 1-D shard
            sharded.layers.append(layer)
        return list(by_weight.values())

    def _make_units(self, gather_unit: str) -> list[_Unit]:
        """The units (see the module docstring) and their owners (``_owned``), in registration order."""
        block_of = _block_of(self.module) if gather_unit == "block" else {}
        groups: dict[tuple, tuple[list[nn.Module], list[_Weight]]] = {}
        for w in self._weights:
            blocks = {block_of.get(layer) for layer in w.layers}
            block = blocks.pop() if len(blocks) == 1 else None
            if block is None:  # outside every block, or tied across blocks: a unit of its own, its layers own it
                groups[(w,)] = (w.layers, [w])
            else:  # one gathered buffer per dtype
                groups.setdefault((block, w.shard.dtype), ([block], []))[1].append(w)
        units = []
        for owners, weights in groups.values():
            unit = _Unit(len(units), weights)
            units.append(unit)
            for owner in owners:
                layers = [(layer, i) for i, w in enumerate(weights) for layer in w.layers
                          if layer is owner or block_of.get(layer) is owner]
                self._owned.setdefault(owner, []).append((unit, layers))
        return units

    # ------------------------------------------------------------------------------------------------
    # All-gathers

    def _start_gather(self, unit: _Unit) -> None:
        """Launch the unit's all-gather: its shards, cast to the compute dtype, side by side (copy-in)."""
        shards = [w.shard.detach() for w in unit.weights]
        dtype = self.compute_dtype or shards[0].dtype
        if len(shards) == 1:
            source = shards[0].to(dtype)  # cast before communicating: fewer bytes
        else:
            source = torch.cat(shards, out=torch.empty(unit.chunk, dtype=dtype, device=shards[0].device))
        gathered = torch.empty(self.world_size * unit.chunk, dtype=dtype, device=source.device)
        if self.world_size == 1:
            gathered.copy_(source)
            work = None
        else:
            work = _all_gather_flat(gathered, source, group=self.process_group, async_op=True)
        unit.pending = (work, gathered, source)
        self._track(gathered)

    def _take_gather(self, unit: _Unit) -> torch.Tensor:
        """This unit's gathered weights (N x unit.chunk,), each whole (weight i at N x the chunks before it): the
        prefetched gather, or one started now; waits for it, then copies the weights out of the rank-major
        buffer (a one-weight unit is whole as it lands)."""
        if unit.pending is None:
            self._start_gather(unit)
        work, gathered, _ = unit.pending
        unit.pending = None
        if work is not None:
            work.wait()
        if len(unit.weights) == 1 or self.world_size == 1:
            return gathered
        n = self.world_size
        full = torch.empty_like(gathered)
        torch.split_with_sizes_copy(gathered.view(n, unit.chunk), unit.chunks, dim=1,
                                    out=[part.view(n, c) for part, c in
                                         zip(full.split([n * c for c in unit.chunks]), unit.chunks)])
        self._track(full)
        return full

    def _track(self, gathered: torch.Tensor) -> None:
        self._gathered.add(gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _prefetch(self, order: list[_Unit], pos: int, done: set[_Unit]) -> None:
        """Start the gathers of the next ``prefetch_layers`` units of ``order`` after ``pos`` (skipping the
        ones this pass already used: a first forward runs in registration order only roughly)."""
        for unit in order[pos + 1:pos + 1 + self.prefetch_layers]:
            if unit.pending is None and unit not in done:
                self._start_gather(unit)

    def _drop_pending(self) -> None:
        """Wait for and drop gathers nobody consumed (a prefetch past the last unit run)."""
        for unit in self._units:
            if unit.pending is not None:
                work = unit.pending[0]
                if work is not None:
                    work.wait()
                unit.pending = None

    def gathered_bytes(self) -> int:
        """Bytes of all-gathered weights alive now (prefetched, in use by forward or by backward)."""
        return sum(t.numel() * t.element_size() for t in self._gathered)

    # ------------------------------------------------------------------------------------------------
    # Forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._fwd_seen, self._fwd_done = [], set()
        self._bwd_order, self._bwd_pos, self._bwd_done = [], {}, set()
        self._fwd_pos = {unit: i for i, unit in reversed(list(enumerate(self._fwd_order)))}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            self._drop_pending()
            self._live.clear()
            if self._fwd_seen:
                self._fwd_order = self._fwd_seen  # next forward prefetches in this forward's order
            self._bwd_order.reverse()
            self._bwd_pos = {unit: i for i, unit in reversed(list(enumerate(self._bwd_order)))}

    def _pre_forward(self, owner: nn.Module, args: tuple) -> None:
        """Gather the units ``owner`` owns, shadow its layers' shards with the full weights, prefetch ahead."""
        for unit, layers in self._owned[owner]:
            full = _GatherUnit.apply(unit, self, *(w.shard for w in unit.weights))
            for layer, i in layers:
                layer.__dict__["weight"] = full[i]
            if unit not in self._fwd_done:
                self._fwd_done.add(unit)
                self._fwd_seen.append(unit)
            pos = self._fwd_pos.get(unit)
            if pos is not None:
                self._prefetch(self._fwd_order, pos, self._fwd_done)

    def _post_forward(self, owner: nn.Module, args: tuple, output: Any) -> None:
        for unit, layers in self._owned[owner]:
            for layer, _ in layers:
                layer.__dict__.pop("weight", None)  # the shard shows again
            if unit.fwd_key is not None:
                self._live.pop(unit.fwd_key, None)
                unit.fwd_key = None

    def _cast_inputs(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """compute_dtype: a sharded layer's floating inputs and its other parameters (a bias) in that dtype."""
        for name, param in layer._parameters.items():
            if name != "weight" and param is not None and param.is_floating_point():
                layer.__dict__[name] = param.to(self.compute_dtype)
        return _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)

    def _uncast_params(self, layer: nn.Module, args: tuple, output: Any) -> None:
        for name in layer._parameters:
            if name != "weight":
                layer.__dict__.pop(name, None)  # the fp32 parameter shows again

    # ------------------------------------------------------------------------------------------------
    # Saved-tensor hooks: keep no gathered weight between forward and backward

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._live:
            return tensor
        try:
            key = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return tensor
        unit = self._live.get(key)
        if unit is None:
            return tensor
        if unit not in self._bwd_pos:
            self._bwd_pos[unit] = len(self._bwd_order)
            self._bwd_order.append(unit)
        return _SavedWeight(unit, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        unit = saved.unit
        gathered = unit.bwd_gathered
        if gathered is None:
            gathered = unit.bwd_gathered = self._take_gather(unit)
            self._bwd_done.add(unit)
            pos = self._bwd_pos.get(unit)
            if pos is not None:
                self._prefetch(self._bwd_order, pos, self._bwd_done)
        return gathered.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------------------------------------
    # Gradients

    def _reduce_scatter_grads(self, unit: _Unit, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Launch the reduce-scatter of one application's gradients of the unit (rank-major, padded, averaged)."""
        n = self.world_size
        dtype = self.reduce_dtype or next(g.dtype for g in grads if g is not None)
        rows = []
        for w, g in zip(unit.weights, grads):
            flat = torch.zeros(w.numel, dtype=dtype, device=w.shard.device) if g is None else g.reshape(-1)
            if n * w.chunk != w.numel:
                flat = F.pad(flat, (0, n * w.chunk - w.numel))
            rows.append(flat.view(n, w.chunk))
        flat = (torch.cat(rows, dim=1, out=torch.empty(n, unit.chunk, dtype=dtype, device=rows[0].device))
                if len(rows) > 1 else rows[0].to(dtype)).reshape(-1)
        if nccl_averages(self._nccl, dtype):  # NCCL averages as it reduces: no pass over the gradients
            op = dist.ReduceOp.AVG
        else:  # divided first (fp16 sums stay in range; gloo has no AVG): a new tensor, never autograd's
            op = dist.ReduceOp.SUM
            flat = flat / n
        if n == 1:
            self._land_grads(None, flat, unit)
            return
        piece = torch.empty(unit.chunk, dtype=dtype, device=flat.device)
        work = _reduce_scatter_flat(piece, flat, op=op, group=self.process_group, async_op=True)
        self._pending_grads.append((work, piece, unit, flat))
        while len(self._pending_grads) > MAX_PENDING_REDUCE_SCATTERS:
            self._land_grads(*self._pending_grads.pop(0)[:3])

    @torch.no_grad()
    def _land_grads(self, work: Any, piece: torch.Tensor, unit: _Unit) -> None:
        """Wait for a reduce-scatter (the full-size buffer it read is dropped with its entry), cast this rank's
        piece to the master dtype and accumulate each weight's part into its shard's ``.grad``."""
        if work is not None:
            work.wait()
        parts = piece.to(unit.weights[0].shard.dtype).split(unit.chunks)
        for w, part in zip(unit.weights, parts):
            if not w.shard.requires_grad:
                continue
            if w.shard.grad is None:
                w.shard.grad = part
            else:
                w.shard.grad += part

    def pending_gradient_bytes(self) -> int:
        """Bytes of the full-size gradient buffers of reduce-scatters still in flight (at most two units')."""
        return sum(flat.numel() * flat.element_size() for *_, flat in self._pending_grads)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Land the gradient reduce-scatters still in flight (fp32, into the shards' ``.grad``) and average the
        replicated parameters' gradients over the ranks."""
        while self._pending_grads:
            self._land_grads(*self._pending_grads.pop(0)[:3])
        self._drop_pending()
        for unit in self._units:
            unit.bwd_gathered = None
        self._all_reduce_replicated()

    def _all_reduce_replicated(self) -> None:
        params = [p for p in self._replicated if p.requires_grad]
        if self.world_size == 1 or not params:
            return
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=self.process_group)
        buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p, flag in zip(params, has_grad.tolist()):
            if flag:
                buckets.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), group in buckets.items():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.process_group)
            offset = 0
            for p in group:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    # ------------------------------------------------------------------------------------------------
    # Full parameters

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter, full and in its master dtype, keyed like ``module.named_parameters()``."""
        full: dict[str, torch.Tensor] = {}
        for name, param in self.module.named_parameters():
            w = self._weight_by_shard.get(id(param))
            if w is None:
                full[name] = param.detach().clone()
                continue
            gathered = torch.empty(w.chunk * self.world_size, dtype=param.dtype, device=param.device)
            if self.world_size == 1:
                gathered.copy_(param.detach())
            else:
                _all_gather_flat(gathered, param.detach(), group=self.process_group)
            full[name] = gathered[:w.numel].view(w.shape).clone()
        return full

    @property
    def eval_module(self) -> nn.Module:
        return self  # gathers the weights: a collective, so every rank runs as many forwards

    def shard_of(self, param: torch.Tensor) -> tuple[torch.Size, int] | None:
        """(full shape, offset of this rank's first element in the flattened weight) for a sharded weight's shard
        (``param``: one of ``module``'s parameters; its optimizer state is laid out alike); None for a replicated
        parameter. Checkpoints save the full weights by it (``torch_impl.checkpoint``)."""
        w = self._weight_by_shard.get(id(param))
        return None if w is None else (w.shape, self.rank * w.chunk)

    def sharded_param_names(self) -> list[str]:
        """Names (as in ``module.named_parameters()``) of the sharded weights."""
        return [w.name for w in self._weights]

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, world_size={self.world_size}, sharded={len(self._weights)}, "
                f"units={len(self._units)} ({self.gather_unit}), compute_dtype={self.compute_dtype}, "
                f"prefetch_layers={self.prefetch_layers}")
