"""Is the Gluon forward (FlashAttention-3's structure, torch_impl/attention/flash_gluon.py) right, and faster than
cuDNN's? A GPU probe for issue 14: ``PYTHONPATH=. python3 scripts/flash_gluon_probe.py OUT [--config I]``.

For each head dim and each configuration of ``flash_gluon.CONFIGS`` (or only the I-th of each, so that a shell
loop can run every configuration in a process of its own under ``timeout``: a kernel whose barriers deadlock
hangs, it does not fail), in one process:

* checks each of VARIANTS (the defaults; the scale folded into the exponent; O written through shared memory and
  TMA; the consumers taking turns to issue their products; a persistent grid instead of one program per work item,
  alone and with the TMA store of O, the items dealt block by block or head by head or handed out by a counter)
  against float64 on fresh random inputs (O and the logsumexp; causal and not; GQA with two query heads a k/v head;
  q, k, v as the model passes them, (B, H, n, d) views of (B, n, H, d)), next to cuDNN's O error on the same inputs:
  the bf16 output's rounding is the floor both share;
* the forward's ``triton.testing.do_bench`` median at the issue's shapes (bf16, causal; each of VARIANTS), against
  cuDNN SDPA and the Triton forward (``flash_triton.flash_forward``) in the same process, with O's relative error
  against cuDNN's.

With ``--backward``, instead, ``flash_gluon.backward`` in each of BACKWARD_VARIANTS: dQ, dK, dV against float64
beside the Triton backward's errors on the same inputs (dO contiguous where q is the model's layout), and its time
beside the Triton backward's and cuDNN's forward + backward, and the times of the passes around the kernel (D and
dQ's zeros; dQ's cast from fp32). ``--no-checks`` times only.

The checks run at ``--head-dims`` (default the tile widths: the forward's and the backward's 64, 128 and 256;
any multiple of 8 from 40 up runs in the tile of its next power of two), the shapes may have any of those;
``--side-by-side`` takes the model's (B, n, H, d) heads below the tile's width as 3-D views
(``flash_gluon.SIDE_BY_SIDE_3D``) and times in that layout.

Rows (with provenance) are appended to OUT/flash_gluon_probe.jsonl as they are measured; a configuration that
fails to compile or run is a row with its error. Not a record: it decides what ``flash_gluon`` runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import os
import statistics
import traceback
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from analysis.records import provenance
from torch_impl.attention import flash_gluon as fg
from torch_impl.attention import flash_triton as ft

os.environ["FLASH_GLUON"] = "0"  # the "triton" rows: flash_triton.flash_forward without the Gluon forward (read
# at its first call)

SHAPES = ("1x16x16384x64", "4x32x2048x64", "1x16x16384x128", "4x32x2048x128")
# (B, H, H_kv, n, causal, layout): the 16-head ones give the persistent grid several items a program; 3 x 4 heads end
# in a part of a group of 8 (the backward's ``head_group``)
CHECKS = (
    (2, 4, 4, 1024, True, "bhnd"), (2, 4, 4, 512, False, "bhnd"), (1, 4, 2, 1024, True, "bnhd"),
    (2, 4, 4, 768, True, "bnhd"), (4, 16, 16, 1024, True, "bnhd"), (2, 16, 8, 2048, True, "bhnd"),
    (4, 16, 16, 512, False, "bhnd"), (3, 4, 4, 512, True, "bnhd"),
)
# forward's options by variant name: flash_gluon.OPTIONS, and the persistent grid instead of one program per work item
VARIANTS = {"gluon" + ("_" + name if name else ""): options for name, options in fg.OPTIONS.items()}
VARIANTS["gluon_persistent"] = {"persistent": True}
VARIANTS["gluon_persistent_tma_store"] = {"persistent": True, "tma_store": True}  # O's store under the next item
VARIANTS["gluon_persistent_heads"] = {"persistent": True, "order": "heads"}  # the items head by head
VARIANTS["gluon_persistent_heads_tma_store"] = {"persistent": True, "order": "heads", "tma_store": True}
VARIANTS["gluon_persistent_dynamic"] = {"persistent": True, "order": "dynamic"}  # items from a counter
VARIANTS["gluon_dynamic"] = {**VARIANTS["gluon_persistent_dynamic"], "tma_store": True}  # and O's TMA store
VARIANTS["gluon_dynamic_folded"] = {**VARIANTS["gluon_dynamic"], "folded": True}  # and the scale in the exponent's FMA
VARIANTS["gluon_heads_folded"] = {**VARIANTS["gluon_persistent_heads_tma_store"], "folded": True}
VARIANTS["gluon_dynamic_folded_groups4"] = {**VARIANTS["gluon_dynamic_folded"], "head_group": 4}  # 4 heads at a time
# the backward's configurations by variant name (BWD_CONFIGS, the default first)
BACKWARD_VARIANTS = {f"gluon_{'_'.join(map(str, c))}": {"config": c} for c in fg.BWD_CONFIGS}
BACKWARD_VARIANTS["gluon_persistent"] = {"persistent": True}  # a program per SM (d 64), the default configuration
BACKWARD_VARIANTS["gluon_persistent_64_64_2_240"] = {"persistent": True, "config": (64, 64, 2, 240)}  # two stages
# each tile's dQ product a tile later (``_bwd_consume_item``) or not: the defaults' other choice
BACKWARD_VARIANTS["gluon_no_dq_lag"] = {"dq_lag": False}
BACKWARD_VARIANTS["gluon_persistent_dq_lag"] = {"persistent": True, "dq_lag": True}
# items from a counter (``flash_gluon.BWD_ORDERS``), and the items of a few heads at a time (``_bwd_item``)
BACKWARD_VARIANTS["gluon_dynamic"] = {"persistent": True, "order": "dynamic"}
for _group in (4, 8):
    BACKWARD_VARIANTS[f"gluon_groups{_group}"] = {"head_group": _group}
    BACKWARD_VARIANTS[f"gluon_dynamic_groups{_group}"] = {**BACKWARD_VARIANTS["gluon_dynamic"], "head_group": _group}
# the op's choices (``backward_schedule``) with products on every tile, those a consumer's keys are all after too
for _name in (f"gluon_{'_'.join(map(str, fg.BWD_CONFIG))}", "gluon_persistent", "gluon_dynamic",
              "gluon_dynamic_groups4", "gluon_groups8"):
    BACKWARD_VARIANTS[f"{_name}_every_tile"] = {**BACKWARD_VARIANTS[_name], "skip_unseen": False}
# at tile width 256 (``_bwd_wide_kernel``): BWD_WIDE_CONFIGS
BACKWARD_VARIANTS.update({f"gluon_wide_{'_'.join(map(str, c))}": {"config": c} for c in fg.BWD_WIDE_CONFIGS})


def backward_takes(variant: str, options: dict, d: int) -> bool:
    """Whether the Gluon backward runs a BACKWARD_VARIANTS entry at head dim d: at tile width 256 the wide ones,
    below it the others (the persistent grid at d 64 only)."""
    wide = variant.startswith("gluon_wide_")
    if fg._bwd_wide(fg.tile_dim(d)):
        return wide
    return not wide and not (options.get("persistent") and fg._epilogue_in_stages(d))


def heads(b: int, h: int, n: int, d: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """(B, H, n, d): contiguous, or the (B, H, n, d) view of a (B, n, H, d) tensor the model passes."""
    if layout == "bnhd":
        return torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    return torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)


def reference(q, k, v, causal: bool):
    """O and the logsumexp in float64, k/v heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def cudnn(q, k, v, causal: bool):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        return sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def error(err: Exception) -> str:
    traceback.print_exc()
    return f"{type(err).__name__}: {str(err)[-1500:]}"


def check(config, d: int, emit) -> None:
    for b, h, h_kv, n, causal, layout in CHECKS:
        gen = torch.Generator(device="cuda").manual_seed(b * 1000 + n + d)
        q = heads(b, h, n, d, layout, gen)
        k, v = heads(b, h_kv, n, d, layout, gen), heads(b, h_kv, n, d, layout, gen)
        row = {"check": "float64", "d": d, "config": config, "shape": f"{b}x{h}x{h_kv}x{n}", "causal": causal,
               "layout": layout}
        try:
            if not fg.supports(q, k, v, causal, config):
                emit({**row, "error": "not supported"})
                continue
            o_ref, lse_ref = reference(q, k, v, causal)
            for variant, options in VARIANTS.items():
                if not fg.runs_with(options, config, d, causal):
                    continue
                o, lse = fg.forward(q, k, v, causal, config, **options)
                torch.cuda.synchronize()
                emit({**row, "variant": variant, "o_rel": rel(o, o_ref),
                      "lse_max_abs": (lse.double() - lse_ref).abs().max().item(),
                      "o_rel_cudnn": rel(cudnn(q, k, v, causal), o_ref)})
        except Exception as err:  # noqa: BLE001 (a failing configuration is a row)
            emit({**row, "error": error(err)})


def bench(shape: str, configs, emit, once: bool = False, layout: str = "bhnd") -> None:
    """The forward's times at ``shape``, q, k, v in ``layout`` (``heads``; ``once``: each kernel launched twice,
    untimed: the driver under Nsight Compute)."""
    b, h, n, d = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (heads(b, h, n, d, layout, gen) for _ in "qkv")
    row = {"shape": shape, "layout": layout, "pass": "fwd", "flops": 4 * b * h * n * n * d / 2}
    want = cudnn(q, k, v, True)

    def timed(name, fn, **extra):
        if once:
            fn(), fn()
            torch.cuda.synchronize()
            return None
        try:
            out = fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            emit({**row, "variant": name, "ms": ms, "tflops": row["flops"] / ms / 1e9,
                  "o_rel_vs_cudnn": rel(out, want), **extra})
            return ms
        except Exception as err:  # noqa: BLE001
            emit({**row, "variant": name, "error": error(err), **extra})
            return None

    cudnn_ms = timed("cudnn", lambda: cudnn(q, k, v, True))
    timed("triton", lambda: ft.flash_forward(q, k, v, True)[0])
    for config in configs:
        if fg.supports(q, k, v, True, config):
            for variant, options in VARIANTS.items():
                if not fg.runs_with(options, config, d, True):
                    continue
                ms = timed(variant, lambda: fg.forward(q, k, v, True, config, **options)[0], config=config)
                if ms and cudnn_ms:
                    print(f"  {shape} {variant} {config}: {ms:.3f} ms, {cudnn_ms / ms:.3f}x cuDNN", flush=True)

def grads_reference(q, k, v, do, causal: bool):
    """dQ, dK, dV in float64: autograd through ``reference`` (the k/v heads' gradients summed over their group)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(q64, k64, v64, causal)[0].backward(do.double())
    return q64.grad, k64.grad, v64.grad


def check_backward(head_dims, emit) -> None:
    """``flash_gluon.backward`` at each of ``head_dims`` against float64, next to the Triton backward's errors on the
    same inputs, both from the Gluon forward's O and L."""
    for (b, h, h_kv, n, causal, layout), d in itertools.product(CHECKS, head_dims):
        gen = torch.Generator(device="cuda").manual_seed(b * 1000 + n + d + 1)
        q, do = heads(b, h, n, d, layout, gen), heads(b, h, n, d, "bhnd", gen)  # dO contiguous, as autograd gives it
        k, v = heads(b, h_kv, n, d, layout, gen), heads(b, h_kv, n, d, layout, gen)
        row = {"check": "backward_float64", "d": d, "shape": f"{b}x{h}x{h_kv}x{n}", "causal": causal,
               "layout": layout}
        if not fg.backward_supports(do, q, k, v, causal):
            emit({**row, "error": "not supported"})
            continue
        try:
            want = grads_reference(q, k, v, do, causal)
            o, lse = fg.forward(q, k, v, causal)
            theirs = ft.flash_backward(do, q, k, v, o, lse, causal)
        except Exception as err:  # noqa: BLE001 (a failing shape is a row)
            emit({**row, "error": error(err)})
            continue
        for variant, options in BACKWARD_VARIANTS.items():
            if not backward_takes(variant, options, d):
                continue
            try:
                ours = fg.backward(do, q, k, v, o, lse, causal, **options)
                torch.cuda.synchronize()
                emit({**row, "variant": variant,
                      **{f"{name}_rel": rel(x, ref) for name, x, ref in zip(("dq", "dk", "dv"), ours, want)},
                      **{f"{name}_rel_triton": rel(x, ref) for name, x, ref in zip(("dq", "dk", "dv"), theirs, want)}})
            except Exception as err:  # noqa: BLE001
                emit({**row, "variant": variant, "error": error(err)})


def bench_backward(shape: str, emit, repeats: int = 1, rep_ms: int = 200, layout: str = "bhnd") -> None:
    """The backward alone (ours in Gluon, ours in Triton, from the same O and L) and forward + backward against
    cuDNN's (autograd through SDPA), causal bf16; ``repeats`` rounds over all of them (each round times every run
    once, so that a drift of the GPU's clock over the process reaches them alike), the median of the rounds'
    medians reported, and each run's median over the rounds of its time over the first run's in the same round (the
    GPU's power cap moves its clock by up to ~20% within a process: short rounds, ``rep_ms`` each, compare runs at
    the same clock)."""
    b, h, n, d = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(n + d + 1)
    q, k, v = (heads(b, h, n, d, layout, gen) for _ in "qkv")  # dO contiguous, as autograd gives it
    do = heads(b, h, n, d, "bhnd", gen)
    o, lse = fg.forward(q, k, v, True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def cudnn_fwd_bwd():  # the gradients returned, not accumulated into .grad (a pass over dQ, dK, dV fewer)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.autograd.grad(sdpa(*leaves, is_causal=True), leaves, do)

    runs = [(variant, functools.partial(fg.backward, do, q, k, v, o, lse, True, **options), "bwd")
            for variant, options in BACKWARD_VARIANTS.items()
            if backward_takes(variant, options, d)]
    dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    runs += [("preprocess", lambda: ft.backward_preprocess(o, do, dq_acc), "bwd_part"),  # D, dQ's zeros
             ("dq_cast", lambda: torch.mul(dq_acc, 1 / math.sqrt(d), out=q.new_empty(q.shape)), "bwd_part"),  # dQ
             ("triton", lambda: ft.flash_backward(do, q, k, v, o, lse, True), "bwd"),
             ("cudnn", cudnn_fwd_bwd, "fwd+bwd"),
             ("gluon", lambda: fg.backward(do, q, k, v, *fg.forward(q, k, v, True), True), "fwd+bwd")]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(repeats):
        for name, fn, pass_ in runs:
            if times[name] is None:
                continue
            try:
                times[name].append(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
            except Exception as err:  # noqa: BLE001
                emit({"shape": shape, "layout": layout, "pass": pass_, "variant": name, "error": error(err)})
                times[name] = None
    first = times[runs[0][0]]
    for name, _, pass_ in runs:
        if times[name]:
            ms = statistics.median(times[name])
            ratio = statistics.median(t / f for t, f in zip(times[name], first)) if first else float("nan")
            emit({"shape": shape, "layout": layout, "pass": pass_, "variant": name, "ms": ms,
                  "rounds_ms": times[name], "vs_first": ratio})
            print(f"  {shape} {pass_} {name}: {ms:.3f} ms, x{ratio:.3f} the first (rounds "
                  f"{', '.join(f'{t:.3f}' for t in times[name])})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="BxHxNxd, comma-separated (causal, bf16)")
    parser.add_argument("--config", type=int, help="only the I-th configuration of each tile width")
    parser.add_argument("--head-dims", help="the head dims the float64 checks run at (comma-separated; each with a "
                                            "tile_dim; default the tile widths: the forward's, or the backward's)")
    parser.add_argument("--side-by-side", action="store_true",
                        help="take the (B, n, H, d) heads below the tile's width as 3-D views (SIDE_BY_SIDE_3D): "
                             "the checks' bnhd rows run, and the shapes are timed in that layout")
    parser.add_argument("--no-checks", action="store_true", help="time only (no float64 checks)")
    parser.add_argument("--backward", action="store_true",
                        help="instead: check flash_gluon.backward against float64 and time it")
    parser.add_argument("--repeats", type=int, default=1, help="with --backward: rounds of timings (median reported)")
    parser.add_argument("--rep-ms", type=int, default=200, help="with --backward: each timing's length (ms)")
    parser.add_argument("--variants", help=f"only these, comma-separated: the forward's ({', '.join(VARIANTS)}) or "
                                           f"with --backward the backward's ({', '.join(BACKWARD_VARIANTS)})")
    parser.add_argument("--once", action="store_true",
                        help="the forward's kernels launched twice each, untimed, unchecked (under Nsight Compute)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    if args.rep_ms < 1:
        parser.error(f"--rep-ms must be at least 1; got {args.rep_ms}")
    widths = fg.BWD_MIN_KEYS if args.backward else fg.TILE_DIMS
    args.head_dims = args.head_dims or ",".join(map(str, widths))
    dims = [s.split("x")[-1] for s in args.shapes.split(",")] + args.head_dims.split(",")
    if not all(d.isdigit() and fg.tile_dim(int(d)) in widths for d in dims):
        parser.error(f"head dims (--head-dims, the shapes' last) must be multiples of 8 from 40 to {max(widths)}; got "
                     f"{', '.join(dims)}")
    head_dims = [int(d) for d in args.head_dims.split(",")]
    fg.SIDE_BY_SIDE_3D = args.side_by_side
    layout = "bnhd" if args.side_by_side else "bhnd"
    if args.variants:
        known = BACKWARD_VARIANTS if args.backward else VARIANTS
        unknown = set(args.variants.split(",")) - set(known)
        if unknown:
            parser.error(f"unknown --variants {', '.join(sorted(unknown))}; accepted: {', '.join(known)}")
        for name in set(known) - set(args.variants.split(",")):
            del known[name]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("flash_gluon_probe: needs an sm_90 GPU (H100, H200)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    meta = provenance(torch.cuda.get_device_name())
    path = args.out / "flash_gluon_probe.jsonl"

    def emit(row: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps({**row, **meta}) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), row.get("error", "")[:300], flush=True)

    configs = {w: cs if args.config is None else cs[args.config:args.config + 1] for w, cs in fg.CONFIGS.items()}
    if args.backward:
        if not args.no_checks:
            check_backward(head_dims, emit)
        for shape in args.shapes.split(","):
            bench_backward(shape, emit, args.repeats, args.rep_ms, layout)
        return 0
    for d in head_dims:
        for config in configs[fg.tile_dim(d)] if not (args.no_checks or args.once) else ():
            check(config, d, emit)
    for shape in args.shapes.split(","):
        bench(shape, configs[fg.tile_dim(int(shape.split("x")[-1]))], emit, args.once, layout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
