"""The trainer once per configuration (a cell), each in its own process: what the training matrix
(``torch_impl.bench.train_matrix``) and the accumulation study (``torch_impl.bench.accum_study``) share.

``run_cell(cell, sweep, run_name)`` runs ``python -m torch_impl.train`` (``--dist none``) or
``torchrun --nproc_per_node --nproc -m torch_impl.train`` with the cell's attention and data-parallel mode and the
sweep's settings (``SweepConfig``, from the flags of ``add_cell_arguments``); the trainer appends one "train" record per epoch to ``--out``, tagged
``metrics.run`` = the run name, and the cell's summary record (``summarize``) is appended after them:

* wall time: the cell's process, start to exit, as measured here (start-up and data included);
* s/epoch and tokens/s: medians over the epochs after the first (the first holds the warm-up), over all
  epochs when there is one; samples/epoch; peak per-GPU memory: the worst rank's, the largest over epochs;
* the last epoch's train and validation losses.

A cell that fails (out of memory, a crash, a bad setting, ``--cell-timeout``) is a summary record with status
"oom" or "error" and its most telling output line as the message (``failure_line``): a row, not a gap.
The reports of both sweeps: ``analysis.training``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

from analysis.records import Record, read_records, save_records
from analysis.training import TRAIN_SUITE
from parallelism_calc.cli import positive_float, positive_int
from torch_impl.distributed.process_group import free_port

_REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Cell:
    attention: str
    dist: str

    @property
    def label(self) -> str:
        return f"{self.attention} / {self.dist}"


@dataclass(frozen=True)
class SweepConfig:
    """What every cell's trainer shares, typed: the flags of ``add_cell_arguments`` and the sweep's --out."""

    nproc: int
    model: str
    batch_size: int
    grad_accum: int
    seq_len: int
    epochs: int
    steps_per_epoch: int | None
    dtype: str
    bucket_mb: float
    device: str
    train_args: str
    cell_timeout: float
    out: str

    @classmethod
    def of(cls, args: argparse.Namespace, **changes) -> "SweepConfig":
        """From a sweep's parsed flags, with ``changes`` (e.g. one setting's batch_size and grad_accum)."""
        return cls(**{f.name: changes[f.name] if f.name in changes else getattr(args, f.name) for f in fields(cls)})


def add_cell_arguments(parser: argparse.ArgumentParser, batch: bool = True) -> None:
    """The flags every cell's trainer gets (``cell_command``); ``batch``: --batch-size and --grad-accum too."""
    a = parser.add_argument
    a("--nproc", type=positive_int, help="ranks of the data-parallel cells (default: the GPUs, else 2)")
    a("--model", default="small", help="model preset (default small)")
    if batch:
        a("--batch-size", type=positive_int, default=8, help="local batch per rank (default 8)")
        a("--grad-accum", type=positive_int, default=1, help="micro-batches per step (default 1)")
    a("--seq-len", type=positive_int, default=512, help="tokens per sequence (default 512)")
    a("--epochs", type=positive_int, default=5, help="epochs per cell (default 5)")
    a("--steps-per-epoch", type=positive_int, default=50, help="optimizer steps per epoch (default 50)")
    a("--dtype", choices=("fp32", "bf16"), default="bf16", help="default bf16 (autocast)")
    a("--bucket-mb", type=positive_float, default=25.0, help="bucket size of bucketed DDP in MiB (default 25)")
    a("--device", default="auto", help="auto, cpu or cuda (passed to the trainer)")
    a("--train-args", default="", help="further trainer flags for every cell, e.g. \"--lr 1e-3 --warmup-steps 20\"")
    a("--cell-timeout", type=positive_float, default=3600.0, help="seconds a cell may take (default 3600)")


def cell_command(cell: Cell, args: SweepConfig, run_name: str) -> list[str]:
    """The trainer's command line for one cell."""
    train = ["-m", "torch_impl.train", "--attention", cell.attention, "--dist", cell.dist, "--run-name", run_name,
             "--model", args.model, "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
             "--seq-len", str(args.seq_len), "--epochs", str(args.epochs), "--dtype", args.dtype,
             "--bucket-mb", str(args.bucket_mb), "--device", args.device, "--out", args.out, "--no-progress",
             *shlex.split(args.train_args)]
    if args.steps_per_epoch:
        train += ["--steps-per-epoch", str(args.steps_per_epoch)]
    if cell.dist == "none":
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *train]


def median_after_first(values: list[float | None]) -> float | None:
    """The median of the values after the first (the warm-up), of all when there is one; None values skipped."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarize(cell: Cell, run_name: str, epochs: list[Record], wall_s: float, failure: str | None,
              args: SweepConfig, suite: str) -> Record:
    """The cell's summary record from its epoch records (see the module docstring)."""
    ok = [r for r in epochs if r.status == "ok"]
    failed = [r for r in epochs if r.status != "ok"]
    status, error = "ok", None
    if failed:
        status, error = failed[-1].status, failed[-1].error
    elif failure is not None:
        status, error = ("oom" if "out of memory" in failure.lower() else "error"), failure
    first = ok[0] if ok else (epochs[0] if epochs else None)
    peaks = [r.peak_memory_bytes for r in ok if r.peak_memory_bytes is not None]
    last = ok[-1].metrics if ok else {}
    record = Record(
        suite=suite, backend="torch", implementation=first.implementation if first else cell.dist,
        model=first.model if first else args.model, model_dims=first.model_dims if first else None,
        batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype, mode="train",
        world_size=first.world_size if first else (1 if cell.dist == "none" else args.nproc),
        tokens_per_s=median_after_first([r.tokens_per_s for r in ok]),
        peak_memory_bytes=max(peaks) if peaks else None, status=status, error=error,
        metrics={"attention": cell.attention, "dist": cell.dist, "run": run_name, "wall_s": wall_s,
                 "epochs_done": len(ok), "epochs": args.epochs,
                 "s_per_epoch": median_after_first([r.metrics["epoch_s"] for r in ok]),
                 "samples_per_epoch": last.get("samples_per_epoch"), "train_loss": last.get("train_loss"),
                 "val_loss": last.get("val_loss"), "grad_accum": args.grad_accum},
    )
    if first is not None:
        record.provenance["device_name"] = first.provenance.get("device_name")
    return record


_ERROR_LINE = re.compile(r"(^|: )error: |^[\w.]*(Error|Exception)\b")
_RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:\s*")  # torchrun's prefix of a rank's traceback lines
_LAUNCHER_NOISE = ("ChildFailedError", "torch.distributed.elastic")


def failure_line(text: str) -> str:
    """The most telling line of a failed cell's output: the last error line of the trainer (``...: error: ...``
    or ``SomeError: ...``), skipping torchrun's own report; else the last line."""
    lines = [_RANK_PREFIX.sub("", line.strip()) for line in text.splitlines() if line.strip()]
    hits = [line for line in lines if _ERROR_LINE.search(line) and not any(n in line for n in _LAUNCHER_NOISE)]
    return hits[-1] if hits else (lines[-1] if lines else "")


def run_cell(cell: Cell, args: SweepConfig, run_name: str, suite: str,
             finish: Callable[[Record, list[Record]], Record] | None = None) -> Record:
    """Run one cell's trainer; its summary record (suite ``suite``, completed by ``finish(summary, epochs)``
    where given, then appended to --out)."""
    start = time.perf_counter()
    failure = None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cell_command(cell, args, run_name), capture_output=True, text=True, env=env,
                              timeout=args.cell_timeout)
        if proc.returncode != 0:
            failure = f"exit status {proc.returncode}: {failure_line(proc.stderr) or failure_line(proc.stdout)}"
    except subprocess.TimeoutExpired:
        failure = f"no result within --cell-timeout {args.cell_timeout:g} s"
    wall_s = time.perf_counter() - start
    out = Path(args.out)
    epochs = [r for r in read_records(out) if r.suite == TRAIN_SUITE and r.metrics.get("run") == run_name] \
        if out.exists() else []
    record = summarize(cell, run_name, epochs, wall_s, failure, args, suite)
    if finish is not None:
        record = finish(record, epochs)
    save_records(out, record)
    return record


def report_only(jsonl: str | None, report_dir: str, write: Callable[[str, str], str]) -> int | None:
    """``--report-only JSONL``: ``write(JSONL, --report-dir)``, print its table, and the exit code; None when
    not asked. A missing or record-less file is a one-line error (exit 2, at ``main``'s error boundary)."""
    if not jsonl:
        return None
    print(write(jsonl, report_dir))
    return 0
