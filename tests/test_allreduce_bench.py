"""The all-reduce benchmark: size parsing, bandwidth arithmetic, and a real 2-rank gloo run under torchrun.

The torchrun run (``python -m torch.distributed.run --nproc_per_node 2 -m torch_impl.bench.allreduce``) uses
tiny sizes and is bounded by a subprocess timeout; its records are checked field by field, with the bus
bandwidth recomputed by hand (S / t * 2 (n - 1) / n, in 10**9 bytes/s) rather than by the calculator.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.records import read_records
from tests._dist import free_port
from torch_impl.bench.allreduce import bandwidths, main, parse_size, size_label

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text,nbytes", [("1MB", 2**20), ("10MB", 10 * 2**20), ("1GB", 2**30), ("64KiB", 65536),
                                          ("4096", 4096), ("0.5MB", 2**19), (" 2 gib ", 2 * 2**30)])
def test_parse_size_binary_units(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["1TB", "MB", "-1MB", "0", "6", "1.5B", "ten"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_size_label_round_trips():
    for text in ("4KB", "1MB", "100MB", "1GB", "12B"):
        assert size_label(parse_size(text)) == text


def test_bandwidths_by_hand():
    # 1 GiB in 10 ms over 4 ranks: algbw = 2**30 / 0.01 / 1e9 = 107.374 GB/s; busbw = algbw * 2 * 3 / 4.
    algbw, busbw = bandwidths(2**30, 4, 0.01)
    assert algbw == pytest.approx(107.3741824)
    assert busbw == pytest.approx(107.3741824 * 1.5)
    assert bandwidths(2**20, 1, 1.0)[1] == 0.0  # one rank moves nothing over the bus


def test_torchrun_two_gloo_ranks_writes_records_and_plot(tmp_path):
    out = tmp_path / "allreduce.jsonl"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "torch_impl.bench.allreduce", "--backend", "gloo",
           "--sizes", "4KB,64KB", "--warmup", "2", "--iters", "4", "--timeout", "30", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "busbw" in proc.stdout  # rank 0's progress lines

    records = read_records(out)
    assert [r.metrics["bytes"] for r in records] == [4096, 65536]  # one record per size, rank 0 only
    for r in records:
        assert (r.suite, r.backend, r.implementation, r.world_size, r.dtype) == (
            "allreduce", "torch", "gloo all_reduce", 2, "fp32")
        assert r.status == "ok" and r.timed_steps == 4 and r.warmup_steps == 2
        m = r.metrics
        seconds = r.timing["median_ms"] / 1e3
        assert m["algbw_gbps"] == pytest.approx(m["bytes"] / seconds / 1e9)
        assert m["busbw_gbps"] == pytest.approx(m["bytes"] / seconds * 2 * (2 - 1) / 2 / 1e9)
        assert m["raw_busbw_gbps"] == pytest.approx(m["bytes"] / (m["raw_loop_ms"] / 1e3) / 1e9)
        assert m["busbw_over_raw"] == pytest.approx(m["busbw_gbps"] / m["raw_busbw_gbps"])
        assert len(m["per_rank_median_ms"]) == 2 and len(m["raw_loop_per_rank_ms"]) == 2
        # A call's time is the slowest rank's, and a median of per-call maxima is >= every rank's own median.
        assert r.timing["median_ms"] >= max(m["per_rank_median_ms"]) - 1e-9
        assert m["raw_loop_ms"] == max(m["raw_loop_per_rank_ms"])

    plot = tmp_path / "busbw.png"
    assert main(["--report-only", str(out), "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 0


def test_report_only_without_records_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["--report-only", str(empty)])
    assert exc.value.code == 2
