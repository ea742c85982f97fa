"""Predicted against measured: the committed GPU step records held against ``parallelism_calc``.

``python -m analysis.fidelity results --out results/reports/fidelity.md`` (files or folders of ``.jsonl``; the chart
as PNG and PDF beside the Markdown). Rows: every record that times a whole training step (mode train_step, status ok)
on a GPU whose measured ceilings are among the records (suite "ceilings", ``torch_impl.bench.ceilings``, matched by
device name); a step record without them is listed, with the reason. Per row:

* time: ``parallelism_calc.roofline.step_time_floor`` of the step as configured (with what its backward recomputes:
  ``analysis.harness.recomputation``, from the record's metrics) on those ceilings (the matmul rate of the record's
  compute dtype, the copy bandwidth, for several devices the bus bandwidth of the largest NCCL all-reduce recorded
  between as many of them, and for a torch bf16 step whose attention kernel the attention benchmark measured on that
  device at its head dim, that kernel's rate at the nearest sequence length: ``attention_rate``) against the median
  step; ``measured / floor`` says how far above its floor a run is, and beyond 25% the row says why where the
  records show it (``explain_times``: host-paced, host-bound, eager, a fixed cost, attention at the matmul rate;
  ``explain_kernels``: a profile of the step's program, its own or one of ``results/profiles`` (``profile_records``),
  where its time went against the floor's terms; ``explain_ranks``: a data-parallel step against the one-GPU step of
  its launch; ``explain_trainer``: an e2e benchmark's same step and what the trainer's loop adds to it;
  ``explain_code_changes``: the changes of our code the run predates, ``CODE_CHANGES``, and the same step measured
  since; ``explain_across_commits``: the same step, measured alike, at another commit within the bound or explained
  there), else it is counted without one in the summary;
* memory: ``parallelism_calc.memory.per_device_memory`` recomputed from the record's spec and configuration
  (``memory_prediction``; so a fixed formula re-reads every committed record) against the measured peak per device
  (``peak_memory_bytes``), for every record with one. One PyTorch device: the peak placed in the step
  (``peak_model="timeline"``: forward's end, each block's backward with its checkpointing, backward's end); several
  PyTorch ranks: the benchmark's own call (the DDP family: timeline with its gradient buckets; the FSDPs: timeline
  with their gathered window and reduce-scatter buffers); every JAX run: its benchmark's call ("sum"); where an
  earlier configuration of the DDP benchmark's launch left memory allocated (``leftover_bytes``: measured, or the
  weights and buckets of a wrapper that leaked before fc529ad), that is added and named. A record whose
  configuration the calculator cannot rebuild keeps what its benchmark predicted at run time (``metrics.
  predicted_peak_bytes`` or ``predicted_memory_bytes``), or, with none, the row's "memory model" says why not;
  a peak the benchmark read as the allocator's reserved bytes (CUDA graph pools) says so there too; beyond 5% the
  row says why where a known gap explains it (``explain_memory``), the run's later epochs do
  (``explain_first_epoch``), a change of our code it predates does
  (``explain_code_changes``) or the same step's peak at another commit does (``explain_across_commits``), else it is
  counted without one;
* communication: the floor's exposed communication against the record's ``comm`` phase, where it has one.

Error = predicted / measured - 1 (negative: the prediction is below the measurement). The summary gives, per
suite and strategy (``strategy_of``), the rows, the median and the worst |error| of each, and how many rows are
within the issue's bounds (5% for memory, 25% for time). The chart plots predicted against measured, log-log, one
point per row.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from analysis.allreduce import ALLREDUCE_SUITE
from analysis.attention import ATTENTION_SUITE
from analysis.data_parallel import (LEADERBOARD_SUITE, PHASES, SUITE as DDP_SUITE, baseline_key, calculator_strategy,
                                    memory_terms, sharded_step_memory)
from analysis.harness import (CUDA_GRAPH_MODES, DTYPES, calculator_terms, compiled_activations, device_terms,
                              recomputation)
from analysis.kernels import KERNEL_TIME_PREFIX
from analysis.overlap import RANK_PROFILES, SPLIT_KEYS
from analysis.records import Record, read_records
from analysis.training import TRAIN_SUITE
from parallelism_calc.cli import ArgumentParser, error_boundary
from parallelism_calc.memory import (CUDA_LIBRARY_WORKSPACES, MemoryBreakdown, get_precision, mesh_memory_strategy,
                                     per_device_memory)
from parallelism_calc.roofline import Ceilings, step_time_floor
from parallelism_calc.specs import ModelSpec

MEMORY_BOUND, TIME_BOUND = 0.05, 0.25  # the bounds the summary counts rows within
CEILINGS_SUITE = "ceilings"
SIDE_BY_SIDE_SUITE = "side_by_side"  # scripts/gpu_side_by_side.sh's records (--suite side_by_side)
PREDICTED_MEMORY = ("predicted_peak_bytes", "predicted_memory_bytes")  # what the benchmarks call their prediction
# The DDP benchmark's wrappers whose gradient hooks kept their model alive after their configuration, until fc529ad
# (notes/data_parallel.md, finding 2; tests/test_ddp.py::test_a_dropped_wrapper_frees_its_model_and_buckets): the
# later configurations of the same launch ran beside their weights and their buckets (individual: the last step's
# gradients it held). Records before 5a320bd have no per_rank_allocated_before_bytes to say how much.
LEAKING_WRAPPERS = ("individual", "bucketed", "zero1")
# The kernel torch's default SDPA (``--attention sdpa``) ran in bf16 on the H100 with torch 2.11: cuDNN's sm90 kernels
# (results/profiles/single_gpu/xl_4x512_train_step_bf16_kernels.md), timed by the attention benchmark as sdpa_cudnn.
SDPA_DEFAULT_KERNEL = "sdpa_cudnn"
LEFTOVER_MIN_BYTES = 2**30  # a leftover smaller than this (NCCL's buffers) is not added
# What bucketed DDP on the copy engines held beyond its buckets, not in the calculator: the peers' slices it pulled,
# allocated as the host launched each bucket ahead of the GPU (1.3-3.1 GB at xl on 2 H200s from 5940089); since
# 4c4c37f the peers push into the buckets themselves and nothing is held (the records do not say which they ran)
COPY_ENGINE_STAGING = ("copy engines before 4c4c37f: the pulled slices held while the host ran ahead are not "
                       "modelled (notes/data_parallel.md, sessions 35, 37)")
# DDPIndividualParameters kept the last step's gradients until the next backward (7.4 GiB through xl's forward in
# bf16) until cf49b57, which let go of them; not in the calculator, and not told apart by the records either
INDIVIDUAL_HELD_GRADIENTS = ("individual before cf49b57: the last step's gradients, held until the next backward, "
                             "are not modelled (notes/data_parallel.md, item 4)")
# What a peak measured around CUDA graph pools was: the allocator's reserved bytes, or (before the records said which,
# peak_memory_kind) the bytes allocated outside the pool, where the blocks' activations live
RESERVED_PEAK = "measured: reserved (CUDA graph pool), not allocated"
OUTSIDE_POOL_PEAK = "measured: allocated outside the CUDA graph pool (recorded before peak_memory_kind)"


@dataclass
class Row:
    """One step record against its predictions; ``why`` says what could not be predicted."""

    record: Record
    floor_ms: float | None = None
    comm_floor_ms: float | None = None
    predicted_memory: float | None = None
    attention_flops: float | None = None  # the attention kernel's measured rate the floor used (attention_rate)
    attention_at_matmul_ms: float = 0.0  # without one: the attention core's time in the floor, at the matmul rate
    attention_kernel_at_matmul_ms: float = 0.0  # and a fused kernel's FLOPs for it (``attention_flops``) at that rate
    products_floor_ms: float = 0.0  # the floor's matrix products and attention kernels (the rest: its bytes, comm)
    memory_model: str = ""  # how predicted_memory was made (see memory_prediction)
    why: str = ""
    time_why: str = ""  # why the time is beyond TIME_BOUND of the floor, where the records say (explain_times, ...)
    memory_why: str = ""  # why the memory is beyond MEMORY_BOUND of the prediction, where known (explain_memory, ...)
    # the kinds ("time", "memory") whose why quotes other runs of the step (explain_code_changes,
    # explain_across_commits): no evidence for a third run
    borrowed: set[str] = field(default_factory=set)

    @property
    def time_error(self) -> float | None:
        return self.floor_ms / self.record.median_ms - 1 if self.floor_ms and self.record.median_ms else None

    @property
    def memory_error(self) -> float | None:
        measured = self.record.peak_memory_bytes
        return self.predicted_memory / measured - 1 if self.predicted_memory and measured else None


def device_ceilings(records: list[Record]) -> dict[str, dict[str, float]]:
    """{device name: {"bf16" | "fp32": matmul FLOP/s, "copy": bytes/s}} from the ceilings records (the latest of
    each wins)."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r.suite != CEILINGS_SUITE or r.status != "ok":
            continue
        entry = out.setdefault(r.provenance.get("device_name", "?"), {})
        if r.tflops:
            entry[r.dtype] = r.tflops * 1e12
        elif r.metrics.get("bytes_per_s"):
            entry["copy"] = r.metrics["bytes_per_s"]
    return out


def bus_bandwidths(records: list[Record]) -> dict[tuple[str, int], float]:
    """{(device name, world size): bytes/s} of the largest NCCL all-reduce recorded (``torch_impl.bench.allreduce``)."""
    best: dict[tuple[str, int], tuple[int, float]] = {}
    for r in records:
        if r.suite == ALLREDUCE_SUITE and r.status == "ok" and r.metrics.get("comm_backend") == "nccl":
            key = (r.provenance.get("device_name", "?"), r.world_size)
            size = r.metrics.get("bytes", 0)
            if size >= best.get(key, (-1, 0.0))[0]:
                best[key] = (size, r.metrics["busbw_gbps"] * 1e9)
    return {key: busbw for key, (_, busbw) in best.items()}


def attention_rates(records: list[Record]) -> dict[tuple[str, str, int], dict[int, float]]:
    """{(device name, kernel, head dim): {sequence length: FLOP/s}} of the attention benchmark's causal bf16
    forward-and-backward records (``torch_impl.bench.attention``; the last record of a shape wins)."""
    rates: dict[tuple[str, str, int], dict[int, float]] = {}
    for r in records:
        if (r.suite == ATTENTION_SUITE and r.mode == "forward_backward" and r.status == "ok" and r.tflops
                and r.dtype == "bf16" and r.metrics.get("causal") and r.metrics.get("head_dim")):
            key = (r.provenance.get("device_name", "?"), r.implementation, r.metrics["head_dim"])
            rates.setdefault(key, {})[r.seq_len] = r.tflops * 1e12
    return rates


def slowest_attention_share(records: list[Record], ceilings: dict[str, dict[str, float]]) -> float | None:
    """The slowest measured attention rate as a share of its device's bf16 matmul rate (``attention_rates``' records,
    any kernel and shape): how slow an attention the floors without a measured rate could be missing."""
    shares = [r.tflops * 1e12 / ceilings[device]["bf16"] for r in records
              if r.suite == ATTENTION_SUITE and r.mode == "forward_backward" and r.status == "ok" and r.tflops
              and r.dtype == "bf16" and r.metrics.get("causal")
              and "bf16" in ceilings.get(device := r.provenance.get("device_name", "?"), {})]
    return min(shares, default=None)


def attention_rate(record: Record, spec: ModelSpec, rates: dict[tuple[str, str, int], dict[int, float]]
                   ) -> float | None:
    """The measured rate of a torch bf16 step's attention kernel (``attention_of``; the default SDPA's:
    ``SDPA_DEFAULT_KERNEL``) on its device at its head dim, at the measured sequence length nearest the step's (on a
    log scale); None where there is none (JAX records, fp32 steps, kernels the attention benchmark does not time,
    devices it did not run on)."""
    if record.backend != "torch" or record.dtype == "fp32" or not spec.n_heads:
        return None
    attention = attention_of(record)
    kernel = SDPA_DEFAULT_KERNEL if attention == "sdpa" else attention
    measured = rates.get((record.provenance.get("device_name", "?"), kernel, spec.d_model // spec.n_heads))
    if not measured:
        return None
    return measured[min(measured, key=lambda n: abs(math.log(n / record.seq_len)))]


def data_parallel(record: Record) -> tuple[str, int, int]:
    """(strategy as ``roofline`` models it, ranks, sequences per rank). JAX runs one program over a mesh whose
    batch is global, as the leaderboard benchmark's (its ``metrics.batch_per_rank`` says so); the other torch
    benchmarks' batch is per rank. A tensor-parallel axis is not modeled."""
    mesh = record.mesh or {}
    if mesh.get("tp", 1) > 1:
        raise ValueError("tensor parallelism: the floor does not model its communication")
    ranks = record.world_size
    sharded = mesh.get("fsdp", 1) > 1 or record.metrics.get("strategy") in ("fsdp", "zero3")
    strategy = "none" if ranks == 1 else "fsdp" if sharded else "ddp"
    batch = record.metrics.get("batch_per_rank") or (
        record.batch_size // ranks if record.backend == "jax" else record.batch_size)
    return strategy, ranks, batch


def strategy_of(record: Record) -> str:
    """How a run spread its step, as its benchmark names it: the DDP benchmark's ``metrics.impl``, the trainer's and
    the leaderboard's ``metrics.dist``, JAX's ``metrics.strategy`` (its mesh's); "none" on one device otherwise."""
    m = record.metrics
    return str(m.get("impl") or m.get("dist") or m.get("strategy") or "none")


def attention_of(record: Record) -> str:
    """The attention backend a record ran: ``metrics.attention``, else the implementation's name
    ('compiled sdpa_cudnn, cuda graph' -> 'sdpa_cudnn'; 'stock eager sdpa' -> 'sdpa'; JAX's 'jit naive fsdp' ->
    'naive')."""
    if record.metrics.get("attention"):
        return record.metrics["attention"]
    words = record.implementation.removeprefix("stock ").split(",")[0].split()
    if record.backend == "jax":
        return words[1] if len(words) > 1 and words[0] == "jit" else words[0]
    return words[1] if len(words) > 1 and words[0] in ("eager", "compiled") else words[-1]


def compiled_of(record: Record) -> bool:
    """Whether a torch record's blocks were compiled: ``metrics.compiled`` (the DDP benchmark), else its
    implementation's name ('compiled sdpa_cudnn, cuda graph per block', 'stock compiled sdpa_cudnn')."""
    return bool(record.metrics.get("compiled")) or record.implementation.removeprefix("stock ").startswith("compiled")


# When our model's RMSNorm became ``F.rms_norm``'s fused kernel (9e6f324): before, the norm written out kept its
# normalized value too (``per_device_memory``'s fused_norm=False; the e2e small-model records of f56be06: -4.6 ...
# -11.2% with the fused count, -0.2 ... -3.0% with this)
FUSED_RMS_NORM = "2026-11-23T10:27:47+00:00"
# When q, k and v became one product (767b604, torch_impl.qkv_projection): before, under autocast each of the three
# kept its own bf16 copy of the norm's output (``per_device_memory``'s qkv_product=False)
QKV_PRODUCT = "2026-11-28T09:37:58+00:00"


def memory_breakdown(record: Record) -> tuple[MemoryBreakdown | None, str]:
    """The calculator's per-device peak for a step record (``parallelism_calc.memory.per_device_memory``'s
    ``MemoryBreakdown``, recomputed from the record's configuration) and how it was made:

    * PyTorch on one device (``torch_impl.bench.e2e``, the DDP benchmark's one-GPU baseline, the trainer):
      ``peak_model="timeline"`` with the record's precision, attention, checkpointing (``metrics.checkpoint_every``,
      ``nested_checkpoint``) and micro-batches (``grad_accum``), the e2e benchmark's compiled plain loss
      (``compiled_loss``) and our RMSNorm and q, k, v products as the model had them then (``FUSED_RMS_NORM``,
      ``QKV_PRODUCT``; the stock model's three products) -> "timeline";
    * the leaderboard step (``torch_impl.bench.leaderboard``, any number of ranks): its call,
      ``analysis.data_parallel.sharded_step_memory`` -> "timeline";
    * PyTorch over several ranks (``torch_impl.bench.ddp``, the trainer): the DDP benchmark's call
      (``analysis.data_parallel.memory_terms``) for its implementation (the trainer's ``metrics.dist``): the peak in
      the step with the DDP family's gradient buckets or the FSDPs' gathered window and reduce-scatter buffers ->
      "timeline";
    * JAX (``jax_impl.bench.e2e``, the trainer): that benchmark's call, the mesh strategy and the remat policy ->
      "sum";

    (None, why not) where the calculator refuses the configuration or the record lacks what it needs.
    """
    m = record.metrics
    try:
        spec = ModelSpec(**record.model_dims)
        seq = record.seq_len
        if record.backend == "torch":
            precision, attention = calculator_terms(record.dtype, attention_of(record))
            compiled = compiled_activations(compiled_of(record), attention, m.get("checkpoint_every"))
            label = ", compiled" if compiled else ""
            if record.suite == LEADERBOARD_SUITE:  # the global batch over our FSDP's or FSDP2's ranks
                return sharded_step_memory(spec, m["dist"], record.world_size, record.batch_size * seq, seq,
                                           precision, attention, m.get("checkpoint_every"),
                                           bool(m.get("nested_checkpoint")), m["loss"],
                                           bool(m.get("keep_attention"))), "timeline"
            # a GPU's record, a step of grad_accum micro-batches (the trainer's; the batch is one micro-batch); our
            # RMSNorm written out before FUSED_RMS_NORM
            step_terms = dict(attention=attention, compiled=compiled, grad_accum=int(m.get("grad_accum") or 1),
                              **device_terms("cuda"))
            if "" < _run_date(record) < FUSED_RMS_NORM and not record.implementation.startswith("stock"):
                step_terms["fused_norm"] = False
            if record.implementation.startswith("stock") or "" < _run_date(record) < QKV_PRODUCT:
                step_terms["qkv_product"] = False  # the stock model's three products, or ours before 767b604
            if record.world_size == 1:
                # the e2e benchmark compiles our plain loss with --compile (the stock model's, the DDP benchmark's
                # and the trainer's run eagerly)
                loss, stock = m.get("loss", "plain"), record.implementation.startswith("stock")
                compiled_loss = (compiled_of(record) and not stock and record.suite not in (DDP_SUITE, TRAIN_SUITE)
                                 and loss == "plain")
                pred = per_device_memory(spec, "ddp", 1, record.batch_size * seq, seq, precision, peak_model="timeline",
                                         checkpoint_every=m.get("checkpoint_every"),
                                         nested_checkpoint=bool(m.get("nested_checkpoint")), loss=loss,
                                         compiled_loss=compiled_loss, **step_terms)
                return pred, "timeline" + label
            n, impl = record.world_size, m.get("impl") or m["dist"]  # the batch is per rank (a micro-batch)
            terms = memory_terms(impl, get_precision(precision).grad_bytes, m.get("comm_dtype", "grad"), n_devices=n)
            pred = per_device_memory(spec, m.get("strategy") or calculator_strategy(impl), n,
                                     n * record.batch_size * seq, seq, precision, **step_terms, **terms)
            return pred, terms.get("peak_model", "sum") + label
        if record.backend == "jax":
            precision, attention = calculator_terms(record.dtype, m["attention"])
            mesh = record.mesh or {}
            strategy, parallel = mesh_memory_strategy(m["strategy"], *(mesh.get(a, 1) for a in ("dp", "fsdp", "tp")))
            return per_device_memory(spec, strategy, parallel, record.batch_size * seq, seq, precision,
                                     checkpointing=m.get("remat", "none"), attention=attention,
                                     fused_norm=False, qkv_product=False), "sum"  # jax_impl's RMSNorm is written
            # out (keeps x / rms); its q, k and v are three products
    except KeyError as err:
        return None, f"not predicted: the record has no {err}"
    except (ValueError, TypeError) as err:
        return None, f"not predicted: {err}"
    return None, f"not predicted: the calculator has no model of a {record.backend} step"


def memory_prediction(record: Record) -> tuple[float | None, str]:
    """(predicted peak bytes per device, how it was made) for a step record with a measured peak:
    ``memory_breakdown``'s total, else what its benchmark predicted at run time -> "stored at run time", else
    (None, why not); (None, "") without a measured peak."""
    if not record.peak_memory_bytes:
        return None, ""
    breakdown, model = memory_breakdown(record)
    stored = next((record.metrics[k] for k in PREDICTED_MEMORY if record.metrics.get(k)), None)
    if breakdown is None and stored is not None:
        return stored, "stored at run time"
    return (breakdown.total if breakdown is not None else None), model


def leftover_bytes(records: list[Record]) -> dict[int, tuple[float, str]]:
    """{id(record): (bytes, why)} for the DDP benchmark's records that ran beside memory an earlier configuration
    of the same launch left allocated: read from ``per_rank_allocated_before_bytes`` (the worst rank) where the
    record has it, else estimated for records of a launch (same commit, command and host, in the order written)
    that ran after a ``LEAKING_WRAPPERS`` configuration: its weights (P x param bytes) and its buckets (P x the
    bytes ``memory_terms`` gives it) or, for ``individual``, its last gradients (P x grad bytes), each such
    configuration's. Leftovers under ``LEFTOVER_MIN_BYTES`` are left out."""
    out: dict[int, tuple[float, str]] = {}
    leaked: dict[tuple, list[tuple[str, float]]] = {}
    for r in records:
        if r.suite != DDP_SUITE or r.backend != "torch" or not r.model_dims:
            continue
        m, prov = r.metrics, r.provenance
        launch = (prov.get("git_commit"), prov.get("command"), prov.get("hostname"), prov.get("device_name"))
        # measured: less cuBLAS's workspaces, which an earlier configuration's first matmul made and the prediction
        # counts already
        before = [b - CUDA_LIBRARY_WORKSPACES for b in m.get("per_rank_allocated_before_bytes") or [] if b is not None]
        if before:
            if max(before) >= LEFTOVER_MIN_BYTES:
                out[id(r)] = (float(max(before)), "measured before the configuration (per_rank_allocated_before_bytes)")
            continue
        if "per_rank_allocated_before_bytes" in m:
            continue
        earlier = leaked.get(launch, [])
        total = sum(b for _, b in earlier)
        if r.status == "ok" and total >= LEFTOVER_MIN_BYTES:
            names = ", ".join(name for name, _ in earlier)
            out[id(r)] = (total, f"estimated: {names} earlier in the launch, before the leak fix (fc529ad), kept "
                                 "its weights and buckets")
        if m.get("impl") in LEAKING_WRAPPERS and r.world_size > 1:
            try:
                n = ModelSpec(**r.model_dims).n_params()
                prec = get_precision(calculator_terms(r.dtype, "flash")[0])
            except (ValueError, KeyError, TypeError):
                continue
            held = (prec.grad_bytes if m["impl"] == "individual" else
                    memory_terms(m["impl"], prec.grad_bytes, m.get("comm_dtype", "grad"),
                                 n_devices=r.world_size)["gradient_buckets"])
            leaked.setdefault(launch, []).append((m["impl"], float(n * (prec.param_bytes + held))))
    return out


def predict(record: Record, ceilings: dict[str, dict[str, float]], buses: dict[tuple[str, int], float],
            leftover: tuple[float, str] | None = None,
            attention: dict[tuple[str, str, int], dict[int, float]] | None = None) -> Row:
    """One row; ``leftover`` (``leftover_bytes``): memory an earlier configuration of the launch left allocated,
    added to the prediction and named in the row's memory model; ``attention``: the measured attention kernels'
    rates (``attention_rates``)."""
    predicted, model = memory_prediction(record)
    if predicted is not None and leftover is not None:
        predicted += leftover[0]
        model += f"; + {leftover[0] / 2**30:.2f} GiB left allocated ({leftover[1]})"
    graph_blocks = _graphs(record) == "blocks"
    if predicted is not None and record.metrics.get("engine") == "copy_engines" and \
            record.metrics.get("impl") == "bucketed":
        model += f"; {COPY_ENGINE_STAGING}"
    if predicted is not None and record.suite == DDP_SUITE and record.metrics.get("impl") == "individual":
        model += f"; {INDIVIDUAL_HELD_GRADIENTS}"
    if predicted is not None and record.metrics.get("peak_memory_kind") == "reserved":
        model += f"; {RESERVED_PEAK}"
    elif predicted is not None and graph_blocks and not record.metrics.get("peak_memory_kind"):
        model += f"; {OUTSIDE_POOL_PEAK}"
    row = Row(record, predicted_memory=predicted, memory_model=model)
    device = record.provenance.get("device_name", "?")
    compute_dtype = "fp32" if record.dtype == "fp32" else "bf16"
    measured = ceilings.get(device, {})
    if compute_dtype not in measured or "copy" not in measured:
        row.why = f"no measured ceilings for {device} ({compute_dtype} matmul, copy) among the records"
        return row
    try:
        strategy, ranks, batch = data_parallel(record)
        bus = buses.get((device, ranks)) if ranks > 1 else None
        if ranks > 1 and bus is None:
            raise ValueError(f"no NCCL all-reduce recorded over {ranks} x {device}")
        spec = ModelSpec(**record.model_dims)
        m = record.metrics
        batch *= int(m.get("grad_accum") or 1)  # the trainer's step: A micro-batches, one update
        row.attention_flops = attention_rate(record, spec, attention or {})
        recomputed = recomputation(m.get("checkpoint_every"), m.get("nested_checkpoint"), m.get("keep_attention"),
                                   m.get("loss"), m.get("remat"))
        floor = step_time_floor(spec, batch, record.seq_len, record.mode, DTYPES[record.dtype],
                                Ceilings(measured[compute_dtype], measured["copy"], bus, row.attention_flops),
                                strategy, ranks, **recomputed)
    except (ValueError, KeyError, TypeError) as err:
        row.why = str(err)
        return row
    row.floor_ms, row.comm_floor_ms = floor.total_s * 1e3, floor.comm_s * 1e3
    row.products_floor_ms = (floor.matmul_s + floor.attention_s) * 1e3
    if row.attention_flops is None and spec.arch == "transformer":
        # the same floor with an attention kernel at the matmul rate: its products without the core, and the
        # kernel's own FLOPs (FlashAttention's backward recomputes the scores) at that rate
        rate = measured[compute_dtype]
        kernel = step_time_floor(spec, batch, record.seq_len, record.mode, DTYPES[record.dtype],
                                 Ceilings(rate, measured["copy"], bus, rate), strategy, ranks, **recomputed)
        row.attention_at_matmul_ms = (floor.matmul_s - kernel.matmul_s) * 1e3
        row.attention_kernel_at_matmul_ms = kernel.attention_s * 1e3
    return row


def is_step(record: Record) -> bool:
    """A measured whole training step on a GPU with a model spec."""
    return (record.mode == "train_step" and record.status == "ok" and bool(record.median_ms)
            and bool(record.model_dims) and record.provenance.get("device_name", "cpu") != "cpu")


def fidelity_rows(records: list[Record], profiles: list[Record] = ()) -> list[Row]:
    """A ``Row`` per GPU step record (``is_step``), predicted (``predict``), then its whys in order: each row's own
    records (``explain_times``), the kernels of its program's profile (``explain_kernels``; ``profiles``: profiled
    records that are evidence, not rows, ``profile_records``), a data-parallel step against the one-GPU step of its
    launch (``explain_ranks``), the e2e benchmark's same step for a trainer row
    (``explain_trainer``), known memory gaps (``explain_memory``), the run's later epochs for a trainer's first
    (``explain_first_epoch``), changes of our code it ran before (``explain_code_changes``), then the same step at
    another commit (``explain_across_commits``)."""
    ceilings, buses, leftovers = device_ceilings(records), bus_bandwidths(records), leftover_bytes(records)
    attention = attention_rates(records)
    rows = [predict(r, ceilings, buses, leftovers.get(id(r)), attention) for r in records if is_step(r)]
    explain_times(rows, slowest_attention_share(records, ceilings))
    explain_kernels(rows, profiles)
    explain_ranks(rows)
    explain_trainer(rows)
    explain_memory(rows)
    explain_first_epoch(rows)
    explain_code_changes(rows)
    explain_across_commits(rows)
    return rows


def _graphs(record: Record) -> str:
    """Which CUDA graphs a torch record's step replayed: ``metrics.cuda_graph`` ("off" before the metric existed),
    else the e2e benchmark's implementation name (``CUDA_GRAPH_MODES``: "..., cuda graph per block": blocks;
    "..., cuda graph": step)."""
    if record.metrics.get("cuda_graph"):
        return record.metrics["cuda_graph"]
    parts = record.implementation.split(", ")[1:]  # the graphs' part may come before others (", fused loss")
    return next((mode for mode, name in CUDA_GRAPH_MODES.items() if name and name.removeprefix(", ") in parts), "off")


def _implementation(record: Record) -> str:
    """A record's implementation less what its CUDA graphs add to the name (``_graphs`` says which it replayed)."""
    graphs = CUDA_GRAPH_MODES[_graphs(record)].removeprefix(", ")
    first, *rest = record.implementation.split(", ")
    return ", ".join([first, *(part for part in rest if part != graphs)])


def _benchmark(record: Record) -> str:
    """The benchmark whose step a record times: its suite, the e2e benchmark's for its sweep's records."""
    return "e2e" if record.suite == "e2e_sweep" else record.suite


def _step(record: Record, kind: str) -> tuple:
    """The step a record times, whichever commit ran it: its benchmark (``_benchmark``) and setup (``_setup``), its
    tokens, micro-batches and CUDA graphs; for ``kind`` "memory" also the kind of peak it read (allocated or
    reserved)."""
    r = record
    return (*_setup(r, _benchmark(r)), r.batch_size, r.seq_len, r.metrics.get("grad_accum") or 1, _graphs(r),
            r.metrics.get("peak_memory_kind") if kind == "memory" else "")


# (kind, its bound, what the bound is of): the two measurements a row is held to
KINDS = (("time", TIME_BOUND, "floor"), ("memory", MEMORY_BOUND, "prediction"))


def _error(row: Row, kind: str) -> float | None:
    return getattr(row, f"{kind}_error")


def _why(row: Row, kind: str) -> str:
    return getattr(row, f"{kind}_why")


def _own_why(row: Row, kind: str) -> str:
    """``row``'s why where its own records (or its siblings') give it, not one quoting the same step's other runs."""
    return "" if kind in row.borrowed else _why(row, kind)


def _borrow(rows: list[Row], kind: str, found: dict[int, str]) -> None:
    """Set each row's ``kind`` why found in another run of its step (``found``: by ``id``)."""
    for row in rows:
        if id(row) in found:
            setattr(row, f"{kind}_why", found[id(row)])
            row.borrowed.add(kind)


def _unexplained(row: Row, kind: str, bound: float) -> bool:
    """Beyond ``bound`` of its floor (prediction), with no why yet."""
    error = _error(row, kind)
    return error is not None and abs(error) > bound and not _why(row, kind)


def _run_date(record: Record) -> str:
    """When a record was made (ISO 8601, UTC, as ``analysis.records`` writes it); "" where it does not say."""
    return record.provenance.get("date") or ""


def _date(row: Row) -> str:
    return _run_date(row.record)


def _commit_of(record: Record) -> str:
    """A record's commit as its first 7 characters (records name it by 7 or by 40)."""
    return (record.provenance.get("git_commit") or "?")[:7]


def _commit(row: Row) -> str:
    return _commit_of(row.record)


def _same_steps(rows: list[Row], kind: str) -> dict[tuple, list[Row]]:
    """The rows by the step they time (``_step``), whichever commit ran them."""
    same: dict[tuple, list[Row]] = {}
    for row in rows:
        same.setdefault(_step(row.record, kind), []).append(row)
    return same


def _measured(row: Row, kind: str) -> str:
    """What ``row`` measured, as a why quotes it: "takes X ms" (time) or "peaks at X GiB" (memory)."""
    r = row.record
    return f"takes {r.median_ms:.1f} ms" if kind == "time" else f"peaks at {r.peak_memory_bytes / 2**30:.1f} GiB"


def _comparable(row: Row, other: Row, kind: str) -> bool:
    """Whether ``other``'s measurement is within ``kind``'s bound of ``row``'s: evidence about a run like this one."""
    bound = TIME_BOUND if kind == "time" else MEMORY_BOUND
    a, b = ((row.record.median_ms, other.record.median_ms) if kind == "time"
            else (row.record.peak_memory_bytes, other.record.peak_memory_bytes))
    return bool(a and b) and abs(b / a - 1) <= bound


@dataclass(frozen=True)
class CodeChange:
    """A change of our code, landed at ``date`` (its commit's, ISO 8601), that moved the steps it ``touches``: what
    it changed, with where it was measured."""

    commit: str
    date: str
    what: str
    touches: Callable[[Record], bool]


# When our model's blocks began to be compiled one region each (1f645a5; before, the whole model at once)
REGIONAL_COMPILATION = "2026-11-23T09:37:07+00:00"


def _ours_in_regions(record: Record) -> bool:
    """Our torch model compiled region by region, not replayed as one whole-step CUDA graph."""
    return (record.backend == "torch" and compiled_of(record) and not record.implementation.startswith("stock")
            and _run_date(record) >= REGIONAL_COMPILATION and _graphs(record) != "step")


# The changes of our code that moved a step some committed record ran before them, in the order they landed
CODE_CHANGES = (
    CodeChange("a0bf3a0", "2026-11-23T21:06:08+00:00", "the gradients clipped in multi-tensor launches, not one to "
               "three a gradient: notes/train_step.md, session 8",
               lambda r: r.suite == TRAIN_SUITE and r.backend == "torch" and bool(r.metrics.get("grad_clip"))),
    CodeChange("d67f943", "2026-11-23T23:54:19+00:00", "4 blocks a compiled region, not one: ~0.2 ms of host a region "
               "entered, notes/train_step.md, session 9", _ours_in_regions),
    CodeChange("e9bb371", "2026-11-24T15:10:10+00:00", "the embedding's gradient summed in float32 "
               "(jax_impl.model.lookup): with bf16 weights XLA's scatter-add of the trainer's text, its ids on few "
               "rows, serialized and took 13.8 ms of a 30.6 ms step at small 8 x 512 (notes/jax.md, session 12)",
               lambda r: r.backend == "jax" and r.suite == TRAIN_SUITE and r.dtype == "bf16_mixed"),
    CodeChange("fc529ad", "2026-11-25T16:56:36+00:00", "torch DDP's compiled regions no longer split at its buckets "
               "by Dynamo's DDPOptimizer: 331.6 -> 173.8 ms (notes/data_parallel.md, finding 3) and 50.9 -> 47.2 GiB "
               "at xl 4 x 1,024 on 2 H100s (results/ddp_overlap_2xh100_{5a320bd,fc529ad}.jsonl)",
               lambda r: r.backend == "torch" and r.metrics.get("impl") == "torch_ddp" and compiled_of(r)),
)


def explain_first_epoch(rows: list[Row]) -> None:
    """Set ``memory_why`` of every trainer row of a run's first epoch still beyond ``MEMORY_BOUND`` without one whose
    run (its step, ``_step``, attention and ``metrics.run``, by the same command at the same commit) has later
    epochs, each within the bound: their peaks, and how much more the first epoch held (what its start held is not
    in the calculator's step)."""
    runs: dict[tuple, list[Row]] = {}
    for row in rows:
        r = row.record
        if r.suite == TRAIN_SUITE and row.memory_error is not None:
            runs.setdefault((_step(r, "memory"), attention_of(r), r.metrics.get("run"), _commit(row),
                             r.provenance.get("command")), []).append(row)
    for run in runs.values():
        later = [s for s in run if (s.record.metrics.get("epoch") or 1) > 1]
        for row in run:
            if ((row.record.metrics.get("epoch") or 1) == 1 and later and _unexplained(row, "memory", MEMORY_BOUND)
                    and all(abs(s.memory_error) <= MEMORY_BOUND for s in later)):
                peaks = sorted(s.record.peak_memory_bytes / 2**30 for s in later)
                row.memory_why = (f"the run's first epoch: its {len(later)} later epochs peak at "
                                  f"{peaks[0]:.2f}-{peaks[-1]:.2f} GiB, within {MEMORY_BOUND:.0%} of the prediction; "
                                  f"this one {row.record.peak_memory_bytes / 2**30 - peaks[-1]:.2f} GiB more")


def explain_code_changes(rows: list[Row]) -> None:
    """Set ``time_why`` (``memory_why``) of every row still beyond ``TIME_BOUND`` (``MEMORY_BOUND``) without one that
    ran before changes of ``CODE_CHANGES`` that touch its step, where the same step (``_step``) ran after them all,
    nearer its floor (prediction) than this row and within the bound or explained by its own records there: those
    changes, and that run (the first after them, the nearest to the changes in the code it ran). Runs before
    ``explain_across_commits``, whose whys it does not read."""
    for kind, bound, against in KINDS:
        same, found = _same_steps(rows, kind), {}
        for row in rows:
            changes = [c for c in CODE_CHANGES if _date(row) < c.date and c.touches(row.record)]
            if not _unexplained(row, kind, bound) or not changes or not _date(row):
                continue
            after = [s for s in same[_step(row.record, kind)] if _date(s) > changes[-1].date
                     and _error(s, kind) is not None and abs(_error(s, kind)) < abs(_error(row, kind))
                     and (abs(_error(s, kind)) <= bound or _own_why(s, kind))]
            if after:
                s = min(after, key=_date)
                found[id(row)] = (f"run before {'; '.join(f'{c.commit} ({c.what})' for c in changes)}. Since, the "
                                  f"same step {_measured(s, kind)} at {_commit(s)}: "
                                  f"{_own_why(s, kind) or f'within {bound:.0%} of the {against}'}")
        _borrow(rows, kind, found)


def explain_across_commits(rows: list[Row]) -> None:
    """Set ``time_why`` (``memory_why``) of every row still beyond ``TIME_BOUND`` (``MEMORY_BOUND``) without one
    where the same step (``_step``) ran at another commit and measured within the bound of this row
    (``_comparable``): within the floor's (prediction's) bound there, that is said, naming the latest such commit;
    else explained there, that why, named with its commit. A step measured further off is no evidence for this row.
    Runs after the other rules; a why found here is never evidence for another row."""
    for kind, bound, against in KINDS:
        same, found = _same_steps(rows, kind), {}
        for row in rows:
            if not _unexplained(row, kind, bound):
                continue
            others = sorted((s for s in same[_step(row.record, kind)] if _commit(s) != _commit(row)
                             and _error(s, kind) is not None and _comparable(row, s, kind)), key=_date)
            within = [s for s in others if abs(_error(s, kind)) <= bound]
            explained = [s for s in others if _own_why(s, kind)]
            if within:
                s = within[-1]
                found[id(row)] = (f"at {_commit(s)} the same step {_measured(s, kind)}, within {bound:.0%} of the "
                                  f"{against}")
            elif explained:
                s = explained[-1]
                found[id(row)] = f"{_own_why(s, kind)} (so measured at {_commit(s)})"
        _borrow(rows, kind, found)


def _benchmark_step(record: Record) -> tuple:
    """What a trainer's epoch record and an e2e benchmark record of the same step share (one micro-batch a step):
    backend, model, dtype, tokens, devices, device, attention kernel, compilation and CUDA graphs."""
    return (record.backend, record.model, record.dtype, record.batch_size, record.seq_len, record.world_size,
            record.provenance.get("device_name"), attention_of(record), compiled_of(record), _graphs(record))


def _from_e2e_benchmark(record: Record) -> bool:
    """Timed by an e2e benchmark: torch's (suites e2e and e2e_sweep) or JAX's (whatever its suite)."""
    command = record.provenance.get("command") or ""
    return _benchmark(record) == "e2e" or record.backend == "jax" and (
        "jax_impl/bench/e2e" in command or "jax_impl.bench.e2e" in command)


def explain_trainer(rows: list[Row]) -> None:
    """Set ``time_why`` of every trainer row (one micro-batch a step) still beyond ``TIME_BOUND`` without one whose
    step an e2e benchmark ran too (``_from_e2e_benchmark``, ``_benchmark_step``, our model, at any commit: the
    latest), within the bound or explained there by its own records, and no slower than the trainer's by more than
    the bound: that why, and what the trainer's loop around the step adds where it is slower (its data on the host,
    the loss read every step, the clipping). Runs after ``explain_times`` and ``explain_kernels``, whose whys it
    quotes."""
    steps: dict[tuple, list[Row]] = {}
    for row in rows:
        r = row.record
        if (_from_e2e_benchmark(r) and not r.implementation.startswith("stock")
                and row.time_error is not None and (abs(row.time_error) <= TIME_BOUND or _own_why(row, "time"))):
            steps.setdefault(_benchmark_step(r), []).append(row)
    for row in rows:
        r = row.record
        if (r.suite != TRAIN_SUITE or (r.metrics.get("grad_accum") or 1) != 1
                or row.time_error is None or abs(row.time_error) <= TIME_BOUND or row.time_why):
            continue
        candidates = [s for s in steps.get(_benchmark_step(r), [])
                      if s.record.median_ms <= (1 + TIME_BOUND) * r.median_ms]
        if not candidates:
            continue
        step = max(candidates, key=lambda s: s.record.provenance.get("date", ""))
        extra, data = r.median_ms - step.record.median_ms, _phase_medians(r).get("data")
        loop = (f"the trainer's loop adds {extra:.1f} ms a step{f' (data on the host {data:.1f})' if data else ''} "
                "to " if extra > 0 else "as ")
        changes = [c for c in CODE_CHANGES if _date(row) < c.date and c.touches(r)]  # what the loop held then
        row.time_why = (f"{loop}the e2e benchmark's same step, {step.record.median_ms:.1f} ms at "
                        f"{step.record.provenance.get('git_commit', '?')[:7]}: "
                        f"{_own_why(step, 'time') or f'within {TIME_BOUND:.0%} of the floor'}"
                        + "".join(f"; the trainer ran before {c.commit} ({c.what})" for c in changes))


def explain_memory(rows: list[Row]) -> None:
    """Set ``memory_why`` of every row beyond ``MEMORY_BOUND`` of its prediction that a known gap explains: under
    the measurement, a peak read as the allocator's reserved bytes (a CUDA graph pool's private memory and the
    cache beside the tensors the calculator counts), the copy engines' pulled slices or ``DDPIndividualParameters``'
    held gradients (``COPY_ENGINE_STAGING``, ``INDIVIDUAL_HELD_GRADIENTS``), or XLA's buffer assignment (its
    temporaries and reuse, not modelled); over it, compiled blocks under checkpointing (the calculator counts the
    eager model's saved tensors there: its compiled count was measured without checkpointing); the stock reference
    model (``torch_impl.stock``, another model's code: the calculator counts ours tensor by tensor); and either way
    the measurement's kind where the record names it (reserved bytes under, allocated outside a CUDA graph pool over).
    Under by no more than the plain loss's working buffers (``plain_loss_buffers``), outside the timeline (which
    counts them): those. Others stay ""."""
    for row in rows:
        error, record, model = row.memory_error, row.record, row.memory_model
        if error is None or abs(error) <= MEMORY_BOUND:
            continue
        missing, loss_buffers = record.peak_memory_bytes - row.predicted_memory, plain_loss_buffers(record)
        if error < 0 and RESERVED_PEAK in model:
            row.memory_why = "measured: the allocator's reserved bytes (CUDA graph pool, cache), not tensors"
        elif error > 0 and OUTSIDE_POOL_PEAK in model:
            row.memory_why = "measured: only what was allocated outside the CUDA graph pool, where activations live"
        elif 0 < missing <= loss_buffers and "timeline" not in model:
            row.memory_why = (f"the plain loss's working buffers, up to {loss_buffers / 2**30:.1f} GiB, are not "
                              "counted (notes/leaderboard.md)")
        elif error < 0 and (COPY_ENGINE_STAGING in model or INDIVIDUAL_HELD_GRADIENTS in model):
            row.memory_why = "held buffers the calculator leaves out (memory model)"
        elif record.backend == "jax":
            row.memory_why = "XLA's buffer assignment: its temporaries and reuse are not modelled"
        elif error > 0 and compiled_of(record) and record.metrics.get("checkpoint_every"):
            row.memory_why = "compiled blocks under checkpointing: the eager model's saved tensors are counted"
        elif record.implementation.startswith("stock"):
            row.memory_why = "the stock reference model: the calculator counts our model's saved tensors"


def plain_loss_buffers(record: Record) -> float:
    """Bytes of the plain loss's working buffers on a device at their peak, N V max(p + 4, 8) (the logits in the
    compute dtype and their fp32 copy in the forward, two fp32 N x V tensors in the backward; notes/train_step.md),
    which ``per_device_memory``'s "sum" model leaves out; 0 for a fused loss or a record without a spec."""
    if record.metrics.get("loss") == "fused" or not record.model_dims:
        return 0.0
    try:
        _, _, batch = data_parallel(record)
    except ValueError:
        return 0.0
    p = 4 if record.dtype == "fp32" else 2
    return batch * record.seq_len * ModelSpec(**record.model_dims).vocab_size * max(p + 4, 8)


# A step is paced by its host when a sibling run (the same configuration at the same commit on the same device)
# with at least HOST_PACED_TOKENS x its tokens takes at most HOST_PACED_TIME x its time: the device's work grew,
# the step barely did (notes/fidelity.md, session 33).
HOST_PACED_TOKENS, HOST_PACED_TIME = 2.0, 1.5


def _setup(record: Record, suite: str) -> tuple:
    """How a run was set up, its tokens and CUDA graphs apart: ``suite``, backend, implementation (``_implementation``),
    compilation, model, dtype, mode, ranks and device."""
    return (suite, record.backend, _implementation(record), compiled_of(record), record.model, record.dtype,
            record.mode, record.world_size, record.provenance.get("device_name"))


def _configuration(record: Record) -> tuple:
    """What two runs share to be siblings that differ only in tokens (batch, sequence length)."""
    return (*_setup(record, record.suite), record.provenance.get("git_commit"))


def _fixed_costs(row: Row, sibling: Row, tokens: dict[int, int]) -> tuple[float, float, float] | None:
    """Where ``row`` and a ``sibling`` with more tokens lie on time = fixed + tokens x cost per token, for the
    measured times and for their floors: (measured fixed ms, the floor's fixed ms, the floor's cost per token over
    the measured one); None without more tokens, a floor or a positive measured slope."""
    n, m = tokens[id(row)], tokens[id(sibling)]
    if m <= n or not sibling.floor_ms:
        return None
    slope = (sibling.record.median_ms - row.record.median_ms) / (m - n)
    floor_slope = (sibling.floor_ms - row.floor_ms) / (m - n)
    if slope <= 0:
        return None
    return row.record.median_ms - slope * n, row.floor_ms - floor_slope * n, floor_slope / slope


def explain_times(rows: list[Row], slowest_attention: float | None = None) -> None:
    """Set ``time_why`` of every row beyond ``TIME_BOUND`` of its floor that the records explain, in this order:
    host-paced (a sibling with ``HOST_PACED_TOKENS`` x the tokens in at most ``HOST_PACED_TIME`` x the time);
    host-bound (the same step replayed as CUDA graphs, a sibling with graphs (``_graphs``), in at most
    1 / ``HOST_PACED_TIME`` of the time); an eager torch step (each op a kernel launched by the host, none fused:
    the floor counts a fused step's elementwise bytes); a fixed cost a step (on the line through the row and its
    sibling with the most tokens, time = fixed + tokens x cost per token, the measured fixed part exceeds the
    floor's by at least half the gap while the cost per token is within ``TIME_BOUND`` of the floor's:
    ``_fixed_costs``); the attention at the matmul rate (no measured rate for the record's kernel on its device:
    XLA's, or any on a device the attention benchmark did not run on), where it could make the gap: at
    ``slowest_attention`` of the matmul rate (``slowest_attention_share``) the floor's attention time would grow
    by at least the gap. Others are left to the passes after it (``fidelity_rows``)."""
    tokens = {id(row): row.record.batch_size * row.record.seq_len for row in rows}
    siblings: dict[tuple, list[Row]] = {}
    for row in rows:
        siblings.setdefault(_configuration(row.record), []).append(row)
    for row in rows:
        if row.time_error is None or abs(row.time_error) <= TIME_BOUND:
            continue
        record = row.record
        graph = _graphs(record)
        mine = [s for s in siblings[_configuration(record)] if _graphs(s.record) == graph]
        paced = [s for s in mine if tokens[id(s)] >= HOST_PACED_TOKENS * tokens[id(row)]
                 and s.record.median_ms <= HOST_PACED_TIME * record.median_ms]
        graphed = [] if graph != "off" else [
            s for s in siblings[_configuration(record)] if tokens[id(s)] == tokens[id(row)]
            and _graphs(s.record) != "off" and s.record.median_ms * HOST_PACED_TIME <= record.median_ms]
        most = max(mine, key=lambda s: tokens[id(s)])  # the line of a fixed cost runs to it
        fixed = _fixed_costs(row, most, tokens)
        if paced:
            widest = max(paced, key=lambda s: tokens[id(s)])
            row.time_why = (f"host-paced: {tokens[id(widest)] / tokens[id(row)]:g}x the tokens in "
                            f"{widest.record.median_ms / record.median_ms:.2f}x the time "
                            f"({widest.record.batch_size} x {widest.record.seq_len})")
        elif graphed:
            fastest = min(graphed, key=lambda s: s.record.median_ms)
            row.time_why = (f"host-bound: replayed as CUDA graphs ({_graphs(fastest.record)}), the same "
                            f"step takes {fastest.record.median_ms / record.median_ms:.2f}x the time")
        elif record.backend == "torch" and not compiled_of(record):
            row.time_why = "eager: every op launched by the host, none fused (the floor counts a fused step's bytes)"
        elif (fixed and fixed[0] - fixed[1] >= (record.median_ms - row.floor_ms) / 2
              and abs(fixed[2] - 1) <= TIME_BOUND):
            row.time_why = (f"a fixed cost: {fixed[0]:.0f} ms a step against the floor's {fixed[1]:.0f} (host, "
                            f"launches); per token within {abs(fixed[2] - 1):.0%} of the floor (time = fixed + "
                            f"tokens x cost, with {most.record.batch_size} x {most.record.seq_len})")
        elif slowest_attention and (record.median_ms - row.floor_ms <= row.attention_kernel_at_matmul_ms
                                    / slowest_attention - row.attention_at_matmul_ms):
            row.time_why = (f"attention at the matmul rate: {row.attention_at_matmul_ms:.1f} ms in the floor, no "
                            f"measured rate for {'XLA' if record.backend == 'jax' else attention_of(record)} on "
                            f"{record.provenance.get('device_name', '?')} (a kernel at the slowest measured, "
                            f"{slowest_attention:.0%} of the matmul rate, would take "
                            f"{row.attention_kernel_at_matmul_ms / slowest_attention:.1f})")


PRODUCT_KERNELS = "matmul"  # the category of ``analysis.kernels.CATEGORIES`` holding the GEMMs and attention kernels
PROFILES_FOLDER = "profiles"  # a results folder's profiled runs (``profile_records``)


def kernel_times(record: Record) -> dict[str, float]:
    """{category: GPU ms a step} of a profiled record's kernels (``time_ms.<category>``); {} where not profiled."""
    return {k.removeprefix(KERNEL_TIME_PREFIX): float(v) for k, v in record.metrics.items()
            if k.startswith(KERNEL_TIME_PREFIX) and v is not None}


def is_profiled(record: Record) -> bool:
    """Whether a record holds its step's profile: kernel times (JAX) or each rank's split (the DDP benchmark's
    ``analysis.overlap.RANK_PROFILES``)."""
    return bool(kernel_times(record)) or any(record.metrics.get(RANK_PROFILES) or ())


def profile_records(sources: list) -> list[Record]:
    """The profiled GPU step records (``is_profiled``, ``is_step``) in the ``profiles/`` folder of each folder
    among ``sources``: evidence for ``explain_kernels``, not rows. That folder holds probes' own formats beside
    records: a file that is not records is passed over."""
    found = []
    for source in sources:
        if isinstance(source, (str, Path)) and Path(source).is_dir():
            for path in sorted((Path(source) / PROFILES_FOLDER).glob("*.jsonl")):
                try:
                    found += [r for r in read_records(path) if is_profiled(r) and is_step(r)]
                except ValueError:  # a probe's rows, not records
                    continue
    return found


def _program(record: Record) -> tuple:
    """The program a step record ran, whichever benchmark and commit ran it: ``_step`` less the benchmark, with its
    attention kernel (``attention_of``), whether it clips its gradients (``metrics.grad_clip``) and the
    options a JAX run compiled it under (``metrics.xla_flags``, ``compiler_options``, ``blocks_per_program``)."""
    m = record.metrics
    return (*_step(record, "time")[1:], attention_of(record), m.get("grad_clip"),
            repr(m.get("xla_flags")), repr(m.get("compiler_options")), m.get("blocks_per_program"))


def profile_split(profiled: Record, row: Row) -> tuple[str, dict[str, float], float] | None:
    """Where ``profiled``'s step went against ``row``'s floor: (the terms as a why says them, each term's ms beyond
    its floor, the ms a step the profile accounts for). Kernel times (JAX): the products (GEMMs and attention
    kernels) against the floor's matmul and attention, the other kernels against the rest of the floor, and the
    GPU's idle time. Each rank's split (the DDP benchmark): its compute kernels against the floor less its
    communication, its collectives running alone (a peer's wait inside them included) against the floor's
    communication, and its idle time. The time accounted for: busy (the kernels' union, where recorded: a mesh's
    collectives run beside the other kernels, whose times add up beyond the step) plus idle. None for a record with
    neither."""
    times = kernel_times(profiled)
    if times:
        products = times.get(PRODUCT_KERNELS, 0.0)
        rest = sum(ms for category, ms in times.items() if category != PRODUCT_KERNELS)
        idle = float(profiled.metrics.get("gpu_idle_ms") or 0.0)
        rest_floor = row.floor_ms - row.products_floor_ms
        text = (f"GEMMs and attention {products:.0f} ms against the floor's {row.products_floor_ms:.0f}, the others "
                f"(elementwise, reductions, copies, collectives) {rest:.0f} against its {rest_floor:.0f} (bytes at the "
                f"copy rate, communication)" + (f", GPU idle {idle:.0f}" if idle else ""))
        busy = profiled.metrics.get("gpu_busy_ms")  # the kernels' union: collectives overlap the rest on a mesh
        return text, {"the products": products - row.products_floor_ms, "the other kernels": rest - rest_floor,
                      "the GPU idle (the host's pace)": idle}, (busy or products + rest) + idle
    ranks = [(rank, split) for rank, split in enumerate(profiled.metrics.get(RANK_PROFILES) or ())
             if isinstance(split, dict) and all(isinstance(split.get(k), (int, float)) for k in SPLIT_KEYS)]
    if not ranks:
        return None
    compute_floor, comm_floor = row.floor_ms - (row.comm_floor_ms or 0.0), row.comm_floor_ms or 0.0
    parts, beyond = [], {}
    for rank, split in ranks:
        alone = split["comm_ms"] - split["both_ms"]
        parts.append(f"rank {rank} compute {split['compute_ms']:.0f} ms, collectives alone {alone:.0f}, idle "
                     f"{split['idle_ms']:.0f}")
        beyond.update({f"rank {rank}'s compute": split["compute_ms"] - compute_floor,
                       f"rank {rank}'s collectives": alone - comm_floor,
                       f"the GPU idle on rank {rank} (its host's pace)": split["idle_ms"]})
    covered = max(s["compute_ms"] + s["comm_ms"] - s["both_ms"] + s["idle_ms"] for _, s in ranks)
    span = max(s["span_ms"] for _, s in ranks)
    return (f"{'; '.join(parts)} (the floor: compute {compute_floor:.0f}, communication {comm_floor:.0f}; the "
            f"profiled steps {span:.0f} ms a step)", beyond, covered)


def _slower_than_bound(row: Row) -> bool:
    """Slower than its floor by more than ``TIME_BOUND``, with no why yet (a step faster than its floor points at
    the floor's ceilings, not at where the step's time went)."""
    return _unexplained(row, "time", TIME_BOUND) and row.time_error < 0


def explain_kernels(rows: list[Row], profiles: list[Record] = ()) -> None:
    """Set ``time_why`` of every row still slower than ``TIME_BOUND`` without one whose program (``_program``) was
    profiled (``is_profiled``): its own record, else the profiled run of the same program (among ``profiles`` and
    the rows) measured nearest it, within ``TIME_BOUND`` of its time, at its commit if one was, else of those that ran
    it faster than that the slowest (at its commit if one was): its kernels, the rest of this run's step the GPU
    waiting on the host or running slower, a term of its own in the why. The why is where that
    profile's step went against the floor's terms (``profile_split``), the term furthest beyond its floor named;
    only a profile whose accounted time is within ``TIME_BOUND`` of its run's timed step counts (neither a profile
    of a part nor one the profiler slowed; the next nearest is tried). A profile of another run is that run's
    evidence: its why lends to no third run (``borrowed``)."""
    profiled: dict[tuple, list[Record]] = {}
    for record in [*profiles, *(row.record for row in rows)]:
        if is_profiled(record):
            profiled.setdefault(_program(record), []).append(record)
    for row in rows:
        record = row.record
        if not _slower_than_bound(row) or not row.products_floor_ms:
            continue
        same = [p for p in profiled.get(_program(record), ()) if p.median_ms]
        near = sorted((p for p in same if abs(p.median_ms / record.median_ms - 1) <= TIME_BOUND),
                      key=lambda p: (p is not record, _commit_of(p) != _commit(row),
                                     abs(math.log(p.median_ms / record.median_ms))))
        faster = sorted((p for p in same if record.median_ms > (1 + TIME_BOUND) * p.median_ms),  # ran faster
                        key=lambda p: (_commit_of(p) != _commit(row), -p.median_ms))  # its commit's, the nearest
        found = next(((p, split) for p in [*near, *faster] if (split := profile_split(p, row))
                      and abs(split[2] / p.median_ms - 1) <= TIME_BOUND), None)
        if found is None:
            continue
        p, (text, beyond, _) = found
        whose = ("its profile" if p is record else
                 f"the same program's profile at {_commit_of(p)} ({p.suite}, {p.median_ms:.1f} ms)")
        slower = p.median_ms * (1 + TIME_BOUND) < record.median_ms
        if slower:
            text += (f"; this run took {record.median_ms - p.median_ms:.0f} ms a step more, with the kernels profiled "
                     f"at {_commit_of(p)}: its GPU waiting on the host or running slower (its steps "
                     f"{record.timing.get('min_ms', 0):.0f} to {record.timing.get('max_ms', 0):.0f} ms)")
            beyond = {**beyond, "this run beyond the profiled step": record.median_ms - p.median_ms}
        row.time_why = f"profiled a step ({whose}): {text}; most beyond the floor: {max(beyond, key=beyond.get)}"
        if p is not record:
            row.borrowed.add("time")


def _one_gpu_step(record: Record) -> tuple | None:
    """``baseline_key`` of a one-GPU torch step a data-parallel launch may time before its ranks: the DDP
    benchmark's ``none`` run, or the e2e benchmark's step of the side-by-side launch
    (``scripts/gpu_side_by_side.sh mesh``); None for any other record."""
    if record.world_size != 1 or record.backend != "torch":
        return None
    if record.suite == DDP_SUITE and record.implementation == "none":
        return baseline_key(record)
    if record.suite == SIDE_BY_SIDE_SUITE and not record.implementation.startswith("stock "):
        return (record.model, record.batch_size, record.seq_len, record.dtype, attention_of(record),
                compiled_of(record), _graphs(record), record.provenance.get("device_name"))
    return None


def explain_ranks(rows: list[Row]) -> None:
    """Set ``time_why`` of every DDP-benchmark row of several ranks still slower than ``TIME_BOUND`` without one,
    where the one-GPU step of its launch (``_one_gpu_step``, of its commit and ``baseline_key``, the last measured
    before it) is within ``TIME_BOUND`` of its own floor and at least half the row's gap lies beyond that step: each
    rank computes what one GPU does, so that time is the ranks waiting (communication the step does not hide, or a
    peer's host), held against the floor's communication, with the phases beside the one GPU's. Records that do not
    name their commit are left out (no launch to pair them by)."""
    singles: dict[tuple, list[Row]] = {}
    for row in rows:
        r = row.record
        key = _one_gpu_step(r)
        if (key is not None and row.time_error is not None and abs(row.time_error) <= TIME_BOUND
                and r.provenance.get("git_commit")):
            singles.setdefault((key, _commit(row)), []).append(row)
    for row in rows:
        r = row.record
        if (r.suite != DDP_SUITE or r.world_size < 2 or not _slower_than_bound(row)
                or not r.provenance.get("git_commit")):
            continue
        before = [s for s in singles.get((baseline_key(r), _commit(row)), ()) if _date(s) <= _date(row)]
        if not before:
            continue
        one = max(before, key=_date).record
        waiting = r.median_ms - one.median_ms
        if waiting <= 0 or waiting < (r.median_ms - row.floor_ms) / 2:
            continue
        mine, its = _phase_medians(r), _phase_medians(one)
        phases = ", ".join(f"{p} {mine[p]:.0f} ({its[p]:.0f})" for p in PHASES if p in mine and p in its)
        row.time_why = (f"ranks waiting: {waiting:.0f} ms a step beyond the one-GPU step of its launch "
                        f"({one.median_ms:.1f} ms, within {TIME_BOUND:.0%} of its floor), against the floor's "
                        f"{row.comm_floor_ms or 0:.0f} ms of communication: communication the step does not hide, or a "
                        f"peer's host" + (f" (by phase, ms, one GPU's in brackets: {phases})" if phases else ""))


def _phase_medians(record: Record) -> dict[str, float]:
    """{phase: median ms} of a record's phases that have a number."""
    return {p: stats["median_ms"] for p, stats in (record.phases or {}).items()
            if isinstance(stats, dict) and isinstance(stats.get("median_ms"), (int, float))}


def _frame(rows: list[Row]):
    import pandas as pd

    def gib(n: Any) -> float | None:
        return n / 2**30 if n else None

    return pd.DataFrame([{
        "suite": row.record.suite, "backend": row.record.backend, "implementation": row.record.implementation,
        "model": row.record.model, "batch x seq": f"{row.record.batch_size} x {row.record.seq_len}",
        "dtype": row.record.dtype, "strategy": strategy_of(row.record), "devices": row.record.world_size,
        "device": row.record.provenance.get("device_name"), "commit": row.record.provenance.get("git_commit"),
        "measured ms": row.record.median_ms, "floor ms": row.floor_ms, "time error": row.time_error,
        "measured / floor": row.record.median_ms / row.floor_ms if row.floor_ms else None,
        "time: why beyond the bound": row.time_why,
        "attention TFLOP/s": row.attention_flops / 1e12 if row.attention_flops else None,
        "comm ms": (row.record.phases or {}).get("comm", {}).get("median_ms"),
        "comm floor ms": row.comm_floor_ms if row.record.world_size > 1 else None,
        "measured GiB": gib(row.record.peak_memory_bytes), "predicted GiB": gib(row.predicted_memory),
        "memory error": row.memory_error, "memory model": row.memory_model,
        "memory: why beyond the bound": row.memory_why, "not predicted": row.why}
        for row in rows])


def summary(frame) -> Any:
    """Per suite and strategy (``strategy_of``): rows, the median and worst |error| of time and memory, how many
    are within the bounds, and how many beyond them have no why (``fidelity_rows``' passes)."""
    import pandas as pd

    out = []
    for (suite, strategy), group in frame.groupby(["suite", "strategy"], sort=True):
        entry: dict[str, Any] = {"suite": suite, "strategy": strategy, "rows": len(group)}
        for what, bound in (("time", TIME_BOUND), ("memory", MEMORY_BOUND)):
            errors = group[f"{what} error"].dropna().abs()
            entry[f"{what}: predicted"] = len(errors)
            entry[f"{what}: median |error|"] = errors.median() if len(errors) else None
            entry[f"{what}: worst |error|"] = errors.max() if len(errors) else None
            entry[f"{what}: within {bound:.0%}"] = int((errors <= bound).sum())
        for what, bound in (("time", TIME_BOUND), ("memory", MEMORY_BOUND)):
            unexplained = (group[f"{what} error"].abs() > bound) & (group[f"{what}: why beyond the bound"] == "")
            entry[f"{what}: beyond {bound:.0%}, no why"] = int(unexplained.sum())
        out.append(entry)
    return pd.DataFrame(out)


def plot(frame, path: Path) -> None:
    """Predicted against measured, log-log, time and memory side by side, one point per row, colour by suite;
    saved as PNG at ``path`` and PDF beside it (``analysis.plots.save_figure``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from analysis.plots import color_map, save_figure

    colors = color_map(sorted(frame["suite"].unique()))
    fig = Figure(figsize=(11, 5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, (measured, predicted, label) in zip(axes, (("measured ms", "floor ms", "step time (ms)"),
                                                      ("measured GiB", "predicted GiB", "peak memory (GiB)"))):
        points = frame.dropna(subset=[measured, predicted])
        for suite, group in points.groupby("suite"):
            ax.scatter(group[measured], group[predicted], s=18, color=colors[suite], label=suite)
        if len(points):
            low = min(points[measured].min(), points[predicted].min()) * 0.8
            high = max(points[measured].max(), points[predicted].max()) * 1.25
            ax.plot([low, high], [low, high], color="grey", lw=0.8, label="predicted = measured")
        ax.set(xscale="log", yscale="log", xlabel=f"measured {label}", ylabel=f"predicted {label}",
               title=f"{label}: {len(points)} records")
        ax.grid(True, which="both", lw=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path)


def report(sources: list, out: Path, profiles: list[Record] | None = None) -> str:
    """Write the fidelity report (Markdown, and its chart as PNG and PDF beside it) of ``sources`` (records, or
    files and folders of them), with the profiled runs ``profiles`` as evidence (default: those of the folders'
    ``profiles/``, ``profile_records``); returns the text."""
    from analysis.tables import load_records, markdown_table

    records = load_records(sources)
    rows = fidelity_rows(records, profile_records(sources) if profiles is None else profiles)
    if not rows:
        raise ValueError(f"{', '.join(map(str, sources))}: no GPU train-step records")
    frame = _frame(rows)
    chart = out.with_suffix(".png")
    predicted = frame.dropna(subset=["floor ms"])
    lines = ["# Predicted against measured", "",
             f"{len(frame)} GPU train-step records; {len(predicted)} with a time floor, "
             f"{frame['memory error'].notna().sum()} with a memory prediction (`python -m analysis.fidelity`; "
             "the floor: `parallelism_calc.roofline`).", "",
             f"![predicted against measured]({chart.name})", "", "## By suite and strategy", "",
             markdown_table(table := summary(frame), list(table.columns)), "", "## Every record", "",
             markdown_table(frame, [c for c in frame.columns if c not in ("device", "not predicted")],
                            max_chars=None)]  # the whys whole
    unpredicted = frame[frame["not predicted"] != ""]
    if len(unpredicted):
        lines += ["", "## Not predicted", "", markdown_table(unpredicted, ["suite", "implementation", "model",
                                                                         "device", "not predicted"])]
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    plot(frame, chart)
    return text


@error_boundary(prog="python -m analysis.fidelity")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m analysis.fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", help=".jsonl files or folders of them (e.g. results)")
    parser.add_argument("--out", type=Path, default=Path("results/reports/fidelity.md"),
                        help="the Markdown report; the chart goes beside it as .png and .pdf (default "
                             "results/reports/fidelity.md)")
    args = parser.parse_args(argv)
    report(args.sources, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} (and .pdf)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
