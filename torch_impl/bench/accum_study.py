"""Batch size x gradient accumulation at a fixed global batch: ``python -m torch_impl.bench.accum_study``.

Each setting ``LxA`` of ``--settings`` (default 16x64, 32x32, ..., 1024x1: local batch L per rank times A
micro-batches, L x A the same for every setting, so the global batch nproc x L x A is fixed) runs the trainer
(``torch_impl.train``, under ``torchrun --nproc_per_node --nproc``) with ``--dist`` (default bucketed), the same
epochs and optimizer steps per epoch, through the cell runner of the training matrix
(``torch_impl.train_sweep.run_cell``): one "train" record per epoch and one "accum_study" summary record per setting,
failures (out of memory, crashes, timeouts) as rows, the sweep going on.

The summary adds the timing breakdown of the trainer (``torch_impl.train``'s docstring): per optimizer step,
the median over the epochs after the first of each phase's median (data, forward with the loss, backward,
comm, optimizer, in ms; forward/backward summed over the step's micro-batches) and per epoch the training,
validation and epoch seconds; plus tokens/s, s/epoch and the worst rank's peak memory.

Report (``--report-dir``; ``--report-only JSONL`` regenerates it; ``analysis.training``): ``accum_study.md`` (the table, and the best
setting by tokens/s) and two charts, ``accum_phases.png`` (ms per step per phase, grouped bars per setting)
and ``accum_throughput.png`` (tokens/s per setting). Our DDP wrappers skip the all-reduce of all but the last
micro-batch (``no_sync()``), so accumulation saves communication as torch DDP's does.

References: the 4-GPU batch-size x gradient-accumulation study of the project's first experiment report
(issue 8); Goyal et al. 2017 (large minibatch SGD: fixed global batch, per-worker batch trade-offs).
"""

from __future__ import annotations

import argparse
import sys
import time

from analysis.harness import progress
from analysis.records import TRAIN_PHASES as STEP_PHASES, Record
from analysis.training import ACCUM_SUITE as SUITE, EPOCH_PHASES, write_accum_report as write_report
from parallelism_calc.cli import ArgumentParser, error_boundary, parse_list, writable_path
from torch_impl.parallelize import WRAPPER_MODES as DIST_MODES
from torch_impl.train_sweep import Cell, SweepConfig, add_cell_arguments, median_after_first, report_only, run_cell

DEFAULT_SETTINGS = "16x64,32x32,64x16,128x8,256x4,512x2,1024x1"


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


def add_breakdown(summary: Record, epochs: list[Record]) -> Record:
    """The per-step phase medians and per-epoch times of the setting's epochs, into the summary's metrics."""
    ok = [r for r in epochs if r.status == "ok" and r.phases]
    summary.metrics["phase_ms"] = {p: median_after_first([r.phases[p]["median_ms"] for r in ok if p in r.phases])
                                   for p in STEP_PHASES}
    summary.metrics["step_ms"] = median_after_first([r.timing["median_ms"] for r in ok if r.timing])
    for name in EPOCH_PHASES:
        summary.metrics[name] = median_after_first([r.metrics.get(name) for r in ok])
    return summary


def run_study(args: argparse.Namespace) -> int:
    settings = parse_settings(args.settings)
    sweep = time.strftime("%Y%m%dT%H%M%S")
    cell = Cell(args.attention, args.dist)
    bar, write = progress(settings, "accum study", "setting")  # a line per setting with or without tqdm
    failures = 0
    for local, accum in bar:
        setting = SweepConfig.of(args, batch_size=local, grad_accum=accum)
        run_name = f"{sweep}/{local}x{accum}"
        record = run_cell(cell, setting, run_name, suite=SUITE, finish=add_breakdown)
        failures += record.status != "ok"
        line = (f"{local}x{accum}: {record.status}" + (f" ({record.error})" if record.error else "") +
                (f", {record.tokens_per_s:,.0f} tokens/s" if record.tokens_per_s else ""))
        write(line)
    if args.report_dir:
        print(write_report(args.out, args.report_dir))
    return 1 if failures else 0


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m torch_impl.bench.accum_study", description=__doc__.split("\n\n")[0])
    add_cell_arguments(p, batch=False)  # the training matrix's, less the batch: each setting sets it
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
    if (code := report_only(args.report_only, args.report_dir, write_report)) is not None:
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
