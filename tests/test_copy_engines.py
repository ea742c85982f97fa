"""``copy_engines.PeerAverage``'s layout on the CPU: N ranks simulated in one process.

The copies, signals and streams are the GPU's (tests/test_ddp.py checks them on 2 GPUs against one process); what
this checks on any machine, for N = 1 ... 4 (the room after the N slices is used from 3 ranks on), with each rank a
thread whose waits block until the peer has signalled, is where each rank's values go: every piece pushed from its
source or from the buffer, the first peer's push landing in the owner's slice (the owner's own values there kept
aside first), the later peers' in the room, and every rank ending with the mean of all, in the same bits.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import secrets
import threading

import pytest
import torch

import torch_impl.distributed.copy_engines as copy_engines
from torch_impl.distributed.copy_engines import PeerAverage, buffer_numel


class _Buffers:
    """N ranks' ``SymmetricBuffer``s in one process, each rank a thread: a peer's buffer is its tensor, and a wait
    blocks the rank's thread until the peer has signalled as often (every stream of a rank is its thread)."""

    def __init__(self, tensors: list[torch.Tensor], rank: int, signals: collections.Counter,
                 condition: threading.Condition):
        self._all, self.tensor, self.rank, self.world_size = tensors, tensors[rank], rank, len(tensors)
        self.peers = [q for q in range(self.world_size) if q != rank]
        self._signals, self._condition, self._awaited = signals, condition, collections.Counter()

    def peer(self, q: int) -> torch.Tensor:
        return self._all[q]

    def signal(self, q: int, channel: int) -> None:
        with self._condition:
            self._signals[q, channel, self.rank] += 1
            self._condition.notify_all()

    def wait(self, q: int, channel: int) -> None:
        self._awaited[q, channel] += 1
        with self._condition:
            if not self._condition.wait_for(lambda: self._signals[self.rank, channel, q] >= self._awaited[q, channel],
                                            timeout=10):
                raise TimeoutError(f"rank {self.rank}: no signal {self._awaited[q, channel]} from {q} on {channel}")


class _Stream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class _Event:
    def record(self) -> None:
        pass


@pytest.fixture
def host_streams(monkeypatch):
    """The CUDA stream calls ``PeerAverage`` makes, as no-ops: every copy then happens when it is issued."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(copy_engines, "watch", lambda what: None)


@pytest.mark.parametrize("lerp_alone", [2**20, 4])  # the means as one multi-tensor kernel, or the pieces of 4+ alone
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_ends_with_the_mean_of_values_read_where_they_are(world_size, lerp_alone, host_streams, monkeypatch):
    monkeypatch.setattr(copy_engines, "LERP_ALONE", lerp_alone)
    seed = secrets.randbelow(2**20)
    generator = torch.Generator().manual_seed(seed)
    numel = int(torch.randint(5, 60, (), generator=generator))
    values = torch.randn(world_size, numel, dtype=torch.float64, generator=generator)
    buffers = [torch.full((buffer_numel(numel, world_size),), float("nan"), dtype=torch.float64)
               for _ in range(world_size)]
    averages, signals, condition = [], collections.Counter(), threading.Condition()
    for rank in range(world_size):  # each rank: some runs of its values in tensors of their own, the rest in its buffer
        cuts = sorted({0, numel, *torch.randint(0, numel, (4,), generator=generator).tolist()})
        sources = []
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            if (k + rank) % 2:
                sources.append((a, values[rank, a:b].clone()))  # the buffer keeps its NaNs there
            else:
                buffers[rank][a:b] = values[rank, a:b]
        padded = -(-numel // world_size) * world_size
        buffers[rank][numel:padded] = 0.0  # the padding, as the caller leaves it
        averages.append(PeerAverage(_Buffers(buffers, rank, signals, condition), _Stream(), _Stream(),
                                    f"rank {rank}", sources))
    with concurrent.futures.ThreadPoolExecutor(world_size) as pool:  # each rank sends, then waits for the means
        for done in [pool.submit(lambda a: a.send().wait(), average) for average in averages]:
            done.result()
    want = values.mean(0)
    for rank, buffer in enumerate(buffers):
        got = buffer[:numel]
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (seed, rank, (got - want).abs().max())
        assert torch.equal(buffer[:padded], buffers[0][:padded]), (seed, rank, "the ranks' bits differ")
        assert not buffer[numel:padded].any(), (seed, rank, "the padding's mean is not zero")


def test_a_buffer_without_its_room_is_refused(host_streams):
    buffers = [torch.zeros(6) for _ in range(3)]  # 3 slices of 2, no room for the third rank's values (4 x 2 needed)
    with pytest.raises(ValueError, match="is not N slices and the room for the peers past the first"):
        PeerAverage(_Buffers(buffers, 0, collections.Counter(), threading.Condition()), _Stream(), _Stream(), "b")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_gathers_every_ranks_values_and_their_mean_is_the_same_bits(world_size, host_streams):
    """``PeerGather``: each rank's values, pushed from tensors of its own at their offsets, land in its slot of every
    peer's buffer; ``mean_of`` each element's values in rank order is the float64 mean rounded once to bf16, in the
    same bits on every rank (the sum in fp32 is exact for two bf16 values; for more, within the fp32 sum's ulps)."""
    from torch_impl.optim import mean_of

    seed = secrets.randbelow(2**20)
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 20, (int(torch.randint(1, 5, (), generator=generator)),), generator=generator).tolist()
    offsets = [sum(sizes[:k]) + 3 * k for k in range(len(sizes))]  # gaps between the tensors, as alignment leaves
    numel = offsets[-1] + sizes[-1]
    values = [[torch.randn(n, generator=generator).to(torch.bfloat16) for n in sizes] for _ in range(world_size)]
    buffers = [torch.full((copy_engines.gather_numel(numel, world_size),), float("nan"), dtype=torch.bfloat16)
               for _ in range(world_size)]
    signals, condition = collections.Counter(), threading.Condition()
    gathers = [copy_engines.PeerGather(_Buffers(buffers, rank, signals, condition), _Stream(), f"rank {rank}",
                                       list(zip(offsets, values[rank]))) for rank in range(world_size)]
    with concurrent.futures.ThreadPoolExecutor(world_size) as pool:
        for done in [pool.submit(lambda g: (g.send(), g.wait()), gather) for gather in gathers]:
            done.result()
    means = []
    for rank, gather in enumerate(gathers):
        terms = [[values[rank][k] if q == rank else gather.values(q)[a:a + n] for q in range(world_size)]
                 for k, (a, n) in enumerate(zip(offsets, sizes))]
        for k, ts in enumerate(terms):
            assert all(torch.equal(t, values[q][k]) for q, t in enumerate(ts)), (seed, rank, k, "a value moved")
        means.append(torch.cat([mean_of(ts) for ts in terms]))
    want = torch.stack([torch.cat(v).double() for v in values]).mean(0)
    assert all(torch.equal(m.view(torch.int16), means[0].view(torch.int16)) for m in means), (seed, "bits differ")
    assert means[0].dtype == torch.bfloat16
    ulps = 2.0**-8 * want.abs() + (2.0**-23 * world_size * torch.stack([torch.cat(v).double() for v in values])
                                   .abs().sum(0))
    assert bool(((means[0].double() - want).abs() <= ulps).all()), (seed, (means[0].double() - want).abs().max())
    if world_size == 2:  # exact sum: the mean rounded once
        assert torch.equal(means[0], want.to(torch.bfloat16)), seed


def test_a_gather_buffer_of_the_wrong_size_is_refused(host_streams):
    buffers = [torch.zeros(5) for _ in range(3)]  # 3 ranks need 2 slots of equal size
    with pytest.raises(ValueError, match="is not N - 1 equal slots"):
        copy_engines.PeerGather(_Buffers(buffers, 0, collections.Counter(), threading.Condition()), _Stream(), "b", [])
