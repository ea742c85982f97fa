"""The benchmark harness both backends' benchmarks share: common flags, the step record, sweeps, progress bars.

``torch_impl.bench.e2e`` and ``jax_impl.bench.e2e`` take the same flags (``add_step_arguments``), parsed into a
typed ``StepConfig`` (each backend's subclass adds its own flags), and turn their per-step times into the same
``Record`` (``step_record``), with FLOPs from ``parallelism_calc`` and MFU against the ``HardwareSpec`` of the
device, so the two backends are compared field by field.
Stdlib and numpy only: no pandas, torch or jax.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from analysis.records import Record, divergence, read_records, save_records, timing_stats
from parallelism_calc.cli import (ArgumentParser, error_boundary, int_list, nonnegative_float, nonnegative_int,
                                  positive_float, positive_int, writable_path)
from parallelism_calc.compute import MODES, step_flops
from parallelism_calc.specs import MODELS, ModelSpec, get_model, hardware_for_device

# --dtype: each value and the calculator's precision of it (parallelism_calc.memory.PRECISIONS)
DTYPES = {"fp32": "fp32",  # fp32 weights, gradients, AdamW state and matmuls (no TF32)
          "bf16": "bf16_autocast",  # fp32 weights, gradients and AdamW state; bf16 compute under autocast
          "bf16_mixed": "bf16_mixed"}  # bf16 weights and gradients; fp32 master weights and AdamW state


def calculator_terms(dtype: str, attention: str) -> tuple[str, str]:
    """--dtype and --attention as ``parallelism_calc.memory`` takes them: (precision, attention), "naive" for the
    naive attention (it saves the n x n probabilities) and "flash" for every fused kernel (it saves none)."""
    return DTYPES[dtype], "naive" if attention == "naive" else "flash"


def device_terms(device_type: str) -> dict[str, Any]:
    """What ``parallelism_calc.memory`` takes for a PyTorch step on a device of this type: on "cuda", RMSNorm as
    ``F.rms_norm``'s fused kernel keeps it and cuBLAS's workspaces (``CUDA_LIBRARY_WORKSPACES``); elsewhere the
    written-out norm (the CPU's ``F.rms_norm``) and none."""
    from parallelism_calc.memory import CUDA_LIBRARY_WORKSPACES

    cuda = device_type == "cuda"
    return {"fused_norm": cuda, "workspaces": CUDA_LIBRARY_WORKSPACES if cuda else 0}


def compiled_activations(compiled: bool, attention: str, checkpoint_every: int | None = None) -> bool:
    """Whether ``parallelism_calc.memory``'s count of what compiled blocks save (``compiled=True``) applies to a
    run: compiled, a fused attention kernel (``calculator_terms``' "flash"), no checkpointing (what the count was
    measured for); otherwise the eager count stands."""
    return bool(compiled) and attention == "flash" and not checkpoint_every


# What the JAX step's remat policies (``jax_impl.train.REMAT_POLICIES``, by name) recompute, as ``recomputation``'s
# terms: "full" every block's forward; "dots" the attention core (its products have batch dimensions, which
# dots_with_no_batch_dims does not save, and cuDNN's fused kernel is no dot). The others keep every product but,
# under "qkv_mlp", the output projection's (2 N d^2 a block, not counted: the floor stays below the step)
JAX_REMAT_RECOMPUTES: dict[str, dict[str, Any]] = {"full": {"recompute_blocks": 1}, "dots": {"selective": True}}


def recomputation(checkpoint_every: int | None, nested_checkpoint: bool, keep_attention: bool,
                  loss: str | None, remat: str | None = None) -> dict[str, Any]:
    """What a step's backward recomputes, as ``parallelism_calc.roofline.step_time_floor`` takes it: each
    checkpointed block's forward (twice if nested) without the attention it kept, and the fused loss's logits; for
    a JAX step, what its ``remat`` policy recomputes (``JAX_REMAT_RECOMPUTES``)."""
    blocks = 0 if not checkpoint_every else 2 if nested_checkpoint else 1
    return {"recompute_blocks": blocks, "loss": loss or "plain", "kept_attention": bool(keep_attention),
            **JAX_REMAT_RECOMPUTES.get(remat or "none", {})}


# torch e2e --cuda-graph: each mode and what it adds to the implementation's name (none, one per compiled block, one
# step); the DDP benchmark and the trainer record theirs as metrics.cuda_graph
CUDA_GRAPH_MODES = {"off": "", "blocks": ", cuda graph per block", "step": ", cuda graph"}
LOSS_METRICS = ("losses", "train_losses", "val_loss")  # metrics holding losses: one not finite = "diverged"


@dataclass(frozen=True)
class StepConfig:
    """A step benchmark's run, typed: the flags every step benchmark takes (``add_step_arguments``, whose
    defaults these are). ``run_benchmark`` hands it, not an ``argparse.Namespace``, to the backend's ``measure``;
    a backend's own flags are the fields of its subclass (``run_benchmark(config=...)``), and
    ``dataclasses.replace`` makes a variant of a run (one sweep configuration, the stock reference's dtype)."""

    model: str = "tiny"
    batch_size: int = 4
    seq_len: int | None = None  # None: the spec's context
    mode: str = "train_step"  # parallelism_calc.compute.MODES
    dtype: str = "fp32"  # DTYPES
    attention: str = "naive"
    device: str = "auto"
    warmup: int = 5
    steps: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    load_weights: str | None = None
    save_weights: str | None = None
    suite: str = "e2e"
    out: str | None = None
    json: bool = False
    sweep_models: str | None = None
    sweep_seq_lens: list[int] | None = None
    config_timeout: float = 1800.0
    process_per: str = "config"  # SWEEP_PROCESSES
    in_process: bool = False  # set by run_sweep in the process it starts per model


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every step benchmark accepts (``StepConfig``'s fields)."""
    d = StepConfig()
    parser.add_argument("--model", default=d.model, help=f"model preset: {', '.join(MODELS)} (default {d.model})")
    parser.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                        help=f"sequences per step (default {d.batch_size})")
    parser.add_argument("--seq-len", type=positive_int, default=d.seq_len,
                        help="tokens per sequence (default: the spec's context)")
    parser.add_argument("--mode", choices=MODES, default=d.mode,
                        help="forward (no gradients), forward_backward, or train_step with AdamW (default)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=d.dtype,
                        help="fp32 (full-precision matmuls, no TF32); bf16 (autocast: fp32 weights, bf16 compute); "
                             "bf16_mixed (bf16 weights, fp32 master weights in the optimizer) "
                             f"(default {d.dtype})")
    parser.add_argument("--attention", default=d.attention, help=f"attention backend (default {d.attention})")
    parser.add_argument("--device", default=d.device, help="auto (the accelerator if any), cpu, cuda or cuda:N")
    parser.add_argument("--warmup", type=nonnegative_int, default=d.warmup,
                        help=f"untimed warm-up steps (default {d.warmup})")
    parser.add_argument("--steps", type=positive_int, default=d.steps, help=f"timed steps (default {d.steps})")
    parser.add_argument("--lr", type=positive_float, default=d.lr, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--weight-decay", type=nonnegative_float, default=d.weight_decay,
                        help=f"AdamW weight decay (default {d.weight_decay})")
    parser.add_argument("--seed", type=nonnegative_int, default=d.seed,
                        help=f"seed of weights and data (default {d.seed})")
    parser.add_argument("--load-weights", metavar="NPZ", help="start from these weights (stable names, .npz)")
    parser.add_argument("--save-weights", metavar="NPZ", help="save the initial weights here (.npz)")
    parser.add_argument("--suite", default=d.suite, help=f"suite name written into the records (default {d.suite})")
    parser.add_argument("--out", metavar="JSONL", type=writable_path,
                        help="append the record to this JSON Lines file")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    sweep = parser.add_argument_group("sweep (a process per configuration or per model; needs --out)")
    sweep.add_argument("--sweep-models", help="comma-separated presets, e.g. small,medium,large,xl,2.7B")
    sweep.add_argument("--sweep-seq-lens", type=int_list,
                       help="comma-separated sequence lengths, e.g. 128,256,512,1024")
    sweep.add_argument("--config-timeout", type=positive_float, default=d.config_timeout,
                       help="seconds one sweep configuration may take before it is recorded as an error")
    sweep.add_argument("--process-per", choices=SWEEP_PROCESSES, default=d.process_per,
                       help="config: a process per configuration (nothing shared); model: a process per model "
                            "runs its sequence lengths one after the other (starts and compiles less; a crash "
                            "loses that model's later lengths, each recorded as an error) (default config)")
    sweep.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)


def resolve_spec(args: StepConfig) -> tuple[ModelSpec, int]:
    """The model spec and sequence length of a run; the spec's context grows to fit a longer --seq-len."""
    spec = get_model(args.model)
    if spec.arch != "transformer":
        raise ValueError(f"model {spec.name!r} is an analysis-only {spec.arch} model; pick a Transformer preset")
    seq_len = args.seq_len or spec.context_length
    for flag, value in (("--batch-size", args.batch_size), ("--seq-len", seq_len), ("--steps", args.steps)):
        if value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if seq_len > spec.context_length:
        spec = spec.replace(context_length=seq_len)
    return spec, seq_len


@dataclass(frozen=True)
class StepRun:
    """What a step record says of the run that made it, typed: the suite, what one step runs, the dtype, one
    step's batch, how many steps were warm-up and timed, and the learning rate (``metrics.lr``; None: the
    caller records its own). ``StepRun.of(config)`` takes them from a run's."""

    suite: str
    mode: str  # parallelism_calc.compute.MODES
    dtype: str  # DTYPES
    batch_size: int
    warmup: int
    steps: int
    lr: float | None = None

    @classmethod
    def of(cls, args: Any, **changes: Any) -> "StepRun":
        return cls(**{f.name: changes.get(f.name, getattr(args, f.name, None)) for f in dataclasses.fields(cls)})


def step_record(
    run: StepRun,
    spec: ModelSpec,
    seq_len: int,
    *,
    backend: str,
    implementation: str,
    device_name: str,
    step_times_ms: Sequence[float] | None = None,
    phases_ms: dict[str, Sequence[float]] | None = None,
    peak_memory_bytes: int | None = None,
    metrics: dict[str, Any] | None = None,
    status: str = "ok",
    error: str | None = None,
    mesh: dict[str, int] | None = None,
) -> Record:
    """The record of one step benchmark: timing statistics, tokens/s, achieved TFLOP/s and MFU; status
    "diverged" where a loss in ``metrics`` (``LOSS_METRICS``) is not finite.

    ``run.batch_size`` is the batch of one step of the measured program. With a ``mesh`` (one program over
    several devices, as JAX's), that batch is global: ``tflops`` and ``mfu`` are per device (the step's
    FLOPs / the number of devices), ``world_size`` is the mesh's device count.
    """
    flops = step_flops(spec, run.batch_size, seq_len, run.mode)
    world_size = int(np.prod(list(mesh.values()))) if mesh else 1
    record = Record(
        suite=run.suite, backend=backend, implementation=implementation, model=spec.name,
        model_dims=dataclasses.asdict(spec), batch_size=run.batch_size, seq_len=seq_len, dtype=run.dtype,
        mode=run.mode, world_size=world_size, mesh=mesh, warmup_steps=run.warmup, timed_steps=run.steps,
        flops_per_step=flops, peak_memory_bytes=peak_memory_bytes, metrics=dict(metrics or {}), status=status,
        error=error,
    )
    if run.lr is not None:
        record.metrics.setdefault("lr", run.lr)
    if status == "ok" and (why := divergence(_losses(record.metrics))):
        record.status, record.error = "diverged", why
    record.provenance["device_name"] = device_name
    if step_times_ms:
        record.timing = timing_stats(step_times_ms)
        seconds = record.timing["median_ms"] / 1e3
        record.tokens_per_s = run.batch_size * seq_len / seconds
        record.tflops = flops / world_size / seconds / 1e12
        hardware = hardware_for_device(device_name)
        if hardware is not None:
            peak = hardware.fp32_flops if run.dtype == "fp32" else hardware.bf16_flops
            record.mfu = flops / world_size / seconds / peak if peak else None
    if phases_ms:
        record.phases = {phase: timing_stats(times) for phase, times in phases_ms.items()}
    return record


def _losses(metrics: dict[str, Any]) -> list[float]:
    """Every loss in ``metrics`` (``LOSS_METRICS``: lists or single values; None, e.g. no validation, skipped)."""
    values = []
    for name in LOSS_METRICS:
        value = metrics.get(name)
        values += value if isinstance(value, list) else [value]
    return [v for v in values if v is not None]


def progress(items: Sequence[Any], desc: str, unit: str, enabled: bool = True):
    """(``items`` wrapped in a tqdm bar on stderr, its ``write``) where tqdm is installed; else (``items``
    themselves, ``print``): the GPU image may lack tqdm. ``write(line)`` prints a result line without
    breaking the bar; ``enabled=False`` hides the bar (e.g. on all but one process)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items, print
    bar = tqdm(items, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, disable=not enabled)
    return bar, bar.write


@contextlib.contextmanager
def frozen_gc():
    """Time steps with every object alive now out of the garbage collector's reach (``gc.freeze``): a full
    collection then scans only what the steps allocate, not the framework's whole heap, which stalled a
    host-driven JAX step for ~50 ms at random steps (notes/jax.md, session 16). Both backends' benchmarks time
    under it. References: the ``gc.freeze`` docs; torchtitan's ``GarbageCollection`` (collections at chosen
    steps)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def fixed_batch(seed: int, batch_size: int, seq_len: int, vocab_size: int) -> np.ndarray:
    """(B, T + 1) int64 token ids from numpy's generator: the same batch in both backends for one seed."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch_size, seq_len + 1), dtype=np.int64)


def emit(args: StepConfig, record: Record) -> int:
    """Append the record to --out, print it (as JSON with --json, else one line); the exit code (0 if ok)."""
    if args.out:
        save_records(args.out, record)
    if args.json:
        print(json.dumps(record.to_dict(), sort_keys=True))
    elif record.status != "ok":
        print(f"{record.backend} {record.implementation} {record.model}: {record.status}: {record.error}")
    else:
        print(f"{record.backend} {record.implementation} {record.model} {record.mode} {record.dtype}: "
              f"median {record.timing['median_ms']:.2f} ms/step, {record.tokens_per_s:,.0f} tokens/s, "
              f"loss {record.metrics['loss_first']:.4f} -> {record.metrics['loss_last']:.4f}"
              + (f", MFU {record.mfu:.1%}" if record.mfu else "")
              + (f", {record.metrics['x_stock']:.2f}x stock" if "x_stock" in record.metrics else ""))
    return 0 if record.status == "ok" else 1


def run_benchmark(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    measure: Callable[[StepConfig], Record | Iterable[Record]],
    on_failure: Callable[[StepConfig, RuntimeError], Record],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    is_writer: Callable[[], bool] = lambda: True,
    config: type[StepConfig] = StepConfig,
) -> int:
    """Parse the step flags into ``config`` (``StepConfig`` or a backend's subclass with a field per flag that
    ``add_arguments`` adds), measure, and emit the record; the CLI body of both backends' step benchmarks.

    ``measure`` returns a record or yields several (e.g. a reference and ours, timed in one process), each
    emitted as soon as it is yielded. Bad input (flags, a weights file) exits with a one-line message and no
    record; a RuntimeError while measuring (out of memory, a kernel failure) becomes the record ``on_failure``
    makes, a row not a gap.
    Only the process for which ``is_writer()`` holds (e.g. process 0 of a multi-host run) emits the record.
    Refused input and an unwritable ``--out`` end at ``parallelism_calc.cli.error_boundary``: one line, status 2.
    """
    return error_boundary(_run_benchmark, prog=prog)(argv, prog=prog, description=description, measure=measure,
                                                    on_failure=on_failure, add_arguments=add_arguments,
                                                    is_writer=is_writer, config=config)


def step_parser(prog: str, description: str,
                add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> ArgumentParser:
    """A step benchmark's parser: the flags every one accepts and the backend's own (``add_arguments``)."""
    parser = ArgumentParser(prog=prog, description=description)
    add_step_arguments(parser)
    if add_arguments is not None:
        add_arguments(parser)
    return parser


def _run_benchmark(argv, *, prog, description, measure, on_failure, add_arguments, is_writer, config) -> int:
    parser = step_parser(prog, description, add_arguments)
    args = config(**vars(parser.parse_args(argv)))
    runs = [args]
    if args.in_process:  # one model's sequence lengths, one after the other (run_sweep's child)
        runs = [dataclasses.replace(args, seq_len=n, sweep_seq_lens=None, in_process=False)
                for n in args.sweep_seq_lens or [args.seq_len]]
    elif args.sweep_models or args.sweep_seq_lens:
        module = prog.split(" -m ")[-1]  # e.g. jax_impl.bench.e2e, whose backend is "jax"
        return run_sweep(args, list(sys.argv[1:] if argv is None else argv), module=module,
                         backend=module.split(".")[0].removesuffix("_impl"))
    codes = []

    def emit_one(run: StepConfig, record: Record) -> None:  # written the moment it exists: not lost to a later failure
        codes.append(emit(run, record) if is_writer() else 0 if record.status == "ok" else 1)

    for run in runs:
        try:
            measured = measure(run)
            for record in [measured] if isinstance(measured, Record) else measured:
                emit_one(run, record)
        except RuntimeError as err:  # torch.OutOfMemoryError and jax's JaxRuntimeError are RuntimeErrors
            emit_one(run, on_failure(run, err))
    return max(codes, default=0)


def failure_record(args: StepConfig, err: Exception, *, backend: str, implementation: str,
                   device_name: str, oom: bool, mesh: dict[str, int] | None = None) -> Record:
    """The record of a run that ran out of memory (``oom``) or failed, with the error's first line."""
    spec, seq_len = resolve_spec(args)
    return step_record(StepRun.of(args), spec, seq_len, backend=backend, implementation=implementation,
                       device_name=device_name, mesh=mesh, status="oom" if oom else "error",
                       error=f"{type(err).__name__}: {err}".splitlines()[0])


_SWEEP_FLAGS = ("--sweep-models", "--sweep-seq-lens", "--config-timeout", "--process-per", "--model", "--seq-len")
# --process-per: what one process of a sweep runs
SWEEP_PROCESSES = ("config", "model")


def _without(argv: list[str], flags: Sequence[str]) -> list[str]:
    """``argv`` without the given valued flags (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in flags:
            skip = True
        elif not token.startswith(tuple(f + "=" for f in flags)):
            out.append(token)
    return out


def _count_records(path: Path) -> int:
    return len(read_records(path)) if path.exists() else 0


def run_sweep(args: StepConfig, argv: list[str], *, module: str, backend: str) -> int:
    """The model x sequence-length grid, one ``python -m module`` process per configuration (so an
    out-of-memory or a crash cannot poison the next one) or, with ``--process-per model``, per model (its
    lengths one after the other: one start, one warm compiler; ``--config-timeout`` then bounds the whole
    process, times its number of lengths). A configuration that ends without writing its record (a crash, a hang
    past the timeout) gets an error record written here: a row, not a gap."""
    if not args.out:
        raise ValueError("a sweep needs --out (its records are its result)")
    models = [m for m in (args.sweep_models or args.model).split(",") if m]
    seq_lens = args.sweep_seq_lens or [args.seq_len]
    base = _without(argv, _SWEEP_FLAGS)
    lengths = ",".join(str(n) for n in seq_lens if n)
    groups = ([[(model, n) for n in seq_lens] for model in models] if args.process_per == "model"
              else [[config] for config in itertools.product(models, seq_lens)])
    bar, _ = progress(groups, f"{module} sweep", "process")
    failures = 0
    for i, group in enumerate(bar, 1):
        model, seq_len = group[0]
        child = [sys.executable, "-m", module, *base, "--model", model]
        if len(group) > 1:
            child += ["--sweep-seq-lens", lengths, "--in-process"]
        elif seq_len:
            child += ["--seq-len", str(seq_len)]
        written = _count_records(Path(args.out))
        timeout = args.config_timeout * len(group)
        try:
            proc = subprocess.run(child, capture_output=True, text=True, timeout=timeout)
            message = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            proc, message = None, f"no result within --config-timeout {args.config_timeout:g} s"
        statuses: dict[tuple[str, int], set[str]] = {}
        for r in read_records(args.out)[written:] if Path(args.out).exists() else []:
            statuses.setdefault((r.model, r.seq_len), set()).add(r.status)
        for model, seq_len in group:
            try:
                spec, n = resolve_spec(dataclasses.replace(args, model=model, seq_len=seq_len))
            except ValueError as err:  # bad configuration: still a row, with the spec's own dims unknown
                spec, n, why = get_model(model) if model in MODELS else None, seq_len, str(err)
            else:
                why = message
            failures += statuses.get((model, n)) != {"ok"}  # none written, or the child's own oom / error
            if (model, n) not in statuses:  # the child wrote nothing for this configuration: record why
                save_records(args.out, Record(suite=args.suite, backend=backend, implementation=f"sweep {module}",
                                              model=model, model_dims=dataclasses.asdict(spec) if spec else None,
                                              batch_size=args.batch_size, seq_len=n, dtype=args.dtype,
                                              mode=args.mode, status="error", error=why))
        if bar is groups:  # no tqdm: a line per process instead
            print(f"[{i}/{len(groups)}] {model} seq {lengths if len(group) > 1 else seq_len}: "
                  f"{'ok' if proc and proc.returncode == 0 else 'failed'}")
    configs = sum(len(group) for group in groups)
    print(f"sweep: {configs - failures} of {configs} configurations ok; records in {args.out}")
    return 0
