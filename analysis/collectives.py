"""The JAX collectives benchmark's report (suite "collectives", ``jax_impl.bench.collectives``): bus bandwidth
against size per collective, as a plot and a Markdown table, and the same bus bandwidths over PyTorch NCCL's
(``torch_impl.bench.allreduce`` records). Never imports jax."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from analysis.plots import line_plot
from analysis.records import read_records
from analysis.tables import markdown_table

COLLECTIVES_SUITE = "collectives"
NCCL_SUITE = "allreduce"  # torch_impl.bench.allreduce's suite
# What the report reads from a successful record's metrics.
REPORT_METRICS = ("op", "axis", "bytes", "size", "algbw_gbps", "busbw_gbps", "raw_busbw_gbps")


def collectives_frame(path: str | os.PathLike) -> pd.DataFrame:
    """One row per successful JAX collective record in ``path``; ``xla`` is its XLA options (stock before they
    were recorded)."""
    rows = []
    for r in read_records(path):
        if r.suite != COLLECTIVES_SUITE or r.status != "ok":
            continue
        m = r.metrics
        xla = m.get("xla", "stock")
        rows.append({"op": m["op"], "axis": m["axis"], "n": r.world_size, "mesh": str(r.mesh), "bytes": m["bytes"],
                     "size": m["size"], "device": r.provenance.get("device_name"), "xla": xla,
                     "median_ms": r.timing["median_ms"], "algbw_gbps": m["algbw_gbps"], "busbw_gbps": m["busbw_gbps"],
                     "raw_busbw_gbps": m["raw_busbw_gbps"],
                     "series": f"{m['op']}, {r.world_size} devices" + ("" if xla == "stock" else f", {xla}")})
    if not rows:
        raise ValueError(f"{path}: no successful {COLLECTIVES_SUITE!r} records")
    return pd.DataFrame(rows)


def write_collectives_report(path: str | os.PathLike, plot: str | os.PathLike | None = None) -> tuple[Path, str]:
    """Bus bandwidth against size from the JAX collective records in ``path``: a PNG (default
    ``<stem>_busbw.png`` next to it), one line per (op, axis size, XLA options), one panel per device kind, and a
    Markdown table of the successful runs. Returns (the PNG's path, the table)."""
    frame = collectives_frame(path)
    out = Path(plot) if plot else Path(path).with_name(f"{Path(path).stem}_busbw.png")
    line_plot(frame, "bytes", "busbw_gbps", hue="series", col="device", logx=2,
              xlabel="buffer size (bytes, float32)", ylabel="bus bandwidth (GB/s)",
              title="JAX collectives over one mesh axis", out=out)
    table = frame.sort_values(["device", "op", "n", "xla", "bytes"])
    text = markdown_table(table, ["device", "op", "axis", "n", "mesh", "xla", "size", "median_ms", "algbw_gbps",
                                  "busbw_gbps", "raw_busbw_gbps"])
    return out, text


def nccl_comparison(jax_path: str | os.PathLike, nccl_path: str | os.PathLike) -> str:
    """Each JAX collective's bus bandwidth (measured op and raw loop) over PyTorch NCCL all-reduce's (its benchmark
    and its raw loop) at the same size, world size and device: a Markdown table. Bus bandwidth is nccl-tests'
    link-comparable figure, so all-gather and reduce-scatter are set against NCCL's all-reduce too."""
    jax_frame = collectives_frame(jax_path)
    nccl = [{"bytes": r.metrics["bytes"], "n": r.world_size, "device": r.provenance.get("device_name"),
             "nccl_busbw_gbps": r.metrics["busbw_gbps"], "nccl_raw_busbw_gbps": r.metrics["raw_busbw_gbps"]}
            for r in read_records(nccl_path)
            if r.suite == NCCL_SUITE and r.status == "ok" and r.metrics.get("comm_backend") == "nccl"]
    if not nccl:
        raise ValueError(f"{nccl_path}: no successful NCCL {NCCL_SUITE!r} records")
    # The latest NCCL record of each (size, world size, device).
    reference = pd.DataFrame(nccl).drop_duplicates(["bytes", "n", "device"], keep="last")
    frame = jax_frame.merge(reference, on=["bytes", "n", "device"])
    if frame.empty:
        raise ValueError(f"{jax_path} and {nccl_path} share no (size, world size, device)")
    frame["jax_over_nccl"] = frame["busbw_gbps"] / frame["nccl_busbw_gbps"]
    frame["raw_over_nccl_raw"] = frame["raw_busbw_gbps"] / frame["nccl_raw_busbw_gbps"]
    frame = frame.sort_values(["device", "n", "bytes", "op", "xla"])
    return markdown_table(frame, ["device", "n", "size", "op", "xla", "busbw_gbps", "nccl_busbw_gbps", "jax_over_nccl",
                                  "raw_busbw_gbps", "nccl_raw_busbw_gbps", "raw_over_nccl_raw"])
