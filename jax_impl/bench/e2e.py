"""End-to-end step benchmark of the Flax model, on one device or a mesh: ``python -m jax_impl.bench.e2e``.

The JAX twin of ``torch_impl.bench.e2e``: the same flags, the same fixed random batch (numpy's generator,
same seed), the same AdamW hyperparameters and the same record, so the two backends compare field by field.
Every run is the sharded program of ``jax_impl.train`` (``make_train_step`` / ``make_loss_fn``) on a mesh:
``--mesh dp=2,fsdp=2,tp=2`` (``-1`` fills in the device count) with the strategy its degrees call for
(``jax_impl.sharding.strategy_for``; ``--strategy`` overrides), and without ``--mesh`` a 1-device mesh of
``--device``. Each mode is one ``jax.jit`` (train_step: forward, backward and the optax update fused,
parameters and optimizer state donated), compiled ahead of time, so only whole-step times are recorded.

Timing, as ``torch_impl.bench.e2e`` times PyTorch's steps with CUDA events: after ``--warmup`` steps, each
followed by reading its loss (the median of all but the first is the metric ``synced_median_ms``: the step with
the device idle while the host starts the next one), the ``--steps`` timed steps are enqueued back to back without
reading a loss, the host running ahead, and a step's time is the interval between its completion and the
previous step's, seen by a thread that waits for each step's loss in turn (``pipelined_step_times``). Then as
many steps again are enqueued with nothing waiting on them until the last: their wall time over their count is
the metric ``back_to_back_mean_ms`` (no thread beside the host that enqueues them).

Record (``analysis.harness.step_record``): ``--batch-size`` is the global batch (one program over the
mesh, JAX's convention; the PyTorch DDP benchmark's batch is per rank); ``tflops`` / ``mfu`` per device;
``world_size`` and ``mesh`` from the mesh; ``peak_memory_bytes`` the worst device's allocator peak (GPU; None
on CPU). Metrics: ``strategy``, ``remat``, ``scan_layers``, ``block_loop``, ``blocks_per_program``, ``init_s``
(parameters and AdamW state created, their jitted initializers' compiles included), ``compile_s`` (the step's
ahead-of-time compile; with ``JAX_COMPILATION_CACHE_DIR`` set, recorded as ``compilation_cache_dir``, a warm cache
shortens both),
``xla_flags`` and ``mem_fraction`` (the ``XLA_FLAGS`` and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` it ran under),
``compiled_memory`` (the compiled step's
``memory_analysis()`` per device: arguments, outputs, aliased (donated) and temporary bytes, and
``estimate_bytes`` = arguments + outputs - aliased + temporaries), the losses, and
``predicted_memory_bytes`` from ``parallelism_calc.memory.per_device_memory`` for the strategy's sharding.
``--profile DIR`` writes a ``jax.profiler`` trace (TensorBoard / Perfetto) of three extra steps after the
timed ones and, on a GPU, their kernel table by category (``DIR/<model>_<B>x<T>_<mode>_kernels.md``, the
shares in the record as ``time_share.<category>``, as the PyTorch benchmark's; the GPU's busy and idle ms per
step as ``gpu_busy_ms`` / ``gpu_idle_ms``, the largest idle gaps in the table's file); ``--dump-hlo FILE`` the
compiled step's optimized HLO (what XLA fused, copied and called). ``--load-weights`` starts from the PyTorch
model's weights (``--save-weights`` there).

Multi-host: ``jax_impl.distributed.initialize_from_env()`` runs first, so the same command under a
launcher (SLURM, Open MPI, torchrun-style variables, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID) runs one program over every host's devices; process 0 writes the record.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from analysis.harness import (StepConfig, StepRun, calculator_terms, failure_record, fixed_batch, frozen_gc,
                              resolve_spec, run_benchmark, step_parser, step_record)
from analysis.kernels import (KERNEL_TIME_PREFIX, hlo_kernel_details, kernel_table, markdown, trace_gpu_idle,
                              trace_kernel_times)
from analysis.records import Record
from jax_impl.device import device_name, mesh_from_flags, peak_memory_bytes
from jax_impl.distributed import initialize_from_env, process_layout
from jax_impl.model import to_numpy_weights
from jax_impl.per_block import COMPILER_OPTIONS
from jax_impl.sharding import STRATEGIES
from jax_impl.train import (BLOCK_LOOPS, REMAT_POLICIES, ShardedTrainer, dtype_arguments, make_loss_fn,
                            matmul_precision, step_name)
from parallelism_calc.specs import ModelSpec

PROFILED_STEPS = 3


def build_mesh(args: JaxStepConfig) -> tuple[Mesh, str]:
    """The mesh of ``--mesh`` over ``--device``'s devices and its strategy (``jax_impl.device.mesh_from_flags``)."""
    return mesh_from_flags(args.mesh, args.device, args.strategy)


def compiled_memory(compiled) -> dict[str, int] | None:
    """Per-device bytes of a compiled step from XLA's ``memory_analysis()`` (None where unsupported)."""
    try:
        analysis = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError):  # AttributeError: several programs
        return None
    if analysis is None:
        return None
    fields = ("argument", "output", "alias", "temp", "generated_code")
    out = {name: int(getattr(analysis, f"{name}_size_in_bytes", 0) or 0) for name in fields}
    out["estimate_bytes"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def predicted_memory(spec: ModelSpec, args: JaxStepConfig, seq_len: int, mesh: Mesh,
                     strategy: str) -> dict[str, Any]:
    """``parallelism_calc``'s per-device memory for this run (train_step only), or why there is none."""
    from parallelism_calc.memory import CHECKPOINTING, mesh_memory_strategy, per_device_memory

    if args.mode != "train_step":
        return {}
    try:
        calc = mesh_memory_strategy(strategy, *(int(mesh.shape[a]) for a in ("dp", "fsdp", "tp")))
    except ValueError as err:
        return {"predicted_memory_error": str(err)}
    if args.remat not in CHECKPOINTING:
        return {"predicted_memory_error": f"remat policy {args.remat!r} is not modelled "
                                          f"(parallelism_calc models {', '.join(CHECKPOINTING)})"}
    precision, attention = calculator_terms(args.dtype, args.attention)
    try:
        pred = per_device_memory(spec, calc[0], calc[1], args.batch_size * seq_len, seq_len, precision,
                                 checkpointing=args.remat, attention=attention, fused_norm=False,
                                 qkv_product=False)  # the RMSNorm written out (its vjp keeps x / rms), q, k and
        # v three products: the torch model's one product is not this one's
    except ValueError as err:
        return {"predicted_memory_error": str(err)}
    return {"predicted_memory_bytes": pred.total, "predicted_strategy": calc[0]}


def measure(args: JaxStepConfig) -> Record:
    if args.block_loop == "per_block" and args.mode != "train_step":
        raise ValueError(f"--block-loop per_block times --mode train_step only, not {args.mode}")
    initialize_from_env()
    precision = matmul_precision(args.dtype)
    mesh, strategy = build_mesh(args)
    with jax.default_matmul_precision(precision):
        return measure_on_mesh(args, mesh, strategy)


def _compile_step(args: JaxStepConfig, trainer: ShardedTrainer,
                  tokens: jax.Array) -> tuple[Any, Callable[[], jax.Array]]:
    """The AOT-compiled program of ``args.mode`` and a closure enqueueing one step (returns its loss, unread)."""
    if args.mode == "train_step":
        trainer.compile(tokens.shape[0], tokens.shape[1] - 1)  # the one program, or every per-block program
        compiled = trainer.train_step

        def step() -> jax.Array:
            trainer.params, trainer.opt_state, loss = compiled(trainer.params, trainer.opt_state, trainer.rest,
                                                               tokens)
            return loss
    else:
        loss_fn = make_loss_fn(trainer.graphdef, trainer.batch_sharding, remat=trainer.remat)
        fn = loss_fn if args.mode == "forward" else jax.value_and_grad(loss_fn)
        replicated = NamedSharding(trainer.mesh, P())
        out = replicated if args.mode == "forward" else (replicated, trainer.param_shardings)
        compiled = jax.jit(fn, in_shardings=(trainer.param_shardings, trainer.rest_shardings,
                                             trainer.batch_sharding), out_shardings=out) \
            .lower(trainer.params, trainer.rest, tokens).compile()

        def step() -> jax.Array:
            result = compiled(trainer.params, trainer.rest, tokens)
            return result if args.mode == "forward" else result[0]
    return compiled, step


def pipelined_step_times(step: Callable[[], jax.Array], n: int) -> tuple[list[float], list[float]]:
    """``n`` steps enqueued back to back, none waited for by the host that enqueues them; a thread waits for each
    step's loss in turn and notes when it is ready. Returns each step's time in ms (from the previous step's
    completion, the first from the call, when the device is idle) and the losses. The device's view of the step,
    as CUDA events give it (the waiting thread's wake-up, tens of microseconds, shifts one interval into the next)."""
    pending: queue.Queue = queue.Queue()
    done = [time.perf_counter()]

    def wait_in_turn() -> None:
        for _ in range(n):
            jax.block_until_ready(pending.get())
            done.append(time.perf_counter())

    waiter = threading.Thread(target=wait_in_turn, daemon=True)
    waiter.start()
    losses = []
    for _ in range(n):
        losses.append(step())
        pending.put(losses[-1])
    waiter.join()
    return [(b - a) * 1e3 for a, b in zip(done, done[1:])], [float(loss) for loss in losses]


def measure_on_mesh(args: JaxStepConfig, mesh: Mesh, strategy: str) -> Record:
    spec, seq_len = resolve_spec(args)
    start = time.perf_counter()
    trainer = ShardedTrainer(spec, mesh, strategy, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                             **dtype_arguments(args.dtype), remat=args.remat,
                             attention=args.attention, block_loop=args.block_loop,
                             blocks_per_program=args.blocks_per_program)
    jax.block_until_ready((trainer.params, trainer.opt_state))
    init_s = time.perf_counter() - start  # parameters and AdamW state created (compiles included)
    if args.load_weights:
        trainer.load_weights(dict(np.load(args.load_weights)))
    if args.save_weights and jax.process_index() == 0:
        np.savez(args.save_weights, **to_numpy_weights(trainer.master_model))
    tokens = trainer.place_batch(fixed_batch(args.seed, args.batch_size, seq_len, spec.vocab_size))

    start = time.perf_counter()
    compiled, step = _compile_step(args, trainer, tokens)
    compile_s = time.perf_counter() - start
    if args.dump_hlo:
        Path(args.dump_hlo).write_text(compiled.as_text())
    losses, synced_ms, profiled = [], [], {}
    read = lambda: float(step())  # noqa: E731  (float() waits for the device)
    with frozen_gc():
        for _ in range(args.warmup):
            start = time.perf_counter()
            losses.append(read())
            synced_ms.append((time.perf_counter() - start) * 1e3)
        step_ms, timed_losses = pipelined_step_times(step, args.steps)
        losses += timed_losses
        start = time.perf_counter()
        jax.block_until_ready([step() for _ in range(args.steps)])
        back_to_back_ms = (time.perf_counter() - start) * 1e3 / args.steps
        if args.profile:
            profiled = profile_steps(step, compiled.as_text(), args.profile,
                                     f"{spec.name}_{args.batch_size}x{seq_len}_{args.mode}")
    metrics: dict[str, Any] = {
        "strategy": strategy, "remat": args.remat, "scan_layers": args.block_loop == "scan",
        "block_loop": args.block_loop, "blocks_per_program": (
            trainer.train_step.blocks_per_program if args.block_loop == "per_block" else None),
        "attention": args.attention, "init_s": init_s, "compile_s": compile_s, **process_layout(),
        "compilation_cache_dir": jax.config.jax_compilation_cache_dir, "xla_flags": os.environ.get("XLA_FLAGS"),
        "compiler_options": COMPILER_OPTIONS if args.block_loop == "per_block" else None,
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "compiled_memory": compiled_memory(compiled), "loss_first": losses[0], "loss_last": losses[-1],
        "losses": losses, "synced_median_ms": statistics.median(synced_ms[1:]) if synced_ms[1:] else None,
        "back_to_back_mean_ms": back_to_back_ms,
        **predicted_memory(spec, args, seq_len, mesh, strategy)}
    metrics.update(profiled)
    return step_record(
        StepRun.of(args), spec, seq_len, backend="jax", implementation=implementation_name(args, mesh, strategy),
        device_name=device_name(mesh.devices.flat[0]), step_times_ms=step_ms, peak_memory_bytes=peak_memory_bytes(mesh),
        mesh={axis: int(size) for axis, size in mesh.shape.items()}, metrics=metrics,
    )


def profile_steps(step: Callable[[], jax.Array], hlo_text: str, out_dir: str, tag: str) -> dict[str, Any]:
    """``PROFILED_STEPS`` calls of ``step`` under ``jax.profiler.trace(out_dir)``, enqueued back to back as the
    timed steps are; on a GPU also the kernel table by category (``analysis.kernels``; what each kernel computes
    from ``hlo_text``, the compiled step's optimized HLO) as ``out_dir/<tag>_kernels.md`` and its shares as
    metrics: one device's (the first), from process 0's trace (the others run the steps untraced)."""
    # one trace, process 0's (each process of a launch runs the steps; several tracing into one folder collide)
    with jax.profiler.trace(out_dir) if jax.process_index() == 0 else contextlib.nullcontext():
        jax.block_until_ready([step() for _ in range(PROFILED_STEPS)])
    metrics: dict[str, Any] = {"profile_dir": out_dir}
    if jax.process_index() != 0:  # process 0's trace may still be being written; its record is process 0's
        return metrics
    traces = sorted(Path(out_dir).glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    try:
        rows = kernel_table(trace_kernel_times(traces[-1]), PROFILED_STEPS) if traces else None
    except ValueError:  # no GPU timeline (a CPU run): the trace alone
        rows = None
    if rows:
        idle = trace_gpu_idle(traces[-1])
        text = markdown(rows, f"{tag}: GPU time per step by kernel category", hlo_kernel_details(hlo_text))
        Path(out_dir, f"{tag}_kernels.md").write_text(f"{text}\n\n{idle.markdown(PROFILED_STEPS)}\n")
        metrics.update({f"time_share.{row.category}": row.fraction for row in rows})
        metrics.update({f"{KERNEL_TIME_PREFIX}{row.category}": row.time_ms for row in rows})
        metrics.update(gpu_busy_ms=idle.busy_ms / PROFILED_STEPS, gpu_idle_ms=idle.idle_ms / PROFILED_STEPS)
    return metrics


def implementation_name(args: JaxStepConfig, mesh: Mesh | None, strategy: str | None) -> str:
    """``jax_impl.train.step_name`` of this run (its strategy named on a mesh of several devices)."""
    return step_name(args.attention, args.remat, block_loop=args.block_loop,
                     strategy=None if mesh is None or mesh.size == 1 else strategy)


def failed_record(args: JaxStepConfig, err: RuntimeError) -> Record:
    """The record of a run that ran out of memory or failed, so the failure is a row, not a gap."""
    oom = "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower()
    mesh, strategy = build_mesh(args)
    return failure_record(args, err, backend="jax", implementation=implementation_name(args, mesh, strategy),
                          device_name=device_name(mesh.devices.flat[0]), oom=oom,
                          mesh={axis: int(size) for axis, size in mesh.shape.items()})


@dataclasses.dataclass(frozen=True)
class JaxStepConfig(StepConfig):
    """A run of this benchmark: the shared step flags and those of ``add_jax_arguments``."""

    mesh: str | None = None
    strategy: str | None = None
    remat: str = "none"
    block_loop: str = "scan"
    blocks_per_program: int | None = None
    profile: str | None = None
    dump_hlo: str | None = None


def add_jax_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", help="device mesh, e.g. dp=2,fsdp=2,tp=2 or fsdp=-1 (default: one device)")
    parser.add_argument("--strategy", choices=STRATEGIES,
                        help="sharding rules (default: the ones the mesh's degrees call for)")
    parser.add_argument("--remat", nargs="?", const="full", default="none", choices=REMAT_POLICIES,
                        help="what each block keeps for the backward pass, the rest recomputed: none (default), "
                             "full (only its input; also the value of a bare --remat), dots (the weight "
                             "products' outputs), dots_attention (those and the attention output), qkv_mlp (the "
                             "attention's inputs and results, SwiGLU's products), qkv_mlp_norms (those, the norms' "
                             "outputs and the residual between attention and MLP), qkv_mlp_norms_product (those "
                             "and SwiGLU's elementwise product)")
    parser.add_argument("--block-loop", choices=BLOCK_LOOPS, default="scan",
                        help="scan: the blocks' parameters stacked and run by one lax.scan, so init and compile "
                             "time do not grow with depth (default); unrolled: a Python loop over separate "
                             "blocks traced into the step's program; per_block: the host calls one compiled "
                             "forward and one compiled backward per span of blocks (no stacks, no scan copies)")
    parser.add_argument("--blocks-per-program", type=int, metavar="N",
                        help="with --block-loop per_block: consecutive blocks run by one program (default: "
                             "jax_impl.per_block.BLOCKS_PER_PROGRAM; fewer dispatches, a longer compile)")
    parser.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace of 3 extra steps here")
    parser.add_argument("--dump-hlo", metavar="FILE", help="write the compiled step's optimized HLO here (text)")


PROG = "python -m jax_impl.bench.e2e"


def build_parser() -> argparse.ArgumentParser:
    """This CLI's parser (``main`` parses with the same one)."""
    return step_parser(PROG, __doc__.splitlines()[0], add_jax_arguments)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(argv, prog=PROG, description=__doc__.splitlines()[0],
                         measure=measure, on_failure=failed_record, add_arguments=add_jax_arguments,
                         is_writer=lambda: jax.process_index() == 0, config=JaxStepConfig)


if __name__ == "__main__":
    sys.exit(main())
