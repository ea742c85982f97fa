"""The leaderboard step benchmark on 2 gloo ranks (torchrun, CPU, tiny): it completes, writes a well-formed record
with the calculator's prediction beside the measurement, and its loss is the plain single-process model's loss on the
same weights and global batch (computed here, independently: no wrapper, the plain loss, the whole batch at once).

Two launches share one JSON Lines file: our FSDP with the fused loss and checkpointing every block, and FSDP2 with
the plain loss, both fp32 (so the losses agree to float rounding). Bad input: tests/test_bad_input.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from analysis.harness import fixed_batch
from analysis.records import read_records
from parallelism_calc.memory import per_device_memory
from parallelism_calc.specs import MODELS
from tests._dist import free_port

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
BATCH, SEQ = 4, 32  # global: 2 sequences a rank
COMMON = ["--device", "cpu", "--model", "tiny", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--dtype", "fp32",
          "--attention", "sdpa", "--warmup", "1", "--steps", "2", "--timeout", "60"]
KEPT = ["--keep-attention", "--attention", "flash_triton"]  # the Triton kernels under the interpreter
LAUNCHES = (["--dist", "fsdp", "--loss", "fused", "--ac-every", "1"], ["--dist", "fsdp2", "--loss", "plain"],
            ["--dist", "fsdp", "--loss", "fused", "--ac-every", "1", *KEPT])


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("leaderboard") / "leaderboard.jsonl"
    profiles = out.parent / "profiles"  # the second launch profiles a step (--profile)
    for flags in LAUNCHES:
        flags = flags + (["--profile", str(profiles)] if flags is LAUNCHES[1] else [])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "torch_impl.bench.leaderboard", *COMMON, *flags,
               "--out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        assert "[leaderboard] timed step 2/2" in proc.stderr  # progress, from rank 0
    assert [p.name for p in sorted(profiles.iterdir())] == [  # rank 0's alone
        "leaderboard_tiny_2l_2x32_fsdp2_eager_sdpa_plain_loss_kernels.md",
        "leaderboard_tiny_2l_2x32_fsdp2_eager_sdpa_plain_loss_trace.json"]
    return read_records(out)


def test_profile_puts_the_kernels_in_the_record(records):
    fused, profiled, _ = records
    assert "profiled_kernel_ms" not in fused.metrics
    shares = {k: v for k, v in profiled.metrics.items() if k.startswith("time_share.")}
    assert shares and sum(shares.values()) == pytest.approx(1.0)
    assert profiled.metrics["profiled_kernel_ms"] > 0 and profiled.metrics["kernel_ms"]
    assert set(profiled.metrics["kernel_calls"]) == set(profiled.metrics["kernel_ms"])


def test_one_well_formed_record_per_launch(records):
    assert [r.implementation for r in records] == ["fsdp, eager sdpa, fused loss, ckpt 1",
                                                   "fsdp2, eager sdpa, plain loss",
                                                   "fsdp, eager flash_triton, fused loss, ckpt 1 keep attention"]
    for r in records:
        assert r.status == "ok", r.error
        assert (r.suite, r.backend, r.mode, r.model, r.batch_size, r.seq_len, r.world_size, r.mesh) == (
            "leaderboard", "torch", "train_step", "tiny", BATCH, SEQ, 2, {"fsdp": 2})
        assert (r.warmup_steps, r.timed_steps) == (1, 2)
        assert set(r.phases) == {"forward", "backward", "comm", "optimizer"}
        assert r.metrics["timer"] == "phase_timer"  # no CUDA here: the phase-timed loop's step times
        assert r.tokens_per_s == pytest.approx(BATCH * SEQ / (r.timing["median_ms"] / 1e3))
        assert r.peak_memory_bytes is None and r.metrics["per_rank_peak_memory_bytes"] == [None, None]
        assert r.provenance["git_commit"] and r.provenance["device_name"] == "cpu"
        assert "floor_s" not in r.metrics  # a CPU has no HardwareSpec: no time floor
        assert len(r.metrics["losses"]) == 3 and r.metrics["loss_last"] < r.metrics["loss_first"]


def test_record_carries_the_calculators_prediction(records):
    fused, plain, kept = records
    spec = MODELS["tiny"]
    expected = per_device_memory(spec, "fsdp", 2, BATCH * SEQ, SEQ, "fp32", attention="flash", checkpoint_every=1,
                                 loss="fused", gather_unit="block", prefetch_layers=1, pending_reduce_scatters=2,
                                 compute_dtype_stream=True, peak_model="timeline",
                                 fused_norm=False)  # a CPU run: RMSNorm written out, no workspaces
    assert fused.metrics["predicted_memory_bytes"] == pytest.approx(expected.total)
    assert fused.metrics["predicted_memory"]["optimizer"] == pytest.approx(spec.n_params() * 8 / 2)  # sharded
    assert plain.metrics["predicted_memory_bytes"] > 0 and plain.metrics["predicted_peak_at"]
    with_kept = per_device_memory(spec, "fsdp", 2, BATCH * SEQ, SEQ, "fp32", attention="flash", checkpoint_every=1,
                                  loss="fused", gather_unit="block", prefetch_layers=1, pending_reduce_scatters=2,
                                  compute_dtype_stream=True, peak_model="timeline", kept_attention=True,
                                  fused_norm=False)
    assert kept.metrics["predicted_memory_bytes"] == pytest.approx(with_kept.total)


def test_kept_attention_trains_as_the_recomputed_one(records):
    """The same steps (each loss after the first depends on the gradients) with the attention kept through the
    checkpoints under our FSDP: the recomputation took the kept outputs in the right blocks."""
    fused, _, kept = records
    assert kept.metrics["keep_attention"] and not fused.metrics["keep_attention"]
    assert kept.metrics["losses"] == pytest.approx(fused.metrics["losses"], rel=1e-4)


def test_loss_equals_the_plain_single_process_model(records):
    from torch_impl.model import TransformerLM, cross_entropy

    torch.manual_seed(0)  # the benchmark's --seed
    model = TransformerLM(MODELS["tiny"], attention="sdpa")
    tokens = torch.from_numpy(fixed_batch(0, BATCH, SEQ, MODELS["tiny"].vocab_size))
    with torch.no_grad():
        reference = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).item()
    for r in records:
        assert r.metrics["loss_first"] == pytest.approx(reference, rel=1e-5), r.implementation


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")
def test_on_two_gpus_the_leaderboards_configuration_trains_as_the_plain_single_process_model(tmp_path):
    """The device run's configuration (our FSDP over NCCL, fused loss, checkpoints keeping the attention, compiled
    blocks, our FlashAttention) on a small spec in fp32: its first three losses (each after the first depends on
    the step before's gradients and update) are those of the plain model trained on one GPU on the whole batch."""
    from torch_impl.model import TransformerLM, cross_entropy

    out = tmp_path / "leaderboard.jsonl"
    flags = ["cuda" if arg == "cpu" else arg for arg in COMMON]  # --device cuda
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "torch_impl.bench.leaderboard", *flags, *LAUNCHES[2],
           "--compile", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**ENV, "TRITON_INTERPRET": "0"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    (record,) = read_records(out)
    assert record.metrics["timer"] == "do_bench" and record.peak_memory_bytes > 0
    torch.manual_seed(0)  # the benchmark's --seed, its weights drawn on the GPU as the benchmark draws them
    model = TransformerLM(MODELS["tiny"], attention="sdpa", device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    tokens = torch.from_numpy(fixed_batch(0, BATCH, SEQ, MODELS["tiny"].vocab_size)).cuda()
    reference = []
    for _ in range(3):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference.append(loss.item())
    assert record.metrics["losses"][:3] == pytest.approx(reference, rel=1e-4)
