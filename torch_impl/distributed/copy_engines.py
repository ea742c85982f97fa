"""Moving gradients and weights between the GPUs of one host with their copy engines instead of NCCL's kernels.

NCCL's collectives run as kernels: their thread blocks hold SMs, and cuBLAS's persistent GEMMs sized to every SM then
run a second wave beside them (notes/data_parallel.md, finding 1). A ``copy_`` between a tensor in this GPU's memory
and one in a peer's, mapped here through symmetric memory (``torch.distributed._symmetric_memory``), is a
``Memcpy PtoP`` done by the copy engines: no SMs. On 2 H200s the backward's GEMMs lost ~1.1 ms per 600 MB beside
NCCL's all-gather or reduce-scatter and 0.03-0.26 ms beside the same bytes copied (``scripts/ce_probe.py``).

Ranks order their copies with counters in the signal pads of symmetric memory, written and waited for by stream memory
operations (``cuStreamWriteValue32`` after a system-wide fence, ``cuStreamWaitValue32``), which take no SM either:
symmetric memory's own ``put_signal`` / ``wait_signal`` are kernels that spin on an SM, and each one resident beside a
persistent GEMM sent it into a second wave (2 H200s, xl: 37 ms a step of spinning, the GEMMs beside it 3.4x as long).
A stream wait has no timeout of its own: the work after each is watched from a thread (``watch``), which ends the
process with a message when a peer has not answered within the default group's timeout (as NCCL's watchdog does).

``SymmetricBuffer``: a flat tensor every rank of a group allocates alike, the peers' copies mapped here, and signals.
``PeerAverage``: the mean of such a buffer over the ranks, in place on every rank (an all-reduce by copies), its
values read where they are (the gradients themselves) rather than copied into the buffer first. ``PeerGather``: every
rank's values on every rank (an all-gather by copies), for a reader that averages them as it reads them (the optimizer:
``DDPBucketed(mean="optimizer")``).

References: PyTorch's symmetric memory (``torch/distributed/_symmetric_memory``); the CUDA driver API's stream memory
operations (``cuStreamWaitValue32``, ``cuStreamWriteValue32``).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from torch_impl.distributed.process_group import group_timeout_s

# How the data-parallel wrappers move bytes between GPUs: NCCL's collectives, or the copy engines (this module)
ENGINES = ("nccl", "copy_engines")
# signal channels: "my buffer is ready for your part", "I sent you my part of your slice", "I wrote my part into your
# buffer"
READY, SENT, WRITTEN = 0, 1, 2
_CHANNELS = 3
# A piece of at least this many elements gets a kernel of its own for its mean: 3.1 TB/s on an H200 where the
# multi-tensor kernel reached 2.4 (2 H200s, xl's bf16 gradients: a rank's means 1.92 ms a step, 2.44 as one kernel)
LERP_ALONE = 2**20
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, so the counters may wrap


def check_engine(engine: str, process_group: dist.ProcessGroup | None, device: torch.device, who: str) -> None:
    """Raise a one-line ValueError unless ``engine`` is one of ``ENGINES`` and can run here."""
    if engine not in ENGINES:
        raise ValueError(f"{who} engine={engine!r}; accepted: {', '.join(ENGINES)}")
    if engine == "copy_engines" and (dist.get_backend(process_group) != "nccl" or device.type != "cuda"):
        raise ValueError(f"{who} engine='copy_engines' needs NCCL on CUDA devices (symmetric memory); "
                         "use engine='nccl'")


@functools.cache
def _stream_wait_value32():
    fn = ctypes.CDLL("libcuda.so.1").cuStreamWaitValue32_v2
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class SymmetricBuffer:
    """``numel`` elements of ``dtype`` in symmetric memory on every rank of ``process_group`` (a collective: every
    rank makes its buffers in the same order), ``tensor`` this rank's, ``peer(q)`` rank q's mapped here;
    ``signal(q, channel)`` / ``wait(q, channel)``: the n-th signal to q on a channel satisfies q's n-th wait on it."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device,
                 process_group: dist.ProcessGroup | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.tensor = symm_mem.empty(numel, dtype=dtype, device=device)  # (numel,)
        self.handle = symm_mem.rendezvous(self.tensor, (process_group or dist.group.WORLD).group_name)
        self.rank, self.world_size = self.handle.rank, self.handle.world_size
        self.peers = [q for q in range(self.world_size) if q != self.rank]
        self._mapped = {q: self.handle.get_buffer(q, (numel,), dtype) for q in self.peers}
        # signal pads (zeros at allocation): slot channel * N + q of mine counts rank q's signals on that channel
        words = (_CHANNELS * self.world_size,)
        self._pad = self.handle.get_signal_pad(self.rank, words, torch.uint32)
        self._peer_pads = {q: self.handle.get_signal_pad(q, words, torch.uint32) for q in self.peers}
        self._sent: collections.Counter = collections.Counter()
        self._awaited: collections.Counter = collections.Counter()

    def peer(self, q: int) -> torch.Tensor:
        """Rank q's buffer, mapped into this GPU's address space: a ``copy_`` to or from it is a peer copy."""
        return self._mapped[q]

    def signal(self, q: int, channel: int) -> None:
        """On the current stream, after its work so far is visible to every GPU: count one more signal in q's pad."""
        from torch._C._distributed_c10d import _SymmetricMemory

        self._sent[q, channel] += 1
        _SymmetricMemory.stream_write_value32(self._peer_pads[q], channel * self.world_size + self.rank,
                                              self._sent[q, channel] & 0xFFFFFFFF)

    def wait(self, q: int, channel: int) -> None:
        """The current stream waits (no SM) until q has signalled on ``channel`` as often as this rank waited."""
        self._awaited[q, channel] += 1
        address = self._pad.data_ptr() + 4 * (channel * self.world_size + q)
        err = _stream_wait_value32()(torch.cuda.current_stream().cuda_stream, address,
                                     self._awaited[q, channel] & 0xFFFFFFFF, _WAIT_GEQ)
        if err:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {err} (no stream memory operations here?)")


class PeerAverage:
    """The mean of a gradient over the N ranks of a ``SymmetricBuffer`` (``buffer_numel(numel, N)`` elements: N equal
    slices of S, then S for each peer past the first), left in the buffer's first N S elements on every rank: a
    reduce-scatter, then an all-gather, both by pushes that the copy engines make on two side streams.

    ``sources``: (offset in the N S elements, a contiguous 1-D tensor): where the values of those elements are
    instead of the buffer (the gradients themselves: then nothing is copied into the buffer). ``send()``, once the
    current stream has written the rest: rank r tells each peer q that its slice r is free and, on ``send_stream``,
    pushes its values of slice q (from the sources, else from its buffer) into q's buffer (the first peer's into
    slice q itself, whose own values q reads from its sources, or kept aside at ``send()``; the others' into the
    room after the N slices) and signals q. ``reduce()``: the current stream waits for every peer's push and folds
    them into the mean of its own slice (a ``lerp`` with weight 1/2 for the first peer, one kernel a piece of at least
    ``LERP_ALONE`` elements and one multi-tensor kernel for the smaller ones: on 2 ranks bf16 and fp16 get (a + b) / 2
    rounded once, as from NCCL's AVG, float32 within an ulp of the larger input; a ``lerp_`` with 1/count for each
    later one), then ``push_stream`` pushes the mean into each peer's slice r and signals it (a second ``reduce()``
    does nothing). ``wait()``: the current stream waits for this rank's pushes and for every peer's mean to have
    arrived here (reducing first if ``reduce()`` was not called). Every rank ends with the same bits (each slice is
    averaged once, by its owner). The buffer may be written again after ``wait()``; the next ``send()`` tells the
    peers so.

    The mean runs on the caller's current stream. During the backward that is the compute stream, not beside it:
    kernels beside the backward's GEMMs slow them (any resident block delays a persistent GEMM's tiles), so callers
    call ``reduce()`` late enough that the pushes are in (``DDPBucketed``: a span of buckets later); after it,
    ``DDPBucketed`` computes the means left on the send stream, beside the optimizer. The two pushes have a stream
    each: behind a mean's push, which waits for this rank's mean, the next sends would wait for the compute stream
    too. (2 H200s, xl: pulling from a bucket the gradients were copied into cost that copy, 1.8 ms a step, and a
    pulled slice's memory: notes/data_parallel.md, sessions 35-37.)"""

    def __init__(self, buffer: SymmetricBuffer, send_stream: torch.cuda.Stream, push_stream: torch.cuda.Stream,
                 what: str, sources: list[tuple[int, torch.Tensor]] = ()):
        n, r = buffer.world_size, buffer.rank
        self.size = size = buffer.tensor.numel() // _slices(n)
        if buffer.tensor.numel() != buffer_numel(n * size, n):
            raise ValueError(f"PeerAverage: a buffer of {buffer.tensor.numel()} elements is not N slices and the "
                             f"room for the peers past the first (N = {n}; see buffer_numel)")
        self.buffer, self.send_stream, self.push_stream, self.what = buffer, send_stream, push_stream, what
        # each slice's pieces: (start, stop) in the slice, the tensor holding their values (None: the buffer)
        self._pieces: list[list[tuple[int, int, torch.Tensor | None]]] = [[] for _ in range(n)]
        for start, source in sorted(sources, key=lambda s: s[0]):
            for q in range(start // size, -(-(start + source.numel()) // size)):
                a, b = max(start, q * size), min(start + source.numel(), (q + 1) * size)
                if a < b:
                    self._pieces[q].append((a - q * size, b - q * size, source[a - start:b - start]))
        for pieces in self._pieces:  # the gaps between the sources: values in the buffer
            filled, start = [], 0
            for a, b, t in pieces + [(size, size, None)]:
                filled += [(start, a, None)] if start < a else []
                filled += [(a, b, t)] if a < b else []
                start = b
            pieces[:] = filled
        self._slice = slice(r * size, (r + 1) * size)
        self._own: list[tuple[torch.Tensor, torch.Tensor]] = []  # this rank's slice: (where the mean goes, values)
        self._pushes_done: torch.cuda.Event | None = None

    def _landing(self, q: int) -> slice:
        """Where this rank's values of slice q go in q's buffer (in q's order of its peers: the first in slice q)."""
        k = self.buffer.rank - (self.buffer.rank > q)
        start = q * self.size if k == 0 else (self.buffer.world_size + k - 1) * self.size
        return slice(start, start + self.size)

    def send(self) -> PeerAverage:
        buffer, size, current = self.buffer, self.size, torch.cuda.current_stream()
        mine = buffer.tensor[self._slice]
        # this rank's values in its slice of the buffer: a peer's push lands there, so they are kept aside first
        self._own = [(mine[a:b], mine[a:b].clone() if t is None else t) for a, b, t in self._pieces[buffer.rank]]
        self.send_stream.wait_stream(current)
        with torch.cuda.stream(self.send_stream):
            for q in buffer.peers:
                buffer.signal(q, READY)
            for q in buffer.peers:
                buffer.wait(q, READY)
                landing = buffer.peer(q)[self._landing(q)]
                for a, b, t in self._pieces[q]:
                    if t is not None:
                        t.record_stream(self.send_stream)
                    landing[a:b].copy_(buffer.tensor[q * size + a:q * size + b] if t is None else t)
                buffer.signal(q, SENT)
            watch(f"{self.what} (its sends)")
        self._pieces = []  # the gradients sent are freed by the caller (the streams that read them are recorded)
        return self

    def reduce(self) -> None:
        if self._pushes_done is not None:  # reduced already
            return
        buffer, size, current = self.buffer, self.size, torch.cuda.current_stream()
        for q in buffer.peers:
            buffer.wait(q, SENT)
        watch(f"{self.what} (the peers' sends)")
        for _, v in self._own:
            v.record_stream(current)  # read here, freed by the caller's stream
        if buffer.peers:  # the first peer's values are in the slice: the mean of 2 there (the same bits either way)
            small = []
            for m, v in self._own:
                if m.numel() >= LERP_ALONE:
                    m.lerp_(v, 0.5)
                else:
                    small.append((m, v))
            if small:
                torch._foreach_lerp_(*map(list, zip(*small)), 0.5)
        elif self._own:
            torch._foreach_copy_(*map(list, zip(*self._own)))
        mine, n = buffer.tensor[self._slice], buffer.world_size
        for count, start in enumerate(range(n * size, (2 * n - 2) * size, size), start=3):  # += (x - mean) / count
            mine.lerp_(buffer.tensor[start:start + size], 1 / count)
        self._own = []  # freed once the current stream is past the lerps
        self.push_stream.wait_stream(current)
        with torch.cuda.stream(self.push_stream):
            for q in buffer.peers:
                buffer.peer(q)[self._slice].copy_(mine)
                buffer.signal(q, WRITTEN)
            self._pushes_done = torch.cuda.Event()
            self._pushes_done.record()

    def wait(self) -> None:
        self.reduce()
        torch.cuda.current_stream().wait_event(self._pushes_done)
        for q in self.buffer.peers:
            self.buffer.wait(q, WRITTEN)
        watch(self.what)


class PeerGather:
    """Every rank's values of ``numel`` elements on every rank: each rank pushes its values, straight from where they
    are (``sources``: (offset, a contiguous 1-D tensor), covering the ``numel`` elements), into a slot of each peer's
    ``SymmetricBuffer`` (``gather_numel(numel, N)`` elements: N - 1 slots of ``numel``, one for each peer in its order
    of peers) on ``send_stream``, with the copy engines; nothing is added. ``send()`` once the current stream has
    written the values (READY: "my slot for you is free", sent after this rank's last reader of its slots; then
    the pushes, and SENT); ``wait()``: the current stream waits for every peer's values and for this rank's pushes
    (after it the sources may be written again: a CUDA graph's replay writes its outputs unordered by streams);
    ``values(q)``: peer q's values in this rank's buffer (this rank's own are its sources).

    On 2 ranks it moves the bytes of a reduce-scatter and an all-gather (each rank's gradient out once) with no
    mean kernel and no second phase: whoever reads the gradients averages them (``MasterAdamW`` as it loads them;
    ``torch_impl.optim.mean_of``); on N ranks it moves N / 2 times the bytes of an all-reduce."""

    def __init__(self, buffer: SymmetricBuffer, send_stream: torch.cuda.Stream, what: str,
                 sources: list[tuple[int, torch.Tensor]]):
        n = buffer.world_size
        self.numel = buffer.tensor.numel() // max(n - 1, 1)
        if buffer.tensor.numel() != gather_numel(self.numel, n):
            raise ValueError(f"PeerGather: a buffer of {buffer.tensor.numel()} elements is not N - 1 equal slots "
                             f"(N = {n}; see gather_numel)")
        if any(start < 0 or start + t.numel() > self.numel for start, t in sources):
            raise ValueError(f"PeerGather: sources beyond the {self.numel} elements gathered")
        self.buffer, self.send_stream, self.what, self.sources = buffer, send_stream, what, sources
        self._sends_done: torch.cuda.Event | None = None

    def _slot(self, sender: int, receiver: int) -> slice:
        """Where ``sender``'s values lie in ``receiver``'s buffer (its peers in rank order, one slot each)."""
        k = sender - (sender > receiver)
        return slice(k * self.numel, (k + 1) * self.numel)

    def values(self, q: int) -> torch.Tensor:
        """Rank q's values in this rank's buffer (q a peer), valid on the current stream after ``wait()``."""
        return self.buffer.tensor[self._slot(q, self.buffer.rank)]

    def send(self) -> PeerGather:
        buffer = self.buffer
        self.send_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.send_stream):
            for q in buffer.peers:
                buffer.signal(q, READY)
            for q in buffer.peers:
                buffer.wait(q, READY)
                slot = buffer.peer(q)[self._slot(buffer.rank, q)]
                for start, t in self.sources:
                    t.record_stream(self.send_stream)
                    slot[start:start + t.numel()].copy_(t)
                buffer.signal(q, SENT)
            self._sends_done = watch(f"{self.what} (its sends)")
        self.sources = []  # the values sent are freed by the caller (the streams that read them are recorded)
        return self

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._sends_done)
        for q in self.buffer.peers:
            self.buffer.wait(q, SENT)
        watch(f"{self.what} (the peers' sends)")


def gather_numel(numel: int, world_size: int) -> int:
    """The elements of a ``SymmetricBuffer`` that ``PeerGather`` gathers ``numel`` elements in: a slot of ``numel``
    for each peer (at least one, so that every rank allocates alike)."""
    return max(world_size - 1, 1) * numel


def buffer_numel(numel: int, world_size: int) -> int:
    """The elements of a ``SymmetricBuffer`` that ``PeerAverage`` averages ``numel`` elements in: ``numel`` padded to
    N equal slices, and a slice more for each peer past the first (where their values land)."""
    return _slices(world_size) * -(-numel // world_size)


def _slices(world_size: int) -> int:
    """The slices of S elements a ``PeerAverage`` buffer holds: N, and one for each peer past the first."""
    return world_size + max(world_size - 2, 0)


class _Watchdog:
    """A daemon thread that ends the process with a message when a watched event (recorded after waits on peers) has
    not completed within the default group's timeout of being watched; events complete in the order watched."""

    def __init__(self):
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, event: torch.cuda.Event, device: torch.device, what: str) -> None:
        with self._lock:
            self._queue.append((event, time.monotonic() + group_timeout_s(), what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(device,), name="copy-engines-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self, device: torch.device) -> None:
        torch.cuda.set_device(device)
        while True:
            with self._lock:
                head = self._queue[0] if self._queue else None
            if head is not None and head[0].query():
                with self._lock:
                    self._queue.popleft()
                continue
            if head is not None and time.monotonic() > head[1]:
                rank = dist.get_rank() if dist.is_initialized() else 0
                print(f"rank {rank}: {head[2]} did not finish within the process group's timeout "
                      f"({group_timeout_s():g} s): a peer stopped (failed, killed or out of step); ending this process",
                      file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(0.01)


_WATCHDOG = _Watchdog()


def watch(what: str) -> torch.cuda.Event:
    """Record an event on the current stream and end the process if it has not completed within the group's timeout
    (``what`` names the work in the message)."""
    event = torch.cuda.Event()
    event.record()
    _WATCHDOG.watch(event, torch.cuda.current_device(), what)
    return event

