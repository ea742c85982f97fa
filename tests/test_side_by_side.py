"""analysis.side_by_side: configurations lined up across backends, the fastest of each compared, files written.

Records are built here with random times (the report is a function of records only), so each check
recomputes its expectation from the drawn numbers: the fastest implementation per backend, the JAX / PyTorch
ratio, the global batch of per-rank (ddp suite) records, the latest of repeated records, failures kept.
"""

from __future__ import annotations

import random

import pytest

from analysis.records import Record, append_records
from analysis.reports import write_reports
from analysis.side_by_side import head_to_head, main, scaling, side_by_side_frame


def _record(backend: str, impl: str, ms: float | None, *, batch: int = 8, world: int = 1, suite: str = "e2e",
            status: str = "ok", peak: int | None = None) -> Record:
    r = Record(suite=suite, backend=backend, implementation=impl, model="small", batch_size=batch, seq_len=512,
               dtype="bf16", mode="train_step", world_size=world, peak_memory_bytes=peak, status=status,
               error=None if status == "ok" else "CUDA out of memory")
    r.provenance["device_name"] = "NVIDIA H100 80GB HBM3"
    if ms is not None:
        r.timing = {"median_ms": ms}
        r.tokens_per_s = batch * world * 512 / (ms / 1e3) if suite == "ddp" else batch * 512 / (ms / 1e3)
    return r


def test_head_to_head_picks_the_fastest_of_each_backend(tmp_path):
    rng = random.Random()
    times = {impl: rng.uniform(10, 100) for impl in ("eager sdpa", "compiled sdpa", "jit naive", "jit dot_product")}
    records = [_record("torch" if impl.endswith("sdpa") else "jax", impl, ms, peak=2**30) for impl, ms in times.items()]
    records.append(_record("torch", "eager naive", None, status="oom"))
    records.append(_record("jax", "jit naive", times["jit naive"] * 2))  # a later re-run of the same configuration
    # 4 ranks x 2 sequences (ddp, per rank) against JAX's global batch of 8 on 4 devices: the same configuration.
    ddp_ms, fsdp_ms = rng.uniform(10, 100), rng.uniform(10, 100)
    records += [_record("torch", "bucketed 25MB", ddp_ms, batch=2, world=4, suite="ddp"),
                _record("jax", "jit naive fsdp", fsdp_ms, batch=8, world=4)]
    frame = side_by_side_frame(records)
    assert len(frame) == 7  # the repeated jit naive counted once (the later one)
    assert frame.loc[frame["implementation"] == "jit naive", "median_ms"].item() == times["jit naive"] * 2
    assert set(frame.loc[frame["devices"] == 4, "global_batch"]) == {8}

    pairs = head_to_head(frame).set_index("devices")
    best_torch = min(("eager sdpa", "compiled sdpa"), key=times.get)
    jax_times = {"jit dot_product": times["jit dot_product"], "jit naive": times["jit naive"] * 2}
    best_jax = min(jax_times, key=jax_times.get)
    one = pairs.loc[1]
    assert one["torch"] == best_torch and one["jax"] == best_jax
    assert one["jax_over_torch_time"] == pytest.approx(jax_times[best_jax] / times[best_torch])
    assert pairs.loc[4, "jax_over_torch_time"] == pytest.approx(fsdp_ms / ddp_ms)

    # Weak scaling: the 4-device runs (global batch 8) against the fastest 1-device run at batch 2.
    single = {"torch": rng.uniform(5, 50), "jax": rng.uniform(5, 50)}
    records += [_record(b, "base", ms, batch=2) for b, ms in single.items()]
    weak = side_by_side_frame(records).pipe(scaling).set_index("backend")
    assert weak.loc["torch", "scaling_efficiency"] == pytest.approx(single["torch"] / ddp_ms)
    assert weak.loc["jax", "scaling_efficiency"] == pytest.approx(single["jax"] / fsdp_ms)

    path = tmp_path / "runs.jsonl"
    append_records(path, records)
    assert main([str(path), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "side_by_side.md").read_text()
    assert "oom" in text and "bucketed 25MB" in text and best_torch in text and "Scaling efficiency" in text
    for name in ("throughput", "memory"):
        assert (tmp_path / "report" / f"side_by_side_{name}.png").stat().st_size > 0
    # The one command that regenerates every report includes it.
    written = write_reports(tmp_path, tmp_path / "reports")
    assert tmp_path / "reports" / "side_by_side" / "side_by_side.md" in written
    assert "side_by_side/side_by_side.md" in (tmp_path / "reports" / "index.md").read_text()


def test_no_step_records_is_a_one_line_error(tmp_path):
    path = tmp_path / "other.jsonl"
    append_records(path, Record(suite="allreduce", backend="torch", implementation="gloo all_reduce"))
    with pytest.raises(SystemExit, match="no step-benchmark records"):
        main([str(path), "--out", str(tmp_path / "out")])
