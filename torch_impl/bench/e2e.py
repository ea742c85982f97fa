"""End-to-end step benchmark of the PyTorch model: ``python -m torch_impl.bench.e2e --model tiny``.

Times ``--mode`` forward (no gradients) | forward_backward | train_step (AdamW) for ``--warmup`` untimed and
``--steps`` timed steps on a fixed random batch (so in train_step mode the loss falls as the model memorizes
it), synchronizing the device around every step, and writes one record (``analysis.records``) with the
per-step and per-phase times, tokens/s, TFLOP/s and MFU (FLOPs from ``parallelism_calc``), peak memory and
the losses. The JAX twin, ``python -m jax_impl.bench.e2e``, takes the same flags; ``--save-weights`` here and
``--load-weights`` there start both from the same weights. An OOM or error is recorded, not lost.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import numpy as np
import torch

from analysis.benchmark import failure_record, fixed_batch, resolve_spec, run_benchmark, step_record
from analysis.records import Record
from parallelism_calc.checkpointing import checkpointed_activation_bytes
from parallelism_calc.memory import activation_bytes_per_token, per_device_memory
from torch_impl import nvtx
from torch_impl.checkpointing import apply_activation_checkpointing
from torch_impl.model import TransformerLM, cross_entropy
from torch_impl.profiling import profile_steps


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available; accepted here: cpu, auto")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}; accepted: auto, cpu, cuda, cuda:N") from None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace) -> Record:
    spec, seq_len = resolve_spec(args)
    device = pick_device(args.device)
    if args.dtype == "fp32":
        torch.set_float32_matmul_precision("highest")  # no TF32: fp32 means fp32, as in the JAX twin
    torch.manual_seed(args.seed)
    model = TransformerLM(spec, attention=args.attention, device=device)
    if args.load_weights:
        model.load_numpy_weights(dict(np.load(args.load_weights)))
    if args.save_weights:
        np.savez(args.save_weights, **model.to_numpy_weights())
    if args.nested_checkpoint and not args.checkpoint_every:
        raise ValueError("--nested-checkpoint needs --checkpoint-every K")
    if args.memory_snapshot and device.type != "cuda":
        raise ValueError("--memory-snapshot records the CUDA allocator: it needs --device cuda")
    if args.checkpoint_every:
        apply_activation_checkpointing(model, args.checkpoint_every, nested=args.nested_checkpoint)
    tokens = torch.from_numpy(fixed_batch(args.seed, args.batch_size, seq_len, spec.vocab_size)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    fused = device.type == "cuda" if args.fused_adamw == "auto" else args.fused_adamw == "on"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused)
    forward = torch.compile(model) if args.compile else model
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())

    def timed(phase: str, fn):
        synchronize(device)
        start = time.perf_counter()
        with nvtx.range(phase):
            out = fn()
        synchronize(device)
        return out, (time.perf_counter() - start) * 1e3

    def step() -> tuple[float, dict[str, float]]:
        if args.mode == "forward":
            with torch.no_grad(), autocast:
                loss, t_fwd = timed("forward", lambda: cross_entropy(forward(inputs), targets))
            return loss.item(), {"forward": t_fwd}
        with autocast:
            loss, t_fwd = timed("forward", lambda: cross_entropy(forward(inputs), targets))
        _, t_bwd = timed("backward", loss.backward)
        phases = {"forward": t_fwd, "backward": t_bwd}
        if args.mode == "train_step":
            _, phases["optimizer"] = timed("optimizer", optimizer.step)
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), phases

    losses, step_ms, phases_ms = [], [], {}
    with nvtx.range("warmup"):
        for _ in range(args.warmup):
            losses.append(step()[0])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if args.memory_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    for _ in range(args.steps):
        loss, phases = step()
        losses.append(loss)
        step_ms.append(sum(phases.values()))
        for phase, ms in phases.items():
            phases_ms.setdefault(phase, []).append(ms)
    if args.memory_snapshot:
        torch.cuda.memory._dump_snapshot(args.memory_snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    metrics = {"loss_first": losses[0], "loss_last": losses[-1], "losses": losses, "fused_adamw": fused,
               "checkpoint_every": args.checkpoint_every, "nested_checkpoint": args.nested_checkpoint,
               **predicted_memory(args, spec, seq_len)}
    if args.profile:
        rows = profile_steps(step, 3, args.profile, tag=f"{spec.name}_{args.mode}_{args.dtype}")
        metrics.update({f"time_share.{row.category}": row.fraction for row in rows})
    return step_record(
        args, spec, seq_len, backend="torch", implementation=implementation_name(args),
        device_name=device_name(device), step_times_ms=step_ms, phases_ms=phases_ms,
        peak_memory_bytes=peak, metrics=metrics,
    )


def predicted_memory(args: argparse.Namespace, spec, seq_len: int) -> dict[str, int | None]:
    """What ``parallelism_calc`` predicts for this run: the activations saved for backward at the step's peak
    (``checkpointing.checkpointed_activation_bytes`` for ``--checkpoint-every K`` flat or nested, else
    ``memory.activation_bytes_per_token``) and, for a train step, the device's peak: those activations
    plus weights, gradients and AdamW state (``memory.per_device_memory``, one device). Forward-only runs
    save nothing for backward: None."""
    if args.mode == "forward":
        return {"predicted_activation_bytes": None, "predicted_peak_bytes": None}
    precision = "fp32" if args.dtype == "fp32" else "bf16_autocast"
    attention = "naive" if args.attention == "naive" else "flash"
    tokens = args.batch_size * seq_len
    if args.checkpoint_every:
        activations = checkpointed_activation_bytes(spec, seq_len, precision, args.checkpoint_every,
                                                    args.nested_checkpoint, attention).for_tokens(tokens)
    else:
        activations = activation_bytes_per_token(spec, seq_len, precision, "none", attention).for_tokens(tokens)
    peak = None
    if args.mode == "train_step":
        state = per_device_memory(spec, "ddp", 1, tokens, seq_len, precision, attention=attention)
        peak = int(state.total - state.activations + activations)
    return {"predicted_activation_bytes": activations, "predicted_peak_bytes": peak}


def implementation_name(args: argparse.Namespace) -> str:
    """e.g. 'compiled sdpa, ckpt 2 nested': how the model ran."""
    name = f"{'compiled' if args.compile else 'eager'} {args.attention}"
    if args.checkpoint_every:
        name += f", ckpt {args.checkpoint_every}" + (" nested" if args.nested_checkpoint else "")
    return name


def failed_record(args: argparse.Namespace, err: RuntimeError) -> Record:
    """The record of a run that ran out of memory or failed, so the failure is a row, not a gap."""
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    return failure_record(args, err, backend="torch", implementation=implementation_name(args),
                          device_name=device_name(torch.device(device)),
                          oom=isinstance(err, torch.OutOfMemoryError))


def add_torch_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the PyTorch benchmark alone."""
    torch_flags = parser.add_argument_group("PyTorch")
    torch_flags.add_argument("--compile", action="store_true", help="torch.compile the model")
    torch_flags.add_argument("--checkpoint-every", type=int, metavar="K",
                             help="activation checkpointing: recompute every segment of K blocks")
    torch_flags.add_argument("--nested-checkpoint", action="store_true",
                             help="also checkpoint each block inside a segment (with --checkpoint-every)")
    torch_flags.add_argument("--fused-adamw", choices=("auto", "on", "off"), default="auto",
                             help="fused AdamW kernel (auto: on CUDA)")
    torch_flags.add_argument("--profile", metavar="DIR",
                             help="after timing, profile 3 steps: Chrome trace and kernel table in DIR")
    torch_flags.add_argument("--memory-snapshot", metavar="PICKLE",
                             help="record the CUDA allocator's history over the timed steps and save the "
                                  "snapshot that pytorch.org/memory_viz opens")


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(argv, prog="python -m torch_impl.bench.e2e", description=__doc__.splitlines()[0],
                         measure=measure, on_failure=failed_record, add_arguments=add_torch_arguments)


if __name__ == "__main__":
    sys.exit(main())
