"""The training matrix: attention kernel x data-parallel mode, ``python -m torch_impl.bench.train_matrix``.

Every cell of ``--attention`` (default sdpa, naive, flash_triton) x ``--dist`` (default none, naive, bucketed,
torch_ddp) runs the trainer (``torch_impl.train``) in its own process (``torch_impl.train_sweep.run_cell``):
``python -m torch_impl.train`` for ``none`` (one GPU), ``torchrun --nproc_per_node --nproc`` for the others, all
with the same local batch and steps per epoch (so a DDP cell sees ``nproc`` times more samples per epoch),
``--epochs`` epochs (default 5). The trainer appends one "train" record per epoch to ``--out``, tagged
``metrics.run`` = the cell's run name; after the cell one "train_matrix" summary record built from them follows
(wall time, s/epoch, tokens/s, samples/epoch, worst-rank peak memory, the last losses:
``torch_impl.train_sweep``). A cell that fails (out of memory, a crash, a bad setting, ``--cell-timeout``) is a
summary record with status "oom" or "error", and the sweep goes on (a row, not a gap).

Report (``--report-dir``, also regenerated alone by ``--report-only JSONL``; ``analysis.training``): from the
records, for each cell the latest summary (file order) and that run's epoch records: ``train_matrix.md`` (the
table) and five PNG charts: time per epoch, peak memory, throughput, samples per epoch and loss convergence.

Caveats: on a CPU, memory is not measured (the chart says so); cells run one after another on the same
GPUs, so the numbers are comparable within one sweep; ``--train-args`` passes further flags to every cell.
References: the LM training benchmark matrix of the project's first experiment report (issue 8).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from analysis.harness import progress
from analysis.training import CHARTS, MATRIX_SUITE as SUITE, write_matrix_report as write_report  # noqa: F401
from parallelism_calc.cli import ArgumentParser, error_boundary, parse_list, writable_path
from torch_impl.parallelize import WRAPPER_MODES as DIST_MODES
from torch_impl.train_sweep import (Cell, SweepConfig, add_cell_arguments, failure_line, report_only,  # noqa: F401
                                    run_cell)

ATTENTIONS = ("sdpa", "naive", "flash_triton")
DISTS = ("none", "naive", "bucketed", "torch_ddp")


def run_matrix(args: argparse.Namespace) -> int:
    cells = [Cell(a, d) for a in parse_list(args.attention, "--attention")
             for d in parse_list(args.dist, "--dist", DIST_MODES)]
    sweep, settings = time.strftime("%Y%m%dT%H%M%S"), SweepConfig.of(args)
    bar, write = progress(cells, "train matrix", "cell")  # a line per cell is printed with or without tqdm
    failures = 0
    for cell in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(cell.label)
        record = run_cell(cell, settings, f"{sweep}/{cell.attention}/{cell.dist}", SUITE)
        failures += record.status != "ok"
        m = record.metrics
        line = (f"{cell.label}: {record.status}" + (f" ({record.error})" if record.error else "") +
                f", {m['epochs_done']} epochs, wall {m['wall_s']:.1f} s")
        write(line)
    if args.report_dir:
        table = write_report(args.out, args.report_dir)
        print(table)
    return 1 if failures else 0


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m torch_impl.bench.train_matrix", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--attention", default=",".join(ATTENTIONS), help=f"comma list (default {','.join(ATTENTIONS)})")
    a("--dist", default=",".join(DISTS), help=f"comma list of {', '.join(DIST_MODES)} (default {','.join(DISTS)})")
    add_cell_arguments(p)
    a("--out", default="results/train_matrix.jsonl", type=writable_path,
      help="records (default results/train_matrix.jsonl)")
    a("--report-dir", default="results/train_matrix", help="table and charts (default results/train_matrix)")
    a("--report-only", metavar="JSONL", help="no training: regenerate the table and charts from JSONL")
    return p


@error_boundary(prog="python -m torch_impl.bench.train_matrix")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (code := report_only(args.report_only, args.report_dir, write_report)) is not None:
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
