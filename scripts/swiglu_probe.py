"""Does SwiGLU pay in the epilogue of its GEMM? A one-call probe for the step issue (GPU):
``python3 scripts/swiglu_probe.py OUT [--model xl] [--tokens 8192] [--gluon-only] [--backward] [--once]``.

The step computes h1 = x W1^T and h3 = x W3^T with cuBLAS, then g = SiLU(h1) * h3 in an Inductor kernel that reads
both back (3.5 ms a step at xl 4 x 2,048 on an H200, at the copy bandwidth: notes/train_step.md, session 47). Here
one Triton kernel (``swiglu_gemm``) computes a tile of h1 and the same tile of h3 from one read of x's tile, then
writes h1, h3 (the backward reads them) and g from its registers. Times, in bf16, each call replayed from a CUDA
graph between CUDA events (median of ``--reps``; the host's launch path left out), cuBLAS's two products plus the
compiled SwiGLU against the fused kernel at each tile configuration, with pointer loads and with TMA descriptors,
then the persistent warp-specialized Gluon kernel of torch_impl/swiglu_gluon.py (sm_90) at each of its
configurations; each fused kernel's largest difference from the unfused g first, relative to g's largest
magnitude (a wrong one is not timed). Then the backward: cuBLAS's dg = dy W2 plus the compiled SwiGLU backward
against the Gluon kernel with that backward in dg's epilogue.
Prints the rows and writes OUT/swiglu_probe.json as it measures them.
Not a record: it finds whether the lever exists (notes/train_step.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from torch_impl.attention.flash_triton import _descriptor_memory  # Triton's allocator for in-kernel descriptors

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): two (BLOCK_M, BLOCK_N) fp32 accumulators a program
CONFIGS = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
           (128, 128, 32, 8, 5), (128, 64, 64, 8, 5))


@triton.jit
def _swiglu_gemm_kernel(x, w1, w3, h1, h3, g, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of h1 = x W1^T, h3 = x W3^T (x (M, K), W1 and W3 (N, K), all contiguous) and
    g = SiLU(h1) * h3, h1 and h3 rounded to the output dtype first, as the unfused step rounds them. Programs run
    GROUP_M row tiles down a column of tiles before the next (the weights' tiles stay in L2)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % rows_in_group
    pid_n = (pid % group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if TMA:
        x_desc = tl.make_tensor_descriptor(x, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
        w1_desc = tl.make_tensor_descriptor(w1, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
        w3_desc = tl.make_tensor_descriptor(w3, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if TMA:  # out-of-bounds rows and columns read as zeros
            a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b1 = w1_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            b3 = w3_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        else:
            cols = k * BLOCK_K + offs_k
            a = tl.load(x + offs_m[:, None] * K + cols[None, :],
                        mask=(offs_m[:, None] < M) & (cols[None, :] < K), other=0.0)
            w_mask = (offs_n[:, None] < N) & (cols[None, :] < K)
            b1 = tl.load(w1 + offs_n[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
            b3 = tl.load(w3 + offs_n[:, None] * K + cols[None, :], mask=w_mask, other=0.0)
        acc1 = tl.dot(a, tl.trans(b1), acc1, input_precision=PRECISION)
        acc3 = tl.dot(a, tl.trans(b3), acc3, input_precision=PRECISION)
    out = h1.dtype.element_ty
    gate, up = acc1.to(out), acc3.to(out)
    gate32 = gate.to(tl.float32)
    product = (gate32 * tl.sigmoid(gate32) * up.to(tl.float32)).to(out)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    at = offs_m[:, None] * N + offs_n[None, :]
    tl.store(h1 + at, gate, mask=mask)
    tl.store(h3 + at, up, mask=mask)
    tl.store(g + at, product, mask=mask)


def swiglu_gemm(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, config=CONFIGS[0], tma: bool = False):
    """(h1, h3, g) of x (M, K) and W1, W3 (N, K), contiguous, one kernel (fp32 inputs multiply in IEEE fp32, not
    TF32: bf16 and fp16 ignore it)."""
    if not all(t.is_contiguous() for t in (x, w1, w3)):
        raise ValueError("swiglu_gemm: x, W1 and W3 must be contiguous")
    (m, k), n = x.shape, w1.shape[0]
    block_m, block_n, block_k, warps, stages = config
    h1, h3, g = (x.new_empty(m, n) for _ in range(3))
    if tma:
        triton.set_allocator(_descriptor_memory)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _swiglu_gemm_kernel[grid](x, w1, w3, h1, h3, g, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                              GROUP_M=8, TMA=tma, PRECISION="ieee", num_warps=warps, num_stages=stages)
    return h1, h3, g


def gluon_configs() -> tuple:
    """The Gluon kernel's configurations (torch_impl.swiglu_gluon) where it can run: sm_90 and a Triton with
    Gluon's Hopper API; else none."""
    if torch.cuda.get_device_capability() != (9, 0):
        return ()
    try:
        from torch_impl.swiglu_gluon import CONFIGS
    except (ImportError, AttributeError) as error:
        print(f"swiglu_probe: no Gluon kernel here ({error})", file=sys.stderr)
        return ()
    return CONFIGS


def _launch_once(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor) -> int:
    """``--once``: x W1^T and dy W2 by cuBLAS, then the Gluon forward and backward (plain and with SwiGLU's
    backward) at their first configurations, each launched once: what ``ncu -k regex:...`` profiles."""
    configs = gluon_configs()
    if not configs:
        print("swiglu_probe: --once needs the Gluon kernels (sm_90)", file=sys.stderr)
        return 2
    from torch_impl.swiglu_gluon import BACKWARD_CONFIGS, swiglu_backward_gemm
    from torch_impl.swiglu_gluon import swiglu_gemm as gluon_gemm

    (m, d), f = x.shape, w1.shape[0]
    dy = torch.randn(m, d, device=x.device, dtype=x.dtype)
    w2 = torch.randn(d, f, device=x.device, dtype=x.dtype) / f ** 0.5
    h1, h3 = x @ w1.T, dy @ w2
    gluon_gemm(x, w1, w3, configs[0])
    swiglu_backward_gemm(dy, w2, h1, h3, BACKWARD_CONFIGS[0], plain=True)
    swiglu_backward_gemm(dy, w2, h1, h3, BACKWARD_CONFIGS[0])
    torch.cuda.synchronize()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="xl")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x sequence)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--once", action="store_true", help="launch cuBLAS's products and the Gluon kernels' first "
                        "configurations (the backward's plain too) once each, untimed, for Nsight Compute")
    parser.add_argument("--backward", action="store_true", help="the backward's rows only (the forward's skipped)")
    parser.add_argument("--gluon-only", action="store_true", help="the Gluon kernels' rows and their anchors only (no "
                        "Triton-written fused forwards, no tile orders)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("swiglu_probe: needs a CUDA device", file=sys.stderr)
        return 2
    from parallelism_calc.specs import get_model
    from torch_impl.timing import median_ms

    def time_ms(fn) -> float:  # each call's device time, replayed from a CUDA graph: the host's launch path of
        return median_ms(fn, args.reps, graph=True)  # a kernel with host-built TMA descriptors outlasts the kernel

    spec = get_model(args.model)
    d, f, uses = spec.d_model, spec.d_ff, spec.n_layers
    x = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16)
    w1, w3 = (torch.randn(f, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5 for _ in range(2))
    swiglu = torch.compile(lambda a, b: F.silu(a) * b)

    def unfused():
        a, b = x @ w1.t(), x @ w3.t()
        return a, b, swiglu(a, b)

    flops = 2 * 2 * args.tokens * d * f
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)

    def add(row: dict, flops: float | None = None) -> None:  # printed and written as measured: a call cut short
        rows.append(row)                                          # keeps what it had
        if "error" in row:
            print(f"{row['variant']:>40} {row['error']}", flush=True)
        else:
            if flops:  # the rows that run products
                row["tflops"] = flops / row["ms"] / 1e9
            row["ms_per_step"] = row["ms"] * uses
            print(f"{row['variant']:>40} {row['ms']:8.3f} ms {row.get('tflops', float('nan')):7.1f} TFLOP/s "
                  f"{row['ms_per_step']:7.2f} ms/step  max diff {row.get('max_diff', float('nan')):.2e}", flush=True)
        (args.out / "swiglu_probe.json").write_text(json.dumps(
            {"model": args.model, "tokens": args.tokens, "device": torch.cuda.get_device_name(),
             "torch": torch.__version__, "triton": triton.__version__, "rows": rows}, indent=1))

    def fused(name: str, fn, expected: tuple, flops: float = flops) -> None:
        """A fused kernel's row: its last outputs against the unfused ones (``expected``) first, each within 5% of
        its largest magnitude (far above bf16's rounding, far below a wrong tile's error; a wrong kernel is not
        timed), then its time."""
        try:
            got = fn()[-len(expected):]
            diffs = [(a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-30)
                     for a, b in zip(got, expected)]
            diff = max(diffs)
            if not diff <= 0.05:  # NaN too
                add({"variant": name, "error": f"wrong: differs from the unfused by {diff:.3g} of its largest",
                     "max_diff": diff})
                return
            add({"variant": name, "ms": time_ms(fn), "max_diff": diff}, flops)
        except Exception as error:  # noqa: BLE001 (a config that does not compile, fit or run: a row)
            message = (str(error).splitlines() or [repr(error)])[0][:300]  # CUDA's last line is boilerplate
            add({"variant": name, "error": f"{type(error).__name__}: {message}"})

    if args.once:
        return _launch_once(x, w1, w3)
    expected = unfused()[2:]
    h1, h3 = x @ w1.t(), x @ w3.t()
    if not args.backward:
        add({"variant": "cuBLAS x2 + compiled SwiGLU", "ms": time_ms(unfused), "max_diff": 0.0}, flops)
        add({"variant": "(cuBLAS x2 alone)", "ms": time_ms(lambda: (x @ w1.t(), x @ w3.t()))}, flops)
        add({"variant": "(compiled SwiGLU alone)", "ms": time_ms(lambda: swiglu(h1, h3))})
    for tma in () if args.backward or args.gluon_only else (False, True):
        for config in CONFIGS:
            fused(f"fused {'TMA' if tma else 'pointers'} {'x'.join(map(str, config[:3]))} w{config[3]} s{config[4]}",
                  lambda: swiglu_gemm(x, w1, w3, config, tma), expected)
    configs = gluon_configs()  # last: a kernel new to the device may hang, and the call's timeout ends it
    if configs:
        from torch_impl.swiglu_gluon import BACKWARD_CONFIGS, swiglu_backward_gemm, swiglu_grads
        from torch_impl.swiglu_gluon import swiglu_gemm as gluon_gemm

    def gluon_name(config) -> str:
        return (f"gluon {'x'.join(map(str, config[0]))} s{config[1]} r{config[2]} b{config[3]} "
                f"{'cooperative' if config[4] else 'ping-pong'}")

    for config in () if args.backward else configs:
        fused(gluon_name(config), lambda: gluon_gemm(x, w1, w3, config), expected)
    # the first configuration's tile order (8 above)
    for group_m in (1, 4, 16) if configs and not (args.backward or args.gluon_only) else ():
        fused(f"{gluon_name(configs[0])} group_m {group_m}", lambda: gluon_gemm(x, w1, w3, configs[0], group_m),
              expected)
    if not configs:
        return 0
    # the backward: dg = dy W2 by cuBLAS, then SwiGLU's backward compiled, against the Gluon kernel that computes
    # it in dg's epilogue (dg never written or read back)
    dy = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(d, f, device="cuda", dtype=torch.bfloat16) / f ** 0.5
    dswiglu = torch.compile(lambda dg, a, b: tuple(t.to(torch.bfloat16) for t in swiglu_grads(dg, a, b)))

    def unfused_backward():
        return dswiglu(dy @ w2, h1, h3)

    backward_flops = flops / 2
    expected = unfused_backward()
    add({"variant": "backward: cuBLAS dg + compiled SwiGLU backward", "ms": time_ms(unfused_backward),
         "max_diff": 0.0}, backward_flops)
    add({"variant": "(backward: cuBLAS dg alone)", "ms": time_ms(lambda: dy @ w2)}, backward_flops)
    dg = dy @ w2
    add({"variant": "(backward: compiled SwiGLU backward alone)", "ms": time_ms(lambda: dswiglu(dg, h1, h3))})
    for config in BACKWARD_CONFIGS:
        fused(f"backward: gluon {'x'.join(map(str, config[0]))} s{config[1]} r{config[2]} "
              f"{'W2^T' if config[3] else 'W2'} ping-pong",
              lambda: swiglu_backward_gemm(dy, w2, h1, h3, config), expected, backward_flops)
    for config in BACKWARD_CONFIGS[:2]:  # the same GEMM with dg itself out: what the epilogue's work costs
        fused(f"(backward: gluon {'x'.join(map(str, config[0]))} {'W2^T' if config[3] else 'W2'}, dg alone)",
              lambda: swiglu_backward_gemm(dy, w2, h1, h3, config, plain=True)[:1], (dg,), backward_flops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
