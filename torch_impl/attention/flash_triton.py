"""FlashAttention-2 in Triton: forward, and a backward with separate dK/dV and dQ passes (no atomics).

Reads top to bottom: the Triton kernels (forward; backward preprocessing D = rowsum(dO * O); dK/dV; dQ) ->
the launchers, which check shapes and dtypes, pick tile configurations (autotuned on a GPU, keyed by
power-of-two buckets of the lengths so tuning does not rerun every call) and allocate outputs -> the
``torch.autograd.Function`` -> the backend ``flash_triton`` of ``TransformerLM``.

* q: (..., n_q, d), k and v: (..., n_k, d), any leading dims, any lengths (ragged tiles are masked), head
  dims 16, 32, 64, 128; fp32, bf16 and fp16. The output has the input dtype; softmax statistics are fp32.
* Causal attention is top-left aligned (query i attends keys j <= i, also when n_q != n_k), as the CS336
  reference. Key tiles wholly above the diagonal are skipped; tiles on the diagonal are handled in a
  separate loop stage with the mask, the tiles below it run unmasked.
* The forward saves O and one log-sum-exp tensor L (..., n_q) (natural log, fp32); the backward recomputes
  P = exp(S - L) tile by tile, so no n_q x n_k tensor is ever materialized.
* The softmax runs in base 2: S is scaled by log2(e) / sqrt(d) once, so exp becomes the cheaper exp2.
* fp32 inputs use Triton's default dot precision (TF32 on tensor cores): measured ~2e-3 relative error on
  O and the gradients against fp64 (TF32 rounds both products, QK^T and PV, to 10 mantissa bits).

References: Dao 2023, "FlashAttention-2" (algorithms 1 and 2); the Triton fused-attention tutorial; the
flash-attention repository's ``flash_attn_triton.py``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from torch_impl.attention.registry import register_attention

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile(base, b, h, stride_b, stride_h, stride_row, rows, cols):
    """Pointers to a (rows, cols) tile of head (b, h): rows along the sequence, cols along the head dim."""
    return base + b * stride_b + h * stride_h + rows[:, None] * stride_row + cols[None, :]


@triton.jit
def _query_tile(IS_CAUSAL: tl.constexpr, n_q, BLOCK_M: tl.constexpr):
    """The query tile of this program: in reverse order when causal (the work grows with the tile index)."""
    if IS_CAUSAL:
        return tl.cdiv(n_q, BLOCK_M) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, lo, hi, n_k, qk_scale,
               MASK_DIAGONAL: tl.constexpr, MASK_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over key tiles [lo, hi): acc, l_i, m_i updated in place (base-2 statistics)."""
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,)
        if MASK_KEYS:
            k = tl.load(k_ptrs, mask=cols[None, :] < n_k, other=0.0)  # (D, BLOCK_N)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, k)  # (BLOCK_M, BLOCK_N), unscaled
        if MASK_DIAGONAL:
            qk = tl.where(offs_m[:, None] >= cols[None, :], qk, -float("inf"))
        if MASK_KEYS:
            qk = tl.where(cols[None, :] < n_k, qk, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # log2 domain (qk_scale > 0 commutes with max)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # one fused multiply-add per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK_KEYS:
            v = tl.load(v_ptrs, mask=cols[:, None] < n_k, other=0.0)  # (BLOCK_N, D)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sm_scale,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                n_heads, n_q, n_k, n_q_bucket, n_k_bucket,
                HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch x head): O = softmax(Q K^T * scale) V and L = logsumexp.
    Causal: the last query tiles see the most keys, so they are launched first (less tail at the end)."""
    start_m = _query_tile(IS_CAUSAL, n_q, BLOCK_M) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = _tile(Q, b, h, stride_qb, stride_qh, stride_qm, offs_m, offs_d)
    k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]  # K^T tile
    v_ptrs = _tile(V, b, h, stride_vb, stride_vh, stride_vn, offs_n, offs_d)
    if EVEN_M:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=offs_m[:, None] < n_q, other=0.0)  # (BLOCK_M, D)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:
        # Stage 1: key tiles wholly below the diagonal (keys < start_m), no causal mask.
        hi = tl.minimum(start_m, n_k)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                                   0, hi, n_k, qk_scale, False, not EVEN_N, BLOCK_N)
        # Stage 2: the tiles on the diagonal, masked; tiles above it are never visited.
        hi = tl.minimum(start_m + BLOCK_M, n_k)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                                   start_m, hi, n_k, qk_scale, True, not EVEN_N, BLOCK_N)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                                   0, n_k, n_k, qk_scale, False, not EVEN_N, BLOCK_N)
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634  # back to natural log
    o_ptrs = _tile(O, b, h, stride_ob, stride_oh, stride_om, offs_m, offs_d)
    lse_ptrs = LSE + bh * n_q + offs_m
    if EVEN_M:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty))
        tl.store(lse_ptrs, lse)
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < n_q)
        tl.store(lse_ptrs, lse, mask=offs_m < n_q)


@triton.jit
def _bwd_preprocess(O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                    n_heads, n_q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO * O) in fp32, one row per query: (batch x head, n_q)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_m[:, None] < n_q
    o = tl.load(_tile(O, b, h, stride_ob, stride_oh, stride_om, offs_m, offs_d), mask=mask, other=0.0)
    do = tl.load(_tile(DO, b, h, stride_dob, stride_doh, stride_dom, offs_m, offs_d),
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * n_q + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qm, stride_dom, offs_n, offs_m_base,
                lo, hi, n_q, n_k, qk_scale, MASK_DIAGONAL: tl.constexpr, MASK_ROWS: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), working with transposed tiles."""
    q_ptrs += lo * stride_qm
    do_ptrs += lo * stride_dom
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m_base  # (BLOCK_M,)
        if MASK_ROWS:
            row_ok = offs_m < n_q
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_ptr + offs_m)
            delta = tl.load(delta_ptr + offs_m)
        qkT = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M), log2 domain
        pT = tl.math.exp2(qkT - lse[None, :] * 1.4426950408889634)
        if MASK_DIAGONAL:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if MASK_ROWS:
            pT = tl.where(row_ok[None, :] & (offs_n[:, None] < n_k), pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do)  # (BLOCK_N, D)
        dpT = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                     n_heads, n_q, n_k, n_q_bucket, n_k_bucket,
                     HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                     RAGGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch x head): dK, dV over every query tile that sees the key tile.
    RAGGED = not (EVEN_M and EVEN_N): rows and keys of partial tiles are masked."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_mask = offs_n[:, None] < n_k
    k = tl.load(_tile(K, b, h, stride_kb, stride_kh, stride_kn, offs_n, offs_d), mask=kv_mask,
                other=0.0)  # (BLOCK_N, D)
    v = tl.load(_tile(V, b, h, stride_vb, stride_vh, stride_vn, offs_n, offs_d), mask=kv_mask,
                other=0.0)
    q_ptrs = _tile(Q, b, h, stride_qb, stride_qh, stride_qm, offs_m, offs_d)
    do_ptrs = _tile(DO, b, h, stride_dob, stride_doh, stride_dom, offs_m, offs_d)
    lse_ptr = LSE + bh * n_q
    delta_ptr = DELTA + bh * n_q
    qk_scale = sm_scale * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:
        # Query tiles on the diagonal (rows start_n .. start_n + BLOCK_N), masked; then the rows below, unmasked.
        diag_end = tl.minimum(start_n + BLOCK_N, n_q)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qm, stride_dom, offs_n,
                             offs_m, start_n, diag_end, n_q, n_k, qk_scale, True, RAGGED, BLOCK_M)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qm, stride_dom, offs_n,
                             offs_m, start_n + BLOCK_N, n_q, n_q, n_k, qk_scale, False, RAGGED, BLOCK_M)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, stride_qm, stride_dom, offs_n,
                             offs_m, 0, n_q, n_q, n_k, qk_scale, False, RAGGED, BLOCK_M)
    dk *= sm_scale
    tl.store(_tile(DK, b, h, stride_dkb, stride_dkh, stride_dkn, offs_n, offs_d),
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(_tile(DV, b, h, stride_dvb, stride_dvh, stride_dvn, offs_n, offs_d),
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n_base, lo, hi, n_k,
              qk_scale, MASK_DIAGONAL: tl.constexpr, MASK_KEYS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        if MASK_KEYS:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < n_k, other=0.0)  # (BLOCK_N, D)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < n_k, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk - lse[:, None])
        if MASK_DIAGONAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if MASK_KEYS:
            p = tl.where(offs_n[None, :] < n_k, p, 0.0)
        dp = tl.dot(do, tl.trans(v))  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sm_scale,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
                   stride_dqb, stride_dqh, stride_dqm,
                   n_heads, n_q, n_k, n_q_bucket, n_k_bucket,
                   HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch x head): dQ over every key tile the query tile sees (causal: the
    heaviest tiles first, as in the forward)."""
    start_m = _query_tile(IS_CAUSAL, n_q, BLOCK_M) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m[:, None] < n_q
    q = tl.load(_tile(Q, b, h, stride_qb, stride_qh, stride_qm, offs_m, offs_d), mask=row_mask,
                other=0.0)
    do = tl.load(_tile(DO, b, h, stride_dob, stride_doh, stride_dom, offs_m, offs_d),
                 mask=row_mask, other=0.0)
    lse = tl.load(LSE + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0) * 1.4426950408889634  # log2 domain
    delta = tl.load(DELTA + bh * n_q + offs_m, mask=offs_m < n_q, other=0.0)
    k_ptrs = _tile(K, b, h, stride_kb, stride_kh, stride_kn, offs_n, offs_d)
    v_ptrs = _tile(V, b, h, stride_vb, stride_vh, stride_vn, offs_n, offs_d)
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if IS_CAUSAL:
        hi = tl.minimum(start_m, n_k)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, 0, hi, n_k,
                       qk_scale, False, not EVEN_N, BLOCK_N)
        hi = tl.minimum(start_m + BLOCK_M, n_k)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, start_m, hi,
                       n_k, qk_scale, True, not EVEN_N, BLOCK_N)
    else:
        dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, 0, n_k, n_k,
                       qk_scale, False, not EVEN_N, BLOCK_N)
    dq *= sm_scale
    tl.store(_tile(DQ, b, h, stride_dqb, stride_dqh, stride_dqm, offs_m, offs_d),
             dq.to(DQ.dtype.element_ty), mask=row_mask)


# ------------------------------------------------------------------------------ tile configurations


def _configs(*configs: tuple[int, int, int, int]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples: a few shapes known to suit Hopper, tuned per key."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in configs]


_TUNE_KEY = ["n_q_bucket", "n_k_bucket", "HEAD_DIM", "IS_CAUSAL"]
# Forward and dQ: BLOCK_M % BLOCK_N == 0, so the diagonal stage starts on a key-tile boundary.
_fwd_tuned = triton.autotune(_configs((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                                      (128, 64, 4, 4), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4)),
                             key=_TUNE_KEY)(_fwd_kernel)
_dkdv_tuned = triton.autotune(_configs((32, 128, 4, 3), (32, 128, 4, 5), (32, 128, 8, 3), (64, 128, 8, 2),
                                       (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 4)), key=_TUNE_KEY)(_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(_configs((128, 32, 4, 3), (128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 2),
                                     (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4)), key=_TUNE_KEY)(_bwd_dq_kernel)
_INTERPRET_TILES = {"BLOCK_M": 16, "BLOCK_N": 16}  # the interpreter runs one fixed, small configuration


# ------------------------------------------------------------------------------------------- launchers


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., n, d) -> (B, H, n, d) without copying where the layout allows, last dim contiguous."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.ndim == 2:
        return t[None, None]
    if t.ndim == 3:
        return t[None]
    if t.ndim > 4:
        return t.reshape(-1, *t.shape[-3:])
    return t


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """ValueError for inputs the kernels do not take (instead of a Triton compile trace)."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"{name} must be (..., n, d), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; accepted: float32, bfloat16, float16")
        if t.device.type != "cuda" and not INTERPRET:
            raise ValueError(f"{name} is on {t.device}; FlashAttention2Triton needs CUDA tensors "
                             "(or TRITON_INTERPRET=1 set before triton is imported, for CPU tensors)")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device; got {q.dtype}/{k.dtype}/{v.dtype}, "
                         f"{q.device}/{k.device}/{v.device}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(f"leading dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v need the same length: {k.shape[-2]} != {v.shape[-2]}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} is not supported; accepted: {', '.join(map(str, HEAD_DIMS))}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"empty sequence: n_q={q.shape[-2]}, n_k={k.shape[-2]}")


def _bucket(n: int) -> int:
    return triton.next_power_of_2(n)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _launch(tuned, kernel, grid_rows: int, by: str, *args, **meta):
    """Run the autotuned kernel on a GPU, or the plain one with small fixed tiles under the interpreter."""
    if INTERPRET:
        grid = (triton.cdiv(grid_rows, _INTERPRET_TILES[by]), meta.pop("_bh"))
        kernel[grid](*args, **meta, **_INTERPRET_TILES)
    else:
        bh = meta.pop("_bh")
        tuned[lambda m: (triton.cdiv(grid_rows, m[by]), bh)](*args, **meta)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """O (q's shape and dtype) and L (q.shape[:-1], fp32) of q, k, v already as (B, H, n, d)."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads, n_q, device=q.device, dtype=torch.float32)
    even = {"EVEN_M": n_q % 128 == 0, "EVEN_N": n_k % 128 == 0}  # 128 is a multiple of every tile size
    _launch(_fwd_tuned, _fwd_kernel, n_q, "BLOCK_M",
            q, k, v, o, lse, 1.0 / math.sqrt(d), *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            heads, n_q, n_k, _bucket(n_q), _bucket(n_k), HEAD_DIM=d, IS_CAUSAL=is_causal, _bh=batch * heads, **even)
    return o, lse


def flash_backward(do, q, k, v, o, lse, is_causal: bool):
    """dQ, dK, dV (each like its input) of (B, H, n, d) tensors: preprocessing, then the dK/dV and dQ passes."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty_like(lse)
    block = 16 if INTERPRET else 128
    _bwd_preprocess[(triton.cdiv(n_q, block), batch * heads)](
        o, do, delta, *_strides(o), *_strides(do), heads, n_q, HEAD_DIM=d, BLOCK_M=block)
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    sm_scale = 1.0 / math.sqrt(d)
    even = {"EVEN_M": n_q % 128 == 0, "EVEN_N": n_k % 128 == 0}
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    sizes = (heads, n_q, n_k, _bucket(n_q), _bucket(n_k))
    _launch(_dkdv_tuned, _bwd_dkdv_kernel, n_k, "BLOCK_N", q, k, v, do, lse, delta, dk, dv, sm_scale,
            *common, *_strides(dk), *_strides(dv), *sizes, HEAD_DIM=d, IS_CAUSAL=is_causal,
            RAGGED=not (even["EVEN_M"] and even["EVEN_N"]), _bh=batch * heads, **even)
    _launch(_dq_tuned, _bwd_dq_kernel, n_q, "BLOCK_M", q, k, v, do, lse, delta, dq, sm_scale,
            *common, *_strides(dq), *sizes, HEAD_DIM=d, IS_CAUSAL=is_causal, _bh=batch * heads, **even)
    return dq, dk, dv


# ------------------------------------------------------------------------------------ autograd Function


class FlashAttention2Triton(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) [+ causal mask]) v with Triton kernels; saves O and L (..., n_q), fp32."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_inputs(q, k, v)
        q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
        o, lse = flash_forward(q4, k4, v4, bool(is_causal))
        ctx.is_causal = bool(is_causal)
        ctx.save_for_backward(lse.reshape(q.shape[:-1]), q, k, v, o.reshape(q.shape))
        return o.reshape(q.shape)

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        lse, q, k, v, o = ctx.saved_tensors
        q4, k4, v4, o4, do4 = (_as_4d(t) for t in (q, k, v, o, do))
        dq, dk, dv = flash_backward(do4, q4, k4, v4, o4, lse.reshape(q4.shape[:-1]), ctx.is_causal)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None


@register_attention("flash_triton")
def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    return FlashAttention2Triton.apply(q, k, v, is_causal)
