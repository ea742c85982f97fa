"""Times of ring collectives (the alpha-beta model) and the bus bandwidth that benchmarks report.

A ring of n devices, each sending to its neighbour over a link of ``bandwidth`` bytes/s (one direction),
with ``latency`` seconds per step. ``total_bytes`` V is the size of the full (gathered / reduced) buffer.

* all-gather and reduce-scatter: n - 1 steps, each moving one chunk of V / n bytes per device:
  T = (n - 1) (V / n) / W + (n - 1) latency;
* all-reduce = reduce-scatter + all-gather: T = 2 (n - 1) (V / n) / W + 2 (n - 1) latency;
* the alternate "whole-buffer" ring all-reduce passes the entire buffer around the ring (reduce along the
  ring, then the result back around): n - 1 steps of V bytes each way, T = 2 (n - 1) V / W + 2 (n - 1)
  latency, n times more traffic than reduce-scatter + all-gather, which is why NCCL does not use it.

With a bidirectional ring (or the TPU Scaling Book's W_ici = 2 x one-way link bandwidth) pass the sum of
both directions as ``bandwidth``. References: Patarasuk & Yuan 2009 (bandwidth-optimal ring all-reduce);
NCCL-tests' PERFORMANCE.md (bus bandwidth); CS336 (2025) lecture 7.
"""

from __future__ import annotations

OPS = ("all_gather", "reduce_scatter", "all_reduce")


def _check(total_bytes: float, n: int, bandwidth: float, latency: float) -> None:
    if total_bytes < 0 or n < 1 or bandwidth <= 0 or latency < 0:
        raise ValueError(
            f"collective needs bytes >= 0, devices >= 1, bandwidth > 0, latency >= 0; got bytes={total_bytes}, "
            f"devices={n}, bandwidth={bandwidth}, latency={latency}"
        )


def ring_all_gather_time(total_bytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """(n - 1) / n * V / W + (n - 1) * latency: every device receives the n - 1 chunks it lacks."""
    _check(total_bytes, n, bandwidth, latency)
    return (n - 1) / n * total_bytes / bandwidth + (n - 1) * latency


def ring_reduce_scatter_time(total_bytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """(n - 1) / n * V / W + (n - 1) * latency: the mirror image of the all-gather."""
    return ring_all_gather_time(total_bytes, n, bandwidth, latency)


def ring_all_reduce_time(total_bytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """Reduce-scatter then all-gather: 2 (n - 1) / n * V / W + 2 (n - 1) * latency."""
    return (ring_reduce_scatter_time(total_bytes, n, bandwidth, latency)
            + ring_all_gather_time(total_bytes, n, bandwidth, latency))


def whole_buffer_ring_all_reduce_time(total_bytes: float, n: int, bandwidth: float, latency: float = 0.0) -> float:
    """The alternate ring all-reduce: the whole buffer goes around twice, 2 (n - 1) * V / W + 2 (n - 1) * latency."""
    _check(total_bytes, n, bandwidth, latency)
    return 2 * (n - 1) * (total_bytes / bandwidth + latency)


def bus_bandwidth(op: str, total_bytes: float, n: int, seconds: float) -> float:
    """NCCL-tests' bus bandwidth: algorithm bandwidth V / t times (n - 1) / n (gather, scatter) or 2 (n - 1) / n
    (all-reduce), so that it is comparable with the link bandwidth whatever n is."""
    if op not in OPS:
        raise ValueError(f"collective {op!r}; accepted: {', '.join(OPS)}")
    if seconds <= 0 or n < 1:
        raise ValueError(f"bus_bandwidth needs seconds > 0 and devices >= 1; got {seconds}, {n}")
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return total_bytes / seconds * factor
