"""The fidelity report (``analysis.fidelity``) on fixture records: the floor it shows is the calculator's on the
recorded ceilings, rows it cannot predict say why, and the CLI writes the report and its chart."""

import dataclasses

import pytest

from analysis.allreduce import ALLREDUCE_SUITE
from analysis.fidelity import (CODE_CHANGES, COPY_ENGINE_STAGING, HOST_PACED_TIME, INDIVIDUAL_HELD_GRADIENTS,
                               attention_of, fidelity_rows, main, memory_breakdown, memory_prediction, predict,
                               profile_records, summary, _commit_of, _frame)
from analysis.harness import JAX_REMAT_RECOMPUTES
from analysis.records import Record, save_records, timing_stats
from parallelism_calc.roofline import Ceilings, step_time_floor
from parallelism_calc.memory import CUDA_LIBRARY_WORKSPACES, per_device_memory
from parallelism_calc.specs import MODELS, ParallelSpec

H100 = "NVIDIA H100 80GB HBM3"
SPEC = MODELS["small"]


def _record(suite="e2e", device=H100, median=100.0, **fields) -> Record:
    base = dict(suite=suite, backend="torch", implementation="compiled sdpa_cudnn", model=SPEC.name,
                model_dims=dataclasses.asdict(SPEC), batch_size=4, seq_len=512, dtype="bf16", mode="train_step",
                timing=timing_stats([median]), peak_memory_bytes=2 * 2**30,
                metrics={"predicted_peak_bytes": 2.5 * 2**30})
    record = Record(**{**base, **fields})
    record.provenance["device_name"] = device
    return record


def _ceilings(device=H100) -> list[Record]:
    matmul = Record(suite="ceilings", backend="torch", implementation="matmul", dtype="bf16", tflops=700.0)
    copy = Record(suite="ceilings", backend="torch", implementation="copy", dtype="fp32",
                  metrics={"bytes_per_s": 3e12})
    for r in (matmul, copy):
        r.provenance["device_name"] = device
    return [matmul, copy]


def test_floor_and_memory_errors_are_the_calculator_s():
    step = _record()
    row, = fidelity_rows([*_ceilings(), step])
    floor = step_time_floor(SPEC, 4, 512, "train_step", "bf16_autocast", Ceilings(700e12, 3e12))
    assert row.floor_ms == pytest.approx(floor.total_s * 1e3)
    assert row.time_error == pytest.approx(floor.total_s * 1e3 / 100.0 - 1)
    # Memory: recomputed from the calculator (one torch device: the peak placed in the step; the record's blocks are
    # compiled: what Inductor saves, with the e2e benchmark's compiled loss), not the stored 2.5 GiB.
    peak = per_device_memory(SPEC, "ddp", 1, 4 * 512, 512, "bf16_autocast", attention="flash", peak_model="timeline",
                             compiled=True, compiled_loss=True, workspaces=CUDA_LIBRARY_WORKSPACES)
    assert (row.predicted_memory, row.memory_model) == (peak.total, "timeline, compiled")
    assert row.memory_error == pytest.approx(peak.total / (2 * 2**30) - 1)
    assert row.why == ""


def test_memory_prediction_falls_back_to_the_stored_value_and_says_so():
    # A JAX record without the metrics the calculator needs keeps what its benchmark stored; none stored: the row
    # says why not; a record whose benchmark stored none is predicted all the same; no measured peak: nothing to hold.
    unknown = _record(backend="jax", metrics={"predicted_memory_bytes": 3 * 2**30})
    assert memory_prediction(unknown) == (3 * 2**30, "stored at run time")
    assert memory_prediction(_record(backend="jax", metrics={})) == (None, "not predicted: the record has no "
                                                                           "'attention'")
    assert memory_prediction(_record(metrics={}))[1] == "timeline, compiled"
    assert memory_prediction(_record(metrics={}, peak_memory_bytes=None)) == (None, "")
    jax = _record(backend="jax", mesh={"dp": 1, "fsdp": 1, "tp": 1},
                  metrics={"predicted_memory_bytes": 1.0, "attention": "dot_product_cudnn", "strategy": "dp",
                           "remat": "full"})
    expected = per_device_memory(SPEC, "ddp", ParallelSpec(dp=1), 4 * 512, 512, "bf16_autocast", "full", "flash",
                                 fused_norm=False, qkv_product=False)  # JAX's RMSNorm written out, 3 products
    assert memory_prediction(jax) == (expected.total, "sum")
    # Eager blocks keep the eager count; compiled ones (by name, or the DDP benchmark's metric) Inductor's
    assert memory_prediction(_record(implementation="eager sdpa_cudnn"))[1] == "timeline"
    assert memory_prediction(_record(implementation="stock compiled sdpa_cudnn"))[1] == "timeline, compiled"
    assert memory_prediction(_record(implementation="compiled naive"))[1] == "timeline"  # compiled count: flash only
    # The e2e benchmark compiles our plain loss (its buffers not counted); the stock model's and the DDP benchmark's
    # one-GPU baseline run it eagerly (its two fp32 N x V gradients at the loss's backward)
    buffers = 4 * 512 * SPEC.vocab_size * 8
    assert memory_breakdown(_record(implementation="compiled sdpa_cudnn"))[0].loss_buffers == 0
    assert memory_breakdown(_record(implementation="stock compiled sdpa_cudnn"))[0].loss_buffers == buffers
    baseline = _record(suite="ddp", implementation="none", world_size=1,
                       metrics={"predicted_memory_bytes": 1.0, "compiled": True, "attention": "sdpa_cudnn"})
    assert memory_breakdown(baseline)[0].loss_buffers == buffers
    assert memory_breakdown(_record(implementation="eager sdpa_cudnn"))[0].loss_buffers == buffers
    assert attention_of(_record(implementation="stock compiled sdpa_cudnn, cuda graph")) == "sdpa_cudnn"
    assert attention_of(_record(implementation="eager flash_triton, ckpt 2 nested")) == "flash_triton"


def test_a_copy_engine_row_names_what_its_prediction_leaves_out():
    ddp = dict(suite="ddp", world_size=2, mesh={"dp": 2})
    engines = _record(**ddp, metrics={"predicted_memory_bytes": 2**30, "impl": "bucketed", "engine": "copy_engines"})
    nccl = _record(**ddp, metrics={"predicted_memory_bytes": 2**30, "impl": "bucketed", "engine": "nccl"})
    individual = _record(**ddp, metrics={"predicted_memory_bytes": 2**30, "impl": "individual", "engine": "nccl"})
    assert COPY_ENGINE_STAGING in predict(engines, {}, {}).memory_model
    assert COPY_ENGINE_STAGING not in predict(nccl, {}, {}).memory_model
    assert INDIVIDUAL_HELD_GRADIENTS in predict(individual, {}, {}).memory_model
    assert INDIVIDUAL_HELD_GRADIENTS not in predict(engines, {}, {}).memory_model


def test_rows_without_what_they_need_say_why():
    no_ceilings = _record(device="NVIDIA H200")
    two_ranks = _record(suite="ddp", world_size=2, mesh={"dp": 2})
    tensor_parallel = _record(suite="side_by_side", backend="jax", world_size=2, mesh={"tp": 2})
    cpu, failed = _record(device="cpu"), _record(status="oom", error="out of memory")
    rows = fidelity_rows([*_ceilings(), no_ceilings, two_ranks, tensor_parallel, cpu, failed])
    assert [r.record for r in rows] == [no_ceilings, two_ranks, tensor_parallel]  # CPU and failed runs: no rows
    assert "no measured ceilings for NVIDIA H200" in rows[0].why
    assert "no NCCL all-reduce recorded over 2" in rows[1].why
    assert "tensor parallelism" in rows[2].why
    assert all(r.floor_ms is None for r in rows)


def test_data_parallel_floor_adds_the_measured_all_reduce():
    allreduce = Record(suite="allreduce", backend="torch", implementation="nccl all_reduce", world_size=2,
                       metrics={"comm_backend": "nccl", "bytes": 2**30, "busbw_gbps": 300.0})
    allreduce.provenance["device_name"] = H100
    step = _record(suite="ddp", world_size=2, mesh={"dp": 2})
    row, = fidelity_rows([*_ceilings(), allreduce, step])
    assert row.comm_floor_ms == pytest.approx(2 * 0.5 * SPEC.n_params() * 4 / 300e9 * 1e3)
    frame = _frame([row])
    table = summary(frame)
    assert table.loc[0, "time: predicted"] == 1 and table.loc[0, "memory: within 5%"] == 0


def _attention(seq_len: int, tflops: float, implementation="sdpa_cudnn", device=H100) -> Record:
    record = Record(suite="attention", backend="torch", implementation=implementation, dtype="bf16",
                    mode="forward_backward", seq_len=seq_len, tflops=tflops,
                    metrics={"causal": True, "head_dim": SPEC.d_model // SPEC.n_heads, "heads": 16})
    record.provenance["device_name"] = device
    return record


def test_the_attention_kernel_s_measured_rate_at_the_nearest_length_times_its_core():
    measured = [_attention(256, 200.0), _attention(2048, 350.0), _attention(2048, 900.0, "flex"),
                _attention(512, 999.0, device="NVIDIA H200")]
    cudnn, default, jax, fp32, other = (
        _record(), _record(implementation="compiled sdpa"), _record(backend="jax", implementation="scan"),
        _record(dtype="fp32"), _record(implementation="compiled flash_triton"))
    rows = fidelity_rows([*_ceilings(), *measured, cudnn, default, jax, fp32, other])
    # 512 tokens: 256 is nearer than 2,048 on a log scale (2x against 4x); the default SDPA ran cuDNN's kernels
    assert [r.attention_flops for r in rows] == [200e12, 200e12, None, None, None]
    floor = step_time_floor(SPEC, 4, 512, "train_step", "bf16_autocast", Ceilings(700e12, 3e12, attention_flops=200e12))
    assert rows[0].floor_ms == pytest.approx(floor.total_s * 1e3) and floor.attention_s > 0
    assert _frame(rows)["attention TFLOP/s"].tolist()[:2] == [200.0, 200.0]


def test_an_accumulated_step_is_floored_as_all_its_micro_batches():
    # The trainer's record times an optimizer step of grad_accum micro-batches (the accumulation study: 16 x 64
    # against 1,024 x 1): its floor is one step over all of them, not one micro-batch's.
    accumulated = _record(suite="train", batch_size=16, metrics={"grad_accum": 64})
    whole = _record(suite="train", batch_size=1024, metrics={"grad_accum": 1})
    rows = fidelity_rows([*_ceilings(), accumulated, whole])
    floor = step_time_floor(SPEC, 1024, 512, "train_step", "bf16_autocast", Ceilings(700e12, 3e12))
    assert [r.floor_ms for r in rows] == pytest.approx([floor.total_s * 1e3] * 2)


def test_cli_writes_report_and_chart(tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    save_records(records, [*_ceilings(), _record(), _record(device="NVIDIA H200")])
    out = tmp_path / "reports" / "fidelity.md"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## By suite" in text and "## Not predicted" in text and "fidelity.png" in text
    assert out.with_suffix(".png").stat().st_size > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main([str(empty), "--out", str(tmp_path / "x.md")])
    assert exit_info.value.code == 2
    assert "no GPU train-step records" in capsys.readouterr().err


def test_ceilings_benchmark_writes_what_the_report_reads(tmp_path):
    from analysis.fidelity import device_ceilings
    from analysis.records import read_records
    from torch_impl.bench import ceilings

    out = tmp_path / "ceilings.jsonl"
    assert ceilings.main(["--device", "cpu", "--size", "64", "--copy-gib", "0.001", "--iters", "2", "--repeats", "2",
                          "--warmup", "1", "--out", str(out)]) == 0
    records = read_records(out)
    assert [r.implementation for r in records] == ["matmul 64x64x64", "matmul 64x64x64", "copy 0.001 GiB"]
    measured = device_ceilings(records)["cpu"]
    assert set(measured) == {"bf16", "fp32", "copy"} and all(v > 0 for v in measured.values())
    matmul = records[0]
    assert matmul.tflops == pytest.approx(2 * 64**3 / (matmul.timing["median_ms"] / 1e3) / 1e12)


def test_a_checkpointed_step_s_floor_counts_what_its_backward_recomputes():
    """A step checkpointing every block recomputes each block's forward (without the attention it kept) and, with
    the fused loss, the head's logits: the floor is the calculator's for that step. A global batch over ranks (the
    leaderboard benchmark's ``batch_per_rank``) is floored per rank."""
    ckpt = _record(metrics={"checkpoint_every": 1, "keep_attention": True, "loss": "fused"})
    sharded = _record(suite="leaderboard", batch_size=2, world_size=2, mesh={"fsdp": 2},
                      metrics={"batch_per_rank": 1, "checkpoint_every": 1})
    bus = Record(suite=ALLREDUCE_SUITE, backend="torch", implementation="nccl", world_size=2,
                 metrics={"comm_backend": "nccl", "bytes": 10**9, "busbw_gbps": 300.0})
    bus.provenance["device_name"] = H100
    rows = fidelity_rows([*_ceilings(), bus, ckpt, sharded])
    ceilings = Ceilings(700e12, 3e12)
    floor = step_time_floor(SPEC, 4, 512, "train_step", "bf16_autocast", ceilings, recompute_blocks=1, loss="fused",
                            kept_attention=True)
    assert rows[0].floor_ms == pytest.approx(floor.total_s * 1e3)
    assert rows[0].floor_ms > step_time_floor(SPEC, 4, 512, "train_step", "bf16_autocast", ceilings).total_s * 1e3
    per_rank = step_time_floor(SPEC, 1, 512, "train_step", "bf16_autocast", Ceilings(700e12, 3e12, 300e9),
                               "fsdp", 2, recompute_blocks=1)
    assert rows[1].floor_ms == pytest.approx(per_rank.total_s * 1e3)


def test_times_beyond_the_bound_say_why_where_the_records_do():
    """A step whose sibling with twice the tokens takes 1.2x the time is host-paced; an eager step is named so; a
    compiled step without a measured attention rate says so where its attention, at the slowest rate measured for
    any kernel (here 20% of the matmul rate, on another GPU), could make the gap, and says nothing where it could not
    (its sibling, 15x its floor); a step within 25% of its floor needs no why."""
    slowest = [_attention(512, 140.0, device="OTHER GPU"), *_ceilings("OTHER GPU")]
    floor_ms = fidelity_rows([*_ceilings(), _record()])[0].floor_ms
    long = fidelity_rows([*_ceilings(), _record(batch_size=1, seq_len=16384)])[0]  # attention ~half the floor
    small, doubled = _record(median=100.0), _record(batch_size=8, median=120.0)
    eager = _record(implementation="eager sdpa", median=100.0)
    within = _record(suite="e2e_sweep", median=floor_ms * 1.1)
    slow = _record(suite="e2e_sweep", batch_size=1, seq_len=16384, median=long.floor_ms * 2)
    rows = fidelity_rows([*_ceilings(), *slowest, small, doubled, eager, within, slow])
    assert [row.time_why.split(":")[0] for row in rows] == ["host-paced", "", "eager", "",
                                                            "attention at the matmul rate"]
    assert rows[0].time_why == "host-paced: 2x the tokens in 1.20x the time (8 x 512)"
    core, kernel = rows[4].attention_at_matmul_ms, rows[4].attention_kernel_at_matmul_ms
    assert rows[4].time_why == (f"attention at the matmul rate: {core:.1f} ms in the floor, no measured rate for "
                                f"sdpa_cudnn on {H100} (a kernel at the slowest measured, 20% of the matmul rate, "
                                f"would take {kernel / 0.2:.1f})")
    # the floor's own split: the core at the matmul rate in its products; the kernel's FLOPs, 3.5 passes to 3
    assert kernel == pytest.approx(core * 3.5 / 3) and 0 < core < long.floor_ms
    assert long.floor_ms <= kernel / 0.2 - core  # that gap within what the attention could add
    assert 120.0 - rows[1].floor_ms > rows[1].attention_kernel_at_matmul_ms / 0.2  # this one not
    table = summary(_frame(rows)).set_index("suite")
    assert table.loc["e2e", "time: beyond 25%, no why"] == 1 and table.loc["e2e_sweep", "time: within 25%"] == 1


def test_a_host_bound_step_and_a_fixed_cost_say_so():
    """A step without CUDA graphs whose graphed sibling takes half the time is host-bound; a step whose sibling
    with 4x the tokens lies on the same line as the floors' plus a fixed cost the floor lacks has a fixed cost."""
    f1, f4 = (fidelity_rows([*_ceilings(), _record(batch_size=b)])[0].floor_ms for b in (4, 16))
    plain = _record(suite="ddp", median=100.0, metrics={"cuda_graph": "off"})
    graphed = _record(suite="ddp", median=50.0, metrics={"cuda_graph": "blocks"})
    one, four = _record(suite="e2e_sweep", median=2 * f1), _record(suite="e2e_sweep", batch_size=16, median=f4 + f1)
    assert f4 + f1 > HOST_PACED_TIME * 2 * f1  # not host-paced: the fixed cost is what is left
    rows = fidelity_rows([*_ceilings(), plain, graphed, one, four])
    assert rows[0].time_why == "host-bound: replayed as CUDA graphs (blocks), the same step takes 0.50x the time"
    floor_fixed = f1 - (f4 - f1) / 3  # the floors' own line (the optimizer's time is per step): 2,048 and 8,192
    assert rows[2].time_why == (f"a fixed cost: {f1 + floor_fixed:.0f} ms a step against the floor's {floor_fixed:.0f}"
                                " (host, launches); per token within 0% of the floor (time = fixed + tokens x cost, "
                                "with 16 x 512)")
    assert not rows[3].time_why.startswith("a fixed")  # no sibling with more tokens: no line to read it from


def test_memory_beyond_the_bound_says_why_where_a_known_gap_explains_it():
    """Under the measurement: a reserved-bytes peak names that; outside the timeline (the "sum" of the JAX rows), a
    gap no larger than the plain loss's buffers (N V 8 bytes in the backward, which that model leaves out) names
    those; the timeline counts them, so there the same gap, and a larger one, stay without a why."""
    batch = 64  # 32,768 tokens: the buffers (2.4 GiB) are a good part of the peak
    predicted = fidelity_rows([*_ceilings(), _record(batch_size=batch)])[0].predicted_memory
    jax = dict(backend="jax", implementation="jit dot_product_cudnn", mesh={"dp": 1, "fsdp": 1, "tp": 1})
    jax_metrics = {"predicted_memory_bytes": 1.0, "attention": "dot_product_cudnn", "strategy": "dp", "remat": "none"}
    jax_predicted = fidelity_rows([*_ceilings(), _record(batch_size=batch, metrics=jax_metrics, **jax)])[0]
    buffers = batch * 512 * SPEC.vocab_size * 8
    reserved = _record(batch_size=batch, peak_memory_bytes=predicted * 1.2,
                       metrics={"predicted_peak_bytes": 1.0, "peak_memory_kind": "reserved"})
    loss = _record(batch_size=batch, peak_memory_bytes=jax_predicted.predicted_memory + buffers / 2,
                   metrics=jax_metrics, **jax)
    in_timeline = _record(batch_size=batch, peak_memory_bytes=predicted + buffers / 2)
    larger = _record(batch_size=batch, peak_memory_bytes=predicted + 2 * buffers)
    rows = fidelity_rows([*_ceilings(), reserved, loss, in_timeline, larger])
    assert jax_predicted.memory_model == "sum" and rows[2].memory_model.startswith("timeline")
    assert all(row.memory_error < -0.05 for row in rows)
    assert rows[0].memory_why.startswith("measured: the allocator's reserved bytes")
    assert rows[1].memory_why == (f"the plain loss's working buffers, up to {buffers / 2**30:.1f} GiB, are not counted "
                                  "(notes/leaderboard.md)")
    assert rows[2].memory_why == rows[3].memory_why == ""
    table = summary(_frame(rows))  # by suite and strategy: the JAX row's "dp" apart from the torch rows' "none"
    assert table[["suite", "strategy"]].values.tolist() == [["e2e", "dp"], ["e2e", "none"]]
    assert table.set_index("strategy").loc["none", "memory: beyond 5%, no why"] == 2
    # the stock reference model is another model's code: the calculator's count is ours
    stock = _record(implementation="stock compiled sdpa_cudnn", batch_size=batch)
    stock, = fidelity_rows([*_ceilings(), dataclasses.replace(
        stock, peak_memory_bytes=fidelity_rows([*_ceilings(), stock])[0].predicted_memory * 1.2)])
    assert stock.memory_why == "the stock reference model: the calculator counts our model's saved tensors"


def _at(record: Record, commit: str, date: str) -> Record:
    record.provenance.update(git_commit=commit, date=date)
    return record


def test_the_same_step_at_another_commit_says_why():
    """A step beyond its bound with no why of its own borrows the same step's, measured within the bound of it, at
    another commit: within the floor's (prediction's) bound there, naming the latest such commit, else that commit's
    why, named; memory likewise. A step measured further off lends nothing, nor does a why found so."""
    floor, predicted = (lambda row: (row.floor_ms, row.predicted_memory))(
        fidelity_rows([*_ceilings(), _attention(512, 300.0), _record()])[0])
    slow = _at(_record(median=1.45 * floor, peak_memory_bytes=1.08 * predicted), "aaaaaaa1", "2026-11-01")
    fast = _at(_record(median=1.2 * floor, peak_memory_bytes=1.04 * predicted), "bbbbbbb2", "2026-11-02")
    earlier = _at(_record(median=1.15 * floor, peak_memory_bytes=predicted), "ccccccc3", "2026-10-01")
    far = _at(_record(median=3 * floor, peak_memory_bytes=1.3 * predicted), "ddddddd4", "2026-10-02")
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), slow, fast, earlier, far])
    assert rows[0].time_why == f"at bbbbbbb the same step takes {1.2 * floor:.1f} ms, within 25% of the floor"
    assert rows[0].memory_why == (f"at bbbbbbb the same step peaks at {1.04 * predicted / 2**30:.1f} GiB, within 5% "
                                  "of the prediction")
    assert rows[3].time_why == rows[3].memory_why == ""  # 3x the floor: the others were not measured like it

    def ddp(median: float, commit: str, date: str, **metrics) -> Record:
        return _at(_record(suite="ddp", implementation="none", median=median * floor,
                           metrics={"compiled": True, "attention": "sdpa_cudnn", **metrics}), commit, date)

    # host-bound at its own commit (a graphed sibling at half the time); before metrics.cuda_graph existed = "off"
    plain, graphed = ddp(3.0, "eeeeeee5", "1", cuda_graph="off"), ddp(1.4, "eeeeeee5", "1", cuda_graph="blocks")
    latest, between = ddp(3.1, "fffffff6", "9"), ddp(3.05, "ggggggg7", "5", cuda_graph="off")
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), plain, graphed, latest, between])
    assert rows[0].time_why.startswith("host-bound: replayed as CUDA graphs (blocks)")
    # each borrows eeeeeee's own why, not the latest row's borrowed one
    assert rows[2].time_why == rows[3].time_why == f"{rows[0].time_why} (so measured at eeeeeee)"


def test_a_trainer_step_quotes_the_e2e_benchmark_s_same_step():
    """A trainer row beyond its bound whose step the e2e benchmark ran (our model, the same tokens, attention,
    compilation and CUDA graphs) quotes that step's why or bound, and what the trainer's loop adds to it; an e2e step
    replaying the whole step as one graph is not a trainer's step without graphs."""
    floor = fidelity_rows([*_ceilings(), _attention(512, 300.0), _record()])[0].floor_ms

    def e2e(implementation: str, median: float, batch_size: int = 4) -> Record:
        return _at(_record(implementation=implementation, median=median, batch_size=batch_size), "bbbbbbb2", "2")

    def trainer(graph: str, median: float, **fields) -> Record:
        metrics = {"compiled": True, "cuda_graph": graph, "grad_accum": 1, "attention": "sdpa_cudnn"}
        return _at(_record(suite="train", implementation="none", median=median, metrics=metrics, **fields),
                   "aaaaaaa1", "1")

    per_block, whole = (e2e("compiled sdpa_cudnn, cuda graph per block", 1.2 * floor),
                        e2e("compiled sdpa_cudnn, cuda graph", 1.2 * floor))
    graphed = trainer("blocks", 1.2 * floor + 40, phases={"data": timing_stats([1.0])})
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), per_block, whole, graphed,
                          trainer("off", 1.2 * floor + 40)])
    assert rows[2].time_why == (f"the trainer's loop adds 40.0 ms a step (data on the host 1.0) to the e2e benchmark's "
                                f"same step, {1.2 * floor:.1f} ms at bbbbbbb: within 25% of the floor")
    assert rows[3].time_why == ""  # the e2e steps replayed graphs; this one did not
    # an e2e step explained by its own siblings (host-paced) is quoted with its why
    paced, doubled = e2e("compiled sdpa_cudnn", 3 * floor), e2e("compiled sdpa_cudnn", 3.3 * floor, batch_size=8)
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), paced, doubled, trainer("off", 3 * floor + 5)])
    assert rows[0].time_why.startswith("host-paced")
    assert rows[2].time_why == (f"the trainer's loop adds 5.0 ms a step to the e2e benchmark's same step, "
                                f"{3 * floor:.1f} ms at bbbbbbb: {rows[0].time_why}")



def test_a_jax_trainer_step_quotes_jax_s_e2e_benchmark_on_as_many_devices():
    """JAX's e2e benchmark (whatever its suite: its command says which benchmark) ran the trainer's step on as many
    devices: the trainer quotes its own why, and names a change of our code the trainer ran before; an e2e step whose
    why was borrowed from another run is not quoted, nor one on another number of devices."""
    jax = dict(backend="jax", implementation="jit naive fsdp", world_size=2, mesh={"fsdp": 2})
    bus = Record(suite=ALLREDUCE_SUITE, backend="torch", implementation="nccl", world_size=2,
                 metrics={"comm_backend": "nccl", "bytes": 10**9, "busbw_gbps": 300.0})
    bus.provenance["device_name"] = H100
    floor = fidelity_rows([*_ceilings(), bus, _record(**jax)])[0].floor_ms
    e2e = _at(_profiled(_record(suite="jax_fidelity", median=floor * 2, **jax), floor / 2, floor * 1.4, idle=0.1),
              "b" * 40, "2026-11-28T00:00:00+00:00")
    e2e.provenance["command"] = "python3 -m jax_impl.bench.e2e --model small --mesh fsdp=2"
    trainer = _at(_record(suite="train", median=floor * 2.2, dtype="bf16_mixed",
                          **{**jax, "metrics": {"grad_clip": 1.0, "attention": "naive"}}),
                  "a" * 40, "2026-11-24T00:00:00+00:00")
    e2e_mixed = dataclasses.replace(e2e, dtype="bf16_mixed", provenance=dict(e2e.provenance))
    rows = fidelity_rows([*_ceilings(), bus, e2e_mixed, trainer])
    assert rows[0].time_why.startswith("profiled a step (its profile): ")
    assert rows[1].time_why == (f"the trainer's loop adds {floor * 0.2:.1f} ms a step to the e2e benchmark's same "
                                f"step, {floor * 2:.1f} ms at bbbbbbb: {rows[0].time_why}; the trainer ran before "
                                f"e9bb371 ({CODE_CHANGES[2].what})")
    one_device = dataclasses.replace(e2e_mixed, world_size=1, mesh=None, provenance=dict(e2e.provenance))
    assert fidelity_rows([*_ceilings(), bus, one_device, trainer])[1].time_why == ""
    # the e2e step's why borrowed from another run's profile: no evidence for a third
    plain = _at(dataclasses.replace(e2e_mixed, metrics={}, provenance=dict(e2e.provenance)), "c" * 40,
                "2026-11-28T00:00:00+00:00")
    rows = fidelity_rows([*_ceilings(), bus, plain, trainer], [e2e_mixed])
    assert "time" in rows[0].borrowed and rows[1].time_why == ""


def test_an_e2e_step_replayed_as_graphs_is_the_same_step_s_sibling():
    """The e2e benchmark names its CUDA graphs in the implementation ("..., cuda graph"): a step without them whose
    graphed sibling (same tokens and commit) takes under 1 / HOST_PACED_TIME of its time is host-bound."""
    floor = fidelity_rows([*_ceilings(), _attention(512, 300.0), _record()])[0].floor_ms
    plain, graphed = _record(median=3 * floor), _record(implementation="compiled sdpa_cudnn, cuda graph",
                                                         median=1.2 * floor)
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), plain, graphed])
    assert rows[0].time_why == "host-bound: replayed as CUDA graphs (step), the same step takes 0.40x the time"
    # the graphs' part of the name may come before others
    from analysis.fidelity import _graphs, _implementation

    fused = _record(implementation="compiled sdpa_cudnn, cuda graph per block, fused loss")
    assert (_graphs(fused), _implementation(fused)) == ("blocks", "compiled sdpa_cudnn, fused loss")


def test_a_step_run_before_a_change_of_our_code_says_so(monkeypatch):
    """A row beyond its bounds, run before changes of ``CODE_CHANGES`` that touch it, names them and the same step's
    first run after them all that is nearer its floor (prediction) and within the bound or explained by its own
    records; a run between the changes, after them, one they do not touch, an undated one, and a run further off
    lend or get nothing, nor does a why found so."""
    import analysis.fidelity as fidelity

    monkeypatch.setattr(fidelity, "CODE_CHANGES", (
        fidelity.CodeChange("ccccccc", "2026-11-05", "what it changed", lambda r: r.batch_size == 4),
        fidelity.CodeChange("eeeeeee", "2026-11-07", "and more", lambda r: r.batch_size == 4),
        fidelity.CodeChange("hhhhhhh", "2026-11-08", "not this step", lambda r: False)))
    floor, predicted = (lambda row: (row.floor_ms, row.predicted_memory))(
        fidelity_rows([*_ceilings(), _attention(512, 300.0), _record()])[0])

    def run(median: float, memory: float, commit: str, date: str | None, batch_size: int = 4) -> Record:
        record = _record(median=median * floor, peak_memory_bytes=memory * predicted, batch_size=batch_size)
        return _at(record, commit, date)

    before, between = run(2.0, 1.1, "aaaaaaa", "2026-11-01"), run(1.0, 1.0, "bbbbbbb", "2026-11-06")
    first, latest = run(1.1, 1.01, "ddddddd", "2026-11-10"), run(1.0, 1.0, "fffffff", "2026-11-12")
    later = run(1.8, 1.09, "ggggggg", "2026-11-09")  # after the changes, comparable to `before`
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), before, between, first, latest, later])
    assert rows[0].time_why == (f"run before ccccccc (what it changed); eeeeeee (and more). Since, the same step "
                                f"takes {1.1 * floor:.1f} ms at ddddddd: within 25% of the floor")
    assert rows[0].memory_why == (f"run before ccccccc (what it changed); eeeeeee (and more). Since, the same step "
                                  f"peaks at {1.01 * predicted / 2**30:.1f} GiB at ddddddd: within 5% of the "
                                  "prediction")
    assert rows[4].time_why == rows[4].memory_why == ""  # run after the changes; `before`'s why is not its evidence

    # a run after the changes explained by its own records (host-paced) lends that why, if nearer its floor
    paced, doubled = run(1.9, 1.0, "ddddddd", "2026-11-10"), run(2.0, 1.0, "ddddddd", "2026-11-10", batch_size=8)
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), before, paced, doubled])
    assert rows[1].time_why.startswith("host-paced")
    assert rows[0].time_why.endswith(f"takes {1.9 * floor:.1f} ms at ddddddd: {rows[1].time_why}")
    nearer = run(1.5, 1.0, "aaaaaaa", "2026-11-01")  # the explained run after the changes is further off
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), nearer, paced, doubled])
    assert rows[0].time_why == ""

    untouched, faster = (run(2.0, 1.0, "fffffff", "2026-11-01", batch_size=8),
                         run(1.1, 1.0, "ggggggg", "2026-11-10", batch_size=8))
    undated, no_commit = run(2.0, 1.0, "aaaaaaa", None), run(2.0, 1.0, None, "2026-11-01")
    rows = fidelity_rows([*_ceilings(), _attention(512, 300.0), untouched, faster, undated, first, no_commit])
    assert rows[0].time_why == ""  # the changes do not touch 8 x 512
    assert rows[2].time_why == ""  # undated: not known to be run before the changes
    assert rows[4].time_why.startswith("run before ccccccc")  # a record without its commit


def test_the_code_changes_are_dated_in_the_order_they_landed():
    from datetime import datetime

    from analysis.fidelity import CODE_CHANGES

    dates = [datetime.fromisoformat(c.date) for c in CODE_CHANGES]  # compared as text with the records' UTC dates
    assert dates == sorted(dates) and all(c.date.endswith("+00:00") and len(c.date) == 25 for c in CODE_CHANGES)
    assert all(len(c.commit) == 7 and c.what for c in CODE_CHANGES)


def test_the_trainer_s_memory_and_the_model_as_it_was():
    """A trainer record is predicted with its implementation (``metrics.dist``), its micro-batches (every gradient
    alive past the first) and its eager plain loss; a record run before FUSED_RMS_NORM with our RMSNorm written out;
    a run's first epoch beyond the bound whose later epochs are within it says so; another run's epochs do not."""
    trainer = _record(suite="train", implementation="bucketed 25MB", world_size=2,
                      metrics={"dist": "bucketed", "grad_accum": 4, "compiled": False, "attention": "sdpa"})
    terms = dict(attention="flash", fused_norm=True, workspaces=CUDA_LIBRARY_WORKSPACES, peak_model="timeline",
                 gradient_buckets=4)
    expected = per_device_memory(SPEC, "ddp", 2, 2 * 4 * 512, 512, "bf16_autocast", grad_accum=4, **terms)
    assert memory_prediction(trainer) == (expected.total, "timeline")
    old = _at(_record(implementation="eager sdpa", metrics={}), "aaaaaaa", "2026-11-22T00:00:00+00:00")
    written_out = per_device_memory(SPEC, "ddp", 1, 4 * 512, 512, "bf16_autocast", **{
        **terms, "fused_norm": False, "qkv_product": False, "gradient_buckets": 0})  # the model before both
    assert memory_prediction(old)[0] == written_out.total > memory_prediction(_record(implementation="eager sdpa",
                                                                                      metrics={}))[0]
    # a one-GPU compiled trainer's plain loss runs eagerly: its buffers are counted (the e2e benchmark compiles it)
    one = _record(suite="train", implementation="none", metrics={"dist": "none", "compiled": True, "attention": "sdpa"})
    assert memory_breakdown(one)[0].loss_buffers > 0 == memory_breakdown(_record())[0].loss_buffers
    # a run's first epoch beyond the bound, its later epochs within it
    first, *later = (dataclasses.replace(trainer, peak_memory_bytes=peak * expected.total,
                                         metrics={**trainer.metrics, "epoch": epoch, "run": "r"})
                     for epoch, peak in ((1, 1.1), (2, 1.01), (3, 1.0)))
    rows = fidelity_rows([*_ceilings(), first, *later])
    assert rows[0].memory_why == (f"the run's first epoch: its 2 later epochs peak at {expected.total / 2**30:.2f}-"
                                  f"{1.01 * expected.total / 2**30:.2f} GiB, within 5% of the prediction; this one "
                                  f"{0.09 * expected.total / 2**30:.2f} GiB more")
    other_run = dataclasses.replace(first, metrics={**first.metrics, "run": "s"})
    assert fidelity_rows([*_ceilings(), other_run, *later])[0].memory_why == ""


def _profiled(record: Record, matmul: float, rest: float, idle: float | None = None) -> Record:
    """``record`` with the kernel times the JAX benchmark's --profile writes (``time_ms.<category>``)."""
    metrics = {**record.metrics, "time_ms.matmul": matmul, "time_ms.elementwise": rest / 2, "time_ms.other": rest / 2}
    if idle is not None:
        metrics["gpu_idle_ms"] = idle
    return dataclasses.replace(record, metrics=metrics)


def test_a_profile_of_the_row_s_program_says_where_its_step_went(tmp_path):
    """A row beyond the bound whose program was profiled (its own record, else a profiled run of the same program in
    ``results/profiles`` measured within 25% of it, else one that ran faster) says how much of the step went to the
    products, the other kernels and the GPU's idle time against the floor's terms, naming the furthest beyond, and
    what a slower run took beyond that profile; a profile that covers too little of its step, of another program or
    measured slower than the row explains nothing; the folder's files that are not records are passed over."""
    jax = dict(backend="jax", implementation="jit dot_product_cudnn remat:dots_attention",
               metrics={"remat": "dots_attention", "predicted_peak_bytes": 2.5 * 2**30})
    floor = fidelity_rows([*_ceilings(), _record(**jax)])[0]
    products, rest = floor.products_floor_ms, floor.floor_ms - floor.products_floor_ms
    assert 0 < products < floor.floor_ms
    median = floor.floor_ms * 2
    own = _profiled(_record(median=median, **jax), products + 1, rest + median / 2, idle=1.0)
    other = _at(_record(suite="jax_vs_torch", median=median * 1.1, **jax), "b" * 40, "2026-11-27T00:00:00+00:00")
    profile = _at(_profiled(_record(suite="jax_profile", median=median, **jax), products, rest, idle=median - products
                            - rest), "c" * 40, "2026-11-26T00:00:00+00:00")
    folder = tmp_path / "profiles"
    folder.mkdir()
    save_records(folder / "jax_profile.jsonl", [profile, _record(**jax)])  # the second: not profiled
    (folder / "probe.jsonl").write_text('{"kernel": "gemm", "median_us": 3.0}\n')
    profiles = profile_records([tmp_path])
    assert [p.suite for p in profiles] == ["jax_profile"]
    far = _record(suite="jax_far", median=median * 2, **jax)
    thin = _record(suite="jax_thin", backend="jax", implementation="jit dot_product_cudnn", median=median,
                   metrics={"time_ms.matmul": 1.0, "predicted_peak_bytes": 2.5 * 2**30})
    quick = _record(suite="jax_quick", median=median * 0.7, **jax)  # the profiled runs took 1.4x its step
    rows = fidelity_rows([*_ceilings(), own, other, far, thin, quick], profiles)
    assert rows[0].time_why == (f"profiled a step (its profile): GEMMs and attention {products + 1:.0f} ms against the "
                                f"floor's {products:.0f}, the others (elementwise, reductions, copies, "
                                f"collectives) {rest + median / 2:.0f} against its {rest:.0f} (bytes at the copy "
                                f"rate, communication), GPU idle 1; most beyond the floor: the other kernels")
    assert rows[1].time_why.startswith("profiled a step (the same program's profile at ccccccc (jax_profile, ")
    assert rows[1].time_why.endswith("most beyond the floor: the GPU idle (the host's pace)")
    assert "time" in rows[1].borrowed and "time" not in rows[0].borrowed
    # twice the profiled run's time: the same kernels, the rest of its step waiting; a run faster than any profile
    # of its program, or one whose kernels cover 1 ms, is not explained by them
    commit = _commit_of(own)  # the row's own commit's profile first (own, a row profiled at it)
    assert rows[2].time_why.startswith(f"profiled a step (the same program's profile at {commit} (")
    assert rows[2].time_why.endswith(f"; this run took {median:.0f} ms a step more, with the kernels profiled at "
                                     f"{commit}: its GPU waiting on the host or running slower (its steps "
                                     f"{median * 2:.0f} to {median * 2:.0f} ms); most beyond the floor: this run "
                                     f"beyond the profiled step")
    assert rows[3].time_why == "" and rows[4].time_error < -0.25 and rows[4].time_why == ""
    # on a mesh the collectives run beside the other kernels: their times add up beyond the step, the union (busy)
    # does not
    mesh = _profiled(_record(suite="jax_mesh", median=median, **jax), products, rest + median, idle=1.0)
    assert fidelity_rows([*_ceilings(), mesh])[0].time_why == ""
    mesh.metrics["gpu_busy_ms"] = median - 1.0
    assert fidelity_rows([*_ceilings(), mesh])[0].time_why.startswith("profiled a step (its profile): ")
    # a row faster than its floor: its time went nowhere the floor missed (the ceilings are in question)
    fast = _profiled(_record(suite="jax_fast", median=floor.floor_ms / 2, **jax), products / 4, rest / 4, idle=0.0)
    assert fidelity_rows([*_ceilings(), fast])[0].time_error > 0.25
    assert fidelity_rows([*_ceilings(), fast])[0].time_why == ""
    # the row's own profile ran 1.5x its step (the profiler's host cost): the next profile of the program counts; a
    # commit named by 40 characters is the one named by 7
    slowed = _at(_profiled(_record(suite="jax_slowed", median=median, **jax), products, rest, idle=median),
                 "d" * 40, "2026-11-28T00:00:00+00:00")
    same = _at(_profiled(_record(suite="jax_same", median=median * 1.1, **jax), products, rest,
                         idle=median * 1.1 - products - rest), "d" * 7, "2026-11-28T00:00:00+00:00")
    other_commit = _at(_profiled(_record(suite="jax_near", median=median, **jax), products, rest,
                                 idle=median - products - rest), "e" * 40, "2026-11-28T00:00:00+00:00")
    why = fidelity_rows([*_ceilings(), slowed], [other_commit, same])[0].time_why
    assert why.startswith("profiled a step (the same program's profile at ddddddd (jax_same, ")


def test_a_jax_step_s_floor_counts_what_its_remat_policy_recomputes():
    """Full rematerialization recomputes every block's forward, "dots" the attention core (``JAX_REMAT_RECOMPUTES``);
    the policies that keep every product recompute none: the floor is the calculator's for each."""
    ceilings = Ceilings(700e12, 3e12)
    rows = fidelity_rows([*_ceilings(), *(_record(backend="jax", implementation=f"jit naive remat:{remat}",
                                                  metrics={"remat": remat}) for remat in ("full", "dots", "qkv_mlp"))])
    expected = [step_time_floor(SPEC, 4, 512, "train_step", "bf16_autocast", ceilings, **terms).total_s * 1e3
                for terms in ({"recompute_blocks": 1}, {"selective": True}, {})]
    assert [row.floor_ms for row in rows] == pytest.approx(expected)
    assert expected[0] > expected[1] > expected[2]
    pytest.importorskip("jax")
    from jax_impl.train import REMAT_POLICIES

    assert set(JAX_REMAT_RECOMPUTES) <= set(REMAT_POLICIES)  # the names are the JAX step's


def test_each_rank_s_profile_says_where_a_data_parallel_step_went():
    """A DDP-benchmark row beyond the bound with each rank's split in its record (``per_rank_profile_ms``) says, rank
    by rank, its compute, its collectives running alone and its idle time against the floor's compute and
    communication, naming the furthest beyond: here one rank's GPU waiting for its host."""
    bus = Record(suite=ALLREDUCE_SUITE, backend="torch", implementation="nccl", world_size=2,
                 metrics={"comm_backend": "nccl", "bytes": 10**9, "busbw_gbps": 300.0})
    bus.provenance["device_name"] = H100
    fsdp = dict(suite="ddp", world_size=2, mesh={"fsdp": 2}, metrics={"impl": "fsdp", "strategy": "fsdp"})
    floor = fidelity_rows([*_ceilings(), bus, _record(**fsdp)])[0]
    median = floor.floor_ms * 3
    compute, comm = floor.floor_ms - floor.comm_floor_ms, floor.comm_floor_ms
    ranks = [{"span_ms": median, "compute_ms": compute, "comm_ms": median - compute, "both_ms": 0.0, "idle_ms": 0.0},
             {"span_ms": median, "compute_ms": compute, "comm_ms": comm, "both_ms": comm,
              "idle_ms": median - compute}]
    profiled = _record(median=median, **{**fsdp, "metrics": {**fsdp["metrics"], "per_rank_profile_ms": ranks}})
    row = fidelity_rows([*_ceilings(), bus, profiled])[0]
    assert row.time_why == (
        f"profiled a step (its profile): rank 0 compute {compute:.0f} ms, collectives alone {median - compute:.0f}, "
        f"idle 0; rank 1 compute {compute:.0f} ms, collectives alone 0, idle {median - compute:.0f} (the floor: "
        f"compute {compute:.0f}, communication {comm:.0f}; the profiled steps {median:.0f} ms a step); most beyond "
        f"the floor: the GPU idle on rank 1 (its host's pace)")
    unprofiled = fidelity_rows([*_ceilings(), bus, _record(median=median, **fsdp)])[0]
    assert unprofiled.time_why == ""
    # a profile whose steps ran 1.5x the timed ones (the profiler's host cost) stands for no step
    slowed = [{**split, "span_ms": split["span_ms"] * 1.5, "idle_ms": split["idle_ms"] + median / 2} for split in ranks]
    profiled.metrics["per_rank_profile_ms"] = slowed
    assert fidelity_rows([*_ceilings(), bus, profiled])[0].time_why == ""


def test_a_data_parallel_step_beyond_its_launch_s_one_gpu_step_is_its_ranks_waiting():
    """A DDP-benchmark row of two ranks beyond the bound, whose launch's one-GPU step (same commit and baseline key,
    measured before it) is within the bound of its floor, says how far beyond that step it is against the floor's
    communication, phase by phase; without that step in its launch (another commit) it says nothing."""
    bus = Record(suite=ALLREDUCE_SUITE, backend="torch", implementation="nccl", world_size=2,
                 metrics={"comm_backend": "nccl", "bytes": 10**9, "busbw_gbps": 300.0})
    bus.provenance["device_name"] = H100
    common = dict(suite="ddp", metrics={"attention": "sdpa_cudnn", "compiled": True})
    one_floor = fidelity_rows([*_ceilings(), _record(implementation="none", **common)])[0].floor_ms
    phases = {"forward": 30.0, "backward": 60.0, "comm": 0.0, "optimizer": 10.0}

    def step(impl, median, world, commit, date, scale):
        record = _at(_record(implementation=impl, median=median, world_size=world,
                             metrics={**common["metrics"], "impl": impl, "strategy": "fsdp" if world > 1 else "none"},
                             suite="ddp", mesh={"fsdp": world} if world > 1 else None), commit, date)
        record.phases = {p: {"median_ms": ms * scale} for p, ms in phases.items()}
        return record

    one = step("none", one_floor * 1.1, 1, "a" * 40, "2026-11-27T00:00:00+00:00", 1.0)
    fsdp_floor = fidelity_rows([*_ceilings(), bus, step("fsdp", 1.0, 2, "a" * 40, "2026-11-27T01:00:00+00:00",
                                                         1.0)])[0].floor_ms
    sharded = step("fsdp", fsdp_floor * 2, 2, "a" * 40, "2026-11-27T01:00:00+00:00", 2.0)
    elsewhere = step("fsdp", fsdp_floor * 3, 2, "b" * 40, "2026-11-27T02:00:00+00:00", 2.0)  # not like the first
    early = step("fsdp", fsdp_floor * 2, 2, "a" * 40, "2026-11-26T01:00:00+00:00", 2.0)  # before the one-GPU step
    faster = step("fsdp", fsdp_floor / 3, 2, "a" * 40, "2026-11-27T01:00:00+00:00", 0.3)  # faster than its floor
    rows = fidelity_rows([*_ceilings(), bus, one, sharded, elsewhere, early, faster])
    assert rows[3].time_why == "" and rows[4].time_error > 0.25 and rows[4].time_why == ""
    # where less than half the gap lies beyond the one-GPU step (here on a bus so fast the floors nearly meet), the
    # rest is the one GPU's own and the ranks are not its why
    fast = dataclasses.replace(bus, metrics={**bus.metrics, "busbw_gbps": 1e6})
    slow_one = step("none", one_floor * 1.24, 1, "c" * 40, "2026-11-27T00:00:00+00:00", 1.0)
    floor = fidelity_rows([*_ceilings(), fast, step("fsdp", 1.0, 2, "c" * 40, "2026-11-27T01:00:00+00:00",
                                                    1.0)])[0].floor_ms
    median = (floor / 0.75 + 2 * slow_one.median_ms - floor) / 2
    assert floor / 0.75 < median < 2 * slow_one.median_ms - floor
    little = step("fsdp", median, 2, "c" * 40, "2026-11-27T01:00:00+00:00", 1.0)
    assert fidelity_rows([*_ceilings(), fast, slow_one, little])[1].time_why == ""
    waiting = sharded.median_ms - one.median_ms
    assert rows[1].time_why == (
        f"ranks waiting: {waiting:.0f} ms a step beyond the one-GPU step of its launch ({one.median_ms:.1f} ms, "
        f"within 25% of its floor), against the floor's {rows[1].comm_floor_ms:.0f} ms of communication: "
        f"communication the step does not hide, or a peer's host (by phase, ms, one GPU's in brackets: forward 60 "
        f"(30), backward 120 (60), comm 0 (0), optimizer 20 (10))")
    assert rows[2].time_why == ""


def test_the_side_by_side_launch_s_e2e_step_is_its_ranks_one_gpu_step():
    """The side-by-side launch times our one-GPU step with the e2e benchmark before the DDP benchmark's ranks: that
    step (same commit, configuration and device) is the ranks' one-GPU step; the stock reference, JAX's step or
    another configuration's is not."""
    bus = Record(suite=ALLREDUCE_SUITE, backend="torch", implementation="nccl", world_size=2,
                 metrics={"comm_backend": "nccl", "bytes": 10**9, "busbw_gbps": 300.0})
    bus.provenance["device_name"] = H100
    commit = "a" * 40
    one_floor = fidelity_rows([*_ceilings(), _record(implementation="compiled sdpa_cudnn")])[0].floor_ms

    def single(implementation, backend="torch", batch_size=4):
        return _at(_record(suite="side_by_side", implementation=implementation, backend=backend,
                           batch_size=batch_size, median=one_floor * 1.1), commit, "2026-11-27T00:00:00+00:00")

    def sharded(median):
        return _at(_record(suite="ddp", implementation="fsdp2", world_size=2, mesh={"fsdp": 2}, median=median,
                           metrics={"attention": "sdpa_cudnn", "compiled": True, "impl": "fsdp2", "strategy": "fsdp"}),
                   commit, "2026-11-27T01:00:00+00:00")

    ranks = sharded(fidelity_rows([*_ceilings(), bus, sharded(1.0)])[0].floor_ms * 3)
    ours = single("compiled sdpa_cudnn")
    assert fidelity_rows([*_ceilings(), bus, ours, ranks])[1].time_why.startswith(
        f"ranks waiting: {ranks.median_ms - ours.median_ms:.0f} ms a step beyond the one-GPU step of its launch "
        f"({ours.median_ms:.1f} ms")
    for other in (single("stock compiled sdpa_cudnn"), single("jit dot_product_cudnn", backend="jax"),
                  single("eager sdpa_cudnn"), single("compiled sdpa_cudnn", batch_size=8)):
        assert fidelity_rows([*_ceilings(), bus, other, ranks])[1].time_why == ""
