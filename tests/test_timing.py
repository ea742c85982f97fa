"""``torch_impl.timing.median_ms``: with ``graph``, the device's time of a call, without its host path."""

from __future__ import annotations

import time

import pytest
import torch

from torch_impl.timing import median_ms


@pytest.mark.gpu
def test_gpu_median_ms_of_a_graph_leaves_the_hosts_launch_path_out():
    """A kernel behind 20 ms of host work: timed call by call, the events count the host's 20 ms; replayed from a
    CUDA graph, only the kernel counts. The kernel counts its runs: the graph's replays run it, its capture not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runs = torch.zeros(1, device="cuda")

    def slow_launch():
        time.sleep(0.02)
        runs.add_(1)

    assert median_ms(slow_launch, reps=3, warmup=1) >= 19.0
    assert runs.item() == 4  # one warm-up, three timed
    runs.zero_()
    assert median_ms(slow_launch, reps=3, warmup=1, graph=True) < 5.0
    assert runs.item() == 5  # one warm-up on the side stream, one replayed, three timed; the capture ran nothing
    with pytest.raises(ValueError, match="warmup >= 1"):
        median_ms(slow_launch, reps=1, warmup=0, graph=True)
