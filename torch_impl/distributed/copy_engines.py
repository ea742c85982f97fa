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
``PeerAverage``: the mean of such a buffer over the ranks, in place on every rank (an all-reduce by copies).

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
READY, WRITTEN = 0, 1  # signal channels: "my buffer is ready for you to read", "I wrote my part into your buffer"
_CHANNELS = 2
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
    """The mean of a ``SymmetricBuffer`` (N S elements, N ranks) over the ranks, in place on every rank: a
    reduce-scatter by pulls, then an all-gather by pushes, the bytes moved by the copy engines on two side streams.

    ``pull()`` (after the current stream's writes of the buffer): rank r signals its peers that its buffer is ready
    and, on ``pull_stream``, pulls the r-th slice of each peer's as each signals. ``reduce()``: the current stream
    folds them into a running mean of its own slice (``lerp_``: one kernel a peer, the arithmetic in float32, one
    rounding to the buffer's dtype a peer: on 2 ranks bf16 and fp16 get (a + b) / 2 rounded once, as from NCCL's AVG,
    float32 within an ulp of the larger input), then ``push_stream`` pushes the mean into each peer's r-th slice and
    signals it (a second ``reduce()`` does nothing). ``wait()``: the current stream waits for this rank's pushes and
    for every peer's mean to have arrived here (reducing first if ``reduce()`` was not called). Every rank ends with
    the same bits (each slice is computed once, by its owner); the buffer may be written again after ``wait()``: each
    peer pulled from it before pushing. ``sources``: (piece of this rank's slice, a tensor of its length) where the
    slice's values are instead of the buffer (the gradients themselves: the caller then copies into the buffer only
    what the peers pull, and the first fold reads the pieces from there; they are kept until it has run).

    The mean runs on the caller's current stream. During the backward that is the compute stream, not beside it:
    kernels beside the backward's GEMMs slow them (any resident block delays a persistent GEMM's tiles), so callers
    call ``reduce()`` late enough that the pulls are done (``DDPBucketed``: a span of buckets later); after it,
    ``DDPBucketed`` computes the means left on the pull stream, beside the optimizer. Pulls and pushes have a stream
    each: behind a push, which waits for this rank's mean, the next pulls would wait for the compute stream too. (2
    H200s, xl: the compute kernels took 3-7 ms a step less than with the means beside them, but the step was no
    faster, the pulls' stalls and the end of the backward took it back, and the pulled slices, allocated as the host
    runs ahead, raised the reserved peak by 1.3-3.1 GB: notes/data_parallel.md, sessions 35 and 36.)"""

    def __init__(self, buffer: SymmetricBuffer, pull_stream: torch.cuda.Stream, push_stream: torch.cuda.Stream,
                 what: str, sources: list[tuple[slice, torch.Tensor]] = ()):
        n = buffer.world_size
        if buffer.tensor.numel() % n:
            raise ValueError(f"PeerAverage: {buffer.tensor.numel()} elements do not split into {n} equal slices")
        self.buffer, self.pull_stream, self.push_stream, self.what = buffer, pull_stream, push_stream, what
        size = buffer.tensor.numel() // n
        self._slice = slice(buffer.rank * size, (buffer.rank + 1) * size)
        mine = buffer.tensor[self._slice]
        self._sources = []  # pieces of this rank's slice: (where in it, the tensor its values are in), in order
        start = 0
        for piece, source in sorted(sources, key=lambda ps: ps[0].start) + [(slice(size, size), None)]:
            if start < piece.start:  # no source given: the values are in the buffer
                self._sources.append((slice(start, piece.start), mine[start:piece.start]))
            if source is not None:
                self._sources.append((piece, source))
            start = piece.stop
        self._pulled: list[torch.Tensor] = []
        self._pulls_done: torch.cuda.Event | None = None
        self._pushes_done: torch.cuda.Event | None = None

    def pull(self) -> PeerAverage:
        buffer = self.buffer
        self._pulled = [torch.empty_like(buffer.tensor[self._slice]) for _ in buffer.peers]  # the current stream's
        self.pull_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.pull_stream):
            for q in buffer.peers:
                buffer.signal(q, READY)
            for q, pulled in zip(buffer.peers, self._pulled):
                buffer.wait(q, READY)
                pulled.record_stream(self.pull_stream)
                pulled.copy_(buffer.peer(q)[self._slice])
            self._pulls_done = watch(f"{self.what} (its pulls)")
        return self

    def reduce(self) -> None:
        if self._pushes_done is not None:  # reduced already
            return
        buffer, mine = self.buffer, self.buffer.tensor[self._slice]
        torch.cuda.current_stream().wait_event(self._pulls_done)
        for piece, source in self._sources:  # the first peer's slice folded in from where this rank's values are
            source.record_stream(torch.cuda.current_stream())  # read here, freed by the caller's stream
            if self._pulled:  # the mean of 2 slices (source may be the buffer itself: out= is then in place)
                torch.lerp(source, self._pulled[0][piece], 0.5, out=mine[piece])
            else:
                mine[piece].copy_(source)
        for count, pulled in enumerate(self._pulled[1:], start=3):  # the mean of `count` slices: += (x - mean) / count
            mine.lerp_(pulled, 1 / count)
        self._pulled, self._sources = [], []  # freed once the current stream is past the lerps
        self.push_stream.wait_stream(torch.cuda.current_stream())
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

