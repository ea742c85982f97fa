"""The attention benchmarks' report (suites "attention" and "naive_attention"): pivot tables, speed-ups, plots.

* ``attention_frame``: the records as a frame with ``heads``, ``head_dim`` and ``causal`` columns.
* ``attention_pivot`` / ``speedups`` / ``attention_markdown``: providers as columns, rows per (dtype, pass, head
  dim, sequence length); the speed-up of ``flash_triton`` over every other provider.
* ``plot_attention``: for each dtype (and device, batch, heads, causal where several are present), latency and
  TFLOP/s against sequence length, one line per provider, one panel per (pass, head dim); failed runs are left
  out of the plots (the table shows them).
* ``write_attention_report``: the Markdown and the PNGs of one record file (``torch_impl.bench.attention``,
  ``analysis.reports``).

Never imports torch. Caveat: records of one configuration measured twice are de-duplicated, the last one (in
file order) winning.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import pandas as pd

from analysis.plots import line_plot, ordered
from analysis.records import ATTENTION_PROVIDERS
from analysis.tables import RecordSource, filter_suite, markdown_table, records_frame
from parallelism_calc.compute import ATTENTION_PASSES

ATTENTION_SUITE = "attention"
ATTENTION_BASELINE = "flash_triton"
PASS_ORDER = tuple(ATTENTION_PASSES)  # display order, as ATTENTION_PROVIDERS'; other values follow, sorted
# One row of the pivot: the configuration a provider's time is compared at.
ATTENTION_KEYS = ("device_name", "dtype", "causal", "batch_size", "heads", "mode", "head_dim", "seq_len")
_GROUP_KEYS = ("device_name", "dtype", "causal", "batch_size", "heads")  # one figure per group
REPORT_METRICS = ("heads", "head_dim", "causal")  # what the report reads from a successful record's metrics
OPTIONAL_METRICS = ("host_ms",)  # and where a record has them (CUDA runs from 5e59770 on)


def attention_frame(records_or_frame: RecordSource | Iterable[RecordSource] | pd.DataFrame,
                    suite: str | None = ATTENTION_SUITE) -> pd.DataFrame:  # fmt: skip
    """The attention benchmark's records as a frame with ``heads``, ``head_dim`` and ``causal`` columns
    (from its metrics), one row per configuration (the last measurement of a repeated one)."""
    frame = records_or_frame if isinstance(records_or_frame, pd.DataFrame) else records_frame(records_or_frame)
    frame = filter_suite(frame, suite).copy()
    for name in (*REPORT_METRICS, *OPTIONAL_METRICS):
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
    return ordered(frame["implementation"], ATTENTION_PROVIDERS)


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
             "Generated from records by `analysis.attention.write_attention_report`; do not edit by hand.", ""]
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
    host = attention_pivot(frame, "host_ms")
    if host[providers_of(frame)].notna().any().any():  # CUDA runs (records before host_ms have none)
        lines += ["## Host time a run (ms)", "",
                  "The host's time to enqueue one run on an idle GPU: where it is near the median time, the run is "
                  "bound by the host (its Python and launches), not by its kernels.", "",
                  _markdown(_cells(frame, host, ".3f"), list(constant)), ""]
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
    providers = ordered([*ATTENTION_PROVIDERS, *frame["implementation"]], ATTENTION_PROVIDERS)  # fixed colours
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
