"""``python -m analysis.side_by_side RECORDS... --out DIR``: PyTorch vs JAX on the same spec, batch and precision.

Reads step-benchmark records of both backends (``torch_impl.bench.e2e``, ``torch_impl.bench.ddp``,
``jax_impl.bench.e2e``; any suite whose records carry a mode and timings) and lines them up by
configuration: model, sequence length, dtype, mode, global batch, number of devices and device kind. The
global batch is the records' batch, times the world size for the PyTorch data-parallel suite (whose batch
is per rank; ``PER_RANK_BATCH_SUITES``); JAX records carry the global batch of their one program.

Writes into ``--out``:
* ``side_by_side.md``: the head-to-head table (per configuration, the fastest PyTorch and the fastest JAX
  implementation: step time, tokens/s, MFU, peak memory per device, and the JAX / PyTorch step-time ratio),
  then every measured implementation (failures as rows with their status), with measured / predicted
  peak memory where the benchmark recorded ``parallelism_calc``'s prediction, and the weak-scaling
  efficiency of multi-device runs (``scaling``: tokens/s over devices x the fastest 1-device run of the same
  backend at the per-device batch);
* ``side_by_side_throughput.png``, ``_time.png``, ``_mfu.png`` and ``_memory.png`` (``plot_side_by_side``): bars
  per configuration measured in both backends (all configurations where none is, device count included), one per
  backend for its fastest run (every implementation of every configuration made a figure thousands of inches
  wide); ``side_by_side_scaling.png``: each backend's best weak-scaling efficiency per configuration.

Nothing is typed by hand: rerun it after adding records. References: the record format in DESIGN.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Iterable

import pandas as pd

from analysis.plots import bar_plot
from analysis.records import Record
from analysis.tables import RecordSource, load_records, markdown_table
from parallelism_calc.cli import ArgumentParser, error_boundary

PER_RANK_BATCH_SUITES = ("ddp",)
CONFIG_KEYS = ("model", "seq_len", "dtype", "mode", "global_batch", "devices", "device")


def _global_batch(r: Record) -> int | None:
    if r.batch_size is None:
        return None
    return r.batch_size * (r.world_size if r.suite in PER_RANK_BATCH_SUITES else 1)


def side_by_side_frame(sources: RecordSource | Iterable[RecordSource], mode: str | None = None) -> pd.DataFrame:
    """One row per step-benchmark record (the latest of repeated configurations), with the config keys."""
    rows = []
    for r in load_records(sources):
        if r.mode is None or r.seq_len is None or (mode and r.mode != mode):
            continue
        metrics = r.metrics or {}
        predicted = metrics.get("predicted_memory_bytes")
        rows.append({
            "model": r.model, "seq_len": r.seq_len, "dtype": r.dtype, "mode": r.mode, "global_batch": _global_batch(r),
            "devices": r.world_size, "device": r.provenance.get("device_name"), "backend": r.backend,
            "implementation": r.implementation, "suite": r.suite, "status": r.status, "error": r.error,
            "median_ms": r.median_ms, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
            "peak_memory_bytes": r.peak_memory_bytes, "predicted_memory_bytes": predicted,
            "memory_over_predicted": (r.peak_memory_bytes / predicted
                                      if r.peak_memory_bytes and predicted else None),
        })
    columns = [*CONFIG_KEYS, "backend", "implementation", "suite", "status", "error", "median_ms", "tokens_per_s",
               "mfu", "peak_memory_bytes", "predicted_memory_bytes", "memory_over_predicted"]
    frame = pd.DataFrame(rows, columns=columns)
    return frame.drop_duplicates([*CONFIG_KEYS, "backend", "implementation"], keep="last").reset_index(drop=True)


def head_to_head(frame: pd.DataFrame) -> pd.DataFrame:
    """Per configuration measured in both backends: the fastest ok run of each and the JAX / PyTorch ratio."""
    ok = frame[(frame["status"] == "ok") & frame["median_ms"].notna()]
    rows = []
    for key, group in ok.groupby(list(CONFIG_KEYS), dropna=False, sort=True):
        best = {b: g.loc[g["median_ms"].idxmin()] for b, g in group.groupby("backend")}
        if set(best) != {"torch", "jax"}:
            continue
        torch_row, jax_row = best["torch"], best["jax"]
        rows.append({
            **dict(zip(CONFIG_KEYS, key)),
            "torch": torch_row["implementation"], "torch_ms": torch_row["median_ms"], "torch_mfu": torch_row["mfu"],
            "torch_peak_memory_bytes": torch_row["peak_memory_bytes"],
            "jax": jax_row["implementation"], "jax_ms": jax_row["median_ms"], "jax_mfu": jax_row["mfu"],
            "jax_peak_memory_bytes": jax_row["peak_memory_bytes"],
            "jax_over_torch_time": jax_row["median_ms"] / torch_row["median_ms"],
        })
    return pd.DataFrame(rows)


def scaling(frame: pd.DataFrame) -> pd.DataFrame:
    """Weak-scaling efficiency of every ok multi-device run: tokens/s / (devices x tokens/s of the fastest
    1-device run of the same backend, model, seq, dtype, mode and device kind at the per-device batch)."""
    ok = frame[(frame["status"] == "ok") & frame["tokens_per_s"].notna()]
    single = ok[ok["devices"] == 1]
    rows = []
    for _, run in ok[ok["devices"] > 1].iterrows():
        per_device = run["global_batch"] / run["devices"]
        base = single[(single["backend"] == run["backend"]) & (single["global_batch"] == per_device) &
                      (single[["model", "seq_len", "dtype", "mode", "device"]] ==
                       run[["model", "seq_len", "dtype", "mode", "device"]]).all(axis=1)]
        if base.empty:
            continue
        best = base["tokens_per_s"].max()
        rows.append({"backend": run["backend"], "implementation": run["implementation"], "model": run["model"],
                     "seq_len": run["seq_len"], "dtype": run["dtype"], "devices": run["devices"],
                     "global_batch": run["global_batch"], "tokens_per_s": run["tokens_per_s"],
                     "single_device_tokens_per_s": best,
                     "scaling_efficiency": run["tokens_per_s"] / (run["devices"] * best)})
    return pd.DataFrame(rows)


def _config_label(row: pd.Series) -> str:
    return f"{row['model']} {row['global_batch']}x{row['seq_len']} {row['dtype']}"


# The bar charts of each backend's fastest run per configuration: column -> (axis label, chart name).
BAR_CHARTS = {"tokens_per_s": ("tokens / s", "throughput"), "median_ms": ("step time (ms)", "time"),
              "mfu": ("MFU", "mfu"), "peak_gib": ("peak memory per device (GiB)", "memory")}


def plot_side_by_side(frame: pd.DataFrame, prefix: str | Path, both_only: bool = True) -> list[Path]:
    """Charts of ``side_by_side_frame`` rows at ``<prefix>_<name>.png`` (and PDF), bars per configuration and backend
    (only configurations measured in both backends, where some are and ``both_only``): its fastest ok run's
    ``BAR_CHARTS`` and its best weak-scaling efficiency (``scaling``); the PNGs written."""
    prefix = Path(prefix)
    ok = frame[frame["status"] == "ok"]
    bars = _best_per_backend(ok, list(CONFIG_KEYS), "median_ms", True, both_only)
    bars = bars.assign(peak_gib=bars["peak_memory_bytes"] / 2**30)
    charts = {column: (bars, label, f"each one's fastest run: {name}", name)
              for column, (label, name) in BAR_CHARTS.items()}
    weak = scaling(frame)
    if not weak.empty:
        keys = ["model", "seq_len", "dtype", "global_batch", "devices"]
        charts["scaling_efficiency"] = (_best_per_backend(weak, keys, "scaling_efficiency", False, both_only),
                                        "weak-scaling efficiency", "each one's best scaling", "scaling")
    written = []
    for column, (rows, label, title, name) in charts.items():
        path = prefix.with_name(f"{prefix.name}_{name}.png")
        if rows.empty or not rows[column].notna().any():
            continue  # CPU-only records carry no allocator peak (nor MFU)
        bar_plot(rows, "config", column, hue="run", note="status" if "status" in rows else None, ylabel=label,
                 xlabel="", title=f"PyTorch vs JAX, {title}", out=path)
        written.append(path)
    return written


def _best_per_backend(rows: pd.DataFrame, keys: list[str], by: str, ascending: bool, both_only: bool) -> pd.DataFrame:
    """Per configuration (``keys``) and backend the row first by ``by``, labelled for the charts (``config``,
    ``run``); only configurations of both backends where some are and ``both_only``."""
    rows = rows.sort_values([*keys, "backend", by], ascending=[True] * (len(keys) + 1) + [ascending],
                            na_position="last").groupby([*keys, "backend"], dropna=False, sort=False).head(1)
    both = rows.groupby(keys, dropna=False)["backend"].transform("nunique") == 2
    rows = rows[both] if both_only and both.any() else rows
    return _labelled(rows)


BACKEND_NAMES = {"torch": "PyTorch", "jax": "JAX"}


def _labelled(rows: pd.DataFrame, implementation: bool = False) -> pd.DataFrame:
    """``rows`` with the charts' labels: ``config`` (model, batch x seq, dtype, devices) and ``run`` (the backend,
    and with ``implementation`` its implementation)."""
    if rows.empty:
        return rows.assign(config=None, run=None)
    devices = rows["devices"].map(lambda n: f", {n} device{'s' if n != 1 else ''}")
    run = rows["backend"].map(BACKEND_NAMES).fillna(rows["backend"])
    return rows.assign(config=rows.apply(_config_label, axis=1) + devices,
                       run=run + " " + rows["implementation"] if implementation else run)


def plot_implementations(frame: pd.DataFrame, prefix: str | Path, title: str) -> list[Path]:
    """The chart of ``side_by_side_frame`` rows at ``<prefix>_time.png`` (and PDF): per configuration, a bar for
    every implementation's latest step time (a failed run shows its status where its bar would be), as a step
    suite's own table lists them (with MFU and memory); the PNGs written (none for rows without a time)."""
    if frame.empty or not frame["median_ms"].notna().any():
        return []
    label, name = BAR_CHARTS["median_ms"]
    path = Path(prefix).with_name(f"{Path(prefix).name}_{name}.png")
    bar_plot(_labelled(frame, implementation=True), "config", "median_ms", hue="run", note="status", ylabel=label,
             xlabel="", title=f"{title}: {label}", out=path)
    return [path]


def write_side_by_side(sources: RecordSource | Iterable[RecordSource], out_dir: str | Path,
                       mode: str | None = "train_step") -> list[Path]:
    """The Markdown report and its charts (module docstring, ``plot_side_by_side``); the files written."""
    frame = side_by_side_frame(sources, mode)
    if frame.empty:
        raise ValueError(f"no step-benchmark records{f' in mode {mode}' if mode else ''} to compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = head_to_head(frame)
    written = plot_side_by_side(frame, out / "side_by_side")
    frame = frame.sort_values([*CONFIG_KEYS, "backend", "median_ms"], na_position="last")
    lines = ["# PyTorch vs JAX, side by side", "", "Generated by `python -m analysis.side_by_side` from the records.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in written] + [""]
    lines += ["## Head to head (fastest implementation of each backend)", ""]
    if pairs.empty:
        lines.append("No configuration was measured in both backends.")
    else:
        lines.append(markdown_table(pairs, list(pairs.columns)))
    weak = scaling(frame)
    if not weak.empty:
        lines += ["", "## Scaling efficiency (against the fastest 1-device run at the per-device batch)", "",
                  markdown_table(weak, list(weak.columns))]
    lines += ["", "## Every measured implementation", "",
              markdown_table(frame, [c for c in frame.columns if c != "error" or frame["status"].ne("ok").any()])]
    report = out / "side_by_side.md"
    report.write_text("\n".join(lines) + "\n")
    return [report, *written]


@error_boundary(prog="python -m analysis.side_by_side")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m analysis.side_by_side", description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="record files, folders or globs (JSON Lines)")
    parser.add_argument("--out", default="results/side_by_side", help="output folder (default results/side_by_side)")
    parser.add_argument("--mode", default="train_step", help="compare this mode only; 'all' for every mode")
    args = parser.parse_args(argv)
    written = write_side_by_side(args.records, args.out, None if args.mode == "all" else args.mode)
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
