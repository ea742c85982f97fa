"""The training loop: ``python -m torch_impl.train`` (one process) or ``torchrun --nproc_per_node N -m torch_impl.train``.

Trains ``TransformerLM`` on a token dataset (``lm_data``: the built-in standard-library byte corpus,
a text file or a ``.npy`` token file) for ``--epochs`` epochs of ``--steps-per-epoch`` optimizer steps, with
AdamW, linear warm-up then cosine decay of the learning rate (``lm_training.lr_at``), gradient clipping, gradient
accumulation over ``--grad-accum`` micro-batches of ``--batch-size`` sequences per rank, optional bf16
autocast, any attention backend, the plain or the fused loss (``--loss fused``: the LM head and the cross-entropy
fused and chunked over tokens, ``torch_impl.linear_cross_entropy``, in training and validation), and one of the
data-parallel modes ``--dist``:
``none`` (one process), our ``naive`` / ``flat`` / ``individual`` / ``bucketed`` DDP, ``torch_ddp``
(``DistributedDataParallel``), ``zero1`` (``ShardedOptimizer(AdamW)`` over bucketed DDP) and ``fsdp``, applied
by ``torch_impl.parallelize.parallelize`` as in the benchmarks. The loop knows each mode only through
its ``DataParallelWrapper`` (``torch_impl.distributed.interface``): no branch per mode here.

Data: each optimizer step draws one *global* batch of ``grad_accum x world_size x batch_size`` random windows
from one numpy generator (seeded with ``--seed``, identical on every rank), laid out as (micro-batch, rank,
row): rank r's micro-batch j is row block [j, r]. So the global batch of a step depends only on the seed and
the global batch size: one process with ``--grad-accum 4`` sees what 2 ranks with ``--grad-accum 2`` or 4
ranks without accumulation see, and their training agrees to float32 round-off. Validation (each epoch) is
the first ``--val-batches`` batches of fixed, non-overlapping windows of the validation split, spread over
the ranks; its loss is the mean over all those windows whatever the world size.

Gradient accumulation: each micro-batch's loss is divided by ``grad_accum``, so the accumulated gradient is
the mean over the global batch; all but the last micro-batch's backward run inside the wrapper's ``no_sync()``
(reduced once per step), but ``fsdp`` reduce-scatters every backward (exact: an averaged gradient plus the next
local one, averaged again, is the running mean). Gradient clipping (``--grad-clip``, 0 = off): the wrapper's
``clip_grad_norm_`` (as torch's, with the *global* norm: FSDP's shards' squares summed over the ranks).

The step is ``torch_impl.step.train_step``, the e2e and DDP benchmarks' too. Timing (per rank, the device's
time between CUDA events at the phase boundaries, ``torch_impl.timing.PhaseTimer``; nothing waits inside a step,
reading its loss ends it): per step ``data`` (windows to device), then the step's phases
(``analysis.records.STEP_PHASES``): ``forward`` (the model and the cross-entropy), ``backward``, ``comm`` (time
blocked in ``finish_gradient_synchronization``: the communication the backward did not hide; inside
``backward`` for torch DDP), ``optimizer`` (clipping, step, schedule, zero_grad); per epoch ``training``,
``validation``, ``checkpoint`` and ``epoch`` (all three); ``worker`` (since the trainer started, after the process
group) and ``total`` (since this module was imported: about the process's life). One record per epoch (rank 0 appends it to ``--out``): suite "train",
implementation the mode (e.g. "bucketed 25MB"), batch_size the per-rank micro-batch, timing / phases over
the epoch's steps (rank 0's; ms per optimizer step), tokens_per_s = tokens of the epoch's global batches /
training seconds, flops_per_step and tflops / mfu per device from ``parallelism_calc.compute.step_flops`` of
one rank's ``batch_size x grad_accum`` sequences, peak_memory_bytes the worst rank's
``torch.cuda.max_memory_allocated`` (None on a CPU); metrics: train_loss (the epoch's mean),
train_losses (per step, averaged over ranks), val_loss, samples_per_epoch, phase totals (s, slowest rank),
every rank's peak memory, the data set, the learning rate, the gradient norms, and where each rank ran
(``placement``, by rank: its host, its node's rank under a multi-node torchrun (GROUP_RANK) and its local rank).

Checkpoints (``--checkpoint-dir``, every ``--checkpoint-every`` epochs and at ``--stop-after-epochs``;
``torch_impl.checkpoint``: ``torch.distributed.checkpoint`` folders, written atomically): the model and the
optimizer state as full tensors by name (each rank writes what it holds: ZeRO-1 its parameters' state, FSDP its
shards' boxes), the LR scheduler, the data generator's state, the step, the settings and every rank's RNG states.
So a checkpoint resumes at any world size and in any ``--dist`` mode (same ``--dtype``): saved on 2 ranks, it
resumes on 1 or 4 with the same global batch (``--batch-size x --grad-accum x ranks``), whose next losses are the
uninterrupted run's to float32 round-off (different ranks sum in different orders). ``--resume`` loads the latest
and continues; on as many ranks in the same mode it gives exactly the uninterrupted run's losses (bit for bit with
one CPU thread, to float round-off with several: two uninterrupted runs on 2 threads already differ by ~1e-5, as
CPU kernels split their sums by thread). It refuses a checkpoint whose settings differ, or whose data set's content
digest (``TokenData.digest``: a hash of the file's bytes) is not the one of ``--data`` now, and one of this
trainer's earlier format (``shared.pt`` / ``rank-NNNNN.pt`` files), with one line each.

Elastic restart (``torchrun --max-restarts N``): the launcher restarts the whole group with the same command line
when a rank dies, so the trainer must decide by itself whether to continue. ``--auto-resume`` resumes from the
latest checkpoint in ``--checkpoint-dir`` if there is one and starts fresh otherwise: what torchtitan's checkpointer
(and MaxText's) does whenever checkpointing is on, so that one command line serves the first start, every restart
and a requeued job alike. It is a flag, not the default, because a run without it starts fresh in a folder that
holds checkpoints (tests and users rely on that); nor is it tied to ``TORCHELASTIC_RESTART_COUNT``, which a
requeued Slurm job resets to 0. A restarted worker without it (or ``--resume``) starts from step 0 with a warning.
Records carry ``metrics.restarts`` (torchrun's restart count of the group that ran the epoch).
Fault injection, for tests only: ``TRAIN_FAULT_AT_STEP=RANK:STEP`` makes rank RANK SIGKILL itself in optimizer
step STEP (1-based) after its first backward, before the gradient synchronization, on the first attempt only
(restart count 0), so the restarted group runs through (``tests/test_elastic.py``).

A non-finite loss ends the run after its epoch: the epoch's record has status "diverged" (no checkpoint of
it is saved) and the exit status is 1. ``--stop-after-epochs K`` ends the job after
epoch K (with a checkpoint), keeping the schedule of ``--epochs``: a preemption, on purpose.

Caveats: sampling is with replacement (CS336's ``get_batch``), so an "epoch" is a number of steps, not a
pass over the data; the default steps per epoch make one epoch about one pass over the training tokens.
AdamW's weight decay applies to every parameter (as in the DDP benchmark). The first epoch includes
warm-up costs (allocator, autotuning, the first NCCL calls).

References: CS336 (Stanford, 2025) assignment 1 (AdamW, cosine schedule with warm-up, gradient clipping,
checkpointing, the training loop) and assignment 2 (DDP and optimizer-state sharding); nanoGPT's
``train.py`` (gradient accumulation with ``no_sync``, autocast, the loop's shape).
"""

from __future__ import annotations

import time

_IMPORTED = time.perf_counter()  # "total" time counts from here (about the process's start)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from analysis.harness import DTYPES, StepRun, step_record  # noqa: E402
from analysis.records import TRAIN_PHASES as STEP_PHASES, Record, divergence, save_records  # noqa: E402
from lm_data import TokenData, global_batch_starts, prepare_data, validation_batch_starts  # noqa: E402
from lm_training import (TrainResult, TrainSettings, add_training_arguments, check_resume_settings,  # noqa: E402
                         describe_epoch, epoch_metrics, lr_at, progress_bar)
from parallelism_calc.cli import ArgumentParser, error_boundary, one_line, positive_float  # noqa: E402
from parallelism_calc.specs import ModelSpec  # noqa: E402
from torch_impl import checkpoint as ckpt  # noqa: E402
from torch_impl.device import pick_device  # noqa: E402
from torch_impl.data import batch_at  # noqa: E402
from torch_impl.distributed.process_group import (DistributedContext, free_port, init_distributed,  # noqa: E402
                                                   restart_count)
from torch_impl.model import MLPS, TransformerLM, cross_entropy  # noqa: E402
from torch_impl.parallelize import (CUDA_GRAPHS, WRAPPER_MODES as DIST_MODES, DataParallelConfig,  # noqa: E402
                                    check_cuda_graph, check_supported, data_parallel_configs, parallelize)
from torch_impl.linear_cross_entropy import LOSSES  # noqa: E402
from torch_impl.step import StepParts, autocast, for_loss, train_step  # noqa: E402
from torch_impl.timing import PhaseTimer  # noqa: E402

SUITE = "train"


@dataclass
class TrainConfig(TrainSettings):
    """Every setting of a run (the CLI's flags, same names): the shared ones (``lm_training.TrainSettings``) and
    PyTorch's own."""

    compile: bool = False
    cuda_graph: str = "off"
    dist: str = "none"
    bucket_mb: float = 25.0
    timeout: float = 300.0
    auto_resume: bool = False
    loss: str = "plain"  # torch_impl.linear_cross_entropy.LOSSES
    mlp: str = "torch"  # torch_impl.model.MLPS

    def __post_init__(self) -> None:
        if self.dist not in DIST_MODES:
            raise ValueError(f"--dist {self.dist!r}; accepted: {', '.join(DIST_MODES)}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss {self.loss!r}; accepted: {', '.join(LOSSES)}")
        if self.mlp not in MLPS:
            raise ValueError(f"--mlp {self.mlp!r}; accepted: {', '.join(MLPS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}; accepted: {', '.join(DTYPES)}")
        check_supported([self.dist], self.dtype, flag="--dist ", cuda_graphs=self.cuda_graph == "blocks")
        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        check_cuda_graph(self.cuda_graph, self.compile, "cuda" if cuda else "cpu", self.grad_accum)
        if not all(0 < v < math.inf for v in (self.bucket_mb, self.timeout)):
            raise ValueError("--bucket-mb and --timeout must be finite and > 0")
        if self.auto_resume and (self.resume or not self.checkpoint_dir):
            raise ValueError("--auto-resume needs --checkpoint-dir and no --resume (--resume insists on a checkpoint, "
                             "--auto-resume starts fresh without one)")
        super().__post_init__()


# ----------------------------------------------------------------------------- model, wrapper, optimizer


def build(cfg: TrainConfig, spec: ModelSpec, device: torch.device, world_size: int, total_steps: int) -> StepParts:
    """The model, compiled with --compile (its CUDA graphs with --cuda-graph blocks), in its data-parallel wrapper
    with AdamW and the LR schedule (``torch_impl.parallelize.parallelize``): what ``train_step`` calls."""
    torch.manual_seed(cfg.seed)
    model = TransformerLM(spec, attention=cfg.attention, device=device, loss=cfg.loss, mlp=cfg.mlp)
    if cfg.init_weights:
        model.load_numpy_weights(dict(np.load(cfg.init_weights)))
    adamw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps, betas=cfg.betas,
                 fused=device.type == "cuda")
    mode = data_parallel_config(cfg)
    forward, wrapper, optimizer = parallelize(model, mode.impl, bucket_mb=mode.bucket_mb, dtype=cfg.dtype,
                                              adamw=adamw, compile=cfg.compile,
                                              cuda_graphs=cfg.cuda_graph == "blocks")
    schedule = cfg.schedule(total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, **schedule) / cfg.lr)
    return StepParts(forward, optimizer, dtype=cfg.dtype, wrapper=wrapper, scheduler=scheduler,
                     grad_clip=cfg.grad_clip, loss_fn=for_loss(cfg.loss))


def data_parallel_config(cfg: TrainConfig) -> DataParallelConfig:
    """--dist with its bucket size (torch_ddp: its own default), named as the records name it."""
    return data_parallel_configs([cfg.dist], [cfg.bucket_mb])[0]


# ----------------------------------------------------------------------------- validation


def _all_reduce_sum(values: list[float], device: torch.device, world_size: int) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


@torch.no_grad()
def evaluate(parts: StepParts, cfg: TrainConfig, data: TokenData, device: torch.device, rank: int,
             world_size: int) -> float | None:
    """Mean loss over the validation windows (the first ``val_batches`` batches), all ranks together.

    Every rank runs as many forwards (under FSDP each is a collective): a rank with fewer batches (their count
    not a multiple of the world size) runs the first batch again, uncounted. With ``--cuda-graph blocks`` the
    blocks run eagerly here: without a backward to wait for, CUDA graph trees start a new generation at each
    call of the blocks' one compiled function and free the block before's output (measured on an H100)."""
    if cfg.val_batches == 0:
        return None
    every = validation_batch_starts(len(data.val), cfg.batch_size, cfg.seq_len, cfg.val_batches)  # all ranks'
    mine, forwards = every[rank::world_size], len(every[::world_size])  # rank 0's share is the largest
    parts.wrapper.module.eval()
    loss_sum, windows = 0.0, 0
    eager = torch.compiler.set_stance("force_eager") if cfg.cuda_graph == "blocks" else contextlib.nullcontext()
    for i in range(forwards):  # only this rank's batches are built (the padding one: batch 0 again)
        x, y = batch_at(data.val, mine[i] if i < len(mine) else every[0], cfg.seq_len, device)
        with autocast(cfg.dtype, device), eager:
            # the fused loss takes the targets (no logits); the plain one's logits go to cross_entropy
            loss = (parts.wrapper.eval_module(x, y) if cfg.loss == "fused"
                    else cross_entropy(parts.wrapper.eval_module(x), y))
        if i < len(mine):
            loss_sum += loss.item() * len(x)
            windows += len(x)
    parts.wrapper.module.train()
    loss_sum, windows = _all_reduce_sum([loss_sum, windows], device, world_size)
    return loss_sum / windows


# ----------------------------------------------------------------------------- checkpoints


def save(parts: StepParts, cfg: TrainConfig, step: int, generator: np.random.Generator, settings: dict) -> None:
    """A checkpoint of everything the next step depends on (see the module docstring). Collective."""
    trainer = {"settings": settings, "dist": cfg.dist, "scheduler": parts.scheduler.state_dict(),
               "data_generator": generator.bit_generator.state}
    ckpt.save_checkpoint(cfg.checkpoint_dir, step, parts.wrapper, parts.optimizer, trainer=trainer)


def restore(parts: StepParts, cfg: TrainConfig, generator: np.random.Generator, settings: dict) -> int:
    """Load the latest checkpoint into ``parts`` and ``generator`` (whatever world size and mode saved it); returns
    its step. Collective."""
    found = ckpt.read_checkpoint(cfg.checkpoint_dir)
    check_resume_settings(found.trainer["settings"], settings, found.path, cfg.data)
    ckpt.load_train_state(found, parts.wrapper, parts.optimizer)
    parts.scheduler.load_state_dict(found.trainer["scheduler"])
    generator.bit_generator.state = found.trainer["data_generator"]
    ckpt.restore_rng(found.rng)
    return found.step


def resume_step(parts: StepParts, cfg: TrainConfig, generator: np.random.Generator, settings: dict,
                rank: int) -> int:
    """The step this run starts from: ``restore``'s with --resume, or with --auto-resume when a checkpoint is
    there; else 0 (a restarted torchrun worker then warns that it starts over)."""
    restarts = restart_count()
    attempt = f"; torchrun restart {restarts}" if restarts else ""
    if cfg.resume or (cfg.auto_resume and ckpt.latest_checkpoint(cfg.checkpoint_dir) is not None):
        step = restore(parts, cfg, generator, settings)
        if rank == 0:
            print(f"resumed from step {step} ({cfg.checkpoint_dir}{attempt})", flush=True)
        return step
    if rank == 0 and cfg.auto_resume:
        print(f"no checkpoint in {cfg.checkpoint_dir}: starting from step 0{attempt}", flush=True)
    elif rank == 0 and restarts > 0:
        print(f"warning: torchrun restart {restarts} starts from step 0; pass --auto-resume (with --checkpoint-dir) "
              "to continue from the latest checkpoint", file=sys.stderr, flush=True)
    return 0


# ----------------------------------------------------------------------------- fault injection (tests only)

FAULT_ENV = "TRAIN_FAULT_AT_STEP"


def fault_at_step() -> tuple[int, int] | None:
    """(rank, step) of ``TRAIN_FAULT_AT_STEP=RANK:STEP`` on the first attempt (restart count 0); None otherwise."""
    value = os.environ.get(FAULT_ENV)
    if value is None or restart_count() > 0:
        return None
    rank, _, step = value.partition(":")
    if not (rank.isdigit() and step.isdigit() and int(step) >= 1):
        raise ValueError(f"{FAULT_ENV}={value!r}: write RANK:STEP, e.g. 1:5 (rank 1 dies in optimizer step 5)")
    return int(rank), int(step)


def _dying_mark(mark: Callable[[str], None], rank: int, step: int) -> Callable[[str], None]:
    """``mark`` that SIGKILLs this process at the step's first "backward" mark (before the gradient sync)."""
    def dying(phase: str) -> None:
        mark(phase)
        if phase == "backward":
            print(f"{FAULT_ENV}: rank {rank} kills itself in step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return dying


# ----------------------------------------------------------------------------- the run


@dataclass
class _EpochStats:
    step_ms: list[float] = field(default_factory=list)
    phase_ms: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in STEP_PHASES})
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def _context(cfg: TrainConfig) -> DistributedContext:
    if dist.is_available() and dist.is_initialized():
        return init_distributed(device="cpu" if cfg.device == "cpu" else None)  # no re-initialization
    return DistributedContext(0, 1, 0, pick_device(cfg.device), "none")


def run_training(cfg: TrainConfig, ctx: DistributedContext | None = None, *,
                 keep_params: bool = False) -> TrainResult:
    """Train as configured; ``ctx`` defaults to the initialized process group, or one process."""
    worker_start = time.perf_counter()
    ctx = ctx or _context(cfg)
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    if cfg.dist == "none" and world_size > 1:
        raise ValueError("--dist none runs as one process; pick a data-parallel mode for several ranks")
    if cfg.dtype == "fp32":
        torch.set_float32_matmul_precision("highest")
    spec = cfg.spec()
    data = prepare_data(cfg.data, cfg.cache_dir, builtin_bytes=int(cfg.builtin_mb * 2**20),
                        val_fraction=cfg.val_fraction)
    data.check_vocab(spec.vocab_size)
    data.check_windows(cfg.seq_len, validation=cfg.val_batches > 0)
    global_batch = cfg.grad_accum * world_size * cfg.batch_size
    steps_per_epoch = cfg.steps_per_epoch_for(len(data.train), global_batch)
    total_steps = cfg.epochs * steps_per_epoch
    parts = build(cfg, spec, device, world_size, total_steps)
    generator = np.random.default_rng(cfg.seed)
    settings = cfg.resume_settings(data, steps_per_epoch, global_batch)
    fault = fault_at_step()
    if fault is not None and fault[0] >= world_size:
        raise ValueError(f"{FAULT_ENV}: rank {fault[0]} does not exist on {world_size} rank(s)")
    step = resume_step(parts, cfg, generator, settings, rank)
    result = TrainResult([], [], [], start_step=step)
    stop_epoch = cfg.stop_epoch
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for epoch in range(step // steps_per_epoch, stop_epoch):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        epoch_start = time.perf_counter()
        stats = _EpochStats()
        bar = progress_bar(steps_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}", cfg.progress and rank == 0)
        timer = PhaseTimer(device)
        for _ in range(steps_per_epoch):
            step_start = time.perf_counter()
            timer.start()
            starts = global_batch_starts(len(data.train), cfg.grad_accum, world_size, cfg.batch_size, cfg.seq_len,
                                         generator)  # (micro, rank, row)
            micro = [batch_at(data.train, starts[j, rank], cfg.seq_len, device) for j in range(cfg.grad_accum)]
            timer.mark("data")
            mark = _dying_mark(timer.mark, rank, step + 1) if fault == (rank, step + 1) else timer.mark
            loss, norm = train_step(parts, micro, mark)
            stats.losses.append(loss.item())  # waits for the step: the wall clock below is the step's
            stats.step_ms.append((time.perf_counter() - step_start) * 1e3)
            if norm is not None:
                stats.grad_norms.append(norm.item())
            step += 1
            if bar is not None:
                tokens_s = global_batch * cfg.seq_len * len(stats.step_ms) / (sum(stats.step_ms) / 1e3)
                bar.set_postfix(loss=f"{stats.losses[-1]:.4f}", tok_s=f"{tokens_s:,.0f}", refresh=False)
                bar.update()
        phases = timer.results()[1]
        stats.phase_ms = {p: phases.get(p, [0.0] * steps_per_epoch) for p in STEP_PHASES}
        if bar is not None:
            bar.close()
        training_s = time.perf_counter() - epoch_start
        val_start = time.perf_counter()
        val_loss = evaluate(parts, cfg, data, device, rank, world_size)
        validation_s = time.perf_counter() - val_start
        losses = [v / world_size for v in _all_reduce_sum(stats.losses, device, world_size)]
        checkpoint_s = 0.0
        last = epoch + 1 == stop_epoch
        diverged = divergence(losses + ([] if val_loss is None else [val_loss]))  # the same on every rank
        if cfg.checkpoint_dir and not diverged and ((epoch + 1) % cfg.checkpoint_every == 0 or last):
            ckpt_start = time.perf_counter()
            save(parts, cfg, step, generator, settings)
            checkpoint_s = time.perf_counter() - ckpt_start
        mine = {"phase_s": {p: sum(v) / 1e3 for p, v in stats.phase_ms.items()},
                "placement": ctx.placement,
                "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                "training_s": training_s, "validation_s": validation_s, "checkpoint_s": checkpoint_s,
                "epoch_s": time.perf_counter() - epoch_start}
        gathered = [mine]
        if world_size > 1:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, mine)
        times = {"worker_s": time.perf_counter() - worker_start, "total_s": time.perf_counter() - _IMPORTED}
        record = _epoch_record(cfg, spec, epoch, steps_per_epoch, step, global_batch, world_size, device_name,
                               stats, losses, val_loss, gathered, times, data, parts)
        result.records.append(record)
        result.train_losses += losses
        result.val_losses.append(val_loss)
        if rank == 0:
            if cfg.out:
                save_records(cfg.out, record)
            print(describe_epoch(record), flush=True)
        if diverged:  # its record says "diverged"; a checkpoint of it would only hold NaNs
            if rank == 0:
                print(f"error: epoch {epoch + 1}: {diverged}; training stopped, no checkpoint of this epoch",
                      file=sys.stderr, flush=True)
            result.diverged = True
            break
    result.stopped_early = stop_epoch < cfg.epochs
    if keep_params:
        result.params = {k: v.detach().cpu().clone() for k, v in parts.wrapper.gather_full_params().items()}
    return result


def _epoch_record(cfg: TrainConfig, spec: ModelSpec, epoch: int, steps_per_epoch: int, step: int,
                  global_batch: int, world_size: int, device_name: str, stats: _EpochStats,
                  losses: list[float], val_loss: float | None, gathered: list[dict], times: dict,
                  data: TokenData, parts: StepParts) -> Record:
    worst = {k: max(g[k] for g in gathered) for k in ("training_s", "validation_s", "checkpoint_s", "epoch_s")}
    peaks = [g["peak"] for g in gathered]
    run = StepRun(suite=SUITE, mode="train_step", dtype=cfg.dtype, batch_size=cfg.batch_size * cfg.grad_accum,
                  warmup=0, steps=len(stats.step_ms))
    metrics = {
        **epoch_metrics(cfg, epoch=epoch, step=step, steps_per_epoch=steps_per_epoch, global_batch=global_batch,
                        losses=losses, val_loss=val_loss, data=data),
        "compiled": cfg.compile, "cuda_graph": cfg.cuda_graph, "dist": cfg.dist, "loss": cfg.loss, "mlp": cfg.mlp,
        "grad_norms": stats.grad_norms,
        **worst, **times,
        "phase_totals_s": {p: max(g["phase_s"][p] for g in gathered) for p in STEP_PHASES},
        "per_rank_peak_memory_bytes": peaks,
        "placement": [g["placement"] for g in gathered],
        "restarts": restart_count(),
    }
    record = step_record(run, spec, cfg.seq_len, backend="torch", implementation=data_parallel_config(cfg).name,
                         device_name=device_name, step_times_ms=stats.step_ms, phases_ms=stats.phase_ms,
                         peak_memory_bytes=None if None in peaks else max(peaks), metrics=metrics)
    record.batch_size = cfg.batch_size
    record.world_size = world_size
    record.mesh = {parts.wrapper.mesh_axis: world_size}
    record.tokens_per_s = metrics["tokens_per_epoch"] / worst["training_s"]
    return record


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = ArgumentParser(prog="python -m torch_impl.train", description=__doc__.split("\n\n")[0])
    add_training_arguments(p, d, batch_help="sequences per micro-batch per rank")
    a = p.add_argument
    a("--dtype", choices=list(DTYPES), default=d.dtype,
      help="fp32; bf16 autocast with fp32 weights; bf16_mixed: bf16 weights, fp32 masters in the optimizer")
    a("--compile", action="store_true", help="torch.compile each block (with --dist fsdp each block's forward, its "
                                             "gathers eager around it)")
    a("--cuda-graph", choices=CUDA_GRAPHS, default=d.cuda_graph,
      help="blocks: replay each compiled block as CUDA graphs (needs --compile, CUDA, --grad-accum 1; default off)")
    a("--dist", choices=DIST_MODES, default=d.dist, help=f"data-parallel mode (default {d.dist})")
    a("--loss", choices=LOSSES, default=d.loss,
      help="plain: the LM head's logits, then the cross-entropy (default); fused: the two fused, chunked over "
           "tokens, never the logits")
    a("--mlp", choices=MLPS, default=d.mlp,
      help="SwiGLU's MLP: torch (PyTorch's ops; default) or gluon (one op whose GEMMs compute SwiGLU and its backward "
           "in their epilogues: sm_90, bf16)")
    a("--bucket-mb", type=positive_float, default=d.bucket_mb,
      help="bucket size in MiB for bucketed, zero1 and zero2 (default 25)")
    a("--device", default=d.device, help="auto (CUDA if available), cpu, or cuda")
    a("--timeout", type=positive_float, default=d.timeout, help="process-group timeout in seconds (default 300)")
    a("--auto-resume", action="store_true",
      help="resume from the latest checkpoint in --checkpoint-dir if there is one, else start fresh (for torchrun "
           "--max-restarts and requeued jobs: one command line for every start)")
    return p


def _failure_record(cfg: TrainConfig, err: BaseException, world_size: int) -> Record:
    oom = isinstance(err, torch.OutOfMemoryError)
    record = Record(suite=SUITE, backend="torch", implementation=data_parallel_config(cfg).name, model=cfg.model,
                    batch_size=cfg.batch_size, seq_len=cfg.seq_len, dtype=cfg.dtype, mode="train_step",
                    world_size=world_size, status="oom" if oom else "error",
                    error=f"{type(err).__name__}: {err}".splitlines()[0],
                    metrics={"attention": cfg.attention, "compiled": cfg.compile, "dist": cfg.dist, "loss": cfg.loss,
                             "mlp": cfg.mlp, "grad_accum": cfg.grad_accum,
                             "run": cfg.run_name, "restarts": restart_count()})
    record.provenance["device_name"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return record


@error_boundary(prog="python -m torch_impl.train")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
        cfg.spec()
        pick_device(cfg.device)  # CUDA asked for and absent: refused here, not a silent CPU run
    except ValueError as err:
        parser.error(str(err))
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.dist == "none" and world_env > 1:
        parser.error("--dist none runs as one process; pick a data-parallel mode for several ranks")
    return _main(cfg, parser)


def _main(cfg: TrainConfig, parser: argparse.ArgumentParser) -> int:
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if cfg.dist == "none":
            return 1 if run_training(cfg).diverged else 0
        if world_size == 1:  # a one-rank group for the wrappers, on a free port
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        from torch_impl.distributed import distributed_context

        with distributed_context(timeout_s=cfg.timeout, device="cpu" if cfg.device == "cpu" else None) as ctx:
            return 1 if run_training(cfg, ctx).diverged else 0
    except ValueError as err:
        parser.error(str(err))
    except RuntimeError as err:  # out of memory, a kernel or a collective failing: a record, not a gap
        if rank == 0 and cfg.out:
            save_records(cfg.out, _failure_record(cfg, err, world_size))
        print(f"error: {type(err).__name__}: {one_line(err)}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
