"""The op's forward + backward (autograd, as ``torch_impl.bench.attention`` times it: ``.backward(dO)``, gradients
reset between runs) at one shape with the Gluon backward's options forced (VARIANTS: its grid, DQ_LAG), in
alternating rounds, cuDNN's step after each: do_bench's spread, the host's time to enqueue one step (the GPU idle,
median of 11: is the step host-bound?), the step's kernels in order with each one's GPU time and the idle time before
it (torch.profiler) and the gradients' largest error relative to cuDNN's; then the host's time of each part of the
op's step beside cuDNN's step, and where it goes (cProfile of 50 steps, by function, the op as it runs). Issue 14,
sessions 23-25: at 4 x 32 x 2,048 the step's host time is about its GPU time.
``PYTHONPATH=. python3 scripts/flash_op_ab.py OUT [--shape 4x32x2048x64] [--rounds 2] [--variants per_item,...]``;
rows to OUT/flash_op_ab.jsonl (with provenance), the host's profile to OUT/flash_op_ab_host.txt."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import statistics
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from analysis.records import provenance
from torch_impl.attention import flash_gluon as fg
from torch_impl.attention import flash_triton as ft
from torch_impl.attention.registry import get_attention
from torch_impl.timing import enqueue_ms


def _forced(backward, forced: dict, /, *args, **options):
    """``backward`` as the op calls it, with ``forced`` options (its grid: the op's ``backward_schedule`` chooses)."""
    return backward(*args, **{**options, **forced})


def timeline(step, steps: int = 7) -> list[dict]:
    """The GPU's kernels of one ``step`` in order (torch.profiler, ``steps`` steps back to back, the first dropped):
    each kernel's name, median time (ms) and the median idle time before it (us; the first kernel's: since the
    last step's end)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return kernel_rows(sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                              if e.device_type == torch.autograd.DeviceType.CUDA), steps)


def kernel_rows(kernels: list[tuple[float, float, str]], steps: int) -> list[dict]:
    """``timeline``'s rows from the kernels of ``steps`` equal steps, (start us, end us, name) in order."""
    per_step = len(kernels) // steps
    if per_step == 0 or len(kernels) % steps:
        return [{"error": f"{len(kernels)} kernels in {steps} steps"}]
    rows = []
    for j in range(per_step):
        runs = range(per_step + j, len(kernels), per_step)  # this kernel in each step but the first
        rows.append({"kernel": kernels[j][2][:60],
                     "ms": statistics.median((kernels[i][1] - kernels[i][0]) / 1e3 for i in runs),
                     "gap_before_us": statistics.median(kernels[i][0] - kernels[i - 1][1] for i in runs)})
    return rows


# the Gluon backward's options the op's step is timed with, by name
VARIANTS = {"per_item": {"persistent": False}, "persistent": {"persistent": True},
            "per_item_no_dq_lag": {"persistent": False, "dq_lag": False},
            "persistent_dq_lag": {"persistent": True, "dq_lag": True}}


class _Floor(torch.autograd.Function):
    """The op's step without its kernels: what autograd and the op's seven allocations cost the host."""

    @staticmethod
    def forward(ctx, q, k, v):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(lse, q, k, v, o)
        return o

    @staticmethod
    def backward(ctx, do):
        lse, q, k, v, o = ctx.saved_tensors
        torch.empty(q.shape, dtype=torch.float32, device=q.device), torch.empty_like(lse)  # dQ's sum, D
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _launcher(kernel, grid, args, constexprs):
    """A launch of ``kernel`` compiled once: what Triton's launcher costs the host (descriptors encoded, arguments
    parsed, the launch), as ``flash_gluon._run`` calls it after the first launch."""
    compiled = kernel[grid](*args, **constexprs)
    rest = [constexprs[name] for name in kernel.arg_names[len(args):]]
    return lambda: compiled[grid](*args, *rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="4x32x2048x64", help="BxHxNxd (bf16, causal)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    dims = args.shape.split("x")
    if len(dims) != 4 or not all(x.isdigit() and int(x) > 0 for x in dims):
        parser.error(f"--shape must be BxHxNxd of positive integers; got {args.shape!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown --variants {', '.join(sorted(unknown))}; accepted: {', '.join(VARIANTS)}")
    b, h, n, d = (int(x) for x in dims)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    d_out = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    attn = get_attention("flash_triton")
    as_run = fg.backward
    variants = {name: functools.partial(_forced, as_run, forced) for name, forced in VARIANTS.items()
                if name in args.variants.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = provenance(torch.cuda.get_device_name())

    def step():
        attn(q, k, v, True).backward(d_out)

    def fresh_step():  # as do_bench runs it: no gradient to accumulate into
        q.grad = k.grad = v.grad = None
        step()

    def cudnn_step():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(d_out)

    def emit(row: dict) -> None:
        with (args.out / "flash_op_ab.jsonl").open("a") as f:
            f.write(json.dumps({"shape": args.shape, **row, **meta}) + "\n")

    cudnn_step()
    reference = [t.grad.float() for t in (q, k, v)]
    for _ in range(args.rounds):
        for name, backward in variants.items():
            fg.backward = backward  # flash_triton calls flash_gluon.backward
            step()
            times = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="all")
            host = enqueue_ms(fresh_step, rounds=11)
            kernels = timeline(fresh_step)
            errors = {name: ((t.grad.float() - ref).abs().max() / ref.abs().max()).item()
                      for name, t, ref in zip("qkv", (q, k, v), reference)}  # the cached launches' results
            row = {"variant": name, "median_ms": statistics.median(times), "min_ms": min(times),
                   "max_ms": max(times), "host_ms": host, "timeline": kernels, "max_error_vs_cudnn": errors}
            emit(row)
            print(f"{args.shape} {name}: median {row['median_ms']:.3f} (min {row['min_ms']:.3f}, max "
                  f"{row['max_ms']:.3f}) ms, host {host:.3f} ms", flush=True)
        times = triton.testing.do_bench(cudnn_step, warmup=25, rep=100, return_mode="all")
        emit({"variant": "cudnn", "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
              "timeline": timeline(cudnn_step)})
        print(f"{args.shape} cudnn: median {statistics.median(times):.3f} ms", flush=True)
    fg.backward = as_run
    with torch.no_grad():  # the host's time of each part of the op's step, and of cuDNN's step (medians of 11)
        o, lse = ft.flash_forward(q, k, v, True)
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        delta = ft.backward_preprocess(o, d_out, dq_acc)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        options = fg.schedule(q, k, True)

        def fwd_arguments():  # the op's forward launch as ``flash_gluon.forward`` makes it
            return fg.launch_arguments(q, k, v, True, None, options.get("folded", False),
                                       fg._programs(q.device) if options.get("persistent") else None, None,
                                       options.get("tma_store", False), False, options.get("order", "blocks"))

        fwd_launch = fwd_arguments()  # made once: Triton's launcher alone
        bwd_options = fg.backward_schedule(q, k, True)
        bwd_launch = fg.backward_launch_arguments(d_out, q, k, v, o, lse, True, None, delta, dq_acc, (dk, dv),
                                                  fg._programs(q.device) if bwd_options.get("persistent") else None,
                                                  None, bwd_options.get("order", "heads"),
                                                  bwd_options.get("head_group", 1))
        parts = {"op forward + backward": fresh_step, "cudnn forward + backward": cudnn_step,
                 "autograd floor (the op's allocations, no launches)": lambda: _Floor.apply(q, k, v).backward(d_out),
                 "gluon forward launch arguments": fwd_arguments,
                 "gluon forward, Triton's launcher alone": _launcher(fg._fwd_kernel, *fwd_launch[:3]),
                 "gluon backward, Triton's launcher alone": _launcher(*bwd_launch[:4]),
                 "flash_forward": lambda: ft.flash_forward(q, k, v, True),
                 "flash_backward": lambda: ft.flash_backward(d_out, q, k, v, o, lse, True),
                 "gluon forward launch": lambda: fg.forward(q, k, v, True, **fg.schedule(q, k, True)),
                 "gluon backward launch": lambda: fg.backward(d_out, q, k, v, o, lse, True, delta=delta,
                                                              dq_acc=dq_acc, dkdv=(dk, dv),
                                                              **fg.backward_schedule(q, k, True)),
                 "preprocess launch": lambda: ft.backward_preprocess(o, d_out, dq_acc),
                 "torch.empty": lambda: torch.empty(q.shape, dtype=torch.float32, device=q.device)}
        for name, fn in parts.items():
            with torch.enable_grad() if name.startswith(("op", "cudnn", "autograd")) else contextlib.nullcontext():
                part_ms = enqueue_ms(fn, calls=10, rounds=11)
            emit({"host_part": name, "host_ms": part_ms})
            print(f"{args.shape} host, {name}: {part_ms:.3f} ms", flush=True)
    profile = cProfile.Profile()  # where the host's time goes, the op as it runs
    profile.runcall(lambda: [fresh_step() for _ in range(50)])
    torch.cuda.synchronize()
    with (args.out / "flash_op_ab_host.txt").open("w") as f:
        f.write(f"{args.shape}: 50 forward + backward steps of the op under cProfile\n")
        pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(40)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
