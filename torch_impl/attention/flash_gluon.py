"""FlashAttention forward for Hopper (sm_90) written in Gluon, with FlashAttention-3's structure.

One program computes two query tiles of one (batch, head) against every key tile they see. Its warps are split
(``gl.warp_specialize``) into a one-warp producer that TMA-loads Q once and K, V tile by tile into a ring of
shared-memory stages (mbarriers say when a stage is full and when both consumers are done with it), and two
consumer warpgroups, one per query tile, that share every K and V tile they load. Each consumer pipelines its
own work as FlashAttention-3 does within a warpgroup: the wgmma of S = Q K_{j+1}^T is issued before the softmax
of S_j and runs under it, and the wgmma of O += P_j V_j stays in flight until the next tile's rescale needs O.
Softmax in base 2 with the scale folded into one multiply-add (``exp2(s * scale * log2 e - m)``); the logsumexp
is written in natural units, as the Triton kernels' backward reads it.

References: Shah et al., "FlashAttention-3" (2024), sections 3.1-3.2; Triton's Gluon tutorials
(python/tutorials/gluon: 05-wgmma, 08-warp-specialization). What it handles is ``supports``; the rest goes to the
Triton kernels (torch_impl/attention/flash_triton.py), which also provide the backward.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)
HEAD_DIMS = (64, 128)  # head dims the tiles are written for (wgmma's N for O and TMA's box width)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
TILES = gl.constexpr(2)  # query tiles a program computes: one per consumer warpgroup


@triton.constexpr_function
def _wgmma_layout(block_n):
    """The accumulator layout of one warpgroup's wgmma: 4 warps stacked along M, one instruction as wide as N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])


@gluon.jit
def _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_free, v_free, q_row, q_col,
          kv_row, kv_col, n_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The producer warp: both Q tiles, then K_j and V_j into stage j % STAGES, each once both consumers freed it.
    K and V are freed apart: K_j as soon as S_j is done, V_j once O += P_j V_j is, so that a consumer waiting for
    K_{j+1} never waits on its own release of V_{j-1} (with two stages, that wait would deadlock)."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    mbarrier.expect(q_bar, TILES * q_desc.block_type.nbytes)
    for t in gl.static_range(TILES):
        tma.async_copy_global_to_shared(q_desc, [q_row + t * BLOCK_M, q_col], q_bar, q_smem.index(t))
    for j in range(n_blocks):
        stage = j % stages
        free_phase = ((j // stages) & 1) ^ 1  # a new barrier passes the parity-1 wait
        mbarrier.wait(k_free.index(stage), free_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], k_ready.index(stage),
                                        k_bufs.index(stage))
        mbarrier.wait(v_free.index(stage), free_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], v_ready.index(stage),
                                        v_bufs.index(stage))


@gluon.jit
def _softmax_tile(s, m_i, l_i, offs_m, offs_n, masked, scale, dtype: gl.constexpr, p_layout: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, NATURAL: gl.constexpr):
    """Online softmax of one S tile: P in wgmma's register-operand layout, the rescale alpha, m and l.
    NATURAL: m in natural units and P = exp2((fl(S * scale) - m) * log2 e), each score rounded as the Triton
    backward rounds it, so that its P = exp(S - L) matches at any magnitude (scale = 1 / sqrt(d)); else the scale
    is folded into one multiply-add in base 2, P = exp2(S * scale - m) (scale = log2 e / sqrt(d)), one FP32
    instruction less per score."""
    if NATURAL:
        s = s * scale
    if IS_CAUSAL:
        if masked:
            s = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0), s, -float("inf"))
    if NATURAL:
        m_new = gl.maximum(m_i, gl.max(s, 1))  # finite: key 0 is in the first tile, every row sees it
        p = gl.exp2((s - gl.expand_dims(m_new, 1)) * _LOG2E)
        alpha = gl.exp2((m_i - m_new) * _LOG2E)  # 0 on the first tile (m_i = -inf)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
        p = gl.exp2(s * scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i


@gluon.jit
def _consume(q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_free, v_free, o_ptr, stride_on, lse_ptr, m_start,
             n_blocks_program, scale, TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, NATURAL: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """One consumer warpgroup: query tile TILE of the program, O and L written at the end."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    start_m = m_start + TILE * BLOCK_M  # this tile's first query
    if IS_CAUSAL:
        n_blocks = gl.cdiv(start_m + BLOCK_M, BLOCK_N)  # key tiles up to the diagonal
        n_full = (start_m + 1) // BLOCK_N  # key tiles wholly below it: no mask
    else:
        n_blocks = n_blocks_program
        n_full = n_blocks_program
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=rows)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=rows)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    q = q_smem.index(TILE)
    mbarrier.wait(q_bar, 0)

    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_free.index(0), count=1)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, offs_n, n_full == 0, scale, dtype, p_layout,
                                       IS_CAUSAL, NATURAL)
    # Iteration j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} on the tensor cores, the softmax of S_j under the latter.
    # Nothing is in flight across the loop's back edge: a loop-carried value of an unfinished wgmma is copied at
    # the edge, and ptxas then serializes every wgmma of the kernel (its warning C7514).
    for j in range(1, n_blocks):
        stage = j % stages
        mbarrier.wait(k_ready.index(stage), (j // stages) & 1)
        s = warpgroup_mma(q, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        prev = (j - 1) % stages
        mbarrier.wait(v_ready.index(prev), ((j - 1) // stages) & 1)
        o = warpgroup_mma(p, v_bufs.index(prev), o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j is done; O += P_{j-1} V_{j-1} runs on
        mbarrier.arrive(k_free.index(stage), count=1)
        p_next, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, j * BLOCK_N + offs_n, j >= n_full, scale,
                                                dtype, p_layout, IS_CAUSAL, NATURAL)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))  # p: the operand stays alive until then
        mbarrier.arrive(v_free.index(prev), count=1)
        p = p_next
    last = n_blocks - 1
    o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    mbarrier.wait(v_ready.index(last % stages), (last // stages) & 1)
    o = warpgroup_mma(p, v_bufs.index(last % stages), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    mbarrier.arrive(v_free.index(last % stages), count=1)
    # Key tiles only the other query tile sees (causal): free them once they have landed (an early release would
    # count towards the stage's previous phase).
    for j in range(n_blocks, n_blocks_program):
        mbarrier.wait(k_ready.index(j % stages), (j // stages) & 1)
        mbarrier.arrive(k_free.index(j % stages), count=1)
        mbarrier.wait(v_ready.index(j % stages), (j // stages) & 1)
        mbarrier.arrive(v_free.index(j % stages), count=1)

    o = o / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    if NATURAL:
        gl.store(lse_ptr + offs_m, m_i + gl.log(l_i))
    else:
        gl.store(lse_ptr + offs_m, (m_i + gl.log2(l_i)) * _LN2)
    offs_mo = start_m + gl.arange(0, BLOCK_M, layout=o_rows)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + gl.expand_dims(offs_mo, 1) * stride_on + gl.expand_dims(offs_d, 0), o.to(dtype))


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, scale, n_heads, group, n_q, n_k,
                q_rows_b, q_rows_h, q_cols_h, kv_rows_b, kv_rows_h, kv_cols_h,
                stride_ob, stride_oh, stride_on, IS_CAUSAL: gl.constexpr, NATURAL: gl.constexpr, STAGES: gl.constexpr,
                CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Program (query-tile pair, batch x head). Element (b, h, n, :) of Q sits at row b * q_rows_b + h * q_rows_h
    + n, column h * q_cols_h of q_desc's 2-D view (and so for K, V with the k/v head h // group)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    pid = gl.program_id(0)
    if IS_CAUSAL:  # the last query tiles see the most keys: launched first
        pid = gl.num_programs(0) - 1 - pid
    bh = gl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    h_kv = h // group
    m_start = pid * (TILES * BLOCK_M)
    if IS_CAUSAL:
        n_blocks = gl.cdiv(m_start + TILES * BLOCK_M, BLOCK_N)
    else:
        n_blocks = n_k // BLOCK_N

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [TILES] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=TILES)  # both consumers release a stage
        mbarrier.init(v_free.index(i), count=TILES)

    q_row = b * q_rows_b + h * q_rows_h + m_start
    kv_row = b * kv_rows_b + h_kv * kv_rows_h
    o_ptr += b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    lse_ptr += bh.to(gl.int64) * n_q
    gl.warp_specialize([
        (_consume, (q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_free, v_free, o_ptr, stride_on, lse_ptr, m_start,
                    n_blocks, scale, 0, IS_CAUSAL, NATURAL, BLOCK_M, BLOCK_N, HEAD_DIM)),
        (_consume, (q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_free, v_free, o_ptr, stride_on, lse_ptr, m_start,
                    n_blocks, scale, 1, IS_CAUSAL, NATURAL, BLOCK_M, BLOCK_N, HEAD_DIM)),
        (_load, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_free, v_free, q_row,
                 h * q_cols_h, kv_row, h_kv * kv_cols_h, n_blocks, BLOCK_M, BLOCK_N)),
    ], [4, 1], [CONSUMER_REGS, 24])


# (BLOCK_M a consumer, BLOCK_N, STAGES, consumer registers): what ``forward`` runs by head dim, and what the
# probe (scripts/flash_probe.py --gluon) chooses from.
CONFIGS = {64: ((64, 128, 3, 240), (64, 128, 2, 240), (64, 128, 4, 240), (64, 64, 3, 240)),
           128: ((64, 128, 2, 240), (64, 64, 3, 240), (64, 64, 4, 240))}


def _rows_and_columns(t: torch.Tensor) -> tuple[list[int], int, tuple[int, int, int]] | None:
    """A 2-D (rows, columns) view of t (B, H, n, d) for TMA, and where (b, h, i, :) sits in it: row
    b * rows_b + h * rows_h + i, column h * cols_h. Covers (B, H, n, d) contiguous and the (B, n, H, d) layout
    the model's heads are views of; None for other strides (or misaligned ones)."""
    batch, heads, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    elem = t.element_size()
    if sd != 1 or (sn * elem) % 16 or t.data_ptr() % 16:
        return None
    if (batch == 1 or sb == n * sn) and (heads == 1 or ((sh * elem) % 16 == 0 and (heads - 1) * sh + d <= sn)):
        return [batch * n, (heads - 1) * sh + d], sn, (n, 0, sh)  # the heads side by side in a row
    if (heads == 1 or sh == n * sn) and (batch == 1 or sb == heads * n * sn) and d <= sn:
        return [batch * heads * n, d], sn, (heads * n, n, 0)  # each head's rows one after another
    return None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config=None) -> bool:
    """Whether ``forward`` takes these (B, H, n, d) inputs: an sm_90 GPU, bf16/fp16, a head dim of HEAD_DIMS,
    whole tiles (n_q a multiple of two query tiles, n_k of a key tile; causal: n_q == n_k), and strides TMA
    can read (``_rows_and_columns``)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype) or q.shape[-1] not in HEAD_DIMS:
        return False
    block_m, block_n, _, _ = config or CONFIGS[q.shape[-1]][0]
    n_q, n_k = q.shape[2], k.shape[2]
    if n_q % (TILES.value * block_m) or n_k % block_n or (is_causal and n_q != n_k) or k.stride() != v.stride():
        return False
    return all(_rows_and_columns(t) is not None for t in (q, k, v))


def _descriptor(t: torch.Tensor, block_rows: int):
    shape, row_stride, where = _rows_and_columns(t)
    block = [block_rows, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, DTYPES[t.dtype])
    return TensorDescriptor(t, shape, [row_stride, 1], block, layout), where


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config=None, natural: bool = True):
    """O (q's shape, contiguous) and L (natural logsumexp, (B, H, n_q) fp32) of q (B, H, n_q, d) and k, v
    (B, H_kv, n_k, d); the inputs must pass ``supports``. ``config`` overrides CONFIGS[d][0]; ``natural`` (default)
    rounds each score as the Triton backward does (``_softmax_tile``; FP fusion off), else the scale is folded
    into the exponent's multiply-add."""
    block_m, block_n, stages, regs = config or CONFIGS[q.shape[-1]][0]
    batch, heads, n_q, d = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    q_desc, q_where = _descriptor(q, block_m)
    k_desc, kv_where = _descriptor(k, block_n)
    v_desc, _ = _descriptor(v, block_n)
    grid = (n_q // (TILES.value * block_m), batch * heads)
    scale = 1 / math.sqrt(d) if natural else _LOG2E.value / math.sqrt(d)
    _fwd_kernel[grid](q_desc, k_desc, v_desc, o, lse, scale, heads, heads // k.shape[1], n_q, k.shape[2],
                      *q_where, *kv_where, o.stride(0), o.stride(1), o.stride(2), IS_CAUSAL=is_causal,
                      NATURAL=natural, STAGES=stages, CONSUMER_REGS=regs, num_warps=4, enable_fp_fusion=not natural)
    return o, lse
