"""Ring collectives and the Scaling Book analysis against hand calculations and worked numbers."""

import math
import random

import pytest

from parallelism_calc.collectives import (bus_bandwidth, ring_all_gather_time, ring_all_reduce_time,
                                          ring_reduce_scatter_time, whole_buffer_ring_all_reduce_time)
from parallelism_calc.scaling import (CS336_V5P, Roofline, block_costs, max_tp_degree, min_batch_per_data_rank,
                                      min_batch_per_device_2d, optimal_fsdp_degree)

D, F = 16_384, 53_248  # the CS336 XXL model


def test_ring_collectives_by_hand():
    v, n, w, lat = random.uniform(1e6, 1e9), random.randint(2, 64), random.uniform(1e10, 1e12), 5e-6
    step = v / n / w + lat  # one of the n - 1 steps: a chunk of V/n bytes, plus a hop's latency
    assert ring_all_gather_time(v, n, w, lat) == pytest.approx((n - 1) * step)
    assert ring_reduce_scatter_time(v, n, w, lat) == pytest.approx((n - 1) * step)
    assert ring_all_reduce_time(v, n, w, lat) == pytest.approx(2 * (n - 1) * step)
    assert whole_buffer_ring_all_reduce_time(v, n, w) == pytest.approx(n * ring_all_reduce_time(v, n, w))
    assert ring_all_reduce_time(v, 1, w, lat) == 0  # one device: nothing to exchange


def test_bus_bandwidth_matches_nccl_tests_convention():
    # NCCL-tests: 1 GB all-reduce over 8 ranks in 5 ms -> algbw 200 GB/s, busbw 200 * 2 * 7/8 = 350 GB/s.
    assert bus_bandwidth("all_reduce", 1e9, 8, 5e-3) == pytest.approx(350e9)
    assert bus_bandwidth("all_gather", 1e9, 8, 5e-3) == pytest.approx(175e9)
    with pytest.raises(ValueError, match="accepted: all_gather"):
        bus_bandwidth("broadcast", 1e9, 8, 1.0)
    with pytest.raises(ValueError, match="devices >= 1"):
        ring_all_gather_time(1e9, 0, 1e10)


def test_xxl_forward_costs_by_hand():
    """X = 16 FSDP, Y = 4 TP, v5p: each term written out from the Scaling Book's formulas."""
    c, w, mx, my, x, y, b = 4.6e14, 1.8e11, 2, 1, 16, 4, 50_000
    costs = block_costs(D, F, b, CS336_V5P, x=x, y=y)
    assert costs.math == pytest.approx(2 * 2 * b * D * F / (x * y * c))  # two D x F products
    assert costs.weight_comm == pytest.approx(2 * 2 * D * F / y / (w * mx))  # bf16 weights gathered over X
    assert costs.tp_comm == pytest.approx(2 * 2 * b * D / x / (w * my))  # AG in + RS out over Y
    alpha = c / w
    assert min_batch_per_data_rank(CS336_V5P) == pytest.approx(alpha / mx)  # ~1277.8
    assert costs.min_batch(overlapped=True) == pytest.approx(x * alpha / mx)  # B/X > alpha / M_X
    # serialized: B (F / (N alpha) - 1 / (X M_Y)) > F / (Y M_X), solved for B
    expected_serial = (F / (y * mx)) / (F / (x * y * alpha) - 1 / (x * my))
    assert costs.min_batch(overlapped=False) == pytest.approx(expected_serial)
    assert 20_000 < costs.min_batch(True) < costs.min_batch(False) < 30_000  # 20,444 and 25,302 tokens
    assert max_tp_degree(F, CS336_V5P) == pytest.approx(F * my / alpha)  # ~20.8


def test_compute_bound_flags_agree_with_min_batch():
    costs = block_costs(D, F, 1.0, CS336_V5P, x=16, y=4)
    for overlapped in (True, False):
        b_min = costs.min_batch(overlapped)
        below = block_costs(D, F, 0.99 * b_min, CS336_V5P, x=16, y=4)
        above = block_costs(D, F, 1.01 * b_min, CS336_V5P, x=16, y=4)
        assert not below.compute_bound(overlapped) and above.compute_bound(overlapped)


def test_too_much_tp_is_never_compute_bound():
    y = 32  # > F M_Y / alpha ~ 20.8
    assert block_costs(D, F, 1e6, CS336_V5P, x=2, y=y).min_batch(overlapped=True) is None


def test_2d_optimum_brute_force():
    """The closed forms against a search over every split of N devices and batch sizes."""
    n_devices = 1024
    for overlapped, k in ((True, 1), (False, 4)):
        per_device = min_batch_per_device_2d(F, CS336_V5P, overlapped)
        assert per_device == pytest.approx(k * CS336_V5P.alpha**2 / (2 * 1 * F))
        best = math.inf
        for x in range(1, n_devices + 1):  # continuous X: any divisor is allowed in the formulas
            y = n_devices / x  # the costs of one block, written out for this split
            a = 2 * 2 * D * F / (n_devices * CS336_V5P.flops)
            f = 2 * 2 * D * F / (y * CS336_V5P.bandwidth * 2)
            t = 2 * 2 * D / (x * CS336_V5P.bandwidth * 1)
            if t < a:
                best = min(best, (f / a if overlapped else f / (a - t)) / n_devices)
        assert best == pytest.approx(per_device, rel=2e-2)  # integer X grid vs the continuous optimum
    b = 4e6
    x_opt = optimal_fsdp_degree(b, F, n_devices, CS336_V5P)
    assert x_opt == pytest.approx(math.sqrt(b * n_devices * 2 / (F * 1)))


def test_backward_and_dp():
    fwd = block_costs(D, F, 1e5, CS336_V5P, x=8, shard_weights=False)
    bwd = block_costs(D, F, 1e5, CS336_V5P, x=8, shard_weights=False, backward=True)
    assert fwd.weight_comm == 0 and bwd.math == pytest.approx(2 * fwd.math)
    # DP backward: all-reduce of the bf16 gradients = 2 x (all-gather of the weights)
    assert bwd.weight_comm == pytest.approx(2 * 2 * 2 * D * F / (CS336_V5P.bandwidth * 2))
    fsdp_bwd = block_costs(D, F, 1e5, CS336_V5P, x=8, backward=True)
    assert fsdp_bwd.weight_comm == pytest.approx(bwd.weight_comm)  # all-gather + reduce-scatter, same bytes
    assert max_tp_degree(F, CS336_V5P, backward=True) == pytest.approx(2 * max_tp_degree(F, CS336_V5P))


def test_bad_input():
    with pytest.raises(ValueError, match="does not divide d_ff"):
        block_costs(D, F, 1e5, CS336_V5P, y=7)
    with pytest.raises(ValueError, match="positive"):
        block_costs(D, F, 0, CS336_V5P)
    with pytest.raises(ValueError, match="Roofline"):
        Roofline(flops=0, bandwidth=1)
