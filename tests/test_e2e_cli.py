"""The step benchmarks of both backends: records they write, same start in both, failures kept as rows."""

import gc
import time

import jax.numpy as jnp
import numpy as np
import pytest

from analysis.harness import frozen_gc
from analysis.records import read_records
from jax_impl.bench.e2e import pipelined_step_times
from parallelism_calc.compute import step_flops
from parallelism_calc.specs import MODELS
from torch_impl.bench import e2e as torch_e2e

# On the CPU in both backends, where fp32 is fp32 everywhere, so the two runs can be compared tightly.
FLAGS = ["--model", "tiny", "--batch-size", "2", "--seq-len", "24", "--warmup", "1", "--steps", "4", "--device", "cpu"]


def test_torch_and_jax_records_start_from_the_same_loss(tmp_path):
    from jax_impl.bench import e2e as jax_e2e

    out, weights = tmp_path / "runs.jsonl", tmp_path / "tiny.npz"
    seed = str(np.random.SeedSequence().entropy % 1000)
    assert torch_e2e.main([*FLAGS, "--seed", seed, "--save-weights", str(weights), "--out", str(out)]) == 0
    assert jax_e2e.main([*FLAGS, "--seed", seed, "--load-weights", str(weights), "--out", str(out)]) == 0
    torch_run, jax_run = read_records(out)
    assert (torch_run.backend, jax_run.backend) == ("torch", "jax")
    for run in (torch_run, jax_run):
        assert run.status == "ok" and run.timed_steps == 4 and len(run.metrics["losses"]) == 5
        assert run.flops_per_step == step_flops(MODELS["tiny"], 2, 24, "train_step")
        assert run.tokens_per_s == pytest.approx(2 * 24 / (run.timing["median_ms"] / 1e3))
        assert run.metrics["loss_last"] < run.metrics["loss_first"]  # AdamW memorizes the fixed batch
    # Same weights and batch: the first losses agree to float32 rounding, and AdamW keeps them together.
    assert jax_run.metrics["loss_first"] == pytest.approx(torch_run.metrics["loss_first"], rel=1e-5)
    np.testing.assert_allclose(jax_run.metrics["losses"], torch_run.metrics["losses"], rtol=1e-3)
    assert set(torch_run.phases) == {"forward", "backward", "optimizer"}


def test_torch_forward_mode_and_failure_is_a_record(tmp_path, monkeypatch):
    out = tmp_path / "runs.jsonl"
    assert torch_e2e.main([*FLAGS, "--mode", "forward", "--out", str(out)]) == 0

    def broken_model(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch_e2e, "TransformerLM", broken_model)
    assert torch_e2e.main([*FLAGS, "--out", str(out)]) == 1
    forward, failed = read_records(out)
    assert forward.mode == "forward" and set(forward.phases) == {"forward"}
    assert forward.metrics["loss_first"] == forward.metrics["loss_last"]  # no training in forward mode
    assert failed.status == "error" and "illegal memory access" in failed.error and failed.timing is None


def test_bad_flags_give_one_line_errors():
    from jax_impl.bench import e2e as jax_e2e

    with pytest.raises(SystemExit, match="accepted: auto, cpu, cuda, cuda:N"):
        jax_e2e.main([*FLAGS, "--device", "tpu"])
    with pytest.raises(SystemExit, match="argument --steps: '0': must be > 0"):
        torch_e2e.main([*FLAGS, "--steps", "0"])
    with pytest.raises(SystemExit, match="analysis-only"):
        torch_e2e.main(["--model", "xxl"])
    with pytest.raises(SystemExit, match="unknown attention backend .flash.; accepted: flash_torch, flash_triton, naive, sdpa, sdpa_cudnn, sdpa_efficient, sdpa_flash"):
        torch_e2e.main([*FLAGS, "--attention", "flash"])


def test_also_times_ours_again_against_the_same_stock_run(tmp_path):
    """``--also``: ours with each named attention backend (and MLP) after ``--attention``'s, one stock run first, every
    one of ours with its ratio to that run; a bad entry is a one-line error before anything runs."""
    out = tmp_path / "runs.jsonl"
    argv = [*FLAGS, "--stock", "sdpa", "--attention", "naive", "--also", "sdpa,flash_torch:torch", "--out", str(out)]
    assert torch_e2e.main(argv) == 0
    stock, *ours = read_records(out)
    assert stock.implementation == "stock eager sdpa"
    assert [run.implementation for run in ours] == ["eager naive", "eager sdpa", "eager flash_torch"]
    for run in ours:
        assert run.status == "ok" and run.metrics["x_stock"] == stock.timing["median_ms"] / run.timing["median_ms"]
        assert run.metrics["loss_first"] == pytest.approx(ours[0].metrics["loss_first"], rel=1e-5)  # same weights
    for bad in ("flash", "sdpa:mlp"):
        with pytest.raises(SystemExit, match=f"--also '{bad}': comma-separated ATTENTION.:MLP., attention one of "):
            torch_e2e.main([*FLAGS, "--also", bad, "--out", str(out)])
    assert len(read_records(out)) == 4


def torch_e2e_args(argv: list[str]):
    """The torch e2e benchmark's flags parsed as ``torch_e2e.main`` parses them, without running a step."""
    from analysis.harness import add_step_arguments
    from parallelism_calc.cli import ArgumentParser

    parser = ArgumentParser(prog="python -m torch_impl.bench.e2e")
    add_step_arguments(parser)
    torch_e2e.add_torch_arguments(parser)
    return parser.parse_args(argv)


def test_ac_every_and_its_old_name_checkpoint_every_parse_the_same():
    """``--ac-every K`` (activation checkpointing every K blocks) and ``--checkpoint-every K``, its old name kept
    for one release, set the same value under the same dest, which the records carry as ``checkpoint_every``."""
    new, old = torch_e2e_args([*FLAGS, "--ac-every", "3"]), torch_e2e_args([*FLAGS, "--checkpoint-every", "3"])
    assert new.checkpoint_every == old.checkpoint_every == 3
    assert vars(new) == vars(old)
    assert torch_e2e_args(FLAGS).checkpoint_every is None
    assert torch_e2e_args([*FLAGS, "--checkpoint-every", "2", "--nested-checkpoint"]).nested_checkpoint


def test_sweep_runs_each_configuration_and_records_failures(tmp_path):
    """A model x sequence grid, one process per configuration; a configuration that dies is still a row."""
    out = tmp_path / "sweep.jsonl"
    sweep = ["--model", "tiny", "--batch-size", "1", "--warmup", "0", "--steps", "1", "--device", "cpu",
             "--sweep-models", "tiny,xxl", "--sweep-seq-lens", "8,24", "--out", str(out)]
    assert torch_e2e.main(sweep) == 0
    rows = {(r.model, r.seq_len): r for r in read_records(out)}
    assert set(rows) == {("tiny", 8), ("tiny", 24), ("xxl", 8), ("xxl", 24)}
    assert rows[("tiny", 24)].status == "ok" and rows[("tiny", 24)].timed_steps == 1
    assert rows[("xxl", 8)].status == "error" and "analysis-only" in rows[("xxl", 8)].error
    with pytest.raises(SystemExit, match="needs --out"):
        torch_e2e.main(["--sweep-models", "tiny"])


def test_sweep_with_a_process_per_model_records_every_configuration(tmp_path):
    """``--process-per model``: one process runs a model's lengths in turn; the records are those of a process
    per configuration (a row each, a bad model's rows errors), warm-up step times kept apart from the timed ones."""
    out = tmp_path / "sweep.jsonl"
    sweep = ["--batch-size", "1", "--warmup", "2", "--steps", "1", "--device", "cpu", "--process-per", "model",
             "--sweep-models", "tiny,xxl", "--sweep-seq-lens", "8,24", "--out", str(out)]
    assert torch_e2e.main(sweep) == 0
    rows = {(r.model, r.seq_len): r for r in read_records(out)}
    assert len(read_records(out)) == 4 and set(rows) == {("tiny", 8), ("tiny", 24), ("xxl", 8), ("xxl", 24)}
    for n in (8, 24):
        tiny = rows[("tiny", n)]
        assert tiny.status == "ok" and tiny.timed_steps == 1 and len(tiny.metrics["losses"]) == 3
        assert len(tiny.metrics["warmup_step_ms"]) == 2 and len(tiny.metrics["warmup_phases_ms"]["forward"]) == 2
        assert rows[("xxl", n)].status == "error" and "analysis-only" in rows[("xxl", n)].error


def test_frozen_gc_hides_the_heap_from_full_collections_then_gives_it_back():
    before = gc.get_freeze_count()
    with frozen_gc():
        assert gc.get_freeze_count() > before  # what was alive is in the permanent generation
        assert gc.isenabled()  # collections still run, over what the steps allocate
    assert gc.get_freeze_count() == 0


def test_pipelined_step_times_time_each_step_from_the_last_completion():
    """Every step is timed once, in order, and the times add up to the whole run (nothing waits in between)."""
    state = {"x": jnp.ones((256, 256)), "i": 0}

    def step():
        state["i"] += 1
        state["x"] = jnp.tanh(state["x"] @ state["x"]) * 0.5
        return jnp.sum(state["x"]) * 0 + state["i"]  # the loss is the step's number

    start = time.perf_counter()
    times, losses = pipelined_step_times(step, 5)
    wall = (time.perf_counter() - start) * 1e3
    assert losses == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(times) == 5 and all(t >= 0 for t in times)
    assert sum(times) <= wall


def test_the_stock_reference_s_prediction_counts_three_q_k_v_products():
    """Under autocast our one q, k, v product casts and saves x once where the stock reference's three products keep
    a copy each: the e2e benchmark predicts each model's own (``parallelism_calc.memory``'s ``qkv_product``)."""
    from analysis.harness import calculator_terms
    from parallelism_calc.memory import activation_bytes_per_token
    from parallelism_calc.specs import MODELS
    from torch_impl.bench.e2e import TorchStepConfig, predicted_memory

    spec = MODELS["tiny"]
    args = TorchStepConfig(model="tiny", batch_size=2, seq_len=16, dtype="bf16", attention="sdpa", device="cpu")
    ours, stock = (predicted_memory(args, spec, 16, stock=s) for s in (False, True))
    precision, attention = calculator_terms("bf16", "sdpa")
    three = activation_bytes_per_token(spec, 16, precision, "none", attention, fused_norm=False,
                                       qkv_product=False).for_tokens(32)
    assert stock["predicted_activation_bytes"] == three > ours["predicted_activation_bytes"]
    assert stock["predicted_peak_bytes"] > ours["predicted_peak_bytes"]
