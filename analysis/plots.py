"""Generic plots from record frames (matplotlib, PNG and PDF); each suite's report lives in its own module.

* ``line_plot(frame, x, y, hue=..., row=..., col=...)``: one line per ``hue`` value in a grid of panels, one
  panel per (``row``, ``col``) value; log axes on request; saved as PNG (and PDF) when given ``out``.
* ``bar_plot(frame, x, y, hue=..., col=...)``: grouped bars, failed rows marked by a note where the bar would be.
* ``color_map(names)``: one stable colour per name; ``ordered(values, order)``: the order of lines and legends.
* ``save_figure(fig, out)``: the one place figures are saved: a PNG at ``out`` and a PDF beside it.

The suites' reports: ``analysis.attention``, ``analysis.allreduce``, ``analysis.collectives``,
``analysis.data_parallel``, ``analysis.single_gpu``, ``analysis.side_by_side``. The attention, all-reduce and
collectives names this module used to hold are still importable from here for one release (old names).

Figures are made with ``matplotlib.figure.Figure`` and rendered by the Agg canvas, so importing this module
never changes pyplot's backend (a notebook keeps its own) and needs no display. Never imports torch.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter


def ordered(values: Iterable[Any], order: Sequence[Any] = ()) -> list[Any]:
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
    sharex: bool = True,
    out: str | os.PathLike | None = None,
) -> Figure:
    """Lines of ``y`` against ``x``, one per ``hue`` value, in a grid with one panel per (``row``, ``col``),
    sharing the x axis unless ``sharex`` is False.

    ``logx`` / ``logy``: True for a base-10 log axis, an integer for that base (2 for powers-of-two sizes,
    whose ticks then read 512, 1k, 64k).
    Rows with a missing ``x`` or ``y`` are left out; each line is sorted by ``x``. With ``out`` the figure is
    saved there as PNG, with a PDF beside it (``save_figure``). Raises ValueError on an unknown column or
    nothing to plot.
    """
    unknown = [c for c in (x, y, hue, row, col) if c is not None and c not in frame.columns]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(unknown)}; accepted: {', '.join(map(str, frame.columns))}")
    data = frame[frame[x].notna() & frame[y].notna()]
    if data.empty:
        raise ValueError(f"nothing to plot: no rows with both {x} and {y}")
    rows = ordered(data[row], row_order) if row else [None]
    cols = ordered(data[col], col_order) if col else [None]
    hues = ordered(data[hue], hue_order) if hue else [None]
    colors = color_map(ordered([*hue_order, *hues], hue_order)) if hue else {}

    fig = Figure(figsize=(panel_size[0] * len(cols) + (2.2 if hue else 0), panel_size[1] * len(rows) + 0.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), len(cols), squeeze=False, sharex=sharex)
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
    return finish_plot(fig, handles, [h for h in hues if h in handles] if hue else [], hue, title, out)


def finish_plot(fig: Figure, handles: dict[Any, Any], order: Sequence[Any], legend_title: str | None,
                title: str | None, out: str | os.PathLike | None) -> Figure:
    """A figure's shared ending: the legend right of the panels (``order`` of ``handles``), the title, and
    the PNG (and PDF) at ``out`` (``save_figure``)."""
    if order:
        fig.legend([handles[h] for h in order], [str(h) for h in order], title=legend_title, loc="center left",
                   bbox_to_anchor=(1.0, 0.5), fontsize=8)  # fmt: skip
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if out is not None:
        save_figure(fig, out)
    return fig


def save_figure(fig: Figure, out: str | os.PathLike) -> list[Path]:
    """``fig`` as a PNG at ``out`` and a PDF beside it (same name, ``.pdf``; folders created): every figure of
    the reports is saved here. The PDF carries no creation date, so regenerating the reports from the same
    records gives the same bytes. https://matplotlib.org/stable/api/backend_pdf_api.html"""
    png = Path(out)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, format="png", dpi=120, bbox_inches="tight")
    pdf = png.with_suffix(".pdf")
    fig.savefig(pdf, format="pdf", bbox_inches="tight", metadata={"CreationDate": None})
    return [png, pdf]


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
    where its bar would be. Saved as PNG and PDF when given ``out`` (``save_figure``); ValueError on an unknown
    column."""
    unknown = [c for c in (x, y, hue, col, note) if c is not None and c not in frame.columns]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(unknown)}; accepted: {', '.join(map(str, frame.columns))}")
    if frame.empty:
        raise ValueError("nothing to plot: no rows")
    cols = ordered(frame[col]) if col else [None]
    xs = ordered(frame[x], x_order)
    hues = ordered(frame[hue], hue_order)
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
    return finish_plot(fig, handles, [h for h in hues if h in handles], hue, title, out)


# Old home of the suites' reports (until they moved to their own modules): kept importable for one release.
_MOVED = {
    "ATTENTION_PROVIDERS": "analysis.records",
    **dict.fromkeys(("ATTENTION_BASELINE", "ATTENTION_KEYS", "ATTENTION_SUITE", "PASS_ORDER", "attention_frame",
                     "attention_markdown", "attention_pivot", "plot_attention", "providers_of", "speedups",
                     "write_attention_report"), "analysis.attention"),
    **dict.fromkeys(("ALLREDUCE_SUITE", "write_allreduce_report"), "analysis.allreduce"),
    **dict.fromkeys(("COLLECTIVES_SUITE", "write_collectives_report"), "analysis.collectives"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    """A name that moved to a suite's module, imported from there on first use (no import cycle)."""
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["bar_plot", "color_map", "line_plot", "ordered", "save_figure", *_MOVED]
