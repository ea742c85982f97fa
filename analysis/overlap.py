"""``python -m analysis.overlap TRACE... [--steps N] [--top K] [--baseline TRACE] [--host N]``: communication beside
computation in a profiled step. How much of the collectives' time the other kernels hid, how long the GPU sat
idle, and which kernels ran slower while a collective shared the GPU with them.

Reads torch.profiler Chrome traces (``*_trace.json``, gzipped or not) or an archive of them (``ARCHIVES``: the DDP
benchmark's ``--profile`` directory, as ``scripts/gpu_distributed.sh`` packs it); kernels are the ``"cat": "kernel"`` events,
collectives those whose name holds ``nccl`` and the copies between GPUs (``"cat": "gpu_memcpy"``, ``Memcpy PtoP``:
the copy engines' communication, ``torch_impl.distributed.copy_engines``). Per trace, per step (``--steps``: how
many steps the trace holds, the benchmark's ``PROFILED_STEPS``): the span from the first kernel to the last, the time some compute kernel ran, the
time some collective ran, the time both did, and the idle time (neither). Per kernel name (the ``--top`` largest
by total time): launches and median duration alone and beside a collective (overlapping one in time) and their
ratio; with ``--baseline TRACE`` (a run without communication, e.g. the one-GPU ``none`` trace) the ratio is to
that run's median of the kernel instead. With ``--host N``, the host's side too: the N host ops (``cpu_op`` and
``user_annotation`` events, the profiler's own step markers left out) with the most time per step, each counted
inclusively (a caller's time holds its callees'), and their calls per step. A collective's kernel counts from its
launch, so one waiting for a late peer counts as running: it holds its SMs all the same. Never imports torch.
Reference: the trace format of ``torch.profiler``'s ``export_chrome_trace``.
"""

from __future__ import annotations

import bisect
import gzip
import json
import statistics
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from parallelism_calc.cli import ArgumentParser, error_boundary, positive_int

GZIP_MAGIC = b"\x1f\x8b"
PEER_COPY = "Memcpy PtoP"  # the profiler's name for a copy between GPUs (copy engines, not SMs)
Interval = tuple[float, float]  # (start us, end us)

# The archives of traces read (tarfile detects the compression): the device scripts pack profiles as .tar.xz
# (Chrome traces come out a third smaller than gzipped); older ones are .tgz
ARCHIVES = (".tar.xz", ".tgz", ".tar.gz")


def is_collective(name: str) -> bool:
    return "nccl" in name.lower() or name.startswith(PEER_COPY)


@dataclass(frozen=True)
class KernelTimes:
    """One kernel name's durations (us), apart from any collective and beside one."""

    name: str
    alone_us: tuple[float, ...]
    beside_us: tuple[float, ...]
    baseline_us: float | None = None  # the kernel's median in a run without communication, if one was given

    @property
    def total_ms(self) -> float:
        return (sum(self.alone_us) + sum(self.beside_us)) / 1e3

    @property
    def slowdown(self) -> float | None:
        """Median beside a collective / the baseline's median, or this trace's median alone (None without
        both)."""
        reference = self.baseline_us or (statistics.median(self.alone_us) if self.alone_us else None)
        if not self.beside_us or not reference:
            return None
        return statistics.median(self.beside_us) / reference


@dataclass(frozen=True)
class Overlap:
    """A trace's step, in ms per step (``steps`` steps in the trace)."""

    trace: str
    steps: int
    span_ms: float
    compute_ms: float  # some compute kernel running
    comm_ms: float  # some collective running
    both_ms: float  # both at once: communication hidden under (and slowing) computation
    idle_ms: float  # neither
    kernels: tuple[KernelTimes, ...]  # compute kernels, largest total first
    host_ops: tuple[tuple[str, float, float], ...] = ()  # (host op, ms per step, calls per step), largest first


def merged(intervals: list[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the intersection of two disjoint sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _touches(interval: Interval, disjoint: list[Interval], starts: list[float]) -> bool:
    """Whether ``interval`` overlaps any of the disjoint sorted intervals (``starts``: their starts)."""
    k = bisect.bisect_left(starts, interval[1])  # the intervals starting before this one ends
    return k > 0 and disjoint[k - 1][1] > interval[0]


def _kernels(events: list[dict], name: str) -> list[tuple[str, float, float]]:
    """``(kernel name, start us, end us)`` of a trace's kernel events and copies between GPUs."""
    kernels = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
               if e.get("ph") == "X" and (e.get("cat") == "kernel" or e.get("cat") == "gpu_memcpy"
                                          and e.get("name", "").startswith(PEER_COPY))]
    if not kernels:
        raise ValueError(f"{name}: no kernel events (was the trace recorded with CUDA activity?)")
    return kernels


def medians(events: list[dict], name: str) -> dict[str, float]:
    """Each kernel name's median duration (us) in a trace: the baseline of ``analyze``."""
    durations: dict[str, list[float]] = {}
    for n, s, e in _kernels(events, name):
        durations.setdefault(n, []).append(e - s)
    return {n: statistics.median(d) for n, d in durations.items()}


HOST_CATEGORIES = ("cpu_op", "user_annotation")  # torch.profiler's host events: ATen ops, record_function ranges


def host_ops(events: list[dict], steps: int, top: int) -> tuple[tuple[str, float, float], ...]:
    """The ``top`` host ops by inclusive time: ``(name, ms per step, calls per step)``, largest first."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES and not e["name"].startswith("ProfilerStep#"):
            total = totals.setdefault(e["name"], [0.0, 0])
            total[0] += float(e["dur"])
            total[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return tuple((n, us / 1e3 / steps, calls / steps) for n, (us, calls) in ranked)


def analyze(events: list[dict], name: str, steps: int, top: int = 12,
            baseline: dict[str, float] | None = None, host: int = 0) -> Overlap:
    """``Overlap`` of a trace's events (its ``traceEvents``); ``baseline``: ``medians`` of a run without
    communication, for the kernels' ratios; ``host``: how many host ops to list (``host_ops``)."""
    kernels = _kernels(events, name)
    comm = merged([(s, e) for n, s, e in kernels if is_collective(n)])
    compute = merged([(s, e) for n, s, e in kernels if not is_collective(n)])
    starts = [a for a, _ in comm]
    by_name: dict[str, tuple[list[float], list[float]]] = {}
    for n, s, e in kernels:
        if not is_collective(n):
            alone, beside = by_name.setdefault(n, ([], []))
            (beside if _touches((s, e), comm, starts) else alone).append(e - s)
    times = sorted((KernelTimes(n, tuple(a), tuple(b), (baseline or {}).get(n)) for n, (a, b) in by_name.items()),
                   key=lambda k: -k.total_ms)
    span = max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)
    busy = length(merged(comm + compute))
    per_step = 1e3 * steps  # us in a trace -> ms per step
    return Overlap(name, steps, span / per_step, length(compute) / per_step, length(comm) / per_step,
                   intersection(compute, comm) / per_step, (span - busy) / per_step, tuple(times[:top]),
                   host_ops(events, steps, host) if host else ())


# The DDP benchmark's --profile: each rank's ``step_split`` in its record, rank by rank (read by analysis.fidelity)
RANK_PROFILES = "per_rank_profile_ms"
SPLIT_KEYS = ("span_ms", "compute_ms", "comm_ms", "both_ms", "idle_ms")  # a ``step_split``'s, ms a step


def step_split(path: str | Path, steps: int) -> dict[str, float] | None:
    """A trace's step as ``analyze`` splits it, ms a step: {key: ms} for ``SPLIT_KEYS``; None where the trace has
    no kernels (a CPU run)."""
    name, events = next(traces(path))
    try:
        o = analyze(events, name, steps)
    except ValueError:  # no kernel events
        return None
    return {key: getattr(o, key) for key in SPLIT_KEYS}


def traces(path: str | Path) -> Iterator[tuple[str, list[dict]]]:
    """``(name, traceEvents)`` of a trace file, or of every ``*_trace.json[.gz]`` in an archive (``ARCHIVES``), by
    name."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    if path.name.endswith(ARCHIVES):
        with tarfile.open(path) as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and
                              m.name.endswith(("_trace.json", "_trace.json.gz"))), key=lambda m: m.name)
            if not members:
                raise ValueError(f"{path}: no *_trace.json in the archive")
            for member in members:
                yield Path(member.name).name, _events(tar.extractfile(member).read(), member.name)
        return
    yield path.name, _events(path.read_bytes(), str(path))


def _events(data: bytes, name: str) -> list[dict]:
    if data[:2] == GZIP_MAGIC:
        data = gzip.decompress(data)
    try:
        return json.loads(data)["traceEvents"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{name}: not a Chrome trace (a JSON object with traceEvents)") from None


def markdown(results: list[Overlap]) -> str:
    """The per-trace table, then each trace's largest kernels alone and beside a collective."""
    lines = ["| trace | span | compute | collectives | both | idle |", "|:--|--:|--:|--:|--:|--:|"]
    lines += [f"| {r.trace} | {r.span_ms:.1f} | {r.compute_ms:.1f} | {r.comm_ms:.1f} | {r.both_ms:.1f} | "
              f"{r.idle_ms:.1f} |" for r in results]
    lines[0] = lines[0].replace("| span", "| span (ms per step)")
    for r in results:
        with_baseline = any(k.baseline_us for k in r.kernels)
        lines += ["", f"{r.trace}: the largest compute kernels, alone and beside a collective", "",
                  "| kernel | ms / step | n alone | median us alone | n beside | median us beside |"
                  + (" baseline us |" if with_baseline else "") + " ratio |",
                  "|:--|--:|--:|--:|--:|--:|--:|" + ("--:|" if with_baseline else "")]
        for k in r.kernels:
            med = [f"{statistics.median(x):.1f}" if x else "-" for x in (k.alone_us, k.beside_us)]
            base = (f" {k.baseline_us:.1f} |" if k.baseline_us else " - |") if with_baseline else ""
            ratio = f"{k.slowdown:.2f}" if k.slowdown else "-"
            lines.append(f"| `{k.name[:60]}` | {k.total_ms / r.steps:.2f} | {len(k.alone_us)} | {med[0]} | "
                         f"{len(k.beside_us)} | {med[1]} |{base} {ratio} |")
        if r.host_ops:
            lines += ["", f"{r.trace}: host ops by time (inclusive)", "", "| host op | ms / step | calls / step |",
                      "|:--|--:|--:|"]
            lines += [f"| `{n[:70]}` | {ms:.2f} | {calls:g} |" for n, ms, calls in r.host_ops]
    return "\n".join(lines)


@error_boundary(prog="python -m analysis.overlap")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m analysis.overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+",
                        help="torch.profiler Chrome traces (*_trace.json[.gz]) or archives of them (.tar.xz, .tgz)")
    parser.add_argument("--steps", type=positive_int, default=2, help="steps each trace holds (default 2)")
    parser.add_argument("--top", type=positive_int, default=12, help="kernels listed per trace (default 12)")
    parser.add_argument("--baseline", metavar="TRACE",
                        help="a trace without communication: the kernels' ratios are to its medians; a file, a name "
                             "inside an archive given (none_rank0_trace.json), or ARCHIVE.tar.xz:NAME")
    parser.add_argument("--host", type=int, default=0, metavar="N",
                        help="also list the N host ops with the most time per step (default 0: none)")
    args = parser.parse_args(argv)
    try:
        loaded = [(name, events) for path in args.traces for name, events in traces(path)]
        baseline = None
        if args.baseline:
            archived = any(f"{suffix}:" in args.baseline for suffix in ARCHIVES)
            archive, _, member = args.baseline.rpartition(":") if archived else ("", "", "")
            pool = [*traces(archive)] if archive else loaded
            found = [events for name, events in pool if name == (member or args.baseline)]
            if not found and not archive:
                found = [events for _, events in traces(args.baseline)][:1]
            if not found:
                raise ValueError(f"--baseline {args.baseline}: no such trace in {archive}")
            baseline = medians(found[0], args.baseline)
        if args.host < 0:
            raise ValueError(f"--host {args.host}: how many host ops to list, 0 or more")
        results = [analyze(events, name, args.steps, args.top, baseline, args.host) for name, events in loaded]
    except ValueError as err:
        parser.error(str(err))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
