"""``torch_impl.train`` on CPU: the loss falls on the built-in corpus; training matches a plain single-process
loop written here (whole global batch, ``torch.nn.utils.clip_grad_norm_``, the schedule set by hand) with
gradient accumulation, on 2 gloo ranks with every data-parallel mode and with FSDP's global clipping norm;
stop-and-resume gives the uninterrupted run's losses exactly (one process, also in a folder holding an earlier,
longer run's checkpoints, and 2 ranks with ZeRO-1); the CLI writes a record per epoch and resumes from its
checkpoints.

Seeds are fresh per run (``secrets``) and printed in the assertion messages. The comparisons against the
reference use AdamW eps 1e-4 (as ``tests/test_fsdp.py`` does): with the default 1e-8 an element whose true
gradient is ~0 can flip its update's sign on float32 summation-order round-off, a difference of 2 lr that
says nothing about the trainer. Tiny model, 16-token sequences, one intra-op thread.
"""

from __future__ import annotations

import math
import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.records import read_records
from parallelism_calc.specs import MODELS
from tests._dist import run_ranks
from lm_data import prepare_data
from torch_impl.model import TransformerLM
from lm_training import lr_at
from torch_impl.train import TrainConfig, main, run_training

REPO = Path(__file__).resolve().parent.parent
BUILTIN_MB = 0.25
SEQ = 16
STEPS = 2  # per epoch
CLIP = 0.3  # below the tiny model's gradient norms, so clipping is active at every step
EPS = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data")
    prepare_data("builtin", path, builtin_bytes=int(BUILTIN_MB * 2**20))
    return str(path)


def _cfg(cache: str, **changes) -> TrainConfig:
    base = dict(model="tiny", seq_len=SEQ, batch_size=2, epochs=2, steps_per_epoch=STEPS, lr=3e-3, warmup_steps=2,
                grad_clip=CLIP, adam_eps=EPS, val_batches=2, cache_dir=cache, builtin_mb=BUILTIN_MB,
                attention="sdpa", device="cpu", progress=False)
    return TrainConfig(**{**base, **changes})


# ----------------------------------------------------------------------------- the reference


def _reference_lr(step: int, cfg: TrainConfig, total: int) -> float:
    """Warm-up to lr over warmup_steps (step + 1 of them done), then half a cosine period down to min_lr at the
    last step."""
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * (step + 1) / w
    angle = math.pi * np.clip((step - w) / max(1, total - 1 - w), 0.0, 1.0)
    return cfg.final_lr + (cfg.lr - cfg.final_lr) * (math.cos(angle) + 1) / 2


def _reference(cfg: TrainConfig, global_batch: int, cache: str) -> dict:
    """Plain single-process training on the whole global batch of every step: per-step losses, pre-clipping
    gradient norms, validation losses per epoch and the final parameters."""
    data = prepare_data("builtin", cache, builtin_bytes=int(BUILTIN_MB * 2**20))
    torch.manual_seed(cfg.seed)
    model = TransformerLM(MODELS["tiny"], attention="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
    rng = np.random.default_rng(cfg.seed)
    total = cfg.epochs * cfg.steps_per_epoch
    losses, norms, val = [], [], []

    def windows(split, starts):
        rows = np.stack([np.asarray(split[s:s + SEQ + 1], dtype=np.int64) for s in starts])
        return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])

    def ce(x, y):
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    for step in range(total):
        x, y = windows(data.train, rng.integers(0, len(data.train) - SEQ, size=global_batch))
        loss = ce(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item())
        for group in opt.param_groups:
            group["lr"] = _reference_lr(step, cfg, total)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (step + 1) % cfg.steps_per_epoch == 0:
            with torch.no_grad():
                starts = [i * SEQ for i in range(cfg.val_batches * cfg.batch_size)]
                val.append(ce(*windows(data.val, starts)).item())
    return {"losses": losses, "norms": norms, "val": val,
            "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def _assert_matches(result: dict, ref: dict, what: str, seed: int, rtol: float = 1e-4) -> None:
    np.testing.assert_allclose(result["losses"], ref["losses"], rtol=rtol, err_msg=f"{what} losses, seed {seed}")
    np.testing.assert_allclose(result["norms"], ref["norms"], rtol=rtol, err_msg=f"{what} grad norms, seed {seed}")
    np.testing.assert_allclose(result["val"], ref["val"], rtol=rtol, err_msg=f"{what} val losses, seed {seed}")
    assert min(result["norms"]) > CLIP, f"{what}: clipping never active ({result['norms']}), seed {seed}"
    for name, ref_param in ref["params"].items():
        torch.testing.assert_close(result["params"][name], ref_param, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what} {name}, seed {seed}: {m}")


def _summary(result) -> dict:
    return {"losses": result.train_losses, "val": result.val_losses, "params": result.params,
            "norms": [n for r in result.records for n in r.metrics["grad_norms"]], "records": result.records}


# ----------------------------------------------------------------------------- one process


def test_lr_schedule():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0 and lr_at(13, **kw) == pytest.approx(0.1) and lr_at(50, **kw) == pytest.approx(0.1)
    assert lr_at(4 + 9 / 2, **kw) == pytest.approx(0.55)  # half way down the cosine
    values = [lr_at(s, **kw) for s in range(4, 14)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert lr_at(0, lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=1) == 2.0  # no warm-up, one step


def test_loss_falls_on_the_builtin_corpus(cache):
    seed = secrets.randbelow(2**31)
    result = run_training(_cfg(cache, seed=seed, epochs=3, steps_per_epoch=15, batch_size=8, seq_len=32,
                               grad_clip=1.0, adam_eps=1e-8, warmup_steps=5))
    first, vals = result.train_losses[0], result.val_losses
    assert abs(first - math.log(512)) < 1.0, (seed, first)  # an untrained model is about uniform
    assert vals[0] > vals[1] > vals[2] and vals[2] < first - 2.5, (seed, first, vals)
    assert len(result.records) == 3 and [r.metrics["epoch"] for r in result.records] == [1, 2, 3]


@pytest.mark.parametrize("batch_size,grad_accum", [(4, 1), (2, 2), (1, 4)])
def test_accumulation_matches_one_large_batch(cache, batch_size, grad_accum):
    seed = secrets.randbelow(2**31)
    cfg = _cfg(cache, seed=seed, batch_size=batch_size, grad_accum=grad_accum)
    result = _summary(run_training(cfg, keep_params=True))
    # The reference validates on batches of --batch-size windows too: the same val_batches x batch_size windows.
    ref = _reference(cfg, 4, cache)
    _assert_matches(result, ref, f"batch {batch_size} x accumulation {grad_accum}", seed)


@pytest.mark.parametrize("dtype", ["fp32", "bf16_mixed"])  # bf16_mixed: the master weights are saved too
def test_resume_reproduces_the_uninterrupted_run(cache, tmp_path, dtype):
    seed = secrets.randbelow(2**31)
    common = dict(seed=seed, epochs=3, grad_accum=2, adam_eps=1e-8, dtype=dtype)
    whole = run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "a"), **common), keep_params=True)
    first = run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "b"), stop_after_epochs=1, **common))
    assert first.stopped_early and len(first.records) == 1
    torch.manual_seed(seed + 1)  # the global RNGs are restored from the checkpoint, whatever they are now
    np.random.seed(seed % 2**32)
    rest = run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "b"), resume=True, **common), keep_params=True)
    assert rest.start_step == STEPS and [r.metrics["epoch"] for r in rest.records] == [2, 3]
    assert first.train_losses + rest.train_losses == whole.train_losses, seed  # exactly
    assert first.val_losses + rest.val_losses == whole.val_losses, seed
    for name, value in whole.params.items():
        assert torch.equal(rest.params[name], value), (name, seed)
    folder = tmp_path / "b"
    assert (folder / "latest").read_text() == f"step-{3 * STEPS:08d}"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", f"step-{2 * STEPS:08d}", f"step-{3 * STEPS:08d}"]
    with pytest.raises(ValueError, match="settings differ.*'lr'"):
        run_training(_cfg(cache, checkpoint_dir=str(folder), resume=True, lr=1e-3, **common))


def test_a_stopped_run_keeps_its_checkpoint_beside_an_earlier_longer_run(cache, tmp_path):
    """Issue 17, item 1: a 3-epoch run, then a new one stopped after 1 epoch in the same folder, then --resume."""
    seed = secrets.randbelow(2**31)
    common = dict(seed=seed, epochs=3, checkpoint_dir=str(tmp_path))
    whole = run_training(_cfg(cache, **common))
    first = run_training(_cfg(cache, stop_after_epochs=1, **common))
    assert (tmp_path / "latest").read_text() == f"step-{STEPS:08d}"
    rest = run_training(_cfg(cache, resume=True, **common))
    assert rest.start_step == STEPS
    assert first.train_losses + rest.train_losses == whole.train_losses, seed
    assert (tmp_path / "latest").read_text() == f"step-{3 * STEPS:08d}"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{2 * STEPS:08d}", f"step-{3 * STEPS:08d}"]


# ----------------------------------------------------------------------------- 2 gloo ranks


RANK_RUNS = {  # name: (TrainConfig changes); each on 2 ranks with a global batch of 4
    "naive accumulate 2": dict(dist="naive", batch_size=1, grad_accum=2),
    "flat": dict(dist="flat", batch_size=2),
    "individual accumulate 2": dict(dist="individual", batch_size=1, grad_accum=2),
    "bucketed": dict(dist="bucketed", batch_size=2, bucket_mb=0.05),
    "torch_ddp accumulate 2": dict(dist="torch_ddp", batch_size=1, grad_accum=2),
    "zero1": dict(dist="zero1", batch_size=2),
    # 3 validation batches on 2 ranks: FSDP's forwards are collectives, rank 1 must run a spare one.
    "fsdp accumulate 2": dict(dist="fsdp", batch_size=1, grad_accum=2, val_batches=3),
}


def _ranks_body(rank: int, world_size: int, cache: str, seed: int, folder: str) -> dict:
    torch.manual_seed(1234 + rank)  # the trainer seeds what it needs
    out = {}
    for name, changes in RANK_RUNS.items():
        out[name] = _summary(run_training(_cfg(cache, seed=seed, **changes), keep_params=True))
    # ZeRO-1 stop and resume (its consolidated optimizer state is a collective to save).
    common = dict(seed=seed, epochs=3, dist="zero1", batch_size=1, grad_accum=2, adam_eps=1e-8)
    whole = run_training(_cfg(cache, **common), keep_params=True)
    first = run_training(_cfg(cache, checkpoint_dir=folder, stop_after_epochs=1, **common))
    rest = run_training(_cfg(cache, checkpoint_dir=folder, resume=True, **common), keep_params=True)
    out["zero1 resume"] = {"whole": _summary(whole), "first": _summary(first), "rest": _summary(rest)}
    for summary in out.values():
        for part in (summary.values() if "whole" in summary else [summary]):
            part["records"] = [(r.world_size, r.implementation, r.metrics["samples_per_epoch"]) for r in part["records"]]
    return out


def test_two_ranks_match_single_process_training(cache, tmp_path):
    seed = secrets.randbelow(2**31)
    results = run_ranks(_ranks_body, 2, cache, seed, str(tmp_path / "zero1"), timeout_s=240, pg_timeout_s=60)
    # The reference's validation set is val_batches x batch_size windows, as the trainer's.
    refs = {}
    for name, changes in RANK_RUNS.items():
        key = (changes["batch_size"], changes.get("val_batches", 2))
        if key not in refs:
            refs[key] = _reference(_cfg(cache, seed=seed, batch_size=key[0], val_batches=key[1]), 4, cache)
        for rank in range(2):
            _assert_matches(results[rank][name], refs[key], f"{name} rank {rank}", seed)
        assert results[0][name]["records"][0][0] == 2 and results[0][name]["records"][0][2] == 4 * STEPS
    for rank in range(2):
        runs = results[rank]["zero1 resume"]
        assert runs["first"]["losses"] + runs["rest"]["losses"] == runs["whole"]["losses"], (rank, seed)
        assert runs["first"]["val"] + runs["rest"]["val"] == runs["whole"]["val"], (rank, seed)
        for name, value in runs["whole"]["params"].items():
            assert torch.equal(runs["rest"]["params"][name], value), (rank, name, seed)


# ----------------------------------------------------------------------------- CLI


def _cli_args(cache: str, out: Path) -> list[str]:
    return ["--seq-len", str(SEQ), "--batch-size", "2", "--epochs", "2", "--steps-per-epoch", "2", "--val-batches",
            "2", "--cache-dir", cache, "--builtin-mb", str(BUILTIN_MB), "--device", "cpu", "--no-progress",
            "--out", str(out)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_cli_writes_a_record_per_epoch(cache, tmp_path):
    out = tmp_path / "train.jsonl"
    proc = _run([sys.executable, "-m", "torch_impl.train", *_cli_args(cache, out), "--grad-accum", "2"])
    assert proc.stdout.count("epoch ") == 2, proc.stdout
    records = read_records(out)
    assert [r.metrics["epoch"] for r in records] == [1, 2]
    for r in records:
        m = r.metrics
        assert (r.suite, r.status, r.implementation, r.world_size, r.batch_size, r.seq_len) == (
            "train", "ok", "none", 1, 2, SEQ)
        assert m["samples_per_epoch"] == 2 * 2 * 2 and m["tokens_per_epoch"] == 8 * SEQ and m["grad_accum"] == 2
        assert r.tokens_per_s == pytest.approx(8 * SEQ / m["training_s"])
        assert set(r.phases) == {"data", "forward", "backward", "comm", "optimizer"}
        assert r.timed_steps == 2 and len(m["train_losses"]) == 2 and m["val_loss"] > 0
        assert m["epoch_s"] >= m["training_s"] + m["validation_s"] and m["total_s"] >= m["worker_s"] > 0
        assert r.peak_memory_bytes is None and m["per_rank_peak_memory_bytes"] == [None]  # CPU


def test_cli_stops_and_resumes(cache, tmp_path):
    """Through the CLI with a process group of one (--dist zero1); torchrun launches are in test_train_matrix."""
    out, folder = tmp_path / "train.jsonl", tmp_path / "ckpt"
    args = [sys.executable, "-m", "torch_impl.train", *_cli_args(cache, out), "--dist", "zero1", "--checkpoint-dir",
            str(folder), "--timeout", "60"]
    _run([*args, "--stop-after-epochs", "1"])
    proc = _run([*args, "--resume"])
    assert "resumed from step 2" in proc.stdout, proc.stdout
    records = read_records(out)
    assert [(r.metrics["epoch"], r.world_size, r.implementation) for r in records] == [
        (1, 1, "zero1 + bucketed 25MB"), (2, 1, "zero1 + bucketed 25MB")]
    assert (folder / "latest").read_text() == f"step-{2 * STEPS:08d}"


@pytest.mark.parametrize("argv,message", [
    (["--dist", "ddp3"], "invalid choice: 'ddp3'"),
    (["--batch-size", "0"], "argument --batch-size: '0': must be > 0"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--vocab-size", "100"], "vocab_size >= 257"),
    (["--model", "xxl"], "analysis-only"),
    (["--compile", "--cuda-graph", "blocks", "--dist", "fsdp"], "--cuda-graph blocks with --dist fsdp"),
    (["--dtype", "bf16_mixed", "--dist", "zero1"], "--dtype bf16_mixed with --dist zero1"),
    (["--cuda-graph", "blocks"], "--cuda-graph blocks replays the graphs of the compiled blocks: it needs --compile"),
    (["--cuda-graph", "blocks", "--compile"], "--cuda-graph blocks replays CUDA graphs: it needs --device cuda"),
    (["--cuda-graph", "on"], "invalid choice: 'on'"),
])
def test_cli_rejects_bad_input(cache, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--cache-dir", cache, "--builtin-mb", str(BUILTIN_MB), "--steps-per-epoch", "1", "--device", "cpu",
              "--no-progress", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


def test_config_refuses_a_cuda_graph_mode_the_trainer_has_not():
    """The whole-step graph is the e2e benchmark's: the trainer's config must not take it and run without graphs."""
    with pytest.raises(ValueError, match="--cuda-graph 'step'; accepted: off, blocks"):
        TrainConfig(cuda_graph="step")
