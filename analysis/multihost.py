"""``python -m analysis.multihost RECORDS... [--out FILE.md]``: does a run launched as several hosts or processes
do what it does on one?

Issue 23's check, from the records alone: each run launched as several torchrun nodes (its records' per-rank
``metrics.placement``: host, node rank, local rank), as several JAX processes (``metrics.processes``), or restarted
by ``torchrun --max-restarts`` after a rank died (``metrics.restarts``) is set beside the same configuration
launched on one node, in one process, uninterrupted: the reference, the first such run of the same commit, program
(``program``: a ``python -c`` run that patched the code is another), suite, backend, implementation, model, batch,
sequence length, dtype, world size and settings (``SAME_RUN_METRICS``).
Other one-host runs of the configuration (a repeat, other threads or GPUs visible: rank 0's ``OMP_NUM_THREADS``
and ``CUDA_VISIBLE_DEVICES`` are in the launch's words; a run stopped early) are set beside it too. A run is a
step benchmark's record, or a trainer's epoch records joined by ``metrics.run`` (``--run-name``), the latest
record of an epoch kept (a restarted run's; two launches under one name at one commit merge so). Per run, over
the epochs it shares with the reference (a trainer's): its losses against the reference's (``identical``: every
step's loss the same number; else how many first steps are equal and the largest absolute difference), the last
validation loss, the step time (median; of the last shared epoch) and its ratio to the reference's, and the worst
device's peak memory beside the calculator's prediction and, for JAX, the compiled step's own estimate
(``compiled_memory.estimate_bytes``) where the record has them; a chart of each run's step time over its
reference's, coloured by whether their losses are identical (``plot_multihost``). ``analysis.reports`` writes it as
``multihost.md`` (the chart ``multihost.png`` and ``.pdf`` beside it) when the records hold such a pair.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.plots import color_map, finish_plot
from analysis.records import Record
from analysis.tables import RecordSource, load_records, markdown_table
from parallelism_calc.cli import ArgumentParser, error_boundary

GIB = 2**30
# The metrics that must match for two launches to be the same run (the launch itself and the run's name aside).
SAME_RUN_METRICS = ("attention", "dist", "strategy", "remat", "grad_accum", "seed", "steps_per_epoch", "epochs",
                    "lr_max", "bucket_mb", "comm_dtype", "compiled", "cuda_graph", "loss",
                    "mlp")


@dataclass
class Run:
    """One launch of one configuration: its records (a trainer's epochs in order) and how it was launched."""

    key: tuple
    name: str
    launch: str
    one_host: bool  # one node / one process, not restarted: a reference
    records: list[Record]

    @property
    def epochs(self) -> list[int] | None:
        """A trainer run's epochs (a run stopped early or resumed holds only some); None for a step benchmark."""
        return [int(r.metrics["epoch"]) for r in self.records] if "epoch" in self.records[0].metrics else None

    def over(self, epochs: list[int] | None) -> Run:
        """This run cut to ``epochs`` (a trainer's; None: as it is)."""
        if epochs is None or self.epochs is None:
            return self
        kept = [r for r in self.records if int(r.metrics["epoch"]) in epochs]
        return Run(self.key, self.name, self.launch, self.one_host, kept)

    @property
    def losses(self) -> list[float]:
        m = [r.metrics for r in self.records]
        if "train_losses" in m[0]:
            return [float(x) for x in sum((x["train_losses"] for x in m), [])]
        if isinstance(m[0].get("losses"), list):
            return [float(x) for x in m[0]["losses"]]
        return [float(m[0][k]) for k in ("loss_first", "loss_last") if k in m[0]]  # older benchmark records

    @property
    def every_step(self) -> bool:
        """Whether ``losses`` holds every step's loss (else only the first and the last)."""
        return any(k in self.records[0].metrics for k in ("train_losses", "losses"))

    @property
    def last(self) -> Record:
        return self.records[-1]


def launch(record: Record) -> tuple[str, bool]:
    """How ``record``'s run was launched, in words, and whether that is one host (one node, or one process)."""
    m = record.metrics
    if "processes" in m:
        processes, local = int(m["processes"]), int(m.get("local_devices") or 0)
        return f"{processes} process{'es' if processes > 1 else ''} x {local} GPU", processes == 1
    placement = m.get("placement") or []
    if not placement:
        return "one process", True
    nodes = {p["node_rank"] for p in placement}
    hosts = {p["host"] for p in placement}
    text = f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} x {len(placement) // len(nodes)} rank"
    if len(hosts) > 1:
        text += f" on {len(hosts)} hosts"
    settings = record.provenance.get("settings") or {}  # rank 0's environment
    if "," not in settings.get("CUDA_VISIBLE_DEVICES", ","):
        text += ", a GPU visible a rank"
    if "OMP_NUM_THREADS" in settings:
        text += f", OMP_NUM_THREADS={settings['OMP_NUM_THREADS']}"
    return text, len(nodes) == 1


def program(record: Record) -> str:
    """What the record's process ran, from its command: the script (its last two path parts, so one module run from
    two checkouts is one program), or ``-c`` for a program given inline (e.g. one that patched the code first)."""
    for word in str(record.provenance.get("command") or "").split():
        if word == "-c" or word.endswith(".py"):
            return "/".join(Path(word).parts[-2:])
    return ""


def runs(records: Iterable[Record]) -> list[Run]:
    """Every successful run of the records that says how it was launched (a step benchmark's record, or a trainer's
    epochs by run name)."""
    groups: dict[tuple, dict[int, Record]] = {}
    for i, r in enumerate(records):
        if r.status != "ok" or not ("placement" in r.metrics or "processes" in r.metrics):
            continue  # failed, or from before records said how they were launched
        words, single = launch(r)
        same = tuple(str(r.metrics.get(k)) for k in SAME_RUN_METRICS)
        key = (r.provenance.get("git_commit"), program(r), r.suite, r.backend, r.implementation, r.model,
               r.batch_size, r.seq_len, r.dtype, r.world_size, same)
        trainer = "epoch" in r.metrics
        name = str(r.metrics.get("run") or "") if trainer else ""
        record_id = None if trainer else i  # a step benchmark's record: a run of its own
        epochs = groups.setdefault((key, name, record_id, words, single), {})
        epochs[int(r.metrics["epoch"]) if trainer else 1] = r  # a restarted run's epoch twice: its latest record
    out = []
    for (key, name, _, words, single), epochs in groups.items():
        ordered = [epochs[e] for e in sorted(epochs)]
        restarts = max(int(r.metrics.get("restarts") or 0) for r in ordered)
        out.append(Run(key, name, words + (f", restarted {restarts}x" if restarts else ""), single and not restarts,
                       ordered))
    return out


def _loss_match(run: Run, reference: Run) -> str:
    """``identical (N steps)``, or how many first steps are equal and the largest absolute difference."""
    mine, theirs = run.losses, reference.losses
    if not (run.every_step and reference.every_step) and len(mine) == len(theirs) == 2:
        return (f"first {'equal' if mine[0] == theirs[0] else f'{mine[0] - theirs[0]:+.3g}'}, last "
                f"{'equal' if mine[1] == theirs[1] else f'{mine[1] - theirs[1]:+.3g}'} (only these recorded)")
    if len(mine) != len(theirs) or not mine:
        return f"{len(mine)} losses against {len(theirs)}"
    if mine == theirs:
        return f"identical ({len(mine)} steps)"
    equal = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
    worst = max(abs(a - b) for a, b in zip(mine, theirs))
    return f"first {equal} equal, then max abs diff {worst:.3g} ({len(mine)} steps)"


def _span(epochs: list[int] | None) -> str:
    """``1-3``, ``2`` or ``-`` (a step benchmark)."""
    if not epochs:
        return "-"
    return str(epochs[0]) if len(epochs) == 1 else f"{epochs[0]}-{epochs[-1]}"


def _gib(value) -> float | None:
    return None if value is None else value / GIB


def multihost_table(records: Iterable[Record]) -> pd.DataFrame:
    """One row per run that has a one-host reference of the same configuration (the reference first); a trainer
    run that shares no epoch with it (stopped early, or resumed, elsewhere) has none."""
    every = runs(records)
    rows = []
    for key in dict.fromkeys(r.key for r in every):
        mine = [r for r in every if r.key == key]
        reference = next((r for r in mine if r.one_host), None)  # the first one-host run of the configuration
        if reference is None:
            continue
        # a trainer run is set beside the reference over the epochs both ran (one stopped early or resumed: some)
        others = [r for r in mine
                  if r is not reference and (r.epochs is None or set(r.epochs) & set(reference.epochs))]
        for original in (reference, *others) if others else ():
            common = None if original.epochs is None else [e for e in reference.epochs if e in original.epochs]
            run, ref = original.over(common), reference.over(common)
            last, ref_ms = run.last, (ref.last.timing or {}).get("median_ms")
            ms = (last.timing or {}).get("median_ms")
            rows.append({
                "suite": last.suite, "backend": last.backend, "implementation": last.implementation,
                "model": last.model, "batch": f"{last.batch_size} x {last.seq_len}", "dtype": last.dtype,
                "run": run.name or "-", "launch": run.launch, "epochs": _span(run.epochs),
                "losses vs one host": "reference" if original is reference else _loss_match(run, ref),
                "last loss": run.losses[-1] if run.losses else None,
                "val loss": last.metrics.get("val_loss"),
                "step ms": ms, "x one host": None if not (ms and ref_ms) else ms / ref_ms,
                "peak GiB": _gib(last.peak_memory_bytes),
                "predicted GiB": _gib(last.metrics.get("predicted_memory_bytes")),
                "XLA's estimate GiB": _gib((last.metrics.get("compiled_memory") or {}).get("estimate_bytes")),
            })
    return pd.DataFrame(rows)


def plot_multihost(table: pd.DataFrame, out: str | Path) -> Path | None:
    """Each run's step time over its one-host reference's (``multihost_table``'s "x one host"), a bar a run labelled
    with its row number in the table, coloured by whether its losses are identical to the reference's; PNG and PDF at
    ``out``. None where no run has a step time beside its reference's."""
    rows = table.assign(row=range(1, len(table) + 1))
    rows = rows[(rows["losses vs one host"] != "reference") & rows["x one host"].notna()]
    if rows.empty:
        return None
    ratios = rows["x one host"].astype(float)
    losses = ["identical" if text.startswith("identical") else "not identical" for text in rows["losses vs one host"]]
    colors = color_map(["identical", "not identical"])
    fig = Figure(figsize=(7.0, 0.2 * len(rows) + 1.0))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars = ax.barh(range(len(rows)), ratios, color=[colors[x] for x in losses])
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), [f"{r.row}. {r.implementation} {r.model}: {r.launch}" for r in rows.itertuples()],
                  fontsize=7)
    ax.invert_yaxis()  # top to bottom, as the table
    ax.set_xlim(0, ratios.max() * 1.05)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlabel("step time / the one-host reference's")
    handles = {x: bars[losses.index(x)] for x in colors if x in losses}
    finish_plot(fig, handles, list(handles), "losses vs one host", "each launch against the same run on one host",
                out)
    return Path(out)


def write_multihost(sources: RecordSource | Iterable[RecordSource], out: str | Path) -> Path:
    """The table into ``out`` (Markdown), its chart beside it (``plot_multihost``: ``out`` as ``.png`` and ``.pdf``);
    ValueError when no run has a one-host reference."""
    table = multihost_table(load_records(sources))
    if table.empty:
        raise ValueError("no run launched as several nodes, several processes or restarted beside the same "
                         "configuration on one host")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = plot_multihost(table, out.with_suffix(".png"))
    chart = f"![step time against one host]({plot.name})" if plot else \
        "No chart: no run has a step time beside its reference's."
    out.write_text("\n".join([
        "# Several hosts against one", "",
        "Generated by `python -m analysis.multihost` from the records: each run launched as several torchrun nodes, "
        "several JAX processes or restarted after a killed rank, and each other one-host run of its configuration "
        "(a repeat, a run stopped early), beside the first run of the configuration launched on one node (one "
        "process), uninterrupted, over the epochs they share. Step ms: the median (of the last epoch compared); "
        "x one host: against the reference's over the same epochs; peak: the worst device's; "
        "predicted: `parallelism_calc`'s; XLA's estimate: the compiled JAX step's `memory_analysis()`.",
        "", chart, "", markdown_table(table, list(table.columns))]) + "\n")
    return out


@error_boundary(prog="python -m analysis.multihost")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m analysis.multihost", description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="record files, folders or globs (JSON Lines)")
    parser.add_argument("--out", default="results/reports/multihost.md", help="the Markdown table")
    args = parser.parse_args(argv)
    try:
        print(write_multihost(args.records, args.out).read_text())
    except ValueError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
