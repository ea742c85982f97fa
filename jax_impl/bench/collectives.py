"""Collective benchmark over one mesh axis: ``python -m jax_impl.bench.collectives --mesh fsdp=8 --axis fsdp``.

The JAX counterpart of ``torch_impl.bench.allreduce``: all-reduce (``lax.psum``), all-gather
(``lax.all_gather``, tiled) and reduce-scatter (``lax.psum_scatter``, tiled) of float32 buffers inside
``jax.shard_map`` over one axis of a (dp, fsdp, tp) mesh; the other axes are independent groups running the
same collective side by side (as FSDP's all-gathers over "fsdp" run once per tp group).

Sizes follow nccl-tests: S (``--sizes``, binary units as in ``parallelism_calc.units``) is the full buffer:
all-reduce in and out S per device; all-gather S / n in, S out; reduce-scatter S in, S / n out, for n
devices on the axis. Bandwidths in decimal GB/s: ``algbw = S / t``, ``busbw`` =
``parallelism_calc.collectives.bus_bandwidth`` (x 2 (n - 1) / n for all-reduce, x (n - 1) / n otherwise).

Method: each (op, size) is one jitted program, compiled before timing. The first call's result is checked
(every device holds its index along the axis: all-reduce gives 0 + 1 + ... + (n - 1), all-gather the
sequence of indices; for reduce-scatter each element also carries n x its output chunk's index, so device k
gets n (n - 1) / 2 + n^2 k); then ``--warmup`` untimed calls, ``--iters`` calls
each timed to completion (``block_until_ready``; the median is the record's time), and a *raw loop* of
``--iters`` calls dispatched back to back with one wait at the end (its time per call in ``metrics``).

Records (process 0 appends one per (op, size) to ``--out``): suite "collectives", backend "jax",
implementation the op, world_size n (the axis size), the mesh, fp32; metrics: op, axis, bytes, size,
algbw/busbw, the raw loop's time and bandwidths. A size that fails (e.g. out of memory) is an error row and
the run goes on. ``--report-only FILE`` draws bus bandwidth against size (one line per op and axis size)
and prints a Markdown table (``analysis.collectives.write_collectives_report``).

References: NCCL-tests PERFORMANCE.md (algbw / busbw); the JAX ``shard_map`` docs (collectives in SPMD
code); the TPU Scaling Book, "Sharded matrices" (collective costs over one mesh axis).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from analysis.harness import progress
from analysis.records import Record, save_records, timing_stats
from parallelism_calc.cli import ArgumentParser, error_boundary, nonnegative_int, positive_int, writable_path
from jax_impl.bench.e2e import platform_devices
from jax_impl.distributed import initialize_from_env
from jax_impl.sharding import MESH_AXES, make_mesh
from parallelism_calc.collectives import OPS, bus_bandwidth
from parallelism_calc.units import FLOAT32_BYTES, parse_size, size_label

SUITE = "collectives"
DEFAULT_SIZES = "1MB,10MB,100MB,1GB"
_GB = 1e9


def _collective(op: str, axis: str) -> Callable[[jax.Array], jax.Array]:
    """The per-device body: this device's buffer -> the collective's result over ``axis``."""
    if op == "all_reduce":
        return lambda x: jax.lax.psum(x, axis)
    if op == "all_gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)


def input_elements(op: str, nbytes: int, n: int) -> int:
    """Elements of each device's input buffer for a collective of size ``nbytes`` (nccl-tests' S)."""
    elements = nbytes // FLOAT32_BYTES
    if elements % n:
        raise ValueError(f"size {size_label(nbytes)} is not divisible into {n} float32 chunks")
    return elements // n if op == "all_gather" else elements


def build(mesh: Mesh, axis: str, op: str, nbytes: int) -> tuple[Callable, jax.Array, Callable]:
    """(the jitted collective, its input, a check of its first result) for one (op, size)."""
    n = mesh.shape[axis]
    per_device = input_elements(op, nbytes, n)
    every_axis = P(MESH_AXES)  # one chunk per device of the whole mesh, in mesh order
    sharding = NamedSharding(mesh, every_axis)
    shard_map = partial(jax.shard_map, mesh=mesh, in_specs=every_axis, out_specs=every_axis)

    # Each device's buffer holds its index along the axis; for reduce-scatter, plus n x the index of the
    # output chunk each element belongs to, so a chunk delivered to the wrong device shows.
    chunk = per_device // n

    def fill(x):
        index = jax.lax.axis_index(axis).astype(jnp.float32)
        if op == "reduce_scatter":
            index = index + n * (jnp.arange(per_device) // chunk).astype(jnp.float32)
        return x + index

    make = jax.jit(shard_map(fill), out_shardings=sharding)
    x = make(jnp.zeros((mesh.size * per_device,), jnp.float32, device=sharding))
    run = jax.jit(shard_map(_collective(op, axis)), out_shardings=sharding)

    def check(result: jax.Array) -> str | None:
        for shard in result.addressable_shards:
            mine = np.argwhere(mesh.devices == shard.device)[0][MESH_AXES.index(axis)]  # index along the axis
            data = np.asarray(shard.data)
            if op == "all_reduce":
                want = np.full_like(data, n * (n - 1) / 2)
            elif op == "all_gather":
                want = np.repeat(np.arange(n, dtype=np.float32), per_device)
            else:  # sum over the axis of (index + n x mine)
                want = np.full_like(data, n * (n - 1) / 2 + n * n * mine)
            if data.shape != want.shape or not np.array_equal(data, want):
                return f"{op} over {axis!r} gave a wrong result on {shard.device}"
        return None

    return run, x, check


def measure(run: Callable, x: jax.Array, check: Callable, warmup: int, iters: int) -> dict[str, Any]:
    """The first call checked, ``warmup`` untimed calls, ``iters`` timed calls and a raw loop."""
    error = check(jax.block_until_ready(run(x)))
    for _ in range(warmup):
        jax.block_until_ready(run(x))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(run(x))
        times.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    results = [run(x) for _ in range(iters)]
    jax.block_until_ready(results)
    raw_ms = (time.perf_counter() - start) * 1e3 / iters
    return {"times_ms": times, "raw_ms": raw_ms, "error": error}


def make_record(op: str, axis: str, mesh: Mesh, nbytes: int, measured: dict[str, Any], args) -> Record:
    n = mesh.shape[axis]
    common = dict(suite=SUITE, backend="jax", implementation=op, dtype="fp32", world_size=n,
                  mesh={a: int(s) for a, s in mesh.shape.items()}, warmup_steps=args.warmup, timed_steps=args.iters)
    metrics: dict[str, Any] = {"op": op, "axis": axis, "bytes": nbytes, "size": size_label(nbytes),
                               "devices": int(mesh.size)}
    if measured.get("error"):
        message = measured["error"]
        status = "oom" if "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower() else "error"
        record = Record(**common, status=status, error=message.splitlines()[0], metrics=metrics)
    else:
        seconds = statistics.median(measured["times_ms"]) / 1e3
        raw_seconds = measured["raw_ms"] / 1e3
        metrics.update({
            "algbw_gbps": nbytes / seconds / _GB, "busbw_gbps": bus_bandwidth(op, nbytes, n, seconds) / _GB,
            "raw_loop_ms": measured["raw_ms"], "raw_algbw_gbps": nbytes / raw_seconds / _GB,
            "raw_busbw_gbps": bus_bandwidth(op, nbytes, n, raw_seconds) / _GB})
        record = Record(**common, timing=timing_stats(measured["times_ms"]), metrics=metrics)
    device = mesh.devices.flat[0]
    record.provenance["device_name"] = "cpu" if device.platform == "cpu" else device.device_kind
    return record


def run_all(args: argparse.Namespace) -> int:
    initialize_from_env()
    mesh = make_mesh(args.mesh, platform_devices(args.device))
    if args.axis not in MESH_AXES:
        raise ValueError(f"--axis {args.axis!r}; accepted: {', '.join(MESH_AXES)}")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    for op in ops:
        if op not in OPS:
            raise ValueError(f"--ops: unknown collective {op!r}; accepted: {', '.join(OPS)}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    writer = jax.process_index() == 0
    failures = 0
    configs = [(op, nbytes) for op in ops for nbytes in sizes]
    bar, write = progress(configs, "collectives", "config", enabled=writer)
    for op, nbytes in bar:
        try:
            run, x, check = build(mesh, args.axis, op, nbytes)
            measured = measure(run, x, check, args.warmup, args.iters)
            del x
        except (RuntimeError, ValueError) as err:  # out of memory, indivisible size: a row, not a gap
            measured = {"error": f"{type(err).__name__}: {err}"}
        record = make_record(op, args.axis, mesh, nbytes, measured, args)
        failures += record.status != "ok"
        if writer:
            if args.out:
                save_records(args.out, record)
            m = record.metrics
            line = (f"{op} {m['size']} over {args.axis}={mesh.shape[args.axis]}: " +
                    (f"{record.timing['median_ms']:.3f} ms, busbw {m['busbw_gbps']:.1f} GB/s "
                     f"(raw loop {m['raw_busbw_gbps']:.1f})" if record.status == "ok" else
                     f"{record.status}: {record.error}"))
            if args.json:
                import json
                line = json.dumps(record.to_dict(), sort_keys=True)
            write(line)
    return 1 if failures else 0


@error_boundary(prog="python -m jax_impl.bench.collectives")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m jax_impl.bench.collectives", description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="fsdp=-1", help="device mesh, e.g. fsdp=8 or dp=2,fsdp=4 (default fsdp=-1)")
    parser.add_argument("--axis", default="fsdp", help="the mesh axis the collectives run over (default fsdp)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated: {', '.join(OPS)} (default all)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"buffer sizes, binary units (default {DEFAULT_SIZES})")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    parser.add_argument("--warmup", type=nonnegative_int, default=5,
                        help="untimed calls after the checked one (default 5)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed calls (default 20)")
    parser.add_argument("--out", metavar="JSONL", type=writable_path, help="append one record per (op, size) here")
    parser.add_argument("--json", action="store_true", help="print each record as JSON")
    parser.add_argument("--report-only", metavar="JSONL", help="only draw the plot and table of these records")
    args = parser.parse_args(argv)
    if args.report_only:
        from analysis.collectives import write_collectives_report

        plot, table = write_collectives_report(args.report_only)
        print(f"{table}\n\nplot: {plot}")
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
