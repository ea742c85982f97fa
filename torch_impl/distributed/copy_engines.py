"""Moving gradients and weights between the GPUs of one host with their copy engines instead of NCCL's kernels.

NCCL's collectives run as kernels: their thread blocks hold SMs, and cuBLAS's persistent GEMMs sized to every SM then
run a second wave beside them (notes/data_parallel.md, finding 1). A ``copy_`` between a tensor in this GPU's memory
and one in a peer's, mapped here through symmetric memory (``torch.distributed._symmetric_memory``), is a
``Memcpy PtoP`` done by the copy engines: no SMs. On 2 H200s the backward's GEMMs lost ~1.1 ms per 600 MB beside
NCCL's all-gather or reduce-scatter and 0.03-0.26 ms beside the same bytes copied (``scripts/ce_probe.py``).

Ranks order their copies with the signal pads of symmetric memory: ``put_signal`` sets a flag in the peer's pad (it
waits while the peer has not consumed the last one), ``wait_signal`` waits for the peer's flag and clears it; both
are kernels of one thread block on the stream they are called on, so the host never waits.

``SymmetricBuffer``: a flat tensor every rank of a group allocates alike, with the peers' copies mapped here.
``average_in_place``: the mean of such buffers over the ranks, in place on every rank (an all-reduce by copies);
``beside(stream, fn)``: run it on a side stream after the current stream's work, with a handle to wait for it.

Reference: PyTorch's symmetric memory (``torch/distributed/_symmetric_memory``, its ``CUDASymmetricMemory`` signal
pads).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# How the data-parallel wrappers move bytes between GPUs: NCCL's collectives, or the copy engines (this module)
ENGINES = ("nccl", "copy_engines")
SIGNAL_TIMEOUT_MS = 120_000  # a peer whose signal never comes ends the process (a device-side trap)
READY, WRITTEN = 0, 1  # signal channels: "my buffer is ready for you to read", "I wrote my part into your buffer"


def check_engine(engine: str, process_group: dist.ProcessGroup | None, device: torch.device, who: str) -> None:
    """Raise a one-line ValueError unless ``engine`` is one of ``ENGINES`` and can run here."""
    if engine not in ENGINES:
        raise ValueError(f"{who} engine={engine!r}; accepted: {', '.join(ENGINES)}")
    if engine == "copy_engines" and (dist.get_backend(process_group) != "nccl" or device.type != "cuda"):
        raise ValueError(f"{who} engine='copy_engines' needs NCCL on CUDA devices (symmetric memory); "
                         "use engine='nccl'")


class SymmetricBuffer:
    """``numel`` elements of ``dtype`` in symmetric memory on every rank of ``process_group`` (a collective: every
    rank makes its buffers in the same order), ``tensor`` this rank's, ``peer(q)`` rank q's mapped here."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device,
                 process_group: dist.ProcessGroup | None = None):
        import torch.distributed._symmetric_memory as symm_mem

        self.tensor = symm_mem.empty(numel, dtype=dtype, device=device)  # (numel,)
        self.handle = symm_mem.rendezvous(self.tensor, (process_group or dist.group.WORLD).group_name)
        self.rank, self.world_size = self.handle.rank, self.handle.world_size
        self.peers = [q for q in range(self.world_size) if q != self.rank]
        self._mapped = {q: self.handle.get_buffer(q, (numel,), dtype) for q in self.peers}

    def peer(self, q: int) -> torch.Tensor:
        """Rank q's buffer, mapped into this GPU's address space: a ``copy_`` to or from it is a peer copy."""
        return self._mapped[q]

    def signal(self, q: int, channel: int) -> None:
        self.handle.put_signal(q, channel, SIGNAL_TIMEOUT_MS)

    def wait(self, q: int, channel: int) -> None:
        self.handle.wait_signal(q, channel, SIGNAL_TIMEOUT_MS)


def average_in_place(buffer: SymmetricBuffer) -> None:
    """Replace ``buffer.tensor`` (N S elements, N ranks) by its mean over the ranks, on the current stream, which
    must already follow the writes of it: a reduce-scatter by pulls, then an all-gather by pushes.

    Rank r signals its peers that its buffer is ready, pulls the r-th slice of each peer's as each signals (copy
    engines), averages them with its own in float32 (the only kernels: an add per peer, a division, a cast), pushes
    the average into each peer's r-th slice and signals it, then waits until every peer's average has arrived in its
    own buffer. Every rank ends with the same bits (each slice is computed once, by its owner). Safe to write again
    after that: each peer pulled from this buffer before pushing into it."""
    n, r = buffer.world_size, buffer.rank
    size = buffer.tensor.numel() // n  # S
    if size * n != buffer.tensor.numel():
        raise ValueError(f"average_in_place: {buffer.tensor.numel()} elements do not split into {n} equal slices")
    mine = buffer.tensor[r * size:(r + 1) * size]
    for q in buffer.peers:
        buffer.signal(q, READY)
    total = mine.to(torch.float32, copy=True)
    for q in buffer.peers:
        buffer.wait(q, READY)
        total.add_(torch.empty_like(mine).copy_(buffer.peer(q)[r * size:(r + 1) * size]))
    mine.copy_(total.div_(n))
    for q in buffer.peers:
        buffer.peer(q)[r * size:(r + 1) * size].copy_(mine)
        buffer.signal(q, WRITTEN)
    for q in buffer.peers:
        buffer.wait(q, WRITTEN)


class SideStreamWork:
    """Work queued on a side stream: ``wait()`` makes the current stream wait for it (the host does not)."""

    def __init__(self, stream: torch.cuda.Stream):
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


def beside(stream: torch.cuda.Stream, fn, *args) -> SideStreamWork:
    """Queue ``fn(*args)`` on ``stream`` after everything queued so far on the current stream."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args)
    return SideStreamWork(stream)
