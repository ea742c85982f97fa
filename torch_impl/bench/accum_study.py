"""Batch size x gradient accumulation at a fixed global batch: ``python -m torch_impl.bench.accum_study``.

Each setting ``LxA`` of ``--settings`` (default 16x64, 32x32, ..., 1024x1: local batch L per rank times A
micro-batches, L x A the same for every setting, so the global batch nproc x L x A is fixed) runs the trainer
(``torch_impl.train``, under ``torchrun --nproc_per_node --nproc``) with ``--dist`` (default bucketed), the same
epochs and optimizer steps per epoch, through the training matrix's cell runner
(``train_matrix.run_cell``): one "train" record per epoch and one "accum_study" summary record per setting,
failures (out of memory, crashes, timeouts) as rows, the sweep going on.

The summary adds the timing breakdown of the trainer (``torch_impl.train``'s docstring): per optimizer step,
the median over the epochs after the first of each phase's median (data, forward with the loss, backward,
comm, optimizer, in ms; forward/backward summed over the step's micro-batches) and per epoch the training,
validation and epoch seconds; plus tokens/s, s/epoch and the worst rank's peak memory.

Report (``--report-dir``; ``--report-only JSONL`` regenerates it): ``accum_study.md`` (the table, and the best
setting by tokens/s) and two charts, ``accum_phases.png`` (ms per step per phase, grouped bars per setting)
and ``accum_throughput.png`` (tokens/s per setting). Our DDP wrappers skip the all-reduce of all but the last
micro-batch (``no_sync()``), so accumulation saves communication as torch DDP's does.

References: the 4-GPU batch-size x gradient-accumulation study of the project's first experiment report
(issue 8); Goyal et al. 2017 (large minibatch SGD: fixed global batch, per-worker batch trade-offs).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

from analysis.harness import progress
from analysis.records import TRAIN_PHASES as STEP_PHASES, Record, read_records
from parallelism_calc.cli import ArgumentParser, error_boundary, parse_list, writable_path
from torch_impl.bench.train_matrix import Cell, report_only, run_cell
from torch_impl.parallelize import WRAPPER_MODES as DIST_MODES

SUITE = "accum_study"
DEFAULT_SETTINGS = "16x64,32x32,64x16,128x8,256x4,512x2,1024x1"
EPOCH_PHASES = ("training_s", "validation_s", "epoch_s")


def parse_settings(text: str) -> list[tuple[int, int]]:
    """'16x64,32x32' -> [(16, 64), (32, 32)]; every L x A must be the same (a fixed global batch)."""
    settings = []
    for item in parse_list(text, "--settings"):
        local, sep, accum = item.lower().partition("x")
        if not (sep and local.isdigit() and accum.isdigit() and int(local) > 0 and int(accum) > 0):
            raise ValueError(f"--settings item {item!r}; write LOCALxACCUM with positive integers, e.g. 16x64")
        settings.append((int(local), int(accum)))
    products = {local * accum for local, accum in settings}
    if len(products) != 1:
        raise ValueError(f"--settings {text!r}: local x accum must be the same everywhere (a fixed global "
                         f"batch); got {sorted(products)}")
    return settings


def _after_first(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values[1:] if len(values) > 1 else values) if values else None


def add_breakdown(summary: Record, epochs: list[Record]) -> Record:
    """The per-step phase medians and per-epoch times of the setting's epochs, into the summary's metrics."""
    ok = [r for r in epochs if r.status == "ok" and r.phases]
    summary.metrics["phase_ms"] = {p: _after_first([r.phases[p]["median_ms"] for r in ok if p in r.phases])
                                   for p in STEP_PHASES}
    summary.metrics["step_ms"] = _after_first([r.timing["median_ms"] for r in ok if r.timing])
    for name in EPOCH_PHASES:
        summary.metrics[name] = _after_first([r.metrics.get(name) for r in ok])
    return summary


def run_study(args: argparse.Namespace) -> int:
    settings = parse_settings(args.settings)
    sweep = time.strftime("%Y%m%dT%H%M%S")
    cell = Cell(args.attention, args.dist)
    bar, write = progress(settings, "accum study", "setting")  # a line per setting with or without tqdm
    failures = 0
    for local, accum in bar:
        setting = copy.copy(args)
        setting.batch_size, setting.grad_accum = local, accum
        run_name = f"{sweep}/{local}x{accum}"
        record = run_cell(cell, setting, run_name, suite=SUITE,
                          finish=add_breakdown)
        failures += record.status != "ok"
        line = (f"{local}x{accum}: {record.status}" + (f" ({record.error})" if record.error else "") +
                (f", {record.tokens_per_s:,.0f} tokens/s" if record.tokens_per_s else ""))
        write(line)
    if args.report_dir:
        print(write_report(args.out, args.report_dir))
    return 1 if failures else 0


# ----------------------------------------------------------------------------- report (pandas, matplotlib)


def latest_settings(records: list[Record]) -> list[Record]:
    """The latest summary per (local batch, accumulation, world size), in file order."""
    latest: dict[tuple, Record] = {}
    for r in records:
        if r.suite == SUITE:
            latest[(r.batch_size, r.metrics.get("grad_accum"), r.world_size)] = r
    if not latest:
        raise ValueError(f"no {SUITE!r} records")
    return list(latest.values())


def write_report(jsonl: str, out_dir: str) -> str:
    import pandas as pd

    from analysis.plots import bar_plot
    from analysis.tables import markdown_table

    summaries = latest_settings(read_records(jsonl))
    rows = []
    for s in summaries:
        m = s.metrics
        rows.append({"setting": f"{s.batch_size}x{m.get('grad_accum')}", "world_size": s.world_size,
                     "global_batch": s.world_size * s.batch_size * (m.get("grad_accum") or 1),
                     "status": s.status, "error": s.error, "tokens_per_s": s.tokens_per_s,
                     "step_ms": m.get("step_ms"),
                     **{f"{p}_ms": (m.get("phase_ms") or {}).get(p) for p in STEP_PHASES},
                     **{name: m.get(name) for name in EPOCH_PHASES}, "peak_memory_bytes": s.peak_memory_bytes})
    frame = pd.DataFrame(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = frame[(frame["status"] == "ok") & frame["tokens_per_s"].notna()]
    best = ok.loc[ok["tokens_per_s"].idxmax()] if not ok.empty else None
    text = markdown_table(frame, [c for c in frame.columns if c != "error" or (frame["status"] != "ok").any()])
    if best is not None:
        text += (f"\n\nBest setting: {best['setting']} (local batch x accumulation) at "
                 f"{best['tokens_per_s']:,.0f} tokens/s, global batch {best['global_batch']}.")
    (out / "accum_study.md").write_text(f"# Batch x gradient accumulation at a fixed global batch\n\n{text}\n")
    order = list(frame["setting"])
    phases = frame.melt(id_vars=["setting", "status"], value_vars=[f"{p}_ms" for p in STEP_PHASES],
                        var_name="phase", value_name="ms")
    phases["phase"] = phases["phase"].str.removesuffix("_ms")
    bar_plot(phases, "setting", "ms", hue="phase", note="status", x_order=order, xlabel="local batch x accumulation",
             ylabel="ms per optimizer step", title="time per step by phase", out=out / "accum_phases.png")
    bar_plot(frame.assign(run="tokens/s"), "setting", "tokens_per_s", hue="run", note="status", x_order=order,
             xlabel="local batch x accumulation", ylabel="tokens/s", title="throughput", out=out / "accum_throughput.png")
    return text


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    from torch_impl.bench.train_matrix import build_parser as matrix_parser

    p = ArgumentParser(prog="python -m torch_impl.bench.accum_study", description=__doc__.split("\n\n")[0])
    shared = {a.dest: a for a in matrix_parser()._actions}
    for flag in ("nproc", "model", "seq_len", "epochs", "steps_per_epoch", "dtype", "bucket_mb", "device",
                 "train_args", "cell_timeout"):
        action = shared[flag]
        p.add_argument(*action.option_strings, type=action.type, default=action.default, help=action.help,
                       choices=action.choices)
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"LOCALxACCUM list (default {DEFAULT_SETTINGS})")
    p.add_argument("--attention", default="sdpa", help="attention backend (default sdpa)")
    p.add_argument("--dist", default="bucketed", help="data-parallel mode (default bucketed)")
    p.add_argument("--out", default="results/accum_study.jsonl", type=writable_path,
                   help="records (default results/accum_study.jsonl)")
    p.add_argument("--report-dir", default="results/accum_study", help="table and charts (default results/accum_study)")
    p.add_argument("--report-only", metavar="JSONL", help="no training: regenerate the table and charts from JSONL")
    return p


@error_boundary(prog="python -m torch_impl.bench.accum_study")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (code := report_only(parser, args, write_report)) is not None:
        return code
    try:
        parse_settings(args.settings)
        parse_list(args.dist, "--dist", DIST_MODES)
        if args.dist == "none":
            raise ValueError("--dist none has no ranks to split the batch over; pick a data-parallel mode")
        if args.nproc is None:
            import torch

            args.nproc = torch.cuda.device_count() or 2
    except ValueError as err:
        parser.error(str(err))
    return run_study(args)


if __name__ == "__main__":
    sys.exit(main())
