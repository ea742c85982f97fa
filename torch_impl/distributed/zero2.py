"""ZeRO stage 2 by hand: ``ZeRO2`` reduce-scatters the gradients in the backward, steps the optimizer on each rank's
slice of the weights, and all-gathers the updated weights.

``ZeRO2(module, torch.optim.AdamW, bucket_size_mb=25, comm_dtype=None, param_dtype=None, lr=..., ...)`` is a
``DataParallelWrapper``; its optimizer is ``.optimizer``, a plain ``optimizer_cls`` (lr schedulers, ``fused``,
``state_dict`` work as usual) over this rank's pieces of the weights.

Layout: the parameters are packed in reverse registration order (the backward's) into buckets of at most
``bucket_size_mb`` MiB, as ``DDPBucketed`` packs gradients; each bucket's weights become views of one flat buffer,
padded to a multiple of the world size N. Rank r owns the r-th of N equal slices of every bucket: the fp32 master
weights, the optimizer state and the averaged gradient of those elements, and nothing of the rest. A slice cuts
each parameter in one contiguous range of its flattened elements (maybe empty): the optimizer's parameters are these
pieces, one per model parameter, in registration order, so checkpoints name and place them like any parameter's
shard (``shard_of``, ``torch_impl.checkpoint``).

One step:

* backward: once all the gradients of a bucket are ready (post-accumulate-grad hooks, buckets launched in their fixed
  order, as ``DDPBucketed``), they are copied into a new flat buffer (in ``comm_dtype``), the parameters' ``.grad``
  are released, and an asynchronous reduce-scatter averages the buffer into this rank's slice. Buffers in flight
  take at most ``MAX_PENDING_MB`` (or one bucket), so the gradients take 1/N of their memory plus those (ZeRO-2's
  P_os+g); the compute stream waits for the oldest reduce-scatter only beyond that.
* ``finish_gradient_synchronization``: waits; the slices (fp32) become the ``.grad`` of the pieces.
* ``optimizer.step()``: updates the pieces; its post-hook casts them into the flat buffers' own slices and
  all-gathers every bucket in place, asynchronously, in the order the next forward needs them: the buckets with
  weights outside ``module.layers``' blocks first, waited for when the module's forward starts; then the blocks'
  buckets, each waited for just before the first span of blocks that uses it (``Blocks.register_span_hook``), so
  the gathers run beside the forward. A module without ``Blocks`` waits for all of them when its forward starts;
  ``state_dict``, ``load_state_dict`` and the next step wait too; other reads of the weights before the next
  forward call ``wait_for_weights()`` first. ``engine="copy_engines"`` (NCCL, one GPU a rank on one host): the
  weights live in symmetric memory (``copy_engines.SymmetricBuffer``) and each rank copies its slices into its
  peers' buffers (the copy engines: no SMs taken from the forward's GEMMs) and signals each peer, whose waits are
  then on those signals; the reduce-scatters stay NCCL's.

Against an all-reduce of the gradients (``DDPBucketed``) the bytes on the wire are the same (a reduce-scatter and
an all-gather), but only the reduce-scatter's half runs beside the backward, the all-gather's beside the forward, and
the optimizer does 1/N of the work.
``param_dtype`` (e.g. ``torch.bfloat16``): the weights (frozen ones too) are cast to it in place at construction
(the master pieces keep their exact fp32 values, as ``MasterAdamW``; run the model without autocast), so the
all-gather moves 2 bytes a weight and the gradients arrive in bf16. A model state dict loaded into the module
resets the masters to its weights; an optimizer state dict loaded after it brings back its exact masters.

Caveats: as ``DDPBucketed``'s (one synchronized backward a step, ``no_sync`` for accumulation: the micro-batches'
gradients accumulate in full-size ``.grad`` until the last backward). A parameter that gets no gradient on any rank
contributes zeros (``find_unused_parameters=False``): the optimizer steps it with a zero gradient, whose weight decay
a single process would skip. Buckets are sized by the weights' bytes before any cast. Step only ``.optimizer``, and
keep the wrapper while it is used (its hooks gather the weights). Weights written in place by other means than
``module.load_state_dict`` (a DCP load of the model alone) leave copied masters stale: load the optimizer's state too.

References: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (stage
2, P_os+g); DeepSpeed's stage 2 (bucketed reduce-scatter into contiguous partitions of flat buffers); torch FSDP's
``SHARD_GRAD_OP``.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_impl.distributed.copy_engines import WRITTEN, SymmetricBuffer, watch
from torch_impl.distributed.ddp import DDPBucketed, _Unit, _unique
from torch_impl.distributed.process_group import all_gather_flat, nccl_averages, reduce_scatter_flat

# Full-size gradient buffers in flight in the backward, MiB. A compiled span's gradients arrive together, at the
# end of its backward (BLOCKS_PER_GRAPH blocks: xl's 4 take 8 buckets of 100 MB), so the cap must hold a span's
# buckets: with 2 buckets the compute stream waited for each reduce-scatter in turn (2 H200s, xl 4 x 1,024: 0.9 ms
# a span, notes/data_parallel.md, session 34).
MAX_PENDING_MB = 1024


@dataclass
class _Slice:
    """A bucket's flat weights and this rank's slice of them."""

    weights: torch.Tensor  # (N S,) the bucket's parameters, packed and padded, in their dtype
    mine: torch.Tensor  # (S,) this rank's slice of ``weights`` (a view)
    master: torch.Tensor  # (S,) fp32: ``mine`` itself when the weights are fp32, else their exact copy
    grad: torch.Tensor  # (S,) fp32: the averaged gradient of the slice
    received: torch.Tensor  # (S,) where the reduce-scatter lands: ``grad`` itself, or a comm_dtype buffer
    pieces: list[tuple[nn.Parameter, int, int]] = field(default_factory=list)  # (piece, start, end) in the slice
    gather: Any = None  # the all-gather of ``weights`` in flight (True: the peers' copies), until a wait for it
    source: torch.Tensor | None = None  # what it gathers from, kept alive until then (gloo: a copy of ``mine``)
    symmetric: SymmetricBuffer | None = None  # copy_engines: ``weights``' symmetric memory

    @property
    def copied(self) -> bool:
        """Whether the master slice is a copy of the weights' (weights not in fp32)."""
        return self.master is not self.mine


class ZeRO2(DDPBucketed):
    """ZeRO-2 over ``module`` (see the module docstring). ``optimizer_cls`` with ``**options``: its optimizer, over
    this rank's pieces; ``param_dtype``: the dtype the weights are cast to (None: kept); ``engine``: how the
    updated weights reach the other ranks (``copy_engines.ENGINES``: NCCL's all-gather, or peer copies);
    ``bucket_size_mb``, ``comm_dtype``, ``comm_sms``, ``process_group``: as ``DDPBucketed``'s."""

    def __init__(self, module: nn.Module, optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
                 *, bucket_size_mb: float = 25.0, comm_dtype: torch.dtype | None = None,
                 param_dtype: torch.dtype | None = None, comm_sms: int = 0, process_group=None,
                 engine: str = "nccl", **options: Any):
        if param_dtype is not None and not param_dtype.is_floating_point:
            raise ValueError(f"param_dtype={param_dtype}: weights are cast to a floating-point dtype")
        self.param_dtype = param_dtype
        self._slices: dict[int, _Slice] = {}  # id(unit) -> its slice
        self._pending: list[_Unit] = []  # launched buckets whose buffers are still in flight
        self._masters_in_state = False  # every copied master is in its optimizer state (once the state exists)
        super().__init__(module, bucket_size_mb, comm_dtype=comm_dtype, engine=engine, comm_sms=comm_sms,
                         process_group=process_group, find_unused_parameters=False)
        self._layout: dict[int, tuple[torch.Size, int]] = {}  # id(piece) -> (full shape, offset in its parameter)
        pieces: list[tuple[int, nn.Parameter]] = []  # (parameter index, piece)
        for unit in self._units:
            for i, piece, offset in self._cut(unit):
                self._layout[id(piece)] = (self._params[i].shape, offset)
                pieces.append((i, piece))
        pieces.sort(key=lambda ip: ip[0])  # registration order
        names = self._param_names()
        self._pieces = [(names[i], piece) for i, piece in pieces]
        self._shard_ids = frozenset(self._layout)
        if param_dtype is not None:  # frozen weights too: one dtype in the forward
            for p in module.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(param_dtype)
        self.optimizer = optimizer_cls([piece for _, piece in self._pieces], **options)
        wrapper = weakref.ref(self)  # the optimizer and the module must not keep the wrapper alive

        def alive() -> ZeRO2:
            if wrapper() is None:
                raise RuntimeError("ZeRO2's optimizer outlived its wrapper: its step would update this rank's slice "
                                   "only; keep the ZeRO2 object")
            return wrapper()

        self.optimizer.register_step_post_hook(lambda *_: alive()._after_step())
        self.optimizer.register_load_state_dict_post_hook(lambda *_: alive()._after_load())
        module.register_load_state_dict_post_hook(
            lambda *_: None if wrapper() is None else wrapper()._masters_from_weights())
        self._order_gathers(module, wrapper)

    def _param_names(self) -> dict[int, str]:
        index = {id(p): i for i, p in enumerate(self._params)}
        return {index[id(p)]: name for name, p in self.module.named_parameters() if id(p) in index}

    def _order_gathers(self, module: nn.Module, alive: Callable[[], ZeRO2 | None]) -> None:
        """The all-gathers' order (``_gathers``: the forward's) and the hooks that wait for them (module docstring)."""
        slice_of = {id(self._params[i]): self._slices[id(unit)] for unit in self._units for i in unit.params}
        layers = getattr(module, "layers", None)
        blocks = tuple(layers) if hasattr(layers, "register_span_hook") else ()
        self._block_slices = {id(b): _unique(slice_of[id(p)] for p in b.parameters() if id(p) in slice_of)
                              for b in blocks}
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        first = {id(slice_of[id(p)]) for p in self._params if id(p) not in in_blocks}
        order = [self._slices[id(unit)] for unit in reversed(self._units)]  # the units are in the backward's order
        self._first = [s for s in order if id(s) in first]
        self._gathers = self._first + [s for s in order if id(s) not in first]

        def hook(slices: Callable[..., list[_Slice]]) -> Callable[..., None]:
            """A hook that waits for ``slices(wrapper, *the hook's arguments)``."""
            def run(*args: Any, **_: Any) -> None:
                if (zero2 := alive()) is not None:
                    zero2._wait(slices(zero2, *args))
            return run

        module.register_forward_pre_hook(hook(lambda z, *_: z._first))
        module.register_state_dict_pre_hook(hook(lambda z, *_: z._gathers))
        module.register_load_state_dict_pre_hook(hook(lambda z, *_: z._gathers))
        if blocks:
            layers.register_span_hook(hook(lambda z, span: [s for b in span for s in z._block_slices[id(b)]]))

    @property
    def symmetric_bytes(self) -> int:
        """Bytes of this rank's weights in symmetric memory (copy_engines), which CUDA's caching allocator does not
        count (``torch.cuda.max_memory_allocated``)."""
        return sum(s.symmetric.tensor.nbytes for s in self._slices.values() if s.symmetric is not None)

    def wait_for_weights(self) -> None:
        """Wait for the last step's all-gathers. The forward, ``state_dict`` and ``load_state_dict`` do; anything
        else that reads the module's weights between ``optimizer.step()`` and the next forward must call this."""
        self._wait(self._gathers)

    @staticmethod
    def _wait(slices: list[_Slice]) -> None:
        """Wait for these slices' all-gathers (NCCL, copy engines: the compute stream does; the host does not)."""
        copied = False
        for s in slices:
            if s.gather is True:  # copy engines: each peer signals once its slice is in
                for q in s.symmetric.peers:
                    s.symmetric.wait(q, WRITTEN)
                copied = True
            elif s.gather is not None:
                s.gather.wait()
            s.gather = s.source = None
        if copied:
            watch("the peers' copies of ZeRO-2's updated weights")

    # ------------------------------------------------------------------ layout

    @torch.no_grad()
    def _allocate(self, unit: _Unit) -> None:
        """Pack the bucket's weights into one flat buffer (padded to N S elements) that they become views of,
        and make this rank's slice: master weights and gradient."""
        params = [self._params[i] for i in unit.params]
        n, device = self.world_size, params[0].device
        size = math.ceil(unit.offsets[-1] / n)  # S
        mine_range = slice(self.rank * size, (self.rank + 1) * size)
        packed = torch.zeros(n * size, dtype=params[0].dtype, device=device)  # the weights as given
        for p, start in zip(params, unit.offsets):
            packed[start:start + p.numel()].copy_(p.reshape(-1))
        weights = packed.to(self.param_dtype or packed.dtype)  # packed itself unless cast
        symmetric = None
        if self.engine == "copy_engines":  # the weights in symmetric memory, each peer's buffer mapped here
            symmetric = SymmetricBuffer(n * size, weights.dtype, device, self.process_group)
            weights = symmetric.tensor.copy_(weights)
        mine = weights[mine_range]
        # fp32 weights are their own master; else an exact fp32 copy of the values before the cast
        master = mine if mine.dtype == torch.float32 else packed[mine_range].to(torch.float32, copy=True)
        for p, start in zip(params, unit.offsets):
            p.data = weights[start:start + p.numel()].view_as(p)
        grad = torch.zeros(size, dtype=torch.float32, device=device)
        comm = self.comm_dtype or weights.dtype
        received = grad if comm == torch.float32 else torch.zeros(size, dtype=comm, device=device)
        self._slices[id(unit)] = _Slice(weights, mine, master, grad, received, symmetric=symmetric)

    def _cut(self, unit: _Unit) -> list[tuple[int, nn.Parameter, int]]:
        """(parameter index, piece, offset of the piece in the flattened parameter) for each parameter of the
        bucket: the range of its elements in this rank's slice, a view of the master weights (maybe empty)."""
        s = self._slices[id(unit)]
        size = s.master.numel()
        lo_slice = self.rank * size
        out = []
        for i, start, end in zip(unit.params, unit.offsets, unit.offsets[1:]):
            lo, hi = max(start, lo_slice), min(end, lo_slice + size)
            lo, hi, offset = (lo, hi, lo - start) if hi > lo else (lo_slice, lo_slice, 0)  # else an empty piece
            piece = nn.Parameter(s.master[lo - lo_slice:hi - lo_slice])
            s.pieces.append((piece, lo - lo_slice, hi - lo_slice))
            out.append((i, piece, offset))
        return out

    # ------------------------------------------------------------------ backward

    @torch.no_grad()
    def _launch(self, unit: _Unit) -> None:
        s = self._slices[id(unit)]
        flat = torch.empty(s.weights.numel(), dtype=s.received.dtype, device=s.weights.device)  # (N S,)
        flat[unit.offsets[-1]:].zero_()  # the padding
        views, grads = [], []
        for i, start, end in zip(unit.params, unit.offsets, unit.offsets[1:]):
            p = self._params[i]
            if p.grad is None:  # no gradient on this rank this step: contribute zeros
                flat[start:end].zero_()
            else:
                views.append(flat[start:end])
                grads.append(p.grad.reshape(-1))
        if views:
            torch._foreach_copy_(views, grads)
        for i in unit.params:
            self._params[i].grad = None  # released: the gradients now live in the flat buffer
        unit.work = reduce_scatter_flat(s.received, flat, op=self._average_op(flat.dtype), group=self.process_group,
                                        async_op=True)
        unit.flat, unit.launched = flat, True
        self._pending.append(unit)
        while len(self._pending) > 1 and sum(u.flat.nbytes for u in self._pending) > MAX_PENDING_MB * 2**20:
            self._land(self._pending.pop(0))

    def on_train_batch_start(self) -> None:
        """Also lands the reduce-scatters of a backward that no ``finish_gradient_synchronization`` followed."""
        self._land_all()
        super().on_train_batch_start()

    @staticmethod
    def _land(unit: _Unit) -> None:
        unit.work.wait()
        unit.flat = None  # the full-size buffer is free once its reduce-scatter is done

    def _land_all(self) -> None:
        for unit in self._pending:
            self._land(unit)
        self._pending = []

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        self._launch_rest()
        self._land_all()
        self._copies_done()
        slices = list(self._slices.values())
        cast = [s for s in slices if s.received is not s.grad]
        if cast:  # one multi-tensor kernel: a copy per slice took 3.6 ms on 2 H200s (xl, bf16), notes/data_parallel.md
            torch._foreach_copy_([s.grad for s in cast], [s.received for s in cast])
        summed = [s.grad for s in slices if not nccl_averages(self._nccl, s.received.dtype)]
        if summed:
            torch._foreach_div_(summed, self.world_size)
        for s in slices:
            for piece, lo, hi in s.pieces:
                piece.grad = s.grad[lo:hi]
        self._end_backward()

    # ------------------------------------------------------------------ after the optimizer

    @torch.no_grad()
    def _after_step(self) -> None:
        """Cast the updated master slices into the flat weights and all-gather every bucket in place, in the
        forward's order; the forward waits for each (``_order_gathers``)."""
        self.wait_for_weights()  # if no forward did since the last step (a load, then a step)
        self._copies_done()
        copied = [s for s in self._slices.values() if s.copied]
        if copied:
            torch._foreach_copy_([s.mine for s in copied], [s.master for s in copied])
        if not self._masters_in_state:  # checkpoints carry the exact weights (MasterAdamW's key), once state exists
            pieces = [piece for s in copied for piece, _, _ in s.pieces]
            for piece in pieces:
                state = self.optimizer.state.get(piece)
                if state:
                    state.setdefault("master", piece)
            self._masters_in_state = all(self.optimizer.state.get(piece) for piece in pieces)
        if self.engine == "copy_engines":
            self._copy_to_peers()
            return
        for s in self._gathers:
            s.source = s.mine if self._nccl else s.mine.clone()  # gloo gathers from a separate tensor
            s.gather = all_gather_flat(s.weights, s.source, group=self.process_group, async_op=True)

    def _copy_to_peers(self) -> None:
        """Each slice into every peer's weights (``Memcpy PtoP``: the copy engines), then a signal to the peer, on a
        side stream after the cast. A peer is done reading its weights by then: this rank's reduce-scatters, which
        the optimizer waited for, needed the peer's last one, launched after its whole backward."""
        self._push_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._push_stream):
            for s in self._gathers:
                size = s.mine.numel()
                for q in s.symmetric.peers:
                    s.symmetric.peer(q)[self.rank * size:(self.rank + 1) * size].copy_(s.mine)
                    s.symmetric.signal(q, WRITTEN)
                s.gather = True

    def _copies_done(self) -> None:
        """The compute stream waits for this rank's copies to the peers before it writes ``mine`` again (the
        optimizer, the cast of the masters): by then they are long done."""
        if self._push_stream is not None:
            torch.cuda.current_stream().wait_stream(self._push_stream)

    @torch.no_grad()
    def _masters_from_weights(self) -> None:
        """Copied masters take the weights' values (a model state dict was loaded): the next step must not write the
        old masters back over them."""
        for s in self._slices.values():
            if s.copied:
                s.master.copy_(s.mine)

    @torch.no_grad()
    def _after_load(self) -> None:
        """Loaded master weights go into the copied masters where they agree with the loaded weights (rounded to
        their dtype); elsewhere the masters take the weights. Then every rank's weights are gathered: a collective."""
        for s in self._slices.values():
            for piece, lo, hi in s.pieces if s.copied else ():
                state = self.optimizer.state.get(piece)
                master = state.pop("master", None) if state else None
                fresh = master is not None and torch.equal(master.to(s.mine.dtype), s.mine[lo:hi])
                piece.copy_(master if fresh else s.mine[lo:hi])
                if state:
                    state["master"] = piece
        self._masters_in_state = False  # pieces the loaded state did not cover get theirs after their first step
        if self.engine == "copy_engines":  # the peers' queued reads of their weights end before our copies land
            dist.barrier(group=self.process_group)
        self._after_step()

    # ------------------------------------------------------------------ DataParallelWrapper

    def named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._pieces)

    def shard_of(self, param: torch.Tensor) -> tuple[torch.Size, int] | None:
        return self._layout.get(id(param))

