"""``python -m analysis.reports``: every suite of every record file gets its report, from the records alone."""

import shutil
from pathlib import Path

import pytest

from analysis import reports
from analysis.records import Record, append_records

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_reports_from_committed_records(tmp_path):
    """The committed records (attention, all-reduce, precision, e2e-style) all render."""
    for name in ("attention_leaderboard_h100.jsonl", "allreduce_gloo_cpu.jsonl", "precision_cpu.jsonl",
                 "foundation_h100.jsonl"):
        shutil.copy(RESULTS / name, tmp_path / name)
    assert reports.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    index = (out / "index.md").read_text()
    # the leaderboard's shapes span several (batch, heads) groups: one plot per group
    for name in ("attention_leaderboard_h100.md", "attention_leaderboard_h100_latency_bf16_batch-size1_heads16.png",
                 "allreduce_gloo_cpu_busbw.png", "precision_cpu.md", "foundation_h100.md"):
        assert (out / name).stat().st_size > 0 and name in index
    assert "| fp16 | fp16 | 9.953125 |" in (out / "precision_cpu.md").read_text()
    assert "jit naive" in (out / "foundation_h100.md").read_text()


def test_generic_suite_shows_scalar_metrics_and_failures(tmp_path):
    append_records(tmp_path / "mixed.jsonl", [
        Record(suite="e2e", backend="torch", implementation="eager sdpa", metrics={"loss_last": 1.5, "losses": [2, 1]}),
        Record(suite="e2e", backend="jax", implementation="jit naive", status="oom", error="RESOURCE_EXHAUSTED"),
    ])
    assert reports.main([str(tmp_path)]) == 0
    text = (tmp_path / "reports" / "mixed.md").read_text()
    assert "metrics.loss_last" in text and "metrics.losses" not in text
    assert "RESOURCE_EXHAUSTED" in text


def test_empty_folder_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reports.main([str(tmp_path)])
    assert exit_info.value.code == 2 and "no *.jsonl record files" in capsys.readouterr().err


def test_every_record_file_in_results_reads():
    """``python -m analysis.reports`` reads every ``results/*.jsonl``: probe outputs that are not records belong in
    ``results/profiles/``."""
    from analysis.records import read_records

    for path in sorted(RESULTS.glob("*.jsonl")):
        assert read_records(path), path
