"""All-reduce benchmark: ``torchrun --nproc_per_node N -m torch_impl.bench.allreduce [flags]``.

For each size, every rank all-reduces (SUM) a float32 tensor of that many bytes: ``--warmup`` untimed calls
(the first one checked for the right sum), then ``--iters`` timed calls, each preceded by a barrier so that
every rank starts together. On GPUs (NCCL) each call is timed with CUDA events around the ``all_reduce``; on
CPUs (gloo) with ``time.perf_counter`` around it. The ranks' per-call times are gathered to rank 0
(``all_gather_object``); a call's time is the slowest rank's (a collective is done when the last rank is),
and the record's timing statistics are over those per-call times. In the same run, as a reference, a *raw
loop* times ``--iters`` back-to-back ``dist.all_reduce`` calls with a single synchronization before and after
(no barrier or event per call; its time per call is the slowest rank's total / iters).

Bandwidths (GB/s = 10**9 bytes/s, as nccl-tests report them), with S the tensor's bytes, t the median time:
algorithm bandwidth ``algbw = S / t``; bus bandwidth ``busbw = algbw * 2 (n - 1) / n`` for n ranks
(``parallelism_calc.collectives.bus_bandwidth``), comparable with the link bandwidth whatever n is.

Sizes: ``--sizes 1MB,10MB,100MB,1GB`` use **binary** units: KB = KiB = 2**10, MB = MiB = 2**20,
GB = GiB = 2**30 bytes (as torch DDP's ``bucket_cap_mb`` and the CS336 handout's sizes); a bare number is bytes.
Bandwidths, in contrast, are decimal GB/s.

Rank 0 prints progress and, with ``--out``, appends one ``Record`` per size (suite "allreduce", implementation
"{backend} all_reduce", the world size, fp32; metrics: bytes, algbw/busbw in GB/s, each rank's median, and the
raw loop's time and bandwidths). A size that fails on any rank (e.g. out of memory) becomes an error record on
every rank's agreement, then the run goes on. ``--report-only FILE`` (no torchrun needed) reads the records
and draws bus bandwidth against size, one line per (world size, benchmark | raw loop), one panel per backend
(``analysis.allreduce.write_allreduce_report``), and prints a Markdown table.

References: NCCL-tests PERFORMANCE.md (algbw / busbw); CS336 assignment 2 (2025), section 2.1 (benchmarking
all-reduce on gloo/CPU and NCCL/GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from analysis.records import Record, save_records, timing_stats
from parallelism_calc.cli import (ArgumentParser, error_boundary, nonnegative_int, positive_float, positive_int,
                                  writable_path)
from parallelism_calc.collectives import bus_bandwidth
from parallelism_calc.units import FLOAT32_BYTES, parse_size, size_label

SUITE = "allreduce"
DEFAULT_SIZES = "1MB,10MB,100MB,1GB"
_GB = 1e9  # bandwidths in decimal GB/s


def bandwidths(nbytes: int, world_size: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10**9 bytes/s) of an all-reduce of ``nbytes`` over ``world_size`` ranks."""
    return nbytes / seconds / _GB, bus_bandwidth("all_reduce", nbytes, world_size, seconds) / _GB


# ----------------------------------------------------------------------------- measuring (under torchrun)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(tensor, iters: int) -> list[float]:
    """Per-call milliseconds of ``iters`` all-reduces, each after a barrier (this rank's view)."""
    import torch
    import torch.distributed as dist

    times = []
    cuda = tensor.device.type == "cuda"
    for _ in range(iters):
        _sync(tensor.device)
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(tensor)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _time_raw_loop(tensor, iters: int) -> float:
    """Milliseconds per call of ``iters`` back-to-back all-reduces, synchronized only before and after."""
    import torch.distributed as dist

    _sync(tensor.device)
    dist.barrier()
    _sync(tensor.device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    _sync(tensor.device)
    return (time.perf_counter() - t0) * 1e3 / iters


def _allocate(nbytes: int, device):
    """This rank's float32 tensor of ``nbytes`` (may raise, e.g. out of memory: before any collective on it)."""
    import torch
    import torch.distributed as dist

    return torch.full((nbytes // FLOAT32_BYTES,), float(dist.get_rank() + 1), dtype=torch.float32,
                      device=device)  # (numel,)


def _measure(tensor, warmup: int, iters: int) -> dict[str, Any]:
    """This rank's measurements on its tensor; every rank issues the same collectives whatever happens, and a
    wrong sum is reported (``error``), not raised, so that the ranks stay in step."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    dist.all_reduce(tensor)  # the first warm-up call, checked: sum over ranks of (rank + 1)
    expected = world_size * (world_size + 1) / 2
    error = None if bool((tensor == expected).all()) else (
        f"all_reduce gave a wrong sum on rank {dist.get_rank()} (expected {expected:g} everywhere)")
    tensor.zero_()  # repeated in-place sums stay finite
    for _ in range(max(warmup - 1, 0)):
        dist.all_reduce(tensor)
    _sync(tensor.device)
    times = _time_calls(tensor, iters)
    raw_ms = _time_raw_loop(tensor, iters)
    return {"times_ms": times, "raw_ms": raw_ms, "error": error}


def _agree_all_ok(ok: bool, device) -> bool:
    """True if every rank succeeded (a MIN all-reduce of one flag), so all ranks skip a failed size together."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def size_record(nbytes: int, world_size: int, backend: str, per_rank: list[dict], warmup: int, iters: int,
                device_name: str) -> Record:
    """The record of one size from every rank's measurements (rank 0, after the gather)."""
    per_call = [max(rank["times_ms"][i] for rank in per_rank) for i in range(iters)]  # the slowest rank's
    timing = timing_stats(per_call)
    algbw, busbw = bandwidths(nbytes, world_size, timing["median_ms"] / 1e3)
    raw_ms = max(rank["raw_ms"] for rank in per_rank)
    raw_algbw, raw_busbw = bandwidths(nbytes, world_size, raw_ms / 1e3)
    record = Record(
        suite=SUITE, backend="torch", implementation=f"{backend} all_reduce", dtype="fp32", world_size=world_size,
        warmup_steps=warmup, timed_steps=iters, timing=timing,
        metrics={
            "bytes": nbytes, "size": size_label(nbytes), "comm_backend": backend,
            "algbw_gbps": algbw, "busbw_gbps": busbw,
            "per_rank_median_ms": [statistics.median(rank["times_ms"]) for rank in per_rank],
            "raw_loop_ms": raw_ms, "raw_loop_per_rank_ms": [rank["raw_ms"] for rank in per_rank],
            "raw_algbw_gbps": raw_algbw, "raw_busbw_gbps": raw_busbw,
            "busbw_over_raw": busbw / raw_busbw,
        },
    )
    record.provenance["device_name"] = device_name
    return record


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from torch_impl.distributed import distributed_context

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError("an all-reduce needs 2 ranks or more (WORLD_SIZE is 1): run it under torchrun "
                         "--nproc_per_node N (N >= 2)")
    with distributed_context(backend=args.backend, timeout_s=args.timeout,
                             device="cpu" if args.backend == "gloo" else None) as ctx:
        device = ctx.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        if ctx.is_main:
            print(f"all_reduce benchmark: {ctx.backend}, {ctx.world_size} ranks, {device_name}, "
                  f"warmup {args.warmup}, iters {args.iters}", flush=True)
        failures = 0
        for nbytes in sizes:
            tensor = error = None
            try:
                tensor = _allocate(nbytes, device)
            except RuntimeError as err:  # out of memory: found before any collective on the tensor
                error = f"{type(err).__name__}: {err}".splitlines()[0]
            mine = None
            if _agree_all_ok(error is None, device):
                mine = _measure(tensor, args.warmup, args.iters)
                error = mine["error"]
            del tensor
            gathered = [None] * ctx.world_size
            dist.all_gather_object(gathered, {"error": error} if mine is None else mine)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if not ctx.is_main:
                continue
            errors = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
            if errors:
                failures += 1
                message = "; ".join(errors)
                record = Record(suite=SUITE, backend="torch", implementation=f"{ctx.backend} all_reduce",
                                dtype="fp32", world_size=ctx.world_size, warmup_steps=args.warmup,
                                timed_steps=args.iters, status="oom" if "out of memory" in message.lower()
                                else "error", error=message,
                                metrics={"bytes": nbytes, "size": size_label(nbytes), "comm_backend": ctx.backend})
                record.provenance["device_name"] = device_name
                print(f"{size_label(nbytes):>6}: {record.status}: {message}", flush=True)
            else:
                record = size_record(nbytes, ctx.world_size, ctx.backend, gathered, args.warmup, args.iters,
                                     device_name)
                m = record.metrics
                print(f"{m['size']:>6}: median {record.timing['median_ms']:9.3f} ms  algbw {m['algbw_gbps']:8.2f} "
                      f"GB/s  busbw {m['busbw_gbps']:8.2f} GB/s  | raw loop {m['raw_loop_ms']:9.3f} ms  busbw "
                      f"{m['raw_busbw_gbps']:8.2f} GB/s ({m['busbw_over_raw']:.1%})", flush=True)
            if args.out:
                save_records(args.out, record)
        dist.barrier()
    return 1 if failures else 0


# ----------------------------------------------------------------------------- report (records -> plot)


def report(path: str, plot: str | None = None) -> tuple[Path, str]:
    """Bus bandwidth against size from the records in ``path`` (``analysis.allreduce.write_allreduce_report``)."""
    from analysis.allreduce import write_allreduce_report  # pandas + matplotlib, only for the report

    return write_allreduce_report(path, plot)


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="torchrun --nproc_per_node N -m torch_impl.bench.allreduce",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="gloo (CPU tensors) or nccl (GPU tensors); default nccl if CUDA is available, else gloo")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"comma-separated tensor sizes, binary units (MB = 2**20 bytes); default {DEFAULT_SIZES}")
    parser.add_argument("--warmup", type=nonnegative_int, default=5,
                        help="untimed calls per size (default 5; at least 1 runs, checked for the right sum)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed calls per size (default 20)")
    parser.add_argument("--timeout", type=positive_float, default=300.0,
                        help="process-group timeout in seconds (default 300)")
    parser.add_argument("--out", metavar="JSONL", type=writable_path,
                        help="append one record per size to this file (rank 0)")
    parser.add_argument("--report-only", metavar="JSONL", help="no measuring: plot and tabulate the records in JSONL")
    parser.add_argument("--plot", metavar="PNG", help="with --report-only: the plot's path (default <stem>_busbw.png)")
    return parser


@error_boundary(prog="python -m torch_impl.bench.allreduce")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report_only:
        out, text = report(args.report_only, args.plot)
        print(text)
        print(f"plot: {out}")
        return 0
    try:
        [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as err:
        parser.error(str(err))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
