"""The all-reduce benchmark's report (suite "allreduce", ``torch_impl.bench.allreduce``): bus bandwidth
against size, as a plot and a Markdown table. Never imports torch."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from analysis.plots import line_plot
from analysis.records import read_records
from analysis.tables import markdown_table

ALLREDUCE_SUITE = "allreduce"
# What the report reads from a successful record's metrics.
REPORT_METRICS = ("bytes", "size", "algbw_gbps", "busbw_gbps", "raw_loop_ms", "raw_algbw_gbps", "raw_busbw_gbps",
                  "busbw_over_raw")


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
