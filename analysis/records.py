"""The one schema for every measured result: a typed ``Record``, appended to and read from JSON Lines.

Stdlib only, so benchmarks in either backend import it without pulling in pandas. Each benchmark writes one
record per measured configuration, as soon as it exists (``save_records``: if ``--out`` cannot be written the
record is printed on stdout, never lost); a failed configuration is a record too (``status`` one of
``STATUSES``: 'diverged', 'oom' or 'error', with its message), never a silent gap. Provenance (git commit,
device, library versions, date, command) is filled in automatically when a record is made. Reading checks
each record against the schema (field names and types, ``schema_version``) and names the file and line of
one that does not fit.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

SCHEMA_VERSION = 1
# How a measurement ended: "ok"; "diverged" (it ran, but a loss was not finite: its numbers mean nothing);
# "oom" (out of memory); "error" (anything else that stopped it). Every status but "ok" carries a message.
Status = Literal["ok", "diverged", "oom", "error"]
STATUSES: tuple[str, ...] = typing.get_args(Status)
# The attention benchmark's providers (records' implementation) in display order; torch-free, for it and its report.
ATTENTION_PROVIDERS = ("flash_triton", "flash_torch", "naive", "naive_compiled", "sdpa_flash", "sdpa_cudnn",
                       "sdpa_efficient", "flex")  # fmt: skip
# The phases of a training step, in every suite's records (torch_impl.step.train_step marks them): forward (with
# the loss), backward, comm (the data-parallel wrapper's wait for its gradient synchronization), optimizer. A suite
# may add its own around the step (the trainer's "data"). Older records' names are read as these (LEGACY_PHASES).
STEP_PHASES = ("forward", "backward", "comm", "optimizer")
TRAIN_PHASES = ("data", *STEP_PHASES)  # the trainer's: the windows to the device, then the step's
LEGACY_PHASES = {"comm_blocked": "comm"}  # the DDP benchmark's name before the step loop was shared
_LIBRARIES = ("torch", "triton", "jax", "jaxlib", "flax", "optax", "numpy")
_REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def library_versions() -> dict[str, str]:
    """Versions of the installed numeric libraries; imported modules win over package metadata (the GPU
    image runs from the source tree, so its versions come from the modules themselves)."""
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module else None
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        versions[name] = str(version)
    return versions


# Environment variables that choose what code runs (our kernels' switches, Triton's, Inductor's, XLA's, NCCL's) or
# how a process runs it (its CPU threads, the GPUs it sees): a record keeps the ones set (``provenance``'
# "settings"), since the same command measures different code with them.
SETTINGS_PREFIXES = ("FLASH_", "TRITON_", "TORCHINDUCTOR_", "XLA_", "NCCL_", "TORCH_BLAS_", "CUBLAS", "OMP_NUM_THREADS",
                     "CUDA_VISIBLE_DEVICES")


@functools.cache
def host_cpu() -> str:
    """The host's CPU model and logical CPU count (``/proc/cpuinfo``; the platform's processor elsewhere): a
    host-bound measurement (a short kernel behind Python) depends on it."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or 'unknown'} x {os.cpu_count()}"


def provenance(device_name: str = "cpu") -> dict[str, Any]:
    """Where and when a measurement was made, with what code and libraries, and the environment variables of
    SETTINGS_PREFIXES that were set.

    The commit comes from git, or from ``$RESULTS_GIT_COMMIT`` where the tree was copied without its history
    (the GPU machines); whether the tree differed from it is then unknown (None).
    """
    commit = os.environ.get("RESULTS_GIT_COMMIT") or _git("rev-parse", "HEAD")
    status = None if os.environ.get("RESULTS_GIT_COMMIT") else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None and commit else None,
        "device_name": device_name,
        "hostname": platform.node(),
        "cpu": host_cpu(),
        "platform": platform.platform(),
        "versions": library_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
        "settings": {name: value for name, value in sorted(os.environ.items()) if name.startswith(SETTINGS_PREFIXES)},
    }


def timing_stats(times_ms: Iterable[float]) -> dict[str, float]:
    """Median, mean, standard deviation, min and max of per-step times in milliseconds."""
    times = list(times_ms)
    if not times:
        raise ValueError("timing_stats needs at least one time")
    return {
        "median_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "std_ms": statistics.stdev(times) if len(times) > 1 else 0.0,
        "min_ms": min(times),
        "max_ms": max(times),
    }


@dataclass
class Record:
    """One measured configuration. Times are per step in milliseconds; FLOPs come from parallelism_calc."""

    suite: str  # which benchmark wrote it, e.g. "e2e", "attention", "allreduce"
    backend: Literal["torch", "jax"]
    implementation: str  # what was measured within the backend, e.g. "sdpa", "flax-nnx naive"
    model: str | None = None  # ModelSpec preset name
    model_dims: dict[str, Any] | None = None  # dataclasses.asdict(ModelSpec)
    batch_size: int | None = None
    seq_len: int | None = None
    dtype: str | None = None  # "fp32", "bf16", "bf16-autocast", ...
    mode: str | None = None  # "forward", "forward_backward", "train_step", ...
    world_size: int = 1
    mesh: dict[str, int] | None = None  # e.g. {"dp": 1, "fsdp": 4, "tp": 2}
    warmup_steps: int | None = None
    timed_steps: int | None = None
    timing: dict[str, float] | None = None  # timing_stats() of the whole step
    phases: dict[str, dict[str, float]] | None = None  # timing_stats() per phase (forward, backward, ...)
    tokens_per_s: float | None = None
    flops_per_step: float | None = None
    tflops: float | None = None  # achieved, per device
    mfu: float | None = None  # achieved / peak dense FLOP/s of the device's HardwareSpec
    peak_memory_bytes: int | None = None  # per device (worst device where several)
    status: Status = "ok"
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # suite-specific numbers (losses, bandwidths, ...)
    provenance: dict[str, Any] = field(default_factory=provenance)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.backend not in ("torch", "jax"):
            raise ValueError(f"Record.backend={self.backend!r}; accepted: 'torch', 'jax'")
        if self.status not in STATUSES:
            raise ValueError(f"Record.status={self.status!r}; accepted: {', '.join(map(repr, STATUSES))}")
        if self.status != "ok" and not self.error:
            raise ValueError(f"a record with status {self.status!r} needs an error message")

    @property
    def median_ms(self) -> float | None:
        return self.timing["median_ms"] if self.timing else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Record":
        """The record a ``to_dict()`` made; a ValueError names what does not fit the schema: an unknown or
        missing field, a value of the wrong type, a ``schema_version`` newer than this code reads."""
        if not isinstance(data, dict):
            raise ValueError(f"a record is a JSON object, not {type(data).__name__}")
        unknown = set(data) - set(_FIELD_TYPES)
        if unknown:
            raise ValueError(f"record has unknown fields {sorted(unknown)}; accepted: {sorted(_FIELD_TYPES)}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"record lacks the fields {missing}")
        version = data.get("schema_version", SCHEMA_VERSION)
        if type(version) is not int or not 1 <= version <= SCHEMA_VERSION:
            raise ValueError(f"schema_version {version!r}: this code reads versions 1 to {SCHEMA_VERSION} (a newer "
                             "writer's records need newer code)")
        for name, value in data.items():
            accepted = _FIELD_TYPES[name]
            if not _is_a(value, accepted):
                raise ValueError(f"field {name!r} is {type(value).__name__} {_short(value)}; accepted: "
                                 f"{' or '.join(t.__name__ for t in accepted)}")
        if data.get("phases"):
            data = {**data, "phases": {LEGACY_PHASES.get(p, p): stats for p, stats in data["phases"].items()}}
        return cls(**data)


def _field_types() -> dict[str, tuple[type, ...]]:
    """Each field's accepted JSON types, from ``Record``'s annotations (``X | None``, ``dict[...]``,
    ``Literal[...]`` of strings)."""
    types = {}
    for name, hint in typing.get_type_hints(Record).items():
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types_union) else (hint,)
        accepted = []
        for option in options:
            origin = typing.get_origin(option)
            if origin is Literal:
                accepted.append(str)
            elif option is Any:
                accepted.append(object)
            else:
                accepted.append(origin or option)
        types[name] = tuple(dict.fromkeys(accepted))
    return types


def _is_a(value: Any, accepted: tuple[type, ...]) -> bool:
    """JSON's view of ``isinstance``: a bool is no number; an int is a float too."""
    if value is None:
        return type(None) in accepted
    if isinstance(value, bool):
        return bool in accepted or object in accepted
    if isinstance(value, int) and float in accepted:
        return True
    return isinstance(value, accepted)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


types_union = type(int | None)
_FIELD_TYPES = _field_types()


def _truncated(line: bytes) -> bool:
    """A line a writer did not finish (killed mid-line, a full disk): no newline at its end, and not JSON."""
    if line.endswith(b"\n"):
        return False
    try:
        json.loads(line)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return True
    return False


def _set_aside_truncated_tail(path: Path) -> None:
    """Before appending: move a truncated last line into ``<name>.corrupt`` (appended there) and cut it off the
    file, saying so in one line on stderr, so that the next record starts a line of its own and the file stays
    readable; a last line that is whole JSON but lacks its newline only gets the newline."""
    if not path.exists():
        return
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        start = data.rfind(b"\n") + 1
        number = data.count(b"\n") + 1
        tail = data[start:]
        if not _truncated(tail):
            f.write(b"\n")
            return
        corrupt = path.with_name(path.name + ".corrupt")
        with corrupt.open("ab") as c:  # kept before it is cut off: a kill in between loses nothing
            c.write(tail + b"\n")
            c.flush()
            os.fsync(c.fileno())
        f.truncate(start)
        f.flush()
        os.fsync(f.fileno())
    print(f"{path}:{number}: a truncated last line ({len(tail)} bytes) moved to {corrupt}",
          file=sys.stderr, flush=True)


def append_records(path: str | os.PathLike, records: Record | Iterable[Record]) -> Path:
    """Append records to a JSON Lines file (created with its folder if missing); returns the path.

    A truncated last line left by an earlier writer is moved out first (``_set_aside_truncated_tail``). The
    records go in one write, flushed to disk, so a writer killed here leaves at most one truncated last line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = [records] if isinstance(records, Record) else list(records)
    _set_aside_truncated_tail(path)
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(record.to_dict(), sort_keys=True) + "\n" for record in batch))
        f.flush()
        os.fsync(f.fileno())
    return path


class RecordsNotWritten(OSError):
    """``--out`` could not be written; the records were printed on stdout instead (``save_records``)."""


def save_records(path: str | os.PathLike, records: Record | Iterable[Record]) -> Path:
    """Append records to ``path`` as ``append_records`` does; where the file cannot be written (a read-only
    folder, a full disk, a file where a folder should be), print each record as one JSON line on stdout, so
    the measurement is not lost, and raise ``RecordsNotWritten`` naming the path (the CLIs' error boundary,
    ``parallelism_calc.cli.run_cli``, turns it into one line on stderr and exit status 2). Benchmarks call it
    as soon as each record exists."""
    batch = [records] if isinstance(records, Record) else list(records)
    try:
        return append_records(path, batch)
    except OSError as err:
        sys.stderr.flush()
        for record in batch:
            print(json.dumps(record.to_dict(), sort_keys=True), flush=True)
        reason = err.strerror or str(err)
        raise RecordsNotWritten(f"cannot write records to {path} ({reason}): the {len(batch)} record(s) are "
                                "printed on stdout above") from err


def divergence(losses: Iterable[float]) -> str | None:
    """Why a run's losses mean nothing (its record's status is then "diverged"), or None: the first loss
    that is not finite (NaN or infinite), named with its 1-based position."""
    for i, loss in enumerate(losses, 1):
        if loss is None or not math.isfinite(loss):
            return f"loss {loss} at step {i}: not finite (the run diverged)"
    return None


def read_records(path: str | os.PathLike) -> list[Record]:
    """Every record of a JSON Lines file; a malformed line is an error naming the file and line, except a
    truncated last line (a writer stopped mid-line), which is skipped with a warning naming them."""
    records = []
    with Path(path).open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if _truncated(line):  # only the last line can lack its newline
                warnings.warn(f"{path}:{number}: skipped a truncated last line ({len(line)} bytes)", stacklevel=2)
                continue
            try:
                records.append(Record.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError, ValueError) as err:
                raise ValueError(f"{path}:{number}: not a valid record: {err}") from None
    return records
