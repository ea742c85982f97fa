"""``python -m jax_impl.bench.collectives`` on the 8 fake CPU devices: checked results, records, failures as rows.

Checked: each op over "fsdp" of a dp=2 x fsdp=4 mesh passes its result check and records n = 4, the mesh,
and bandwidths that follow from its size and median (nccl-tests' factors); a broken collective (an
identity in place of the op) is caught by the check and recorded as an error row; a size that does not
split into n chunks is an error row while the other sizes still run; bad flags are one-line errors; the
report draws a plot and a table from the records.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from analysis.collectives import write_collectives_report  # noqa: E402
from analysis.records import read_records  # noqa: E402
from jax_impl.bench import collectives  # noqa: E402

FLAGS = ["--mesh", "dp=2,fsdp=4", "--axis", "fsdp", "--device", "cpu", "--warmup", "1", "--iters", "3"]


def test_every_op_is_checked_and_recorded(tmp_path):
    out = tmp_path / "coll.jsonl"
    assert collectives.main([*FLAGS, "--sizes", "64KB,96KB", "--out", str(out)]) == 0
    records = read_records(out)
    assert sorted((r.implementation, r.metrics["size"]) for r in records) == sorted(
        (op, size) for op in ("all_reduce", "all_gather", "reduce_scatter") for size in ("64KB", "96KB"))
    for r in records:
        assert r.status == "ok" and r.backend == "jax" and r.suite == "collectives"
        assert r.world_size == 4 and r.mesh == {"dp": 2, "fsdp": 4, "tp": 1} and r.metrics["devices"] == 8
        seconds = r.timing["median_ms"] / 1e3
        factor = 2 * 3 / 4 if r.implementation == "all_reduce" else 3 / 4
        assert r.metrics["algbw_gbps"] == pytest.approx(r.metrics["bytes"] / seconds / 1e9)
        assert r.metrics["busbw_gbps"] == pytest.approx(r.metrics["algbw_gbps"] * factor)
    plot, table = write_collectives_report(out)
    assert plot.stat().st_size > 0 and "reduce_scatter" in table and table.count("\n") == 1 + len(records)


def test_wrong_results_and_bad_sizes_are_rows(tmp_path, monkeypatch):
    out = tmp_path / "coll.jsonl"
    monkeypatch.setattr(collectives, "_collective", lambda op, axis: lambda x: x)  # no communication at all
    assert collectives.main([*FLAGS, "--ops", "all_reduce,reduce_scatter", "--sizes", "4KB", "--out", str(out)]) == 1
    records = read_records(out)
    assert [r.implementation for r in records] == ["all_reduce", "reduce_scatter"]
    for r in records:
        assert r.status == "error" and f"{r.implementation} over 'fsdp' gave a wrong result" in r.error
        assert r.timing is None
    monkeypatch.undo()
    out2 = tmp_path / "sizes.jsonl"
    assert collectives.main([*FLAGS, "--ops", "all_gather", "--sizes", "8,4KB", "--out", str(out2)]) == 1
    bad, good = read_records(out2)
    assert bad.status == "error" and "not divisible into 4" in bad.error
    assert good.status == "ok"


def test_bad_flags_give_one_line_errors():
    with pytest.raises(SystemExit, match="accepted: dp, fsdp, tp"):
        collectives.main([*FLAGS[:2], "--axis", "pp"])
    with pytest.raises(SystemExit, match="unknown collective 'broadcast'"):
        collectives.main([*FLAGS, "--ops", "broadcast"])
    with pytest.raises(SystemExit, match="binary units"):
        collectives.main([*FLAGS, "--sizes", "1XB"])
