"""The device's measured ceilings: ``python -m torch_impl.bench.ceilings --out results/ceilings_h100.jsonl``.

What a roofline needs, measured rather than read off a datasheet (whose peaks no program reaches): the rate of a
large matrix product (``--size`` cubed, bf16 and fp32 without TF32, random normal data) in FLOP/s, and the
bandwidth of a device-to-device copy of ``--copy-gib`` GiB in bytes/s, counting the bytes read and the bytes
written. Each is timed with CUDA events around ``--iters`` back-to-back calls after ``--warmup`` untimed ones,
``--repeats`` times; the record's timing holds the per-call times of the repeats, its rate the median's. One record
each (suite "ceilings"): ``tflops`` for the products, ``metrics.bytes_per_s`` for the copy. ``analysis.fidelity``
reads them as the ceilings of its roofline. On the CPU the same runs with host clocks (a smoke test, not a ceiling).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch

from analysis.records import Record, save_records, timing_stats
from parallelism_calc.cli import ArgumentParser, error_boundary, positive_float, positive_int, writable_path
from torch_impl.device import device_name, pick_device

SUITE = "ceilings"
MATMUL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def time_per_call_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Milliseconds per call of ``fn``, ``iters`` calls back to back between two clock readings."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e3 / iters


def measure(args) -> list[Record]:
    device = pick_device(args.device)
    name = device_name(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    records = []

    def record(implementation: str, dtype: str, times_ms: list[float], **fields) -> Record:
        r = Record(suite=SUITE, backend="torch", implementation=implementation, dtype=dtype,
                   timing=timing_stats(times_ms), **fields)
        r.provenance["device_name"] = name
        return r

    def repeat(fn: Callable[[], object]) -> list[float]:
        return [time_per_call_ms(fn, device, args.warmup, args.iters) for _ in range(args.repeats)]

    n = args.size
    for dtype, torch_dtype in MATMUL_DTYPES.items():
        a, b = (torch.randn(n, n, device=device, dtype=torch_dtype) for _ in range(2))
        times = repeat(lambda: a @ b)
        flops = 2 * n**3
        records.append(record(f"matmul {n}x{n}x{n}", dtype, times, flops_per_step=float(flops),
                              tflops=flops / (statistics.median(times) / 1e3) / 1e12))
        del a, b
    elements = int(args.copy_gib * 2**30) // 4
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    times = repeat(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()  # read once, written once
    records.append(record(f"copy {args.copy_gib:g} GiB", "fp32", times, metrics={
        "bytes": moved, "bytes_per_s": moved / (statistics.median(times) / 1e3)}))
    for r in records:
        rate = f"{r.tflops:.1f} TFLOP/s" if r.tflops else f"{r.metrics['bytes_per_s'] / 1e12:.3f} TB/s"
        print(f"{name}: {r.implementation} {r.dtype}: {r.timing['median_ms']:.3f} ms, {rate}", flush=True)
    return records


@error_boundary(prog="python -m torch_impl.bench.ceilings")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m torch_impl.bench.ceilings", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (the GPU if any), cpu, cuda or cuda:N")
    parser.add_argument("--size", type=positive_int, default=8192, help="matrix size n of the n^3 products (8192)")
    parser.add_argument("--copy-gib", type=positive_float, default=2.0, help="GiB copied (default 2)")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed calls before each timing (3)")
    parser.add_argument("--iters", type=positive_int, default=10, help="calls per timing (10)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timings per ceiling (5)")
    parser.add_argument("--out", type=writable_path, help="append the records to this .jsonl")
    args = parser.parse_args(argv)
    records = measure(args)
    if args.out:
        save_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
