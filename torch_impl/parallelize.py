"""Turning a single-device model into a fast or a parallel one, from outside: one ``apply_*`` per technique.

``parallelize(model, mode, ...)`` applies them in torchtitan's order (``parallelize_llama``): activation
checkpointing, then compilation, then the data-parallel wrapper. The trainer and every benchmark call it, so a fix
made here reaches all of them.

* ``apply_activation_checkpointing(model, every, nested)``: ``torch_impl.activation_checkpointing``.
* ``apply_compile(model, cuda_graphs, blocks_per_graph)``: regional compilation, ``torch.compile`` of each span of
  ``BLOCKS_PER_GRAPH`` Transformer blocks (torchtitan's ``apply_compile`` compiles each block; PyTorch's "regional
  compilation" recipe). The spans are identical, so one graph serves all of them: xl's 48 blocks compile in the
  time of one span (seconds), where compiling the whole model as one graph took 87-169 s on an H100
  (notes/train_step.md). The embedding, the final norm and the LM head stay eager (the e2e benchmark compiles its
  loss function on its own). ``cuda_graphs`` adds Inductor's CUDA graph trees (``mode="reduce-overhead"``): each
  span's forward and backward kernels are replayed as one graph, for steps whose host cannot launch kernels as
  fast as the device runs them (xl at 4 x 512).
* ``apply_data_parallel(model, mode, bucket_mb=, dtype=, adamw=)``: the built (maybe compiled) model in one of
  ``DATA_PARALLEL``, with its AdamW and its ``DataParallelWrapper`` (``torch_impl.distributed.interface``: what the
  trainer calls; None for fsdp2): ``none``; our ``naive``, ``flat``, ``individual``, ``bucketed`` DDP; ``torch_ddp``
  (no buffer broadcast per forward, ``forward_sync_buffers=False`` (torch >= 2.13) or ``broadcast_buffers=False``:
  ours broadcast buffers at construction only); ``zero1`` (``ShardedOptimizer`` over ``DDPBucketed``); ``zero2``
  (``ZeRO2``: bf16 weights with fp32 master pieces under bf16_mixed); our ``fsdp`` (``compute_dtype=bfloat16`` with
  bf16); ``fsdp2`` (``fully_shard`` per block, then the root; ``MixedPrecisionPolicy(param_dtype=bfloat16)`` with
  bf16: it reduces in the param dtype, as our FSDP does). ``check_supported`` rejects the modes ``UNSUPPORTED``
  lists for ``--cuda-graph blocks`` and ``--dtype bf16_mixed``; ``DataParallelConfig``: a mode with its bucket size,
  named as the records name it, and its strategy in the calculator's vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from analysis.data_parallel import calculator_strategy
from torch_impl.activation_checkpointing import apply_activation_checkpointing
from torch_impl.distributed.copy_engines import ENGINES  # how the wrappers move bytes between GPUs
from torch_impl.distributed.ddp import MEANS  # where bucketed DDP's means are computed
from torch_impl.model import Blocks, TransformerBlock, run_blocks

__all__ = ["BLOCKS_PER_GRAPH", "COMM_DTYPES", "COMM_DTYPE_MODES", "COMM_SMS_MODES", "CUDA_GRAPHS", "DATA_PARALLEL",
           "ENGINES", "ENGINE_MODES", "HOOKED_MODES", "MEANS", "MEAN_MODES", "OPTIMIZER_STEP_MODES", "UNSUPPORTED",
           "WRAPPER_MODES", "DataParallelConfig", "apply_activation_checkpointing", "apply_compile",
           "apply_data_parallel", "check_cuda_graph", "check_supported", "data_parallel_configs",
           "means_in_optimizer", "parallelize"]

DATA_PARALLEL = ("none", "naive", "flat", "individual", "bucketed", "torch_ddp", "zero1", "zero2", "fsdp", "fsdp2")
# The modes with a DataParallelWrapper, so the trainer's --dist: not fsdp2 (its DTensor parameters would need their
# own norm and checkpoints).
WRAPPER_MODES = tuple(m for m in DATA_PARALLEL if m != "fsdp2")
# what a mode cannot be combined with: the flag, the modes, why
UNSUPPORTED = {"--cuda-graph blocks": (("fsdp", "fsdp2"), "their gathered weights are new tensors every step, "
                                                          "which each graph's replay would copy in"),
               "--dtype bf16_mixed": (("zero1", "fsdp", "fsdp2"), "they shard or cast the weights themselves")}
# The modes whose module hooks gather the weights: compiled, each block's forward is the compiled region and the
# hooks run eagerly around it (``apply_compile(hooks_eager=True)``).
HOOKED_MODES = ("fsdp", "fsdp2")
BUCKETED = ("bucketed", "zero1", "zero2")  # one configuration per bucket size
OWN_OPTIMIZER = ("zero1", "zero2", "fsdp", "fsdp2")  # they shard the optimizer state: the wrapper builds it
TORCH_DDP_BUCKET_MB = 25.0  # torch DDP's default bucket_cap_mb


# Blocks per compiled region: xl at 4 x 512 is host-bound, and entering a compiled region costs the host ~0.2 ms
# forward and backward (48 regions a step: 130.0 ms; spans of 4: 111.9; of 12: 107.6, compiling in 2, 14 and
# 33 s; one H100, one call: results/profiles/step_probe_xl_4x512_host_h100_d8e2463.json). The gradients of a
# span's parameters are produced together, at the end of its backward.
BLOCKS_PER_GRAPH = 4


def apply_compile(model: nn.Module, cuda_graphs: bool = False, options: dict | None = None,
                  blocks_per_graph: int = BLOCKS_PER_GRAPH, hooks_eager: bool = False) -> nn.Module:
    """``torch.compile`` the blocks of ``model.layers`` in place, ``blocks_per_graph`` consecutive blocks as one
    region (``torch_impl.model.Blocks`` runs them; 1: each block, any ModuleList), one graph serving every region
    (``fullgraph``: a graph break is an error, not a silent slowdown), with CUDA graph trees if ``cuda_graphs`` and
    Inductor ``options`` (its config names, as ``torch.compile`` takes them). ``hooks_eager``: each
    ``TransformerBlock``'s ``forward`` alone is compiled (inside checkpointed segments too), so hooks registered on
    the block, an FSDP's gathers, run eagerly around its region (``nn.Module.compile`` would trace them; torchtitan
    compiles each block and then shards it). Parameter names do not change. Returns the model."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("regional compilation needs a model with a ModuleList of blocks in .layers")
    if blocks_per_graph < 1 or (blocks_per_graph > 1 and not isinstance(layers, Blocks)):
        raise ValueError(f"blocks_per_graph={blocks_per_graph}: accepted 1, or more where model.layers is "
                         f"torch_impl.model.Blocks (it runs them; this model's is {type(layers).__name__})")
    # torch.compile takes a mode or options, not both: reduce-overhead is the option triton.cudagraphs
    how = ({"options": {**options, "triton.cudagraphs": cuda_graphs}} if options
           else {"mode": "reduce-overhead" if cuda_graphs else None})
    if hooks_eager:
        for block in model.modules():
            if isinstance(block, TransformerBlock):
                block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False, **how)
        return model
    if blocks_per_graph > 1:
        layers.span = blocks_per_graph
        layers.run_span = torch.compile(run_blocks, fullgraph=True, dynamic=False, **how)
        return model
    for block in layers:
        block.compile(fullgraph=True, dynamic=False, **how)
    return model


# --cuda-graph of the trainer and the DDP benchmark (e2e adds "step", the whole step captured as one graph)
CUDA_GRAPHS = ("off", "blocks")


def check_cuda_graph(mode: str, compile: bool, device: str, grad_accum: int = 1, whole_step: bool = False) -> None:
    """ValueError unless ``--cuda-graph mode`` can run: blocks replays the graphs of the compiled blocks, so it
    needs ``--compile`` and a CUDA device, and one micro-batch a step (a second micro-batch's replay would
    write over the gradients the first left in the graphs' memory); ``whole_step`` accepts "step" too (the e2e
    benchmark captures the whole step)."""
    accepted = (*CUDA_GRAPHS, "step") if whole_step else CUDA_GRAPHS
    if mode not in accepted:
        raise ValueError(f"--cuda-graph {mode!r}; accepted: {', '.join(accepted)}")
    if mode == "off":
        return
    if mode == "blocks" and not compile:
        raise ValueError("--cuda-graph blocks replays the graphs of the compiled blocks: it needs --compile")
    if device != "cuda":
        raise ValueError(f"--cuda-graph {mode} replays CUDA graphs: it needs --device cuda")
    if grad_accum > 1:
        raise ValueError(f"--cuda-graph {mode}: not with --grad-accum {grad_accum} (each micro-batch's replay would "
                         "write over the gradients of the one before)")


def check_supported(modes: list[str], dtype: str, flag: str, cuda_graphs: bool = False) -> None:
    """ValueError if ``--cuda-graph blocks`` or ``--dtype bf16_mixed`` meets a mode that cannot take it
    (``UNSUPPORTED``; ``flag``: how the CLI names modes)."""
    for option, wanted in (("--cuda-graph blocks", cuda_graphs), ("--dtype bf16_mixed", dtype == "bf16_mixed")):
        excluded, why = UNSUPPORTED[option]
        unsupported = [m for m in modes if m in excluded] if wanted else []
        if unsupported:
            raise ValueError(f"{option} with {flag}{', '.join(unsupported)}: {why}; {option} works with: "
                             f"{', '.join(m for m in DATA_PARALLEL if m not in excluded)}")


# our DDP wrappers, which take comm_sms (torch_impl.distributed.ddp: the SMs their NCCL kernels may occupy)
COMM_SMS_MODES = ("naive", "flat", "individual", "bucketed", "zero1", "zero2")
# the dtype gradients travel in: their own, or bf16 (our buckets' comm_dtype; torch DDP's bf16_compress_hook)
COMM_DTYPES = ("grad", "bf16")
COMM_DTYPE_MODES = ("bucketed", "zero1", "zero2", "torch_ddp")
# the wrappers that can move bytes on the copy engines (``ENGINES``): bucketed's all-reduce, zero2's weight gather
ENGINE_MODES = ("bucketed", "zero2")
# the wrappers whose gradients land in parts (``finish_in_parts``), which the optimizer may step as they land
# (``torch_impl.step.OPTIMIZER_STEPS``; it does with bf16_mixed's MasterAdamW and no clipping)
OPTIMIZER_STEP_MODES = ("individual", "bucketed")
# the wrappers whose means the optimizer may compute as it reads every rank's gradients (``MEANS``; on the copy
# engines, without a cast)
MEAN_MODES = ("bucketed",)


def means_in_optimizer(mode: str, engine: str, comm_dtype: str) -> bool:
    """Whether ``mode`` with ``engine`` and ``comm_dtype`` can leave its means to the optimizer (``MEANS``' optimizer):
    ``MEAN_MODES`` on the copy engines, the gradients travelling in their own dtype."""
    return mode in MEAN_MODES and engine == "copy_engines" and comm_dtype == "grad"


@dataclass(frozen=True)
class DataParallelConfig:
    """A mode of ``DATA_PARALLEL`` with its bucket size in MiB (``BUCKETED``, torch_ddp; else None) and, for
    ``COMM_SMS_MODES``, the SMs its NCCL kernels may occupy (0: NCCL's default); for ``COMM_DTYPE_MODES``, the
    dtype its gradients travel in (``COMM_DTYPES``); for ``ENGINE_MODES``, what moves the bytes (``ENGINES``); for
    ``OPTIMIZER_STEP_MODES``, when the optimizer steps (``OPTIMIZER_STEPS``); for ``MEAN_MODES`` on the copy
    engines, where the means are computed (``MEANS``)."""

    impl: str
    bucket_mb: float | None = None
    comm_sms: int = 0
    comm_dtype: str = "grad"
    engine: str = "nccl"
    optimizer_step: str = "overlapped"
    mean: str = "bucket"

    @property
    def strategy(self) -> str:
        """What ``parallelism_calc`` calls it (``parallelism_calc.memory.STRATEGIES``): ddp, zero1, zero2 or fsdp."""
        return calculator_strategy(self.impl)

    @property
    def name(self) -> str:
        """The record's implementation: 'bucketed 25MB', 'zero1 + bucketed 25MB', 'zero2 25MB', 'torch_ddp', ..."""
        name = (f"bucketed {self.bucket_mb:g}MB" if self.impl == "bucketed" else
                f"zero1 + bucketed {self.bucket_mb:g}MB" if self.impl == "zero1" else
                f"zero2 {self.bucket_mb:g}MB" if self.impl == "zero2" else self.impl)
        return name + (f", comm {self.comm_sms} SMs" if self.comm_sms else "") + (
            f", {self.comm_dtype} comm" if self.comm_dtype != "grad" else "") + (
            "" if self.engine == "nccl" else ", copy-engine gather" if self.impl == "zero2" else ", copy engines") + (
            ", optimizer after" if self.optimizer_step == "after" else "") + (
            ", mean in optimizer" if self.mean == "optimizer" else "")


def data_parallel_configs(modes: list[str], bucket_mb: list[float], comm_sms: list[int] | tuple[int, ...] = (0,),
                          comm_dtypes: list[str] | tuple[str, ...] = ("grad",),
                          engines: list[str] | tuple[str, ...] = ("nccl",),
                          optimizer_steps: list[str] | tuple[str, ...] = ("overlapped",),
                          means: list[str] | tuple[str, ...] = ("bucket",)) -> list[DataParallelConfig]:
    """In order: ``BUCKETED`` modes once per bucket size, torch_ddp with its default bucket, the others once;
    each of ``COMM_SMS_MODES`` once per ``comm_sms`` value, each of ``COMM_DTYPE_MODES`` once per comm dtype, each of
    ``ENGINE_MODES`` once per engine, each of ``OPTIMIZER_STEP_MODES`` once per optimizer step, each of
    ``MEAN_MODES`` on the copy engines without a cast once per place of its means."""
    out: list[DataParallelConfig] = []
    for mode in modes:
        sizes = bucket_mb if mode in BUCKETED else [TORCH_DDP_BUCKET_MB if mode == "torch_ddp" else None]
        sms = comm_sms if mode in COMM_SMS_MODES else (0,)
        dtypes = comm_dtypes if mode in COMM_DTYPE_MODES else ("grad",)
        ways = engines if mode in ENGINE_MODES else ("nccl",)
        steps = optimizer_steps if mode in OPTIMIZER_STEP_MODES else ("overlapped",)
        out += [DataParallelConfig(mode, mb, k, d, g, o, m) for mb in sizes for d in dtypes for k in sms for g in ways
                for o in steps for m in (means if means_in_optimizer(mode, g, d) else ("bucket",))]
    return out


def apply_data_parallel(model: nn.Module, mode: str, *, bucket_mb: float | None = None, dtype: str = "fp32",
                        adamw: dict[str, Any], comm_sms: int = 0, comm_dtype: str = "grad",
                        engine: str = "nccl", mean: str = "bucket") -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    """(the module to call, its ``DataParallelWrapper`` (None for fsdp2), the optimizer): ``model``, built on its
    device (and maybe compiled: ``parallelize``), wrapped in ``mode`` with
    ``AdamW(**adamw)``. ``dtype`` (``analysis.harness.DTYPES``): bf16 makes the FSDPs compute in bf16;
    bf16_mixed gives ``MasterAdamW``. ``comm_sms``: the SMs ``COMM_SMS_MODES``' NCCL kernels may occupy (0:
    NCCL's default); ``comm_dtype``: the dtype gradients travel in (``COMM_DTYPES``; bf16 with
    ``COMM_DTYPE_MODES`` only); ``engine``: what moves ``ENGINE_MODES``' bytes (``ENGINES``); ``mean``: where
    ``MEAN_MODES``' means are computed (``MEANS``: optimizer with the copy engines, no bf16 comm). Our DDP wrappers
    skip the per-step count of unused parameters (``find_unused_parameters=False``, torch DDP's default; the count
    costs a device-to-host synchronization per step): every parameter of ``TransformerLM`` gets a gradient.
    Collectives inside (the wrappers' broadcasts) run on every rank alike."""
    from torch_impl.distributed import (FSDP, DDPBucketed, DDPIndividualParameters, FlatDDP, NaiveDDP,
                                        ShardedOptimizer, SingleProcess, TorchDDP, ZeRO2)
    from torch_impl.optim import adamw_for

    bf16 = dtype == "bf16"
    if comm_sms and mode not in COMM_SMS_MODES:
        raise ValueError(f"comm_sms={comm_sms} with {mode}; accepted with: {', '.join(COMM_SMS_MODES)}")
    if engine not in ENGINES or engine != "nccl" and mode not in ENGINE_MODES:
        raise ValueError(f"engine={engine!r} with {mode}; accepted: {', '.join(ENGINES)} (copy_engines with "
                         f"{', '.join(ENGINE_MODES)})")
    if comm_dtype not in COMM_DTYPES or comm_dtype != "grad" and mode not in COMM_DTYPE_MODES:
        raise ValueError(f"comm_dtype={comm_dtype!r} with {mode}; accepted: {', '.join(COMM_DTYPES)}, bf16 with "
                         f"{', '.join(COMM_DTYPE_MODES)}")
    if mean not in MEANS or mean != "bucket" and not means_in_optimizer(mode, engine, comm_dtype):
        raise ValueError(f"mean={mean!r} with {mode}, engine={engine!r}, comm_dtype={comm_dtype!r}; accepted: "
                         f"{', '.join(MEANS)} (optimizer with {', '.join(MEAN_MODES)} on copy_engines, comm_dtype "
                         "grad)")
    # OWN_OPTIMIZER modes build their optimizer over what they shard; for the others it is built here, before any
    # wrapper sees the weights: with bf16_mixed it casts them to bf16
    optimizer = None if mode in OWN_OPTIMIZER else adamw_for(dtype, model.parameters(), **adamw)
    if mode == "none":
        return model, SingleProcess(model), optimizer
    bf16_comm = comm_dtype == "bf16"
    if mode in COMM_SMS_MODES:
        comm = torch.bfloat16 if bf16_comm else None
        if mode == "zero2":  # bf16_mixed: bf16 weights, fp32 master pieces (MasterAdamW's precision)
            wrapper = ZeRO2(model, torch.optim.AdamW, bucket_size_mb=bucket_mb, comm_dtype=comm, comm_sms=comm_sms,
                            param_dtype=torch.bfloat16 if dtype == "bf16_mixed" else None, engine=engine, **adamw)
            return wrapper, wrapper, wrapper.optimizer
        ours = dict(comm_sms=comm_sms, find_unused_parameters=False)
        wrapper = (DDPBucketed(model, bucket_mb, comm_dtype=comm, engine=engine, mean=mean, **ours)
                   if mode in BUCKETED else
                   {"naive": NaiveDDP, "flat": FlatDDP, "individual": DDPIndividualParameters}[mode](model, **ours))
        if mode == "zero1":
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **adamw)
        return wrapper, wrapper, optimizer
    if mode == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        # No per-forward buffer broadcast (torch >= 2.13 renames the flag; 2.11 knows only the old one).
        no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                   inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False})
        device = next(model.parameters()).device
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      bucket_cap_mb=bucket_mb, **no_sync)
        if bf16_comm:
            if device.type != "cuda":
                raise ValueError("torch_ddp with bf16 gradients (its bf16_compress_hook) runs on CUDA devices only")
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            ddp.register_comm_hook(None, bf16_compress_hook)
        return ddp, TorchDDP(ddp), optimizer
    if mode == "fsdp":
        fsdp = FSDP(model, compute_dtype=torch.bfloat16 if bf16 else None)
        return fsdp, fsdp, torch.optim.AdamW(fsdp.parameters(), **adamw)
    if mode == "fsdp2":
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError as err:
            raise RuntimeError(f"fsdp2: torch.distributed.fsdp.fully_shard is not available: {err}") from None
        kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if bf16 else {}
        for block in model.modules():
            if isinstance(block, TransformerBlock):
                fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model, None, torch.optim.AdamW(model.parameters(), **adamw)
    raise ValueError(f"unknown data-parallel mode {mode!r}; accepted: {', '.join(DATA_PARALLEL)}")


def parallelize(model: nn.Module, mode: str = "none", *, bucket_mb: float | None = None, dtype: str = "fp32",
                adamw: dict[str, Any], compile: bool = False, cuda_graphs: bool = False, ac_every: int = 0,
                nested_ac: bool = False, ac_keep_attention: bool = False, comm_sms: int = 0, comm_dtype: str = "grad",
                engine: str = "nccl", mean: str = "bucket") -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    """``model`` made fast and parallel in torchtitan's order: activation checkpointing every ``ac_every`` blocks
    (``ac_keep_attention``: selective, the attention's outputs kept), then ``apply_compile`` (with the CUDA graphs
    of its regions if ``cuda_graphs``; for ``HOOKED_MODES`` each block's forward, the hooks eager), then
    ``apply_data_parallel`` in ``mode``; returns what that returns: (the module to call, its wrapper, the
    optimizer)."""
    check_supported([mode], dtype, flag="--dist ", cuda_graphs=cuda_graphs)
    if cuda_graphs and not compile:
        raise ValueError("CUDA graphs of the compiled blocks need compile=True")
    if ac_keep_attention and (not ac_every or cuda_graphs):
        raise ValueError("keeping the attention outputs needs activation checkpointing (ac_every) and no CUDA graphs "
                         "(a graph's replay would not hand the kept outputs to the recomputation)")
    if ac_every:
        apply_activation_checkpointing(model, ac_every, nested=nested_ac, keep_attention=ac_keep_attention)
    if compile:
        # each block's forward alone where the FSDPs' hooks run around it, or where its segment hands the kept
        # attention outputs to it in Python (a compiled segment would recompute inside its graph)
        apply_compile(model, cuda_graphs=cuda_graphs, hooks_eager=mode in HOOKED_MODES or ac_keep_attention)
        # Regions compiled before torch DDP wraps them are compiled lazily inside DDP's forward, where Dynamo's
        # DDPOptimizer would split each at DDP's bucket boundaries (2 H100s, xl 4 x 1,024: forward 110 ms instead
        # of 41, notes/data_parallel.md); a region's gradients are all ready at its end anyway. Process-wide.
        torch._dynamo.config.optimize_ddp = mode != "torch_ddp" and torch._dynamo.config.optimize_ddp
    return apply_data_parallel(model, mode, bucket_mb=bucket_mb, dtype=dtype, adamw=adamw, comm_sms=comm_sms,
                               comm_dtype=comm_dtype, engine=engine, mean=mean)
