"""The JAX collectives benchmark's report (suite "collectives", ``jax_impl.bench.collectives``): bus bandwidth
against size per collective, as a plot and a Markdown table, and the same bus bandwidths over PyTorch NCCL's
(``torch_impl.bench.allreduce`` records). Never imports jax."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from analysis.plots import line_plot
from analysis.records import Record, read_records
from analysis.tables import markdown_table

COLLECTIVES_SUITE = "collectives"
NCCL_SUITE = "allreduce"  # torch_impl.bench.allreduce's suite
# What the report reads from a successful record's metrics.
REPORT_METRICS = ("op", "axis", "bytes", "size", "algbw_gbps", "busbw_gbps", "raw_busbw_gbps")


def collectives_frame(path: str | os.PathLike) -> pd.DataFrame:
    """One row per successful JAX collective record in ``path``; ``xla`` is its XLA options (stock before they
    were recorded)."""
    frame = _collectives_rows(read_records(path))
    if frame.empty:
        raise ValueError(f"{path}: no successful {COLLECTIVES_SUITE!r} records")
    return frame


def _collectives_rows(records: list[Record]) -> pd.DataFrame:
    rows = []
    for r in records:
        if r.suite != COLLECTIVES_SUITE or r.status != "ok":
            continue
        m = r.metrics
        xla = m.get("xla", "stock")
        rows.append({"op": m["op"], "axis": m["axis"], "n": r.world_size, "mesh": str(r.mesh), "bytes": m["bytes"],
                     "size": m["size"], "device": r.provenance.get("device_name"), "xla": xla,
                     "commit": r.provenance.get("git_commit"),
                     "median_ms": r.timing["median_ms"], "algbw_gbps": m["algbw_gbps"], "busbw_gbps": m["busbw_gbps"],
                     "raw_busbw_gbps": m["raw_busbw_gbps"],
                     "series": f"{m['op']}, {r.world_size} devices" + ("" if xla == "stock" else f", {xla}")})
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
    jax_records, nccl_records = read_records(jax_path), read_records(nccl_path)
    if _collectives_rows(jax_records).empty:
        raise ValueError(f"{jax_path}: no successful {COLLECTIVES_SUITE!r} records")
    if not _nccl_rows(nccl_records):
        raise ValueError(f"{nccl_path}: no successful NCCL {NCCL_SUITE!r} records")
    frame = comparison_frame(jax_records + nccl_records, same_commit=False)
    if frame.empty:
        raise ValueError(f"{jax_path} and {nccl_path} share no (size, world size, device)")
    return markdown_table(frame, COMPARISON_COLUMNS)


COMPARISON_COLUMNS = ["device", "n", "size", "op", "xla", "busbw_gbps", "nccl_busbw_gbps", "jax_over_nccl",
                      "raw_busbw_gbps", "nccl_raw_busbw_gbps", "raw_over_nccl_raw"]


def _nccl_rows(records: list[Record]) -> list[dict]:
    return [{"bytes": r.metrics["bytes"], "n": r.world_size, "device": r.provenance.get("device_name"),
             "commit": r.provenance.get("git_commit"), "nccl_busbw_gbps": r.metrics["busbw_gbps"],
             "nccl_raw_busbw_gbps": r.metrics["raw_busbw_gbps"]}
            for r in records if r.suite == NCCL_SUITE and r.status == "ok" and r.metrics.get("comm_backend") == "nccl"]


def comparison_frame(records: list[Record], same_commit: bool = True) -> pd.DataFrame:
    """The JAX collective records beside the latest NCCL all-reduce record (in ``records``' order) of the same size,
    world size, device and (``same_commit``) commit, with the ratios ``jax_over_nccl`` and ``raw_over_nccl_raw``;
    empty where none pair."""
    keys = ["bytes", "n", "device", *(["commit"] if same_commit else [])]
    jax_frame, nccl = _collectives_rows(records), _nccl_rows(records)
    if jax_frame.empty or not nccl:
        return pd.DataFrame(columns=COMPARISON_COLUMNS)
    reference = pd.DataFrame(nccl).drop_duplicates(keys, keep="last")
    frame = jax_frame.merge(reference.drop(columns=[] if same_commit else ["commit"]), on=keys)
    frame["jax_over_nccl"] = frame["busbw_gbps"] / frame["nccl_busbw_gbps"]
    frame["raw_over_nccl_raw"] = frame["raw_busbw_gbps"] / frame["nccl_raw_busbw_gbps"]
    return frame.sort_values(["device", "n", "bytes", "op", "xla"])


def write_nccl_comparison(records: list[Record], out: str | os.PathLike) -> list[Path]:
    """``comparison_frame`` of ``records`` as a Markdown table at ``out`` and a chart beside it (``.png`` and PDF:
    JAX over NCCL bus bandwidth against size, the measured op and the raw loop); the files written."""
    frame = comparison_frame(records)
    if frame.empty:
        raise ValueError("no JAX collective and NCCL all-reduce records of the same size, devices and commit")
    out = Path(out)
    chart = out.with_suffix(".png")
    ratios = frame.melt(id_vars=["bytes", "series", "device", "n"], value_vars=["jax_over_nccl", "raw_over_nccl_raw"],
                        var_name="timed", value_name="ratio")
    ratios["timed"] = ratios["timed"].map({"jax_over_nccl": "one op", "raw_over_nccl_raw": "raw loop"})
    line_plot(ratios.assign(setup=ratios["device"] + ", " + ratios["n"].astype(str) + " devices"), "bytes", "ratio",
              hue="series", row="timed", col="setup", logx=2, xlabel="buffer size (bytes, float32)",
              ylabel="JAX / NCCL bus bandwidth", title="JAX collectives against NCCL all-reduce", out=chart)
    out.write_text("# JAX collectives against PyTorch NCCL all-reduce\n\nGenerated by `python -m analysis.reports` "
                   "from the records: each JAX bus bandwidth over NCCL all-reduce's at the same size, devices and "
                   f"commit.\n\n![JAX over NCCL]({chart.name})\n\n{markdown_table(frame, COMPARISON_COLUMNS)}\n")
    return [out, chart]
