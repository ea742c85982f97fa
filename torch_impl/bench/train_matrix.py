"""The training matrix: attention kernel x data-parallel mode, ``python -m torch_impl.bench.train_matrix``.

Every cell of ``--attention`` (default sdpa, naive, flash_triton) x ``--dist`` (default none, naive, bucketed,
torch_ddp) runs the trainer (``torch_impl.train``) in its own process: ``python -m torch_impl.train`` for
``none`` (one GPU), ``torchrun --nproc_per_node --nproc`` for the others, all with the same local batch and
steps per epoch (so a DDP cell sees ``nproc`` times more samples per epoch), ``--epochs`` epochs (default 5).
The trainer appends one "train" record per epoch to ``--out``, tagged ``metrics.run`` = the cell's run name;
after the cell this module appends one "train_matrix" summary record built from them:

* wall time: the cell's process, start to exit, as measured here (start-up and data included);
* s/epoch and tokens/s: medians over the epochs after the first (the first holds the warm-up), over all
  epochs when there is one; samples/epoch; peak per-GPU memory: the worst rank's, the largest over epochs;
* the last epoch's train and validation losses.

A cell that fails (out of memory, a crash, a bad setting, ``--cell-timeout``) is a summary record with status
"oom" or "error" and the last line of its output as the message, and the sweep goes on (a row, not a gap).

Report (``--report-dir``, also regenerated alone by ``--report-only JSONL``): from the records, for each cell
the latest summary (file order) and that run's epoch records: ``train_matrix.md`` (the table) and five PNG
charts: ``time_per_epoch.png`` (s per epoch against epoch), ``peak_memory.png``, ``throughput.png`` (tokens/s),
``samples_per_epoch.png`` (``analysis.plots.bar_plot``: bars per mode, one colour per attention kernel; a
failed cell shows its status instead of a bar) and ``loss_convergence.png`` (training and validation loss against epoch).

Caveats: on a CPU, memory is not measured (the chart says so); cells run one after another on the same
GPUs, so the numbers are comparable within one sweep; ``--train-args`` passes further flags to every cell.
References: the LM training benchmark matrix of the project's first experiment report (issue 8).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from analysis.harness import progress
from analysis.records import Record, read_records, save_records
from parallelism_calc.cli import (ArgumentParser, error_boundary, parse_list, positive_float, positive_int,
                                  writable_path)
from torch_impl.distributed.process_group import free_port
from torch_impl.parallelize import WRAPPER_MODES as DIST_MODES

SUITE = "train_matrix"
TRAIN_SUITE = "train"
ATTENTIONS = ("sdpa", "naive", "flash_triton")
DISTS = ("none", "naive", "bucketed", "torch_ddp")
CHARTS = ("time_per_epoch", "peak_memory", "throughput", "samples_per_epoch", "loss_convergence")


@dataclass(frozen=True)
class Cell:
    attention: str
    dist: str

    @property
    def label(self) -> str:
        return f"{self.attention} / {self.dist}"


def cell_command(cell: Cell, args: argparse.Namespace, run_name: str) -> list[str]:
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


# ----------------------------------------------------------------------------- summaries


def _median_after_first(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median(values[1:] if len(values) > 1 else values)


def summarize(cell: Cell, run_name: str, epochs: list[Record], wall_s: float, failure: str | None,
              args: argparse.Namespace, suite: str = SUITE) -> Record:
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
        tokens_per_s=_median_after_first([r.tokens_per_s for r in ok]),
        peak_memory_bytes=max(peaks) if peaks else None, status=status, error=error,
        metrics={"attention": cell.attention, "dist": cell.dist, "run": run_name, "wall_s": wall_s,
                 "epochs_done": len(ok), "epochs": args.epochs,
                 "s_per_epoch": _median_after_first([r.metrics["epoch_s"] for r in ok]),
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


def run_cell(cell: Cell, args: argparse.Namespace, run_name: str, suite: str = SUITE,
             finish: Callable[[Record, list[Record]], Record] | None = None) -> Record:
    """Run one cell's trainer; its summary record (suite ``suite``, completed by ``finish(summary, epochs)``
    where given, then appended to --out)."""
    start = time.perf_counter()
    failure = None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                     os.environ.get("PYTHONPATH")]))}
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


def run_matrix(args: argparse.Namespace) -> int:
    cells = [Cell(a, d) for a in parse_list(args.attention, "--attention")
             for d in parse_list(args.dist, "--dist", DIST_MODES)]
    sweep = time.strftime("%Y%m%dT%H%M%S")
    bar, write = progress(cells, "train matrix", "cell")  # a line per cell is printed with or without tqdm
    failures = 0
    for cell in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(cell.label)
        record = run_cell(cell, args, f"{sweep}/{cell.attention}/{cell.dist}")
        failures += record.status != "ok"
        m = record.metrics
        line = (f"{cell.label}: {record.status}" + (f" ({record.error})" if record.error else "") +
                f", {m['epochs_done']} epochs, wall {m['wall_s']:.1f} s")
        write(line)
    if args.report_dir:
        table = write_report(args.out, args.report_dir)
        print(table)
    return 1 if failures else 0


# ----------------------------------------------------------------------------- report (pandas, matplotlib)


def latest_cells(records: list[Record]) -> tuple[list[Record], list[Record]]:
    """(the latest summary per (attention, dist, world size) in file order, their runs' epoch records)."""
    summaries: dict[tuple, Record] = {}
    for r in records:
        if r.suite == SUITE:
            summaries[(r.metrics.get("attention"), r.metrics.get("dist"), r.world_size)] = r
    if not summaries:
        raise ValueError(f"no {SUITE!r} records")
    runs = {s.metrics["run"] for s in summaries.values()}
    epochs = [r for r in records if r.suite == TRAIN_SUITE and r.status == "ok" and r.metrics.get("run") in runs]
    return list(summaries.values()), epochs


TABLE_COLUMNS = {"metrics.attention": "attention", "implementation": "dist", "world_size": "world_size",
                 "metrics.wall_s": "wall_s", "metrics.s_per_epoch": "s_per_epoch", "tokens_per_s": "tokens_per_s",
                 "metrics.samples_per_epoch": "samples_per_epoch", "peak_memory_bytes": "peak_memory_bytes",
                 "metrics.train_loss": "train_loss", "metrics.val_loss": "val_loss", "status": "status",
                 "error": "error"}


def markdown(summaries: list[Record]) -> str:
    from analysis.tables import markdown_table, records_frame

    frame = records_frame(summaries)
    for column in TABLE_COLUMNS:
        if column not in frame:
            frame[column] = None
    frame = frame[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)
    return markdown_table(frame, [c for c in TABLE_COLUMNS.values() if c not in ("status", "error")])


def _frames(summaries: list[Record], epochs: list[Record]):
    import pandas as pd

    cells = pd.DataFrame([{"attention": s.metrics.get("attention"), "dist": s.metrics.get("dist"),
                           "status": s.status, "tokens_per_s": s.tokens_per_s,
                           "peak_memory_gib": s.peak_memory_bytes / 2**30 if s.peak_memory_bytes else None,
                           "samples_per_epoch": s.metrics.get("samples_per_epoch")} for s in summaries])
    rows = []
    for r in epochs:
        cell = f"{r.metrics['attention']} / {r.metrics['dist']}"
        base = {"cell": cell, "epoch": r.metrics["epoch"], "epoch_s": r.metrics["epoch_s"]}
        rows.append({**base, "split": "train", "loss": r.metrics["train_loss"]})
        if r.metrics.get("val_loss") is not None:
            rows.append({**base, "split": "validation", "loss": r.metrics["val_loss"]})
    return cells, pd.DataFrame(rows, columns=["cell", "epoch", "epoch_s", "split", "loss"])


def write_report(jsonl: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """The table (``train_matrix.md``) and the five charts from ``jsonl``'s records; returns the table."""
    from analysis.plots import bar_plot, line_plot

    summaries, epochs = latest_cells(read_records(jsonl))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(summaries)
    (out / "train_matrix.md").write_text(table + "\n")
    cells, per_epoch = _frames(summaries, epochs)
    order = dict(x_order=list(dict.fromkeys(cells["dist"])), hue_order=list(dict.fromkeys(cells["attention"])))
    bars = {"peak_memory": ("peak_memory_gib", "peak memory per GPU, worst rank (GiB)"),
            "throughput": ("tokens_per_s", "tokens/s"),
            "samples_per_epoch": ("samples_per_epoch", "samples per epoch")}
    for name, (value, label) in bars.items():
        # A missing bar says why: the cell's status, or that this device does not measure it (CPU memory).
        notes = cells.assign(note=cells["status"].where(cells["status"] != "ok", "not measured"))
        bar_plot(notes, "dist", value, hue="attention", note="note", **order, xlabel="data-parallel mode", ylabel=label,
                 title=label, out=out / f"{name}.png")
    if per_epoch.empty:  # no cell finished an epoch: the line charts show each cell's status instead
        for name in ("time_per_epoch", "loss_convergence"):
            bar_plot(cells.assign(nothing=None), "dist", "nothing", hue="attention", note="status", **order,
                     xlabel="data-parallel mode", ylabel="", title=name.replace("_", " "), out=out / f"{name}.png")
        return table
    epoch_rows = per_epoch.drop_duplicates(["cell", "epoch"])
    line_plot(epoch_rows, "epoch", "epoch_s", hue="cell", ylabel="seconds per epoch", title="time per epoch",
              out=out / "time_per_epoch.png")
    line_plot(per_epoch, "epoch", "loss", hue="cell", col="split", col_order=("train", "validation"),
              ylabel="loss (nats/token)", title="loss convergence", out=out / "loss_convergence.png")
    return table


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m torch_impl.bench.train_matrix", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--attention", default=",".join(ATTENTIONS), help=f"comma list (default {','.join(ATTENTIONS)})")
    a("--dist", default=",".join(DISTS), help=f"comma list of {', '.join(DIST_MODES)} (default {','.join(DISTS)})")
    a("--nproc", type=positive_int, help="ranks of the data-parallel cells (default: the GPUs, else 2)")
    a("--model", default="small", help="model preset (default small)")
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
    a("--out", default="results/train_matrix.jsonl", type=writable_path,
      help="records (default results/train_matrix.jsonl)")
    a("--report-dir", default="results/train_matrix", help="table and charts (default results/train_matrix)")
    a("--report-only", metavar="JSONL", help="no training: regenerate the table and charts from JSONL")
    return p


def report_only(parser: argparse.ArgumentParser, args: argparse.Namespace,
                write: Callable[[str, str], str]) -> int | None:
    """``--report-only JSONL``: ``write(JSONL, --report-dir)``, print its table, and the exit code; None when
    not asked. A missing or record-less file is a one-line error (exit 2, at ``main``'s error boundary)."""
    if not args.report_only:
        return None
    print(write(args.report_only, args.report_dir))
    return 0


@error_boundary(prog="python -m torch_impl.bench.train_matrix")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (code := report_only(parser, args, write_report)) is not None:
        return code
    try:
        parse_list(args.attention, "--attention")
        parse_list(args.dist, "--dist", DIST_MODES)
        if args.nproc is None:
            import torch

            args.nproc = torch.cuda.device_count() or 2
        shlex.split(args.train_args)
    except ValueError as err:
        parser.error(str(err))
    return run_matrix(args)


if __name__ == "__main__":
    sys.exit(main())
