"""``python -m analysis.snapshot FILE [--top N]``: the largest allocations at the peak of a CUDA memory snapshot.

Reads what ``torch.cuda.memory._dump_snapshot`` writes (a pickle, gzipped or not) after
``torch.cuda.memory._record_memory_history``, without torch: ``segments`` (the allocator's state at the dump) and
``device_traces`` (per device, the recorded ``alloc`` / ``free_requested`` / ``free_completed`` / ``segment_*``
events, each with ``addr``, ``size``, ``time_us`` and its Python ``frames``, innermost first). Replays one
device's trace and reports the peak of the allocated bytes (an allocation counts from ``alloc`` to
``free_completed``, its requested size rounded up to 512-byte blocks, as ``torch.cuda.max_memory_allocated``
counts it) and the allocations live there, grouped by size and origin (the innermost frame of this repository's
code; recorded without Python frames: made on a C++ thread, as the autograd engine's backward allocates).
Allocations made before recording began count as live from the start: those still held at the dump (the
snapshot's active blocks the trace never allocated) and those the trace frees without having allocated them.
Reads data only: a pickle naming any class or function (code to run on loading) is refused. Format and recording:
https://pytorch.org/docs/stable/torch_cuda_memory.html
"""

from __future__ import annotations

import gzip
import io
import pickle
import sys
import zlib
from dataclasses import dataclass
from itertools import islice
from pathlib import Path, PurePosixPath
from typing import Iterator

from parallelism_calc.cli import ArgumentParser, error_boundary, nonnegative_int, positive_int

GZIP_MAGIC = b"\x1f\x8b"
REPO_PACKAGES = ("torch_impl", "analysis", "parallelism_calc")  # the package folders of this repository
BEFORE_RECORDING = "allocated before recording"
# a recorded allocation without Python frames: made on a C++ thread (the autograd engine's backward, a collective's)
WITHOUT_PYTHON = "no Python frame (a C++ thread: the autograd engine's backward, ...)"
LIVE_STATES = ("active_allocated", "active_pending_free")  # blocks still counted as allocated at the dump
INSTALLED = ("site-packages", "dist-packages")
BLOCK = 512  # the allocator's granularity (kMinBlockSize): the trace records requested sizes, the stats blocks
MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class Allocation:
    """``count`` live allocations of ``size_bytes`` each, made at ``origin`` (``torch_impl/model.py:60 (forward)``)."""

    size_bytes: int
    origin: str
    count: int


@dataclass(frozen=True)
class SnapshotPeak:
    """The peak of the allocated bytes (pre-existing blocks included), when it was first reached (the trace's
    ``time_us``; None without a trace) and the largest groups of allocations live then."""

    peak_bytes: int
    time_us: int | None
    largest: tuple[Allocation, ...]


class _DataOnly(pickle.Unpickler):
    """A snapshot is plain dicts, lists, strings and numbers: refuse any class or function a pickle names."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"names {module}.{name}, a memory snapshot names no classes")


def load_snapshot(path: str | Path) -> dict:
    """The snapshot at ``path`` (gzipped or not, told by the magic bytes); a ValueError if it is not one.
    See https://pytorch.org/docs/stable/torch_cuda_memory.html for how to record one."""
    data = Path(path).read_bytes()
    try:
        if data[:2] == GZIP_MAGIC:
            data = gzip.decompress(data)
        snapshot = _DataOnly(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, gzip.BadGzipFile, zlib.error, ValueError, TypeError, KeyError,
            IndexError, AttributeError, OverflowError, RecursionError) as err:
        raise ValueError(f"{path}: not a CUDA memory snapshot (a pickle from torch.cuda.memory._dump_snapshot): "
                         f"{type(err).__name__}: {err}") from None
    if not (isinstance(snapshot, dict) and isinstance(snapshot.get("segments"), list)
            and isinstance(snapshot.get("device_traces"), list)):
        raise ValueError(f"{path}: not a CUDA memory snapshot: expected a dict with 'segments' and "
                         "'device_traces' lists")
    return snapshot


def _parts(filename: str) -> tuple[str, ...]:
    return PurePosixPath(filename.replace("\\", "/")).parts


def _is_torch(filename: str) -> bool:
    """In torch's own files: ``site-packages/torch/...``, or a ``torch`` folder outside any site-packages."""
    parts = _parts(filename)[:-1]
    installed = [i for i, p in enumerate(parts) if p in INSTALLED]
    return "torch" in (parts[installed[-1] + 1:installed[-1] + 2] if installed else parts)


def _is_repo(filename: str) -> bool:
    return any(p in REPO_PACKAGES for p in _parts(filename)[:-1]) and not _is_torch(filename)


def _short(filename: str) -> str:
    """From the package folder on: the innermost repository package, else what follows site-packages."""
    parts = _parts(filename)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in REPO_PACKAGES or parts[i] in INSTALLED:
            return "/".join(parts[i + (parts[i] not in REPO_PACKAGES):])
    return filename


def origin(frames: list[dict], no_frames: str = BEFORE_RECORDING) -> str:
    """Where an allocation was made: the innermost frame of this repository's code, else the innermost frame
    outside torch's own files, as ``torch_impl/model.py:60 (forward)``; ``no_frames`` without any (a block older
    than the recording: ``BEFORE_RECORDING``; a recorded one: ``WITHOUT_PYTHON``)."""
    frames = [f for f in frames or () if isinstance(f, dict) and f.get("filename")]
    if not frames:
        return no_frames
    frame = (next((f for f in frames if _is_repo(f["filename"])), None)
             or next((f for f in frames if not _is_torch(f["filename"])), frames[0]))
    return f"{_short(frame['filename'])}:{frame.get('line', '?')} ({frame.get('name', '?')})"


def _rounded(size: int) -> int:
    """The bytes the allocator counts for a request of ``size`` (a whole number of 512-byte blocks)."""
    return max(BLOCK, -(-size // BLOCK) * BLOCK)


def _trace(snapshot: dict, device: int) -> list[dict]:
    """``device``'s allocations and frees (``free_completed``: when the allocator stops counting the block)."""
    traces = snapshot["device_traces"]
    if not 0 <= device < max(len(traces), 1):
        raise ValueError(f"device {device}: the snapshot has traces for devices 0 to {len(traces) - 1}")
    trace = traces[device] if traces else []
    if not isinstance(trace, list) or not all(isinstance(e, dict) for e in trace):
        raise ValueError(f"device {device}: the trace is not a list of events")
    trace = [e for e in trace if e.get("action") in ("alloc", "free_completed")]
    if not all(isinstance(e.get("addr"), int) and isinstance(e.get("size"), int) for e in trace):
        raise ValueError(f"device {device}: an alloc or free_completed event without an integer addr and size")
    return trace


def _preexisting(snapshot: dict, trace: list[dict], device: int) -> dict[int, tuple[int, str]]:
    """address -> (bytes, origin) of the allocations live when recording began: freed by the trace without being
    allocated in it, or held at the dump (the snapshot's active blocks) without being allocated in it."""
    before, live = {}, set()
    for e in trace:
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["addr"] in live:
            live.discard(e["addr"])
        else:
            before[e["addr"]] = (_rounded(e["size"]), BEFORE_RECORDING)
    for segment in snapshot["segments"]:
        if not isinstance(segment, dict) or segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", ()):
            if isinstance(block, dict) and block.get("state") in LIVE_STATES and block.get("address") not in live:
                if not isinstance(block.get("address"), int) or not isinstance(block.get("size"), int):
                    raise ValueError("a segment's active block without an integer address and size")
                before[block["address"]] = (block["size"], origin(block.get("frames", [])))
    return before


def _replay(trace: list[dict], live: dict[int, tuple[int, str]]) -> Iterator[int]:
    """Applies each event to ``live`` (address -> (bytes, origin)) in turn; yields the change in live bytes."""
    for e in trace:
        if e["action"] == "alloc":
            old = live.get(e["addr"], (0, ""))[0]
            live[e["addr"]] = (_rounded(e["size"]), origin(e.get("frames", []), WITHOUT_PYTHON))
            yield live[e["addr"]][0] - old
        else:
            yield -live.pop(e["addr"], (0, ""))[0]


def peak_allocations(snapshot: dict, top: int = 10, device: int = 0) -> SnapshotPeak:
    """The peak of ``device``'s allocated bytes (when first reached: the event that reached it, or the first
    event if the peak was the state before it) and its ``top`` largest (size, origin) groups of live
    allocations, by total bytes. See https://pytorch.org/docs/stable/torch_cuda_memory.html for the format."""
    trace = _trace(snapshot, device)
    live = _preexisting(snapshot, trace, device)
    total = peak = sum(size for size, _ in live.values())
    peak_at = -1  # the state before the first event
    for i, change in enumerate(_replay(trace, live)):
        total += change
        if total > peak:
            peak, peak_at = total, i
    live = _preexisting(snapshot, trace, device)  # replay again up to the peak (copying at each maximum: quadratic)
    for _ in islice(_replay(trace, live), peak_at + 1):
        pass
    groups: dict[tuple[int, str], int] = {}
    for key in live.values():
        groups[key] = groups.get(key, 0) + 1
    ranked = sorted(groups.items(), key=lambda kv: (-kv[0][0] * kv[1], -kv[0][0], kv[0][1]))
    first = snapshot["device_traces"][device] if snapshot["device_traces"] else []  # any event: the trace's start
    time_us = trace[peak_at].get("time_us") if peak_at >= 0 else first[0].get("time_us") if first else None
    return SnapshotPeak(peak, time_us, tuple(Allocation(size, where, n) for (size, where), n in ranked[:top]))


def markdown(peak: SnapshotPeak, title: str) -> str:
    """``title`` as a heading, the peak in GiB, and a table of the largest groups (size in MiB, count, origin)."""
    shown = sum(a.size_bytes * a.count for a in peak.largest)
    lines = [f"### {title}", "",
             f"Peak allocated: {peak.peak_bytes / GiB:.2f} GiB; the {len(peak.largest)} largest groups of "
             f"allocations live at the peak hold {shown / GiB:.2f} GiB of it.", "",
             "| size (MiB) | count | total (MiB) | origin |", "|---:|---:|---:|:---|"]
    lines += [f"| {a.size_bytes / MiB:,.1f} | {a.count} | {a.size_bytes * a.count / MiB:,.1f} | "
              f"`{a.origin}` |" for a in peak.largest]
    return "\n".join(lines) + "\n"


@error_boundary(prog="python -m analysis.snapshot")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m analysis.snapshot", description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a snapshot from torch.cuda.memory._dump_snapshot (.pickle[.gz])")
    parser.add_argument("--top", type=positive_int, default=10, help="how many groups to list (default 10)")
    parser.add_argument("--device", type=nonnegative_int, default=0, help="which device's trace (default 0)")
    args = parser.parse_args(argv)
    peak = peak_allocations(load_snapshot(args.file), top=args.top, device=args.device)
    print(markdown(peak, args.file.name), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
