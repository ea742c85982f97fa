"""The framework-free half of the training loop, shared by ``torch_impl.train`` and ``jax_impl.trainer`` (stdlib only).

* ``lr_at(step, *, lr, min_lr, warmup_steps, total_steps)``: the learning rate of an optimizer step, linear
  warm-up then a cosine down to ``min_lr`` (torch's ``LambdaLR`` and optax's schedule both evaluate it).
* ``TrainSettings``: the settings both trainers take (the CLI's flags, same names), checked on construction;
  ``.spec()`` (the preset with its overrides), ``.final_lr``, ``.schedule(total_steps)`` (``lr_at``'s keywords),
  ``.steps_per_epoch_for(train_tokens, global_batch)``, ``.stop_epoch``, ``.resume_settings(...)`` (what a
  checkpoint must share with a resumed run: ``RESUME_KEYS``, the data set's content digest, the steps per epoch
  and the global batch). Each backend's config subclasses it with its own flags.
* ``add_training_arguments(parser, defaults)``: the shared flags (each trainer adds its own: dtype, parallelism).
* ``check_resume_settings(saved, now, checkpoint, data)``: a ValueError naming what differs (the data set first).
* ``epoch_metrics(cfg, ...)``: the metrics of an epoch record every trainer writes (the same names in both
  backends, so ``analysis.training`` reads either); ``describe_epoch(record)``: its one-line summary.
* ``TrainResult``: what a run returns (records, losses, where it started, how it ended);
  ``progress_bar(total, desc, enabled)``: a tqdm bar on stderr, or None (disabled, or tqdm missing).

References: CS336 (Stanford, 2025) assignment 1 (the cosine schedule with warm-up, the training loop); MaxText's
``train.py`` (one config object across the loop); nanoGPT's ``train.py`` (``get_lr``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from lm_data import DEFAULT_BUILTIN_BYTES, DEFAULT_VAL_FRACTION, TokenData
from parallelism_calc.cli import (fraction, nonnegative_float, nonnegative_int, positive_float, positive_int,
                                  writable_path)
from parallelism_calc.specs import MODELS, ModelSpec, get_model

# Settings a resumed run must share with the checkpoint for its trajectory to be the uninterrupted one's.
RESUME_KEYS = ("model", "d_model", "d_ff", "n_layers", "n_heads", "vocab_size", "seq_len", "epochs",
               "steps_per_epoch", "lr", "min_lr", "warmup_steps", "grad_clip", "weight_decay", "adam_eps",
               "betas", "seed", "init_weights", "dtype", "data", "val_batches")


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up lr * (step + 1) / warmup_steps
    for the first ``warmup_steps`` steps, then a cosine from lr (at step ``warmup_steps``) down to min_lr
    (at the last step, ``total_steps - 1``): min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2 with
    p = (step - warmup_steps) / (total_steps - 1 - warmup_steps), clamped to [0, 1]."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainSettings:
    """The settings both trainers share (the CLI's flags, same names); a backend's config adds its own."""

    model: str = "tiny"
    d_model: int | None = None
    d_ff: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    vocab_size: int | None = None
    epochs: int = 1
    steps_per_epoch: int | None = None  # None: about one pass over the training tokens
    stop_after_epochs: int | None = None
    batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 64
    lr: float = 1e-3
    min_lr: float | None = None  # None: lr / 10
    warmup_steps: int = 0
    grad_clip: float = 1.0
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    dtype: str = "fp32"
    attention: str = "sdpa"
    val_batches: int = 8
    data: str = "builtin"
    cache_dir: str = ".cache/data"
    builtin_mb: float = DEFAULT_BUILTIN_BYTES / 2**20
    val_fraction: float = DEFAULT_VAL_FRACTION
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    resume: bool = False
    out: str | None = None
    seed: int = 0
    init_weights: str | None = None  # .npz of stable names: the initial weights, instead of --seed's draw
    run_name: str | None = None  # tags the records (metrics.run), e.g. a sweep's cell
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        for name in ("epochs", "batch_size", "grad_accum", "seq_len", "checkpoint_every"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        for name in ("steps_per_epoch", "stop_after_epochs"):
            if getattr(self, name) is not None and not getattr(self, name) >= 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "val_batches", "grad_clip", "weight_decay"):  # `not >=`: NaN fails too
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be finite and >= 0")
        if not 0 < self.lr < math.inf or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"--lr={self.lr} must be finite and > 0 and --min-lr={self.min_lr} in [0, lr]")
        if not 0 < self.adam_eps < math.inf:
            raise ValueError(f"--adam-eps={self.adam_eps} must be finite and > 0")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if self.init_weights is not None and not os.path.isfile(self.init_weights):
            raise ValueError(f"--init-weights {self.init_weights}: no such file (a .npz of weights by their stable "
                             f"names, e.g. from an e2e benchmark's --save-weights)")

    def spec(self) -> ModelSpec:
        """The preset with any dimension overridden, its context grown to --seq-len if shorter."""
        spec = get_model(self.model)
        if spec.arch != "transformer":
            raise ValueError(f"model {spec.name!r} is an analysis-only {spec.arch} model; pick a Transformer preset")
        changes = {k: getattr(self, k) for k in ("d_model", "d_ff", "n_layers", "n_heads", "vocab_size")
                   if getattr(self, k) is not None}
        if self.seq_len > spec.context_length:
            changes["context_length"] = self.seq_len
        return spec.replace(**changes) if changes else spec

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def stop_epoch(self) -> int:
        """The epoch after which this job ends (--stop-after-epochs, at most --epochs)."""
        return min(self.epochs, self.stop_after_epochs or self.epochs)

    def schedule(self, total_steps: int) -> dict[str, Any]:
        """``lr_at``'s keywords for a run of ``total_steps`` optimizer steps."""
        return dict(lr=self.lr, min_lr=self.final_lr, warmup_steps=self.warmup_steps, total_steps=total_steps)

    def steps_per_epoch_for(self, train_tokens: int, global_batch: int) -> int:
        """--steps-per-epoch, or enough steps of ``global_batch`` windows for about one pass over the tokens."""
        return self.steps_per_epoch or max(1, train_tokens // (global_batch * self.seq_len))

    def resume_settings(self, data: TokenData, steps_per_epoch: int, global_batch: int) -> dict[str, Any]:
        """What a checkpoint records and a resumed run must match: the data set by its content digest."""
        return {**{k: getattr(self, k) for k in RESUME_KEYS}, "data": data.digest,
                "steps_per_epoch": steps_per_epoch, "global_batch": global_batch}


def _plain(settings: dict[str, Any]) -> dict[str, Any]:
    """As JSON holds them (tuples become lists), so settings read back from JSON or a pickle compare alike."""
    return json.loads(json.dumps(settings))


def check_resume_settings(saved: dict[str, Any], now: dict[str, Any], checkpoint: object, data: str) -> None:
    """A ValueError if the checkpoint's ``saved`` settings differ from ``now`` (``resume_settings``): the data set
    (content digest) named first, as the likeliest slip; ``checkpoint`` names where it was read, ``data`` --data."""
    saved, now = _plain(saved), _plain(now)
    differ = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if "data" in differ:
        raise ValueError(f"--resume: --data {data} is not the data set the checkpoint {checkpoint} was trained "
                         f"on (content digest {differ['data'][0]} there, {differ['data'][1]} now); resume with "
                         "the same data")
    if differ:
        raise ValueError(f"--resume: settings differ from the checkpoint {checkpoint} (saved, now): {differ}")


def betas(text: str) -> tuple[float, float]:
    """An argparse type: two AdamW betas, e.g. ``0.9,0.95``, each in [0, 1)."""
    try:
        b1, b2 = (float(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write two numbers, e.g. 0.9,0.95") from None
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: each beta must be in [0, 1), e.g. 0.9,0.95")
    return b1, b2


def add_training_arguments(parser: argparse.ArgumentParser, d: TrainSettings, *, batch_help: str) -> None:
    """The flags of ``TrainSettings`` but --dtype (each backend has its own choices); defaults from ``d``."""
    a = parser.add_argument
    a("--model", default=d.model, help=f"model preset: {', '.join(MODELS)} (default {d.model})")
    for flag in ("--d-model", "--d-ff", "--n-layers", "--n-heads", "--vocab-size"):
        a(flag, type=positive_int, help="override the preset's dimension")
    a("--epochs", type=positive_int, default=d.epochs, help=f"epochs (default {d.epochs})")
    a("--steps-per-epoch", type=positive_int,
      help="optimizer steps per epoch (default: about one pass over the tokens)")
    a("--stop-after-epochs", type=positive_int, help="end the job after this many epochs (checkpointed), keeping the "
                                                     "schedule of --epochs; continue with --resume")
    a("--batch-size", type=positive_int, default=d.batch_size, help=f"{batch_help} (default {d.batch_size})")
    a("--grad-accum", type=positive_int, default=d.grad_accum, help="micro-batches per optimizer step (default 1)")
    a("--seq-len", type=positive_int, default=d.seq_len, help=f"tokens per sequence (default {d.seq_len})")
    a("--lr", type=positive_float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    a("--min-lr", type=nonnegative_float, help="learning rate at the last step (default lr / 10)")
    a("--warmup-steps", type=nonnegative_int, default=d.warmup_steps, help="linear warm-up steps (default 0)")
    a("--grad-clip", type=nonnegative_float, default=d.grad_clip,
      help=f"max global gradient norm, 0 = off (default {d.grad_clip})")
    a("--weight-decay", type=nonnegative_float, default=d.weight_decay,
      help=f"AdamW weight decay (default {d.weight_decay})")
    a("--adam-eps", type=positive_float, default=d.adam_eps, help=f"AdamW eps (default {d.adam_eps})")
    a("--betas", type=betas, default=d.betas, help="AdamW betas (default 0.9,0.999)")
    a("--attention", default=d.attention, help=f"attention backend (default {d.attention})")
    a("--val-batches", type=nonnegative_int, default=d.val_batches,
      help="validation batches per epoch, 0 = none (default 8)")
    a("--data", default=d.data, help="builtin (the stdlib's source as bytes), a .npy token file, or a text file")
    a("--cache-dir", default=d.cache_dir, help=f"where byte corpora are built (default {d.cache_dir})")
    a("--builtin-mb", type=positive_float, default=d.builtin_mb,
      help=f"size of the built-in corpus (default {d.builtin_mb:g})")
    a("--val-fraction", type=fraction, default=d.val_fraction, help="share of the data for validation (default 0.05)")
    a("--checkpoint-dir", help="save checkpoints here")
    a("--checkpoint-every", type=positive_int, default=d.checkpoint_every,
      help="epochs between checkpoints (default 1)")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    a("--out", metavar="JSONL", type=writable_path, help="append one record per epoch here")
    a("--seed", type=nonnegative_int, default=d.seed, help="seed of the weights and the data order (default 0)")
    a("--init-weights", metavar="NPZ", help="start from these weights (stable names, .npz, e.g. an e2e benchmark's "
                                           "--save-weights; the other backend's too) instead of --seed's draw")
    a("--run-name", help="a name for this run, written into its records (metrics.run)")
    a("--no-progress", dest="progress", action="store_false", help="no progress bar")


def epoch_metrics(cfg: TrainSettings, *, epoch: int, step: int, steps_per_epoch: int, global_batch: int,
                  losses: list[float], val_loss: float | None, data: TokenData) -> dict[str, Any]:
    """The metrics of epoch ``epoch`` (0-based) that both trainers' records carry, under the same names;
    ``step`` is the optimizer steps done, ``losses`` the epoch's per-step training losses."""
    tokens_per_epoch = global_batch * steps_per_epoch * cfg.seq_len
    return {
        "epoch": epoch + 1, "epochs": cfg.epochs, "step": step, "steps_per_epoch": steps_per_epoch,
        "attention": cfg.attention, "grad_accum": cfg.grad_accum, "global_batch": global_batch,
        "samples_per_epoch": global_batch * steps_per_epoch, "tokens_per_epoch": tokens_per_epoch,
        "train_loss": statistics.fmean(losses), "train_losses": losses, "val_loss": val_loss,
        "lr": lr_at(step - 1, **cfg.schedule(cfg.epochs * steps_per_epoch)),  # of the epoch's last step
        "data": data.describe(), "seed": cfg.seed, "lr_max": cfg.lr, "min_lr": cfg.final_lr,
        "warmup_steps": cfg.warmup_steps, "grad_clip": cfg.grad_clip, "weight_decay": cfg.weight_decay,
        "run": cfg.run_name,
    }


def describe_epoch(record: Any) -> str:
    """One line per epoch record: losses, seconds (training, validation), tokens/s, samples."""
    m = record.metrics
    val = f"{m['val_loss']:.4f}" if m["val_loss"] is not None else "-"
    return (f"epoch {m['epoch']}/{m['epochs']}: train loss {m['train_loss']:.4f}, val loss {val}, "
            f"{m['epoch_s']:.2f} s ({m['training_s']:.2f} training, {m['validation_s']:.2f} validation), "
            f"{record.tokens_per_s:,.0f} tokens/s, {m['samples_per_epoch']} samples")


@dataclass
class TrainResult:
    records: list  # analysis.records.Record, one per epoch run (on every rank; rank 0 wrote them to --out)
    train_losses: list[float]  # per step run, averaged over ranks
    val_losses: list[float | None]  # per epoch run
    start_step: int  # 0, or the step resumed from
    params: dict[str, Any] | None = None  # full final parameters on the host, stable names (keep_params=True)
    stopped_early: bool = False
    diverged: bool = False  # a loss was not finite: the run stopped after that epoch (its record: "diverged")


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar of ``total`` steps on stderr, or None when disabled or tqdm is missing (the GPU image may lack
    it: the per-epoch line is printed anyway)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr, leave=False)
