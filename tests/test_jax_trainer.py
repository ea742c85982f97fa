"""``jax_impl.trainer`` on CPU (tests/conftest.py gives JAX 8 CPU devices): optax's schedule is ``lm_training.lr_at``
step for step; accumulating A micro-batches of b rows takes the steps of one batch of A x b rows (one device and
a dp=2 mesh, float tolerance); stop-and-resume through orbax checkpoints gives the uninterrupted run's losses and
weights bit for bit and refuses other settings; epoch records carry the PyTorch trainer's fields; bad input is one
line and exit status 2; two processes joined by ``jax.distributed`` train one mesh and checkpoint it, and one
process resumes it, to the single-process run's losses. Tiny model with one block, 16-token sequences.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

from analysis.records import read_records  # noqa: E402
from jax_impl.trainer import JaxTrainConfig, build_parser, lr_schedule, main, run_training  # noqa: E402
from lm_data import prepare_data  # noqa: E402
from lm_training import TrainSettings, epoch_metrics, lr_at  # noqa: E402

BUILTIN_MB = 0.25
SEQ = 16
STEPS = 2  # per epoch


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data")
    prepare_data("builtin", path, builtin_bytes=int(BUILTIN_MB * 2**20))
    return str(path)


def _cfg(cache: str, **changes) -> JaxTrainConfig:
    base = dict(model="tiny", n_layers=1, seq_len=SEQ, batch_size=2, epochs=2, steps_per_epoch=STEPS, lr=3e-3,
                warmup_steps=2, grad_clip=0.3, adam_eps=1e-5, val_batches=2, cache_dir=cache, builtin_mb=BUILTIN_MB,
                device="cpu", progress=False)
    return JaxTrainConfig(**{**base, **changes})


def _argv(cache: str, *extra: str) -> list[str]:
    return ["--n-layers", "1", "--seq-len", str(SEQ), "--batch-size", "2", "--epochs", "2", "--steps-per-epoch",
            str(STEPS), "--val-batches", "2", "--cache-dir", cache, "--builtin-mb", str(BUILTIN_MB), "--device", "cpu",
            "--no-progress", *extra]


@pytest.mark.parametrize("warmup,total", [(0, 1), (3, 10), (5, 5), (2, 40)])
def test_schedule_is_lr_at(warmup, total):
    cfg = JaxTrainConfig(lr=2e-3, min_lr=1e-4, warmup_steps=warmup)
    schedule = lr_schedule(cfg, total)
    expected = [np.float32(lr_at(count, **cfg.schedule(total))) for count in range(total)]
    assert [float(schedule(count)) for count in range(total)] == expected
    assert float(schedule(total + 5)) == expected[-1]  # after the last step (never run): its value


@pytest.mark.parametrize("mesh", [None, "dp=2"])
def test_accumulation_matches_one_large_batch(cache, mesh):
    seed = secrets.randbelow(2**31)
    accumulated = run_training(_cfg(cache, seed=seed, batch_size=2, grad_accum=2, mesh=mesh), keep_params=True)
    one_batch = run_training(_cfg(cache, seed=seed, batch_size=4, grad_accum=1, mesh=mesh, val_batches=1),
                             keep_params=True)
    # Validation: 2 batches of 2 windows against 1 batch of 4, the same 4 windows.
    np.testing.assert_allclose(accumulated.train_losses, one_batch.train_losses, rtol=1e-5, err_msg=str(seed))
    np.testing.assert_allclose(accumulated.val_losses, one_batch.val_losses, rtol=1e-5, err_msg=str(seed))
    for name, value in one_batch.params.items():
        np.testing.assert_allclose(accumulated.params[name], value, rtol=1e-4, atol=1e-6, err_msg=f"{name} {seed}")


@pytest.mark.parametrize("dtype", ["fp32", "bf16_mixed"])  # bf16_mixed: float32 masters in the optimizer state
def test_resume_reproduces_the_uninterrupted_run(cache, tmp_path, dtype):
    seed = secrets.randbelow(2**31)
    common = dict(seed=seed, epochs=3, grad_accum=2, dtype=dtype)
    whole = run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "a"), **common), keep_params=True)
    first = run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "b"), stop_after_epochs=1, **common))
    assert first.stopped_early and len(first.records) == 1
    rest = run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "b"), resume=True, **common), keep_params=True)
    assert rest.start_step == STEPS and [r.metrics["epoch"] for r in rest.records] == [2, 3]
    assert first.train_losses + rest.train_losses == whole.train_losses, seed  # exactly
    assert first.val_losses + rest.val_losses == whole.val_losses, seed
    for name, value in whole.params.items():
        assert np.array_equal(rest.params[name], value), (name, seed)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [str(2 * STEPS), str(3 * STEPS)]  # keeps 2
    with pytest.raises(ValueError, match="settings differ.*'lr'"):
        run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "b"), resume=True, lr=1e-3, **common))
    with pytest.raises(ValueError, match="holds checkpoints"):  # a fresh run would mix with these
        run_training(_cfg(cache, checkpoint_dir=str(tmp_path / "b"), **common))


def test_cli_writes_the_torch_trainers_record_fields(cache, tmp_path):
    out = tmp_path / "train.jsonl"
    assert main(_argv(cache, "--grad-accum", "2", "--out", str(out), "--run-name", "cell")) == 0
    records = read_records(out)
    assert [r.metrics["epoch"] for r in records] == [1, 2]
    shared = set(epoch_metrics(_cfg(cache), epoch=0, step=1, steps_per_epoch=1, global_batch=1, losses=[1.0],
                               val_loss=None, data=prepare_data("builtin", cache, builtin_bytes=int(BUILTIN_MB * 2**20))))
    for r in records:
        m = r.metrics
        assert (r.suite, r.backend, r.status, r.implementation, r.batch_size, r.seq_len, r.world_size) == (
            "train", "jax", "ok", "jit naive", 2, SEQ, 1)
        assert shared <= set(m) and m["run"] == "cell"
        assert m["samples_per_epoch"] == 2 * 2 * STEPS and m["tokens_per_epoch"] == 8 * SEQ and m["grad_accum"] == 2
        assert r.tokens_per_s == pytest.approx(8 * SEQ / m["training_s"]) and r.flops_per_step > 0
        assert set(r.phases) == {"data"} and r.timed_steps == STEPS and len(m["train_losses"]) == STEPS
        assert m["val_loss"] > 0 and m["epoch_s"] >= m["training_s"] + m["validation_s"]
        assert m["lr"] == pytest.approx(lr_at(m["step"] - 1, lr=1e-3, min_lr=1e-4, warmup_steps=0,
                                              total_steps=2 * STEPS))


@pytest.mark.parametrize("argv,message", [
    (["--grad-accum", "0"], "argument --grad-accum: '0': must be > 0"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--dtype", "fp16"], "invalid choice: 'fp16'"),
    (["--attention", "flash"], "unknown attention backend 'flash'"),
    (["--vocab-size", "100"], "vocab_size >= 257"),
    (["--mesh", "dp=16"], "--mesh dp=16 needs 16 devices"),
    (["--batch-size", "3", "--mesh", "dp=2"], "not divisible by the data-parallel degree 2"),
])
def test_cli_rejects_bad_input(cache, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(_argv(cache, *argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_cli_refuses_a_checkpoint_of_other_settings(cache, tmp_path, capsys):
    folder = str(tmp_path / "ckpt")
    assert main(_argv(cache, "--checkpoint-dir", folder, "--stop-after-epochs", "1")) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(_argv(cache, "--checkpoint-dir", folder, "--resume", "--seed", "7"))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "settings differ" in err[0] and "'seed': (0, 7)" in err[0], err


def test_matrix_loss_chart_gets_the_latest_jax_run(tmp_path, monkeypatch):
    """analysis.training: the JAX trainer's latest run (a resumed run continues it) is a line beside the cells."""
    import analysis.plots
    from analysis.records import Record, save_records
    from analysis.training import latest_jax_runs, write_matrix_report

    def epoch(backend, implementation, n, loss, run=None):
        return Record(suite="train", backend=backend, implementation=implementation, metrics={
            "attention": "sdpa", "dist": "none", "epoch": n, "epoch_s": 1.0, "train_loss": loss, "val_loss": loss,
            "run": run})

    records = [Record(suite="train_matrix", backend="torch", implementation="none",
                      metrics={"attention": "sdpa", "dist": "none", "run": "cell", "samples_per_epoch": 4}),
               epoch("torch", "none", 1, 5.0, "cell"), epoch("torch", "none", 2, 4.0, "cell"),
               epoch("jax", "jit naive", 1, 9.0), epoch("jax", "jit naive", 2, 8.0),  # an older run
               epoch("jax", "jit naive", 1, 6.0), epoch("jax", "jit naive", 2, 5.5), epoch("jax", "jit naive", 3, 5.0)]
    for r in records:
        save_records(tmp_path / "m.jsonl", r)
    assert [r.metrics["train_loss"] for r in latest_jax_runs(records)] == [6.0, 5.5, 5.0]
    drawn, line_plot = {}, analysis.plots.line_plot

    def recording_line_plot(frame, *args, **kwargs):
        drawn[kwargs["title"]] = frame
        return line_plot(frame, *args, **kwargs)

    monkeypatch.setattr(analysis.plots, "line_plot", recording_line_plot)
    write_matrix_report(tmp_path / "m.jsonl", tmp_path / "report")
    lines = drawn["loss convergence"].groupby("cell")["loss"].apply(list).to_dict()
    assert lines == {"jax: jit naive": [6.0, 6.0, 5.5, 5.5, 5.0, 5.0], "sdpa / none": [5.0, 5.0, 4.0, 4.0]}
    assert (tmp_path / "report" / "loss_convergence.png").exists()


def test_both_trainers_take_the_same_steps_from_the_same_weights(cache, tmp_path):
    """``--init-weights``: PyTorch's initial weights in both trainers, the same data draw and schedule: the same
    losses (fp32; clipping off, as JAX's clip has no 1e-6 term in its denominator)."""
    torch = pytest.importorskip("torch")
    from torch_impl.model import TransformerLM as TorchLM
    from torch_impl.train import TrainConfig, run_training as run_torch_training

    seed = secrets.randbelow(2**31)
    settings = dict(seed=seed, grad_clip=0.0, init_weights=str(tmp_path / "init.npz"))
    torch.manual_seed(seed)
    np.savez(settings["init_weights"], **TorchLM(_cfg(cache).spec()).to_numpy_weights())
    jax_run = run_training(_cfg(cache, attention="naive", **settings))
    shared = {f.name: getattr(_cfg(cache, **settings), f.name) for f in dataclasses.fields(TrainSettings)}
    torch_cfg = TrainConfig(**{**shared, "attention": "sdpa"})
    torch_run = run_torch_training(torch_cfg)
    assert len(jax_run.train_losses) == 2 * STEPS
    np.testing.assert_allclose(jax_run.train_losses, torch_run.train_losses, rtol=2e-5, err_msg=str(seed))
    np.testing.assert_allclose(jax_run.val_losses, torch_run.val_losses, rtol=2e-5, err_msg=str(seed))


def test_two_processes_train_and_one_process_resumes(cache, tmp_path):
    """Two processes of 2 CPU devices each, joined by ``jax.distributed`` (gloo collectives), train one dp=2 x
    fsdp=2 mesh for an epoch and checkpoint it into a shared folder (orbax, each process its shards); one process
    of 4 devices resumes it. Both halves give the losses of one uninterrupted single-process run (float tolerance:
    the collectives' order differs), and process 0 alone writes the record."""
    from tests._dist import free_port, run_launchers  # torch, as the PyTorch pieces here, imported where needed

    seed = secrets.randbelow(2**31)
    ckpt, out = tmp_path / "ckpt", tmp_path / "two.jsonl"
    argv = _argv(cache, "--batch-size", "4", "--mesh", "dp=2,fsdp=2", "--seed", str(seed), "--checkpoint-dir",
                 str(ckpt), "--stop-after-epochs", "1", "--out", str(out))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "JAX_PLATFORMS": "cpu",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
           "JAX_DISTRIBUTED_TIMEOUT_S": "60"}
    command = [sys.executable, "-m", "jax_impl.trainer", *argv]
    results = run_launchers([["env", f"JAX_PROCESS_ID={i}", *command] for i in range(2)], env=env, cwd=tmp_path,
                            timeout_s=240)
    for i, (code, output) in enumerate(results):
        assert code == 0, f"process {i} exited {code}:\n{output[-3000:]}"
    (two,) = read_records(out)  # process 0 alone writes; one epoch before the stop
    assert (two.world_size, two.mesh, two.metrics["epoch"]) == (4, {"dp": 2, "fsdp": 2, "tp": 1}, 1)

    cfg = JaxTrainConfig(**vars(build_parser().parse_args(argv)))  # the processes' settings, in this process
    whole = run_training(dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "whole"), stop_after_epochs=None,
                                             out=None))
    rest = run_training(dataclasses.replace(cfg, resume=True, stop_after_epochs=None, out=None))
    assert rest.start_step == STEPS
    np.testing.assert_allclose(two.metrics["train_losses"], whole.train_losses[:STEPS], rtol=1e-5,
                               err_msg=str(seed))
    np.testing.assert_allclose(rest.train_losses, whole.train_losses[STEPS:], rtol=1e-5, err_msg=str(seed))
    np.testing.assert_allclose(rest.val_losses, whole.val_losses[1:], rtol=1e-5, err_msg=str(seed))
