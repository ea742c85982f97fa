"""FlashAttention-2 in Triton: a forward kernel and two backwards, exposed as PyTorch custom ops so
``torch.compile(fullgraph=True)`` traces through them without a graph break. Both backwards first take
D = rowsum(dO * O); then
* fused (the default on sm_90 and later): one pass per key tile computes S, P, dP, dS once for each query tile
  and adds dQ = dS K into an fp32 buffer with TMA reduce-adds of whole tiles (five products per tile pair);
  the order of those adds varies, so dQ may differ in the last bits from run to run;
* two-pass (``torch.use_deterministic_algorithms(True)``, and GPUs older than sm_90, where per-element atomics
  lose to it): a dK/dV pass, then a dQ pass that recomputes S and dP (seven products), no atomics, the same
  bits every run.

Reads top to bottom: the Triton kernels -> tile configurations -> the launchers, which check the inputs, pick
tiles and allocate outputs -> the custom ops ``torch.ops.torch_impl.flash_attention_forward`` / ``_backward``
(fake implementations for tracing, the backward registered as the forward's autograd formula), and
``flash_attention_rope_forward`` / ``_backward``, the same on the model's one q, k, v product (RoPE and the split in
the forward, the product's gradient written by the backward: ``flash_backward_packed``) -> the public
``flash_attention`` function (the ``flash_triton`` backend of ``TransformerLM``) and ``FlashAttention2Triton``,
the ``torch.autograd.Function`` of DESIGN.md, both routed to the same ops; ``flash_triton_attention_of_product``
and ``FlashAttentionOfProduct``; ``flash_attention_input_forward`` / ``_backward``, the model's input and q, k, v
weights to the attention in one op (the product made rotated by RoPE in its Gluon epilogue: ``qkv_rope_gluon``),
behind ``flash_triton_attention_of_input`` (the backend's attention of the input,
``registry.register_packed_attention``; the product route where the Gluon product cannot run) and
``FlashAttentionOfInput``.

Inputs: q (..., H, n_q, d), k and v (..., H_kv, n_k, d), the same leading dims.
* Grouped-query attention: H must be a multiple of H_kv; query head h reads key/value head h // (H / H_kv)
  (``F.scaled_dot_product_attention(..., enable_gqa=True)``'s convention); dK and dV sum over the H / H_kv query
  heads of their group, inside the dK/dV kernel (no expanded copies of k and v). 2-D inputs are one head.
* Any strides: the kernels take the batch, head, sequence and head-dim stride of every tensor (a transposed
  (B, T, H, d) view is read in place); leading dims beyond (B, H) are merged by ``reshape`` (a copy only where
  their layout cannot be merged).
* Head dim d: a multiple of 8 from 16 to 256 (80, 96, 112, 160, 192 included). The kernels tile the head dim
  with the next power of two (BLOCK_D >= d) and mask the loads and stores of the columns d..BLOCK_D-1, which
  read as zeros and add nothing to the dot products: no padded copy of any tensor.
* Any n_q >= 0, n_k >= 1 (ragged last tiles are masked). Causal attention is top-left aligned: query i sees
  keys j <= i, also when n_q != n_k, as ``F.scaled_dot_product_attention(is_causal=True)`` (its mask is
  ``ones(n_q, n_k).tril()``) and the CS336 reference (the flash-attn CUDA package aligns bottom-right instead).
  Every query sees key 0, so no row is empty. Key tiles wholly above the diagonal are skipped; tiles on it run
  in a masked loop stage of their own.
* dtypes fp32, bf16, fp16 on CUDA. Under ``TRITON_INTERPRET=1`` (CPU tensors) bf16 is refused: the
  interpreter keeps bf16 as raw uint16 bits and its ``tl.dot`` multiplies those (errors ~1e9;
  triton-lang/triton#11584); fp32 and fp16 are computed correctly there. The interpreter has no TMA: there the
  fused backward adds dQ with per-element atomics (the same kernel otherwise), so the CPU tests cover both.

Numerics:
* fp32 inputs are computed in fp32 (``tl.dot(..., input_precision="ieee")``) unless PyTorch's own fp32
  matmuls may use TF32 (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, or the legacy
  ``allow_tf32`` / ``torch.set_float32_matmul_precision("high" | "medium")``): then TF32, as cuBLAS would.
  The decision is taken at the forward and reused by its backward (under torch.compile: when traced). bf16/fp16
  products are exact with fp32 accumulation; P and dS are rounded to the input dtype before their products, as in
  FlashAttention-2.
* The forward saves O and one log-sum-exp L (..., n_q), natural log, fp32. The backward recomputes each
  score exactly as the forward rounded it, S = fl(fl(q k^T) * scale), and takes the exponent S - L in natural
  units before scaling it by log2(e) for exp2; FP fusion (mul + add -> FMA) is off in every kernel so the
  compiler cannot round one pass differently from the other. With large logits (inputs x1e3, |S| ~ 1e6,
  where one fp32 ulp of S is 0.06) any such difference shows up in P = exp(S - L) directly: storing L in base
  2 and converting it back, as the first version did, put dV off by 3.97 (absolute).
* Scores of masked positions are set to -inf before the exponent, so nothing overflows.

References: Dao 2023, "FlashAttention-2" (algorithms 1 and 2); the Triton fused-attention tutorial; the
flash-attention repository's ``flash_attn_triton.py``; PyTorch's "Python custom operators" tutorial
(``torch.library.custom_op``, ``register_fake``, ``register_autograd``).
"""

# No ``from __future__ import annotations``: the custom ops infer their schemas from real annotation objects.
import functools
import importlib
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from torch_impl.activation_checkpointing import kept_attention
from torch_impl.attention.registry import register_attention, register_packed_attention
from torch_impl.qkv_pack_triton import launch_rotate_back
from torch_impl.qkv_projection import (QKVProduct, check_split_inputs, rotate_pairs, split_weight_grad,
                                      transposed_weights)

MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 16, 256, 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# FLASH_TRITON_AUTOTUNE=0: on a GPU, run the first configuration the pruning keeps (that fits in shared memory)
# instead of autotuning (GPU correctness tests over many shapes, without a tuning run per shape).
AUTOTUNE = os.environ.get("FLASH_TRITON_AUTOTUNE", "1") != "0"
_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _ptrs(base, b, h, stride_b, stride_h, stride_n, stride_d, rows, cols):
    """Pointers to the (rows, cols) tile of head (b, h): rows along the sequence, cols along the head dim."""
    return base + b * stride_b + h * stride_h + rows[:, None] * stride_n + cols[None, :] * stride_d


@triton.jit
def _below(offs, n, MASK: tl.constexpr):
    """offs < n where MASK, else all True (a constant mask, which the compiler drops)."""
    if MASK:
        ok = offs < n
    else:
        ok = tl.full(offs.shape, 1, tl.int1)
    return ok


@triton.jit
def _program_head(n_heads, group):
    """(b, h, h_kv) of this program's batch x head index (axis 1 of the grid), as int64 for the offsets."""
    bh = tl.program_id(1)
    h = bh % n_heads
    return (bh // n_heads).to(tl.int64), h.to(tl.int64), (h // group).to(tl.int64)


@triton.jit
def _query_tile(IS_CAUSAL: tl.constexpr, n_q, BLOCK_M: tl.constexpr):
    """The query tile of this program: in reverse order when causal (the work grows with the tile index)."""
    if IS_CAUSAL:
        return tl.cdiv(n_q, BLOCK_M) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n_base, d_ok, lo, hi, n_k,
               sm_scale, MASK_DIAGONAL: tl.constexpr, MASK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Online softmax over the key tiles [lo, hi): acc, the row sum l_i and the row max m_i (natural units)."""
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base  # (BLOCK_N,)
        key_ok = _below(offs_n, n_k, MASK_KEYS)
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        # S = q k^T, written as in the backward's kernels (q @ trans(k), k @ trans(q)): the same rounding in each.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N)
        if MASK_DIAGONAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, -float("inf"))
        if MASK_KEYS:
            s = tl.where(key_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is in the first tile and every row sees it
        p = tl.math.exp2((s - m_new[:, None]) * _LOG2E)
        alpha = tl.math.exp2((m_i - m_new) * _LOG2E)  # 0 on the first tile (m_i = -inf)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sm_scale,
                stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,
                n_heads, group, n_q, n_k, n_q_bucket, n_k_bucket,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch x head): O = softmax(Q K^T * scale) V and L = logsumexp (natural).
    Causal: the last query tiles see the most keys, so they are launched first (less tail at the end)."""
    start_m = _query_tile(IS_CAUSAL, n_q, BLOCK_M) * BLOCK_M
    b, h, h_kv = _program_head(n_heads, group)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = _below(offs_d, HEAD_DIM, HEAD_DIM != BLOCK_D)
    row_ok = _below(offs_m, n_q, not EVEN_M)
    q = tl.load(_ptrs(Q, b, h, stride_qb, stride_qh, stride_qn, stride_qd, offs_m, offs_d),
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    k_ptrs = _ptrs(K, b, h_kv, stride_kb, stride_kh, stride_kn, stride_kd, offs_n, offs_d)
    v_ptrs = _ptrs(V, b, h_kv, stride_vb, stride_vh, stride_vn, stride_vd, offs_n, offs_d)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:
        # Stage 1: key tiles wholly below the diagonal (keys < start_m), no causal mask.
        hi = tl.minimum(start_m, n_k)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_ok,
                                   0, hi, n_k, sm_scale, False, not EVEN_N, DOT_PRECISION, BLOCK_N)
        # Stage 2: the tiles on the diagonal, masked; tiles above it are never visited.
        hi = tl.minimum(start_m + BLOCK_M, n_k)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_ok,
                                   start_m, hi, n_k, sm_scale, True, not EVEN_N, DOT_PRECISION, BLOCK_N)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_ok,
                                   0, n_k, n_k, sm_scale, False, not EVEN_N, DOT_PRECISION, BLOCK_N)
    acc = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)
    tl.store(_ptrs(O, b, h, stride_ob, stride_oh, stride_on, stride_od, offs_m, offs_d),
             acc.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + (b * n_heads + h) * n_q + offs_m, lse, mask=row_ok)


@triton.jit
def _scale_cast_kernel(SRC, DST, n, scale, BLOCK: tl.constexpr):
    """DST = SRC * scale in DST's dtype, both contiguous with n elements: the fused backward's fp32 dQ accumulator
    into dQ at copy bandwidth (ATen's mul into a bf16 ``out`` ran at ~2.4 TB/s on an H200: 1.57 ms a step at xl
    4 x 2,048 against cuDNN's 1.21 for the same conversion; notes/train_step.md, session 46)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(DST + offs, (tl.load(SRC + offs, mask=mask) * scale).to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_preprocess(O, DO, DELTA, DQ, stride_ob, stride_oh, stride_on, stride_od,
                    stride_dob, stride_doh, stride_don, stride_dod, n_heads, n_q,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ZERO_DQ: tl.constexpr):
    """D = rowsum(dO * O) in fp32, one value per query: (batch x head, n_q); with ZERO_DQ, also zeros for the same
    rows of DQ (contiguous fp32, q's shape), which the fused pass adds into (one launch fewer than a memset)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b, h, _ = _program_head(n_heads, 1)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < n_q) & _below(offs_d, HEAD_DIM, HEAD_DIM != BLOCK_D)[None, :]
    o = tl.load(_ptrs(O, b, h, stride_ob, stride_oh, stride_on, stride_od, offs_m, offs_d), mask=mask, other=0.0)
    do = tl.load(_ptrs(DO, b, h, stride_dob, stride_doh, stride_don, stride_dod, offs_m, offs_d),
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + (b * n_heads + h) * n_q + offs_m, delta, mask=offs_m < n_q)
    if ZERO_DQ:
        rows = (b * n_heads + h).to(tl.int64) * n_q + offs_m
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        tl.store(DQ + rows[:, None] * HEAD_DIM + offs_d[None, :], zeros, mask=mask)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don, stride_dqn,
                offs_n, key_ok, offs_m_base, d_ok, lo, hi, n_q, sm_scale, MASK_DIAGONAL: tl.constexpr,
                MASK_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, dq_desc):
    """Accumulate dK, dV of one key tile over the query tiles [lo, hi) of one head, with transposed tiles; with
    ATOMIC_DQ also add each query tile's share of dQ / scale, dS K, to the fp32 dQ accumulator (atomics)."""
    q_ptrs += lo * stride_qn
    do_ptrs += lo * stride_don
    dq_ptrs += lo * stride_dqn
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m_base  # (BLOCK_M,)
        row_ok = _below(offs_m, n_q, MASK_ROWS)
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
        do = tl.load(do_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * sm_scale  # S^T (BLOCK_N, BLOCK_M)
        visible = key_ok[:, None] & row_ok[None, :]
        if MASK_DIAGONAL:
            visible = visible & (offs_m[None, :] >= offs_n[:, None])
        pt = tl.math.exp2((tl.where(visible, st, -float("inf")) - lse[None, :]) * _LOG2E)  # P^T
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_D)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T (BLOCK_N, BLOCK_M)
        dst = (pt * (dpt - delta[None, :])).to(q.dtype)  # dS^T
        dk = tl.dot(dst, q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(dst), k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
            if DQ_TMA:
                dq_desc.atomic_add([start_m, 0], dq)  # TMA reduce-add; rows >= n_q, columns >= d are dropped
            else:
                tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
                dq_ptrs += BLOCK_M * stride_dqn
        q_ptrs += BLOCK_M * stride_qn
        do_ptrs += BLOCK_M * stride_don
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, sm_scale,
                     stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_don, stride_dod,
                     stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                     stride_dqb, stride_dqh, stride_dqn, stride_dqd,
                     n_heads, group, n_q, n_k, n_q_bucket, n_k_bucket,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                     EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                     DQ_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch x key/value head): dK, dV summed over every query tile that sees the
    key tile, in each of the ``group`` query heads that share this key/value head (grid axis 1: B x H_kv).
    ATOMIC_DQ: the same pass adds dQ into an fp32 accumulator DQ (the fused backward: S, P, dP, dS computed once
    per tile pair, five products instead of the two-kernel backward's seven); else DQ is not touched."""
    start_n = tl.program_id(0) * BLOCK_N
    b, h_kv, _ = _program_head(n_heads // group, 1)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = _below(offs_d, HEAD_DIM, HEAD_DIM != BLOCK_D)
    key_ok = _below(offs_n, n_k, not EVEN_N)
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(_ptrs(K, b, h_kv, stride_kb, stride_kh, stride_kn, stride_kd, offs_n, offs_d), mask=kv_mask,
                other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(_ptrs(V, b, h_kv, stride_vb, stride_vh, stride_vn, stride_vd, offs_n, offs_d), mask=kv_mask,
                other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, group):  # the query heads of this key/value head, in order: deterministic sums
        h = h_kv * group + g
        q_ptrs = _ptrs(Q, b, h, stride_qb, stride_qh, stride_qn, stride_qd, offs_m, offs_d)
        do_ptrs = _ptrs(DO, b, h, stride_dob, stride_doh, stride_don, stride_dod, offs_m, offs_d)
        dq_ptrs = _ptrs(DQ, b, h, stride_dqb, stride_dqh, stride_dqn, stride_dqd, offs_m, offs_d)
        if ATOMIC_DQ and DQ_TMA:  # this head's (n_q, d) rows of the contiguous fp32 accumulator
            dq_desc = tl.make_tensor_descriptor(DQ + b * stride_dqb + h * stride_dqh, shape=[n_q, HEAD_DIM],
                                                strides=[stride_dqn, 1], block_shape=[BLOCK_M, BLOCK_D])
        else:
            dq_desc = None
        lse_ptr = LSE + (b * n_heads + h) * n_q
        delta_ptr = DELTA + (b * n_heads + h) * n_q
        if IS_CAUSAL:
            # Query rows on the diagonal (start_n .. start_n + BLOCK_N), masked; then the rows below, unmasked.
            diag_end = tl.minimum(start_n + BLOCK_N, n_q)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                                 stride_dqn, offs_n, key_ok, offs_m, d_ok, start_n, diag_end, n_q, sm_scale, True,
                                 not EVEN_M, DOT_PRECISION, BLOCK_M, ATOMIC_DQ, DQ_TMA, dq_desc)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                                 stride_dqn, offs_n, key_ok, offs_m, d_ok, start_n + BLOCK_N, n_q, n_q, sm_scale,
                                 False, not EVEN_M, DOT_PRECISION, BLOCK_M, ATOMIC_DQ, DQ_TMA, dq_desc)
        else:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, lse_ptr, delta_ptr, stride_qn, stride_don,
                                 stride_dqn, offs_n, key_ok, offs_m, d_ok, 0, n_q, n_q, sm_scale, False, not EVEN_M,
                                 DOT_PRECISION, BLOCK_M, ATOMIC_DQ, DQ_TMA, dq_desc)
    dk *= sm_scale
    tl.store(_ptrs(DK, b, h_kv, stride_dkb, stride_dkh, stride_dkn, stride_dkd, offs_n, offs_d),
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(_ptrs(DV, b, h_kv, stride_dvb, stride_dvh, stride_dvn, stride_dvd, offs_n, offs_d),
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n_base, d_ok, lo, hi, n_k,
              sm_scale, MASK_DIAGONAL: tl.constexpr, MASK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Accumulate dQ of one query tile over the key tiles [lo, hi)."""
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        key_ok = _below(offs_n, n_k, MASK_KEYS)
        k = tl.load(k_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N)
        if MASK_DIAGONAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, -float("inf"))
        if MASK_KEYS:
            s = tl.where(key_ok[None, :], s, -float("inf"))
        p = tl.math.exp2((s - lse[:, None]) * _LOG2E)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sm_scale,
                   stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_don, stride_dod,
                   stride_dqb, stride_dqh, stride_dqn, stride_dqd,
                   n_heads, group, n_q, n_k, n_q_bucket, n_k_bucket,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr,
                   EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch x head): dQ over every key tile the query tile sees (causal: the
    heaviest tiles first, as in the forward)."""
    start_m = _query_tile(IS_CAUSAL, n_q, BLOCK_M) * BLOCK_M
    b, h, h_kv = _program_head(n_heads, group)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = _below(offs_d, HEAD_DIM, HEAD_DIM != BLOCK_D)
    row_ok = _below(offs_m, n_q, not EVEN_M)
    mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(_ptrs(Q, b, h, stride_qb, stride_qh, stride_qn, stride_qd, offs_m, offs_d), mask=mask, other=0.0)
    do = tl.load(_ptrs(DO, b, h, stride_dob, stride_doh, stride_don, stride_dod, offs_m, offs_d), mask=mask,
                 other=0.0)
    lse = tl.load(LSE + (b * n_heads + h) * n_q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + (b * n_heads + h) * n_q + offs_m, mask=row_ok, other=0.0)
    k_ptrs = _ptrs(K, b, h_kv, stride_kb, stride_kh, stride_kn, stride_kd, offs_n, offs_d)
    v_ptrs = _ptrs(V, b, h_kv, stride_vb, stride_vh, stride_vn, stride_vd, offs_n, offs_d)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:
        hi = tl.minimum(start_m, n_k)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_ok, 0, hi,
                       n_k, sm_scale, False, not EVEN_N, DOT_PRECISION, BLOCK_N)
        hi = tl.minimum(start_m + BLOCK_M, n_k)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_ok, start_m,
                       hi, n_k, sm_scale, True, not EVEN_N, DOT_PRECISION, BLOCK_N)
    else:
        dq = _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_ok, 0, n_k,
                       n_k, sm_scale, False, not EVEN_N, DOT_PRECISION, BLOCK_N)
    dq *= sm_scale
    tl.store(_ptrs(DQ, b, h, stride_dqb, stride_dqh, stride_dqn, stride_dqd, offs_m, offs_d),
             dq.to(DQ.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------ tile configurations


def _configs(*configs: tuple[int, int, int, int]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tuples: a few shapes known to suit Hopper, tuned per key."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in configs]


# IEEE fp32 dots run on FMAs, not tensor cores, and Triton unrolls each tile product into BLOCK_M x BLOCK_N x BLOCK_D
# / threads FMAs a thread: the configurations IEEE keeps are those within this many a thread. Compile time grows with
# it: at d 256 the forward's and dQ's first kept tiles (64 x 64, 4 warps: 8,192) took 44 and 86 s to compile on a
# CPU core, did not fit in shared memory, and the next ones compiled in turn (minutes a kernel on the H100's host);
# within 2,048 they take 7, 12 and 26-34 s (dK/dV) (notes/flash_attention.md, session 26).
IEEE_FMAS_PER_THREAD = 2048


def _prune_wide_tiles(axis: str):
    """early_config_prune for the autotuner: at BLOCK_D = 256 drop the configurations whose ``axis`` tile (the
    one kept in registers for the whole program) exceeds 64 rows, as they spill or overflow shared memory; IEEE
    fp32 dots keep tiles of at most 64 x 64 within IEEE_FMAS_PER_THREAD."""

    def prune(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        ieee = kwargs.get("DOT_PRECISION", named_args.get("DOT_PRECISION")) == "ieee"
        kept = [c for c in configs if (block_d < 256 or c.kwargs[axis] <= 64) and (not ieee or (
            c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64
            and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * block_d <= IEEE_FMAS_PER_THREAD * 32 * c.num_warps))]
        return kept or configs

    return prune


_TUNE_KEY = ["n_q_bucket", "n_k_bucket", "BLOCK_D", "IS_CAUSAL", "DOT_PRECISION"]
# The first configuration each pruning keeps is the one FLASH_TRITON_AUTOTUNE=0 runs where it fits in shared memory
# (and tests/_flash_compile.py compiles; IEEE fp32 at head dim 256 needs a later one). Forward and dQ need
# BLOCK_M % BLOCK_N == 0 (the diagonal stage starts on a key-tile boundary); dK/dV needs BLOCK_N % BLOCK_M == 0 (its
# diagonal stage covers exactly the key tile's rows).
_fwd_tuned = triton.autotune(_configs((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                                      (128, 64, 4, 4), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4),
                                      (64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2)),
                             key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_wide_tiles("BLOCK_M")}
                             )(_fwd_kernel)
_dkdv_tuned = triton.autotune(_configs((32, 128, 4, 3), (32, 128, 4, 5), (32, 128, 8, 3), (64, 128, 8, 2),
                                       (64, 128, 8, 3), (32, 64, 8, 2), (64, 64, 4, 3), (32, 64, 4, 4),
                                       (16, 64, 4, 2)),
                              key=[*_TUNE_KEY, "ATOMIC_DQ", "DQ_TMA"], reset_to_zero=["DQ"],  # atomics add to it
                              prune_configs_by={"early_config_prune": _prune_wide_tiles("BLOCK_N")}
                              )(_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(_configs((128, 32, 4, 3), (128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 2),
                                     (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (64, 32, 8, 2),
                                     (64, 16, 4, 2)),
                            key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune_wide_tiles("BLOCK_M")}
                            )(_bwd_dq_kernel)
# The interpreter runs one fixed configuration per kernel: small, and with BLOCK_M != BLOCK_N so the CPU tests
# exercise the tile-boundary logic of the GPU configurations (forward/dQ: BLOCK_M > BLOCK_N; dK/dV: <).
_INTERPRET_TILES = {"fwd": {"BLOCK_M": 32, "BLOCK_N": 16}, "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32},
                    "dq": {"BLOCK_M": 32, "BLOCK_N": 16}}


# ------------------------------------------------------------------------------------------- launchers


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A one-line ValueError naming the input and what is accepted, for anything the kernels do not take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
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
    if INTERPRET and q.dtype == torch.bfloat16:
        raise ValueError("q, k, v are bfloat16, which Triton's interpreter (TRITON_INTERPRET=1) computes wrongly; "
                         "accepted there: float32, float16 (or flash_torch, or a GPU)")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"q, k, v need the same number of dims: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]) or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"leading dims differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.ndim >= 3 and (k.shape[-3] == 0 or q.shape[-3] % k.shape[-3] != 0):
        raise ValueError(f"q has {q.shape[-3]} heads (dim -3) and k, v {k.shape[-3]}; accepted: a number of "
                         "query heads that is a multiple of the key/value heads (grouped-query attention)")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v need the same length: {k.shape[-2]} != {v.shape[-2]}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}")
    d = q.shape[-1]
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_MULTIPLE == 0):
        raise ValueError(f"head dim {d} is not supported; accepted: multiples of {HEAD_DIM_MULTIPLE} from "
                         f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    if k.shape[-2] == 0:
        raise ValueError("k and v have no keys (length 0): softmax over no keys is undefined; accepted: n_k >= 1")


@torch.compiler.assume_constant_result  # Dynamo cannot trace the flag's C getter: read once, when traced
def tf32_allowed() -> bool:
    """Whether PyTorch's own fp32 CUDA matmuls may use TF32 (the new ``fp32_precision`` API, else the legacy
    ``float32_matmul_precision``, which ``allow_tf32`` sets); fp32 attention follows the same choice. Eager
    calls read it every time; a compiled graph keeps the value it was traced with."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # torch >= 2.9
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    precision = getattr(torch.backends, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


@torch.compiler.assume_constant_result
def deterministic_backward() -> bool:
    """Whether the backward must give the same bits every run: ``torch.use_deterministic_algorithms(True)``, as
    for PyTorch's own kernels (read when the backward runs; a compiled graph keeps the value it was traced with)."""
    return torch.are_deterministic_algorithms_enabled()


def _descriptor_memory(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the tensor descriptors the fused backward makes in the kernel, from PyTorch's caching
    allocator on the current device (stream-ordered: freed after the launch, reused only by later work)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Whether the GPU adds tiles with TMA reduce-adds (sm_90 and later): the fused backward needs them to win;
    with per-element atomics (older GPUs) it lost to the two-pass backward (notes/flash_attention.md)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


def _dot_precision(dtype: torch.dtype, tf32: bool) -> str:
    """``tl.dot``'s input_precision: IEEE fp32 for fp32 unless TF32 is allowed; bf16/fp16 ignore it."""
    return "ieee" if dtype == torch.float32 and not tf32 else "tf32"


def _as_heads(t: torch.Tensor) -> torch.Tensor:
    """(..., n, d) -> a (B, H, n, d) view (dim -3 is the heads), merging leading dims beyond two."""
    if t.ndim == 2:
        return t[None, None]
    if t.ndim == 3:
        return t[None]
    if t.ndim > 4:
        return t.reshape(-1, *t.shape[-3:])
    return t


def empty_like_heads(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of t's shape and dtype: in the model's layout where t (B, H, n, d) is a view of rows that
    hold its heads side by side (a contiguous (B, n, H, d), or one part of the q, k, v product's (B, n, 3, H, d))
    (O's heads then merge for the output projection without a copy, and dV's for its product), else contiguous."""
    if t.ndim == 4 and _heads_side_by_side(t):
        _, heads, n, d = t.shape
        return torch.empty_strided(t.shape, (n * heads * d, d, heads * d, 1), dtype=t.dtype, device=t.device)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _heads_side_by_side(t: torch.Tensor) -> bool:
    """Whether t (B, H, n, d) is a view of rows that hold its heads side by side: head h at column h d of row
    (b, i), the rows one after another (size-1 dims' strides do not matter, as for ``is_contiguous``)."""
    (batch, heads, n, d), (sb, sh, sn, sd) = t.shape, t.stride()
    return ((d == 1 or sd == 1) and (heads == 1 or sh == d) and (n == 1 or sn >= heads * d)
            and (batch == 1 or sb == n * sn))


def _strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def _kept_configs(tuned, meta: dict) -> list[dict]:
    """The configurations the autotuner's pruning keeps for these constexprs, in order, as launch keywords."""
    return [{**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
            for config in tuned.early_config_prune(tuned.configs, {}, **meta)]


# One entry per launch seen on a GPU: the compiled kernel, its grid and its constexpr arguments (see _launch).
_LAUNCHES: dict[tuple, tuple] = {}
_MAX_LAUNCHES = 4096  # distinct shapes kept; then the cache starts over


def _launch(tuned, kernel, name: str, grid_rows: int, by: str, bh: int, *args, **meta) -> None:
    """The autotuned kernel on a GPU (or, FLASH_TRITON_AUTOTUNE=0, the first kept configuration that fits; with
    ``tuned`` None, the tiles in ``meta``), or the plain one with small fixed tiles under the interpreter. FP fusion
    is off: the backward must round each score exactly as the forward did (see the module notes).

    The first launch of a (kernel, sizes, strides, dtypes, pointer alignments) goes through the autotuner and
    Triton's launcher, which re-derive the kernel's specialization from all ~45 arguments on every call; it keeps
    the compiled kernel it ran, and each later launch with the same key calls that kernel directly, as Inductor's
    generated code does. The key holds every integer argument's value, so the specialization (multiples of 16,
    ones) cannot differ."""
    if INTERPRET:
        tiles = _INTERPRET_TILES.get(name, {})
        kernel[(triton.cdiv(grid_rows, {**meta, **tiles}[by]), bh)](*args, **meta, **tiles)
        return
    key = (name, torch.cuda.current_device(), grid_rows, bh, *meta.items(),
           *((a.dtype, a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a for a in args))
    cached = _LAUNCHES.get(key)
    if cached is not None:
        compiled, grid, constexprs = cached
        compiled[grid](*args, *constexprs)
        return
    if tuned is None:
        config = {}
        compiled = kernel[(triton.cdiv(grid_rows, meta[by]), bh)](*args, **meta, enable_fp_fusion=False)
    elif AUTOTUNE:
        compiled = tuned[lambda m: (triton.cdiv(grid_rows, m[by]), bh)](*args, **meta, enable_fp_fusion=False)
        config = tuned.best_config.kwargs
    else:  # the first kept configuration that fits in shared memory (the autotuner skips the others as well)
        configs = _kept_configs(tuned, meta)
        for i, config in enumerate(configs):
            try:  # Triton raises OutOfResources when it loads the compiled kernel, before it launches
                compiled = kernel[(triton.cdiv(grid_rows, config[by]), bh)](*args, **meta, **config,
                                                                            enable_fp_fusion=False)
                break
            except triton.runtime.errors.OutOfResources:
                if i == len(configs) - 1:
                    raise
    values = {**meta, **config}
    if len(_LAUNCHES) >= _MAX_LAUNCHES:
        _LAUNCHES.clear()
    _LAUNCHES[key] = (compiled, (triton.cdiv(grid_rows, values[by]), bh, 1),
                      tuple(values[arg] for arg in kernel.arg_names[len(args):]))


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2(n)`` for n >= 1, on the launches' host path: its constexpr_function wrapper costs
    ~5 us a call (Triton 3.6, 3.9), several calls a step."""
    return 1 << (n - 1).bit_length()


def _shape_meta(q4: torch.Tensor, k4: torch.Tensor, is_causal: bool, tf32: bool) -> tuple[tuple, dict]:
    """The size arguments and constexprs every attention kernel takes."""
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    sizes = (heads, heads // k4.shape[1], n_q, n_k, next_power_of_2(n_q), next_power_of_2(n_k))
    meta = {"HEAD_DIM": d, "BLOCK_D": next_power_of_2(d), "IS_CAUSAL": is_causal,
            "EVEN_M": n_q % 128 == 0, "EVEN_N": n_k % 128 == 0,  # 128: a multiple of every tile size
            "DOT_PRECISION": _dot_precision(q4.dtype, tf32)}
    return sizes, meta


@functools.cache
def _gluon_module(module: str, switch: str):
    """The Gluon module ``module`` where it can run: a GPU, not the interpreter, the environment variable ``switch``
    not "0", and a Triton with Gluon's Hopper API; else None."""
    if INTERPRET or os.environ.get(switch, "1") == "0" or not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module(module)
    except (ImportError, AttributeError):  # a Triton without (this version of) Gluon
        return None


def _gluon():
    """``flash_gluon`` (FlashAttention-3's structure on sm_90, in Gluon; ``FLASH_GLUON=0``: never) or None
    (``_gluon_module``). Its forward takes the inputs where it is ``preferred`` (bf16/fp16, head dim 40 to 256 in
    tiles of 64, 128 or 256, whole tiles, 1,024 keys or more), its backward where it is ``backward_preferred``, the
    Triton kernels the rest; its O and L are what the Triton backward reads (L exact for one-hot rows, as the Triton
    forward's), and the reverse."""
    return _gluon_module("torch_impl.attention.flash_gluon", "FLASH_GLUON")


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, tf32: bool = False):
    """O (q's shape, dtype and layout: ``empty_like_heads``) and L (q.shape[:-1], fp32, contiguous) of q
    (..., H, n_q, d), k, v (..., H_kv, n_k, d)."""
    check_inputs(q, k, v)
    o = empty_like_heads(q)  # (..., n_q, d)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # (..., n_q)
    if q.numel() == 0:  # no queries (or no heads, or an empty batch): nothing to launch
        return o, lse
    q4, k4, v4, o4 = (_as_heads(t) for t in (q, k, v, o))
    gluon = _gluon()
    if gluon is not None and gluon.preferred(q4, k4, v4, is_causal):  # it writes O and L in place
        gluon.forward(q4, k4, v4, is_causal, out=(o4, lse.view(q4.shape[:-1])), **gluon.schedule(q4, k4, is_causal))
        return o, lse
    sizes, meta = _shape_meta(q4, k4, is_causal, tf32)
    batch, heads, n_q, d = q4.shape
    _launch(_fwd_tuned, _fwd_kernel, "fwd", n_q, "BLOCK_M", batch * heads,
            q4, k4, v4, o4, lse, 1.0 / math.sqrt(d), *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o4),
            *sizes, **meta)
    return o, lse


def backward_preprocess(o: torch.Tensor, do: torch.Tensor, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """D = rowsum(dO * O) in fp32 (o.shape[:-1]) of O and dO (B, H, n, d), and, given ``zeros`` (fp32, contiguous,
    o's shape), zeros written into it in the same pass: the accumulator the fused backwards add dQ into."""
    batch, heads, n_q, d = o.shape
    delta = torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device)
    _launch(None, _bwd_preprocess, "delta", n_q, "BLOCK_M", batch * heads,
            o, do, delta, zeros, *_strides(o), *_strides(do), heads, n_q, HEAD_DIM=d,
            BLOCK_D=next_power_of_2(d), BLOCK_M=16 if INTERPRET else 128, ZERO_DQ=zeros is not None)
    return delta


def flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, is_causal: bool, tf32: bool = False, deterministic: bool = False):
    """dQ (contiguous, as its fp32 accumulator: the scale and cast run at bandwidth, where into the model's layout
    they took twice as long), dK, dV (in k's and v's layout: ``empty_like_heads``): the D = rowsum(dO * O) pass, then
    the fused pass (dK, dV, and dQ added with fp32 atomics, in an order that varies from run to run; the Gluon
    kernel where ``flash_gluon.backward_preferred``), or, with ``deterministic`` or on a GPU older than sm_90, the
    dK/dV pass and then a dQ pass of its own (no atomics, the same bits every run, 7/5 of the products)."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk, dv = empty_like_heads(k), empty_like_heads(v)
    _backward_into(dq, dk, dv, do, q, k, v, o, lse, is_causal, tf32, deterministic)
    return dq, dk, dv


def flash_backward_packed(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          lse: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_causal: bool, tf32: bool = False,
                          deterministic: bool = False) -> torch.Tensor:
    """The gradient (B, n, 3 H d) of the q, k, v product whose q and k RoPE rotated (``qkv_projection.rotate_split``,
    tables cos, sin (n, d / 2)) into q, k (B, H, n, d), v its third part: ``flash_backward``'s passes writing dK and
    dV into the product's gradient, then dQ rotated back into it by a pass, and dK by the Gluon backward's epilogue
    (``flash_gluon.rotates_dk``: rounded once) or a second pass, where ``pack_rotated_grads`` read and wrote all
    three. The fused backward's dQ is rotated from its fp32 accumulator (rounded once); the two-pass one's dQ,
    written in q's dtype, in place."""
    batch, heads, n, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"flash_backward_packed: q, k, v must be (B, H, n, d) alike (one product's three parts); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    packed = q.new_empty(batch, n, 3, heads, d)
    dq, dk, dv = packed.permute(2, 0, 3, 1, 4)  # (B, H, n, d) views of its three parts
    _backward_into(dq, dk, dv, do, q, k, v, o, lse, is_causal, tf32, deterministic, rope=(cos, sin))
    return packed.flatten(2)


def _backward_into(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, do: torch.Tensor, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, is_causal: bool, tf32: bool,
                   deterministic: bool, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """``flash_backward``'s passes into dq, dk, dv (q's, k's, v's shapes, any strides the kernels write); with
    ``rope`` (RoPE's tables cos, sin), dQ and dK rotated back by minus its angles (``launch_rotate_back``; dK by the
    Gluon kernel where it rotates it)."""
    if q.numel() == 0:  # no queries: nothing flows to the keys
        dk.zero_(), dv.zero_()
        return
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (_as_heads(t) for t in (q, k, v, o, do, dq, dk, dv))
    lse = lse.contiguous()
    batch, heads, n_q, d = q4.shape
    sm_scale = 1.0 / math.sqrt(d)
    gluon = None if deterministic else _gluon()
    gluon = gluon if gluon is not None and gluon.backward_preferred(do4, q4, k4, v4, is_causal) else None
    fused = gluon is not None or (not deterministic and (INTERPRET or _has_tma(q.device)))
    tma = fused and not INTERPRET
    # The fused pass adds dS K into fp32 zeros (the preprocess writes them; scaled and cast into dq at the end); the
    # two-pass one never reads it.
    dq_acc = torch.empty(q4.shape, dtype=torch.float32, device=q.device) if fused else dq4
    delta = backward_preprocess(o4, do4, dq_acc if fused else None)
    # the Gluon backward rotates dK back as it writes it where it can, else a pass does, as it does dQ
    rope_dk = rope if gluon is not None and rope is not None and gluon.rotates_dk(d) else None
    if gluon is not None:  # the Gluon backward adds dS K into the same zeros and writes dK, dV in place
        gluon.backward(do4, q4, k4, v4, o4, lse.view(q4.shape[:-1]), is_causal, delta=delta, dq_acc=dq_acc,
                       dkdv=(dk4, dv4), rope=rope_dk, **gluon.backward_schedule(q4, k4, is_causal))
    else:  # the Triton kernels (their arguments made only here: the Gluon path's host time matters at short lengths)
        sizes, meta = _shape_meta(q4, k4, is_causal, tf32)
        common = (*_strides(q4), *_strides(k4), *_strides(v4), *_strides(do4))
        if tma:  # Triton's allocator is a context variable: set in this thread (autograd's backward runs in its own)
            triton.set_allocator(_descriptor_memory)
        _launch(_dkdv_tuned, _bwd_dkdv_kernel, "dkdv", k4.shape[2], "BLOCK_N", batch * k4.shape[1],
                q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc, sm_scale, *common, *_strides(dk4), *_strides(dv4),
                *_strides(dq_acc), *sizes, ATOMIC_DQ=fused, DQ_TMA=tma, **meta)
        if not fused:
            _launch(_dq_tuned, _bwd_dq_kernel, "dq", n_q, "BLOCK_M", batch * heads,
                    q4, k4, v4, do4, lse, delta, dq4, sm_scale, *common, *_strides(dq4), *sizes, **meta)
    if rope is not None:  # dQ (scaled from its accumulator, or in place) and dK in place, rotated back
        launch_rotate_back(dq_acc.transpose(1, 2), dq4.transpose(1, 2), *rope, sm_scale if fused else 1.0)
        if rope_dk is None:
            launch_rotate_back(dk4.transpose(1, 2), dk4.transpose(1, 2), *rope)
    elif fused:  # the fused passes add dS K: dQ is that over sqrt(d), cast (dq_acc and dq both contiguous)
        block = 1024 if INTERPRET else 8192
        _scale_cast_kernel[(triton.cdiv(dq_acc.numel(), block),)](dq_acc, dq4, dq_acc.numel(), sm_scale,
                                                                  BLOCK=block, num_warps=8)


# ----------------------------------------------------------------------------------------- custom ops


def _forward_or_kept(q, k, v, is_causal: bool, tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_forward``, or in a checkpointed segment that keeps its attention
    (``torch_impl.activation_checkpointing.kept_attention``) the (O, L) its forward kept, in its recomputation."""
    kept = kept_attention()
    compute = lambda: flash_forward(q, k, v, is_causal, tf32)  # noqa: E731
    return compute() if kept is None else kept.take((q.shape, k.shape, v.shape, is_causal), compute)



@torch.library.custom_op("torch_impl::flash_attention_forward", mutates_args=())
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                            tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) of the Triton forward; an opaque op to torch.compile, which never re-compiles the kernels."""
    return _forward_or_kept(q, k, v, is_causal, tf32)


@flash_attention_forward.register_fake
def _(q, k, v, is_causal, tf32):
    check_inputs(q, k, v)  # bad inputs fail at trace time with the same message
    return empty_like_heads(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torch_impl::flash_attention_backward", mutates_args=())
def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                             lse: torch.Tensor, is_causal: bool, tf32: bool,
                             deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of the Triton backward: fused with atomic dQ, or the deterministic two-pass one."""
    return flash_backward(do, q, k, v, o, lse, is_causal, tf32, deterministic)


@flash_attention_backward.register_fake
def _(do, q, k, v, o, lse, is_causal, tf32, deterministic):
    return q.new_empty(q.shape), empty_like_heads(k), empty_like_heads(v)


def _save_for_backward(ctx, q, k, v, is_causal: bool, tf32: bool, o, lse, *tables) -> None:
    """What every autograd route keeps: (L, q, k, v, O), L first and the only tensor shaped (..., n_q), then RoPE's
    tables where the route takes the q, k, v product (``flash_triton_attention_of_product``)."""
    ctx.save_for_backward(lse, q, k, v, o, *tables)
    ctx.is_causal, ctx.tf32 = is_causal, tf32


def _grads(ctx, do: torch.Tensor, backward):
    """``backward`` (the backward op, ``flash_backward``, or their product's) of what ``_save_for_backward`` kept:
    (dQ, dK, dV), or the product's gradient."""
    lse, q, k, v, o, *tables = ctx.saved_tensors
    return backward(do, q, k, v, o, lse, *tables, ctx.is_causal, ctx.tf32, deterministic_backward())


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, is_causal, tf32 = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    _save_for_backward(ctx, q, k, v, is_causal, tf32, o, lse)


def _op_backward(ctx, do, _dlse):  # the op's formula, which AOTAutograd traces: always the backward op
    return (*_grads(ctx, do, torch.ops.torch_impl.flash_attention_backward), None, None)


flash_attention_forward.register_autograd(_op_backward, setup_context=_setup_context)


def _forward_of_product(product: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, is_causal: bool,
                        tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O, L, q, k, v) of the (B, T, 3 H d) q, k, v product: q and k rotated by RoPE and v split off
    (``rotate_split``, each (B, T, H, d)), then the forward of their (B, H, T, d) views; q, k, v for the backward."""
    q, k, v = torch.ops.torch_impl.rotate_split(product, cos, sin, n_heads)
    return (*_forward_or_kept(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal, tf32), q, k, v)


def _backward_of_product(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                         lse: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_causal: bool, tf32: bool,
                         deterministic: bool) -> torch.Tensor:
    """The product's gradient (B, T, 3 H d) from q, k, v (B, T, H, d) as ``_forward_of_product`` made them."""
    return flash_backward_packed(do, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), o, lse, cos, sin,
                                 is_causal, tf32, deterministic)


@torch.library.custom_op("torch_impl::flash_attention_rope_forward", mutates_args=())
def flash_attention_rope_forward(product: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                                 is_causal: bool, tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor, torch.Tensor]:
    """``_forward_of_product`` as an op opaque to torch.compile."""
    return _forward_of_product(product, cos, sin, n_heads, is_causal, tf32)


@flash_attention_rope_forward.register_fake
def _(product, cos, sin, n_heads, is_causal, tf32):
    d = check_split_inputs(product, cos, sin, n_heads)
    q, k, v = (product.new_empty(*product.shape[:2], n_heads, d) for _ in "qkv")
    q_heads = q.transpose(1, 2)
    check_inputs(q_heads, k.transpose(1, 2), v.transpose(1, 2))  # bad inputs fail at trace time, as the forward's
    return empty_like_heads(q_heads), q.new_empty(q_heads.shape[:-1], dtype=torch.float32), q, k, v


@torch.library.custom_op("torch_impl::flash_attention_rope_backward", mutates_args=())
def flash_attention_rope_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  o: torch.Tensor, lse: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  is_causal: bool, tf32: bool, deterministic: bool) -> torch.Tensor:
    """``_backward_of_product`` as an op opaque to torch.compile."""
    return _backward_of_product(do, q, k, v, o, lse, cos, sin, is_causal, tf32, deterministic)


@flash_attention_rope_backward.register_fake
def _(do, q, k, v, o, lse, cos, sin, is_causal, tf32, deterministic):
    return q.new_empty(*q.shape[:2], 3 * q.shape[2] * q.shape[3])


def _rope_setup_context(ctx, inputs, output) -> None:
    _, cos, sin, _, is_causal, tf32 = inputs
    ctx.mark_non_differentiable(*output[1:])  # L, q, k, v: for the backward only
    o, lse, q, k, v = output
    _save_for_backward(ctx, q, k, v, is_causal, tf32, o, lse, cos, sin)


def _rope_backward(ctx, do, *_):  # the op's formula, which AOTAutograd traces: always the backward op
    return _grads(ctx, do, torch.ops.torch_impl.flash_attention_rope_backward), None, None, None, None, None


flash_attention_rope_forward.register_autograd(_rope_backward, setup_context=_rope_setup_context)


def _qkv_rope():
    """``torch_impl.qkv_rope_gluon`` (the q, k, v product with RoPE in its epilogue; ``FLASH_QKV_ROPE=0``: never) or
    None (``_gluon_module``)."""
    return _gluon_module("torch_impl.qkv_rope_gluon", "FLASH_QKV_ROPE")


def rope_product_runs(x: torch.Tensor, weights: tuple[torch.Tensor, ...], cos: torch.Tensor,
                      sin: torch.Tensor) -> bool:
    """Whether ``qkv_rope_gluon.qkv_rope_gemm`` takes these inputs here (an sm_90 GPU, bf16, whole tiles: its
    ``input_problem``), so that the backend's attention of the input makes the product rotated in its epilogue."""
    gemm = _qkv_rope()
    return (gemm is not None and x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)
            and gemm.input_problem(x, weights, cos, sin) is None)


def _rotated_product(x: torch.Tensor, weights: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor,
                     n_heads: int) -> torch.Tensor:
    """x [W_q; W_k; W_v]^T (B, T, 3 H d) with q's and k's heads rotated by RoPE: ``qkv_rope_gemm`` where it runs,
    else PyTorch's ops (the product, then ``rotate_pairs``; CPU tests, other GPUs)."""
    if rope_product_runs(x, weights, cos, sin):
        return _qkv_rope().qkv_rope_gemm(x, *weights, cos, sin)
    q, k, v = F.linear(x, torch.cat(weights)).unflatten(-1, (3, n_heads, -1)).unbind(2)
    cos, sin = cos[:, None], sin[:, None]  # (T, 1, d / 2): broadcast over the heads
    return torch.stack((rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin), v), dim=2).flatten(2)


def _parts(product: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, T, H, d): views of the (B, T, 3 H d) product."""
    return product.unflatten(-1, (3, n_heads, -1)).unbind(2)


def _forward_of_input(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, n_heads: int, is_causal: bool,
                      tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O, L, the rotated product) of x (B, T, d): the product rotated by RoPE (``_rotated_product``), then the
    forward of its q, k, v ((B, H, T, d) views of it, read in place)."""
    product = _rotated_product(x, (w_q, w_k, w_v), cos, sin, n_heads)
    return (*_forward_or_kept(*(t.transpose(1, 2) for t in _parts(product, n_heads)), is_causal, tf32), product)


def _backward_of_input(do: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, product: torch.Tensor,
                       o: torch.Tensor, lse: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                       is_causal: bool, tf32: bool, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, the (3 H d, d) gradient of [W_q; W_k; W_v]) from ``weight_t``, [W_q; W_k; W_v]^T (``transposed_weights``,
    made outside the op, where Inductor writes it): the un-rotated product's gradient (``_backward_of_product``: dQ and
    dK rotated back), then x's and the weights' as ``QKVProduct``'s backward makes them (one GEMM each)."""
    grad = _backward_of_product(do, *_parts(product, n_heads), o, lse, cos, sin, is_causal, tf32, deterministic)
    return grad @ weight_t.T, grad.flatten(0, 1).T @ x.flatten(0, 1)


@torch.library.custom_op("torch_impl::flash_attention_input_forward", mutates_args=())
def flash_attention_input_forward(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                                  cos: torch.Tensor, sin: torch.Tensor, n_heads: int, is_causal: bool,
                                  tf32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_forward_of_input`` as an op opaque to torch.compile."""
    return _forward_of_input(x, w_q, w_k, w_v, cos, sin, n_heads, is_causal, tf32)


@flash_attention_input_forward.register_fake
def _(x, w_q, w_k, w_v, cos, sin, n_heads, is_causal, tf32):
    product = x.new_empty(*x.shape[:2], 3 * w_q.shape[0])
    q, k, v = (t.transpose(1, 2) for t in _parts(product, n_heads))
    check_inputs(q, k, v)  # bad inputs fail at trace time, as the forward's
    return empty_like_heads(q), q.new_empty(q.shape[:-1], dtype=torch.float32), product


@torch.library.custom_op("torch_impl::flash_attention_input_backward", mutates_args=())
def flash_attention_input_backward(do: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor, product: torch.Tensor,
                                   o: torch.Tensor, lse: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   n_heads: int, is_causal: bool, tf32: bool,
                                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``_backward_of_input`` as an op opaque to torch.compile."""
    return _backward_of_input(do, x, weight_t, product, o, lse, cos, sin, n_heads, is_causal, tf32, deterministic)


@flash_attention_input_backward.register_fake
def _(do, x, weight_t, product, o, lse, cos, sin, n_heads, is_causal, tf32, deterministic):
    return torch.empty_like(x), weight_t.new_empty(weight_t.shape[1], weight_t.shape[0])


def _save_input(ctx, inputs: tuple, output: tuple) -> None:
    """What the attention of the input keeps: L, the rotated product (its q, k, v), O, and the inputs."""
    x, w_q, w_k, w_v, cos, sin, n_heads, is_causal, tf32 = inputs
    o, lse, product = output
    ctx.save_for_backward(lse, product, o, x, w_q, w_k, w_v, cos, sin)
    ctx.n_heads, ctx.is_causal, ctx.tf32 = n_heads, is_causal, tf32


def _input_setup_context(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(*output[1:])  # L and the product: for the backward only
    _save_input(ctx, inputs, output)


def _input_grads(ctx, do: torch.Tensor, backward) -> tuple:
    """(dx, dW_q, dW_k, dW_v) by ``backward`` (the backward op or ``_backward_of_input``) of what
    ``_input_setup_context`` kept."""
    lse, product, o, x, *weights, cos, sin = ctx.saved_tensors
    dx, dw = backward(do, x, transposed_weights(weights), product, o, lse, cos, sin, ctx.n_heads, ctx.is_causal,
                      ctx.tf32, deterministic_backward())
    return dx, *split_weight_grad(dw)


def _input_backward(ctx, do, *_):  # the op's formula, which AOTAutograd traces: always the backward op
    return *_input_grads(ctx, do, torch.ops.torch_impl.flash_attention_input_backward), *(None,) * 5


flash_attention_input_forward.register_autograd(_input_backward, setup_context=_input_setup_context)


# ------------------------------------------------------------------------------------- public entry points


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) [+ top-left causal mask]) v: q (..., H, n_q, d), k and v (..., H_kv, n_k, d) ->
    (..., H, n_q, d), differentiable. Traced by torch.compile, the custom ops and their registered autograd formula
    (no graph break); in eager mode, ``FlashAttention2Triton`` (the same launches without the ops' dispatch)."""
    if torch.compiler.is_compiling():
        return torch.ops.torch_impl.flash_attention_forward(q, k, v, bool(is_causal), tf32_allowed())[0]
    return FlashAttention2Triton.apply(q, k, v, is_causal)


@register_attention("flash_triton")
def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    """The ``flash_triton`` backend of ``TransformerLM`` (causal by default, as every registered backend)."""
    return flash_attention(q, k, v, is_causal)


def flash_triton_attention_of_product(product: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                      n_heads: int) -> torch.Tensor:
    """The ``flash_triton`` backend on the model's one q, k, v product (B, T, 3 H d): RoPE (tables cos, sin (T,
    d / 2)) and the split in the forward, the product's gradient written by the backward, where dQ's cast and dK's
    pass rotate them back (``flash_backward_packed``): no packing pass. Causal; -> (B, H, T, d). Traced by
    torch.compile, the custom ops; in eager mode ``FlashAttentionOfProduct`` (without the ops' dispatch)."""
    if torch.compiler.is_compiling():
        return torch.ops.torch_impl.flash_attention_rope_forward(product, cos, sin, n_heads, True, tf32_allowed())[0]
    return FlashAttentionOfProduct.apply(product, cos, sin, n_heads)


def flash_triton_attention_of_input(x: torch.Tensor, weights: tuple[torch.Tensor, ...], cos: torch.Tensor,
                                    sin: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The ``flash_triton`` backend on the model's input x (B, T, d) and its q, k, v projections' weights (d, d)
    (``registry.register_packed_attention``): where ``rope_product_runs`` (sm_90, bf16; ``FLASH_QKV_ROPE=0`` never),
    the product made rotated by RoPE in its Gluon epilogue and the attention as one op, whose backward is the product
    route's and then x's and the weights' GEMMs (an op of the rotated product alone would owe the product's
    gradient unrotated, a rotation pass more); else the one product by ``QKVProduct`` (cast as F.linear is under
    autocast) and ``flash_triton_attention_of_product``. Causal; -> (B, H, T, d). Traced by torch.compile, the
    custom ops; in eager mode ``FlashAttentionOfInput`` (without the ops' dispatch)."""
    if not rope_product_runs(x, weights, cos, sin):
        return flash_triton_attention_of_product(QKVProduct.apply(x, *weights), cos, sin, n_heads)
    if torch.compiler.is_compiling():
        return torch.ops.torch_impl.flash_attention_input_forward(x, *weights, cos, sin, n_heads, True,
                                                                  tf32_allowed())[0]
    return FlashAttentionOfInput.apply(x, *weights, cos, sin, n_heads)


# FLASH_PACKED_ROPE=0: the model splits the product and rotates q, k itself (``project_qkv``), as for every other
# backend, and packs the three gradients in a pass of its own (``pack_rotated_grads``): the A/B of this route.
if os.environ.get("FLASH_PACKED_ROPE", "1") != "0":
    register_packed_attention("flash_triton")(flash_triton_attention_of_input)


class FlashAttentionOfInput(torch.autograd.Function):
    """``.apply(x, w_q, w_k, w_v, cos, sin, n_heads)``: ``flash_triton_attention_of_input``'s op in eager mode only,
    the launches themselves; torch.compile traces the custom ops."""

    @staticmethod
    def forward(ctx, x, w_q, w_k, w_v, cos, sin, n_heads: int):
        inputs = (x, w_q, w_k, w_v, cos, sin, n_heads, True, tf32_allowed())
        output = _forward_of_input(*inputs)
        _save_input(ctx, inputs, output)
        return output[0]

    @staticmethod
    def backward(ctx, do):
        return *_input_grads(ctx, do, _backward_of_input), None, None, None


class FlashAttentionOfProduct(torch.autograd.Function):
    """``.apply(product, cos, sin, n_heads)``: ``flash_triton_attention_of_product`` in eager mode only, the launches
    themselves (as ``FlashAttention2Triton`` is ``flash_attention``'s); torch.compile traces the custom ops, which
    ``flash_triton_attention_of_product`` calls while compiling."""

    @staticmethod
    def forward(ctx, product, cos, sin, n_heads: int):
        tf32 = tf32_allowed()
        o, lse, q, k, v = _forward_of_product(product, cos, sin, n_heads, True, tf32)
        _save_for_backward(ctx, q, k, v, True, tf32, o, lse, cos, sin)
        return o

    @staticmethod
    def backward(ctx, do):
        return _grads(ctx, do, _backward_of_product), None, None, None


class FlashAttention2Triton(torch.autograd.Function):
    """``.apply(q, k, v, is_causal=False)``: ``flash_attention`` as a ``torch.autograd.Function`` (DESIGN.md's stable
    name): the custom ops while torch.compile traces it (opaque to Inductor), else the launches themselves (each
    op call adds 70-150 us of CPU on the H100 host: notes/flash_attention.md); saves (L, q, k, v, O) with L
    (..., n_q) fp32."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        tf32 = tf32_allowed()
        forward = torch.ops.torch_impl.flash_attention_forward if torch.compiler.is_compiling() else _forward_or_kept
        o, lse = forward(q, k, v, bool(is_causal), tf32)
        _save_for_backward(ctx, q, k, v, bool(is_causal), tf32, o, lse)
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        backward = torch.ops.torch_impl.flash_attention_backward if torch.compiler.is_compiling() else flash_backward
        return (*_grads(ctx, do, backward), None)
