"""End-to-end step benchmark of the PyTorch model: ``python -m torch_impl.bench.e2e --model tiny``.

Times ``--mode`` forward (no gradients) | forward_backward | train_step (AdamW) for ``--warmup`` untimed and
``--steps`` timed steps on a fixed random batch (so in train_step mode the loss falls as the model memorizes
it), and writes one record (``analysis.records``) with the per-step and per-phase times, tokens/s, TFLOP/s and
MFU (FLOPs from ``parallelism_calc``), peak memory, the losses and the time the first step took to build
(compilation, capture: ``metrics.compile_s``). The warm-up steps are timed too and kept apart
(``metrics.warmup_step_ms``, ``metrics.warmup_phases_ms``; the first includes compilation): with the timed steps
after them they are what the same run would have reported without a warm-up. The step is
``torch_impl.step.train_step``, the trainer's and the DDP benchmark's; its phases are marked with CUDA events and
the device is waited for once, after the timed steps (``torch_impl.timing.PhaseTimer``), so the harness does not
stall the step it times.

``--stock BACKEND`` first times the stock reference (``torch_impl.stock``, compiled as a whole with
``--compile``) in the same process with the same flags and weights; ours then carries ``metrics.x_stock``.
``--also ATTENTION[:MLP],...`` times ours again with each of those attention backends (and MLPs) after
``--attention``'s, against the same stock run: e.g. ``--attention sdpa_cudnn --also flash_triton:gluon``.
``--dtype bf16_mixed`` trains ours with bf16 weights and ``torch_impl.optim.MasterAdamW`` (fp32 master weights
and moments, one Triton kernel) instead of autocast and torch's AdamW; the stock reference beside it trains
bf16 the stock way (autocast, fused AdamW) and its record says ``bf16``.
``--compile`` compiles ours a span of blocks at a time (``torch_impl.parallelize.parallelize``; the record's
``metrics.blocks_per_graph``) and its loss. ``--loss fused`` fuses ours' LM head with its cross-entropy, chunked
over tokens (``torch_impl.linear_cross_entropy``: never the batch x seq x vocab logits; custom ops that
``--compile`` leaves as they are); the record's ``metrics.loss`` and implementation (", fused loss") say which.
``--mlp gluon`` runs ours' SwiGLU MLPs through ``torch_impl.swiglu_gluon`` (SwiGLU in the GEMMs' epilogues); the
implementation says ", gluon mlp".
``--cuda-graph`` names how ours replays CUDA graphs (``analysis.harness.CUDA_GRAPH_MODES``), one record each, in the
given order: ``off`` (none), ``blocks`` (each compiled span's graph, Inductor's CUDA graph trees: needs
``--compile``; the records keep the name "cuda graph per block"), ``step`` (the whole step, forward,
backward and AdamW, as one graph: ``torch_impl.timing.capture_step``); e.g. ``--cuda-graph off,blocks,step``.

The JAX twin, ``python -m jax_impl.bench.e2e``, takes the same step flags; ``--save-weights`` here and
``--load-weights`` there start both from the same weights. An OOM or error is recorded, not lost.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

from analysis.harness import (CUDA_GRAPH_MODES, StepConfig, StepRun, calculator_terms, compiled_activations,
                              device_terms, failure_record, fixed_batch, frozen_gc, resolve_spec, run_benchmark,
                              step_record)
from analysis.records import Record
from parallelism_calc.checkpointing import checkpointed_activation_bytes
from parallelism_calc.memory import activation_bytes_per_token, per_device_memory
from torch_impl import nvtx
from torch_impl.attention.registry import ATTENTION_BACKENDS
from torch_impl.device import device_name, pick_device
from torch_impl.linear_cross_entropy import LOSSES
from torch_impl.model import MLPS, TransformerLM, cross_entropy
from torch_impl.parallelize import BLOCKS_PER_GRAPH, check_cuda_graph, parallelize
from torch_impl.profiling import memory_history, profile_metrics, profile_steps
from torch_impl.step import StepParts, for_loss, train_step
from torch_impl.stock import SDPA_BACKENDS, StockTransformerLM
from torch_impl.timing import PhaseTimer, capture_step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args: TorchStepConfig, spec, device: torch.device, stock: bool) -> torch.nn.Module:
    """Our TransformerLM, or the stock reference with the same weights (``torch_impl.stock``). Same seed, same
    weights, whichever is built."""
    torch.manual_seed(args.seed)
    model = TransformerLM(spec, attention=args.attention, device=device, loss="plain" if stock else args.loss,
                          mlp="torch" if stock else args.mlp)
    if args.load_weights:
        model.load_numpy_weights(dict(np.load(args.load_weights)))
    if args.save_weights and not stock:
        np.savez(args.save_weights, **model.to_numpy_weights())
    if stock:
        reference = StockTransformerLM(spec, attention=args.stock, device=device)
        reference.load_state_dict(model.state_dict())
        model = reference
    return model


def measure(args: TorchStepConfig) -> Iterator[Record]:
    """Ours, once per ``--cuda-graph`` mode, and first the stock reference with ``--stock BACKEND``, one after
    the other in this process, each record yielded as soon as it is made; each of ours then carries
    ``metrics.x_stock`` = stock's median step time / ours (> 1: ours is faster)."""
    graphs, runs = check_flags(args)
    stock = None
    if args.stock:  # the stock model trains bf16 the stock way, under autocast, also beside ours with bf16_mixed
        stock_dtype = "bf16" if args.dtype == "bf16_mixed" else args.dtype
        stock = measure_one(dataclasses.replace(args, dtype=stock_dtype), stock=True, graph="off")
        yield stock
    for run, graph in ((run, graph) for run in runs for graph in graphs):
        record = measure_one(run, stock=False, graph=graph)
        if stock is not None and stock.status == "ok" and record.status == "ok":
            record.metrics["x_stock"] = stock.timing["median_ms"] / record.timing["median_ms"]
        yield record


def also_runs(args: TorchStepConfig) -> list[TorchStepConfig]:
    """Ours as ``--attention`` and ``--mlp`` say, then as each ``--also ATTENTION[:MLP]`` says (its MLP ``--mlp``'s
    if not named)."""
    runs = [args]
    for item in filter(None, (args.also or "").split(",")):
        attention, _, mlp = item.partition(":")
        if attention not in ATTENTION_BACKENDS or (mlp or args.mlp) not in MLPS:
            raise ValueError(f"--also {item!r}: comma-separated ATTENTION[:MLP], attention one of "
                             f"{', '.join(sorted(ATTENTION_BACKENDS))}, MLP one of {', '.join(MLPS)}")
        runs.append(dataclasses.replace(args, attention=attention, mlp=mlp or args.mlp))
    return runs


def check_flags(args: TorchStepConfig) -> tuple[list[str], list[TorchStepConfig]]:
    """Rejects flags that cannot go together; returns the ``--cuda-graph`` modes and ours' runs (``also_runs``) in
    order."""
    device = pick_device(args.device)
    graphs = args.cuda_graph.split(",")
    unknown = [g for g in graphs if g not in CUDA_GRAPH_MODES]
    if unknown or len(set(graphs)) < len(graphs):
        raise ValueError(f"--cuda-graph {args.cuda_graph!r}: a comma-separated list of distinct modes from "
                         f"{', '.join(CUDA_GRAPH_MODES)}")
    if args.nested_checkpoint and not args.checkpoint_every:
        raise ValueError("--nested-checkpoint needs --ac-every K")
    if args.memory_snapshot and device.type != "cuda":
        raise ValueError("--memory-snapshot records the CUDA allocator: it needs --device cuda")
    if "blocks" in graphs and args.checkpoint_every:
        raise ValueError("--cuda-graph blocks: not with --ac-every (the recomputation would replay the "
                         "blocks' graphs inside the backward); use --cuda-graph step")
    for graph in graphs:
        check_cuda_graph(graph, args.compile, device.type, whole_step=True)
    if args.stock and args.stock not in SDPA_BACKENDS:
        raise ValueError(f"--stock {args.stock!r}: the stock model runs SDPA; accepted: {', '.join(SDPA_BACKENDS)}")
    return graphs, also_runs(args)


def measure_one(args: TorchStepConfig, stock: bool, graph: str) -> Record:
    """One model's record; an out-of-memory or other runtime failure becomes a failure record."""
    try:
        return _measure(args, stock, graph)
    except RuntimeError as err:  # torch.OutOfMemoryError is one
        return failed_record(args, err, stock=stock, graph=graph)
    finally:  # free this model before the next is built: compiled code and cached blocks included
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _measure(args: TorchStepConfig, stock: bool, graph: str) -> Record:
    spec, seq_len = resolve_spec(args)
    device = pick_device(args.device)
    if args.dtype == "fp32":
        torch.set_float32_matmul_precision("highest")  # no TF32: fp32 means fp32, as in the JAX twin
    model = build_model(args, spec, device, stock)
    tokens = torch.from_numpy(fixed_batch(args.seed, args.batch_size, seq_len, spec.vocab_size)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    graphed = graph == "step"
    fused = args.dtype != "bf16_mixed" and (device.type == "cuda" if args.fused_adamw == "auto"
                                            else args.fused_adamw == "on")
    adamw = dict(fused=fused, capturable=graphed, lr=args.lr, weight_decay=args.weight_decay)
    # ours compiled by regions; the stock way below: the whole model as one graph
    forward, _, optimizer = parallelize(model, dtype=args.dtype, adamw=adamw, compile=args.compile and not stock,
                                        cuda_graphs=graph == "blocks", ac_every=args.checkpoint_every,
                                        nested_ac=args.nested_checkpoint)
    loss = "plain" if stock else args.loss  # the stock reference computes its loss the plain way
    parts = StepParts(forward, optimizer, dtype=args.dtype, loss_fn=for_loss(loss))
    if args.compile and stock:
        parts.forward = torch.compile(model)
    elif args.compile and loss == "plain":
        parts.loss_fn = torch.compile(cross_entropy)
    timer = PhaseTimer(device)

    def step(mark) -> torch.Tensor:
        return train_step(parts, [(inputs, targets)], mark, mode=args.mode)[0]

    start = time.perf_counter()
    if graphed:
        # The graph's memory pool is made once, at capture, and never freed: count it in the peak.
        torch.cuda.reset_peak_memory_stats(device)
        replay = capture_step(lambda: step(lambda phase: None), optimizer)

        def run() -> torch.Tensor:
            timer.start()
            loss = replay().clone()
            timer.mark("step")  # one graph: its phases cannot be told apart
            return loss
    else:
        def run() -> torch.Tensor:
            timer.start()
            return step(timer.mark)

    losses = [run()]
    synchronize(device)
    compile_s = time.perf_counter() - start  # building the step: compilation, autotuning, capture
    warmup_ms, warmup_phases_ms = [], {}
    with frozen_gc():
        if args.warmup:  # the first step (compilation, capture) was the first warm-up step: not in the timing
            with nvtx.range("warmup"):
                losses += [run() for _ in range(args.warmup - 1)]
            warmup_ms, warmup_phases_ms = timer.results()  # kept apart: what timing without a warm-up would see
            timer = PhaseTimer(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if not graphed:  # the peak of a step after the warm-up
                torch.cuda.reset_peak_memory_stats(device)
        with memory_history(args.memory_snapshot) if args.memory_snapshot else contextlib.nullcontext():
            losses += [run() for _ in range(args.steps - (0 if args.warmup else 1))]
    step_ms, phases_ms = timer.results()
    # CUDA graph trees hand their pool's blocks back to the allocator's books after recording, so the allocated
    # peak misses what the blocks' graphs keep (xl 4 x 512: 23 GiB, below the 32 GiB of weights, gradients and
    # AdamW state): the reserved peak, an upper bound, is the honest figure there.
    peak = peak_kind = None
    if device.type == "cuda":
        peak_kind = "reserved" if graph == "blocks" else "allocated"
        peak = getattr(torch.cuda, f"max_memory_{peak_kind}")(device)
    losses = [float(loss) for loss in losses]
    metrics = {"loss_first": losses[0], "loss_last": losses[-1], "losses": losses, "fused_adamw": fused,
               "optimizer": type(optimizer).__name__, "loss": loss, "mlp": "torch" if stock else args.mlp,
               "peak_memory_kind": peak_kind,
               "checkpoint_every": args.checkpoint_every, "nested_checkpoint": args.nested_checkpoint,
               "blocks_per_graph": BLOCKS_PER_GRAPH if args.compile and not stock else None,
               "compile_s": compile_s, "warmup_step_ms": warmup_ms, "warmup_phases_ms": warmup_phases_ms,
               **predicted_memory(dataclasses.replace(args, loss=loss), spec, seq_len, stock)}
    if args.profile:
        variant = "_stock" if stock else "" if graph == "off" else f"_graph_{graph}"
        tag = f"{spec.name}_{args.batch_size}x{seq_len}_{args.mode}_{args.dtype}{variant}"
        calls: dict[str, float] = {}
        metrics.update(profile_metrics(profile_steps(run, 3, args.profile, tag=tag, calls=calls), calls))
    return step_record(
        StepRun.of(args), spec, seq_len, backend="torch", implementation=implementation_name(args, stock, graph),
        device_name=device_name(device), step_times_ms=step_ms, phases_ms=phases_ms,
        peak_memory_bytes=peak, metrics=metrics,
    )


def predicted_memory(args: TorchStepConfig, spec, seq_len: int, stock: bool = False) -> dict[str, int | None]:
    """What ``parallelism_calc`` predicts for this run: the activations saved for backward at the step's peak
    (``checkpointing.checkpointed_activation_bytes`` for ``--ac-every K`` flat or nested, else
    ``memory.activation_bytes_per_token``) and, for a train step, the device's peak placed in the step
    (``memory.per_device_memory(..., peak_model="timeline")``, one device: weights and AdamW state plus the
    largest of the forward's end, each block's backward with its checkpointing, and the backward's end; see
    notes/fidelity.md). Forward-only runs save nothing for backward: None. ``--loss fused``: the calculator's fused
    loss (an fp32 log-sum-exp a token, a chunk of logits and dW's accumulator, ``memory.loss_buffer_bytes``), except
    under ``--ac-every``, whose count (``checkpointing.checkpointed_activation_bytes``) keeps the plain loss's. With
    ``--compile`` our plain loss is compiled (``compiled_loss``), the ``stock`` model's runs eagerly, and its q, k
    and v are three products (ours one: ``qkv_product``); the device's terms: ``analysis.harness.device_terms``."""
    if args.mode == "forward":
        return {"predicted_activation_bytes": None, "predicted_peak_bytes": None}
    precision, attention = calculator_terms(args.dtype, args.attention)
    compiled = compiled_activations(args.compile, attention, args.checkpoint_every)
    tokens = args.batch_size * seq_len
    terms = device_terms(pick_device(args.device).type)
    if args.checkpoint_every:
        activations = checkpointed_activation_bytes(spec, seq_len, precision, args.checkpoint_every,
                                                    args.nested_checkpoint, attention,
                                                    fused_norm=terms["fused_norm"]).for_tokens(tokens)
    else:
        activations = activation_bytes_per_token(spec, seq_len, precision, "none", attention, compiled=compiled,
                                                 loss=args.loss, fused_norm=terms["fused_norm"],
                                                 qkv_product=not stock).for_tokens(tokens)
    peak = None
    if args.mode == "train_step":
        compiled_loss = args.compile and not stock and args.loss == "plain"
        peak = int(per_device_memory(spec, "ddp", 1, tokens, seq_len, precision, attention=attention,
                                     peak_model="timeline", checkpoint_every=args.checkpoint_every,
                                     nested_checkpoint=args.nested_checkpoint, compiled=compiled,
                                     loss=args.loss, compiled_loss=compiled_loss, qkv_product=not stock,
                                     **terms).total)
    return {"predicted_activation_bytes": activations, "predicted_peak_bytes": peak}


def implementation_name(args: TorchStepConfig, stock: bool = False, graph: str = "off") -> str:
    """e.g. 'compiled sdpa, ckpt 2 nested', 'compiled sdpa_cudnn, cuda graph' (the whole step),
    'compiled sdpa_cudnn, cuda graph per block', 'stock compiled sdpa_cudnn', 'compiled sdpa, fused loss',
    'compiled flash_triton, cuda graph per block, gluon mlp'."""
    name = f"{'compiled' if args.compile else 'eager'} {args.stock if stock else args.attention}"
    if stock:
        name = "stock " + name
    else:
        name += CUDA_GRAPH_MODES[graph]
    if args.checkpoint_every:
        name += f", ckpt {args.checkpoint_every}" + (" nested" if args.nested_checkpoint else "")
    if args.loss == "fused" and not stock:
        name += ", fused loss"
    if args.mlp != "torch" and not stock:
        name += f", {args.mlp} mlp"
    return name


def failed_record(args: TorchStepConfig, err: RuntimeError, stock: bool = False, graph: str = "off") -> Record:
    """The record of a run that ran out of memory or failed, so the failure is a row, not a gap."""
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    return failure_record(args, err, backend="torch", implementation=implementation_name(args, stock, graph),
                          device_name=device_name(torch.device(device)),
                          oom=isinstance(err, torch.OutOfMemoryError))


@dataclasses.dataclass(frozen=True)
class TorchStepConfig(StepConfig):
    """A run of this benchmark: the shared step flags and those of ``add_torch_arguments``."""

    compile: bool = False
    cuda_graph: str = "off"  # a comma list of CUDA_GRAPH_MODES
    stock: str | None = None
    also: str | None = None  # ours' other runs: ATTENTION[:MLP],... (``also_runs``)
    checkpoint_every: int | None = None  # --ac-every
    nested_checkpoint: bool = False
    fused_adamw: str = "auto"
    loss: str = "plain"  # torch_impl.linear_cross_entropy.LOSSES
    mlp: str = "torch"  # torch_impl.model.MLPS
    profile: str | None = None
    memory_snapshot: str | None = None


def add_torch_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the PyTorch benchmark alone."""
    torch_flags = parser.add_argument_group("PyTorch")
    torch_flags.add_argument("--compile", action="store_true",
                             help="torch.compile each block and the loss (the stock reference: the whole model)")
    torch_flags.add_argument("--cuda-graph", default="off", metavar="MODES",
                             help="how ours replays CUDA graphs (GPU; never the stock model), a comma-separated "
                                  "list timed in order, one record each: off, blocks (each compiled block: needs "
                                  "--compile), step (the whole step); default off"),
    torch_flags.add_argument("--stock", metavar="SDPA_BACKEND",
                             help="first time the stock reference with this SDPA backend (e.g. sdpa_cudnn) in the "
                                  f"same process, same flags: {', '.join(SDPA_BACKENDS)}")
    torch_flags.add_argument("--also", metavar="ATTENTION[:MLP],...",
                             help="then time ours again with each of these attention backends (and MLPs, e.g. "
                                  "flash_triton:gluon), in order, against the same stock run")
    # dest stays checkpoint_every: the records' metrics and analysis.single_gpu read that key
    torch_flags.add_argument("--ac-every", "--checkpoint-every", dest="checkpoint_every", type=int, metavar="K",
                             help="activation checkpointing (recomputation): recompute every segment of K blocks; "
                                  "--checkpoint-every is its old name, kept for one release")
    torch_flags.add_argument("--nested-checkpoint", action="store_true",
                             help="also checkpoint each block inside a segment (with --ac-every)")
    torch_flags.add_argument("--fused-adamw", choices=("auto", "on", "off"), default="auto",
                             help="fused AdamW kernel (auto: on CUDA)")
    torch_flags.add_argument("--loss", choices=LOSSES, default="plain",
                             help="plain: the LM head's logits, then the cross-entropy (default); fused: the two "
                                  "fused, chunked over tokens, never the logits (not the stock reference)")
    torch_flags.add_argument("--mlp", choices=MLPS, default="torch",
                             help="SwiGLU's MLP: torch (PyTorch's ops; default) or gluon (one op whose GEMMs compute "
                                  "SwiGLU and its backward in their epilogues: sm_90, bf16; not the stock reference)")
    torch_flags.add_argument("--profile", metavar="DIR",
                             help="after timing, profile 3 steps: Chrome trace and kernel table in DIR")
    torch_flags.add_argument("--memory-snapshot", metavar="PICKLE",
                             help="record the CUDA allocator's history over the timed steps and save the "
                                  "snapshot that pytorch.org/memory_viz opens")


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(argv, prog="python -m torch_impl.bench.e2e", description=__doc__.splitlines()[0],
                         measure=measure, on_failure=failed_record, add_arguments=add_torch_arguments,
                         config=TorchStepConfig)


if __name__ == "__main__":
    sys.exit(main())
