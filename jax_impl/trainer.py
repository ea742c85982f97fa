"""The JAX training loop, twin of ``torch_impl.train``: ``python -m jax_impl.trainer``.

Trains the Flax ``TransformerLM`` on the same token datasets (``lm_data``) for ``--epochs`` epochs of
``--steps-per-epoch`` optimizer steps with the same settings (``lm_training.TrainSettings``, the same flags):
AdamW, warm-up + cosine (``lm_training.lr_at``, given to optax as a table of its values, ``lr_schedule``),
global-norm clipping, gradient accumulation, validation each epoch, checkpoints and exact resume. The step is
``jax_impl.train.ShardedTrainer``'s one jitted program (forward, backward, accumulation over ``--grad-accum``
micro-batches by ``lax.scan``, clipping and the AdamW update), on one device or on ``--mesh`` (e.g.
``fsdp=-1``, the strategy its degrees call for, as ``jax_impl.bench.e2e``). ``--dtype bf16`` computes in bf16
with fp32 parameters and AdamW state, ``bf16_mixed`` stores the parameters in bf16 and keeps fp32 masters in
the optimizer state (``jax_impl.train.MasterState``); fp32 runs its matmuls at full precision (no TF32).

Data (the same tokens as the PyTorch trainer): each optimizer step draws its global batch of ``grad_accum x
batch_size`` windows from one numpy generator seeded with ``--seed`` (``lm_data.global_batch_starts``), so for a
given seed and global batch both trainers read the same windows in the same micro-batch order. ``--batch-size``
is the micro-batch of the whole mesh (JAX's convention, one program; the PyTorch trainer's is per rank):
``--batch-size 8`` on ``--mesh dp=2`` reads what ``torchrun --nproc_per_node 2 -m torch_impl.train --batch-size
4`` reads. Validation: the first ``--val-batches`` batches of ``--batch-size`` fixed windows of the validation
split (``lm_data.validation_batch_starts``); its loss is the mean over the windows. The initial weights come from
``--seed`` through JAX's generator, so they are not the PyTorch model's: ``--init-weights NPZ`` (in both
trainers) starts from saved weights by their stable names, so the two backends' curves start together.

Checkpoints (``--checkpoint-dir``, every ``--checkpoint-every`` epochs and at ``--stop-after-epochs``): an orbax
``CheckpointManager`` step folder ``DIR/<step>/`` with ``state`` (the parameters and the optax state, each array
saved from its shards) and ``meta`` (JSON: the step, the data generator's state and the settings that must match
on resume, ``lm_training.TrainSettings.resume_settings``); orbax writes into a temporary folder and renames it
when complete, and keeps the 2 latest. ``--resume`` restores the latest into the current state's shardings (the
abstract state of this run's trainer), refusing a checkpoint whose settings or data set differ, and continues:
on a CPU the losses are bit for bit the uninterrupted run's. A run without ``--resume`` refuses a folder that
holds checkpoints already.

Records: one per epoch, suite "train", backend "jax", the PyTorch trainer's metric names
(``lm_training.epoch_metrics``: train_loss, train_losses, val_loss, lr, samples / tokens per epoch, ...; and
compile_s, the step's ahead-of-time compile before the first epoch, outside every epoch's clock; training_s,
validation_s, checkpoint_s, epoch_s, worker_s, total_s, the strategy and remat);
batch_size the micro-batch, mesh and world size the mesh's; timing the whole step (one fused program: only
the ``data`` phase, drawing and placing the windows, is timed apart); tokens_per_s = the epoch's tokens /
training seconds; tflops and mfu per device (``analysis.harness.step_record``). The first validation
includes the evaluation's compilation. A non-finite loss ends the run after its epoch: status "diverged", no
checkpoint of it, exit status 1.

References: MaxText ``train.py`` (the loop around a jitted, sharded ``train_step``; checkpoints with orbax's
``CheckpointManager``, restored into the abstract state's shardings, ``checkpointing.py``); the orbax docs
("Checkpointing with CheckpointManager", ``args.Composite`` / ``StandardSave`` / ``JsonSave``); optax's
``clip_by_global_norm`` / ``adamw`` with a schedule; CS336 (Stanford, 2025) assignment 1 (the training loop).

Several processes (one per GPU, or several hosts): ``jax_impl.distributed.initialize_from_env()`` runs first, so
the same command under a launcher (Slurm's ``srun`` with ``JAX_COORDINATOR_ADDRESS``, torchrun-style variables, or
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID) trains one program over every process's devices:
each process draws the same global batches and places its own shards of them, orbax writes each process's shards
of a checkpoint into the shared ``--checkpoint-dir``, and process 0 alone writes the records and prints.

Caveats: a short last validation batch must still divide by the data-parallel degree.
"""

from __future__ import annotations

import time

_IMPORTED = time.perf_counter()  # "total" time counts from here (about the process's start)

import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from analysis.harness import DTYPES, StepRun, step_record  # noqa: E402
from analysis.records import Record, divergence, save_records  # noqa: E402
from jax_impl.attention import get_attention  # noqa: E402
from jax_impl.device import device_name, mesh_from_flags, peak_memory_bytes  # noqa: E402
from jax_impl.distributed import initialize_from_env, process_layout  # noqa: E402
from jax_impl.model import to_numpy_weights  # noqa: E402
from jax_impl.train import (REMAT_POLICIES, ShardedTrainer, check_remat, dtype_arguments,  # noqa: E402
                            matmul_precision, step_name)
from lm_data import TokenData, global_batch_starts, prepare_data, validation_batch_starts, windows_at  # noqa: E402
from lm_training import (TrainResult, TrainSettings, add_training_arguments, check_resume_settings,  # noqa: E402
                         describe_epoch, epoch_metrics, lr_at, progress_bar)
from parallelism_calc.cli import ArgumentParser, error_boundary, one_line  # noqa: E402

SUITE = "train"
KEEP_CHECKPOINTS = 2


@dataclass
class JaxTrainConfig(TrainSettings):
    """Every setting of a run (the CLI's flags, same names): the shared ones (``lm_training.TrainSettings``) and
    JAX's own."""

    attention: str = "naive"
    remat: str = "none"
    mesh: str | None = None  # e.g. "dp=2,fsdp=-1"; None: one device

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}; accepted: {', '.join(DTYPES)}")
        check_remat(self.remat)
        get_attention(self.attention)  # an unknown backend: a ValueError naming the accepted ones
        super().__post_init__()


def lr_schedule(cfg: TrainSettings, total_steps: int) -> optax.Schedule:
    """optax's learning rate of update ``count``: ``lr_at(count)`` (float32), looked up in a table of its
    ``total_steps`` values (the last one beyond), so both trainers follow one formula."""
    table = jnp.asarray([lr_at(step, **cfg.schedule(total_steps)) for step in range(total_steps)], jnp.float32)
    return lambda count: table[jnp.minimum(count, total_steps - 1)]


def build(cfg: JaxTrainConfig, total_steps: int) -> ShardedTrainer:
    """The sharded model (from ``--init-weights`` if given), its AdamW (clipping, ``lr_schedule``) and its jitted
    step, on ``--mesh``."""
    mesh, strategy = mesh_from_flags(cfg.mesh, cfg.device)
    trainer = ShardedTrainer(cfg.spec(), mesh, strategy, lr=lr_schedule(cfg, total_steps),
                             weight_decay=cfg.weight_decay, seed=cfg.seed,
                             **dtype_arguments(cfg.dtype), remat=cfg.remat, attention=cfg.attention, b1=cfg.betas[0], b2=cfg.betas[1],
                             eps=cfg.adam_eps, grad_clip=cfg.grad_clip, grad_accum=cfg.grad_accum)
    if cfg.init_weights:
        trainer.load_weights(dict(np.load(cfg.init_weights)))
    return trainer


def evaluate(trainer: ShardedTrainer, cfg: JaxTrainConfig, data: TokenData) -> float | None:
    """Mean loss over the validation windows (the first ``val_batches`` batches of ``batch_size``)."""
    if cfg.val_batches == 0:
        return None
    loss_sum, windows = 0.0, 0
    for starts in validation_batch_starts(len(data.val), cfg.batch_size, cfg.seq_len, cfg.val_batches):
        loss_sum += float(trainer.eval_loss(windows_at(data.val, starts, cfg.seq_len))) * len(starts)
        windows += len(starts)
    return loss_sum / windows


# ----------------------------------------------------------------------------- checkpoints (orbax)


def checkpoint_manager(cfg: JaxTrainConfig) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(Path(cfg.checkpoint_dir).absolute(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=KEEP_CHECKPOINTS, create=True))


def save(manager: ocp.CheckpointManager, trainer: ShardedTrainer, step: int, generator: np.random.Generator,
         settings: dict) -> None:
    """Checkpoint ``step``: the state from its shards, and the step, generator and settings as JSON."""
    state = {"params": trainer.params, "opt_state": trainer.opt_state}
    meta = {"step": step, "data_generator": generator.bit_generator.state, "settings": settings}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()  # the next step donates these buffers


def restore(manager: ocp.CheckpointManager, trainer: ShardedTrainer, cfg: JaxTrainConfig,
            generator: np.random.Generator, settings: dict) -> int:
    """Load the latest checkpoint into ``trainer`` (with its shardings) and ``generator``; returns its step."""
    step = manager.latest_step()
    if step is None:
        raise ValueError(f"--resume: no checkpoint in {cfg.checkpoint_dir}")
    where = Path(cfg.checkpoint_dir) / str(step)
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    check_resume_settings(meta["settings"], settings, where, cfg.data)
    current = {"params": trainer.params, "opt_state": trainer.opt_state}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, current)  # shapes, dtypes and shardings
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    # The leaves in the current tree's structure (orbax may hand optax's named tuples back as plain tuples).
    state = jax.tree.unflatten(jax.tree.structure(current), jax.tree.leaves(state))
    trainer.params, trainer.opt_state = state["params"], state["opt_state"]
    generator.bit_generator.state = meta["data_generator"]
    return meta["step"]


# ----------------------------------------------------------------------------- the run


def implementation_name(cfg: JaxTrainConfig, trainer: ShardedTrainer) -> str:
    """``jax_impl.train.step_name`` of this run (as ``jax_impl.bench.e2e`` names it)."""
    return step_name(cfg.attention, cfg.remat, strategy=None if trainer.mesh.size == 1 else trainer.strategy)


def run_training(cfg: JaxTrainConfig, *, keep_params: bool = False) -> TrainResult:
    """Train as configured (the module docstring); ``keep_params``: the final weights as numpy arrays."""
    with jax.default_matmul_precision(matmul_precision(cfg.dtype)):
        return _run(cfg, keep_params)


def _run(cfg: JaxTrainConfig, keep_params: bool) -> TrainResult:
    worker_start = time.perf_counter()
    spec = cfg.spec()
    data = prepare_data(cfg.data, cfg.cache_dir, builtin_bytes=int(cfg.builtin_mb * 2**20),
                        val_fraction=cfg.val_fraction)
    data.check_vocab(spec.vocab_size)
    data.check_windows(cfg.seq_len, validation=cfg.val_batches > 0)
    global_batch = cfg.grad_accum * cfg.batch_size
    steps_per_epoch = cfg.steps_per_epoch_for(len(data.train), global_batch)
    trainer = build(cfg, cfg.epochs * steps_per_epoch)
    generator = np.random.default_rng(cfg.seed)
    settings = cfg.resume_settings(data, steps_per_epoch, global_batch)
    manager = checkpoint_manager(cfg) if cfg.checkpoint_dir else None
    writer = jax.process_index() == 0  # of several processes, the one that writes records and prints
    step = 0
    if cfg.resume:
        step = restore(manager, trainer, cfg, generator, settings)
        if writer:
            print(f"resumed from step {step} ({cfg.checkpoint_dir})", flush=True)
    elif manager is not None and manager.latest_step() is not None:
        raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir} holds checkpoints (latest step "
                         f"{manager.latest_step()}): continue them with --resume, or pick an empty folder")
    compile_s = trainer.compile(global_batch, cfg.seq_len)  # before the clock of any epoch starts
    result = TrainResult([], [], [], start_step=step)
    mesh_shape = {axis: int(size) for axis, size in trainer.mesh.shape.items()}
    name = device_name(trainer.mesh.devices.flat[0])
    for epoch in range(step // steps_per_epoch, cfg.stop_epoch):
        epoch_start = time.perf_counter()
        losses, step_ms, data_ms = [], [], []
        bar = progress_bar(steps_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}", cfg.progress and writer)
        for _ in range(steps_per_epoch):
            step_start = time.perf_counter()
            starts = global_batch_starts(len(data.train), cfg.grad_accum, 1, cfg.batch_size, cfg.seq_len, generator)
            tokens = windows_at(data.train, starts.reshape(-1), cfg.seq_len)  # (A x B, T + 1), micro-batch order
            data_ms.append((time.perf_counter() - step_start) * 1e3)
            losses.append(float(trainer.step(tokens)))  # float() waits for the step
            step_ms.append((time.perf_counter() - step_start) * 1e3)
            step += 1
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
                bar.update()
        if bar is not None:
            bar.close()
        training_s = time.perf_counter() - epoch_start
        val_start = time.perf_counter()
        val_loss = evaluate(trainer, cfg, data)
        validation_s = time.perf_counter() - val_start
        diverged = divergence(losses + ([] if val_loss is None else [val_loss]))
        checkpoint_s = 0.0
        if manager is not None and not diverged and ((epoch + 1) % cfg.checkpoint_every == 0
                                                     or epoch + 1 == cfg.stop_epoch):
            ckpt_start = time.perf_counter()
            save(manager, trainer, step, generator, settings)
            checkpoint_s = time.perf_counter() - ckpt_start
        metrics = {
            **epoch_metrics(cfg, epoch=epoch, step=step, steps_per_epoch=steps_per_epoch, global_batch=global_batch,
                            losses=losses, val_loss=val_loss, data=data),
            "strategy": trainer.strategy, "remat": cfg.remat, "compile_s": compile_s, "training_s": training_s,
            "validation_s": validation_s, "checkpoint_s": checkpoint_s,
            "epoch_s": time.perf_counter() - epoch_start, "worker_s": time.perf_counter() - worker_start,
            "total_s": time.perf_counter() - _IMPORTED, "phase_totals_s": {"data": sum(data_ms) / 1e3},
            **process_layout(),
        }
        run = StepRun(suite=SUITE, mode="train_step", dtype=cfg.dtype, batch_size=global_batch, warmup=0,
                      steps=len(step_ms))
        record = step_record(run, spec, cfg.seq_len, backend="jax", implementation=implementation_name(cfg, trainer),
                             device_name=name, step_times_ms=step_ms, phases_ms={"data": data_ms},
                             peak_memory_bytes=peak_memory_bytes(trainer.mesh), mesh=mesh_shape, metrics=metrics)
        record.batch_size = cfg.batch_size
        record.tokens_per_s = metrics["tokens_per_epoch"] / training_s
        result.records.append(record)
        result.train_losses += losses
        result.val_losses.append(val_loss)
        if writer:
            if cfg.out:
                save_records(cfg.out, record)
            print(describe_epoch(record), flush=True)
        if diverged:  # its record says "diverged"; a checkpoint of it would only hold NaNs
            print(f"error: epoch {epoch + 1}: {diverged}; training stopped, no checkpoint of this epoch",
                  file=sys.stderr, flush=True)
            result.diverged = True
            break
    if manager is not None:
        manager.close()
    result.stopped_early = cfg.stop_epoch < cfg.epochs
    if keep_params:
        result.params = to_numpy_weights(trainer.master_model)
    return result


# ----------------------------------------------------------------------------- CLI


def build_parser() -> ArgumentParser:
    d = JaxTrainConfig()
    p = ArgumentParser(prog="python -m jax_impl.trainer", description=__doc__.split("\n\n")[0])
    add_training_arguments(p, d, batch_help="sequences per micro-batch, the whole mesh's")
    a = p.add_argument
    a("--dtype", choices=list(DTYPES), default=d.dtype,
      help="fp32 (full-precision matmuls); bf16: bf16 compute, fp32 parameters and AdamW state; bf16_mixed: bf16 "
           "parameters, fp32 master weights and AdamW state (default fp32)")
    a("--remat", nargs="?", const="full", default=d.remat, choices=REMAT_POLICIES,
      help=f"what each block keeps for the backward pass ({', '.join(REMAT_POLICIES)}; a bare --remat: full)")
    a("--mesh", help="device mesh, e.g. dp=2,fsdp=2,tp=2 or fsdp=-1 (default: one device)")
    a("--device", default=d.device, help="auto (the accelerator if any), cpu, cuda or cuda:N (without --mesh)")
    return p


def _failure_record(cfg: JaxTrainConfig, err: BaseException) -> Record:
    text = str(err)
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    return Record(suite=SUITE, backend="jax", implementation=f"jit {cfg.attention}", model=cfg.model,
                  batch_size=cfg.batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype, mode="train_step",
                  status="oom" if oom else "error", error=f"{type(err).__name__}: {one_line(err)}",
                  metrics={"attention": cfg.attention, "grad_accum": cfg.grad_accum, "mesh": cfg.mesh,
                           "run": cfg.run_name})


@error_boundary(prog="python -m jax_impl.trainer")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = JaxTrainConfig(**vars(args))
        cfg.spec()
        initialize_from_env()  # several processes under a launcher: one program over all their devices
        mesh_from_flags(cfg.mesh, cfg.device)  # an absent device or a mesh too large: refused before any work
    except ValueError as err:
        parser.error(str(err))
    try:
        return 1 if run_training(cfg).diverged else 0
    except ValueError as err:
        parser.error(str(err))
    except RuntimeError as err:  # out of memory, a failing kernel: a record, not a gap
        if cfg.out and jax.process_index() == 0:
            save_records(cfg.out, _failure_record(cfg, err))
        print(f"error: {type(err).__name__}: {one_line(err)}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
