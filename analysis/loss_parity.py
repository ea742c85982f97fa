"""``python -m analysis.loss_parity RECORDS... --out FILE.md``: do the two backends take the same steps?

Pairs PyTorch and JAX runs that trained the same model from the same saved weights on the same batches (the same
commit, suite, model, global batch, sequence length, dtype, learning rate and weight file:
``jax_impl.bench.e2e --load-weights`` beside ``torch_impl.bench.e2e --save-weights``, or both trainers from one
``--init-weights`` file) and compares
their losses step by step: the largest relative difference over the first ``FIRST_STEPS`` steps and over the
whole run, against the bf16 tolerance ``BF16_RTOL`` (bf16's machine epsilon, 2^-7: one unit in the last place
of a bf16 number near 1). A run's losses are its records' ``losses`` (the e2e benchmarks: warm-up and timed steps,
in order) or ``train_losses`` (the trainers: each epoch's, concatenated in epoch order); a trainer's run is its
``metrics.run`` name (``--run-name``), else its implementation. The learning rate is the ``--lr`` of the
recorded command, else a step benchmark's ``metrics.lr``, else unknown (left blank).

Writes the table (``FILE.md``) and the loss curves of every pair (``FILE.png``, one panel per pair). Nothing is
typed by hand: rerun it after adding records. ``analysis.reports`` writes it as ``loss_parity.md`` when the
records hold a pair. References: the issue's criterion ("losses of the two backends from the same weights agree
to bf16 tolerance over the first 10 steps"); the record format in DESIGN.md.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pandas as pd

from analysis.plots import line_plot
from analysis.records import Record
from analysis.tables import RecordSource, load_records, markdown_table
from parallelism_calc.cli import ArgumentParser, error_boundary

FIRST_STEPS = 10
BF16_RTOL = 2.0**-7  # bf16's machine epsilon
PAIR_KEYS = ("commit", "suite", "model", "global_batch", "seq_len", "dtype", "lr", "weights")


@dataclass
class Run:
    """One training run's losses, with what makes two runs comparable."""

    key: tuple
    backend: str
    name: str
    losses: list[float]


def _flag(record: Record, *names: str) -> str | None:
    """The value of the first of ``names`` (``--flag VALUE`` or ``--flag=VALUE``) in the recorded command."""
    words = shlex.split(record.provenance.get("command") or "")
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(name + "="):
                return word[len(name) + 1:]
    return None


def learning_rate(record: Record) -> float | None:
    """The ``--lr`` of the recorded command (a trainer's peak rate; its records' ``metrics.lr`` follow the
    schedule), else a step benchmark's ``metrics.lr``, else None (the command's default)."""
    value = _flag(record, "--lr")
    if value is not None:
        return float(value)
    lr = record.metrics.get("lr")
    return float(lr) if isinstance(lr, (int, float)) and "losses" in record.metrics else None


def runs(records: Iterable[Record]) -> list[Run]:
    """Every run that started from saved weights (``--save-weights`` / ``--load-weights`` / ``--init-weights``
    in its command, the file then part of its key) and recorded its losses: an e2e record on its own, a
    trainer's epochs joined by run name."""
    out, epochs = [], {}
    for r in records:
        weights = _flag(r, "--save-weights", "--load-weights", "--init-weights")
        if r.status != "ok" or r.backend not in ("torch", "jax") or weights is None:
            continue
        ranks = r.world_size if r.backend == "torch" else 1  # PyTorch's batch is per rank, JAX's the mesh's
        key = (r.provenance.get("git_commit"), r.suite, r.model,
               r.batch_size * (r.metrics.get("grad_accum") or 1) * (ranks or 1), r.seq_len, r.dtype,
               learning_rate(r), weights)
        if isinstance(r.metrics.get("losses"), list):  # a step benchmark: one record per run
            out.append(Run(key, r.backend, r.implementation, [float(x) for x in r.metrics["losses"]]))
        elif isinstance(r.metrics.get("train_losses"), list):  # a trainer: one record per epoch
            epochs.setdefault((key, r.backend, str(r.metrics.get("run") or r.implementation)), []).append(r)
    for (key, backend, name), group in epochs.items():
        group.sort(key=lambda r: r.metrics.get("epoch", 0))
        out.append(Run(key, backend, name, [float(x) for r in group for x in r.metrics["train_losses"]]))
    return out


def loss_parity(records: Iterable[Record]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per PyTorch-JAX pair: the relative differences; the curves of every pair, long format)."""
    rows, curves = [], []
    every = runs(records)
    for torch_run in (r for r in every if r.backend == "torch"):
        for jax_run in (r for r in every if r.backend == "jax" and r.key == torch_run.key):
            steps = min(len(torch_run.losses), len(jax_run.losses))
            rel = [abs(j - t) / abs(t) for t, j in zip(torch_run.losses[:steps], jax_run.losses[:steps])]
            first = max(rel[:FIRST_STEPS], default=float("nan"))
            commit, suite, model, _, _, dtype, lr, _ = torch_run.key
            pair = f"{suite} {model} {dtype} lr {lr} ({commit}): {jax_run.name}"
            rows.append({**dict(zip(PAIR_KEYS, torch_run.key)), "torch": torch_run.name, "jax": jax_run.name,
                         "steps": steps, f"max_rel_diff_first_{FIRST_STEPS}": first, "max_rel_diff": max(rel),
                         f"within_bf16_first_{FIRST_STEPS}": first <= BF16_RTOL})
            for backend, run in (("torch", torch_run), ("jax", jax_run)):
                curves += [{"pair": pair, "backend": backend, "step": i, "loss": loss}
                           for i, loss in enumerate(run.losses[:steps])]
    return pd.DataFrame(rows), pd.DataFrame(curves)


def write_loss_parity(sources: RecordSource | Iterable[RecordSource], out: str | Path) -> list[Path]:
    """The table (``out``, Markdown) and the curves (``out`` with ``.png``); the files written."""
    table, curves = loss_parity(load_records(sources))
    if table.empty:
        raise ValueError("no PyTorch and JAX runs of the same model, batch, dtype, learning rate and commit "
                         "with losses to compare")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    chart = out.with_suffix(".png")
    line_plot(curves, "step", "loss", hue="backend", row="pair", xlabel="step", ylabel="training loss",
              title="PyTorch and JAX from the same weights", panel_size=(7.0, 2.6), sharex=False, out=chart)
    lines = ["# Loss parity: PyTorch and JAX from the same weights", "",
             "Generated by `python -m analysis.loss_parity` from the records. Relative difference |jax - torch| / "
             f"torch per step; bf16 tolerance {BF16_RTOL:.4g} (2^-7).", "", f"![loss curves]({chart.name})", "",
             markdown_table(table, list(table.columns))]
    out.write_text("\n".join(lines) + "\n")
    return [out, chart]


@error_boundary(prog="python -m analysis.loss_parity")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m analysis.loss_parity", description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="record files, folders or globs (JSON Lines)")
    parser.add_argument("--out", default="results/reports/loss_parity.md", help="the Markdown table (and .png)")
    args = parser.parse_args(argv)
    for path in write_loss_parity(args.records, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
