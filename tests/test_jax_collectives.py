"""``python -m jax_impl.bench.collectives`` on the 8 fake CPU devices: checked results, records, failures as rows.

Checked: each op over "fsdp" of a dp=2 x fsdp=4 mesh passes its result check and records n = 4, the mesh,
and bandwidths that follow from its size and median (nccl-tests' factors), the raw loop's by the same formula
from the same size; the raw loop is one compiled program of ``--iters`` chained collectives (counted in its
HLO), its result checked like the measured op's, and a chain that XLA collapses is an error row; a broken
collective (an identity in place of the op) is caught by the check and recorded as an error row; a size that
does not split into n chunks is an error row while the other sizes still run; XLA options are compile options
recorded with the environment; bad flags are one-line errors; the report draws a plot and a table from the
records and sets them against PyTorch NCCL's.
"""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("jax")

import jax  # noqa: E402

from analysis.collectives import nccl_comparison, write_collectives_report  # noqa: E402
from analysis.records import Record, read_records, save_records, timing_stats  # noqa: E402
from jax_impl.bench import collectives  # noqa: E402
from jax_impl.sharding import make_mesh  # noqa: E402

FLAGS = ["--mesh", "dp=2,fsdp=4", "--axis", "fsdp", "--device", "cpu", "--warmup", "1", "--iters", "3"]
OPS = ("all_reduce", "all_gather", "reduce_scatter")


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("dp=2,fsdp=4", jax.devices("cpu"))


def test_every_op_is_checked_and_recorded(tmp_path):
    out = tmp_path / "coll.jsonl"
    assert collectives.main([*FLAGS, "--sizes", "64KB,96KB", "--out", str(out)]) == 0
    records = read_records(out)
    assert sorted((r.implementation, r.metrics["size"]) for r in records) == sorted(
        (op, size) for op in OPS for size in ("64KB", "96KB"))
    for r in records:
        m = r.metrics
        assert r.status == "ok" and r.backend == "jax" and r.suite == "collectives"
        assert r.world_size == 4 and r.mesh == {"dp": 2, "fsdp": 4, "tp": 1} and m["devices"] == 8
        seconds = r.timing["median_ms"] / 1e3
        factor = 2 * 3 / 4 if r.implementation == "all_reduce" else 3 / 4
        assert m["algbw_gbps"] == pytest.approx(m["bytes"] / seconds / 1e9)
        assert m["busbw_gbps"] == pytest.approx(m["algbw_gbps"] * factor)
        # The raw loop: the same bytes and formula, its time per collective of one program of --iters of them.
        raw_seconds = m["raw_loop_ms"] / 1e3
        assert m["raw_loop_iters"] == m["raw_loop_collectives"] == 3
        assert len(m["raw_loop_calls_ms"]) == collectives.RAW_CALLS
        assert m["raw_loop_ms"] == pytest.approx(statistics.median(m["raw_loop_calls_ms"]) / 3)
        assert m["raw_algbw_gbps"] == pytest.approx(m["bytes"] / raw_seconds / 1e9)
        assert m["raw_busbw_gbps"] == pytest.approx(m["raw_algbw_gbps"] * factor)
        assert m["busbw_over_raw"] == pytest.approx(m["busbw_gbps"] / m["raw_busbw_gbps"])
        assert m["xla"] == "stock" and m["xla_options"] == {}
        assert "--xla_force_host_platform_device_count=8" in m["env"]["XLA_FLAGS"]
    plot, table = write_collectives_report(out)
    assert plot.stat().st_size > 0 and "reduce_scatter" in table and table.count("\n") == 1 + len(records)


@pytest.mark.parametrize("op", OPS)
def test_raw_loop_is_one_program_of_chained_collectives(mesh, op):
    programs = collectives.build(mesh, "fsdp", op, 64 * 1024, iters=5)
    assert collectives.count_collectives(programs.run.as_text(), op) == 1
    assert programs.raw_collectives == collectives.count_collectives(programs.raw.as_text(), op) == 5
    assert programs.check(programs.raw(programs.x, programs.zero), "raw") is None
    # The chain updates one buffer in place: its scratch memory does not grow with its length.
    shorter = collectives.build(mesh, "fsdp", op, 64 * 1024, iters=2)
    assert programs.raw.memory_analysis().temp_size_in_bytes == shorter.raw.memory_analysis().temp_size_in_bytes
    measured = collectives.measure(programs, warmup=0, iters=2)
    assert measured["error"] is None and measured["raw_iters"] == 5
    assert measured["raw_ms"] == pytest.approx(statistics.median(measured["raw_calls_ms"]) / 5)


def test_raw_loop_results_and_compiled_chain_are_checked(tmp_path, monkeypatch):
    original = collectives.raw_loop_body

    def shifted(collective, iters):  # right op, wrong values: the raw loop's own check must catch it
        chain = original(collective, iters)
        return lambda x, zero: chain(x, zero) + 1

    monkeypatch.setattr(collectives, "raw_loop_body", shifted)
    out = tmp_path / "shifted.jsonl"
    assert collectives.main([*FLAGS, "--ops", "all_gather", "--sizes", "4KB", "--out", str(out)]) == 1
    (record,) = read_records(out)
    assert record.status == "error" and "all_gather raw loop over 'fsdp' gave a wrong result" in record.error

    def independent(collective, iters):  # no data dependence: XLA keeps one collective of the --iters
        def chain(x, zero):
            results = [collective(x) for _ in range(iters)]
            return results[-1]
        return chain

    monkeypatch.setattr(collectives, "raw_loop_body", independent)
    out = tmp_path / "merged.jsonl"
    assert collectives.main([*FLAGS, "--ops", "all_reduce", "--sizes", "4KB", "--out", str(out)]) == 1
    (record,) = read_records(out)
    assert record.status == "error" and "compiled raw loop holds 1 all_reduce ops, fewer than 3" in record.error


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


def test_xla_options_are_compile_options_and_recorded(tmp_path):
    assert collectives.parse_xla_options("stock") == {}
    assert collectives.parse_xla_options("tuned") == collectives.TUNED_XLA_OPTIONS
    assert collectives.parse_xla_options("tuned,xla_gpu_enable_latency_hiding_scheduler=false,xla_x=1.5") == {
        **collectives.TUNED_XLA_OPTIONS, "xla_gpu_enable_latency_hiding_scheduler": False, "xla_x": 1.5}
    spec = "tuned,xla_gpu_nccl_collective_max_nchannels=16"
    out = tmp_path / "tuned.jsonl"
    assert collectives.main([*FLAGS, "--ops", "all_gather", "--sizes", "4KB", "--xla-options", spec,
                             "--out", str(out)]) == 0
    (record,) = read_records(out)
    assert record.status == "ok" and record.metrics["xla"] == spec
    assert record.metrics["xla_options"] == {**collectives.TUNED_XLA_OPTIONS,
                                             "xla_gpu_nccl_collective_max_nchannels": 16}
    _, table = write_collectives_report(out)
    assert spec in table


def test_report_sets_jax_against_pytorch_nccl(tmp_path):
    out = tmp_path / "coll.jsonl"
    assert collectives.main([*FLAGS, "--sizes", "4KB", "--out", str(out)]) == 0
    nccl = tmp_path / "allreduce.jsonl"
    for nbytes, busbw in ((4096, 2.0), (8192, 3.0)):  # NCCL all-reduce records as torch_impl.bench.allreduce writes
        record = Record(suite="allreduce", backend="torch", implementation="nccl all_reduce", world_size=4,
                        timing=timing_stats([1.0]), metrics={"bytes": nbytes, "comm_backend": "nccl",
                                                             "busbw_gbps": busbw, "raw_busbw_gbps": 2 * busbw})
        record.provenance["device_name"] = "cpu"
        save_records(nccl, record)
    table = nccl_comparison(out, nccl)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 and "jax_over_nccl" in lines[0]  # one row per op at 4KB, none at 8KB
    jax_records = {r.implementation: r.metrics for r in read_records(out)}
    for line in lines[2:]:
        op = next(op for op in OPS if f" {op} " in line)
        assert f"{jax_records[op]['busbw_gbps'] / 2.0:.4g}" in line
        assert f"{jax_records[op]['raw_busbw_gbps'] / 4.0:.4g}" in line
    with pytest.raises(ValueError, match="no successful NCCL"):
        nccl_comparison(out, out)


def test_bad_flags_give_one_line_errors():
    with pytest.raises(SystemExit, match="accepted: dp, fsdp, tp"):
        collectives.main([*FLAGS[:2], "--axis", "pp"])
    with pytest.raises(SystemExit, match="unknown collective 'broadcast'"):
        collectives.main([*FLAGS, "--ops", "broadcast"])
    with pytest.raises(SystemExit, match="binary units"):
        collectives.main([*FLAGS, "--sizes", "1XB"])
    with pytest.raises(SystemExit, match="No such compile option: 'xla_no_such_option'"):
        collectives.main([*FLAGS, "--xla-options", "xla_no_such_option=1"])
    with pytest.raises(SystemExit, match="is not stock, tuned or xla_NAME=VALUE"):
        collectives.main([*FLAGS, "--xla-options", "fast"])
