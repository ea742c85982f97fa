"""analysis.plots and analysis.attention on synthetic records: generic line plots, the attention pivot, speed-ups
and report files; the names that moved out of analysis.plots still import from there (for one release)."""

import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from analysis import plots
from analysis.attention import (
    attention_frame, attention_markdown, attention_pivot, plot_attention, speedups, write_attention_report,
)  # fmt: skip
from analysis.plots import line_plot
from analysis.records import Record, append_records, timing_stats

SEQS = (128, 256, 512, 1024)


def record(provider, mode, seq, head_dim=64, dtype="bf16", ms=1.0, status="ok", error=None, device="NVIDIA H100"):
    r = Record(suite="attention", backend="torch", implementation=provider, batch_size=1, seq_len=seq, dtype=dtype,
               mode=mode, status=status, error=error, flops_per_step=2.0 * seq * seq * head_dim,
               metrics={"heads": 16, "head_dim": head_dim, "causal": True}, provenance={"device_name": device})
    if status == "ok":
        r.timing = timing_stats([ms, ms * 1.1, ms * 0.9])
        r.tflops = r.flops_per_step / (ms / 1e3) / 1e12
    return r


def synthetic(tmp_path=None):
    records = []
    for mode, factor in (("forward", 1.0), ("backward", 2.5)):
        for head_dim in (64, 128):
            for seq in SEQS:
                base = factor * seq / 128 * head_dim / 64
                records += [record("flash_triton", mode, seq, head_dim, ms=base),
                            record("sdpa_cudnn", mode, seq, head_dim, ms=base * 0.8),
                            record("naive", mode, seq, head_dim, ms=base * 4)]
    records.append(record("naive", "forward", 2048, 64, status="oom", error="OutOfMemoryError: CUDA out of memory"))
    records.append(record("flash_triton", "forward", 2048, 64, ms=20.0))
    return records


def test_line_plot_grid_and_png(tmp_path):
    frame = pd.DataFrame({"n": [1, 2, 4] * 4, "t": [1, 2, 4, 2, 4, 8] * 2, "who": (["a"] * 3 + ["b"] * 3) * 2,
                          "panel": ["p"] * 6 + ["q"] * 6})  # fmt: skip
    out = tmp_path / "sub" / "lines.png"
    fig = line_plot(frame, "n", "t", hue="who", col="panel", logx=2, logy=True, title="t", out=out)
    assert len(fig.axes) == 2 and fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 2]
    assert out.stat().st_size > 5_000 and matplotlib.image.imread(out).ndim == 3
    with pytest.raises(ValueError, match="unknown column"):
        line_plot(frame, "n", "missing")
    with pytest.raises(ValueError, match="nothing to plot"):
        line_plot(frame.assign(t=None), "n", "t")


def test_every_chart_is_saved_as_png_and_pdf(tmp_path):
    """``save_figure`` (the one place figures are saved): a PDF beside each PNG, with no creation date, so the same
    records give the same bytes; the Agg canvas renders both without a display."""
    frame = pd.DataFrame({"x": [1, 2, 1, 2], "y": [1.0, 2.0, 3.0, None], "run": ["a", "a", "b", "b"],
                          "note": ["", "", "", "oom"]})
    line_plot(frame, "x", "y", hue="run", out=tmp_path / "line.png")
    plots.bar_plot(frame, "x", "y", hue="run", note="note", out=tmp_path / "sub" / "bars.png")
    first = {p.name: p.read_bytes() for p in tmp_path.rglob("*.*")}
    assert sorted(first) == ["bars.pdf", "bars.png", "line.pdf", "line.png"]
    assert first["line.pdf"][:5] == first["bars.pdf"][:5] == b"%PDF-"
    assert first["line.png"][:8] == b"\x89PNG\r\n\x1a\n"
    line_plot(frame, "x", "y", hue="run", out=tmp_path / "line.png")
    assert (tmp_path / "line.pdf").read_bytes() == first["line.pdf"]


def test_plots_never_import_torch():
    code = ("import sys, analysis.plots, analysis.attention, analysis.allreduce, analysis.collectives; "
            "assert 'torch' not in sys.modules, 'analysis imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_old_names_still_import_from_plots():
    from analysis import allreduce, attention, collectives

    assert plots.write_attention_report is attention.write_attention_report
    assert plots.write_allreduce_report is allreduce.write_allreduce_report
    assert plots.write_collectives_report is collectives.write_collectives_report
    assert all(getattr(plots, name) is not None for name in plots.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        plots.nope


def test_attention_pivot_and_speedups():
    frame = attention_frame(synthetic())
    pivot = attention_pivot(frame)
    assert list(pivot.columns[-3:]) == ["flash_triton", "naive", "sdpa_cudnn"]  # benchmark order
    assert len(pivot) == 2 * 2 * len(SEQS) + 1
    first = pivot.iloc[0]
    assert (first["mode"], first["head_dim"], first["seq_len"]) == ("forward", 64, 128)  # forward before backward
    oom = pivot[(pivot["seq_len"] == 2048)].iloc[0]
    assert oom["flash_triton"] == pytest.approx(20.0) and pd.isna(oom["naive"])
    ratio = speedups(pivot)
    assert ratio["vs naive"].iloc[0] == pytest.approx(4.0) and ratio["vs sdpa_cudnn"].iloc[0] == pytest.approx(0.8)


def test_attention_markdown_shows_constants_failures_and_speedups():
    text, speedup = attention_markdown(synthetic())
    assert "Same for every row: device_name=NVIDIA H100, dtype=bf16, causal=True, batch_size=1, heads=16" in text
    assert "| OOM " in text and "## Failed runs" in text and "OutOfMemoryError" in text
    assert speedup in text and "| vs naive " in speedup and "4.00x" in speedup and "0.80x" in speedup
    # A measurement repeated later wins.
    again = [*synthetic(), record("naive", "forward", 2048, 64, ms=50.0)]
    text, _ = attention_markdown(again)
    assert "| OOM " not in text and "50.000" in text


def test_plot_attention_one_pair_per_dtype_and_device(tmp_path):
    records = synthetic() + [record("flash_triton", "forward", s, dtype="fp32", ms=s / 64) for s in SEQS]
    records += [record("flash_triton", "forward", s, device="NVIDIA H200", ms=s / 100) for s in SEQS]
    written = plot_attention(records, tmp_path)
    assert sorted(p.name for p in written) == sorted(
        f"attention_{kind}_{device}_{dtype}.png" for kind in ("latency", "tflops")
        for device, dtype in (("nvidia-h100", "bf16"), ("nvidia-h100", "fp32"), ("nvidia-h200", "bf16")))
    for path in written:
        assert path.stat().st_size > 10_000
    failed_only = [record("naive", "forward", 128, status="error", error="RuntimeError: no kernel")]
    assert plot_attention(failed_only, tmp_path / "none") == []


def test_write_attention_report_from_a_file(tmp_path):
    path = append_records(tmp_path / "runs" / "h100.jsonl", synthetic())
    written, speedup = write_attention_report(path)
    assert [p.name for p in written] == ["h100.md", "h100_latency_bf16.png", "h100_tflops_bf16.png"]
    assert "flash_triton" in speedup
    other = append_records(tmp_path / "e2e.jsonl", Record(suite="e2e", backend="torch", implementation="x"))
    with pytest.raises(ValueError, match="no records of suite 'attention'; suites present: e2e"):
        write_attention_report(other)
