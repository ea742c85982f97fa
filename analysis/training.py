"""Reports of the trainer's sweeps (``torch_impl.train_sweep``), from their records alone.

* The training matrix (suite "train_matrix", ``torch_impl.bench.train_matrix``), ``write_matrix_report``: for each
  cell (attention x data-parallel mode) the latest summary (file order) and that run's epoch records (suite
  "train"): ``train_matrix.md`` (the table) and five PNG charts (``CHARTS``): ``time_per_epoch.png`` (s per epoch
  against epoch), ``peak_memory.png``, ``throughput.png`` (tokens/s), ``samples_per_epoch.png``
  (``analysis.plots.bar_plot``: bars per mode, one colour per attention kernel; a failed cell shows its status
  instead of a bar; on a CPU, memory is not measured and the chart says so) and ``loss_convergence.png``
  (training and validation loss against epoch; beside the cells, the latest run of the JAX trainer
  (``jax_impl.trainer``) per implementation found in the same file, ``latest_jax_runs``, labelled "jax: ...").
* The batch x accumulation study (suite "accum_study", ``torch_impl.bench.accum_study``), ``write_accum_report``:
  the latest summary per setting: ``accum_study.md`` (the table, and the best setting by tokens/s) and two
  charts, ``accum_phases.png`` (ms per step per phase, grouped bars per setting) and ``accum_throughput.png``
  (tokens/s per setting).
* Any file's epoch records (suite "train"), ``plot_train_runs``: tokens/s per run, where a run has several
  epochs its losses against epoch, else, where records hold each step's loss, the training loss against step
  (``python -m analysis.reports`` draws them beside the file's table). A run without a name is labelled by its
  backend, implementation and batch, and by the settings that differ between the file's runs (``RUN_SETTINGS``).

Stdlib only until a report is drawn (pandas, matplotlib), so the sweeps import it for the suite names.
"""

from __future__ import annotations

import os
from pathlib import Path

from analysis.records import TRAIN_PHASES, Record, read_records

TRAIN_SUITE = "train"  # the trainer's epoch records
MATRIX_SUITE = "train_matrix"
ACCUM_SUITE = "accum_study"
CHARTS = ("time_per_epoch", "peak_memory", "throughput", "samples_per_epoch", "loss_convergence")
EPOCH_PHASES = ("training_s", "validation_s", "epoch_s")  # the accumulation study's seconds per epoch


# ----------------------------------------------------------------------------- the training matrix


def latest_cells(records: list[Record]) -> tuple[list[Record], list[Record]]:
    """(the latest summary per (attention, dist, world size) in file order, their runs' epoch records)."""
    summaries: dict[tuple, Record] = {}
    for r in records:
        if r.suite == MATRIX_SUITE:
            summaries[(r.metrics.get("attention"), r.metrics.get("dist"), r.world_size)] = r
    if not summaries:
        raise ValueError(f"no {MATRIX_SUITE!r} records")
    runs = {s.metrics["run"] for s in summaries.values()}
    epochs = [r for r in records if r.suite == TRAIN_SUITE and r.status == "ok" and r.metrics.get("run") in runs]
    return list(summaries.values()), epochs


def latest_jax_runs(records: list[Record]) -> list[Record]:
    """The epoch records of the JAX trainer's latest run per (implementation, run name), in file order: a run
    restarts where its epoch number does not grow (a resumed run continues it)."""
    runs: dict[tuple, list[Record]] = {}
    for r in records:
        if r.suite == TRAIN_SUITE and r.backend == "jax" and r.status == "ok":
            run = runs.setdefault((r.implementation, r.metrics.get("run")), [])
            if run and r.metrics["epoch"] <= run[-1].metrics["epoch"]:
                run.clear()
            run.append(r)
    return [r for run in runs.values() for r in run]


TABLE_COLUMNS = {"metrics.attention": "attention", "implementation": "dist", "world_size": "world_size",
                 "metrics.wall_s": "wall_s", "metrics.s_per_epoch": "s_per_epoch", "tokens_per_s": "tokens_per_s",
                 "metrics.samples_per_epoch": "samples_per_epoch", "peak_memory_bytes": "peak_memory_bytes",
                 "metrics.train_loss": "train_loss", "metrics.val_loss": "val_loss", "status": "status",
                 "error": "error"}


def matrix_markdown(summaries: list[Record]) -> str:
    from analysis.tables import markdown_table, records_frame

    frame = records_frame(summaries)
    for column in TABLE_COLUMNS:
        if column not in frame:
            frame[column] = None
    frame = frame[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)
    return markdown_table(frame, [c for c in TABLE_COLUMNS.values() if c not in ("status", "error")])


def _cell(r: Record) -> str:
    """The loss chart's line of an epoch record: "attention / dist" for the matrix's cells, "jax: ..." for JAX."""
    return f"jax: {r.implementation}" if r.backend == "jax" else f"{r.metrics['attention']} / {r.metrics['dist']}"


def _frames(summaries: list[Record], epochs: list[Record]):
    import pandas as pd

    cells = pd.DataFrame([{"attention": s.metrics.get("attention"), "dist": s.metrics.get("dist"),
                           "status": s.status, "tokens_per_s": s.tokens_per_s,
                           "peak_memory_gib": s.peak_memory_bytes / 2**30 if s.peak_memory_bytes else None,
                           "samples_per_epoch": s.metrics.get("samples_per_epoch")} for s in summaries])
    return cells, _epoch_rows(epochs, [_cell(r) for r in epochs])


def _epoch_rows(epochs: list[Record], labels: list[str]):
    """The loss charts' rows: per epoch record (its line's label), its training and (if any) validation loss."""
    import pandas as pd

    rows = []
    for r, label in zip(epochs, labels):
        base = {"cell": label, "epoch": r.metrics["epoch"], "epoch_s": r.metrics["epoch_s"]}
        rows.append({**base, "split": "train", "loss": r.metrics["train_loss"]})
        if r.metrics.get("val_loss") is not None:
            rows.append({**base, "split": "validation", "loss": r.metrics["val_loss"]})
    return pd.DataFrame(rows, columns=["cell", "epoch", "epoch_s", "split", "loss"])


RUN_SETTINGS = ("dtype", "attention", "mlp", "loss", "seed")  # what may tell unnamed runs apart in a label
_SETTING_DEFAULTS = {"mlp": "torch", "loss": "plain"}  # what records from before a setting existed ran


def run_labels(epochs: list[Record]) -> list[str]:
    """A label per epoch record of suite "train": its run's name (else backend, implementation and batch), then each
    of ``RUN_SETTINGS`` whose value is not the same in every record of that name (e.g. "attention flash_triton, mlp
    gluon"), "#k" on the k-th run of that label where several are (a run restarts where its epoch number does not
    grow)."""

    def setting(r: Record, key: str):
        return r.dtype if key == "dtype" else r.metrics.get(key, _SETTING_DEFAULTS.get(key))

    bases = [r.metrics.get("run") or f"{r.backend} {r.implementation}, batch {r.batch_size}" for r in epochs]
    varying = {base: [key for key in RUN_SETTINGS
                      if len({str(setting(r, key)) for r, b in zip(epochs, bases) if b == base}) > 1]
               for base in set(bases)}
    keys, starts = [], {}
    for r, base in zip(epochs, bases):
        name = ", ".join([base, *(f"{key} {setting(r, key)}" for key in varying[base])])
        runs = starts.setdefault(name, [])
        if not runs or r.metrics["epoch"] <= runs[-1]:
            runs.append(0)
        runs[-1] = r.metrics["epoch"]
        keys.append((name, len(runs)))
    return [name if len(starts[name]) == 1 else f"{name} #{k}" for name, k in keys]


def plot_train_runs(records: list[Record], prefix: str | os.PathLike) -> list[Path]:
    """Charts of the trainer's epoch records (suite "train") at ``<prefix>_<name>.png`` (and PDF): ``throughput``,
    tokens/s of each run's last epoch (bars, one colour per backend), where a run has 2+ epochs, ``loss``
    (training and validation loss against epoch, one line per run), else, where the records hold each step's loss
    (``train_losses``), ``loss_steps`` (its mean over each ``STEP_WINDOW`` steps against the step, one line per
    run: a step's loss alone is mostly its batch's); the PNGs written."""
    import pandas as pd

    from analysis.plots import bar_plot, line_plot

    prefix = Path(prefix)
    epochs = [r for r in records if r.suite == TRAIN_SUITE and r.status == "ok"
              and {"epoch", "epoch_s", "train_loss"} <= r.metrics.keys()]
    labels = run_labels(epochs)
    last = pd.DataFrame([{"run": label, "backend": r.backend, "tokens_per_s": r.tokens_per_s}
                         for r, label in zip(epochs, labels)]).drop_duplicates("run", keep="last")
    written = []
    if not last.empty and last["tokens_per_s"].notna().any():
        path = prefix.with_name(f"{prefix.name}_throughput.png")
        bar_plot(last, "run", "tokens_per_s", hue="backend", x_order=list(last["run"]), xlabel="run",
                 ylabel="tokens/s (last epoch)", title="training throughput per run", out=path)
        written.append(path)
    losses = _epoch_rows(epochs, labels)
    by_epoch = not losses.empty and losses.groupby("cell")["epoch"].nunique().max() > 1
    if by_epoch:
        path = prefix.with_name(f"{prefix.name}_loss.png")
        line_plot(losses, "epoch", "loss", hue="cell", col="split", col_order=("train", "validation"),
                  hue_order=list(dict.fromkeys(labels)), ylabel="loss (nats/token)", title="loss per run", out=path)
        written.append(path)
    steps = _step_rows(epochs, labels)
    if not by_epoch and not steps.empty:
        path = prefix.with_name(f"{prefix.name}_loss_steps.png")
        line_plot(steps, "step", "loss", hue="cell", hue_order=list(dict.fromkeys(labels)), xlabel="step",
                  ylabel=f"training loss, mean of {STEP_WINDOW} steps", title="training loss per run",
                  panel_size=(9.0, 5.0), out=path)
        written.append(path)
    return written


STEP_WINDOW = 10  # steps whose losses make one point of the loss_steps chart


def _step_rows(epochs: list[Record], labels: list[str]):
    """The loss_steps chart's rows: per run (label), the mean training loss of each ``STEP_WINDOW`` steps, at the
    window's last step, over the run's epochs in order (steps counted from the run's first epoch's)."""
    import pandas as pd

    rows, done = [], {}
    for r, label in zip(epochs, labels):
        losses = r.metrics.get("train_losses") or []
        first = done.get(label, 0)
        for start in range(0, len(losses) - STEP_WINDOW + 1, STEP_WINDOW):
            window = losses[start:start + STEP_WINDOW]
            rows.append({"cell": label, "step": first + start + STEP_WINDOW, "loss": sum(window) / STEP_WINDOW})
        done[label] = first + len(losses)
    return pd.DataFrame(rows, columns=["cell", "step", "loss"])


def write_matrix_report(jsonl: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """The table (``train_matrix.md``) and the five charts from ``jsonl``'s records; returns the table."""
    import pandas as pd

    from analysis.plots import bar_plot, line_plot

    records = read_records(jsonl)
    summaries, epochs = latest_cells(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = matrix_markdown(summaries)
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
    jax_epochs = _frames(summaries, latest_jax_runs(records))[1]
    epoch_rows = per_epoch.drop_duplicates(["cell", "epoch"])
    line_plot(epoch_rows, "epoch", "epoch_s", hue="cell", ylabel="seconds per epoch", title="time per epoch",
              out=out / "time_per_epoch.png")
    losses = pd.concat([per_epoch, jax_epochs], ignore_index=True) if not jax_epochs.empty else per_epoch
    line_plot(losses, "epoch", "loss", hue="cell", col="split", col_order=("train", "validation"),
              ylabel="loss (nats/token)", title="loss convergence", out=out / "loss_convergence.png")
    return table


# ----------------------------------------------------------------------------- the accumulation study


def latest_settings(records: list[Record]) -> list[Record]:
    """The latest summary per (local batch, accumulation, world size), in file order."""
    latest: dict[tuple, Record] = {}
    for r in records:
        if r.suite == ACCUM_SUITE:
            latest[(r.batch_size, r.metrics.get("grad_accum"), r.world_size)] = r
    if not latest:
        raise ValueError(f"no {ACCUM_SUITE!r} records")
    return list(latest.values())


def write_accum_report(jsonl: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """The table (``accum_study.md``) and the two charts from ``jsonl``'s records; returns the table."""
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
                     **{f"{p}_ms": (m.get("phase_ms") or {}).get(p) for p in TRAIN_PHASES},
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
    phases = frame.melt(id_vars=["setting", "status"], value_vars=[f"{p}_ms" for p in TRAIN_PHASES],
                        var_name="phase", value_name="ms")
    phases["phase"] = phases["phase"].str.removesuffix("_ms")
    bar_plot(phases, "setting", "ms", hue="phase", note="status", x_order=order, xlabel="local batch x accumulation",
             ylabel="ms per optimizer step", title="time per step by phase", out=out / "accum_phases.png")
    bar_plot(frame.assign(run="tokens/s"), "setting", "tokens_per_s", hue="run", note="status", x_order=order,
             xlabel="local batch x accumulation", ylabel="tokens/s", title="throughput", out=out / "accum_throughput.png")
    return text
