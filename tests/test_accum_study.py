"""The batch x accumulation study on CPU: 2 gloo ranks under torchrun, settings 1x4 / 2x2 / 4x1 of tiny through
the real trainer; the summary's breakdown recomputed from the epoch records; the table, best setting and
charts regenerated from the records; bad settings are one-line errors."""

from __future__ import annotations

import statistics

import pytest

from analysis.records import read_records
from torch_impl.bench.accum_study import main, parse_settings
from torch_impl.train import STEP_PHASES


def test_settings_run_and_report(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    argv = ["--settings", "1x4,2x2,4x1", "--nproc", "2", "--model", "tiny", "--seq-len", "16", "--epochs", "2",
            "--steps-per-epoch", "2", "--dtype", "fp32", "--device", "cpu", "--cell-timeout", "120",
            "--train-args", f"--val-batches 1 --builtin-mb 0.25 --cache-dir {tmp_path / 'cache'}",
            "--out", str(tmp_path / "study.jsonl"), "--report-dir", str(tmp_path / "report")]
    assert main(argv) == 0
    records = read_records(tmp_path / "study.jsonl")
    summaries = [r for r in records if r.suite == "accum_study"]
    assert [(s.batch_size, s.metrics["grad_accum"], s.status) for s in summaries] == [(1, 4, "ok"), (2, 2, "ok"),
                                                                                       (4, 1, "ok")]
    for s in summaries:
        epochs = [r for r in records if r.suite == "train" and r.metrics.get("run") == s.metrics["run"]]
        assert len(epochs) == 2 and all(r.metrics["global_batch"] == 8 for r in epochs)  # 2 ranks x 4 fixed
        for phase in STEP_PHASES:  # the median over the epochs after the first (one here)
            assert s.metrics["phase_ms"][phase] == epochs[1].phases[phase]["median_ms"]
        assert s.metrics["step_ms"] == epochs[1].timing["median_ms"]
        assert s.tokens_per_s == statistics.median([epochs[1].tokens_per_s])
    best = max(summaries, key=lambda s: s.tokens_per_s)
    table = (tmp_path / "report" / "accum_study.md").read_text()
    assert f"Best setting: {best.batch_size}x{best.metrics['grad_accum']} " in table
    assert all((tmp_path / "report" / f"{name}.png").stat().st_size > 0 for name in ("accum_phases", "accum_throughput"))


def test_bad_settings():
    assert parse_settings("16x64, 1024x1") == [(16, 64), (1024, 1)]
    with pytest.raises(ValueError, match="must be the same everywhere"):
        parse_settings("16x64,32x64")
    with pytest.raises(ValueError, match="write LOCALxACCUM"):
        parse_settings("16by64")
    with pytest.raises(SystemExit):
        main(["--settings", "2x2", "--dist", "none"])
