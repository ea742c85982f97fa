"""Data-parallel training-step benchmark: ``torchrun --nproc_per_node N -m torch_impl.bench.ddp [flags]``.

Each rank trains ``TransformerLM(--model)`` on its own fixed random batch (``--batch-size`` sequences of
``--seq-len`` tokens, seed ``--seed + rank``) with AdamW (fused on CUDA), wrapped by ``--dist``, a mode of
``torch_impl.parallelize.parallelize``: ``none`` (one process, no wrapper: the baseline of the scaling
efficiency), our ``naive``, ``flat``, ``individual`` and ``bucketed`` DDP, ``torch_ddp`` (``bucket_cap_mb=25``, its
default), ``zero1`` (``ShardedOptimizer(AdamW)`` over bucketed DDP), ``zero2`` (``ZeRO2``: gradients
reduce-scattered by bucket in the backward, AdamW on each rank's slice, weights all-gathered after it; with
``--dtype bf16_mixed`` bf16 weights and fp32 master slices), our ``fsdp`` and ``fsdp2`` (``fully_shard``; an import
failure is an error record); ``bucketed``, ``zero1`` and ``zero2`` run once per ``--bucket-mb`` value.

``--dist`` (old name ``--impl``) takes a comma list (``naive,bucketed,zero1``): the configurations run one after
another in the same launch (each freed, Dynamo's caches too, before the next; ``per_rank_allocated_before_bytes``
records what was still allocated). ``--dtype bf16`` runs the forward under ``torch.autocast(bfloat16)``, fp32
weights (all impls). ``--comm-dtype grad,bf16`` runs bucketed, zero1, zero2 and torch_ddp once per dtype the gradients
travel in; ``--comm-sms 0,8`` runs our wrappers once per budget of SMs for their NCCL kernels (with cuBLAS kept off
them during the backward; ``torch_impl.distributed.ddp``); ``--engine nccl,copy_engines`` runs bucketed and zero2
once per engine moving their bytes (``torch_impl.distributed.copy_engines``); ``--optimizer-step overlapped,after``
runs individual and bucketed once with bf16_mixed's optimizer stepping each bucket as its average lands and once after
all (``torch_impl.step.OPTIMIZER_STEPS``; the record's ``optimizer_step`` says which ran); ``--mean bucket,optimizer``
runs bucketed on the copy engines once averaging each bucket and once leaving the means to the optimizer, which reads
every rank's gradients (``torch_impl.distributed.ddp.MEANS``); ``--profile DIR`` profiles
``PROFILED_STEPS`` more steps of each configuration on every rank (read them with ``python -m analysis.overlap``;
each rank's compute, collectives, both and idle time a step go into the record as ``per_rank_profile_ms``).

Phases of a step (ms), ``torch_impl.step.train_step``'s (``analysis.records.STEP_PHASES``): ``forward`` (model +
loss), ``backward`` (``loss.backward()``), ``comm`` (time blocked in ``finish_gradient_synchronization()``: the
gradient communication the backward did not hide; ~0 when the optimizer step is overlapped, whose ``optimizer``
holds it), ``optimizer`` (``optimizer.step()``; for ZeRO-1 it includes the broadcast of the updated parameters, for
ZeRO-2 the all-gather of the weights), and the step total. Timing
(``torch_impl.timing.PhaseTimer``): on CUDA an event on the compute stream at each phase boundary and nothing waits
inside a step, so an NCCL all-reduce still running on its own stream when the backward's kernels finish is counted
in ``comm`` (where ``finish_gradient_synchronization`` makes the compute stream wait for it); reading the loss ends
each step. On the CPU (gloo), host clocks. Caveat: ``torch_ddp`` and ``fsdp2`` wait for their gradient communication
inside ``backward`` itself (the autograd engine's final callback), so their ``comm`` is ~0 (fsdp2: recorded as 0)
and their exposed communication is part of ``backward``; ``none`` also records ~0. ``--cuda-graph blocks`` (with
``--compile``) replays each block's graphs, as the e2e benchmark's fastest one-GPU step does.

Records (rank 0 appends one per configuration to ``--out``): suite "ddp", implementation e.g.
"bucketed 25MB" / "zero1 + bucketed 25MB", world_size, mode train_step. Every rank's per-step phase times
and peak memory (``torch.cuda.max_memory_allocated`` after the warm-up, plus zero2's weights in symmetric memory
or bucketed's buffers with ``--engine copy_engines``, which the allocator does not count; None on CPU) are gathered
to rank 0 (``all_gather_object``). **A step's time, and each phase's, is the slowest rank's at that step** (a
data-parallel step is done when the last rank is); the record's timing / phase statistics are over those
per-step maxima, so the phases' medians need not add up to the step's. ``tokens_per_s`` = world_size x
batch x seq / median step; ``tflops`` / ``mfu`` per device from ``parallelism_calc.compute.step_flops`` of
one rank's batch (``analysis.harness.step_record``'s conventions); ``peak_memory_bytes`` = the worst rank.
Metrics: ``per_rank_peak_memory_bytes``, ``per_rank_median_ms`` (each rank's own step and phase medians),
``predicted_memory_bytes`` (+ its breakdown) from ``parallelism_calc.memory.per_device_memory`` with the
strategy the impl implements (ddp for none / the DDP variants / torch_ddp, zero1, zero2, fsdp for fsdp / fsdp2;
precision fp32 or bf16_autocast; attention "naive" for --attention naive, else "flash") and, for the two
FSDPs, the working set each really gathers (in the compute dtype, so no autocast weight copies): ``fsdp``
a block at a time with ``FSDP``'s defaults (``gather_unit="block"``, 1 prefetched; the embedding and the LM head
units of their own, resharded after use); ``fsdp2`` a block at a time, 1 prefetched, plus its root (embedding,
final norm, LM head), which FSDP2 does not reshard after forward (``reshard_root=False``); and
``comm_blocked_share`` = median comm / median step. Caveats: our FSDP shards the Linear / Embedding weights and
replicates the norm gains (the calculator's "fsdp" shards all, a negligible difference); the reduce-scatters in
flight (``MAX_PENDING_REDUCE_SCATTERS`` = 2 units for ours, each its input and output piece until it lands; one
block's input for FSDP2) are placed moment by moment as ``pending_reduce_scatters`` and ``reduce_scatter_output``
(``analysis.data_parallel.FSDP_GATHERING``, ``parallelism_calc.memory.reduce_scatter_queue``).

Scaling efficiency: when ``--out`` already holds an ok ``none`` record (world size 1) with the same model,
batch, seq, dtype, attention and device name, each new record gets ``metrics.scaling_efficiency`` =
tokens_per_s / (world_size x tokens_per_s of that record) (the latest such record), and
``metrics.single_tokens_per_s``. ``--report-only FILE`` prints a Markdown table of the file's ddp records
(``analysis.tables``) with that column, recomputed from the file for records written before their baseline.

Failures: a configuration that fails on a rank (e.g. out of memory) becomes an error record ("oom" or
"error") and the run goes on to the next configuration, provided every rank got to the agreement point at the
end of the configuration (failures that strike every rank alike, such as an OOM of the same shapes, or one
while building the model). A collective that fails or times out (``--timeout``, the process group's
timeout), or ranks that disagree on where they failed, end the run: rank 0 writes an error record if it can,
and every process exits non-zero (torchrun then stops the others) instead of hanging.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import re
import statistics
import sys
from typing import Any

from analysis.harness import (DTYPES, StepConfig, StepRun, calculator_terms, compiled_activations, device_terms,
                              fixed_batch, resolve_spec, step_record)
from analysis.data_parallel import (PHASES, SUITE, add_scaling_efficiency, baseline_key, memory_terms, report,
                                     single_process_baselines)
from analysis.overlap import RANK_PROFILES, step_split
from analysis.records import Record, read_records, save_records
from parallelism_calc.cli import (ArgumentParser, error_boundary, nonnegative_float, nonnegative_int, parse_list,
                                  positive_float, positive_int, writable_path)
from torch_impl.parallelize import (COMM_DTYPE_MODES, COMM_DTYPES, CUDA_GRAPHS, DATA_PARALLEL, ENGINE_MODES, ENGINES,
                                    MEAN_MODES, MEANS, OPTIMIZER_STEP_MODES, check_cuda_graph, check_supported,
                                    means_in_optimizer, parallelize)
from torch_impl.step import OPTIMIZER_STEPS
from torch_impl.parallelize import DataParallelConfig as Config, data_parallel_configs as configurations


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPBenchConfig(StepConfig):
    """A run of this benchmark, typed: its flags (``build_parser``, with their defaults), the step flags it
    shares with the e2e benchmarks under ``StepConfig``'s names; ``impl``: --dist, a comma list."""

    impl: str
    bucket_mb: str
    comm_sms: str
    comm_dtype: str
    engine: str
    optimizer_step: str
    mean: str
    compile: bool
    cuda_graph: str
    timeout: float
    profile: str | None
    profile_host: str
    memory_snapshot: str | None
    report_only: str | None


PROFILED_STEPS = 2  # --profile: steps each rank runs under torch.profiler after the timed ones


class CollectiveFailure(RuntimeError):
    """A collective failed or timed out: the ranks are out of step, so the run must end."""


def parse_impls(text: str) -> list[str]:
    """--dist: 'naive, bucketed' -> ['naive', 'bucketed'] (order kept, repeats dropped); unknown names raise."""
    return parse_list(text, "--dist", DATA_PARALLEL)


def parse_bucket_mb(text: str) -> list[float]:
    """'1,10,25' -> [1.0, 10.0, 25.0] MiB; each must be > 0."""
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--bucket-mb {text!r}: write numbers of MiB, e.g. 1,10,25,100") from None
    if not values or not all(0 < v < math.inf for v in values):
        raise ValueError(f"--bucket-mb {text!r}: every size must be finite and > 0")
    return values


def parse_comm_sms(text: str) -> list[int]:
    """--comm-sms '0,4,8' -> [0, 4, 8]: SMs for our wrappers' NCCL kernels, one configuration each (0: NCCL's
    default, no carveout)."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise ValueError(f"--comm-sms {text!r}: write whole numbers of SMs >= 0, e.g. 0,4,8 (0: NCCL's default)")
    return values


def parse_comm_dtypes(text: str) -> list[str]:
    """--comm-dtype 'grad,bf16' -> ['grad', 'bf16'] (checked against ``COMM_DTYPES``)."""
    return parse_list(text, "--comm-dtype", COMM_DTYPES)


def parse_optimizer_steps(text: str) -> list[str]:
    """--optimizer-step 'overlapped,after' -> ['overlapped', 'after'] (``OPTIMIZER_STEPS``)."""
    return parse_list(text, "--optimizer-step", OPTIMIZER_STEPS)


def parse_means(text: str) -> list[str]:
    """--mean 'bucket,optimizer' -> ['bucket', 'optimizer'] (``MEANS``)."""
    return parse_list(text, "--mean", MEANS)


def parse_engines(text: str, device: str) -> list[str]:
    """--engine 'nccl,copy_engines' -> ['nccl', 'copy_engines'] (``ENGINES``; copy_engines on CUDA only)."""
    engines = parse_list(text, "--engine", ENGINES)
    if "copy_engines" in engines and device != "cuda":
        raise ValueError("--engine copy_engines copies into the peers' GPU memory: CUDA devices only")
    return engines


# ----------------------------------------------------------------------------- per-step timing


def _is_collective_error(err: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(err, (CollectiveFailure, getattr(dist, "DistError", ()))):
        return True
    text = str(err).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed", "connection reset", "gloo",
                                   "nccl", "peer", "broken pipe"))


def _measure(cfg: Config, args: DDPBenchConfig, spec, seq_len: int, device, rank: int) -> dict[str, Any]:
    """This rank's per-step phase times (ms), its peak memory and its losses, for one configuration."""
    import torch
    from torch_impl.model import TransformerLM
    from torch_impl.step import StepParts, train_step
    from torch_impl.timing import PhaseTimer

    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    torch.manual_seed(args.seed)
    model = TransformerLM(spec, attention=args.attention, device=device)
    adamw = dict(lr=args.lr, weight_decay=args.weight_decay, fused=device.type == "cuda")
    forward, wrapper, optimizer = parallelize(model, cfg.impl, bucket_mb=cfg.bucket_mb, dtype=args.dtype, adamw=adamw,
                                              compile=args.compile, cuda_graphs=args.cuda_graph == "blocks",
                                              comm_sms=cfg.comm_sms, comm_dtype=cfg.comm_dtype, engine=cfg.engine,
                                              mean=cfg.mean)
    tokens = torch.from_numpy(fixed_batch(args.seed + rank, args.batch_size, seq_len, spec.vocab_size)).to(device)
    batch = [(tokens[:, :-1], tokens[:, 1:])]  # (inputs, targets), (B, T) each
    parts = StepParts(forward, optimizer, dtype=args.dtype, wrapper=wrapper, optimizer_step=cfg.optimizer_step)

    def step(timer: PhaseTimer) -> float:
        timer.start()
        return train_step(parts, batch, timer.mark)[0].item()

    losses = [step(PhaseTimer(device)) for _ in range(args.warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = PhaseTimer(device)
    losses += [step(timer) for _ in range(args.steps)]
    step_ms, phases_ms = timer.results()
    phases_ms.setdefault("comm", [0.0] * args.steps)  # fsdp2: no wrapper, its communication is in the backward
    # CUDA graph trees hand their pool's blocks back to the allocator's books: the reserved peak is the honest
    # figure there (as in the e2e benchmark)
    peak_of = torch.cuda.max_memory_reserved if args.cuda_graph == "blocks" else torch.cuda.max_memory_allocated
    # + symmetric memory (the copy engines' buffers: zero2's weights, bucketed's gradients), which the allocator
    # does not count
    peak = peak_of(device) + getattr(wrapper, "symmetric_bytes", 0) if device.type == "cuda" else None
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.name)  # 'bucketed 25MB, bf16 comm' -> bucketed_25MB_bf16_comm
    split = None
    if args.profile:  # after the timed steps, so the profiler's own cost is in no timing
        from torch_impl.profiling import profile_steps

        profile_steps(lambda: step(PhaseTimer(device)), PROFILED_STEPS, args.profile, tag=f"{tag}_rank{rank}",
                      host=args.profile_host == "on")
        split = step_split(os.path.join(args.profile, f"{tag}_rank{rank}_trace.json"), PROFILED_STEPS)
    if args.memory_snapshot:  # one more step, after the timed ones: what is alive at its peak, and made where
        from torch_impl.profiling import memory_history

        with memory_history(os.path.join(args.memory_snapshot, f"{tag}_rank{rank}.pickle.gz")):
            step(PhaseTimer(device))
    overlapped = parts.overlapped and cfg.impl in OPTIMIZER_STEP_MODES  # the wrapper's parts, stepped as they land
    return {"step_ms": step_ms, "phases_ms": phases_ms, "peak": peak, "losses": losses, "error": None,
            "allocated_before": allocated_before, "optimizer_step": "overlapped" if overlapped else "after",
            "profile": split}


# ----------------------------------------------------------------------------- records (rank 0)


def predicted_memory(cfg: Config, args: DDPBenchConfig, spec, seq_len: int, world_size: int):
    """``per_device_memory`` of the strategy ``cfg`` implements with ``analysis.data_parallel.memory_terms``, the
    peak placed in the step: the FSDPs with the working set each gathers (see the module docstring) and their
    reduce-scatter buffers in flight; the one-process baseline and the DDP family with the gradient buckets they
    keep; compiled blocks with what Inductor saves."""
    from parallelism_calc.memory import get_precision, per_device_memory

    precision, attention = calculator_terms(args.dtype, args.attention)
    n = 1 if cfg.impl == "none" else world_size
    terms = memory_terms(cfg.impl, get_precision(precision).grad_bytes, cfg.comm_dtype, n_devices=n)
    return per_device_memory(spec, cfg.strategy, n, n * args.batch_size * seq_len, seq_len, precision,
                             attention=attention, compiled=compiled_activations(args.compile, attention),
                             **device_terms(args.device), **terms)


def make_record(cfg: Config, args: DDPBenchConfig, spec, seq_len: int, world_size: int, device_name: str,
                gathered: list[dict[str, Any]]) -> Record:
    """The record of one configuration from every rank's measurements (see the module docstring)."""
    errors = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g.get("error")]
    run = StepRun.of(args, suite=SUITE, mode="train_step")
    common = dict(backend="torch", implementation=cfg.name, device_name=device_name)
    metrics: dict[str, Any] = {"impl": cfg.impl, "bucket_mb": cfg.bucket_mb, "comm_sms": cfg.comm_sms,
                               "comm_dtype": cfg.comm_dtype, "attention": args.attention,
                               "compiled": bool(args.compile), "cuda_graph": args.cuda_graph,
                               "peak_memory_kind": "reserved" if args.cuda_graph == "blocks" else "allocated",
                               "strategy": cfg.strategy, "fused_adamw": device_name != "cpu", "engine": cfg.engine,
                               "mean": cfg.mean,
                               "timing_rank": "slowest rank per step",
                               "placement": [g.get("placement") for g in gathered]}
    try:
        pred = predicted_memory(cfg, args, spec, seq_len, world_size)
        metrics["predicted_memory_bytes"] = pred.total
        metrics["predicted_memory"] = {f.name: getattr(pred, f.name) for f in dataclasses.fields(pred)
                                       if isinstance(getattr(pred, f.name), (int, float))}
    except ValueError as err:  # e.g. a batch the calculator cannot split
        metrics["predicted_memory_error"] = str(err)
    if errors:
        message = "; ".join(errors)
        oom = "out of memory" in message.lower()
        record = step_record(run, spec, seq_len, metrics=metrics, status="oom" if oom else "error",
                             error=message, **common)
    else:
        steps = range(args.steps)
        step_ms = [max(g["step_ms"][i] for g in gathered) for i in steps]
        phases_ms = {p: [max(g["phases_ms"][p][i] for g in gathered) for i in steps] for p in PHASES}
        peaks = [g["peak"] for g in gathered]
        metrics.update({
            "per_rank_peak_memory_bytes": peaks,
            # what earlier configurations of the launch left allocated (0 unless something leaks)
            "per_rank_allocated_before_bytes": [g.get("allocated_before") for g in gathered],
            "per_rank_median_ms": [{"step": statistics.median(g["step_ms"]),
                                    **{p: statistics.median(g["phases_ms"][p]) for p in PHASES}} for g in gathered],
            "loss_first": gathered[0]["losses"][0], "loss_last": gathered[0]["losses"][-1],
            "losses": gathered[0]["losses"],
            "optimizer_step": gathered[0]["optimizer_step"],
        })
        if any(g.get("profile") for g in gathered):  # --profile on GPUs: each rank's step split (analysis.overlap)
            metrics[RANK_PROFILES] = [g.get("profile") for g in gathered]
        record = step_record(run, spec, seq_len, step_times_ms=step_ms, phases_ms=phases_ms,
                             peak_memory_bytes=None if None in peaks else max(peaks), metrics=metrics, **common)
        record.tokens_per_s = world_size * args.batch_size * seq_len / (record.timing["median_ms"] / 1e3)
        record.metrics["comm_blocked_share"] = record.phases["comm"]["median_ms"] / record.timing["median_ms"]
    record.world_size = world_size
    record.mesh = {"dp": world_size} if cfg.strategy != "fsdp" else {"fsdp": world_size}
    return record


def _describe(record: Record) -> str:
    if record.status != "ok":
        return f"{record.implementation:>24}: {record.status}: {record.error}"
    m = record.metrics
    phases = "  ".join(f"{p} {record.phases[p]['median_ms']:.2f}" for p in PHASES)
    eff = f"  scaling {m['scaling_efficiency']:.1%}" if "scaling_efficiency" in m else ""
    return (f"{record.implementation:>24}: step {record.timing['median_ms']:.2f} ms ({phases})  "
            f"{record.tokens_per_s:,.0f} tokens/s{eff}")


# ----------------------------------------------------------------------------- the run


def _failure_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


def run(args: DDPBenchConfig) -> int:
    import torch

    spec, seq_len = resolve_spec(args)
    configs = configurations(parse_impls(args.impl), parse_bucket_mb(args.bucket_mb), parse_comm_sms(args.comm_sms),
                             parse_comm_dtypes(args.comm_dtype), parse_engines(args.engine, args.device),
                             parse_optimizer_steps(args.optimizer_step), parse_means(args.mean))
    if args.dtype == "fp32":
        torch.set_float32_matmul_precision("highest")
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if all(c.impl == "none" for c in configs) and world_env == 1:  # no process group needed
        from torch_impl.device import pick_device

        device = pick_device(args.device)
        from torch_impl.distributed.process_group import rank_placement

        return _run_configs(configs, args, spec, seq_len, device, rank=0, world_size=1, placement=rank_placement())
    if any(c.impl == "none" for c in configs) and world_env > 1:
        raise ValueError("--dist none runs as one process: launch it with plain python -m (or --nproc_per_node 1)")
    from torch_impl.distributed import distributed_context

    with distributed_context(timeout_s=args.timeout, device=args.device) as ctx:
        return _run_configs(configs, args, spec, seq_len, ctx.device, ctx.rank, ctx.world_size, ctx.placement)


def _run_configs(configs: list[Config], args, spec, seq_len: int, device, rank: int, world_size: int,
                 placement: dict) -> int:
    import torch
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    baselines = single_process_baselines(read_records(args.out)) if rank == 0 and args.out and \
        os.path.exists(args.out) else {}
    if rank == 0:
        print(f"ddp benchmark: {spec.name}, {world_size} rank(s), {device_name}, batch {args.batch_size}/rank x "
              f"seq {seq_len}, {args.dtype}, warmup {args.warmup}, steps {args.steps}", flush=True)
    failures = 0
    for cfg in configs:
        try:
            mine = _measure(cfg, args, spec, seq_len, device, rank)
        except Exception as err:  # noqa: BLE001 - recorded, or fatal if the ranks are out of step
            if distributed and _is_collective_error(err):
                _fatal(cfg, args, spec, seq_len, world_size, device_name, rank, err)
            mine = {"error": _failure_text(err)}
        mine["placement"] = placement
        _release_configuration()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        gathered = [mine]
        if distributed:
            gathered = [None] * world_size
            try:
                dist.all_gather_object(gathered, mine)
            except Exception as err:  # noqa: BLE001 - the ranks failed at different points
                _fatal(cfg, args, spec, seq_len, world_size, device_name, rank, err)
        if rank != 0:
            continue
        record = make_record(cfg, args, spec, seq_len, world_size, device_name, gathered)
        add_scaling_efficiency(record, baselines)
        if record.status == "ok" and cfg.impl == "none":
            baselines[baseline_key(record)] = record.tokens_per_s
        failures += record.status != "ok"
        print(_describe(record), flush=True)
        if args.out:
            save_records(args.out, record)
    if distributed:
        dist.barrier()
    return 1 if failures else 0


def _release_configuration() -> None:
    """Free what a configuration built before the next one: its compiled regions too (Dynamo's cache keeps
    references into the model it compiled, so each configuration's weights and gradients would stay allocated)."""
    import torch

    torch._dynamo.reset()
    gc.collect()


def _fatal(cfg: Config, args, spec, seq_len: int, world_size: int, device_name: str, rank: int,
           err: BaseException) -> None:
    """A collective failed: write what can be written (rank 0) and end this process with an error."""
    message = f"collective failure (the run stopped here): {_failure_text(err)}"
    print(f"{cfg.name}: rank {rank}: {message}", file=sys.stderr, flush=True)
    if rank == 0 and args.out:  # the record's error reads "rank 0: collective failure ..."
        record = make_record(cfg, args, spec, seq_len, world_size, device_name, [{"error": message}])
        save_records(args.out, record)
    os._exit(3)  # no teardown: the group's other ranks may be gone or stuck


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    import torch

    parser = ArgumentParser(prog="torchrun --nproc_per_node N -m torch_impl.bench.ddp",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="xl", help="model preset (default xl)")
    parser.add_argument("--batch-size", type=positive_int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--seq-len", type=positive_int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="fp32; bf16 = torch.autocast(bfloat16) with fp32 weights; bf16_mixed = bf16 weights "
                             "with fp32 masters in torch_impl.optim.MasterAdamW (default fp32)")
    parser.add_argument("--dist", "--impl", dest="impl", default="bucketed",
                        help=f"comma list of: {', '.join(DATA_PARALLEL)} (default bucketed; --impl: its old name)")
    parser.add_argument("--bucket-mb", default="1,10,25,100",
                        help="bucket sizes in MiB for bucketed, zero1 and zero2, one configuration each "
                             "(default 1,10,25,100)")
    parser.add_argument("--comm-sms", default="0",
                        help="SMs our DDP wrappers' NCCL kernels may occupy, with cuBLAS leaving them free during "
                             "the backward (torch_impl.distributed.ddp), one configuration each: e.g. 0,4,8 "
                             "(default 0: NCCL's default, no carveout)")
    parser.add_argument("--comm-dtype", default="grad",
                        help=f"the dtype gradients travel in, one configuration each: grad (their own) and/or bf16 "
                             f"(half the bytes; with {', '.join(COMM_DTYPE_MODES)}; torch_ddp: its "
                             "bf16_compress_hook), e.g. grad,bf16 (default grad)")
    parser.add_argument("--engine", default="nccl",
                        help=f"what moves {' and '.join(ENGINE_MODES)}'s bytes, one configuration each: nccl (its "
                             "collectives) and/or copy_engines (copies into the peers' symmetric memory: bucketed's "
                             "all-reduce, zero2's weight gather; NCCL on one host's GPUs), e.g. nccl,copy_engines "
                             "(default nccl)")
    parser.add_argument("--optimizer-step", default="overlapped",
                        help=f"when the optimizer steps ({', '.join(OPTIMIZER_STEP_MODES)}), one configuration each: "
                             "overlapped (bucket by bucket as their averages land, hiding the last buckets' "
                             "communication; with --dtype bf16_mixed) and/or after (once every gradient is in), "
                             "e.g. overlapped,after (default overlapped)")
    parser.add_argument("--mean", default="bucket",
                        help=f"where {', '.join(MEAN_MODES)}'s means are computed with --engine copy_engines, one "
                             "configuration each: bucket (each bucket averaged by its owner and pushed back) and/or "
                             "optimizer (every rank's gradients pushed to every rank, averaged by --dtype bf16_mixed's "
                             "optimizer as it reads them; other dtypes set the means in .grad after the backward), "
                             "e.g. bucket,optimizer (default bucket)")
    parser.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps per configuration (default 3)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per configuration (default 10)")
    parser.add_argument("--attention", default="sdpa", help="attention backend of the model (default sdpa)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block before wrapping (fsdp, fsdp2: each block's forward, their hooks "
                             "eager around it; torch_impl.parallelize.apply_compile)")
    parser.add_argument("--cuda-graph", choices=CUDA_GRAPHS, default="off",
                        help="blocks: replay each compiled block's forward and backward as CUDA graphs (needs "
                             "--compile and CUDA; the fix for a host-bound step, notes/train_step.md); default off")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--weight-decay", type=nonnegative_float, default=0.01,
                        help="AdamW weight decay (default 0.01)")
    parser.add_argument("--seed", type=nonnegative_int, default=0,
                        help="seed of the weights; rank r's data uses seed + r")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (NCCL, cuda:LOCAL_RANK) or cpu (gloo); default cuda if available")
    parser.add_argument("--timeout", type=positive_float, default=300.0,
                        help="process-group timeout in seconds: a failed collective ends the run (default 300)")
    parser.add_argument("--profile", metavar="DIR",
                        help=f"after timing, {PROFILED_STEPS} steps per configuration under torch.profiler on every "
                             "rank: a Chrome trace <impl>_rank<r>_trace.json and a kernel table in DIR (the NCCL "
                             "kernels beside the compute ones: where overlap slows the backward)")
    parser.add_argument("--profile-host", choices=("on", "off"), default="on",
                        help="--profile records the host's ops too (on, the default) or the GPU's kernels alone "
                             "(off: the profiler's host cost, which slows a host-bound step, mostly left out)")
    parser.add_argument("--memory-snapshot", metavar="DIR",
                        help="after timing, one more step per configuration with the CUDA allocator's history "
                             "recorded on every rank: DIR/<configuration>_rank<r>.pickle.gz, e.g. "
                             "bucketed_25MB_rank0.pickle.gz (read it with python -m "
                             "analysis.snapshot: what is alive at the peak and which line made it)")
    parser.add_argument("--out", default="results/ddp.jsonl", type=writable_path,
                        help="append records here (rank 0; default results/ddp.jsonl)")
    parser.add_argument("--report-only", metavar="JSONL", help="no measuring: print a Markdown table of JSONL")
    return parser


@error_boundary(prog="python -m torch_impl.bench.ddp")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = DDPBenchConfig(**vars(parser.parse_args(argv)))
    if args.report_only:
        print(report(args.report_only))
        return 0
    try:
        resolve_spec(args)
        impls = parse_impls(args.impl)
        check_supported(impls, args.dtype, flag="", cuda_graphs=args.cuda_graph == "blocks")
        check_cuda_graph(args.cuda_graph, args.compile, args.device)
        parse_bucket_mb(args.bucket_mb)
        parse_comm_sms(args.comm_sms)
        comm_dtypes = parse_comm_dtypes(args.comm_dtype)
        if "torch_ddp" in impls and "bf16" in comm_dtypes and args.device != "cuda":
            raise ValueError("--dist torch_ddp --comm-dtype bf16 (torch DDP's bf16_compress_hook) runs on CUDA "
                             "devices only; on the CPU bf16 gradients work with bucketed, zero1 and zero2")
        engines = parse_engines(args.engine, args.device)
        parse_optimizer_steps(args.optimizer_step)
        if "optimizer" in parse_means(args.mean) and not any(
                means_in_optimizer(m, e, d) for m in impls for e in engines for d in comm_dtypes):
            raise ValueError(f"--mean optimizer: the means move to the optimizer with {', '.join(MEAN_MODES)} on "
                             "--engine copy_engines with --comm-dtype grad; this run has none")
        if args.memory_snapshot and args.device != "cuda":
            raise ValueError("--memory-snapshot records the CUDA allocator: it needs --device cuda")
        return run(args)
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
