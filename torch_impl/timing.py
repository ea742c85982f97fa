"""Timing training steps by phase without stalling the device, and replaying a whole step as a CUDA graph.

``PhaseTimer`` marks phase boundaries (``start()``, then ``mark("forward")``, ``mark("backward")``, ...). On
CUDA each mark records an event on the current stream and nothing waits: the host keeps queueing kernels
while the device runs, as in real training, and the times (read once, by ``results()``) are the device's time
between the marks, idle gaps included, so a host too slow to feed the device still shows. A synchronization
at every phase boundary, as this harness did before, drains the queue three times a step and makes the
device wait for the host's next launches (notes/train_step.md). On the CPU the marks are host clocks.

``capture_step(step)`` records one call of ``step`` (forward, backward, optimizer) in a CUDA graph and
returns a function that replays it: one launch per step instead of thousands, for steps whose kernels are
too short to hide the host's launch time (PyTorch's "whole network capture", torch.cuda.graphs docs). The
inputs, parameters, gradients and optimizer state must keep their addresses: gradients are created inside
the graph (set to None before capture) and the optimizer must be ``capturable``. Steps compiled with
``torch_impl.parallelize.apply_compile(model, cuda_graphs=True)`` replay one graph per block instead.

``median_ms(fn, reps)`` times one call at a time between CUDA events: the probes' clock for a single kernel or
optimizer step (a ~0.1 ms kernel timed so carries launch gaps that back-to-back kernels in a step do not).
``enqueue_ms(fn)`` is the host's side of a call: the time it takes to return on an idle GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


class PhaseTimer:
    """Per-step phase times: ``start()`` before a step, ``mark(phase)`` at the end of each phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._steps: list[list[tuple[str, object]]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._steps.append([("start", self._now())])

    def mark(self, phase: str) -> None:
        self._steps[-1].append((phase, self._now()))

    def results(self) -> tuple[list[float], dict[str, list[float]]]:
        """(step times in ms, {phase: times in ms}) of every started step, a phase marked several times in a
        step (one per micro-batch) summed; waits for the device once."""
        if self.cuda:
            torch.cuda.synchronize()

        def ms(a, b) -> float:
            return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

        steps, phases = [], {}
        for marks in self._steps:
            steps.append(ms(marks[0][1], marks[-1][1]))
            this_step: dict[str, float] = {}
            for (_, before), (phase, after) in zip(marks, marks[1:]):
                this_step[phase] = this_step.get(phase, 0.0) + ms(before, after)
            for phase, time_ms in this_step.items():
                phases.setdefault(phase, []).append(time_ms)
        return steps, phases


def enqueue_ms(fn: Callable[[], object], calls: int = 1, rounds: int = 1) -> float:
    """The host's milliseconds to enqueue one ``fn()`` on an idle GPU: the median over ``rounds`` rounds of
    ``calls`` calls in a row, the GPU synchronized before each round and after the last. Where a run's time is near
    it, the run is bound by its host (Python and launches), not by its kernels."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def median_ms(fn: Callable[[], object], reps: int, warmup: int = 3, graph: bool = False) -> float:
    """Median milliseconds of one ``fn()`` call over ``reps`` calls after ``warmup`` untimed ones, each timed
    alone between two CUDA events (what the probes in scripts/ measure a kernel or an optimizer step with). With
    ``graph``, ``fn`` is captured by ``capture_step`` (after its warm-up, on a side stream) and the replays are
    timed: the device's time without the host's launch path, which the events would otherwise count where it is
    longer than the kernels (a Triton kernel with TMA descriptors built on the host: session 48 of
    notes/train_step.md), and what a step's CUDA graphs run."""
    if graph:
        if warmup < 1:  # the capture would hold the first call's lazy set-up (compilation, cuBLAS's workspace)
            raise ValueError(f"median_ms: graph=True needs warmup >= 1 (got {warmup})")
        fn = capture_step(fn, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def capture_step(step: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer | None = None,
                 warmup: int = 2) -> Callable[[], torch.Tensor]:
    """Run ``step`` ``warmup`` times on a side stream, capture one call in a CUDA graph, and return a function
    that replays it and returns the (static) tensor the captured call returned, e.g. the loss. The gradients
    of ``optimizer``'s parameters are released before the capture, so that the graph's pool, which makes
    them anew, does not sit beside the warm-up's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # lazy initialisation (cuBLAS workspaces, autotuning) stays out of the graph
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()  # the graph's private pool cannot reuse cached blocks: hand them back first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    replay.graph = graph  # keep the graph (and its memory pool) alive as long as the function
    return replay
