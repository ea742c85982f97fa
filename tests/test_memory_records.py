"""The calculator's single-GPU training-step peak (``per_device_memory(..., peak_model="timeline")``) against the
committed 2.7B records of one H100 (results/memory_h100.jsonl: batch 4, context 128-1,024, fp32 and bf16 autocast,
eager SDPA; results/checkpointing_h100.jsonl: 4 x 2,048 bf16, our Triton kernel, checkpointing every 1-8 blocks,
flat and nested), and the fidelity report's recomputation against what the benchmarks stored at run time.

Achieved: every ok train-step row of both files within 1.4% (-0.2% to -1.0% for memory_h100, -1.3% to -1.4% for the
checkpointing rows), with RMSNorm counted as CUDA's fused kernel keeps it (its input and rsqrt; the written-out count,
which also keeps x / rms, gave up to +3.23%), the plain loss's buffers at its backward and cuBLAS's workspaces. The one
failed row (no checkpointing at 4 x 2,048: out of memory) is predicted above the card's 79.18 GiB. Not explained
here: see notes/fidelity.md (compiled steps, CUDA graph pools, data-parallel wrappers, XLA).
"""

from pathlib import Path

import pytest

from analysis.data_parallel import LEADERBOARD_SUITE
from analysis.fidelity import QKV_PRODUCT, memory_breakdown, memory_prediction
from analysis.harness import calculator_terms
from analysis.records import read_records
from analysis.tables import load_records
from parallelism_calc.memory import CUDA_LIBRARY_WORKSPACES, per_device_memory
from parallelism_calc.specs import ModelSpec

RESULTS = Path(__file__).resolve().parent.parent / "results"
FILES = ("memory_h100.jsonl", "checkpointing_h100.jsonl")
ACHIEVED = 0.014  # the worst |predicted / measured - 1| over the rows below: 1.35%
H100_CAPACITY = 79.18 * 2**30  # what torch reports for an H100 80GB HBM3 (the OOM record's message)


def _step_records(name):
    path = RESULTS / name
    if not path.exists():
        pytest.skip(f"{path} not committed")
    return [r for r in read_records(path) if r.mode == "train_step"]


def _predict(record):
    attention = record.implementation.split()[1].rstrip(",")  # "eager sdpa", "eager flash_triton, ckpt 2 nested"
    precision, attention = calculator_terms(record.dtype, attention)
    return per_device_memory(ModelSpec(**record.model_dims), "ddp", 1, record.batch_size * record.seq_len,
                             record.seq_len, precision, attention=attention, peak_model="timeline",
                             checkpoint_every=record.metrics.get("checkpoint_every"),
                             nested_checkpoint=bool(record.metrics.get("nested_checkpoint")),
                             workspaces=CUDA_LIBRARY_WORKSPACES,
                             qkv_product=record.provenance.get("date", "") >= QKV_PRODUCT)  # the model as it ran


@pytest.mark.parametrize("name", FILES)
def test_single_gpu_peaks_within_the_achieved_error(name):
    rows = [r for r in _step_records(name) if r.status == "ok"]
    assert rows
    errors = {}
    for record in rows:
        predicted = _predict(record).total
        errors[record.implementation, record.dtype, record.seq_len] = predicted / record.peak_memory_bytes - 1
        # The fidelity report reads the same number from the calculator, not the one stored at run time.
        assert memory_prediction(record) == (predicted, "timeline")
    outside = {k: f"{e:+.2%}" for k, e in errors.items() if abs(e) > ACHIEVED}
    assert not outside, outside


def test_the_out_of_memory_run_is_predicted_above_the_card():
    failed = [r for r in _step_records("checkpointing_h100.jsonl") if r.status == "oom"]
    for record in failed:
        assert _predict(record).total > H100_CAPACITY, record.implementation


def test_checkpointing_peaks_fall_in_the_last_segment_s_backward():
    for record in _step_records("checkpointing_h100.jsonl"):
        k = record.metrics.get("checkpoint_every")
        if record.status == "ok" and k:
            pred = _predict(record)
            # nested: one block recomputed at a time, the first block's backward is the worst moment; flat: the
            # top block of the first segment, right after the segment is recomputed (every gradient but k blocks').
            block = 0 if record.metrics.get("nested_checkpoint") else k - 1
            assert pred.peak_at == f"backward, block {block}", record.implementation


# From 767b604 (``analysis.fidelity.QKV_PRODUCT``) until 4d360ae's fix, ``jax_impl.bench.e2e`` stored its memory
# prediction with the calculator's default of one q, k, v product (the torch model's); the JAX model has three,
# which the report's recomputation counts (one record: results/jax_fidelity_h200_1f53e87.jsonl's naive step)
JAX_ONE_PRODUCT = ("2026-11-28T09:37:58+00:00", "2026-11-28T14:20:00+00:00")


def test_recomputed_predictions_read_each_configuration_as_its_benchmark_did(monkeypatch):
    """Every JAX record keeps the benchmark's own ("sum") formula: recomputing it from the record gives the stored
    number. Every leaderboard record keeps its call (our FSDP's or FSDP2's timeline), whose count has changed since
    (session 40): with the device terms its predictions were stored with (the written-out RMSNorm, no workspaces:
    what ``device_terms`` gives a CPU) a fused-loss record's is reproduced whole on one rank less the reduce-scatter
    buffers our FSDP never holds there (``fsdp_terms``, session 41); on more, whose records hold the reduce-scatter
    buffers of a constant at every backward moment, u p (1 + (k + 1) (1 + 1 / N)), it holds the units in flight at
    the peak's moment instead (``reduce_scatter_queue``, session 42 (helper)), less; a plain-loss record's, which now
    has the loss's buffers too, in the terms that read the configuration (world size, FSDP flavour, precision:
    weights, masters, AdamW state, gathered window). The DDP family's, ZeRO-2's and the FSDPs' multi-rank records
    are placed in the step with their buckets (ZeRO-2: its gradient slices) or gathered and reduce-scatter buffers,
    as one process's are."""
    import analysis.fidelity
    import analysis.harness

    as_stored = analysis.harness.device_terms("cpu")
    for module in (analysis.fidelity, analysis.harness):
        monkeypatch.setattr(module, "device_terms", lambda device_type: as_stored)
    calculator = analysis.fidelity.per_device_memory
    checked = {"sum": 0, LEADERBOARD_SUITE: 0, "fused loss": 0}
    for record in load_records([RESULTS]):
        stored = record.metrics.get("predicted_memory_bytes")
        if record.mode != "train_step" or record.status != "ok" or not stored:
            continue
        one_product = record.backend == "jax" and JAX_ONE_PRODUCT[0] <= record.provenance.get("date", "") < \
            JAX_ONE_PRODUCT[1]  # stored counting one q, k, v product, as the JAX benchmark did then
        monkeypatch.setattr(analysis.fidelity, "per_device_memory", (lambda *a, **k: calculator(
            *a, **{**k, "qkv_product": True})) if one_product else calculator)
        breakdown, model = memory_breakdown(record)
        what = (record.suite, record.implementation, model)
        assert breakdown is not None, what
        if model == "sum":
            assert breakdown.total == pytest.approx(stored, rel=1e-12), what
            checked["sum"] += 1
        elif record.suite == LEADERBOARD_SUITE:
            terms = ("params", "master", "optimizer", "gathered")
            assert {t: getattr(breakdown, t) for t in terms} == \
                pytest.approx({t: record.metrics["predicted_memory"][t] for t in terms}, rel=1e-12), what
            checked[LEADERBOARD_SUITE] += 1
            if record.metrics["loss"] == "fused":
                one_rank = record.world_size == 1 and record.metrics["dist"] == "fsdp"
                held = record.metrics["predicted_memory"]["reduce_scatter"]
                if one_rank:
                    assert breakdown.reduce_scatter == 0.0, what
                    assert breakdown.total == pytest.approx(stored - held, rel=1e-12), what
                else:  # what is in flight at the peak's moment, under the constant the record was stored with
                    assert 0.0 < breakdown.reduce_scatter < held and breakdown.total < stored, what
                checked["fused loss"] += 1
        else:
            assert model in ("timeline", "timeline, compiled"), what
            assert record.world_size == 1 or record.metrics.get("strategy") in ("ddp", "zero1", "zero2", "fsdp"), what
    assert min(checked.values()) >= 1, checked


def test_fsdp_and_torch_ddp_rows_within_5_percent_once_the_leaked_model_is_counted():
    """The 2-H200 side-by-side launch at 106d7e6 (results/side_by_side_mesh_2xh200.jsonl: 2.7B, 4 x 512 a rank, bf16
    autocast, eager, cuDNN attention) ran bucketed, torch DDP, our FSDP and FSDP2 in one process, before the leak fix
    (fc529ad): bucketed's weights and buckets (P x 8 bytes, 25.4 GiB) stayed allocated beside the three after it.
    With that leftover (analysis.fidelity.leftover_bytes) and the FSDPs' timeline (reduce-scatter buffers, the
    compute-dtype residual stream) every row is within 5% (FSDP +2.1%, FSDP2 +2.7%, torch DDP +0.8%)."""
    from analysis.fidelity import fidelity_rows

    rows = [row for row in fidelity_rows(load_records([RESULTS / "side_by_side_mesh_2xh200.jsonl"]))
            if row.record.backend == "torch" and row.record.world_size > 1]
    impls = {row.record.metrics["impl"]: row for row in rows}
    assert set(impls) == {"bucketed", "torch_ddp", "fsdp", "fsdp2"}
    assert "left allocated" not in impls["bucketed"].memory_model
    for impl in ("torch_ddp", "fsdp", "fsdp2"):
        row = impls[impl]
        assert "left allocated" in row.memory_model and row.memory_model.startswith("timeline"), impl
        assert abs(row.memory_error) < 0.05, (impl, row.memory_error)
