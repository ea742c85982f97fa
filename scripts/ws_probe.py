"""Does Triton's Hopper warp specialization (``tl.range(..., warp_specialize=True)``, Triton 3.6) speed up the
FlashAttention loops? A one-call go/no-go probe for issue 14: ``PYTHONPATH=. python3 scripts/ws_probe.py OUT``.

Two minimal kernels, each compiled with and without warp specialization from the same code: the forward loop
(online softmax over key tiles) and the two-pass backward's dK/dV loop (over query tiles; no dQ: Triton 3.6's pass
rejects the TMA reduce-add of the fused backward, and loads other than through tensor descriptors). Non-causal, so
every tile is the same work; all loads through TMA descriptors, as the pass needs. Anchors in the same process:
cuDNN SDPA and our kernels (``torch_impl.attention.flash_triton``, non-causal) at the same shape. Each probe kernel
is checked against cuDNN (relative Frobenius error). Rows go to OUT/ws_probe.jsonl; a table is printed.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from analysis.records import provenance
from torch_impl.attention import flash_triton as ft

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))


@triton.jit
def _rows(T, rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA descriptor over the (rows, HEAD_DIM) matrix of every head's rows, tiles of BLOCK rows."""
    return tl.make_tensor_descriptor(T, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1], block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def _fwd(Q, K, V, O, LSE, sm_scale, n, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         WS: tl.constexpr):
    """O and LSE (natural log) of one query tile of one head; rows of all heads stacked: (B*H*n, d)."""
    start_m = tl.program_id(0) * BLOCK_M
    row0 = tl.program_id(1) * n
    rows = tl.num_programs(1) * n
    q_desc = _rows(Q, rows, HEAD_DIM, BLOCK_M)
    k_desc = _rows(K, rows, HEAD_DIM, BLOCK_N)
    v_desc = _rows(V, rows, HEAD_DIM, BLOCK_N)
    q = q_desc.load([row0 + start_m, 0])
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    scale = sm_scale * LOG2E
    for start_n in tl.range(0, n, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([row0 + start_n, 0])
        s = tl.dot(q, k.T) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([row0 + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    offs_m = row0 + start_m + tl.arange(0, BLOCK_M)
    o = (acc / l_i[:, None]).to(O.dtype.element_ty)
    tl.store(O + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], o)
    tl.store(LSE + offs_m, (m_i + tl.math.log2(l_i)) / LOG2E)


@triton.jit
def _dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, n, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, WS: tl.constexpr):
    """dK, dV of one key tile of one head, over every query tile (non-causal)."""
    start_n = tl.program_id(0) * BLOCK_N
    row0 = tl.program_id(1) * n
    rows = tl.num_programs(1) * n
    q_desc = _rows(Q, rows, HEAD_DIM, BLOCK_M)
    do_desc = _rows(DO, rows, HEAD_DIM, BLOCK_M)
    k_desc = _rows(K, rows, HEAD_DIM, BLOCK_N)
    v_desc = _rows(V, rows, HEAD_DIM, BLOCK_N)
    k = k_desc.load([row0 + start_n, 0])
    v = v_desc.load([row0 + start_n, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    scale = sm_scale * LOG2E
    for start_m in tl.range(0, n, BLOCK_M, warp_specialize=WS):
        q = q_desc.load([row0 + start_m, 0])
        do = do_desc.load([row0 + start_m, 0])
        offs_m = row0 + start_m + tl.arange(0, BLOCK_M)
        lse2 = tl.load(LSE + offs_m) * LOG2E
        delta = tl.load(DELTA + offs_m)
        pt = tl.math.exp2(tl.dot(k, q.T) * scale - lse2[None, :])
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dst = (pt * (tl.dot(v, do.T) - delta[None, :])).to(q.dtype)
        dk = tl.dot(dst, q, dk)
    offs_n = row0 + start_n + tl.arange(0, BLOCK_N)
    offs = offs_n[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + offs, dv.to(DV.dtype.element_ty))


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return sdpa(q, k, v, is_causal=False)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench(fn) -> float:
    """Median ms of launches from Python (``do_bench``: host overhead is small against these ms-long kernels; a
    CUDA-graph capture of the non-causal cuDNN backward failed in call 3). One call first: compilation, tuning."""
    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def probe(shape, emit) -> None:
    b, h, n, d = shape
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sm_scale = d ** -0.5
    flops = 4 * b * h * n * n * d  # two products of 2 n^2 d a head; the dK/dV loop does four (S^T, dV, dP^T, dK)
    row = {"shape": "x".join(map(str, shape)), "causal": False}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cudnn(*leaves)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out, leaves, do)
    emit({**row, "variant": "cudnn", "pass": "fwd", "ms": bench(lambda: cudnn(q, k, v)), "flops": flops})
    emit({**row, "variant": "cudnn", "pass": "fwd+bwd", "flops": 3.5 * flops,
          "ms": bench(lambda: torch.autograd.grad(cudnn(*leaves), leaves, do))})
    emit({**row, "variant": "ours", "pass": "fwd", "flops": flops,
          "ms": bench(lambda: ft.flash_attention(q, k, v, False))})
    emit({**row, "variant": "ours", "pass": "fwd+bwd", "flops": 3.5 * flops,
          "ms": bench(lambda: torch.autograd.grad(ft.flash_attention(*leaves, False), leaves, do))})
    flat = [t.reshape(b * h * n, d) for t in (q, k, v, do)]
    o = torch.empty_like(flat[0])
    lse = torch.empty(b * h * n, device="cuda", dtype=torch.float32)
    dk, dv = torch.empty_like(flat[1]), torch.empty_like(flat[2])
    delta = (out.detach().float() * do.float()).sum(-1).reshape(-1)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for ws in (False, True):
        for bm, bn, warps, stages in ((128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
            config = {"ws": ws, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                def fwd():
                    _fwd[(n // bm, b * h)](flat[0], flat[1], flat[2], o, lse, sm_scale, n, d, bm, bn, ws,
                                           num_warps=warps, num_stages=stages)
                fwd()
                emit({**row, "variant": "probe", "pass": "fwd", **config, "flops": flops, "ms": bench(fwd),
                      "o_rel_vs_cudnn": rel(o.view(b, h, n, d), out)})
            except Exception as err:  # a configuration that does not compile is a row
                emit({**row, "variant": "probe", "pass": "fwd", **config,
                      "error": f"{type(err).__name__}: {err}"[:300]})
        for bm, bn, warps, stages in ((64, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3)):
            config = {"ws": ws, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                def dkdv():
                    _dkdv[(n // bn, b * h)](flat[0], flat[1], flat[2], flat[3], lse, delta, dk, dv, sm_scale, n, d,
                                            bm, bn, ws, num_warps=warps, num_stages=stages)
                dkdv()
                emit({**row, "variant": "probe", "pass": "dkdv", **config, "flops": 2 * flops,
                      "ms": bench(dkdv), "dk_rel_vs_cudnn": rel(dk.view(b, h, n, d), dk_ref),
                      "dv_rel_vs_cudnn": rel(dv.view(b, h, n, d), dv_ref)})
            except Exception as err:
                emit({**row, "variant": "probe", "pass": "dkdv", **config,
                      "error": f"{type(err).__name__}: {err}"[:300]})


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not torch.cuda.is_available():
        print("usage: ws_probe.py OUT (a CUDA GPU with TMA: sm_90 or later)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    meta = {**provenance(torch.cuda.get_device_name()), "command": "python3 scripts/ws_probe.py OUT"}
    rows = []

    def emit(r: dict) -> None:
        r = {**r, "tflops": r["flops"] / r["ms"] / 1e9 if "ms" in r else None, "provenance": meta}
        rows.append(r)
        with open(out / "ws_probe.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print({k: v for k, v in r.items() if k != "provenance"}, flush=True)

    for shape in ((1, 16, 16384, 64), (4, 32, 2048, 64), (1, 16, 16384, 128)):
        try:
            probe(shape, emit)
        except Exception:
            traceback.print_exc()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
