"""``torch_impl.timing.median_ms``: with ``graph``, the device's time of a call, without its host path."""

from __future__ import annotations

import time

import pytest
import torch

from torch_impl.timing import median_ms


@pytest.mark.gpu
def test_gpu_median_ms_of_a_graph_leaves_the_hosts_launch_path_out():
    """A product behind 20 ms of host work: timed call by call, the events count the host's 20 ms; replayed from
    a CUDA graph, only the product (well under 20 ms) counts, and its result is the product's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    a = torch.randn(512, 512, device="cuda")
    out = torch.empty_like(a)

    def slow_launch():
        time.sleep(0.02)
        torch.mm(a, a, out=out)

    assert median_ms(slow_launch, reps=3) >= 19.0
    out.zero_()
    assert median_ms(slow_launch, reps=3, graph=True) < 5.0
    torch.testing.assert_close(out, a @ a)
