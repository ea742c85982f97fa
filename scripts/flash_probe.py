"""Where does FlashAttention2Triton lose to cuDNN? A one-call GPU probe of kernel variants (issue 14):
``PYTHONPATH=. python3 scripts/flash_probe.py OUT [--shapes 1x16x16384x64,4x32x2048x64]``.

For each shape B x H x N x d (bf16, causal), in one process: cuDNN SDPA and our kernels, forward alone and
forward + backward (``torch.autograd.grad``), each timed twice, with ``triton.testing.do_bench`` (launches from
Python every time, as a training step does) and ``do_bench_cudagraph`` (the same work replayed from a CUDA graph:
the GPU time alone, so the difference is host overhead). Our variants:

* ``fwd``: the forward.
* ``det``: forward + the two-pass backward (``torch.use_deterministic_algorithms(True)``).
* ``fused``: forward + the fused backward (the default).

With ``--tiles`` each shape instead times the backward with each dK/dV tile configuration in turn (the autotuning
list and ``EXTRA_TILES``; the fused backward and the two-pass one): what the tuner chose from, and what it could
choose. With ``--host`` each shape instead measures the CPU time to enqueue one call (the GPU idle before it, so
nothing waits): cuDNN's and ours, forward and forward + backward, and ours split into its layers (the custom op, its
kernel launches alone, one allocation; and a cProfile of the launches): where host overhead shows when the GPU runs
faster than the CPU launches. With ``--profile`` each forward + backward also gets its GPU time per kernel
(``torch.profiler``); ``--once`` only runs each variant's forward + backward once per shape (no checks, no timing:
the driver under Nsight Compute, after a run that autotuned with ``TRITON_CACHE_AUTOTUNING=1``;
``scripts/gpu_flash.sh OUT ncu``). Each backward's gradients are compared with the two-pass one's and cuDNN's
(relative Frobenius error), and first, at 1 x 4 x 1,024 x d (d = 64, 80), with a float64 reference; the tile
configuration each autotuned kernel chose ends the file. Rows (with the commit and machine:
``analysis.records.provenance``) go to OUT/flash_probe.jsonl as they are measured (a variant that fails is a row
with its error); a table is printed at the end. Not the leaderboard (``python -m torch_impl.bench.attention`` makes
that); it decides what the kernels become (notes/flash_attention.md).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from analysis.records import provenance
from torch_impl.attention import flash_triton as ft
from torch_impl.bench.attention import _choices, _shapes  # the benchmark's --shapes / --providers parsers
from torch_impl.timing import enqueue_ms

SHAPES = ("1x16x16384x64", "4x32x2048x64", "1x16x16384x128", "4x32x2048x80")
VARIANTS = ("fwd", "det", "fused")
BACKWARDS = {"det": True, "fused": False}  # name -> torch.use_deterministic_algorithms


@contextlib.contextmanager
def deterministic(flag: bool):
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(flag)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return sdpa(q, k, v, is_causal=True)


def ours(q, k, v):
    return ft.FlashAttention2Triton.apply(q, k, v, True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(b: int, h: int, n: int, d: int, seed: int = 0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    return q, k, v, torch.randn_like(q)


def grads(attn, q, k, v, do):
    out = attn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), do)


def shape_row(shape: tuple[int, int, int, int]) -> dict:
    """The fields every row of a shape starts with: its name and the causal forward's FLOPs (fwd+bwd: 3.5x)."""
    b, h, n, d = shape
    return {"shape": "x".join(map(str, shape)), "flops_fwd": 4 * b * h * n * n * d / 2}


def rel_errors(got, want, against: str) -> dict:
    """dQ, dK, dV's relative errors against another backward's, as ``d{q,k,v}_rel_vs_{against}``."""
    return {f"d{x}_rel_vs_{against}": rel(g, w) for x, g, w in zip("qkv", got, want)}


def times(fn) -> dict:
    fn()  # autotuning and compilation happen here, outside both timers
    return {"ms": triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"),
            "graph_ms": triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")}


def float64_checks(emit, variants: set[str]) -> None:
    """Each backward against float64 at 1 x 4 x 1,024 x d, causal, bf16 inputs."""
    for d in (64, 80):
        q, k, v, do = inputs(1, 4, 1024, d, seed=d)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        want = grads(lambda a, b, c: sdpa(a, b, c, is_causal=True), q64, k64, v64, do.double())
        for name, flag in BACKWARDS.items():
            if name not in variants:
                continue
            try:
                with deterministic(flag):
                    got = grads(ours, q, k, v, do)  # the first call, autotuning included: what a user gets
                emit({"check": "float64", "d": d, "variant": name,
                      **{f"d{n}_rel": rel(g, w) for n, g, w in zip("qkv", got, want)}})
            except Exception as err:  # noqa: BLE001 (a failing variant is a row)
                emit({"check": "float64", "d": d, "variant": name, "error": _error(err)})


def kernel_times(fn, calls: int = 3) -> dict:
    """GPU time per call of each kernel fn launches (torch.profiler), in ms, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:60]] = totals.get(event.name[:60], 0.0) + event.device_time / 1e3 / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def tuned_configs() -> dict:
    """The configuration each autotuned kernel chose, per tuning key."""
    return {name: {str(key): str(config) for key, config in tuned.cache.items()}
            for name, tuned in (("fwd", ft._fwd_tuned), ("dkdv", ft._dkdv_tuned), ("dq", ft._dq_tuned))}


def probe_shape(shape: tuple[int, int, int, int], emit, variants: set[str], profile: bool) -> None:
    q, k, v, do = inputs(*shape)
    row = shape_row(shape)
    want = grads(cudnn, q, k, v, do)
    emit({**row, "variant": "cudnn", "pass": "fwd", **times(lambda: cudnn(q, k, v))})
    emit({**row, "variant": "cudnn", "pass": "fwd+bwd", **times(lambda: grads(cudnn, q, k, v, do)),
          **({"kernels": kernel_times(lambda: grads(cudnn, q, k, v, do))} if profile else {})})
    if "fwd" in variants:
        try:
            emit({**row, "variant": "fwd", "pass": "fwd", **times(lambda: ours(q, k, v)),
                  "o_rel_vs_cudnn": rel(ours(q, k, v), cudnn(q, k, v))})
        except Exception as err:  # noqa: BLE001
            emit({**row, "variant": "fwd", "pass": "fwd", "error": _error(err)})
    det = None
    for name, flag in BACKWARDS.items():
        if name not in variants:
            continue
        try:
            with deterministic(flag):
                timing = times(lambda: grads(ours, q, k, v, do))  # autotunes first: its runs add into dQ buffers
                got = grads(ours, q, k, v, do)
                det = got if name == "det" else det
                errors = rel_errors(got, want, "cudnn")
                if det is not None and name != "det":
                    errors.update(rel_errors(got, det, "det"))
                if profile:
                    errors["kernels"] = kernel_times(lambda: grads(ours, q, k, v, do))
                emit({**row, "variant": name, "pass": "fwd+bwd", **timing, **errors})
        except Exception as err:  # noqa: BLE001
            emit({**row, "variant": name, "pass": "fwd+bwd", "error": _error(err)})


# dK/dV tiles (BLOCK_M, BLOCK_N, warps, stages) beyond the autotuning list: key tiles of 128 rows halve the
# L2 traffic per product (q, dO loaded and dQ reduced once per key tile; Nsight Compute, session 6)
EXTRA_TILES = ((128, 128, 8, 2), (64, 128, 8, 4), (32, 128, 8, 4), (64, 128, 4, 2))


@contextlib.contextmanager
def only_config(tuned, config):
    """The autotuned kernel restricted to one configuration (no tuning run; its cache restored afterwards)."""
    saved_configs, saved_cache = tuned.configs, dict(tuned.cache)
    tuned.configs = [config]
    tuned.cache.clear()
    try:
        yield
    finally:
        tuned.configs = saved_configs
        tuned.cache.clear()
        tuned.cache.update(saved_cache)


def tile_sweep(shape: tuple[int, int, int, int], emit) -> None:
    """fwd+bwd (CUDA-graph ms) with each dK/dV tile configuration, per backward variant; cuDNN and our forward
    alone as anchors (the backward's time is the difference)."""
    q, k, v, do = inputs(*shape)
    row = {**shape_row(shape), "sweep": "tiles"}
    want = grads(cudnn, q, k, v, do)
    emit({**row, "variant": "cudnn", "pass": "fwd+bwd", **times(lambda: grads(cudnn, q, k, v, do))})
    emit({**row, "variant": "fwd", "pass": "fwd", **times(lambda: ours(q, k, v))})
    configs = list(ft._dkdv_tuned.configs) + [c for t in EXTRA_TILES for c in ft._configs(t)]
    for name, flag in (("fused", False), ("det", True)):
        for config in configs:
            tiles = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
            try:
                with deterministic(flag), only_config(ft._dkdv_tuned, config):
                    timing = times(lambda: grads(ours, q, k, v, do))
                    errors = rel_errors(grads(ours, q, k, v, do), want, "cudnn")
                emit({**row, "variant": name, "pass": "fwd+bwd", "tiles": tiles, **timing, **errors})
            except Exception as err:  # noqa: BLE001 (a configuration that does not compile or fit is a row)
                emit({**row, "variant": name, "pass": "fwd+bwd", "tiles": tiles, "error": _error(err)})


def enqueue_us(fn, calls: int = 50) -> float:
    """Median CPU microseconds to enqueue fn() on an idle GPU (synchronized before each call, not inside it), after
    one untimed call."""
    fn()
    return enqueue_ms(fn, rounds=calls) * 1e3


def host_overhead(shape: tuple[int, int, int, int], emit, out: Path) -> None:
    """CPU enqueue time per call, ours layer by layer against cuDNN's (see the module docstring); the launches'
    cProfile to OUT/host_profile_<shape>.txt."""
    row = shape_row(shape)
    q, k, v, do = inputs(*shape)
    qd, kd, vd = (t.detach() for t in (q, k, v))  # no autograd: the op's and the launches' own cost alone
    o, lse = ft.flash_forward(qd, kd, vd, True)
    op = torch.ops.torch_impl.flash_attention_forward  # what torch.compile calls; eager calls skip its dispatch
    layers = {
        "cudnn fwd": lambda: cudnn(q, k, v),
        "cudnn fwd+bwd": lambda: grads(cudnn, q, k, v, do),
        "ours fwd+bwd (autograd.Function)": lambda: grads(ours, q, k, v, do),
        "ours fwd+bwd (custom op)": lambda: grads(lambda *t: op(*t, True, False)[0], q, k, v, do),
        "ours fwd (custom op)": lambda: op(qd, kd, vd, True, False),
        "ours fwd (flash_forward: launches alone)": lambda: ft.flash_forward(qd, kd, vd, True),
        "ours bwd (flash_backward: launches alone)": lambda: ft.flash_backward(do, qd, kd, vd, o, lse, True),
        "empty tensor (allocation alone)": lambda: torch.empty(1, device="cuda"),
    }
    for name, fn in layers.items():
        try:
            emit({**row, "host": name, "enqueue_us": enqueue_us(fn)})
        except Exception as err:  # a layer that fails is a row
            emit({**row, "host": name, "error": _error(err)})
    # Where the launches' CPU time goes, function by function (cProfile, cumulative time of 200 calls each).
    for name in ("ours fwd (flash_forward: launches alone)", "ours bwd (flash_backward: launches alone)"):
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [layers[name]() for _ in range(200)])
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        with (out / f"host_profile_{row['shape']}.txt").open("a") as f:
            f.write(f"## {name}, 200 calls\n{text.getvalue()}\n")


def _error(err: BaseException) -> str:
    traceback.print_exc()
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def table(rows: list[dict]) -> str:
    """ms (graph ms) per shape and variant, and the speed relative to cuDNN's pass in the same run (where the run
    timed it)."""
    anchor = {(r["shape"], r["pass"]): r["graph_ms"] for r in rows if r.get("variant") == "cudnn" and "graph_ms" in r}
    lines = ["| shape | pass | variant | ms (do_bench) | ms (CUDA graph) | TFLOP/s (graph) | cuDNN / ours (graph) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "shape" not in r or "variant" not in r:
            continue
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['pass']} | {r['variant']} | error: {r['error'][:80]} | | | |")
            continue
        flops = r["flops_fwd"] * (1 if r["pass"] == "fwd" else 3.5)
        variant = r["variant"] + (" {BLOCK_M}x{BLOCK_N} w{num_warps} s{num_stages}".format(**r["tiles"])
                                  if "tiles" in r else "")
        cudnn_ms = anchor.get((r["shape"], r["pass"]))
        ratio = f"{cudnn_ms / r['graph_ms']:.2f}x" if cudnn_ms else "-"
        lines.append(f"| {r['shape']} | {r['pass']} | {variant} | {r['ms']:.3f} | {r['graph_ms']:.3f} | "
                     f"{flops / r['graph_ms'] / 1e9:.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", type=_shapes, default=",".join(SHAPES), help="comma-separated BxHxNxd")
    parser.add_argument("--no-checks", action="store_true", help="skip the float64 checks")
    parser.add_argument("--variants", type=_choices(VARIANTS), default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--profile", action="store_true", help="also each fwd+bwd's GPU time per kernel")
    parser.add_argument("--once", action="store_true", help="run each variant once per shape, nothing else")
    parser.add_argument("--tiles", action="store_true", help="time the backward with each dK/dV tile configuration")
    parser.add_argument("--host", action="store_true", help="CPU time to enqueue one call, layer by layer")
    args = parser.parse_args(argv)
    variants = set(args.variants)
    if not torch.cuda.is_available():
        print("flash_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.once:
        for shape in args.shapes:
            q, k, v, do = inputs(*shape)
            for name, flag in BACKWARDS.items():
                if name in variants:
                    with deterministic(flag):
                        grads(ours, q, k, v, do)
        torch.cuda.synchronize()
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "flash_probe.jsonl"
    rows: list[dict] = []
    stamp = {"provenance": provenance(torch.cuda.get_device_name())}

    def emit(row: dict) -> None:
        row = {**row, **stamp}
        rows.append(row)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    if not args.no_checks:
        float64_checks(emit, variants)
    for shape in args.shapes:
        if args.host:
            host_overhead(shape, emit, args.out)
        elif args.tiles:
            tile_sweep(shape, emit)
        else:
            probe_shape(shape, emit, variants, args.profile)
    emit({"autotune": tuned_configs()})
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
