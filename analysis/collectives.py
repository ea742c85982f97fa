"""The JAX collectives benchmark's report (suite "collectives", ``jax_impl.bench.collectives``): bus bandwidth
against size per collective, as a plot and a Markdown table. Never imports jax."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from analysis.plots import line_plot
from analysis.records import read_records
from analysis.tables import markdown_table

COLLECTIVES_SUITE = "collectives"
# What the report reads from a successful record's metrics.
REPORT_METRICS = ("op", "axis", "bytes", "size", "algbw_gbps", "busbw_gbps", "raw_busbw_gbps")


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
