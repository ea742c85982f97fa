"""Plots from records (matplotlib, PNG), and the attention benchmark's report: pivot tables, speed-ups, plots.

* ``line_plot(frame, x, y, hue=..., row=..., col=...)``: one line per ``hue`` value in a grid of panels, one
  panel per (``row``, ``col``) value; log axes on request; saved as PNG when given ``out``.
* ``bar_plot(frame, x, y, hue=..., col=...)``: grouped bars, failed rows marked by a note where the bar would be.
* ``plot_attention(records_or_frame, out_dir)``: for each dtype (and device, batch, heads, causal where
  several are present), latency and TFLOP/s against sequence length, one line per provider, one panel per
  (pass, head dim); failed runs are left out of the plots (the table shows them).
* ``attention_pivot`` / ``attention_markdown`` / ``write_attention_report``: providers as columns, rows per
  (dtype, pass, head dim, sequence length); the speed-up of ``flash_triton`` over every other provider.

Figures are made with ``matplotlib.figure.Figure`` and rendered by the Agg canvas, so importing this module
never changes pyplot's backend (a notebook keeps its own) and needs no display. Never imports torch: the
plots come from records only. Caveat: records of one configuration measured twice are de-duplicated, the
last one (in file order) winning.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from analysis.records import ATTENTION_PROVIDERS, read_records
from analysis.tables import RecordSource, markdown_table, records_frame
from parallelism_calc.compute import ATTENTION_PASSES

ATTENTION_SUITE = "attention"
ATTENTION_BASELINE = "flash_triton"
PASS_ORDER = tuple(ATTENTION_PASSES)  # display order, as ATTENTION_PROVIDERS'; other values follow, sorted
# One row of the pivot: the configuration a provider's time is compared at.
ATTENTION_KEYS = ("device_name", "dtype", "causal", "batch_size", "heads", "mode", "head_dim", "seq_len")
_GROUP_KEYS = ("device_name", "dtype", "causal", "batch_size", "heads")  # one figure per group


# ----------------------------------------------------------------------------- generic plots


def _ordered(values: Iterable[Any], order: Sequence[Any] = ()) -> list[Any]:
    """Distinct non-missing values: those in ``order`` first (in its order), then the rest sorted."""
    present = list(dict.fromkeys(v for v in values if not (v is None or (isinstance(v, float) and v != v))))
    known = [v for v in order if v in present]
    rest = [v for v in present if v not in known]
    try:
        rest.sort()
    except TypeError:
        rest.sort(key=str)
    return known + rest


def color_map(names: Sequence[Any]) -> dict[Any, Any]:
    """A stable colour per name (tab10, then tab20), so one provider has one colour in every figure."""
    from matplotlib import colormaps

    palette = list(colormaps["tab10"].colors) + list(colormaps["tab20"].colors)[1::2]
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def _binary_size(value: float, _pos: Any = None) -> str:
    """A tick of a base-2 axis: 512, 1k, 64k, 1M."""
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def line_plot(
    frame: pd.DataFrame,
    x: str,
    y: str,
    *,
    hue: str | None = None,
    row: str | None = None,
    col: str | None = None,
    hue_order: Sequence[Any] = (),
    row_order: Sequence[Any] = (),
    col_order: Sequence[Any] = (),
    logx: bool | int = False,
    logy: bool | int = False,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
    panel_size: tuple[float, float] = (4.0, 3.0),
    out: str | os.PathLike | None = None,
) -> Figure:
    """Lines of ``y`` against ``x``, one per ``hue`` value, in a grid with one panel per (``row``, ``col``).

    ``logx`` / ``logy``: True for a base-10 log axis, an integer for that base (2 for powers-of-two sizes,
    whose ticks then read 512, 1k, 64k).
    Rows with a missing ``x`` or ``y`` are left out; each line is sorted by ``x``. With ``out`` the figure is
    saved there as PNG (folders created). Raises ValueError on an unknown column or nothing to plot.
    """
    unknown = [c for c in (x, y, hue, row, col) if c is not None and c not in frame.columns]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(unknown)}; accepted: {', '.join(map(str, frame.columns))}")
    data = frame[frame[x].notna() & frame[y].notna()]
    if data.empty:
        raise ValueError(f"nothing to plot: no rows with both {x} and {y}")
    rows = _ordered(data[row], row_order) if row else [None]
    cols = _ordered(data[col], col_order) if col else [None]
    hues = _ordered(data[hue], hue_order) if hue else [None]
    colors = color_map(_ordered([*hue_order, *hues], hue_order)) if hue else {}

    fig = Figure(figsize=(panel_size[0] * len(cols) + (2.2 if hue else 0), panel_size[1] * len(rows) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), len(cols), squeeze=False, sharex=True)
    handles: dict[Any, Any] = {}
    for i, row_value in enumerate(rows):
        for j, col_value in enumerate(cols):
            ax = axes[i][j]
            panel = data
            if row:
                panel = panel[panel[row] == row_value]
            if col:
                panel = panel[panel[col] == col_value]
            for hue_value in hues:
                line = panel if hue is None else panel[panel[hue] == hue_value]
                if line.empty:
                    continue
                line = line.sort_values(x)
                (handle,) = ax.plot(line[x].astype(float), line[y].astype(float), marker="o", markersize=3,
                                    label=str(hue_value), color=colors.get(hue_value))  # fmt: skip
                handles.setdefault(hue_value, handle)
            if logx:
                ax.set_xscale("log", base=10 if logx is True else int(logx))
                if logx == 2:
                    ax.xaxis.set_major_formatter(FuncFormatter(_binary_size))
            if logy:
                ax.set_yscale("log", base=10 if logy is True else int(logy))
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(", ".join(f"{name}={value}" for name, value in ((row, row_value), (col, col_value)) if name),
                         fontsize=9)  # fmt: skip
            if i == len(rows) - 1:
                ax.set_xlabel(xlabel or x)
            if j == 0:
                ax.set_ylabel(ylabel or y)
    return _finish(fig, handles, [h for h in hues if h in handles] if hue else [], hue, title, out)


def _finish(fig: Figure, handles: dict[Any, Any], order: Sequence[Any], legend_title: str | None,
            title: str | None, out: str | os.PathLike | None) -> Figure:
    """A figure's shared ending: the legend right of the panels (``order`` of ``handles``), the title, and
    the PNG at ``out`` (folders created)."""
    if order:
        fig.legend([handles[h] for h in order], [str(h) for h in order], title=legend_title, loc="center left",
                   bbox_to_anchor=(1.0, 0.5), fontsize=8)  # fmt: skip
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=120, bbox_inches="tight")
    return fig


def bar_plot(
    frame: pd.DataFrame,
    x: str,
    y: str,
    *,
    hue: str,
    col: str | None = None,
    note: str | None = None,
    x_order: Sequence[Any] = (),
    hue_order: Sequence[Any] = (),
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
    out: str | os.PathLike | None = None,
) -> Figure:
    """Grouped bars of ``y``: one group per ``x`` value, one bar per ``hue`` value (colours as ``color_map``),
    one panel per ``col`` value. A row whose ``y`` is missing shows its ``note`` column's text (e.g. "oom")
    where its bar would be. Saved as PNG when given ``out``; ValueError on an unknown column."""
    unknown = [c for c in (x, y, hue, col, note) if c is not None and c not in frame.columns]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(unknown)}; accepted: {', '.join(map(str, frame.columns))}")
    if frame.empty:
        raise ValueError("nothing to plot: no rows")
    cols = _ordered(frame[col]) if col else [None]
    xs = _ordered(frame[x], x_order)
    hues = _ordered(frame[hue], hue_order)
    colors = color_map(hues)
    width = 0.8 / len(hues)
    fig = Figure(figsize=((1.2 * len(xs) * max(1, len(hues)) ** 0.5 + 1.5) * len(cols) + 2.2, 3.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(cols), squeeze=False)[0]
    handles: dict[Any, Any] = {}
    for ax, col_value in zip(axes, cols):
        panel = frame if col is None else frame[frame[col] == col_value]
        for i, hue_value in enumerate(hues):
            for j, x_value in enumerate(xs):
                cell = panel[(panel[hue] == hue_value) & (panel[x] == x_value)]
                if cell.empty:
                    continue
                position, height = j - 0.4 + width * (i + 0.5), cell[y].iloc[0]
                if height is not None and height == height:  # not None / NaN
                    handles[hue_value] = ax.bar(position, float(height), width, color=colors[hue_value])
                elif note is not None:
                    ax.text(position, 0, str(cell[note].iloc[0]), rotation=90, ha="center", va="bottom",
                            fontsize=7, color=colors[hue_value])
        ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=20, ha="right", fontsize=8)
        ax.set_xlim(-0.6, len(xs) - 0.4)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_xlabel(x if xlabel is None else xlabel)
        ax.set_title(str(col_value) if col else "", fontsize=9)
    axes[0].set_ylabel(y if ylabel is None else ylabel)
    return _finish(fig, handles, [h for h in hues if h in handles], hue, title, out)


# ----------------------------------------------------------------------------- attention records


def attention_frame(records_or_frame: RecordSource | Iterable[RecordSource] | pd.DataFrame,
                    suite: str | None = ATTENTION_SUITE) -> pd.DataFrame:  # fmt: skip
    """The attention benchmark's records as a frame with ``heads``, ``head_dim`` and ``causal`` columns
    (from its metrics), one row per configuration (the last measurement of a repeated one)."""
    frame = records_or_frame if isinstance(records_or_frame, pd.DataFrame) else records_frame(records_or_frame)
    if suite is not None and "suite" in frame:
        present = sorted(frame["suite"].dropna().unique())
        frame = frame[frame["suite"] == suite]
        if frame.empty:
            raise ValueError(f"no records of suite {suite!r}; suites present: {', '.join(present) or 'none'}")
    frame = frame.copy()
    for name in ("heads", "head_dim", "causal"):
        if name not in frame:
            frame[name] = frame.get(f"metrics.{name}")
    for name in ("heads", "head_dim"):
        try:
            frame[name] = frame[name].astype("Int64")
        except (TypeError, ValueError):
            pass
    keys = [k for k in (*ATTENTION_KEYS, "implementation") if k in frame]
    return frame.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


def _sorted_configs(frame: pd.DataFrame) -> pd.DataFrame:
    rank = {name: i for i, name in enumerate(PASS_ORDER)}
    order = frame.assign(_pass=frame["mode"].map(lambda m: rank.get(m, len(rank))))
    keys = [k for k in ("device_name", "dtype", "causal", "batch_size", "heads", "_pass", "mode", "head_dim",
                        "seq_len") if k in order]  # fmt: skip
    return order.sort_values(keys, kind="stable").drop(columns="_pass").reset_index(drop=True)


def providers_of(frame: pd.DataFrame) -> list[str]:
    return _ordered(frame["implementation"], ATTENTION_PROVIDERS)


def _selected(records_or_frame: RecordSource | Iterable[RecordSource] | pd.DataFrame) -> pd.DataFrame:
    """A frame as given (its suite already chosen), or the attention suite's records as a frame."""
    return attention_frame(records_or_frame, suite=None if isinstance(records_or_frame, pd.DataFrame)
                           else ATTENTION_SUITE)


def attention_pivot(frame: pd.DataFrame, value: str = "median_ms") -> pd.DataFrame:
    """Providers as columns, one row per configuration (``ATTENTION_KEYS``); failed runs are NaN."""
    keys = [k for k in ATTENTION_KEYS if k in frame]
    ok = frame[frame["status"] == "ok"]
    table = frame[keys].drop_duplicates()
    for provider in providers_of(frame):
        values = ok[ok["implementation"] == provider][[*keys, value]].rename(columns={value: provider})
        table = table.merge(values, on=keys, how="left")
    return _sorted_configs(table)


def speedups(pivot: pd.DataFrame, baseline: str = ATTENTION_BASELINE) -> pd.DataFrame:
    """Columns ``vs <provider>`` = that provider's time / the baseline's (> 1: the baseline is faster)."""
    keys = [k for k in ATTENTION_KEYS if k in pivot]
    out = pivot[keys].copy()
    if baseline not in pivot:
        return out
    for provider in [c for c in pivot.columns if c not in keys and c != baseline]:
        out[f"vs {provider}"] = pivot[provider] / pivot[baseline]
    return out


def _cells(frame: pd.DataFrame, pivot: pd.DataFrame, fmt: str) -> pd.DataFrame:
    """A pivot's numbers as text; a failed run shows its status (OOM, error) instead of a blank."""
    keys = [k for k in ATTENTION_KEYS if k in pivot]
    failed = frame[frame["status"] != "ok"]
    text = pivot.copy()
    for provider in [c for c in pivot.columns if c not in keys]:
        cells = [None if pd.isna(v) else format(float(v), fmt) for v in pivot[provider]]
        status = failed[failed["implementation"] == provider][[*keys, "status"]]
        if not status.empty:
            merged = pivot[keys].merge(status, on=keys, how="left")["status"].tolist()
            cells = [("OOM" if s == "oom" else s) if c is None and isinstance(s, str) else c
                     for c, s in zip(cells, merged)]  # fmt: skip
        text[provider] = pd.Series(cells, index=text.index, dtype=object)
    return text


def _constant_keys(frame: pd.DataFrame) -> dict[str, Any]:
    """Configuration keys with a single value over all rows: said once above the tables, not per row."""
    return {k: frame[k].iloc[0] for k in ATTENTION_KEYS if k in frame and k not in ("mode", "seq_len")
            and len(frame) and frame[k].nunique(dropna=False) == 1}  # fmt: skip


def _markdown(cells: pd.DataFrame, drop: Sequence[str]) -> str:
    shown = cells.drop(columns=[c for c in drop if c in cells])
    return markdown_table(shown, list(shown.columns))


def attention_markdown(records_or_frame: RecordSource | Iterable[RecordSource] | pd.DataFrame,
                       baseline: str = ATTENTION_BASELINE) -> tuple[str, str]:  # fmt: skip
    """The attention report in Markdown, and its speed-up table alone (for printing). A frame is taken as
    already selected (``attention_frame``); records are filtered to the attention suite."""
    frame = _selected(records_or_frame)
    constant = _constant_keys(frame)
    lines = ["# Attention benchmark", "",
             "Generated from records by `analysis.plots.write_attention_report`; do not edit by hand.", ""]
    if constant:
        lines += ["Same for every row: " + ", ".join(f"{k}={v}" for k, v in constant.items()), ""]
    ms = attention_pivot(frame, "median_ms")
    lines += ["## Median time (ms)", "", _markdown(_cells(frame, ms, ".3f"), list(constant)), ""]
    tflops = attention_pivot(frame, "tflops")
    lines += ["## TFLOP/s", "", _markdown(_cells(frame, tflops, ".4g"), list(constant)), ""]
    speedup_text = ""
    if baseline in ms:
        ratio = speedups(ms, baseline)
        keys = [k for k in ATTENTION_KEYS if k in ratio]
        for column in [c for c in ratio.columns if c not in keys]:
            ratio[column] = pd.Series([None if pd.isna(v) else f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x"
                                       for v in ratio[column]], index=ratio.index, dtype=object)  # fmt: skip
        speedup_text = (f"## Speed-up of {baseline} (other provider's median time / {baseline}'s; "
                        f"> 1: {baseline} is faster)\n\n" + _markdown(ratio, list(constant)))  # fmt: skip
        lines += [speedup_text, ""]
    failed = frame[frame["status"] != "ok"]
    if not failed.empty:
        columns = [c for c in ("implementation", "mode", "dtype", "head_dim", "seq_len", "status", "error")
                   if c in failed]  # fmt: skip
        lines += ["## Failed runs", "", markdown_table(_sorted_configs(failed), columns), ""]
    return "\n".join(lines), speedup_text


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(value)).strip("-").lower()


def plot_attention(records_or_frame: RecordSource | Iterable[RecordSource] | pd.DataFrame,
                   out_dir: str | os.PathLike, prefix: str = "attention") -> list[Path]:  # fmt: skip
    """Latency (log-log) and TFLOP/s (log x) against sequence length, one line per provider, one panel per
    (pass, head dim); one pair of PNGs per dtype (and per device / batch / heads / causal where several are
    present). Only successful runs are drawn. Returns the files written (none if nothing succeeded).
    A frame is taken as already selected (``attention_frame``); records are filtered to the attention suite."""
    frame = _selected(records_or_frame)
    frame = frame[frame["status"] == "ok"]
    if frame.empty:
        return []
    groups = [k for k in _GROUP_KEYS if k in frame]
    varying = [k for k in groups if k == "dtype" or frame[k].nunique(dropna=False) > 1]
    providers = _ordered([*ATTENTION_PROVIDERS, *frame["implementation"]], ATTENTION_PROVIDERS)  # fixed colours
    written = []
    for values, group in frame.groupby(groups, dropna=False, sort=True):
        values = dict(zip(groups, values if isinstance(values, tuple) else (values,)))
        suffix = "_".join(_slug(f"{'' if k in ('dtype', 'device_name') else k}{values[k]}") for k in varying)
        label = ", ".join(f"{k}={v}" for k, v in values.items())
        for name, y, ylabel, logy in (("latency", "median_ms", "median time (ms)", True),
                                      ("tflops", "tflops", "TFLOP/s", False)):  # fmt: skip
            out = Path(out_dir) / f"{prefix}_{name}_{suffix}.png"
            line_plot(group, "seq_len", y, hue="implementation", row="mode", col="head_dim", hue_order=providers,
                      row_order=PASS_ORDER, logx=2, logy=logy, xlabel="sequence length", ylabel=ylabel,
                      title=f"attention {name}: {label}", out=out)
            written.append(out)
    return written


def write_attention_report(path: str | os.PathLike, suite: str = ATTENTION_SUITE,
                           out_dir: str | os.PathLike | None = None) -> tuple[list[Path], str]:  # fmt: skip
    """Read the records in ``path``; write ``<stem>.md`` and ``<stem>_*.png`` next to it (or in ``out_dir``).

    Returns the files written and the speed-up table's Markdown (empty without ``flash_triton`` records).
    """
    path = Path(path)
    frame = attention_frame(records_frame(path), suite)
    out_dir = Path(out_dir) if out_dir is not None else path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    text, speedup_text = attention_markdown(frame)
    table = out_dir / f"{path.stem}.md"
    table.write_text(text, encoding="utf-8")
    return [table, *plot_attention(frame, out_dir, prefix=path.stem)], speedup_text


# ----------------------------------------------------------------------------- all-reduce records

ALLREDUCE_SUITE = "allreduce"


def write_allreduce_report(path: str | os.PathLike, plot: str | os.PathLike | None = None) -> tuple[Path, str]:
    """Bus bandwidth against size from the all-reduce records in ``path``: a PNG (default: ``<stem>_busbw.png``
    next to it) with one line per (world size, benchmark | raw loop) and one panel per backend, and a Markdown
    table of the successful runs. Returns (the PNG's path, the table)."""
    rows = []
    for r in read_records(path):
        if r.suite != ALLREDUCE_SUITE or r.status != "ok":
            continue
        m = r.metrics
        common = {"bytes": m["bytes"], "size": m["size"], "backend": m.get("comm_backend", r.implementation),
                  "world_size": r.world_size, "device": r.provenance.get("device_name")}
        rows.append({**common, "series": f"{r.world_size} ranks, benchmark", "median_ms": r.timing["median_ms"],
                     "algbw_gbps": m["algbw_gbps"], "busbw_gbps": m["busbw_gbps"],
                     "raw_busbw_gbps": m["raw_busbw_gbps"], "busbw_over_raw": m["busbw_over_raw"]})
        rows.append({**common, "series": f"{r.world_size} ranks, raw loop", "median_ms": m["raw_loop_ms"],
                     "algbw_gbps": m["raw_algbw_gbps"], "busbw_gbps": m["raw_busbw_gbps"]})
    if not rows:
        raise ValueError(f"{path}: no successful {ALLREDUCE_SUITE!r} records")
    frame = pd.DataFrame(rows)
    out = Path(plot) if plot else Path(path).with_name(f"{Path(path).stem}_busbw.png")
    series = sorted(frame["series"].unique(), key=lambda s: (int(s.split()[0]), s))
    line_plot(frame, "bytes", "busbw_gbps", hue="series", col="backend", hue_order=series, logx=2,
              xlabel="tensor size (bytes, float32)", ylabel="bus bandwidth (GB/s)",
              title="all_reduce bus bandwidth", out=out)
    table = frame[frame["series"].str.endswith("benchmark")].sort_values(["backend", "world_size", "bytes"])
    text = markdown_table(table, ["backend", "device", "world_size", "size", "median_ms", "algbw_gbps", "busbw_gbps",
                                  "raw_busbw_gbps", "busbw_over_raw"])
    return out, text


COLLECTIVES_SUITE = "collectives"


def write_collectives_report(path: str | os.PathLike, plot: str | os.PathLike | None = None) -> tuple[Path, str]:
    """Bus bandwidth against size from the JAX collective records in ``path``: a PNG (default
    ``<stem>_busbw.png`` next to it), one line per (op, axis size), one panel per device kind, and a Markdown
    table of the successful runs. Returns (the PNG's path, the table)."""
    rows = []
    for r in read_records(path):
        if r.suite != COLLECTIVES_SUITE or r.status != "ok":
            continue
        m = r.metrics
        rows.append({"op": m["op"], "axis": m["axis"], "n": r.world_size, "mesh": str(r.mesh), "bytes": m["bytes"],
                     "size": m["size"], "device": r.provenance.get("device_name"), "median_ms": r.timing["median_ms"],
                     "algbw_gbps": m["algbw_gbps"], "busbw_gbps": m["busbw_gbps"],
                     "raw_busbw_gbps": m["raw_busbw_gbps"], "series": f"{m['op']}, {r.world_size} devices"})
    if not rows:
        raise ValueError(f"{path}: no successful {COLLECTIVES_SUITE!r} records")
    frame = pd.DataFrame(rows)
    out = Path(plot) if plot else Path(path).with_name(f"{Path(path).stem}_busbw.png")
    line_plot(frame, "bytes", "busbw_gbps", hue="series", col="device", logx=2,
              xlabel="buffer size (bytes, float32)", ylabel="bus bandwidth (GB/s)",
              title="JAX collectives over one mesh axis", out=out)
    table = frame.sort_values(["device", "op", "n", "bytes"])
    text = markdown_table(table, ["device", "op", "axis", "n", "mesh", "size", "median_ms", "algbw_gbps",
                                  "busbw_gbps", "raw_busbw_gbps"])
    return out, text

__all__ = [
    "ATTENTION_PROVIDERS", "attention_frame", "attention_markdown", "attention_pivot", "color_map",
    "bar_plot", "line_plot", "plot_attention", "speedups", "write_allreduce_report", "write_attention_report",
    "write_collectives_report",
]  # fmt: skip
