"""Distributed data parallelism by hand on ``torch.distributed``: four ways to average gradients.

Every rank holds a full replica of the model and sees its own slice of the batch; after the backward the
ranks' gradients are averaged so that every replica takes the same optimizer step, which reproduces
single-process training on the concatenated batch (with a mean loss). The variants differ only in *how* and
*when* gradients are communicated:

* ``NaiveDDP(module)``: after the backward, one blocking all-reduce per parameter (many small messages,
  each paying the collective's latency; no overlap with compute).
* ``FlatDDP(module)``: after the backward, all gradients flattened into one buffer per dtype/device and
  all-reduced with a single collective (latency paid once; still no overlap).
* ``DDPIndividualParameters(module)``: an asynchronous all-reduce per parameter, launched from its
  post-accumulate-grad hook as soon as its gradient is ready, overlapping communication with the rest of
  the backward; ``finish_gradient_synchronization()`` waits for them.
* ``DDPBucketed(module, bucket_size_mb)``: parameters grouped, in reverse registration order (roughly the
  order in which the backward produces their gradients), into flat buckets of at most ``bucket_size_mb``
  MiB (2**20 bytes; a larger parameter gets a bucket of its own); a bucket's asynchronous all-reduce is
  launched when all its gradients are ready. Overlap *and* few messages (Li et al. 2020, section 3.2.3).

Common to all (the ``_DataParallel`` base class): rank 0's parameters **and buffers** are broadcast at
construction, so replicas start identical whatever each rank initialized; parameters are deduplicated by
identity (tied weights, e.g. an embedding shared with the output head, are one parameter and are reduced
once); frozen parameters (``requires_grad=False``) are skipped; ``forward`` delegates to ``.module``.

Parameters that get no gradient in a step (unused on this rank, or on every rank) never deadlock: every
rank launches the same collectives in the same fixed order (the hook-driven variants launch a bucket only
after all buckets before it in that order, as PyTorch's reducer does, so a rank whose graph differs still
issues matching collectives), and a missing gradient contributes zeros. With ``find_unused_parameters=True``
(the default) one more tiny all-reduce per step counts, per parameter, how many ranks produced a gradient;
a parameter that got a gradient on no rank keeps ``.grad = None`` afterwards, exactly as in single-process
training (so an optimizer with weight decay or momentum skips it there too). With
``find_unused_parameters=False`` that count (and its device-to-host sync) is skipped and such a parameter
ends the step with a zero gradient instead.

Communication beside compute (``comm_sms=k``, NCCL only): an all-reduce's kernels occupy SMs while the backward's
matrix products run, and cuBLAS's persistent GEMMs, sized to every SM, then run in two waves: on an H100 the
backward's largest GEMMs took 1.84x as long while NCCL's 24 thread blocks were resident (notes/data_parallel.md).
With ``comm_sms=k`` the gradients go through a group whose NCCL kernels use at most k SMs
(``process_group.comm_group``), and the hook-driven variants make cuBLAS target all SMs but k from the backward's
first gradient to ``finish_gradient_synchronization`` (``leave_sms_to_communication``), so the GEMMs fit beside
them. NCCL averages fp32 and bf16 itself (``ReduceOp.AVG``, ``process_group.nccl_averages``); otherwise a sum and a
division.

Gradient accumulation: run the backward of every micro-batch but the last inside ``with ddp.no_sync():``
(as with torch DDP): gradients accumulate locally in ``.grad`` and nothing is communicated (the hooks of the
overlapped variants stand down); the last backward, outside it, communicates the accumulated gradients once,
and ``finish_gradient_synchronization()`` follows it as usual (calling it inside ``no_sync()`` raises).

Caveats:
* One synchronized backward per step: call ``finish_gradient_synchronization()`` after it and before the
  optimizer step (the hook-driven variants raise if a parameter's gradient arrives twice between two
  synchronizations outside ``no_sync()``).
* Gradients are averaged (summed, then divided by the world size), matching a mean loss.
* Collectives go to ``process_group`` (default: the default group), which must be initialized first
  (``torch_impl.distributed.init_distributed``).
* ``DDPBucketed`` leaves each ``.grad`` as a view into its bucket's flat buffer after the step (PyTorch DDP's
  ``gradient_as_bucket_view``), which saves a copy per step; ``zero_grad()`` (``set_to_none``) works as usual. (With
  ``mean="optimizer"`` each ``.grad`` is its mean, a tensor of its own, after ``finish_gradient_synchronization``.)

References: S. Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB 2020 (arXiv:2006.15704) - gradient bucketing, overlap via autograd hooks, fixed bucket order, unused
parameters; Stanford CS336 assignment 2 (2025), section 2.3 (naive, flat, individual, bucketed DDP).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from torch_impl.distributed.copy_engines import (PeerAverage, PeerGather, SymmetricBuffer, buffer_numel, check_engine,
                                                 gather_numel)
from torch_impl.distributed.interface import DataParallelWrapper
from torch_impl.distributed.process_group import comm_group, nccl_averages
from torch_impl.optim import ALIGN, Part, mean_of

_MIB = 2**20
# The gradients the backward launches last, in MiB: their communication is still running when it ends. With the copy
# engines a bucket's mean is computed on the compute stream once the buckets launched after it hold this many MiB
# (DDPBucketed: late enough that the peers' pushes are in), so the means of the last 2 TAIL_MB are computed at the
# end of the backward or after it; an optimizer stepping the units as they land (``finish_in_parts``) steps those
# units one by one, and all earlier ones, landed by then, in one part (with the first part taking the units 1 to 2
# TAIL_MB from the end too, it waited ~0.8 ms for their means on 2 H200s, xl, 4c4c37f).
TAIL_MB = 512
# Where bucketed DDP's means are computed: in each bucket (an all-reduce), or by the optimizer as it reads the
# gradients of every rank (copy engines: each rank's gradients pushed to its peers, ``copy_engines.PeerGather``)
MEANS = ("bucket", "optimizer")


def _unique(tensors) -> list[torch.Tensor]:
    """Tensors deduplicated by identity, first occurrence order kept."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _group_by_dtype_device(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), groups in order of first appearance."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


class _DataParallel(nn.Module, DataParallelWrapper):
    """What every DDP variant shares: the replica, its broadcast, the parameter list, averaging, unused grads.

    Subclasses implement ``finish_gradient_synchronization()`` (and may hook into the backward).
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None,
                 find_unused_parameters: bool = True, comm_sms: int = 0):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialized process group; call "
                               "torch_impl.distributed.init_distributed() (or dist.init_process_group) first")
        if comm_sms < 0:
            raise ValueError(f"comm_sms={comm_sms}: the SMs left to communication; 0 (NCCL's default) or more")
        self.module = module
        self.comm_sms = comm_sms
        self.process_group = comm_group(comm_sms, process_group) if comm_sms else process_group
        self._nccl = dist.get_backend(self.process_group) == "nccl"
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.find_unused_parameters = find_unused_parameters
        # Trainable parameters, each once (module.parameters() already drops repeats of a tied Parameter;
        # _unique guards against modules that override it), in registration order.
        self._params: list[nn.Parameter] = [p for p in _unique(module.parameters()) if p.requires_grad]
        self._sync = True  # False inside no_sync()
        self._broadcast_state()

    # ------------------------------------------------------------------ construction

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Copy rank 0's parameters (trainable or not) and buffers to every rank: one flat broadcast per
        (dtype, device) group instead of one per tensor."""
        tensors = _unique([*self.module.parameters(), *self.module.buffers()])
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for idx in _group_by_dtype_device(tensors):
            group = [tensors[i].data for i in idx]
            wire = [t.view(torch.uint8) if t.dtype == torch.bool else t for t in group]  # gloo has no bool
            flat = _flatten_dense_tensors(wire)
            dist.broadcast(flat, src=src, group=self.process_group)
            for t, synced in zip(wire, _unflatten_dense_tensors(flat, wire)):
                t.copy_(synced)

    # ------------------------------------------------------------------ forward / common helpers

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without any communication (as torch DDP's
        ``no_sync``); the next backward outside communicates the accumulated gradients."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _check_sync(self) -> None:
        if not self._sync:
            raise RuntimeError(f"{type(self).__name__}.finish_gradient_synchronization() inside no_sync(): "
                               "call it after the last micro-batch's backward, outside no_sync()")

    def _average_op(self, dtype: torch.dtype) -> dist.ReduceOp:
        """AVG where NCCL averages ``dtype`` (then ``_averaged`` does nothing), else SUM."""
        return dist.ReduceOp.AVG if nccl_averages(self._nccl, dtype) else dist.ReduceOp.SUM

    def _all_reduce(self, tensor: torch.Tensor, async_op: bool = False, average: bool = False):
        """Sum ``tensor`` over the ranks, or average it where the backend can (then ``_averaged`` does nothing)."""
        op = self._average_op(tensor.dtype) if average else dist.ReduceOp.SUM
        return dist.all_reduce(tensor, op=op, group=self.process_group, async_op=async_op)

    def _averaged(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` after ``_all_reduce(..., average=True)``: divided by the world size unless NCCL did it."""
        return tensor if nccl_averages(self._nccl, tensor.dtype) else tensor.div_(self.world_size)

    @staticmethod
    def _grad_or_zeros(p: nn.Parameter) -> tuple[torch.Tensor, bool]:
        """(the gradient to contribute, whether this rank produced one); a missing gradient is zeros."""
        if p.grad is not None:
            return p.grad, True
        return torch.zeros_like(p, memory_format=torch.contiguous_format), False

    def _launch_presence(self, present: list[bool]):
        """Start the all-reduce that counts, per parameter, the ranks that produced a gradient (or None)."""
        if not self.find_unused_parameters or not self._params:
            return None
        counts = torch.tensor(present, dtype=torch.int32, device=self._params[0].device)  # (n_params,)
        return counts, self._all_reduce(counts, async_op=True)

    def _assign_grads(self, grads: list[torch.Tensor], presence) -> None:
        """Set each parameter's averaged gradient; with the presence count, a parameter that got a gradient on
        no rank keeps ``.grad = None`` (as in single-process training)."""
        used = [True] * len(self._params)
        if presence is not None:
            counts, work = presence
            work.wait()
            used = (counts > 0).tolist()  # a device-to-host sync, only with find_unused_parameters
        for p, g, u in zip(self._params, grads, used):
            if not u:
                p.grad = None
            elif p.grad is not g:
                p.grad = g


class NaiveDDP(_DataParallel):
    """One blocking all-reduce per parameter gradient, after the backward (``finish_gradient_synchronization``).

    The simplest correct DDP and the slowest: as many collectives as parameters, none overlapped with compute.
    """

    def finish_gradient_synchronization(self) -> None:
        self._check_sync()
        grads, present = zip(*(self._grad_or_zeros(p) for p in self._params)) if self._params else ((), ())
        for g in grads:  # same order on every rank: registration order
            self._all_reduce(g, average=True)
            self._averaged(g)
        self._assign_grads(list(grads), self._launch_presence(list(present)))


class FlatDDP(_DataParallel):
    """All gradients flattened into one buffer per (dtype, device) and all-reduced by one collective, after
    the backward. Pays the collective latency once, at the price of a copy in and out of the flat buffer."""

    def finish_gradient_synchronization(self) -> None:
        self._check_sync()
        grads, present = zip(*(self._grad_or_zeros(p) for p in self._params)) if self._params else ((), ())
        grads, present = list(grads), list(present)
        presence = self._launch_presence(present)
        for idx in _group_by_dtype_device(grads):
            group = [grads[i] for i in idx]
            flat = _flatten_dense_tensors(group)  # (sum of numels,)
            self._all_reduce(flat, average=True)
            self._averaged(flat)
            for g, synced in zip(group, _unflatten_dense_tensors(flat, group)):
                g.copy_(synced)
        self._assign_grads(grads, presence)


def leave_sms_to_communication(sms: int) -> tuple:
    """Make cuBLAS's matrix products run on all SMs but ``sms`` (``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET``, which
    PyTorch sets from ``torch._C._set_sm_carveout_experimental`` on its cuBLASLt path only, so that library is
    chosen too); returns the settings replaced, for ``restore_matmul_sms``."""
    replaced = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    return replaced


def restore_matmul_sms(replaced: tuple) -> None:
    library, carveout = replaced
    torch.backends.cuda.preferred_blas_library(library)
    torch._C._set_sm_carveout_experimental(carveout)


@dataclass
class _Unit:
    """A group of parameters communicated together (one parameter for ``DDPIndividualParameters``)."""

    params: list[int]  # indices into _DataParallel._params
    pending: int = 0  # gradients not yet ready this step
    launched: bool = False
    work: Any = None  # the async all-reduce's handle
    flat: torch.Tensor | None = None  # the bucket's flat buffer (bucketed only)
    offsets: list[int] = field(default_factory=list)  # each parameter's start in ``flat``
    grads: list[torch.Tensor] = field(default_factory=list)  # bucketed with a comm dtype or mean="optimizer": the
    # gradients' home
    symmetric: SymmetricBuffer | None = None  # bucketed on the copy engines: ``flat``'s symmetric memory


class _OverlappedDDP(_DataParallel):
    """Hook-driven DDP: gradients are communicated during the backward, unit by unit.

    Units (buckets) are ordered by the reverse registration order of their parameters. A post-accumulate-grad
    hook marks a parameter ready; a unit whose gradients are all ready is launched, asynchronously, as soon as
    every unit before it has been launched. The fixed order makes every rank issue the same collectives in the
    same sequence even where their backward graphs differ (Li et al. 2020, 3.2.3). At
    ``finish_gradient_synchronization`` the units not launched yet (parameters with no gradient this step) are
    launched with zeros for the missing gradients, and all are waited for and averaged.
    """

    def __init__(self, module: nn.Module, units: list[list[int]] | None = None, **kwargs: Any):
        super().__init__(module, **kwargs)
        # comm_sms on NCCL: cuBLAS leaves those SMs free during the backward (see the class docstring)
        self._carveout = self.comm_sms if self._nccl else 0
        order = list(reversed(range(len(self._params))))
        self._units = [_Unit(params=u) for u in (units if units is not None else self._make_units(order))]
        self._unit_of = {i: k for k, u in enumerate(self._units) for i in u.params}
        # finish_in_parts' first part: the units before this one, landed by the end of the backward (each unit from
        # here on has at most 2 TAIL_MB launched after it)
        self._tail_start, later = len(self._units), 0
        while self._tail_start > 0 and later <= 2 * TAIL_MB * _MIB:
            self._tail_start -= 1
            later += sum(self._params[i].numel() * self._params[i].element_size()
                         for i in self._units[self._tail_start].params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]
        self.on_train_batch_start()

    def _make_units(self, order: list[int]) -> list[list[int]]:
        return [[i] for i in order]

    def on_train_batch_start(self) -> None:
        """Reset the per-step state (also done at the end of every ``finish_gradient_synchronization``)."""
        self._ready = [False] * len(self._params)
        self._present = [False] * len(self._params)
        self._next = 0  # the first unit not launched yet
        self._carved = None  # what leave_sms_to_communication replaced in this backward, to restore
        for u in self._units:
            u.pending, u.launched, u.work = len(u.params), False, None

    def _make_hook(self, i: int):
        # A weak reference: the parameter holds its hooks where the garbage collector cannot see them, so a hook
        # holding the wrapper would keep the wrapper, its model and its buckets alive forever (a test checks)
        wrapper = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            self = wrapper()
            if self is None or not self._sync:  # inside no_sync(): the gradient just accumulates in .grad
                return
            if self._ready[i]:
                raise RuntimeError(f"{type(self).__name__}: parameter {i} received a second gradient before "
                                   "finish_gradient_synchronization(); run one backward per step")
            if self._carveout and self._carved is None:  # the backward's first gradient: leave SMs to NCCL
                self._carved = leave_sms_to_communication(self._carveout)
            self._ready[i] = self._present[i] = True
            self._units[self._unit_of[i]].pending -= 1
            self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        """Launch, in order, every unit whose gradients are all ready and whose predecessors are launched."""
        while self._next < len(self._units) and self._units[self._next].pending == 0:
            self._launch(self._units[self._next])
            self._next += 1

    def _launch(self, unit: _Unit) -> None:
        raise NotImplementedError

    def _finish_unit(self, unit: _Unit) -> tuple[list[torch.Tensor], Callable[[], None], list | None]:
        """A launched unit's (the tensors its averaged gradients land in, the call that makes the current stream
        wait for them and land them, ``Part.terms`` or None). The unit may be reused (the next step) once that call
        has been made."""
        raise NotImplementedError

    def _launch_rest(self) -> None:
        """Mark ready the parameters whose hook never fired this step and launch every unit left, in order
        (missing gradients are zeros)."""
        self._check_sync()
        for i, p in enumerate(self._params):
            if not self._ready[i]:
                self._present[i] = p.grad is not None  # e.g. a gradient set by hand
                self._ready[i] = True
                self._units[self._unit_of[i]].pending -= 1
        self._launch_ready()

    def _end_backward(self) -> None:
        """Give cuBLAS its SMs back and reset the per-step state."""
        if self._carved is not None:
            restore_matmul_sms(self._carved)
        self.on_train_batch_start()

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        for part in self.finish_in_parts():
            part.ready()
            for p, terms in zip(part.params, part.terms or ()):
                if p.grad is not None:  # None: no rank had a gradient (find_unused_parameters)
                    p.grad = mean_of(terms)

    def finish_in_parts(self) -> list[Part]:
        """The interface's parts, in launch order (the order the communication ends in): each unit with at most
        2 ``TAIL_MB`` launched after it one a part, every earlier unit (landed by then) in the first part."""
        self._launch_rest()
        presence = self._launch_presence(self._present)
        grads: list[torch.Tensor | None] = [None] * len(self._params)
        parts = []
        for unit in self._units:
            unit_grads, land, terms = self._finish_unit(unit)
            for i, g in zip(unit.params, unit_grads):
                grads[i] = g
            parts.append(Part([self._params[i] for i in unit.params], land, terms))
        self._assign_grads(grads, presence)
        self._end_backward()
        head = self._tail_start
        if head > 1:
            lands, terms = [part.ready for part in parts[:head]], [part.terms for part in parts[:head]]
            parts[:head] = [Part([p for part in parts[:head] for p in part.params], lambda: [land() for land in lands],
                                 None if None in terms else [t for unit_terms in terms for t in unit_terms])]
        return parts


class DDPIndividualParameters(_OverlappedDDP):
    """An asynchronous all-reduce per parameter, launched from its post-accumulate-grad hook (in reverse
    registration order), overlapping the rest of the backward; ``finish_gradient_synchronization`` waits
    for them and divides by the world size."""

    def _launch(self, unit: _Unit) -> None:
        (i,) = unit.params
        p = self._params[i]
        if p.grad is None:  # no gradient on this rank this step: contribute zeros
            p.grad = torch.zeros_like(p)
            self._present[i] = False
        unit.flat = p.grad
        unit.work = self._all_reduce(p.grad, async_op=True, average=True)
        unit.launched = True

    def _finish_unit(self, unit: _Unit) -> tuple[list[torch.Tensor], Callable[[], None], None]:
        grad, work, unit.flat = unit.flat, unit.work, None  # the unit must not keep the gradient past the step:
        # the next step's zero_grad frees it (it held 7.4 GiB through xl's forward, call 3)

        def land() -> None:
            work.wait()
            self._averaged(grad)
        return [grad], land, None


class DDPBucketed(_OverlappedDDP):
    """Gradients packed into flat buckets of at most ``bucket_size_mb`` MiB (2**20 bytes), filled in reverse
    registration order; a bucket's asynchronous all-reduce starts once all its gradients are ready (and all
    earlier buckets have started). A bucket holds one dtype on one device; a parameter larger than the cap
    gets a bucket of its own, so a tiny cap means one parameter per bucket and a huge one a single bucket.
    After the step each ``.grad`` is a view into its bucket's buffer (but with ``mean="optimizer"``, below).

    ``comm_dtype`` (e.g. ``torch.bfloat16``; None: the gradients' own): buckets of that dtype, so the gradients are
    cast on their way into the bucket (the copy made anyway), communicated in it (half the bytes of fp32), and
    copied back into each parameter's own ``.grad`` afterwards, as torch DDP's ``bf16_compress_hook`` does; the
    average then carries that dtype's rounding (8 bits of mantissa for bf16).

    ``engine="copy_engines"`` (NCCL, one GPU a rank on one host; ``copy_engines.ENGINES``): each bucket's buffer lives
    in symmetric memory and is averaged by peer copies on side streams (``copy_engines.PeerAverage``: the copy
    engines move the bytes, no SMs); the kernels that add run on the compute stream, once the buckets launched after
    it hold ``TAIL_MB`` (a compiled span's gradients arrive together: by then the peers' pushes are in), so that
    nothing runs beside the backward's GEMMs, and those left at the end of the backward on the send stream. Without
    a cast nothing is copied into the bucket: the gradients are pushed to the peers and averaged from where they are,
    and only the means land in it.

    ``mean="optimizer"`` (copy engines, no cast; ``MEANS``): no mean is computed here. Each rank pushes its whole
    bucket of gradients into a slot of each peer's buffer (``copy_engines.PeerGather``; on 2 ranks the bytes of the
    reduce-scatter and all-gather, with no mean kernel on the compute stream and no second phase), each ``.grad``
    keeps this rank's gradient, and ``finish_in_parts`` hands the optimizer each parameter's gradient on every rank
    (``Part.terms``): ``MasterAdamW`` averages them as it loads them (2 bytes a parameter more read), which is the
    update it makes of the averaged gradient, bit for bit. ``finish_gradient_synchronization`` (a clipped step,
    another optimizer) sets each ``.grad`` to its mean (``mean_of``: summed in fp32, rounded once)."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, comm_dtype: torch.dtype | None = None,
                 engine: str = "nccl", mean: str = "bucket", **kwargs: Any):
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb} must be > 0")
        if comm_dtype is not None and not comm_dtype.is_floating_point:
            raise ValueError(f"comm_dtype={comm_dtype}: gradients travel in a floating-point dtype")
        if mean not in MEANS or mean == "optimizer" and (engine != "copy_engines" or comm_dtype is not None):
            raise ValueError(f"DDPBucketed mean={mean!r} with engine={engine!r}, comm_dtype={comm_dtype}; accepted: "
                             f"{', '.join(MEANS)} (optimizer with engine='copy_engines' and no comm_dtype)")
        self.bucket_size_bytes = bucket_size_mb * _MIB
        self.comm_dtype = comm_dtype
        self.engine = engine
        self.mean = mean
        super().__init__(module, **kwargs)
        device = self._params[0].device if self._params else torch.device("cpu")
        check_engine(engine, self.process_group, device, type(self).__name__)
        copies = engine == "copy_engines"  # the peer copies' streams
        self._send_stream, self._push_stream = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if copies else (
            None, None)
        align = ALIGN if mean == "optimizer" else 1  # the optimizer's kernel reads the peers' gradients in the slots
        for unit in self._units:
            unit.offsets = [0]
            for i in unit.params:
                unit.offsets.append(unit.offsets[-1] + -(-self._params[i].numel() // align) * align)
            self._allocate(unit)

    def on_train_batch_start(self) -> None:
        self._unreduced: list[PeerAverage] = []  # copy engines: buckets launched, their means not yet computed
        super().on_train_batch_start()

    def _allocate(self, unit: _Unit) -> None:
        """The bucket's flat buffer, kept from step to step (copy engines: padded to N equal slices, in symmetric
        memory with the room ``PeerAverage`` needs; with mean="optimizer" only the peers' slots, no bucket of this
        rank's own)."""
        p = self._params[unit.params[0]]
        dtype, n, numel = self.comm_dtype or p.dtype, self.world_size, unit.offsets[-1]
        if self.mean == "optimizer":
            unit.symmetric = SymmetricBuffer(gather_numel(numel, n), dtype, p.device, self.process_group)
        elif self.engine == "copy_engines":
            unit.symmetric = SymmetricBuffer(buffer_numel(numel, n), dtype, p.device, self.process_group)
            unit.flat = unit.symmetric.tensor.zero_()[:-(-numel // n) * n]  # (N S,)
        else:
            unit.flat = torch.zeros(numel, dtype=dtype, device=p.device)  # (numel,)

    @property
    def symmetric_bytes(self) -> int:
        """Bytes this rank holds in symmetric memory (the copy engines' buffers), which CUDA's caching allocator does
        not count (``torch.cuda.max_memory_allocated``)."""
        return sum(u.symmetric.tensor.nbytes for u in self._units if u.symmetric is not None)

    def _make_units(self, order: list[int]) -> list[list[int]]:
        buckets: list[list[int]] = []
        size = 0.0
        for i in order:
            p = self._params[i]
            nbytes = p.numel() * p.element_size()
            head = self._params[buckets[-1][0]] if buckets else None
            if (head is None or size + nbytes > self.bucket_size_bytes
                    or (head.dtype, head.device) != (p.dtype, p.device)):
                buckets.append([])
                size = 0.0
            buckets[-1].append(i)
            size += nbytes
        return buckets

    @property
    def bucket_params(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order (for inspection and tests)."""
        return [[self._params[i] for i in u.params] for u in self._units]

    def _views(self, unit: _Unit) -> list[torch.Tensor]:
        return [unit.flat[unit.offsets[k]:unit.offsets[k + 1]] for k in range(len(unit.params))]

    def _casts(self, unit: _Unit) -> bool:
        return unit.flat.dtype != self._params[unit.params[0]].dtype

    @torch.no_grad()
    def _launch_gather(self, unit: _Unit) -> None:
        """mean="optimizer": push this rank's gradients, as they are, into the peers' slots (a missing one as
        zeros, a strided one made contiguous: each ``.grad`` is then the tensor pushed)."""
        unit.grads, sources = [], []
        for i, start in zip(unit.params, unit.offsets):
            p = self._params[i]
            if p.grad is None:  # no gradient on this rank this step: contribute zeros
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                self._present[i] = False
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            unit.grads.append(p.grad)
            sources.append((start, p.grad.view(-1)))
        what = f"the copy engines' gather of bucket {self._next}"
        unit.work = PeerGather(unit.symmetric, self._send_stream, what, sources).send()
        unit.launched = True

    @torch.no_grad()
    def _launch(self, unit: _Unit) -> None:
        if self.mean == "optimizer":
            return self._launch_gather(unit)
        views, grads = [], []  # the gradients to copy into the bucket: one multi-tensor copy (the host's time
        casts = self._casts(unit)  # per launch is what a compiled backward has least of)
        unit.grads = []  # with a cast: where each averaged gradient goes back
        # copy engines without a cast: the gradients are pushed and averaged from where they are (no copy in)
        direct = unit.symmetric is not None and not casts
        sources = []  # (offset in the bucket, the gradient's elements)
        for k, (view, i) in enumerate(zip(self._views(unit), unit.params)):
            p = self._params[i]
            g = p.grad
            if g is None:  # no gradient on this rank this step: contribute zeros
                view.zero_()
                self._present[i] = False
            elif not casts and g.data_ptr() == view.data_ptr() and g.is_contiguous():
                pass  # already our view (accumulated in place)
            elif direct and g.is_contiguous():
                sources.append((unit.offsets[k], g.view(-1)))
            else:
                views.append(view.view_as(g))
                grads.append(g)
            if casts:
                unit.grads.append(g if g is not None and g.is_contiguous() else
                                  torch.zeros_like(p, memory_format=torch.contiguous_format))
        if views:
            torch._foreach_copy_(views, grads)
        if unit.symmetric is not None:
            what = f"the copy engines' average of bucket {self._next}"
            unit.work = PeerAverage(unit.symmetric, self._send_stream, self._push_stream, what, sources).send()
            self._unreduced.append(unit.work)
            while sum(a.buffer.tensor.nbytes for a in self._unreduced[1:]) > TAIL_MB * _MIB:
                self._unreduced.pop(0).reduce()
        else:
            unit.work = self._all_reduce(unit.flat, async_op=True, average=True)
        unit.launched = True

    def finish_in_parts(self) -> list[Part]:
        """With the copy engines, the means left for after the backward are computed on the send stream, each once
        the peers' values are in, so that their pushes go on beside the optimizer (no GEMM runs then for them to
        slow): on the compute stream each waited for the peers' values and the next part for its pushes (2 H200s,
        xl, 713df4a)."""
        unreduced = self._unreduced  # the list the units launched now join
        parts = super().finish_in_parts()
        if unreduced:
            with torch.cuda.stream(self._send_stream), torch.no_grad():
                for average in unreduced:
                    average.reduce()
        return parts

    def _finish_unit(self, unit: _Unit) -> tuple[list[torch.Tensor], Callable[[], None], list | None]:
        if self.mean == "optimizer":
            gather, grads, unit.grads = unit.work, unit.grads, []  # the unit keeps no gradient past the step
            terms = [[g if q == self.rank else gather.values(q)[start:start + g.numel()].view_as(g)
                      for q in range(self.world_size)] for g, start in zip(grads, unit.offsets)]
            return grads, gather.wait, terms
        work, flat, views = unit.work, unit.flat, self._views(unit)
        casts = self._casts(unit)
        grads = unit.grads if casts else [view.view_as(self._params[i]) for view, i in zip(views, unit.params)]

        @torch.no_grad()
        def land() -> None:
            work.wait()
            if unit.symmetric is None:  # the copy engines' average is one already
                self._averaged(flat)
            if casts:
                torch._foreach_copy_([g.view(-1) for g in grads], views)
        return grads, land, None
