"""The CS336 leaderboard's training step: ``torchrun --nproc_per_node N -m torch_impl.bench.leaderboard [flags]``.

One full step of ``TransformerLM(--model)`` (default ``lm8b``): forward, loss, backward and the AdamW step, on a
global batch of ``--batch-size`` sequences (default 2) of ``--seq-len`` tokens (default the preset's context, 32,768
for lm8b), split evenly over the ranks and sharded with ``--dist fsdp`` (ours) or ``fsdp2`` (``fully_shard``), both
through ``torch_impl.parallelize.parallelize`` (torchtitan's order: activation checkpointing ``--ac-every K``
[``--nested-checkpoint`` or ``--keep-attention``], ``--compile`` (each block's forward, the FSDP's hooks eager
around it), then the wrapper). ``--loss fused|plain``, ``--attention`` and ``--dtype`` (default bf16 autocast) as
the e2e benchmark names them; ``--layers`` overrides the preset's depth, to profile the memory on one GPU with fewer
blocks. The global batch is ``analysis.harness.fixed_batch(--seed, ...)``; rank r takes rows r x B / N onwards.

Timing: ``--warmup`` untimed steps, then ``--steps`` steps timed by phase (``torch_impl.timing.PhaseTimer``: CUDA
events, or host clocks on the CPU; phases ``forward`` (model + loss), ``backward``, ``comm`` (ours: what the
backward did not hide; fsdp2's is inside ``backward``, recorded 0) and ``optimizer``), each step's time the slowest
rank's; then, where triton and CUDA are there, ``triton.testing.do_bench`` of the whole step, as the leaderboard's
handout times it: its per-call times are the record's step times (``metrics.timer`` = "do_bench"), else those of
the phase-timed loop ("phase_timer"). do_bench picks its number of calls from a first estimate on each rank; its
``warmup`` and ``rep`` are set from the agreed (slowest) warm-up step so every rank makes the same number of calls
(a rank that did not would leave the others in a collective until ``--timeout``).

Record (rank 0 appends one to ``--out``, ``analysis.records``): suite "leaderboard", world_size, mesh {"fsdp": N},
the step's timing and phases, ``peak_memory_bytes`` (the worst rank's ``torch.cuda.max_memory_allocated`` after the
warm-up; None on the CPU), and metrics: ``per_rank_peak_memory_bytes``, ``loss_first`` / ``loss_last`` (the global
batch's mean loss: the ranks' mean), the flags, and the calculator's predictions for the same configuration:
``predicted_memory_bytes`` (+ ``predicted_memory``, its terms; ``analysis.data_parallel.sharded_step_memory``:
``parallelism_calc.memory.per_device_memory`` with the gathering our FSDP / FSDP2 does, the loss and the kept
attention) and, on a GPU the calculator knows, ``floor_s`` (+ ``floor``, its parts;
``parallelism_calc.roofline.step_time_floor`` at the datasheet rates). ``--profile DIR`` profiles one more step:
rank 0's Chrome trace and kernel table in DIR, its kernels' shares and largest kernels in the record
(``torch_impl.profiling.profile_metrics``). Bad input is one line (exit 2); a rank that fails prints one line, rank
0 records the failure if it can, and every process exits non-zero (torchrun stops the rest; a collective waits
``--timeout`` at most).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

from analysis.data_parallel import LEADERBOARD_SUITE, sharded_step_memory
from analysis.harness import (DTYPES, StepRun, calculator_terms, fixed_batch, recomputation, resolve_spec,
                              step_record)
from analysis.records import STEP_PHASES, Record, save_records
from parallelism_calc.cli import (ArgumentParser, error_boundary, nonnegative_int, positive_float, positive_int,
                                  writable_path)
from parallelism_calc.memory import LOSSES, get_precision
from parallelism_calc.roofline import Ceilings, step_time_floor
from parallelism_calc.specs import MODELS, get_model, hardware_for_device

SUITE = LEADERBOARD_SUITE
SHARDING = ("fsdp", "fsdp2")  # torch_impl.parallelize.DATA_PARALLEL's sharded modes
PROFILED_STEPS = 1  # --profile: a step of lm8b is seconds long and launches ~10^5 kernels


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaderboardConfig:
    """A run of this benchmark, typed (``build_parser``'s flags); ``batch_size`` is the global batch."""

    model: str = "lm8b"
    layers: int | None = None
    batch_size: int = 2
    seq_len: int | None = None
    dist: str = "fsdp"
    dtype: str = "bf16"
    loss: str = "fused"
    attention: str = "sdpa"
    checkpoint_every: int | None = None
    nested_checkpoint: bool = False
    keep_attention: bool = False
    compile: bool = False
    warmup: int = 2
    steps: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    device: str = "cuda"
    timeout: float = 600.0
    profile: str | None = None
    out: str | None = "results/leaderboard.jsonl"

    @property
    def mode(self) -> str:  # analysis.harness.StepRun's field
        return "train_step"

    @property
    def suite(self) -> str:
        return SUITE


def resolve(args: LeaderboardConfig, world_size: int):
    """(spec with ``--layers`` applied, seq_len, sequences per rank); ValueError with one line on bad input."""
    if args.model not in MODELS:
        raise ValueError(f"unknown model preset {args.model!r}; accepted: {', '.join(MODELS)}")
    spec, seq_len = resolve_spec(args)
    if args.layers is not None:
        spec = spec.replace(n_layers=args.layers)
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} (global) is not divisible by the {world_size} ranks")
    if args.dist not in SHARDING:
        raise ValueError(f"--dist {args.dist!r}; accepted: {', '.join(SHARDING)}")
    return spec, seq_len, args.batch_size // world_size


def implementation_name(args: LeaderboardConfig) -> str:
    """e.g. 'fsdp2, compiled flash_triton, fused loss, ckpt 1'."""
    name = f"{args.dist}, {'compiled' if args.compile else 'eager'} {args.attention}, {args.loss} loss"
    if args.checkpoint_every:
        name += (f", ckpt {args.checkpoint_every}" + (" nested" if args.nested_checkpoint else "")
                 + (" keep attention" if args.keep_attention else ""))
    return name


# ----------------------------------------------------------------------------- predictions (calculator)


def predictions(args: LeaderboardConfig, spec, seq_len: int, world_size: int, device_name: str) -> dict[str, Any]:
    """The calculator's per-GPU peak and (on a GPU it knows) the step's time floor for this configuration."""
    precision, attention = calculator_terms(args.dtype, args.attention)
    out: dict[str, Any] = {}
    try:
        mem = sharded_step_memory(spec, args.dist, world_size, args.batch_size * seq_len, seq_len, precision,
                                  attention, args.checkpoint_every, args.nested_checkpoint, args.loss,
                                  args.keep_attention, args.device)
        out["predicted_memory_bytes"] = mem.total
        out["predicted_memory"] = {f.name: getattr(mem, f.name) for f in dataclasses.fields(mem)
                                   if isinstance(getattr(mem, f.name), (int, float))}
        out["predicted_peak_at"] = mem.peak_at
    except ValueError as err:
        out["predicted_memory_error"] = str(err)
    hardware = hardware_for_device(device_name)
    if hardware is not None:
        rate = hardware.fp32_flops if args.dtype == "fp32" else hardware.bf16_flops
        floor = step_time_floor(spec, args.batch_size / world_size, seq_len, "train_step", precision,
                                Ceilings(rate, hardware.memory_bw, hardware.interconnect_bw),
                                "fsdp" if world_size > 1 else "none", world_size,
                                **recomputation(args.checkpoint_every, args.nested_checkpoint, args.keep_attention,
                                                args.loss))
        out["floor_s"] = floor.total_s
        out["floor"] = {**dataclasses.asdict(floor), "hardware": hardware.name, "rates": "datasheet"}
    return out


# ----------------------------------------------------------------------------- the measurement (every rank)


def _do_bench_times(step, agreed_ms: float, steps: int) -> list[float]:
    """``triton.testing.do_bench`` of ``step``: ``steps`` timed calls (and one warm-up) when its own estimate is
    near ``agreed_ms``; the half-step margins keep the ranks' counts equal (module docstring)."""
    from triton.testing import do_bench

    return list(do_bench(step, warmup=0.5 * agreed_ms, rep=(steps + 0.5) * agreed_ms, return_mode="all"))


def measure(args: LeaderboardConfig, spec, seq_len: int, per_rank: int, device, rank: int, world_size: int,
            say) -> dict[str, Any]:
    """This rank's losses, per-step phase times and peak memory (and do_bench's step times on CUDA)."""
    import torch
    import torch.distributed as dist

    from torch_impl.model import TransformerLM
    from torch_impl.parallelize import parallelize
    from torch_impl.step import StepParts, for_loss, train_step
    from torch_impl.timing import PhaseTimer

    if args.dtype == "fp32":
        torch.set_float32_matmul_precision("highest")
    say(f"building {spec.name} ({spec.n_layers} layers, {spec.n_params():,} parameters) on "
        f"{world_size} rank(s) with {args.dist}")
    torch.manual_seed(args.seed)
    model = TransformerLM(spec, attention=args.attention, device=device, loss=args.loss)
    adamw = dict(lr=args.lr, weight_decay=args.weight_decay, fused=device.type == "cuda")
    forward, wrapper, optimizer = parallelize(model, args.dist, dtype=args.dtype, adamw=adamw, compile=args.compile,
                                              ac_every=args.checkpoint_every or 0,
                                              nested_ac=args.nested_checkpoint,
                                              ac_keep_attention=args.keep_attention)
    tokens = torch.from_numpy(fixed_batch(args.seed, args.batch_size, seq_len, spec.vocab_size))
    tokens = tokens[rank * per_rank:(rank + 1) * per_rank].to(device)  # this rank's rows of the global batch
    batch = [(tokens[:, :-1], tokens[:, 1:])]  # (inputs, targets), (B / N, T) each
    parts = StepParts(forward, optimizer, dtype=args.dtype, wrapper=wrapper, loss_fn=for_loss(args.loss))
    losses: list[float] = []

    def run(mark) -> None:
        losses.append(train_step(parts, batch, mark)[0].item())  # reading the loss ends the step

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world_size > 1:
            dist.barrier()

    warm_ms = []
    for i in range(args.warmup):
        sync()
        start = time.perf_counter()
        run(lambda phase: None)
        warm_ms.append((time.perf_counter() - start) * 1e3)
        say(f"warm-up step {i + 1}/{args.warmup}: {warm_ms[-1] / 1e3:.2f} s, loss {losses[-1]:.4f}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = PhaseTimer(device)
    for i in range(args.steps):
        sync()  # each timed step starts on every rank together
        timer.start()
        run(timer.mark)
        say(f"timed step {i + 1}/{args.steps}: loss {losses[-1]:.4f}")
    step_ms, phases_ms = timer.results()
    phases_ms.setdefault("comm", [0.0] * args.steps)  # fsdp2: no wrapper, its communication is in the backward
    bench_ms = None
    try:
        import triton.testing  # noqa: F401 - do_bench where triton and CUDA are there
        use_do_bench = device.type == "cuda"
    except ImportError:
        use_do_bench = False
    if use_do_bench:
        agreed = torch.tensor([statistics.median(step_ms)], device=device)
        if world_size > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        say(f"triton.testing.do_bench: about {args.steps + 7} steps of {agreed.item() / 1e3:.2f} s")
        bench_ms = _do_bench_times(lambda: run(lambda phase: None), agreed.item(), args.steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    profiled = {}
    if args.profile:  # every rank steps (the collectives need them all); rank 0 writes the trace and the table
        from torch_impl.profiling import profile_metrics, profile_steps

        say(f"profiling {PROFILED_STEPS} step(s) into {args.profile}")
        tag = f"leaderboard_{spec.name}_{spec.n_layers}l_{per_rank}x{seq_len}_{implementation_name(args)}"
        calls: dict[str, float] = {}
        rows = profile_steps(lambda: train_step(parts, batch, lambda phase: None)[0].item(), PROFILED_STEPS,
                             args.profile if rank == 0 else None, tag="_".join(tag.replace(",", "").split()),
                             calls=calls)
        profiled = profile_metrics(rows, calls)
    return {"step_ms": step_ms, "phases_ms": phases_ms, "bench_ms": bench_ms, "peak": peak, "losses": losses,
            "warmup_ms": warm_ms, "profiled": profiled}


# ----------------------------------------------------------------------------- the record (rank 0)


def make_record(args: LeaderboardConfig, spec, seq_len: int, world_size: int, device_name: str,
                gathered: list[dict[str, Any]] | None, error: str | None = None) -> Record:
    """The record of the run from every rank's measurements, or of its failure (``error``)."""
    run = StepRun.of(args)
    metrics: dict[str, Any] = {"dist": args.dist, "loss": args.loss, "attention": args.attention,
                               "compiled": args.compile, "checkpoint_every": args.checkpoint_every,
                               "nested_checkpoint": args.nested_checkpoint, "keep_attention": args.keep_attention,
                               "n_layers": spec.n_layers,
                               "batch_per_rank": args.batch_size // world_size, "fused_adamw": device_name != "cpu",
                               "timing_rank": "slowest rank per step",
                               **predictions(args, spec, seq_len, world_size, device_name)}
    common = dict(backend="torch", implementation=implementation_name(args), device_name=device_name,
                  mesh={"fsdp": world_size})
    if error is not None:
        status = "oom" if "out of memory" in error.lower() else "error"
        return step_record(run, spec, seq_len, metrics=metrics, status=status, error=error, **common)
    steps = range(args.steps)
    phases_ms = {p: [max(g["phases_ms"][p][i] for g in gathered) for i in steps] for p in STEP_PHASES
                 if p in gathered[0]["phases_ms"]}
    bench = [g["bench_ms"] for g in gathered]
    if bench[0] is not None:
        if len({len(b) for b in bench}) != 1:
            raise RuntimeError(f"do_bench made {[len(b) for b in bench]} calls on the ranks: they disagreed")
        step_ms = [max(b[i] for b in bench) for i in range(len(bench[0]))]
        metrics["timer"] = "do_bench"
        metrics["phase_timer_step_ms"] = [max(g["step_ms"][i] for g in gathered) for i in steps]
    else:
        step_ms = [max(g["step_ms"][i] for g in gathered) for i in steps]
        metrics["timer"] = "phase_timer"
    peaks = [g["peak"] for g in gathered]
    rank_losses = [g["losses"] for g in gathered]
    losses = [statistics.fmean(r[i] for r in rank_losses) for i in range(len(rank_losses[0]))]
    metrics.update(gathered[0]["profiled"])  # rank 0's kernels (--profile)
    metrics.update({"per_rank_peak_memory_bytes": peaks, "losses": losses, "loss_first": losses[0],
                    "loss_last": losses[-1], "warmup_step_ms": [max(w) for w in zip(*(g["warmup_ms"]
                                                                                      for g in gathered))]})
    record = step_record(run, spec, seq_len, step_times_ms=step_ms, phases_ms=phases_ms,
                         peak_memory_bytes=None if None in peaks else max(peaks), metrics=metrics, **common)
    if "floor_s" in metrics:
        record.metrics["x_floor"] = record.timing["median_ms"] / 1e3 / metrics["floor_s"]
    return record


def describe(record: Record) -> str:
    if record.status != "ok":
        return f"{record.implementation}: {record.status}: {record.error}"
    m = record.metrics
    phases = ", ".join(f"{p} {s['median_ms'] / 1e3:.3f}" for p, s in record.phases.items())
    peak = f"{record.peak_memory_bytes / 1e9:.1f} GB" if record.peak_memory_bytes else "n/a (CPU)"
    predicted = m.get("predicted_memory_bytes")
    floor = f", floor {m['floor_s']:.2f} s" if "floor_s" in m else ""
    return (f"{record.model} ({m['n_layers']} layers) {record.batch_size} x {record.seq_len} on {record.world_size} "
            f"rank(s), {record.implementation}: step {record.timing['median_ms'] / 1e3:.3f} s ({m['timer']}; "
            f"{phases} s){floor}; peak {peak}"
            + (f", predicted {predicted / 1e9:.1f} GB" if predicted else "")
            + f"; loss {m['loss_first']:.4f} -> {m['loss_last']:.4f}")


# ----------------------------------------------------------------------------- the run


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


def run(args: LeaderboardConfig) -> int:
    """Every rank: measure, gather to rank 0, which writes the record. A failure ends every process non-zero."""
    import torch
    import torch.distributed as dist

    from torch_impl.distributed import distributed_context

    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    spec, seq_len, per_rank = resolve(args, world_env)
    with distributed_context(timeout_s=args.timeout, device=args.device) as ctx:
        rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

        def say(line: str) -> None:  # progress, from rank 0
            if rank == 0:
                print(f"[leaderboard] {line}", file=sys.stderr, flush=True)

        try:
            mine = measure(args, spec, seq_len, per_rank, device, rank, world_size, say)
            gathered = [None] * world_size
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                record = make_record(args, spec, seq_len, world_size, device_name, gathered)
                print(describe(record), flush=True)
                if args.out:
                    save_records(args.out, record)
            dist.barrier()
        except Exception as err:  # noqa: BLE001 - one line, a record from rank 0, and every process ends
            message = f"rank {rank}: {_one_line(err)}"
            print(f"python -m torch_impl.bench.leaderboard: {message}", file=sys.stderr, flush=True)
            if rank == 0 and args.out:
                save_records(args.out, make_record(args, spec, seq_len, world_size, device_name, None, message))
            sys.stderr.flush()
            os._exit(1)  # no teardown: the other ranks may be gone or stuck in a collective
    return 0


def build_parser() -> argparse.ArgumentParser:
    d = LeaderboardConfig()
    p = ArgumentParser(prog="torchrun --nproc_per_node N -m torch_impl.bench.leaderboard",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, help=f"model preset: {', '.join(MODELS)} (default {d.model})")
    p.add_argument("--layers", type=positive_int, help="override the preset's number of blocks (memory profiling)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help=f"global sequences per step, split over the ranks (default {d.batch_size})")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the preset's context)")
    p.add_argument("--dist", choices=SHARDING, default=d.dist,
                   help="fsdp (ours, torch_impl.distributed.FSDP) or fsdp2 (torch's fully_shard) (default fsdp)")
    p.add_argument("--dtype", choices=list(DTYPES), default=d.dtype,
                   help="bf16 (autocast, fp32 weights; the FSDPs gather in bf16) or fp32 (default bf16)")
    p.add_argument("--loss", choices=LOSSES, default=d.loss,
                   help="fused: the LM head and the loss chunked over tokens, never the logits; plain (default fused)")
    p.add_argument("--attention", default=d.attention, help=f"attention backend (default {d.attention})")
    p.add_argument("--ac-every", "--checkpoint-every", dest="checkpoint_every", type=positive_int, metavar="K",
                   help="activation checkpointing: recompute every segment of K blocks (1: every block)")
    p.add_argument("--nested-checkpoint", action="store_true", help="also checkpoint each block of a segment")
    p.add_argument("--keep-attention", action="store_true",
                   help="with --ac-every and --attention flash_triton: keep each block's attention output for the "
                        "recomputation, which then skips the attention forward (selective checkpointing)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block's forward (the FSDPs' hooks run eagerly around it)")
    p.add_argument("--warmup", type=nonnegative_int, default=d.warmup, help=f"untimed steps (default {d.warmup})")
    p.add_argument("--steps", type=positive_int, default=d.steps,
                   help=f"steps timed by phase, and do_bench's timed calls (default {d.steps})")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (default 0.01)")
    p.add_argument("--seed", type=nonnegative_int, default=d.seed, help="seed of the weights and the batch")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device,
                   help="cuda (NCCL, cuda:LOCAL_RANK) or cpu (gloo) (default cuda)")
    p.add_argument("--timeout", type=positive_float, default=d.timeout,
                   help=f"process-group timeout in seconds: a stuck collective ends the run (default {d.timeout:g})")
    p.add_argument("--profile", metavar="DIR",
                   help="after timing, profile one step: rank 0's Chrome trace and kernel table in DIR")
    p.add_argument("--out", type=writable_path, default=d.out, help=f"append the record here (default {d.out})")
    return p


@error_boundary(prog="python -m torch_impl.bench.leaderboard")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = LeaderboardConfig(**vars(parser.parse_args(argv)))
    try:
        from torch_impl.activation_checkpointing import KEEPS
        from torch_impl.parallelize import check_supported

        resolve(args, int(os.environ.get("WORLD_SIZE", "1")))
        get_precision(DTYPES[args.dtype])
        check_supported([args.dist], args.dtype, flag="--dist ")
        if args.nested_checkpoint and not args.checkpoint_every:
            raise ValueError("--nested-checkpoint needs --ac-every K")
        if args.keep_attention and (not args.checkpoint_every or args.nested_checkpoint or args.attention not in KEEPS):
            raise ValueError(f"--keep-attention needs --ac-every K without --nested-checkpoint and --attention "
                             f"{' or '.join(KEEPS)} (the attention that takes the kept outputs)")
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device here; use --device cpu (gloo)")
    except ValueError as err:
        parser.error(str(err))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
