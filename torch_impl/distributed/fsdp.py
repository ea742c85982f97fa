"""FSDP by hand (ZeRO-3 for the matmul weights): ``FSDP(module, compute_dtype=None)``.

What is sharded: the 2-D ``weight`` of every ``torch.nn.Linear`` / ``torch.nn.Embedding`` and of every module
whose class is *named* ``Linear`` or ``Embedding`` (our ``torch_impl.model`` layers). Each such weight is
flattened, zero-padded to a multiple of the world size N, and split in N contiguous pieces; rank r keeps
piece r as an ``nn.Parameter`` registered under the *same name* (``module.weight`` becomes a 1-D shard), in
fp32 (the master weights: ``promote(dtype, float32)``), which is what the optimizer sees. Tied weights
(one Parameter in two layers) become one shard. Every other parameter (norm gains, biases) is replicated and
its gradient is all-reduced (averaged) in ``finish_gradient_synchronization()``. At construction rank 0's
parameters and buffers are broadcast to every rank. Build the optimizer *after* wrapping.

Forward: a forward pre-hook on each sharded layer all-gathers its weight and shadows the shard for the
duration of the layer's forward (``module.__dict__["weight"]`` = the full tensor; the post-hook removes it,
so ``named_parameters()`` never changes). The gather is ``_GatherWeight``, an ``autograd.Function`` whose
forward all-gathers the (cast) shard and whose backward reduce-scatters the weight's gradient. Prefetch:
before waiting for its own gather, a layer starts asynchronous all-gathers for the next ``prefetch_layers``
(at most 2) sharded layers in execution order (recorded in the previous forward; registration order in the
first one), so communication overlaps the current layer's compute. Two layers ahead are in flight at most,
except in the first forward, where registration order can differ from execution order (SwiGLU's w2 is
registered before w3 but runs after it) and a layer prefetched too early stays gathered until it runs.

Freeing after use, and gathering again for backward: ``FSDP.forward`` runs the module under
``torch.autograd.graph.saved_tensors_hooks``. When autograd saves a tensor that lives in a gathered weight's
storage (e.g. ``W.T`` saved by the matmul for the input gradient), the pack hook stores only (layer, size,
stride, offset) instead, so the gathered weight is freed by the post-forward hook. When backward needs it,
the unpack hook all-gathers the weight again (or takes the prefetched gather) and rebuilds the same view
with ``as_strided``; it also starts the gathers of the next ``prefetch_layers`` layers in backward order
(reverse forward order of the layers that saved a weight). Each backward gather is dropped as soon as the
autograd node that needed it is done. This needs no change to the layers' forward code and no recomputation.

Gradients: ``_GatherWeight.backward`` pads the full weight gradient, divides it by N and launches an
asynchronous reduce-scatter (in ``reduce_dtype``: the compute dtype by default, like torch FSDP2's
``MixedPrecisionPolicy``). At most ``MAX_PENDING_REDUCE_SCATTERS`` (2) are in flight: launching another first
waits for the oldest and lands its piece, so the padded full-size gradient buffers alive at once are bounded
by two layers' (``pending_gradient_bytes()``), not all of them (the rate limit of Zhao et al.). Landing a
piece casts it to the master dtype and accumulates it into the shard's ``.grad`` (so gradients arrive fp32,
in the master dtype); ``finish_gradient_synchronization()`` lands the rest and all-reduces the replicated
parameters' gradients (a parameter with no gradient on any rank keeps
``None``). Call it once after the backward(s) of a step, before ``optimizer.step()``.

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

Caveats: a sharded weight may only be used inside its own module's forward (outside it, ``module.weight`` is
the 1-D shard). Every rank must run the same layers in the same order (data-dependent skipping of a layer
on one rank would deadlock the collectives, as in any FSDP). Calling ``fsdp.module(x)`` directly bypasses the
saved-tensor hooks: still correct, but gathered weights then stay alive until backward.

References: Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (flat
parameters, forward/backward prefetch, rate limiting, mixed precision); Rajbhandari et al. 2020, ZeRO stage 3
(P_os+g+p); torch FSDP2 ``fully_shard`` (per-parameter sharding, ``MixedPrecisionPolicy``); CS336 (Stanford,
2025) assignment 2.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_impl.distributed.interface import DataParallelWrapper

SHARDED_CLASS_NAMES = ("Linear", "Embedding")
MAX_PREFETCH_LAYERS = 2
MAX_PENDING_REDUCE_SCATTERS = 2  # gradient reduce-scatters in flight (each holds a full-size gradient buffer)

# torch 2.13 renames the flat collectives (and warns on the old names); torch 2.11 only has the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_sharded_layer(module: nn.Module) -> bool:
    """True for the layers FSDP shards: nn.Linear / nn.Embedding or a class named Linear / Embedding,
    with a 2-D ``weight`` Parameter of its own."""
    weight = module._parameters.get("weight")
    named = isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ in SHARDED_CLASS_NAMES
    return named and isinstance(weight, nn.Parameter) and weight.dim() == 2


@dataclass(eq=False)
class _Unit:
    """One sharded weight (shared by every layer that holds it)."""

    index: int
    name: str  # its first name in module.named_parameters()
    shape: torch.Size
    numel: int
    padded: int  # numel rounded up to a multiple of the world size
    shard: nn.Parameter  # this rank's piece, (padded / N,), master dtype
    pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (work, gathered, source) in flight
    fwd_key: int | None = None  # storage pointer of the gathered weight of the forward in progress
    bwd_ref: Any = None  # weakref to the gathered weight backward is using
    modules: list[nn.Module] = field(default_factory=list)


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps instead of a gathered weight: enough to rebuild the same view after a re-gather."""

    unit: _Unit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _GatherWeight(torch.autograd.Function):
    """shard (padded / N,) -> full weight (shape), all-gathered; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: _Unit, fsdp: "FSDP") -> torch.Tensor:
        gathered = fsdp._take_gather(unit)  # (padded,) compute dtype
        unit.fwd_key = gathered.untyped_storage().data_ptr()
        fsdp._live[unit.fwd_key] = unit
        ctx.unit, ctx.fsdp = unit, fsdp
        return gathered[: unit.numel].view(unit.shape)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.fsdp._reduce_scatter_grad(ctx.unit, grad_full)
        return None, None, None  # the shard's .grad is filled by finish_gradient_synchronization()


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
    ``reduce_dtype``: dtype of the gradient reduce-scatter (None: the compute dtype). ``prefetch_layers``:
    how many sharded layers ahead to gather asynchronously, 0 to 2. ``process_group``: default the world.
    """

    mesh_axis, sync_every_backward, sharded_state = "fsdp", True, True

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, *,
                 reduce_dtype: torch.dtype | None = None, prefetch_layers: int = MAX_PREFETCH_LAYERS,
                 process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not 0 <= prefetch_layers <= MAX_PREFETCH_LAYERS:
            raise ValueError(f"prefetch_layers={prefetch_layers}; accepted: 0 to {MAX_PREFETCH_LAYERS}")
        for name, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"{name}={dtype} is not a floating-point dtype")
        self.module = module
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.prefetch_layers = prefetch_layers
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1

        self._broadcast_from_rank0()
        self._units: list[_Unit] = []
        self._unit_of: dict[nn.Module, _Unit] = {}
        self._shard_ids: set[int] = set()
        self._shard_params()
        self._replicated = [p for p in module.parameters() if id(p) not in self._shard_ids]
        self._unit_by_shard = {id(u.shard): u for u in self._units}

        self._live: dict[int, _Unit] = {}  # storage pointer -> unit, for weights gathered in a running forward
        self._fwd_order: list[_Unit] = list(self._units)  # prefetch order of the next forward
        self._fwd_seen: list[_Unit] = []  # execution order of the forward in progress
        self._fwd_done: set[_Unit] = set()  # (the same, as a set)
        self._fwd_pos: dict[_Unit, int] = {}
        self._bwd_order: list[_Unit] = []  # layers that saved their weight, last first
        self._bwd_pos: dict[_Unit, int] = {}
        self._bwd_done: set[_Unit] = set()  # layers whose weight backward has gathered already
        self._pending_grads: list[tuple[Any, torch.Tensor, _Unit, torch.Tensor]] = []
        self._gathered: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self.peak_gathered_bytes = 0
        self._handles = []
        for layer in self._unit_of:
            self._handles.append(layer.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post_forward, always_call=True))

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
    def _shard_params(self) -> None:
        names = {id(p): n for n, p in self.module.named_parameters()}
        by_weight: dict[int, _Unit] = {}
        for layer in self.module.modules():
            if not is_sharded_layer(layer):
                continue
            weight = layer._parameters["weight"]
            unit = by_weight.get(id(weight))
            if unit is None:
                numel = weight.numel()
                padded = math.ceil(numel / self.world_size) * self.world_size
                per_rank = padded // self.world_size
                master_dtype = torch.promote_types(weight.dtype, torch.float32)
                flat = torch.zeros(padded, dtype=master_dtype, device=weight.device)
                flat[:numel] = weight.reshape(-1)
                shard = nn.Parameter(flat[self.rank * per_rank:(self.rank + 1) * per_rank].clone(),
                                     requires_grad=weight.requires_grad)
                unit = _Unit(len(self._units), names[id(weight)], weight.shape, numel, padded, shard)
                by_weight[id(weight)] = unit
                self._units.append(unit)
                self._shard_ids.add(id(shard))
            layer._parameters["weight"] = unit.shard  # same name, now the 1-D shard
            unit.modules.append(layer)
            self._unit_of[layer] = unit

    # ------------------------------------------------------------------------------------------------
    # All-gathers

    def _start_gather(self, unit: _Unit) -> None:
        source = unit.shard.detach()
        if self.compute_dtype is not None:
            source = source.to(self.compute_dtype)  # cast before communicating: fewer bytes
        gathered = torch.empty(unit.padded, dtype=source.dtype, device=source.device)
        if self.world_size == 1:
            gathered.copy_(source)
            work = None
        else:
            work = _all_gather_flat(gathered, source, group=self.process_group, async_op=True)
        unit.pending = (work, gathered, source)
        self._gathered.add(gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _take_gather(self, unit: _Unit) -> torch.Tensor:
        """This unit's gathered weight (padded,): the prefetched one, or gathered now; waits for it."""
        if unit.pending is None:
            self._start_gather(unit)
        work, gathered, _ = unit.pending
        unit.pending = None
        if work is not None:
            work.wait()
        return gathered

    def _prefetch(self, order: list[_Unit], pos: int, done: set[_Unit]) -> None:
        """Start the gathers of the next ``prefetch_layers`` units of ``order`` after ``pos`` (skipping the
        ones this pass already used: a first forward runs in registration order only roughly)."""
        for unit in order[pos + 1:pos + 1 + self.prefetch_layers]:
            if unit.pending is None and unit not in done:
                self._start_gather(unit)

    def _drop_pending(self) -> None:
        """Wait for and drop gathers nobody consumed (a prefetch past the last layer run)."""
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

    def _pre_forward(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        unit = self._unit_of[layer]
        if unit.pending is None:
            self._start_gather(unit)  # ours first, then the ones ahead, then wait for ours
        if unit not in self._fwd_done:
            self._fwd_done.add(unit)
            self._fwd_seen.append(unit)
        pos = self._fwd_pos.get(unit)
        if pos is not None:
            self._prefetch(self._fwd_order, pos, self._fwd_done)
        layer.__dict__["weight"] = _GatherWeight.apply(unit.shard, unit, self)
        if self.compute_dtype is not None:
            for name, param in layer._parameters.items():
                if name != "weight" and param is not None and param.is_floating_point():
                    layer.__dict__[name] = param.to(self.compute_dtype)
            args, kwargs = _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)
        return args, kwargs

    def _post_forward(self, layer: nn.Module, args: tuple, output: Any) -> None:
        for name in list(layer._parameters):
            layer.__dict__.pop(name, None)  # the shard (and the fp32 bias) show again
        unit = self._unit_of[layer]
        if unit.fwd_key is not None:
            self._live.pop(unit.fwd_key, None)
            unit.fwd_key = None

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
        gathered = unit.bwd_ref() if unit.bwd_ref is not None else None
        if gathered is None:
            gathered = self._take_gather(unit)
            unit.bwd_ref = weakref.ref(gathered)
            self._bwd_done.add(unit)
            pos = self._bwd_pos.get(unit)
            if pos is not None:
                self._prefetch(self._bwd_order, pos, self._bwd_done)
        return gathered.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------------------------------------
    # Gradients

    def _reduce_scatter_grad(self, unit: _Unit, grad_full: torch.Tensor) -> None:
        dtype = self.reduce_dtype or grad_full.dtype
        # Average: divide before summing (keeps fp16 sums in range); a new tensor, never autograd's.
        if unit.padded == unit.numel:
            flat = grad_full.reshape(-1).to(dtype) / self.world_size
        else:
            flat = torch.zeros(unit.padded, dtype=dtype, device=grad_full.device)
            flat[:unit.numel] = grad_full.reshape(-1)
            flat.div_(self.world_size)
        if self.world_size == 1:
            self._land_grad(None, flat, unit)
            return
        piece = torch.empty(unit.padded // self.world_size, dtype=dtype, device=grad_full.device)
        work = _reduce_scatter_flat(piece, flat, group=self.process_group, async_op=True)
        self._pending_grads.append((work, piece, unit, flat))
        while len(self._pending_grads) > MAX_PENDING_REDUCE_SCATTERS:
            self._land_grad(*self._pending_grads.pop(0)[:3])

    @torch.no_grad()
    def _land_grad(self, work: Any, piece: torch.Tensor, unit: _Unit) -> None:
        """Wait for a reduce-scatter (the full-size buffer it read is dropped with its entry) and accumulate
        its piece, in the master dtype, into the shard's ``.grad``."""
        if work is not None:
            work.wait()
        grad = piece.to(unit.shard.dtype)
        if unit.shard.grad is None:
            unit.shard.grad = grad
        else:
            unit.shard.grad += grad

    def pending_gradient_bytes(self) -> int:
        """Bytes of the full-size gradient buffers of reduce-scatters still in flight (at most two layers')."""
        return sum(flat.numel() * flat.element_size() for *_, flat in self._pending_grads)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Land the gradient reduce-scatters still in flight (fp32, into the shards' ``.grad``) and average the
        replicated parameters' gradients over the ranks."""
        while self._pending_grads:
            self._land_grad(*self._pending_grads.pop(0)[:3])
        self._drop_pending()
        for unit in self._units:
            unit.bwd_ref = None
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
        units = {id(u.shard): u for u in self._units}
        full: dict[str, torch.Tensor] = {}
        for name, param in self.module.named_parameters():
            unit = units.get(id(param))
            if unit is None:
                full[name] = param.detach().clone()
                continue
            gathered = torch.empty(unit.padded, dtype=param.dtype, device=param.device)
            if self.world_size == 1:
                gathered.copy_(param.detach())
            else:
                _all_gather_flat(gathered, param.detach(), group=self.process_group)
            full[name] = gathered[:unit.numel].view(unit.shape).clone()
        return full

    @property
    def eval_module(self) -> nn.Module:
        return self  # gathers the weights: a collective, so every rank runs as many forwards

    def shard_of(self, param: torch.Tensor) -> tuple[torch.Size, int] | None:
        """(full shape, offset of this rank's first element in the flattened weight) for a sharded weight's shard
        (``param``: one of ``module``'s parameters; its optimizer state is laid out alike); None for a replicated
        parameter. Checkpoints save the full weights by it (``torch_impl.checkpoint``)."""
        unit = self._unit_by_shard.get(id(param))
        return None if unit is None else (unit.shape, self.rank * (unit.padded // self.world_size))

    def sharded_param_names(self) -> list[str]:
        """Names (as in ``module.named_parameters()``) of the sharded weights."""
        return [u.name for u in self._units]

    def extra_repr(self) -> str:
        return (f"rank={self.rank}, world_size={self.world_size}, sharded={len(self._units)}, "
                f"compute_dtype={self.compute_dtype}, prefetch_layers={self.prefetch_layers}")
