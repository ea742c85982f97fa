"""Attention benchmark: our FlashAttention-2 (Triton, plain PyTorch) against naive, compiled, SDPA and flex.

    # the CS336 sweep (default): batch 1, 1 head, causal, seq 128 ... 65,536, head dim 16 ... 128, bf16 + fp32
    python -m torch_impl.bench.attention --out results/attention_h100.jsonl
    # the leaderboard configuration: batch 1, 16 heads, seq 16,384, head dim 64 and 128, bf16, causal
    python -m torch_impl.bench.attention --preset leaderboard --out results/attention_h100.jsonl
    # FlashAttention v2 (issue 14): the issue's and ISSUE_NOTES' shapes and the head-dim sweep d = 64, 80, 128,
    # 256, bf16 causal, ours against cuDNN SDPA, flash SDPA and FlexAttention, forward and forward+backward
    python -m torch_impl.bench.attention --preset flash_shapes --out /tmp/attention_shapes.jsonl
    # a subset; explicit B x H x N x d shapes replace the batch/heads/seq-lens/head-dims grid
    python -m torch_impl.bench.attention --providers flash_triton,sdpa_cudnn --passes forward \\
        --seq-lens 1024,4096 --head-dims 64 --dtypes bf16
    python -m torch_impl.bench.attention --shapes 4x32x2048x80,1x8x8192x256 --providers flash_triton,sdpa_cudnn
    # regenerate the table and plots from records only (no GPU, no torch kernels run)
    python -m torch_impl.bench.attention --report-only results/attention_h100.jsonl
    # a tiny functional run on the CPU (timings meaningless; for tests)
    python -m torch_impl.bench.attention --device cpu --seq-lens 16,32 --head-dims 16 --dtypes fp32 \\
        --providers naive,flash_torch --out /tmp/attention.jsonl

Providers (``--providers``, comma-separated, default all), each built once per shape:
  flash_triton    ours: ``torch_impl.attention.flash_triton.FlashAttention2Triton.apply(q, k, v, is_causal)``
  flash_torch     ours, plain PyTorch: ``torch_impl.attention.flash_torch.FlashAttention2Torch.apply(...)``
  naive           the model's eager ``naive_attention``: softmax(q kᵀ / sqrt(d), causal mask) v, the n x n matrix
                  materialized; its causal mask made once per shape, outside the timing
  naive_compiled  ``torch.compile`` of the same function
  sdpa_flash / sdpa_cudnn / sdpa_efficient
                  the model's backends: ``F.scaled_dot_product_attention`` pinned by ``sdpa_kernel`` to one of
                  FLASH_ATTENTION / CUDNN_ATTENTION / EFFICIENT_ATTENTION (no fallback: unsupported inputs error)
  flex            ``torch.compile(flex_attention)`` with a causal ``BlockMask`` made once per shape

Passes (``--passes``, default all three):
  forward           a training forward (inputs require grad, autograd records the graph), as in the Triton
                    fused-attention tutorial and the CS336 timing test
  backward          ``out.backward(dO, retain_graph=True)`` alone: the forward runs once, untimed, and its graph
                    is kept, so only the backward kernels are timed (the Triton tutorial's method); q/k/v
                    gradients are reset to None between runs (``grad_to_none``), so nothing accumulates
  forward_backward  ``fn(q, k, v).backward(dO)``, the graph built and consumed each run

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each run; ``--warmup``/``--rep`` are its
warm-up and measurement budgets in ms); every per-run time is kept (``return_mode="all"``) for
``timing_stats``, falling back to the median alone where a Triton lacks it. On the CPU (tests only) a
``perf_counter`` loop with the same budgets replaces it. Inputs are fresh ``torch.randn`` (seeded, the same for
every provider of a shape), never zeros. On CUDA each record also keeps the host's time to enqueue one run on an
idle GPU (``metrics.host_ms``): where it is near the median, the run is bound by the host's Python and launches,
which differ from machine to machine, not by its kernels.

FLOPs (``parallelism_calc.compute.attention_flops``): forward 4·B·H·N²·d (two N x N x d matrix products, 2 FLOPs per multiply-add),
halved when causal; backward 2.5 x forward (five products instead of two); forward_backward 3.5 x forward.
TFLOP/s = FLOPs / median time; MFU against the bf16 or fp32 peak of the device's ``HardwareSpec``. (The model
FLOPs of ``parallelism_calc.compute`` count causal attention in full; this benchmark follows the
FlashAttention papers and halves it, so a kernel that skips masked tiles is not credited for work it skips.)

Records: one ``analysis.records.Record`` per (provider, pass, dtype, sequence length, head dim), suite
"attention", appended to ``--out`` as it is measured. Out of memory becomes status "oom", any other exception
(an SDPA backend without fp32, a missing module, a compile failure) status "error" with the error's first line
(and the first SDPA "kernel not used because" warning); the sweep goes on. Peak memory is
``torch.cuda.max_memory_allocated`` over one extra, untimed call of the pass with its inputs (and, for
backward, the kept forward graph) alive.

At the end (or with ``--report-only FILE``) ``analysis.attention.write_attention_report`` writes, next to the
records file, ``<stem>.md`` (median ms and TFLOP/s with providers as columns, flash_triton's speed-up over each
other provider, the host's time a run on CUDA, failures) and PNG plots (latency and TFLOP/s against sequence
length). The report step is the only part that imports pandas/matplotlib, and only then.

Caveats: fp32 means fp32 for PyTorch's matmuls and for ``flash_triton`` (IEEE dots), unless TF32 is allowed
(``metrics.tf32_allowed`` is recorded, from ``flash_triton.tf32_allowed``); fp32 MFU is against the non-TF32 peak. A
CUDA error that corrupts the context (an illegal memory access) fails every later configuration too.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import inspect
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from analysis.records import ATTENTION_PROVIDERS, Record, provenance, save_records, timing_stats
from parallelism_calc.cli import (ArgumentParser, error_boundary, int_list, nonnegative_float, nonnegative_int,
                                  positive_float, positive_int, writable_path)
from parallelism_calc.compute import ATTENTION_PASSES, attention_flops
from parallelism_calc.specs import hardware_for_device
from torch_impl.attention import get_attention
from torch_impl.attention.naive import future_mask, naive_attention
from torch_impl.timing import enqueue_ms

PASSES = tuple(ATTENTION_PASSES)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SUITE = "attention"
DEFAULT_OUT = ".cache/results/attention.jsonl"  # not a tracked results/ file: a quick run must not append to one
PRESETS: dict[str, dict[str, Any]] = {
    # CS336 assignment 2: batch 1, causal, a single (batch, seq, d) head; every provider, every pass.
    "cs336": dict(batch=1, heads=1, seq_lens=[2**i for i in range(7, 17)], head_dims=[16, 32, 64, 128],
                  dtypes=["bf16", "fp32"], causal=True),
    # The CS336 FlashAttention leaderboard: forward + backward at one large shape.
    "leaderboard": dict(batch=1, heads=16, seq_lens=[16384], head_dims=[64, 128], dtypes=["bf16"], causal=True),
    # FlashAttention v2 (issue 14): the leaderboard shape at d = 64, 80, 128, 256 (the head-dim sweep), the issue's
    # 4 x 32 x 2,048 x 64, and the head dims of ISSUE_NOTES (the 2.7B preset's 80, 96, 256) against the kernels
    # to beat, forward and forward + backward.
    "flash_shapes": dict(shapes=[(1, 16, 16384, 64), (1, 16, 16384, 80), (1, 16, 16384, 128), (1, 16, 16384, 256),
                                 (4, 32, 2048, 64), (4, 32, 2048, 80), (2, 16, 4096, 96), (1, 8, 8192, 256)],
                         dtypes=["bf16"], causal=True, providers=["flash_triton", "sdpa_cudnn", "sdpa_flash", "flex"],
                         passes=["forward", "forward_backward"]),
    # CS336 assignment 2's PyTorch attention benchmark: batch 8, no heads, full attention, fp32, naive only.
    "naive": dict(batch=8, heads=1, seq_lens=[256, 1024, 4096, 8192, 16384], head_dims=[16, 32, 64, 128],
                  dtypes=["fp32"], causal=False, providers=["naive", "naive_compiled"],
                  passes=["forward", "backward"]),
}  # fmt: skip


# ----------------------------------------------------------------------------- providers


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str
    causal: bool


AttentionCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _import(module: str, name: str) -> Any:
    """``module.name``, imported now (our kernels may be absent); a missing module is a one-line error."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            raise RuntimeError(f"module {module} is missing") from None
        raise


def _flash(module: str, name: str) -> Callable[[Shape, torch.device], AttentionCall]:
    def build(shape: Shape, device: torch.device) -> AttentionCall:
        fn = _import(module, name)
        return lambda q, k, v: fn.apply(q, k, v, shape.causal)

    return build


def _naive(shape: Shape, device: torch.device, fn: Callable[..., torch.Tensor] = naive_attention) -> AttentionCall:
    """Its causal mask made once per shape, so the timing leaves it out."""
    future = future_mask(shape.seq_len, shape.seq_len, device) if shape.causal else None
    return lambda q, k, v: fn(q, k, v, shape.causal, future)


def _naive_compiled(shape: Shape, device: torch.device) -> AttentionCall:
    torch._dynamo.reset()  # one compilation per shape: never the recompile limit's silent eager fallback
    return _naive(shape, device, torch.compile(naive_attention, dynamic=False))


def _registered(name: str) -> Callable[[Shape, torch.device], AttentionCall]:
    """The model's attention backend ``name``, called as the model calls it."""
    def build(shape: Shape, device: torch.device) -> AttentionCall:
        fn = get_attention(name)
        return lambda q, k, v: fn(q, k, v, shape.causal)

    return build


def _flex(shape: Shape, device: torch.device) -> AttentionCall:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if shape.causal:
        def causal(b, h, q_idx, kv_idx):  # noqa: ANN001 (flex's mask_mod signature)
            return q_idx >= kv_idx

        # _compile: build the mask block by block instead of materializing N x N booleans (4 GiB at 65,536)
        compile_mask = device.type == "cuda" and "_compile" in inspect.signature(create_block_mask).parameters
        block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=shape.seq_len, KV_LEN=shape.seq_len,
                                       device=device, **({"_compile": True} if compile_mask else {}))
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


# Each provider's builder; the names and their order (--providers, the report's columns): ATTENTION_PROVIDERS.
PROVIDERS: dict[str, Callable[[Shape, torch.device], AttentionCall]] = {
    "flash_triton": _flash("torch_impl.attention.flash_triton", "FlashAttention2Triton"),
    "flash_torch": _flash("torch_impl.attention.flash_torch", "FlashAttention2Torch"),
    "naive": _naive,
    "naive_compiled": _naive_compiled,
    "sdpa_flash": _registered("sdpa_flash"),
    "sdpa_cudnn": _registered("sdpa_cudnn"),
    "sdpa_efficient": _registered("sdpa_efficient"),
    "flex": _flex,
}


# ----------------------------------------------------------------------------- timing


_DO_BENCH_ALL: bool | None = None  # whether this Triton's do_bench accepts return_mode="all"


def _do_bench(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, grad_to_none: list[torch.Tensor]) -> list[float]:
    global _DO_BENCH_ALL
    from triton.testing import do_bench

    if _DO_BENCH_ALL is not False:
        try:
            times = do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="all")
            _DO_BENCH_ALL = True
            return [float(t) for t in times]
        except (AssertionError, TypeError, ValueError):
            if _DO_BENCH_ALL:  # "all" worked before: this failure is the function's own
                raise
            _DO_BENCH_ALL = False
    return [float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))]


def _cpu_bench(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, grad_to_none: list[torch.Tensor]) -> list[float]:
    """do_bench's budgets with ``time.perf_counter`` on the CPU: warm up for ~warmup_ms, time for ~rep_ms."""

    def once() -> float:
        for t in grad_to_none:
            t.grad = None
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    estimate = max(once(), 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        once()
    return [once() for _ in range(min(1000, max(5, int(rep_ms / estimate))))]


def bench(fn: Callable[[], Any], device: torch.device, warmup_ms: float, rep_ms: float,
          grad_to_none: list[torch.Tensor]) -> list[float]:  # fmt: skip
    """Per-run times of ``fn`` in milliseconds."""
    if device.type == "cuda":
        return _do_bench(fn, warmup_ms, rep_ms, grad_to_none)
    return _cpu_bench(fn, warmup_ms, rep_ms, grad_to_none)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _host_ms(fn: Callable[[], Any], device: torch.device, grad_to_none: list[torch.Tensor], calls: int = 5,
             rounds: int = 5) -> float | None:
    """The host's time to enqueue one call of ``fn`` on an idle GPU (ms; median of ``rounds`` rounds of ``calls``
    calls, the GPU synchronized around each round); None off CUDA. Where it is near the median time, the run is
    bound by the host (its Python and launches), not by its kernels."""
    if device.type != "cuda":
        return None

    def run():
        for t in grad_to_none:
            t.grad = None
        fn()

    return enqueue_ms(run, calls, rounds)


def _peak_memory(fn: Callable[[], Any], device: torch.device, grad_to_none: list[torch.Tensor]) -> int | None:
    """Peak bytes allocated during one untimed call of ``fn`` (live inputs included); None off CUDA."""
    if device.type != "cuda":
        return None
    for t in grad_to_none:
        t.grad = None
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


# ----------------------------------------------------------------------------- the sweep


def _error_text(err: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    """The error's first line, with the first warning that explains an SDPA 'no kernel' error."""
    text = (f"{type(err).__name__}: {err}".splitlines() or [type(err).__name__])[0]
    reasons = [" ".join(str(w.message).split()) for w in caught
               if "not used because" in str(w.message) or "only supports" in str(w.message)]  # fmt: skip
    return f"{text} ({reasons[0]})" if reasons else text


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


@dataclass
class Outcome:
    times_ms: list[float] | None = None
    peak_memory_bytes: int | None = None
    memory_before_backward_bytes: int | None = None  # allocated after the forward, before its backward (CUDA)
    host_ms: float | None = None  # the host's time to enqueue one run (CUDA: ``_host_ms``)
    status: str = "ok"
    error: str | None = None


def _measure(call: AttentionCall, shape: Shape, pass_: str, device: torch.device, *, seed: int,
             warmup_ms: float, rep_ms: float) -> Outcome:  # fmt: skip
    dims = (shape.batch, shape.heads, shape.seq_len, shape.head_dim)  # (B, H, N, d)
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(dims, generator=generator, device=device, dtype=DTYPES[shape.dtype]).requires_grad_()
               for _ in range(3))  # fmt: skip
    if pass_ == "forward":
        fn = lambda: call(q, k, v)  # noqa: E731
    else:
        out = call(q, k, v)  # (B, H, N, d); compiles (if compiled) outside the timing
        d_out = torch.randn(out.shape, generator=generator, device=device, dtype=out.dtype)
        _synchronize(device)
        before_backward = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        if pass_ == "backward":
            fn = lambda: out.backward(d_out, retain_graph=True)  # noqa: E731
        else:
            fn = lambda: call(q, k, v).backward(d_out)  # noqa: E731
    fn()  # a first call outside the timing: compilation, autotuning, a failure surfaces here
    _synchronize(device)
    peak = _peak_memory(fn, device, [q, k, v])
    times = bench(fn, device, warmup_ms, rep_ms, [q, k, v])
    return Outcome(times_ms=times, peak_memory_bytes=peak, host_ms=_host_ms(fn, device, [q, k, v]),
                   memory_before_backward_bytes=before_backward if pass_ == "backward" else None)


def run_pass(call: AttentionCall, shape: Shape, pass_: str, device: torch.device, *, seed: int,
             warmup_ms: float, rep_ms: float) -> Outcome:  # fmt: skip
    """Time one pass of one provider at one shape; an exception becomes an 'oom' / 'error' outcome.

    The tensors live in ``_measure``'s frame only, and the exception (whose traceback holds that frame) is
    dropped at the end of the except block, so memory is freed before the next configuration.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcome = _measure(call, shape, pass_, device, seed=seed, warmup_ms=warmup_ms, rep_ms=rep_ms)
        except Exception as err:  # noqa: BLE001 (every failure is a row, the sweep goes on)
            outcome = Outcome(status="oom" if _is_oom(err) else "error", error=_error_text(err, caught))
    _free(device)
    return outcome


def _tf32_allowed() -> bool | None:
    """PyTorch's fp32 matmul setting, as flash_triton reads it (None where the kernel module cannot load)."""
    try:
        return bool(_import("torch_impl.attention.flash_triton", "tf32_allowed")())
    except Exception:  # noqa: BLE001 (a record field, never a failed run)
        return None


def make_record(provider: str, shape: Shape, pass_: str, outcome: Outcome, *, device_name: str,
                base_provenance: dict[str, Any], warmup_ms: float, rep_ms: float, timer: str,
                suite: str = SUITE) -> Record:  # fmt: skip
    """The record of one (provider, pass, shape): timing, TFLOP/s and MFU, or the failure."""
    flops = attention_flops(shape.batch, shape.heads, shape.seq_len, shape.head_dim, shape.causal, pass_)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    prov = dict(base_provenance, device_name=device_name, date=now)  # git is asked once per sweep, not per row
    record = Record(
        suite=suite, backend="torch", implementation=provider, batch_size=shape.batch, seq_len=shape.seq_len,
        dtype=shape.dtype, mode=pass_, flops_per_step=flops, peak_memory_bytes=outcome.peak_memory_bytes,
        status=outcome.status, error=outcome.error, provenance=prov,
        metrics={"heads": shape.heads, "head_dim": shape.head_dim, "causal": shape.causal,
                 "warmup_ms": warmup_ms, "rep_ms": rep_ms,
                 "timer": timer,
                 "tf32_allowed": _tf32_allowed(),
                 "memory_before_backward_bytes": outcome.memory_before_backward_bytes,
                 "host_ms": outcome.host_ms},
    )  # fmt: skip
    if outcome.times_ms:
        record.timing = timing_stats(outcome.times_ms)
        record.timed_steps = len(outcome.times_ms)
        seconds = record.timing["median_ms"] / 1e3
        record.tokens_per_s = shape.batch * shape.seq_len / seconds
        record.tflops = flops / seconds / 1e12
        hardware = hardware_for_device(device_name)
        peak = None if hardware is None else (hardware.bf16_flops if shape.dtype == "bf16" else hardware.fp32_flops)
        record.mfu = flops / seconds / peak if peak else None
    return record


def shapes(args: argparse.Namespace) -> list[Shape]:
    """The explicit ``--shapes`` (B, H, N, d) if given, else the grid of head dims x sequence lengths."""
    if args.shapes:
        return [Shape(b, h, n, d, dtype, args.causal) for dtype in args.dtypes for b, h, n, d in args.shapes]
    return [Shape(args.batch, args.heads, n, d, dtype, args.causal)
            for dtype in args.dtypes for d in args.head_dims for n in args.seq_lens]  # fmt: skip


class _Progress:
    """tqdm where installed, else a plain ``[i/n]`` line per configuration."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit="config", dynamic_ncols=True, file=sys.stderr)

    def update(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(line[:60], refresh=False)
            self.bar.update()
        else:
            print(f"[{self.done}/{self.total}] {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _summary(provider: str, shape: Shape, pass_: str, record: Record) -> str:
    where = f"{provider} {pass_} {shape.dtype} N={shape.seq_len} d={shape.head_dim}"
    if record.status != "ok":
        return f"{where}: {record.status}"
    return f"{where}: {record.timing['median_ms']:.3f} ms"


def sweep(args: argparse.Namespace, device: torch.device) -> Iterator[Record]:
    """Every (shape, provider, pass) record, appended to ``args.out`` as it is measured."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    base = provenance(name)
    timer = "triton.testing.do_bench" if device.type == "cuda" else "perf_counter"
    configs = shapes(args)
    progress = _Progress(len(configs) * len(args.providers) * len(args.passes))
    try:
        for index, shape in enumerate(configs):
            for provider in args.providers:
                outcomes: dict[str, Outcome] = {}
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        call = PROVIDERS[provider](shape, device)
                    except Exception as err:  # noqa: BLE001 (a missing module fails all its passes)
                        failure = Outcome(status="oom" if _is_oom(err) else "error", error=_error_text(err, caught))
                        outcomes = {pass_: failure for pass_ in args.passes}
                for pass_ in args.passes:
                    if pass_ not in outcomes:
                        outcomes[pass_] = run_pass(call, shape, pass_, device, seed=args.seed + index,
                                                   warmup_ms=args.warmup, rep_ms=args.rep)  # fmt: skip
                    record = make_record(provider, shape, pass_, outcomes[pass_], device_name=name,
                                         base_provenance=base, warmup_ms=args.warmup, rep_ms=args.rep,
                                         timer=timer, suite=args.suite)  # fmt: skip
                    save_records(args.out, record)
                    progress.update(_summary(provider, shape, pass_, record))
                    yield record
                call = None
                _free(device)
    finally:
        progress.close()


# ----------------------------------------------------------------------------- command line


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _shapes(text: str) -> list[tuple[int, int, int, int]]:
    """'1x16x16384x64,4x32x2048x80' -> [(1, 16, 16384, 64), (4, 32, 2048, 80)] (batch x heads x seq x head dim)."""
    try:
        values = [tuple(int(part) for part in name.lower().split("x")) for name in _names(text)]
    except ValueError:
        values = []
    if not values or any(len(v) != 4 or min(v) < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated BxHxNxd shapes of positive integers, "
                                         "e.g. 1x16x16384x64,4x32x2048x80")
    return values


def _choices(accepted: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = _names(text)
        unknown = [n for n in names if n not in accepted]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)}; accepted: {', '.join(accepted)}")
        return list(dict.fromkeys(names))

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m torch_impl.bench.attention", description=__doc__.split("\nProviders")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)  # description: summary, examples
    parser.add_argument("--preset", choices=PRESETS, default="cs336",
                        help="sweep defaults: cs336 (batch 1, 1 head, causal, seq 128..65536, d 16..128, bf16+fp32) "
                             "leaderboard (batch 1, 16 heads, causal, seq 16384, d 64,128, bf16), flash_shapes (8 "
                             "BxHxNxd shapes, d 64-256, bf16 causal, ours vs cuDNN, flash SDPA, flex) or naive "
                             "(batch 8, 1 head, full attention, seq 256..16384, d 16..128, fp32, naive eager and "
                             "compiled, forward and backward); flags below override it (default cs336)")
    parser.add_argument("--providers", type=_choices(ATTENTION_PROVIDERS),
                        help=f"comma-separated subset of {','.join(ATTENTION_PROVIDERS)} (default: the preset's, "
                             "else all)")
    parser.add_argument("--passes", type=_choices(PASSES),
                        help=f"comma-separated subset of {','.join(PASSES)} (default: the preset's, else all)")
    parser.add_argument("--shapes", type=_shapes,
                        help="comma-separated BxHxNxd shapes (batch x heads x sequence x head dim); replaces the grid "
                             "of --batch, --heads, --seq-lens and --head-dims")
    parser.add_argument("--seq-lens", type=int_list, help="comma-separated sequence lengths")
    parser.add_argument("--head-dims", type=int_list, help="comma-separated head dimensions")
    parser.add_argument("--dtypes", type=_choices(tuple(DTYPES)), help="comma-separated of bf16,fp32")
    parser.add_argument("--batch", type=positive_int, help="batch size")
    parser.add_argument("--heads", type=positive_int, help="number of heads")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                        help="causal masking (--no-causal for full attention)")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a tiny functional run")
    parser.add_argument("--warmup", type=nonnegative_float, default=25.0,
                        help="do_bench warm-up budget in ms (default 25)")
    parser.add_argument("--rep", type=positive_float, default=100.0,
                        help="do_bench measurement budget in ms (default 100)")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--suite", default=SUITE, help=f"suite written into the records (default {SUITE})")
    parser.add_argument("--out", type=lambda text: Path(writable_path(text)), default=Path(DEFAULT_OUT),
                        help="records are appended here; the report goes next to it (default "
                             f"{DEFAULT_OUT}, untracked; name a results/ file to keep them)")
    parser.add_argument("--no-report", action="store_true", help="write records only, no table or plots")
    parser.add_argument("--report-only", type=Path, metavar="JSONL",
                        help="measure nothing: regenerate the table and plots from these records")
    parser.add_argument("--dry-run", action="store_true", help="list the configurations and exit")
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the sweep flags not given from the preset; bad values exit with a one-line message."""
    grid = {"--batch": args.batch, "--heads": args.heads, "--seq-lens": args.seq_lens, "--head-dims": args.head_dims}
    given = [flag for flag, value in grid.items() if value is not None]
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    args.providers = args.providers or list(ATTENTION_PROVIDERS)
    args.passes = args.passes or list(PASSES)
    if args.shapes and given:
        raise ValueError(f"{', '.join(given)} and explicit shapes (--shapes or --preset {args.preset}) exclude "
                         "each other; give the shapes as BxHxNxd")
    return args


def pick_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}; accepted: cuda, cuda:N, cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device is available: this benchmark measures GPUs "
                         "(--device cpu runs a tiny functional sweep, timings meaningless)")  # fmt: skip
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {name!r}; accepted: cuda, cuda:N, cpu")
    return device


def report(path: Path, suite: str = SUITE) -> list[Path]:
    """Write the Markdown table and plots of the records in ``path`` next to it; print the speed-ups."""
    from analysis.attention import write_attention_report  # pandas + matplotlib, imported only for the report

    written, speedups = write_attention_report(path, suite=suite)
    if speedups:
        print(speedups)
    for out in written:
        print(f"wrote {out}")
    return written


@error_boundary(prog="python -m torch_impl.bench.attention")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only is not None:
        report(args.report_only, args.suite)
        return 0
    args = resolve_args(args)
    if args.dry_run:
        for shape in shapes(args):
            print(f"{shape}  providers={','.join(args.providers)}  passes={','.join(args.passes)}")
        return 0
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(torch.device(device).index or 0)
    failed = sum(record.status != "ok" for record in sweep(args, device))
    print(f"{failed} failed configuration(s) recorded in {args.out}" if failed else f"records in {args.out}")
    if not args.no_report:
        try:
            report(args.out, args.suite)
        except (ImportError, OSError, ValueError) as err:  # the records are safe: say how to redo the report
            print(f"report skipped ({type(err).__name__}: {err}); rerun with --report-only {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
