"""Collective benchmark over one mesh axis: ``python -m jax_impl.bench.collectives --mesh fsdp=8 --axis fsdp``.

The JAX counterpart of ``torch_impl.bench.allreduce``: all-reduce (``lax.psum``), all-gather
(``lax.all_gather``, tiled) and reduce-scatter (``lax.psum_scatter``, tiled) of float32 buffers inside
``jax.shard_map`` over one axis of a (dp, fsdp, tp) mesh; the other axes are independent groups running the
same collective side by side (as FSDP's all-gathers over "fsdp" run once per tp group).

Sizes follow nccl-tests: S (``--sizes``, binary units as in ``parallelism_calc.units``) is the full buffer:
all-reduce in and out S per device; all-gather S / n in, S out; reduce-scatter S in, S / n out, for n
devices on the axis. Bandwidths in decimal GB/s: ``algbw = S / t``, ``busbw`` =
``parallelism_calc.collectives.bus_bandwidth`` (x 2 (n - 1) / n for all-reduce, x (n - 1) / n otherwise);
the measured op and the raw loop go through the same function (``bandwidths``) with the same S.

Method: each (op, size) is two jitted programs, compiled before timing. The *measured op* runs the collective
once: its first call's result is checked (every device holds its index along the axis: all-reduce gives
0 + 1 + ... + (n - 1), all-gather the sequence of indices; for reduce-scatter each element also carries n x its
output chunk's index, so device k gets n (n - 1) / 2 + n^2 k); then ``--warmup`` untimed calls and ``--iters``
calls each timed to completion (``block_until_ready``; the median is the record's time). The *raw loop* is the
upper bound without per-call host overhead, as nccl-tests and ``torch_impl.bench.allreduce``'s raw loop time
back-to-back collectives: one program of ``--iters`` chained collectives (unrolled), checked like the measured
op, then timed as whole calls (the median of ``RAW_CALLS``; its time per collective in ``metrics``). Each
collective's input is the previous one with element 0 set to the first input's plus ``zero`` x the previous
result's element 0, ``zero`` a runtime argument (0.0): the values never change, but XLA cannot prove it, so it
neither merges the collectives (without that data dependence it CSEs ``--iters`` identical collectives into
one) nor hoists or overlaps them; the compiled program is checked to hold ``--iters`` of them (an error row
if fewer). Each link adds a one-element in-place update (a tiny kernel on GPUs); each call copies its input once
(all-reduce and reduce-scatter S, all-gather S / n) and is dispatched once, both spread over the collectives.

XLA options (``--xla-options``): ``stock`` (none, the default), ``tuned`` (``TUNED_XLA_OPTIONS``: the latency
hiding scheduler from JAX's GPU performance tips and the 8 GiB combine thresholds of NVIDIA JAX-Toolbox's
FSDP tips), and/or ``NAME=VALUE`` pairs, comma-separated; they are compile options of both programs
(``.compile(compiler_options=...)``), so they apply whenever JAX started. Every record's metrics carry the
options (``xla_options``, ``xla``: the spec) and the environment that configures XLA and NCCL (``env``:
``XLA_FLAGS``, ``XLA_PYTHON_CLIENT_*``, ``NCCL_*``, ``CUDA_DEVICE_MAX_CONNECTIONS``; these act only when set
before JAX starts its backend, so set them on the command line).

Records (process 0 appends one per (op, size) to ``--out``): suite "collectives", backend "jax",
implementation the op, world_size n (the axis size), the mesh, fp32; metrics: op, axis, bytes, size,
algbw/busbw, the raw loop's time per collective, bandwidths, iterations and compiled collective count, the
XLA options and environment. A size that fails (e.g. out of memory) is an error row and the run goes on.
``--report-only FILE`` draws bus bandwidth against size (one line per op, axis size and XLA options) and
prints a Markdown table (``analysis.collectives.write_collectives_report``); with ``--nccl FILE`` (records of
``torch_impl.bench.allreduce``) also each JAX bus bandwidth over PyTorch NCCL all-reduce's at the same size,
world size and device (``analysis.collectives.nccl_comparison``).

References: NCCL-tests PERFORMANCE.md (algbw / busbw); the JAX ``shard_map`` docs (collectives in SPMD
code); the TPU Scaling Book, "Sharded matrices" (collective costs over one mesh axis); JAX's "GPU performance
tips" and NVIDIA JAX-Toolbox's GPU_performance.md (XLA flags for collectives).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
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
from jax_impl.device import platform_devices
from jax_impl.distributed import initialize_from_env
from jax_impl.sharding import MESH_AXES, make_mesh
from parallelism_calc.collectives import OPS, bus_bandwidth
from parallelism_calc.units import FLOAT32_BYTES, parse_size, size_label

SUITE = "collectives"
DEFAULT_SIZES = "1MB,10MB,100MB,1GB"
RAW_CALLS = 3  # timed calls of the raw-loop program (each runs --iters collectives); the median counts
_GB = 1e9
_HLO_OPCODE = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
# --xla-options tuned. JAX's "GPU performance tips" and NVIDIA JAX-Toolbox (its image's default) turn on the
# latency hiding scheduler (collectives scheduled to overlap compute); JAX-Toolbox's FSDP tips raise the combine
# thresholds so that many small all-gathers / reduce-scatters / all-reduces go as one large one. A lone
# collective has nothing to overlap or combine, so for this benchmark they should change nothing: they are here to
# show that (and to be measured next to stock); NVLink SHARP / user-buffer options are left out (multicast).
_8GiB = 8 * 2**30
TUNED_XLA_OPTIONS: dict[str, bool | int] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_gather_combine_threshold_bytes": _8GiB,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": _8GiB,
    "xla_gpu_all_reduce_combine_threshold_bytes": _8GiB,
}
# The environment that configures XLA and NCCL, recorded with every record (it acts only before JAX starts).
_ENV_NAMES = ("XLA_FLAGS", "CUDA_DEVICE_MAX_CONNECTIONS")
_ENV_PREFIXES = ("XLA_PYTHON_CLIENT_", "NCCL_")


def _collective(op: str, axis: str) -> Callable[[jax.Array], jax.Array]:
    """The per-device body: this device's buffer -> the collective's result over ``axis``."""
    if op == "all_reduce":
        return lambda x: jax.lax.psum(x, axis)
    if op == "all_gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)


def _option_value(text: str) -> bool | int | float | str:
    """An XLA option's value from text: true/false, an integer, a float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_xla_options(spec: str) -> dict[str, bool | int | float | str]:
    """``--xla-options``: "stock" (none), "tuned" (``TUNED_XLA_OPTIONS``) and ``NAME=VALUE`` pairs, comma-separated,
    later ones winning -> XLA compile options."""
    options: dict[str, bool | int | float | str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if item in ("", "stock"):
            continue
        if item == "tuned":
            options.update(TUNED_XLA_OPTIONS)
            continue
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"xla_\w+", name.strip()) or not value.strip():
            raise ValueError(f"--xla-options: {item!r} is not stock, tuned or xla_NAME=VALUE")
        options[name.strip()] = _option_value(value.strip())
    return options


def check_xla_options(options: dict[str, Any]) -> None:
    """Compile a trivial program with ``options`` so that an unknown name or a bad value is a one-line error."""
    try:
        jax.jit(lambda v: v + 1).lower(jnp.zeros((1,), jnp.float32)).compile(compiler_options=options or None)
    except jax.errors.JaxRuntimeError as err:
        raise ValueError(f"--xla-options: {str(err).splitlines()[0]}") from None


def xla_environment() -> dict[str, str]:
    """The environment variables that configure XLA and NCCL in this process (see ``_ENV_NAMES``)."""
    return {name: value for name, value in sorted(os.environ.items())
            if name in _ENV_NAMES or name.startswith(_ENV_PREFIXES)}


def count_collectives(hlo_text: str, op: str) -> int:
    """How many ``op`` instructions a compiled HLO module holds (synchronous, or the start of an asynchronous
    pair; an op wrapped in a generic async computation counts once, in its computation)."""
    return len(re.findall(rf"\s{_HLO_OPCODE[op]}(?:-start)?\(", hlo_text))


def bandwidths(op: str, nbytes: int, n: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of ``op`` on a buffer of ``nbytes`` (nccl-tests' S) over ``n`` devices in ``seconds``:
    the one formula of both the measured op and the raw loop."""
    return nbytes / seconds / _GB, bus_bandwidth(op, nbytes, n, seconds) / _GB


def input_elements(op: str, nbytes: int, n: int) -> int:
    """Elements of each device's input buffer for a collective of size ``nbytes`` (nccl-tests' S)."""
    elements = nbytes // FLOAT32_BYTES
    if elements % n:
        raise ValueError(f"size {size_label(nbytes)} is not divisible into {n} float32 chunks")
    return elements // n if op == "all_gather" else elements


@dataclass
class Programs:
    """The compiled programs of one (op, size) and what they run on."""

    run: Callable[[jax.Array], jax.Array]  # the measured op: x -> the collective's result
    raw: Callable[[jax.Array, jax.Array], jax.Array]  # the raw loop: (x, zero) -> the last of `iters` chained results
    x: jax.Array  # (mesh.size * per-device elements,), sharded over every mesh axis
    zero: jax.Array  # 0.0, replicated: the raw loop's runtime zero
    check: Callable[[jax.Array, str], str | None]  # (a result, what made it) -> an error message or None
    op: str
    iters: int  # collectives in the raw loop
    raw_collectives: int  # collectives of the op in the compiled raw loop (fewer than iters: an error)


def raw_loop_body(collective: Callable[[jax.Array], jax.Array], iters: int) -> Callable:
    """(x, zero) -> the result of ``iters`` collectives run back to back, each on the previous input with element 0
    set to x[0] + zero x the previous result's element 0: a data dependence XLA cannot remove (``zero`` is only
    known at run time), so it neither merges nor reorders them; the values are those of one collective on ``x``.
    Element 0 is *set* from the first input rather than added to, so that nothing in the update reads the buffer
    it writes: XLA's GPU emitter then writes the one element in place (its in-place test refuses a fusion that
    also slices that buffer, as ``.at[0].add`` would, which would then rewrite the whole buffer per collective)."""

    def chain(x, zero):
        first = x[0]  # (), read once from the program's input
        y = collective(x)
        for _ in range(iters - 1):
            x = x.at[0].set(first + zero * y[0])
            y = collective(x)
        return y

    return chain


def build(mesh: Mesh, axis: str, op: str, nbytes: int, iters: int = 1,
          xla_options: dict[str, Any] | None = None) -> Programs:
    """The measured op and the raw loop of ``iters`` collectives for one (op, size), compiled with ``xla_options``,
    their input and a check of their results."""
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
    zero = jax.device_put(jnp.zeros((), jnp.float32), NamedSharding(mesh, P()))
    options = xla_options or None
    collective = _collective(op, axis)
    run = jax.jit(shard_map(collective), out_shardings=sharding).lower(x).compile(compiler_options=options)
    raw_program = jax.jit(jax.shard_map(raw_loop_body(collective, iters), mesh=mesh, in_specs=(every_axis, P()),
                                        out_specs=every_axis), out_shardings=sharding)
    raw = raw_program.lower(x, zero).compile(compiler_options=options)

    def check(result: jax.Array, what: str = op) -> str | None:
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
                return f"{what} over {axis!r} gave a wrong result on {shard.device}"
        return None

    return Programs(run, raw, x, zero, check, op, iters, count_collectives(raw.as_text(), op))


def _timed_ms(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(call())
    return (time.perf_counter() - start) * 1e3


def measure(programs: Programs, warmup: int, iters: int) -> dict[str, Any]:
    """The measured op (first call checked, ``warmup`` untimed calls, ``iters`` timed calls), then the raw loop
    (first call checked, ``RAW_CALLS`` timed calls of its ``programs.iters`` collectives)."""
    run, raw, x, zero, op = programs.run, programs.raw, programs.x, programs.zero, programs.op
    error = programs.check(jax.block_until_ready(run(x)), op)
    for _ in range(warmup):
        jax.block_until_ready(run(x))
    times = [_timed_ms(lambda: run(x)) for _ in range(iters)]
    if programs.raw_collectives < programs.iters:  # more is harmless (a backend may split one into several)
        error = error or (f"the compiled raw loop holds {programs.raw_collectives} {op} ops, fewer than "
                          f"{programs.iters}: XLA merged or dropped some")
    error = error or programs.check(jax.block_until_ready(raw(x, zero)), f"{op} raw loop")
    raw_calls = [_timed_ms(lambda: raw(x, zero)) for _ in range(RAW_CALLS)]
    return {"times_ms": times, "raw_ms": statistics.median(raw_calls) / programs.iters, "raw_calls_ms": raw_calls,
            "raw_iters": programs.iters, "raw_collectives": programs.raw_collectives, "error": error}


def make_record(op: str, axis: str, mesh: Mesh, nbytes: int, measured: dict[str, Any], args,
                xla_options: dict[str, Any] | None = None) -> Record:
    n = mesh.shape[axis]
    common = dict(suite=SUITE, backend="jax", implementation=op, dtype="fp32", world_size=n,
                  mesh={a: int(s) for a, s in mesh.shape.items()}, warmup_steps=args.warmup, timed_steps=args.iters)
    metrics: dict[str, Any] = {"op": op, "axis": axis, "bytes": nbytes, "size": size_label(nbytes),
                               "devices": int(mesh.size), "xla": args.xla_options.strip() or "stock",
                               "xla_options": dict(xla_options or {}), "env": xla_environment()}
    if measured.get("error"):
        message = measured["error"]
        status = "oom" if "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower() else "error"
        record = Record(**common, status=status, error=message.splitlines()[0], metrics=metrics)
    else:
        algbw, busbw = bandwidths(op, nbytes, n, statistics.median(measured["times_ms"]) / 1e3)
        raw_algbw, raw_busbw = bandwidths(op, nbytes, n, measured["raw_ms"] / 1e3)
        metrics.update({
            "algbw_gbps": algbw, "busbw_gbps": busbw, "raw_loop_ms": measured["raw_ms"],
            "raw_loop_iters": measured["raw_iters"], "raw_loop_collectives": measured["raw_collectives"],
            "raw_loop_calls_ms": measured["raw_calls_ms"], "raw_algbw_gbps": raw_algbw, "raw_busbw_gbps": raw_busbw,
            "busbw_over_raw": busbw / raw_busbw})
        record = Record(**common, timing=timing_stats(measured["times_ms"]), metrics=metrics)
    device = mesh.devices.flat[0]
    record.provenance["device_name"] = "cpu" if device.platform == "cpu" else device.device_kind
    return record


def run_all(args: argparse.Namespace) -> int:
    xla_options = parse_xla_options(args.xla_options)
    initialize_from_env()
    mesh = make_mesh(args.mesh, platform_devices(args.device))
    if args.axis not in MESH_AXES:
        raise ValueError(f"--axis {args.axis!r}; accepted: {', '.join(MESH_AXES)}")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    for op in ops:
        if op not in OPS:
            raise ValueError(f"--ops: unknown collective {op!r}; accepted: {', '.join(OPS)}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    check_xla_options(xla_options)
    writer = jax.process_index() == 0
    failures = 0
    configs = [(op, nbytes) for op in ops for nbytes in sizes]
    bar, write = progress(configs, "collectives", "config", enabled=writer)
    for op, nbytes in bar:
        try:
            programs = build(mesh, args.axis, op, nbytes, args.iters, xla_options)
            measured = measure(programs, args.warmup, args.iters)
            del programs
        except (RuntimeError, ValueError) as err:  # out of memory, indivisible size: a row, not a gap
            measured = {"error": f"{type(err).__name__}: {err}"}
        record = make_record(op, args.axis, mesh, nbytes, measured, args, xla_options)
        failures += record.status != "ok"
        if writer:
            if args.out:
                save_records(args.out, record)
            m = record.metrics
            line = (f"{op} {m['size']} over {args.axis}={mesh.shape[args.axis]} ({m['xla']}): " +
                    (f"{record.timing['median_ms']:.3f} ms, busbw {m['busbw_gbps']:.1f} GB/s "
                     f"(raw loop {m['raw_loop_ms']:.3f} ms, {m['raw_busbw_gbps']:.1f})" if record.status == "ok" else
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
    parser.add_argument("--iters", type=positive_int, default=20,
                        help="timed calls, and collectives in the raw loop's program (default 20)")
    parser.add_argument("--xla-options", default="stock", metavar="SPEC",
                        help="XLA compile options of both programs: stock (none; default), tuned (the latency hiding "
                             "scheduler and 8 GiB combine thresholds) and/or xla_NAME=VALUE, comma-separated")
    parser.add_argument("--out", metavar="JSONL", type=writable_path, help="append one record per (op, size) here")
    parser.add_argument("--json", action="store_true", help="print each record as JSON")
    parser.add_argument("--report-only", metavar="JSONL", help="only draw the plot and table of these records")
    parser.add_argument("--nccl", metavar="JSONL", help="with --report-only: torch_impl.bench.allreduce records to "
                                                        "compare bus bandwidths with")
    args = parser.parse_args(argv)
    if args.report_only:
        from analysis.collectives import nccl_comparison, write_collectives_report

        plot, table = write_collectives_report(args.report_only)
        print(f"{table}\n\nplot: {plot}")
        if args.nccl:
            print(f"\n{nccl_comparison(args.report_only, args.nccl)}")
        return 0
    if args.nccl:
        parser.error("--nccl goes with --report-only")
    parse_xla_options(args.xla_options)  # a bad spec is a one-line error before JAX starts
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
