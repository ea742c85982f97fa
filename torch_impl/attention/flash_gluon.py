"""FlashAttention for Hopper (sm_90) written in Gluon: a forward with FlashAttention-3's structure, and a backward
(``backward``; flash_triton runs it where ``backward_preferred``; its design is in its kernels' docstrings), both
written for tiles of head dim 64, 128 and 256 (the backward's at 256 a kernel of its own, ``_bwd_wide_kernel``) and
running any head dim from 40 to 256 in the next (``tile_dim``).

A work item is two query tiles of one (batch, head) against every key tile they see; by default a program per item,
head by head and each head's heaviest first (causal), else (``persistent``) a grid of one program per SM taking the
items in turn (``_tile``, ``_position``), which the op takes where every program's share is even (``schedule``). A
program's warps are split (``gl.warp_specialize``) into a one-warp producer that TMA-loads Q and then K, V tile by
tile into a ring of shared-memory stages (mbarriers say when a stage is full and when both consumers are done with it,
so a persistent program's next item's loads run under the end of the last), and two consumer warpgroups, one per
query tile, that share every K and V tile. Each consumer overlaps
within its warpgroup as FlashAttention-3 does: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued together and the
softmax of S_j runs under the latter.
Softmax in base 2; each exponent is one multiply-add of the raw score with the scale folded in (``folded``, the op's
choice), or taken from the raw score's difference to its row maximum; either way the logsumexp L (natural units, as
the Triton backward reads it) is exact for one-hot rows (``_softmax_tile``). Options measured and not faster on one
H100 (notes/flash_attention.md, session 19): ``pingpong`` (the consumers take turns to issue their products); the
op's persistent grids (the forward's with O written through shared memory and TMA, ``tma_store``) are ``schedule``'s
and ``backward_schedule``'s.
``scripts/gluon_compile.py`` compiles every variant without a GPU and reads ptxas's report of it;
``scripts/flash_gluon_probe.py`` checks and times them on one.

References: Shah et al., "FlashAttention-3" (2024), sections 3.1-3.2; Triton's Gluon tutorials
(python/tutorials/gluon: 05-wgmma, 08-warp-specialization). What the forward handles is ``supports``, the backward
``backward_supports``; the rest goes to the Triton kernels (torch_impl/attention/flash_triton.py).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin

from torch_impl.attention import flash_triton
from torch_impl.gluon_hopper import thread_barrier as _thread_barrier
from torch_impl.gluon_hopper import tma_load as _tma_load
from torch_impl.gluon_hopper import tma_store as _tma_store
from torch_impl.qkv_projection import check_tables

_LOG2E = gl.constexpr(1.4426950408889634)
_LN2 = gl.constexpr(0.6931471805599453)


@builtin
def _tma_add(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add of a shared-memory tile into global memory (``cp.reduce.async.bulk.tensor ... .add``): the
    op Triton 3.9 calls ``tma.async_atomic_add``, which 3.6's Gluon builds (``create_async_tma_reduce``) but does
    not expose. Wait for it with ``tma.store_wait`` before the tile is written again."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@builtin
def _reinterpret(smem, dtype, shape, layout, _semantic=None):
    """smem seen with another dtype, shape and layout: ``_reinterpret`` in Triton 3.6, ``reinterpret`` from 3.7."""
    view = getattr(smem, "reinterpret", None) or smem._reinterpret
    return view(dtype, shape, layout, _semantic=_semantic)


TILE_DIMS = (64, 128, 256)  # head dims the tiles are written for (wgmma's N for O, TMA's box width): ``tile_dim``
# O's TMA store, a tile a consumer, only at 64 and 128 (at 256 those 64 KB do not fit beside Q and the stages).
TMA_STORE_TILE_DIMS = (64, 128)
MIN_KEYS = 1024  # below, the Triton forward is as fast or faster (``preferred``)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
TILES = gl.constexpr(2)  # query tiles a program computes: one per consumer warpgroup


def tile_dim(d: int) -> int | None:
    """The tile width head dim d runs at: its next power of two (as the Triton kernels pad it) where that is one of
    TILE_DIMS and d a multiple of 8 (a row of TMA's box: 16 bytes), else None. Below the tile, the columns past d are
    TMA's zero fill on every load (the views must end each row there: ``_rows_and_columns``) and are never stored
    (TMA's stores stop at the view's edge), so S, dP and O's first d columns are exact."""
    width = flash_triton.next_power_of_2(d)
    return width if width in TILE_DIMS and d % 8 == 0 else None


@triton.constexpr_function
def _wgmma_layout(block_n):
    """The accumulator layout of one warpgroup's wgmma: 4 warps stacked along M, one instruction as wide as N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])


@triton.constexpr_function
def _tile_shape(count, block_shape):
    """``count`` of a descriptor's blocks as the 2-D tiles the MMAs read: [count, rows, width], from a block of
    [rows, width] or [rows, 1, width] (one head of a 3-D view: ``_rows_and_columns``)."""
    return [count, block_shape[0], block_shape[-1]]


@triton.constexpr_function
def _tile_layout(layout):
    """A descriptor's shared-memory layout at rank 2 (the same swizzle: a block of one head lands as its 2-D tile);
    a 2-D one as it is."""
    if layout.rank == 2:
        return layout
    return gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, 2, layout.transposed,
                                layout.fp4_padded)


@triton.constexpr_function
def _is_3d(block_shape):
    return len(block_shape) == 3


@gluon.jit
def _tile_buffers(desc, count: gl.constexpr):
    """Shared memory for ``count`` 2-D tiles of desc's block (``_load_tile`` fills one)."""
    return gl.allocate_shared_memory(desc.dtype, _tile_shape(count, desc.block_type.shape), _tile_layout(desc.layout))


@gluon.jit
def _load_tile(desc, row, col, bar, smem):
    """TMA-load desc's block at (row, col) into the 2-D tile ``smem``, arriving at ``bar``; in a 3-D view
    (``_rows_and_columns``) col is the head, and the block lands as the tile."""
    if _is_3d(desc.block_type.shape):
        _tma_load(desc, [row, col, 0], bar, _reinterpret(smem, smem.dtype, desc.block_type.shape, desc.layout))
    else:
        _tma_load(desc, [row, col], bar, smem)


@gluon.jit
def _store_tile(desc, row, col, offset, smem):
    """TMA-store the 2-D tile ``smem`` into desc's block at row ``row``, ``offset`` columns into the head whose first
    column is ``col`` (``_load_tile``'s (row, col); in a 3-D view col is the head)."""
    if _is_3d(desc.block_type.shape):
        _tma_store(desc, [row, col, offset], _reinterpret(smem, smem.dtype, desc.block_type.shape, desc.layout))
    else:
        _tma_store(desc, [row, col + offset], smem)


@gluon.jit
def _in_head(desc, col, offs):
    """Which of a tile's columns ``offs`` lie in the head whose first column is ``col`` in desc's view (``_load_tile``'s
    col): those below the head dim where the tile is wider."""
    if _is_3d(desc.block_type.shape):
        return offs < desc.shape[2]
    else:
        return col + offs < desc.shape[1]


@gluon.jit
def _grouped(item, n_bh, n_blocks, head_group):
    """Item ``item`` of n_bh heads x n_blocks blocks taken ``head_group`` heads at a time (the last group those
    left), a group's blocks in order, each block head by head -> (head, block) (head_group 1: head by head)."""
    per_group = n_blocks * head_group
    first = item // per_group * head_group  # the group's first head
    heads = gl.minimum(n_bh - first, head_group)
    r = item % per_group
    return first + r % heads, r // heads


@gluon.jit
def _tile(tile, n_bh, n_heads, group, n_m_blocks, n_k, head_group, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, BLOCK_MAJOR: gl.constexpr):
    """Work item ``tile`` -> (its first query, batch, head, k/v head, key tiles it reads). The heaviest query blocks
    (causal: those that see the most keys) come first. Head by head, so that the programs running at once read a few
    heads' K and V, which stay in L2: one program per item (the hardware hands out programs as SMs free up), or a
    persistent grid (``order="heads"``). BLOCK_MAJOR (a persistent grid's default ``order="blocks"``): block by
    block, every head's heaviest block first, so that taking them in the order ``_position`` deals them gives every
    program an even share at any length (head by head, a program's share depends on which blocks its stride lands
    on: 1.43x the per-item grid's time at 1 x 16 x 16,384 x 64, call 1 of session 19), but the running programs
    read every head's K and V (DRAM 68% busy against 16% at 4 x 32 x 2,048 x 64, 392a011). Else ``head_group``
    heads at a time (``_grouped``), as the backward's ``_bwd_item`` takes its items."""
    if BLOCK_MAJOR:
        m_block = tile // n_bh
        bh = tile % n_bh
    else:
        bh, m_block = _grouped(tile, n_bh, n_m_blocks, head_group)
    if IS_CAUSAL:
        m_block = n_m_blocks - 1 - m_block
    h = bh % n_heads
    m_start = m_block * (TILES * BLOCK_M)
    if IS_CAUSAL:
        n_blocks = gl.cdiv(m_start + TILES * BLOCK_M, BLOCK_N)
    else:
        n_blocks = n_k // BLOCK_N
    return m_start, bh // n_heads, h, h // group, n_blocks


@gluon.jit
def _position(k):
    """The k-th work item of this program: items are dealt to the programs in rounds, in turn forward and backward
    (program p gets items p, 2P - 1 - p, 2P + p, ...), so that with the heaviest first every program's share of
    the work is even (a round's lighter items go to the programs that got the heavier ones in the last round)."""
    programs = gl.num_programs(0)
    pid = gl.program_id(0)
    return k * programs + gl.where(k % 2 == 0, pid, programs - 1 - pid)


@gluon.jit
def _fetch_add(counter_ptr):
    """The counter's value before adding 1 to it (``atom.global.add``, one lane of the calling warp), every lane's."""
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    old = gl.inline_asm_elementwise(
        "{ .reg .pred first; .reg .u32 lane; mov.u32 lane, %laneid; setp.eq.u32 first, lane, 0; "
        "@first atom.global.add.u32 $0, [$1], 1; shfl.sync.idx.b32 $0, $0, 0, 0x1f, 0xffffffff; }",
        "=r,l", [counter_ptr + gl.zeros([32], gl.int32, lanes)], dtype=gl.int32, is_pure=False, pack=1)
    return gl.max(old, 0)


@gluon.jit
def _publish(ids, id_ready, id_free, t, item):
    """The producer: the program's t-th work item into slot t % 2 of ``ids``, once both consumers took the item
    that slot held last."""
    slot = t % 2
    mbarrier.wait(id_free.index(slot), ((t // 2) & 1) ^ 1)  # a new barrier passes the parity-1 wait
    ids.index(slot).store(gl.full([1], item, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))
    _thread_barrier()
    mbarrier.arrive(id_ready.index(slot), count=1)


@gluon.jit
def _take(ids, id_ready, id_free, t):
    """A consumer warpgroup: the program's t-th work item from ``ids`` (``_publish``)."""
    slot = t % 2
    mbarrier.wait(id_ready.index(slot), (t // 2) & 1)
    item = gl.max(ids.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    _thread_barrier()  # every thread has read the slot before it is released
    mbarrier.arrive(id_free.index(slot), count=1)
    return item


@gluon.jit
def _load_item(tile, i, t, q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free,
               v_free, n_bh, n_heads, group, n_m_blocks, n_k, head_group, q_rows_b, q_rows_h, q_cols_h, kv_rows_b,
               kv_rows_h, kv_cols_h, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_MAJOR: gl.constexpr):
    """The producer's part of work item ``tile``, the program's t-th, its key tiles counted from i (returned: i past
    them): ``_load``."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    m_start, b, h, h_kv, n_blocks = _tile(tile, n_bh, n_heads, group, n_m_blocks, n_k, head_group, IS_CAUSAL,
                                          BLOCK_M, BLOCK_N, BLOCK_MAJOR)
    q_row = b * q_rows_b + h * q_rows_h + m_start
    kv_row = b * kv_rows_b + h_kv * kv_rows_h
    mbarrier.wait(q_free, (t & 1) ^ 1)  # a new barrier passes the parity-1 wait
    mbarrier.expect(q_ready, TILES * q_desc.block_type.nbytes)
    for u in gl.static_range(TILES):
        _load_tile(q_desc, q_row + u * BLOCK_M, h * q_cols_h, q_ready, q_smem.index(u))
    for j in range(n_blocks):
        stage = i % stages
        free_phase = ((i // stages) & 1) ^ 1
        mbarrier.wait(k_free.index(stage), free_phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        _load_tile(k_desc, kv_row + j * BLOCK_N, h_kv * kv_cols_h, k_ready.index(stage), k_bufs.index(stage))
        mbarrier.wait(v_free.index(stage), free_phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        _load_tile(v_desc, kv_row + j * BLOCK_N, h_kv * kv_cols_h, v_ready.index(stage), v_bufs.index(stage))
        i += 1
    return i


@gluon.jit
def _load(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free, ids,
          id_ready, id_free, counter_ptr, n_tiles, n_bh, n_heads, group, n_m_blocks, n_k, head_group, q_rows_b,
          q_rows_h, q_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, BLOCK_MAJOR: gl.constexpr, DYNAMIC: gl.constexpr):
    """The producer warp, for each work item of the program: both Q tiles once both consumers are done with the
    last item's (their last S is computed), then K_j and V_j into stage i % STAGES (i counts the program's key
    tiles over all its items), each once both consumers freed it. K and V are freed apart: K_j as soon as S_j is
    done, V_j once O += P_j V_j is, so that a consumer waiting for K_{j+1} never waits on its own release of
    V_{j-1} (with two stages, that wait would deadlock). So the next item's loads run under the last one's end.
    DYNAMIC: the program's first item is its index, each next one the persistent grid's size plus a global counter's
    count (fetched once the last one's loads are issued: before them, its round trip held them back, 1.11x the
    time at 1 x 16 x 16,384 x 128, 136ea2c), handed to the consumers through ``ids`` (``_publish``); n_tiles ends
    them."""
    i = 0
    t = 0
    if DYNAMIC:
        tile = gl.program_id(0)
        while tile < n_tiles:
            _publish(ids, id_ready, id_free, t, tile)
            i = _load_item(tile, i, t, q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready,
                           v_ready, k_free, v_free, n_bh, n_heads, group, n_m_blocks, n_k, head_group, q_rows_b,
                           q_rows_h, q_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, IS_CAUSAL, BLOCK_M, BLOCK_N,
                           BLOCK_MAJOR)
            tile = gl.num_programs(0) + _fetch_add(counter_ptr)  # under the item's last tiles (its round trip)
            t += 1
        _publish(ids, id_ready, id_free, t, n_tiles)
    else:
        for k in range(gl.cdiv(n_tiles, gl.num_programs(0))):
            tile = _position(k)
            if tile < n_tiles:  # the last round's items run out
                i = _load_item(tile, i, t, q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready,
                               v_ready, k_free, v_free, n_bh, n_heads, group, n_m_blocks, n_k, head_group, q_rows_b,
                               q_rows_h, q_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, IS_CAUSAL, BLOCK_M, BLOCK_N,
                               BLOCK_MAJOR)
                t += 1


@gluon.jit
def _softmax_tile(s, m_i, l_i, offs_m, offs_n, masked, scale2, dtype: gl.constexpr, p_layout: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, FOLDED: gl.constexpr):
    """Online softmax of one tile of raw scores S = Q K^T: P in wgmma's register-operand layout, the rescale
    alpha, the row's raw maximum score m and the row sum l; scale2 = log2(e) / sqrt(d) (FP fusion off: each
    operation rounds as written).
    FOLDED: P = exp2(S * scale2 - fl(m * scale2)), one multiply-add a score (FlashAttention-3); the row's
    maximum gets P = exp2(e) with e = m * scale2 - fl(m * scale2) (exact), which ``_consume_item`` takes out of L.
    Else P = exp2((S - m) * scale2), one instruction more: S - m is exact, so the row's maximum gets P = 1 exactly.
    Either way L = m / sqrt(d) + log(l) is the Triton backward's own rounding of that score: with one-hot rows
    (inputs x1000, |S| ~ 1e6) the backward's P = exp(S / sqrt(d) - L) stays exact."""
    if IS_CAUSAL:
        if masked:
            s = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0), s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))  # finite: key 0 is in the first tile, every row sees it
    if FOLDED:
        base = m_new * scale2
        p = gl.exp2(gl.fma(s, scale2, gl.expand_dims(-base, 1)))
        alpha = gl.exp2(m_i * scale2 - base)  # the last tile's base, rounded as it was; 0 on the first (m_i = -inf)
    else:
        p = gl.exp2((s - gl.expand_dims(m_new, 1)) * scale2)
        alpha = gl.exp2((m_i - m_new) * scale2)
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_i


@gluon.jit
def _my_turn(turn, r, TILE: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: wait until the other consumer has issued its products of round r - 1 (tile 0 goes first)."""
    if PINGPONG:
        mbarrier.wait(turn.index(TILE), (r & 1) ^ (1 - TILE))


@gluon.jit
def _their_turn(turn, TILE: gl.constexpr, PINGPONG: gl.constexpr):
    """PINGPONG: this round's products are issued; the other consumer may issue its own."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - TILE), count=1)


@gluon.jit
def _consume_item(tile, i, t, r, q_smem, k_bufs, v_bufs, o_smem, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                  turn, o_desc, o_ptr, lse_ptr, n_bh, n_heads, n_m_blocks, n_q, n_k, head_group, o_rows_b, o_rows_h,
                  o_cols_h, stride_ob, stride_oh, stride_on, sm_scale, TILE: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  FOLDED: gl.constexpr, TMA_STORE: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_MAJOR: gl.constexpr):
    """One consumer warpgroup's query tile of work item ``tile``, the program's t-th, its key tiles counted from i
    and its rounds of products from r (returned: i and r past them): ``_consume``."""
    stages: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    scale2 = sm_scale * _LOG2E
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(TILE)
    m_start, b, h, h_kv, n_blocks_program = _tile(tile, n_bh, n_heads, 1, n_m_blocks, n_k, head_group, IS_CAUSAL,
                                                  BLOCK_M, BLOCK_N, BLOCK_MAJOR)
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
    o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    mbarrier.wait(q_ready, t & 1)

    stage = i % stages
    mbarrier.wait(k_ready.index(stage), (i // stages) & 1)
    _my_turn(turn, r, TILE, PINGPONG)
    s = warpgroup_mma(q, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _their_turn(turn, TILE, PINGPONG)
    r += 1
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_free.index(stage), count=1)
    p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, offs_n, n_full == 0, scale2, dtype, p_layout,
                                       IS_CAUSAL, FOLDED)
    # Key tile j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} on the tensor cores, the softmax of S_j under the
    # latter. Nothing is in flight across the loop's back edge: a loop-carried value of an unfinished wgmma is
    # copied at the edge, and ptxas then serializes every wgmma of the kernel (its warning C7514).
    for j in range(1, n_blocks):
        cur = i + j
        stage = cur % stages
        mbarrier.wait(k_ready.index(stage), (cur // stages) & 1)
        _my_turn(turn, r, TILE, PINGPONG)
        s = warpgroup_mma(q, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        prev = (cur - 1) % stages
        mbarrier.wait(v_ready.index(prev), ((cur - 1) // stages) & 1)
        o = warpgroup_mma(p, v_bufs.index(prev), o, is_async=True)
        _their_turn(turn, TILE, PINGPONG)
        r += 1
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j is done; O += P_{j-1} V_{j-1} runs on
        mbarrier.arrive(k_free.index(stage), count=1)
        p_next, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, j * BLOCK_N + offs_n, j >= n_full, scale2,
                                                dtype, p_layout, IS_CAUSAL, FOLDED)
        o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o, p))  # p: the operand stays alive until then
        mbarrier.arrive(v_free.index(prev), count=1)
        p = p_next
    mbarrier.arrive(q_free, count=1)  # every S of this item is done: the next item's Q may land
    last = i + n_blocks - 1
    o = o * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    mbarrier.wait(v_ready.index(last % stages), (last // stages) & 1)
    _my_turn(turn, r, TILE, PINGPONG)
    o = warpgroup_mma(p, v_bufs.index(last % stages), o, is_async=True)
    _their_turn(turn, TILE, PINGPONG)
    r += 1
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o, ))
    mbarrier.arrive(v_free.index(last % stages), count=1)
    # Key tiles only the other query tile sees (causal): free them once they have landed (an early release
    # would count towards the stage's previous phase).
    for j in range(n_blocks, n_blocks_program):
        cur = i + j
        mbarrier.wait(k_ready.index(cur % stages), (cur // stages) & 1)
        mbarrier.arrive(k_free.index(cur % stages), count=1)
        mbarrier.wait(v_ready.index(cur % stages), (cur // stages) & 1)
        mbarrier.arrive(v_free.index(cur % stages), count=1)

    o = o / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    bh = b * n_heads + h
    log_l = gl.log(l_i)
    if FOLDED:  # l carries exp2(e) from the row's maximum (``_softmax_tile``): out of L, as the Triton forward's
        log_l = log_l - gl.fma(m_i, scale2, -(m_i * scale2)) * _LN2
    gl.store(lse_ptr + bh.to(gl.int64) * n_q + offs_m, m_i * sm_scale + log_l)
    if TMA_STORE:
        tma.store_wait(0)  # the last item's store has read the buffer
        o_smem.store(o.to(dtype))
        fence_async_shared()
        _store_tile(o_desc, b * o_rows_b + h * o_rows_h + start_m, h * o_cols_h, 0, o_smem)
    else:
        offs_mo = start_m + gl.arange(0, BLOCK_M, layout=o_rows)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_tile = o_ptr + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
        in_view = (gl.expand_dims(offs_mo, 1) >= 0) & gl.expand_dims(_in_head(o_desc, h * o_cols_h, offs_d), 0)
        gl.store(o_tile + gl.expand_dims(offs_mo, 1) * stride_on + gl.expand_dims(offs_d, 0), o.to(dtype),
                 mask=in_view)  # a head dim below the tile: its first d columns
    return i + n_blocks_program, r


@gluon.jit
def _consume(q_smem, k_bufs, v_bufs, o_smem, q_ready, q_free, k_ready, v_ready, k_free, v_free, turn, ids, id_ready,
             id_free, o_desc, o_ptr, lse_ptr, n_tiles, n_bh, n_heads, n_m_blocks, n_q, n_k, head_group, o_rows_b,
             o_rows_h, o_cols_h, stride_ob, stride_oh, stride_on, sm_scale, TILE: gl.constexpr, IS_CAUSAL: gl.constexpr,
             FOLDED: gl.constexpr, TMA_STORE: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_MAJOR: gl.constexpr, DYNAMIC: gl.constexpr):
    """One consumer warpgroup: query tile TILE of each of the program's work items, its O and L written at the end.
    Key tile i of the program (over all its items) sits in stage i % STAGES, filled for the (i // STAGES)-th time.
    TMA_STORE: O goes through shared memory and a TMA store that runs on while the next item starts (else each
    thread stores its accumulator registers). PINGPONG: the two consumers take turns to issue each round's products
    (FlashAttention-3's section 3.1), so that one's softmax runs under the other's products; both must run the same
    number of rounds per item (``launch_arguments`` checks the tiles).
    DYNAMIC: the items the producer hands over (``_take``) until n_tiles."""
    i = 0
    t = 0
    r = 0  # rounds of products issued (PINGPONG)
    if DYNAMIC:
        tile = _take(ids, id_ready, id_free, t)
        while tile < n_tiles:
            i, r = _consume_item(tile, i, t, r, q_smem, k_bufs, v_bufs, o_smem, q_ready, q_free, k_ready, v_ready,
                                 k_free, v_free, turn, o_desc, o_ptr, lse_ptr, n_bh, n_heads, n_m_blocks, n_q, n_k,
                                 head_group, o_rows_b, o_rows_h, o_cols_h, stride_ob, stride_oh, stride_on, sm_scale,
                                 TILE, IS_CAUSAL, FOLDED, TMA_STORE, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_MAJOR)
            t += 1
            tile = _take(ids, id_ready, id_free, t)
    else:
        for k in range(gl.cdiv(n_tiles, gl.num_programs(0))):
            tile = _position(k)
            if tile < n_tiles:  # the last round's items run out
                i, r = _consume_item(tile, i, t, r, q_smem, k_bufs, v_bufs, o_smem, q_ready, q_free, k_ready,
                                     v_ready, k_free, v_free, turn, o_desc, o_ptr, lse_ptr, n_bh, n_heads, n_m_blocks,
                                     n_q, n_k, head_group, o_rows_b, o_rows_h, o_cols_h, stride_ob, stride_oh,
                                     stride_on, sm_scale, TILE, IS_CAUSAL, FOLDED, TMA_STORE, PINGPONG, BLOCK_M,
                                     BLOCK_N, HEAD_DIM, BLOCK_MAJOR)
                t += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, o_ptr, lse_ptr, counter_ptr, sm_scale, n_heads, group, n_bh, n_q,
                n_k, q_rows_b, q_rows_h, q_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, o_rows_b, o_rows_h, o_cols_h,
                stride_ob, stride_oh, stride_on, head_group, IS_CAUSAL: gl.constexpr, FOLDED: gl.constexpr,
                TMA_STORE: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                BLOCK_MAJOR: gl.constexpr, DYNAMIC: gl.constexpr, num_warps: gl.constexpr):
    """A program takes work items (two query tiles of one batch x head, ``_tile``, in BLOCK_MAJOR's order) in the
    order ``_position`` deals them (one item in a grid of a program per item), or (DYNAMIC) as they come from a
    counter (``counter_ptr``, an int32 zero: ``_load``).
    Element (b, h, n, :) of Q sits at row b * q_rows_b + h * q_rows_h + n, column h * q_cols_h of q_desc's 2-D view
    (of a 3-D view: head h * q_cols_h; and so for K, V with the k/v head h // group)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[-1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    n_m_blocks = n_q // (TILES * BLOCK_M)
    n_tiles = n_m_blocks * n_bh

    q_smem = _tile_buffers(q_desc, TILES)
    k_bufs = _tile_buffers(k_desc, STAGES)
    v_bufs = _tile_buffers(v_desc, STAGES)
    o_bufs = _tile_buffers(o_desc, TILES if TMA_STORE else 1)  # one unused tile without TMA_STORE
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: whose round it is
    ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # DYNAMIC
    id_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for u in gl.static_range(2):
        mbarrier.init(turn.index(u), count=1)
        mbarrier.init(id_ready.index(u), count=1)
        mbarrier.init(id_free.index(u), count=TILES)  # both consumers took the item
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_free, count=TILES)  # both consumers release Q
    for u in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(u), count=1)
        mbarrier.init(v_ready.index(u), count=1)
        mbarrier.init(k_free.index(u), count=TILES)  # both consumers release a stage
        mbarrier.init(v_free.index(u), count=TILES)

    gl.warp_specialize([
        (_consume, (q_smem, k_bufs, v_bufs, o_bufs.index(0), q_ready, q_free, k_ready, v_ready, k_free, v_free, turn,
                    ids, id_ready, id_free, o_desc, o_ptr, lse_ptr, n_tiles, n_bh, n_heads, n_m_blocks, n_q, n_k,
                    head_group, o_rows_b, o_rows_h, o_cols_h, stride_ob, stride_oh, stride_on, sm_scale, 0, IS_CAUSAL,
                    FOLDED, TMA_STORE, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_MAJOR, DYNAMIC)),
        (_consume, (q_smem, k_bufs, v_bufs, o_bufs.index(1 if TMA_STORE else 0), q_ready, q_free, k_ready, v_ready,
                    k_free, v_free, turn, ids, id_ready, id_free, o_desc, o_ptr, lse_ptr, n_tiles, n_bh, n_heads,
                    n_m_blocks, n_q, n_k, head_group, o_rows_b, o_rows_h, o_cols_h, stride_ob, stride_oh, stride_on,
                    sm_scale, 1, IS_CAUSAL, FOLDED, TMA_STORE, PINGPONG, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_MAJOR,
                    DYNAMIC)),
        (_load, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready, k_free, v_free,
                 ids, id_ready, id_free, counter_ptr, n_tiles, n_bh, n_heads, group, n_m_blocks, n_k, head_group,
                 q_rows_b, q_rows_h, q_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, IS_CAUSAL, BLOCK_M, BLOCK_N,
                 BLOCK_MAJOR, DYNAMIC)),
    ], [4, 1], [CONSUMER_REGS, 24])


# ----------------------------------------------------------------------------------------------------- backward
# Right on the H100 (float64 checks, scripts/flash_gluon_probe.py --backward); flash_triton's backward runs it
# where ``backward_preferred``.


@triton.constexpr_function
def _dq_split(head_dim):
    """Whether both consumers compute dQ_i every tile, each half of its columns (FlashAttention-3's split across
    warpgroups), instead of taking turns at the whole: above d 64, where a whole (64, d) fp32 part beside dK, dV,
    S^T and dP^T would not fit a consumer's 240 registers. (At d 64 the split was 1.15x slower: 9390f37.)"""
    return head_dim > 64


@triton.constexpr_function
def _exact_scale(head_dim):
    """Whether 1 / sqrt(d) is a power of two (d 16, 64, 256): then S * scale is exact, and S * scale - L as one
    multiply-add rounds as the forward's and the Triton backward's two operations do (fl(S * scale), then - L)."""
    return 4 ** round(math.log(head_dim, 4)) == head_dim


@triton.constexpr_function
def _epilogue_in_stages(head_dim):
    """Whether dK and dV go out through the Q and dO stage buffers (above d 64, where tiles of their own would not
    fit the shared memory beside the stages, K, V, dS^T and dQ), not tiles of their own."""
    return head_dim > 64


@gluon.jit
def _probabilities_t(st, lse, offs_key, offs_q, masked, sm_scale, IS_CAUSAL: gl.constexpr,
                     EXACT_SCALE: gl.constexpr):
    """P^T = exp(fl(S^T / sqrt(d)) - L) of a tile of raw scores S^T (keys, queries) and the queries' L, rounded as the
    Triton backward rounds it; ``masked``: a tile the causal diagonal crosses (keys after their query get 0)."""
    if not EXACT_SCALE:
        st = st * sm_scale
    if IS_CAUSAL:
        if masked:
            st = gl.where(gl.expand_dims(offs_q, 0) >= gl.expand_dims(offs_key, 1), st, -float("inf"))
    if EXACT_SCALE:  # one multiply-add, rounded once as fl(S^T * scale) - L is (``_exact_scale``); negated
        return gl.exp2(gl.fma(st, -sm_scale, gl.expand_dims(lse, 0)) * -_LOG2E)  # (L - S^T scale): L as it is
    return gl.exp2((st - gl.expand_dims(lse, 0)) * _LOG2E)


@gluon.jit
def _tma_add_tile(tile, smem, desc, row, col):
    """Add a register tile into global memory at (row, col) of desc's view: through smem and a TMA reduce-add,
    once the last one issued from smem has read it."""
    tma.store_wait(0)
    smem.store(tile)
    fence_async_shared()
    _tma_add(desc, [row, col], smem)


@gluon.jit
def _rotated_back(x, cos, sin, first_row, half):
    """A (rows, d) fp32 tile of dK at positions first_row + r rotated by minus RoPE's angles (tables cos, sin
    (positions, half), contiguous, read in fp32; columns past 2 half get 0): even column x_2k cos + x_2k+1 sin, odd
    x_2k+1 cos - x_2k sin, as ``qkv_pack_triton.launch_rotate_back`` rotates it (in a wgmma accumulator both columns
    of a pair are one thread's)."""
    ROWS: gl.constexpr = x.type.shape[0]
    PAIRS: gl.constexpr = x.type.shape[1] // 2
    even, odd = gl.split(gl.reshape(x, [ROWS, PAIRS, 2]))
    layout: gl.constexpr = even.type.layout
    rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, PAIRS, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows, 1) * half + gl.expand_dims(cols, 0)
    mask = (gl.expand_dims(rows, 1) >= 0) & (gl.expand_dims(cols, 0) < half)
    c = gl.load(cos + offs, mask=mask, other=0.0).to(gl.float32)
    s = gl.load(sin + offs, mask=mask, other=0.0).to(gl.float32)
    return gl.reshape(gl.join(even * c + odd * s, odd * c - even * s), [ROWS, 2 * PAIRS])


@gluon.jit
def _dq_part(t_dq, ds_bufs, ds_ready, k_cols, zero_dq):
    """A consumer's part of tile t_dq's dQ_i (unscaled), once both halves of its dS^T are in buffer t_dq % 2: dS
    (the transpose of dS^T, both consumers' keys) times its columns of K, waited (with every product issued before
    it)."""
    mbarrier.wait(ds_ready.index(t_dq % 2), (t_dq // 2) & 1)
    ds = ds_bufs.index(t_dq % 2)
    dq = warpgroup_mma(ds.permute((1, 0)), k_cols, zero_dq, use_acc=False, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))


@gluon.jit
def _share_ds(dst_lo, s, ds_bufs, ds_ready, ds_free, TILE: gl.constexpr):
    """This consumer's half of tile s's dS^T (its keys' rows) into buffer s % 2, once tile s - 2's dQ has read it."""
    BLOCK_K: gl.constexpr = dst_lo.type.shape[0]
    buf = s % 2
    mbarrier.wait(ds_free.index(buf), ((s // 2) & 1) ^ 1)
    ds_bufs.index(buf).slice(TILE * BLOCK_K, BLOCK_K).store(dst_lo)
    fence_async_shared()
    _thread_barrier()  # every thread's part of dS^T is in shared memory before the MMAs read it
    mbarrier.arrive(ds_ready.index(buf), count=1)


@gluon.jit
def _add_dq(t_dq, stage_free, ds_bufs, ds_ready, ds_free, k_cols, zero_dq, dq_smem, dq_desc, row, col):
    """This consumer's turn at tile t_dq's dQ part (``_dq_part``): the stage (``stage_free``, or None) and the dS^T
    buffer released once the product has read them, then its fp32 sum added at (row, col) of dq_desc."""
    dq = _dq_part(t_dq, ds_bufs, ds_ready, k_cols, zero_dq)  # its wait retires every product issued before it
    if stage_free is not None:
        mbarrier.arrive(stage_free, count=1)
    mbarrier.arrive(ds_free.index(t_dq % 2), count=1)
    _tma_add_tile(dq, dq_smem, dq_desc, row, col)


@gluon.jit
def _bwd_unseen_tile(s, s_item, row, dq_row, ready, free, ds_bufs, ds_ready, ds_free, k_cols, zero_ds, zero_dq,
                     dq_smem, dq_desc, dq_col, TILE: gl.constexpr, SPLIT: gl.constexpr, DQ_LAG: gl.constexpr):
    """Tile s, a query tile that sees none of this consumer's keys (causal: above the diagonal, the second
    consumer's first tile of each item and head): no products, zeros for its half of dS^T, and its turn at a dQ part
    as on any tile. (Its stage's loads are waited as any tile's, so that its release comes after them.)"""
    stages: gl.constexpr = ready.type.shape[0]
    stage = s % stages
    mbarrier.wait(ready.index(stage), (s // stages) & 1)
    _share_ds(zero_ds, s, ds_bufs, ds_ready, ds_free, TILE)
    t_dq = s - DQ_LAG
    if _takes_dq(t_dq, s_item, TILE, SPLIT):
        _add_dq(t_dq, free.index(stage), ds_bufs, ds_ready, ds_free, k_cols, zero_dq, dq_smem, dq_desc,
                dq_row if DQ_LAG else row, dq_col)
    else:
        mbarrier.arrive(free.index(stage), count=1)


@gluon.jit
def _takes_dq(t, s_item, TILE: gl.constexpr, SPLIT: gl.constexpr):
    """Whether this consumer takes tile t's dQ product: a tile of its item (counted from s_item), and, unless both
    take a part every tile (``_dq_split``), its turn."""
    return t >= s_item and (SPLIT or t % TILES == TILE)


@gluon.jit
def _program_item():
    """A grid of a program per item: this program's item, its index in launch order (x fastest)."""
    return gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)


@gluon.jit
def _bwd_item(item, n_bkv, n_kv_heads, n_kb, head_group, BLOCK_KEYS: gl.constexpr, BLOCK_M: gl.constexpr,
              IS_CAUSAL: gl.constexpr):
    """Work item ``item`` of the backward -> (batch, k/v head, first key, first query tile that sees its keys): the
    n_bkv batch x k/v heads ``head_group`` at a time (the last group those left), a group's key blocks in order
    (causal: the heaviest first), each block head by head. head_group 1: head by head. Every head's heaviest first
    (head_group n_bkv) was 1.34x slower at 4 x 32 x 2,048 x 64: the running programs then read every head's Q and
    dO (0f0351f); a few heads at a time keep theirs in L2 and put the light blocks of all but the last group before
    the end, so that the heavy ones do not run last (a grid of a program per item starts the programs in order, as
    a counter hands them out)."""
    bh, key_block = _grouped(item, n_bkv, n_kb, head_group)
    key_start = key_block * BLOCK_KEYS
    i_first = key_start // BLOCK_M if IS_CAUSAL else 0  # query tiles wholly above the diagonal see none of its keys
    return bh // n_kv_heads, bh % n_kv_heads, key_start, i_first


@gluon.jit
def _bwd_load_item(item, t, s, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, stat_bufs,
                   k_bufs, v_bufs, kv_ready, kv_free, ready, free, n_kb, n_kv_heads, group, n_heads, n_m, q_rows_b,
                   q_rows_h, q_cols_h, do_rows_b, do_rows_h, do_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, n_bkv,
                   head_group, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """The producer's part of work item ``item`` (``_bwd_item``), the program's t-th (its tiles counted from s;
    returned: s past them): its K and V (both consumers' keys, one tile each) into K/V buffer t % KV_BUFS once both
    consumers are done with that buffer's last item, then Q_i, dO_i, L_i and D_i of every query tile i >= i_first of
    every query head of the k/v head's group into stage s % STAGES (L_i and D_i into stat_bufs 2 s % STAGES and the
    next)."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    kv_bufs: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_KEYS: gl.constexpr = k_desc.block_type.shape[0]
    b, h_kv, key_start, i_first = _bwd_item(item, n_bkv, n_kv_heads, n_kb, head_group, BLOCK_KEYS, BLOCK_M,
                                            IS_CAUSAL)
    kv = t % kv_bufs
    row = b * kv_rows_b + h_kv * kv_rows_h + key_start
    mbarrier.wait(kv_free.index(kv), ((t // kv_bufs) & 1) ^ 1)  # a new barrier passes the parity-1 wait
    mbarrier.expect(kv_ready.index(kv), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _load_tile(k_desc, row, h_kv * kv_cols_h, kv_ready.index(kv), k_bufs.index(kv))
    _load_tile(v_desc, row, h_kv * kv_cols_h, kv_ready.index(kv), v_bufs.index(kv))
    for g in range(group):
        h = h_kv * group + g
        for i in range(i_first, n_m):
            stage = s % stages
            mbarrier.wait(free.index(stage), ((s // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), q_desc.block_type.nbytes + do_desc.block_type.nbytes +
                            2 * lse_desc.block_type.nbytes)
            _tma_load(lse_desc, [(b * n_heads + h) * n_m + i, 0], ready.index(stage), stat_bufs.index(2 * stage))
            _tma_load(delta_desc, [(b * n_heads + h) * n_m + i, 0], ready.index(stage), stat_bufs.index(2 * stage + 1))
            _load_tile(q_desc, b * q_rows_b + h * q_rows_h + i * BLOCK_M, h * q_cols_h, ready.index(stage),
                       q_bufs.index(stage))
            _load_tile(do_desc, b * do_rows_b + h * do_rows_h + i * BLOCK_M, h * do_cols_h, ready.index(stage),
                       do_bufs.index(stage))
            s += 1
    return s


@gluon.jit
def _bwd_load(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs,
              kv_ready, kv_free, ready, free, ids, id_ready, id_free, counter_ptr, n_items, n_kb, n_kv_heads, group,
              n_heads, n_m, q_rows_b, q_rows_h, q_cols_h, do_rows_b, do_rows_h, do_cols_h, kv_rows_b, kv_rows_h,
              kv_cols_h, n_bkv, head_group, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr):
    """The producer warp (``_bwd_load_item``): the program's item, or (PERSISTENT) each of its items in the order
    ``_position`` deals them, or (DYNAMIC) as a counter hands them out, passed to the consumers as the forward's
    ``_load`` passes them; its tiles counted on over the items (so a persistent program's next item's loads run
    under the last one's end)."""
    s = gl.to_tensor(0)
    if DYNAMIC:
        t = 0
        item = gl.program_id(0)
        while item < n_items:
            _publish(ids, id_ready, id_free, t, item)
            s = _bwd_load_item(item, t, s, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs,
                               stat_bufs, k_bufs, v_bufs, kv_ready, kv_free, ready, free, n_kb, n_kv_heads, group,
                               n_heads, n_m, q_rows_b, q_rows_h, q_cols_h, do_rows_b, do_rows_h, do_cols_h, kv_rows_b,
                               kv_rows_h, kv_cols_h, n_bkv, head_group, IS_CAUSAL, BLOCK_M)
            item = gl.num_programs(0) + _fetch_add(counter_ptr)  # under the item's last tiles (its round trip)
            t += 1
        _publish(ids, id_ready, id_free, t, n_items)
    elif PERSISTENT:
        t = 0
        for k in range(gl.cdiv(n_items, gl.num_programs(0))):
            item = _position(k)
            if item < n_items:  # the last round's items run out
                s = _bwd_load_item(item, t, s, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs,
                                   do_bufs, stat_bufs, k_bufs, v_bufs, kv_ready, kv_free, ready, free, n_kb,
                                   n_kv_heads, group, n_heads, n_m, q_rows_b, q_rows_h, q_cols_h, do_rows_b,
                                   do_rows_h, do_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, n_bkv, head_group,
                                   IS_CAUSAL, BLOCK_M)
                t += 1
    else:
        _bwd_load_item(_program_item(), 0, s, q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs,
                       stat_bufs, k_bufs, v_bufs, kv_ready, kv_free, ready, free, n_kb, n_kv_heads, group, n_heads,
                       n_m, q_rows_b, q_rows_h, q_cols_h, do_rows_b, do_rows_h, do_cols_h, kv_rows_b, kv_rows_h,
                       kv_cols_h, n_bkv, head_group, IS_CAUSAL, BLOCK_M)


@gluon.jit
def _bwd_consume_item(item, t, s, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, ds_bufs, dq_smem, dk_smem, dv_smem,
                      kv_ready, kv_free, ready, free, ds_ready, ds_free, done, dq_desc, dk_desc, dv_desc, n_kb, group,
                      n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h, dkv_cols_h, n_bkv, head_group,
                      cos, sin, rope_cols, TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_K: gl.constexpr, HEAD_DIM: gl.constexpr, PERSISTENT: gl.constexpr, DQ_LAG: gl.constexpr,
                      EXACT_SCALE: gl.constexpr, SKIP_UNSEEN: gl.constexpr, ROPE: gl.constexpr):
    """One consumer warpgroup's part of work item ``item`` (``_bwd_item``), the program's t-th (its tiles counted
    from s; returned: s past them): keys key_start + TILE * BLOCK_K .. + BLOCK_K, in K/V buffer t % KV_BUFS
    (released once its last product is done).
    Per query tile i (with L_i and D_i = rowsum(dO_i O_i)): S^T = K Q_i^T and dP^T = V dO_i^T,
    P^T = exp(fl(S^T / sqrt(d)) - L) rounded as the Triton backward rounds it, dS^T = P^T (dP^T - D);
    dV += P^T dO_i and dK += dS^T Q_i (register operands).
    dQ_i += dS K over both consumers' keys at once: each writes its dS^T into its half of a shared buffer (two
    buffers, alternating), and the consumers take turns (tile i's s-th of the program: consumer s % 2) to read the
    whole of it transposed, multiply by the program's K and add the fp32 result (dS K: the caller scales the sum by
    1 / sqrt(d), once, as the Triton fused backward's does) into the accumulator through
    ``dq_smem`` and a TMA reduce-add (FlashAttention-3's dQ writes), half the additions of a dQ part per consumer;
    above d 64 both do it every tile, each for half of dQ's columns (``_dq_split``). The dQ product is queued behind
    dK's. DQ_LAG: tile s's dQ product is taken at tile s + 1 (the item's last after its loop), when both halves of
    dS^T have long been written, instead of waiting for the other consumer's half at once; dK's product is then
    issued before dS^T's store and fences, which run under it (2-3% faster a program per item at
    1 x 16 x 16,384 x 64, 4% slower on the persistent grid at 4 x 32 x 2,048: notes/flash_attention.md, session 25).
    Every product is waited within the iteration (no wgmma in flight across a back edge: see ``_consume``). dK and dV
    go out through ``dk_smem``, ``dv_smem`` and TMA stores that run on under the next item; when those are stage
    buffers (``_epilogue_in_stages``, a program of one item), once both consumers have arrived at ``done`` (the other
    may still read its last Q_i, dO_i). SKIP_UNSEEN (causal): the query tiles that see none of this consumer's keys
    (the second's first of each item and head) run no products (``_bwd_unseen_tile``). ROPE: dK rotated back by minus
    RoPE's angles on its way out (``_rotated_back``; tables cos, sin (n_k, rope_cols)), dV stored first."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    kv_bufs: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    st_layout: gl.constexpr = _wgmma_layout(BLOCK_M)  # S^T, dP^T: (keys, queries)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)  # dK, dV (keys, d) and the dQ part (queries, d)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_rows: gl.constexpr = gl.SliceLayout(1, st_layout)
    query_cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # a row of L or D seen as a vector
    zero_st = gl.zeros([BLOCK_K, BLOCK_M], gl.float32, layout=st_layout)
    SPLIT: gl.constexpr = _dq_split(HEAD_DIM)
    DQ_COLS: gl.constexpr = HEAD_DIM // TILES if SPLIT else HEAD_DIM  # of dQ_i a consumer computes
    zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=_wgmma_layout(DQ_COLS))
    b, h_kv, key_start, i_first = _bwd_item(item, n_bkv, n_kv_heads, n_kb, head_group, TILES * BLOCK_K, BLOCK_M,
                                            IS_CAUSAL)
    kv = t % kv_bufs
    k_smem = k_bufs.index(kv)
    k = k_smem.slice(TILE * BLOCK_K, BLOCK_K)
    v = v_bufs.index(kv).slice(TILE * BLOCK_K, BLOCK_K)
    offs_key = key_start + TILE * BLOCK_K + gl.arange(0, BLOCK_K, layout=key_rows)
    dk = gl.zeros([BLOCK_K, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_K, HEAD_DIM], gl.float32, layout=acc_layout)
    k_cols = k_smem.slice(TILE * DQ_COLS, DQ_COLS, dim=1) if SPLIT else k_smem  # K's columns for this one's dQ
    dq_col = TILE * DQ_COLS if SPLIT else 0
    s_item = s
    dq_row = 0  # DQ_LAG: the last tile's row of dQ
    zero_ds = gl.zeros([BLOCK_K, BLOCK_M], dtype, layout=st_layout)
    # causal: the query tiles before i_seen see none of this consumer's keys (the second's first tile)
    i_seen = gl.minimum((key_start + TILE * BLOCK_K) // BLOCK_M, n_m) if IS_CAUSAL and SKIP_UNSEEN else i_first
    mbarrier.wait(kv_ready.index(kv), (t // kv_bufs) & 1)
    for g in range(group):
        h = h_kv * group + g
        for i in range(i_first, i_seen):
            row = (b * n_heads + h) * n_q + i * BLOCK_M  # of dQ_i in dq_desc's (B H n_q, d) view
            _bwd_unseen_tile(s, s_item, row, dq_row, ready, free, ds_bufs, ds_ready, ds_free, k_cols, zero_ds,
                             zero_dq, dq_smem, dq_desc, dq_col, TILE, SPLIT, DQ_LAG)
            dq_row = row
            s += 1
        for i in range(i_seen, n_m):
            stage = s % stages
            mbarrier.wait(ready.index(stage), (s // stages) & 1)
            lse = _reinterpret(stat_bufs.index(2 * stage), gl.float32, [BLOCK_M], flat).load(query_cols)
            q = q_bufs.index(stage)
            do = do_bufs.index(stage)
            st = warpgroup_mma(k, q.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v, do.permute((1, 0)), zero_st, use_acc=False, is_async=True)
            # The products in the order their operands are ready, each under the arithmetic that follows it
            # (FlashAttention-3's order): P^T under dP^T, dV under dS^T.
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))  # S^T done, dP^T running
            offs_q = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=query_cols)
            pt = _probabilities_t(st, lse, offs_key, offs_q, i * BLOCK_M < key_start + TILES * BLOCK_K, sm_scale,
                                  IS_CAUSAL, EXACT_SCALE)
            pt_a = gl.convert_layout(pt.to(dtype), a_layout)
            dv = warpgroup_mma(pt_a, do, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))  # dP^T done, dV running
            delta = _reinterpret(stat_bufs.index(2 * stage + 1), gl.float32, [BLOCK_M], flat).load(query_cols)
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            dst_lo = dst.to(dtype)
            dst_a = gl.convert_layout(dst_lo, a_layout)
            if DQ_LAG:  # dK's product first: dS^T's store and fences run under it (no one reads it this tile)
                dk = warpgroup_mma(dst_a, q, dk, is_async=True)
            _share_ds(dst_lo, s, ds_bufs, ds_ready, ds_free, TILE)
            if not DQ_LAG:
                dk = warpgroup_mma(dst_a, q, dk, is_async=True)
            row = (b * n_heads + h) * n_q + i * BLOCK_M  # of dQ_i in dq_desc's (B H n_q, d) view
            t_dq = s - DQ_LAG  # the tile whose dQ part is taken now, queued behind dK
            take = _takes_dq(t_dq, s_item, TILE, SPLIT)
            if take:  # dQ over both halves of the keys: this one's columns, or its turn (retires dV's, dK's)
                _add_dq(t_dq, free.index(stage), ds_bufs, ds_ready, ds_free, k_cols, zero_dq, dq_smem, dq_desc,
                        dq_row if DQ_LAG else row, dq_col)
            dv, dk, pt_a, dst_a = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pt_a, dst_a))
            if not take:
                mbarrier.arrive(free.index(stage), count=1)
            dq_row = row
            s += 1
    t_dq = s - 1  # DQ_LAG: the item's last tile's dQ part, if it is this one's
    if DQ_LAG and _takes_dq(t_dq, s_item, TILE, SPLIT):  # (not taken in the loop)
        _add_dq(t_dq, None, ds_bufs, ds_ready, ds_free, k_cols, zero_dq, dq_smem, dq_desc, dq_row, dq_col)
    mbarrier.arrive(kv_free.index(kv), count=1)  # every product reading this item's K and V is done
    key_row = b * dkv_rows_b + h_kv * dkv_rows_h + key_start + TILE * BLOCK_K  # of dK, dV (``_load_tile``'s row)
    if _epilogue_in_stages(HEAD_DIM):  # both consumers are done with every stage before either overwrites one
        mbarrier.arrive(done, count=1)
        mbarrier.wait(done, 0)
    if PERSISTENT:  # the last item's dK, dV stores (and dQ's additions) have read them
        tma.store_wait(0)
    dv_smem.store(dv.to(dtype))
    dk = dk * sm_scale
    if ROPE:
        dk = _rotated_back(dk, cos, sin, key_start + TILE * BLOCK_K, rope_cols)
    dk_smem.store(dk.to(dtype))
    fence_async_shared()
    _thread_barrier()  # every thread's part of both tiles is in shared memory before TMA reads them
    _store_tile(dk_desc, key_row, h_kv * dkv_cols_h, 0, dk_smem)
    _store_tile(dv_desc, key_row, h_kv * dkv_cols_h, 0, dv_smem)
    return s


@gluon.jit
def _bwd_consume(q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, ds_bufs, dq_smem, dk_smem, dv_smem, kv_ready, kv_free,
                 ready, free, ds_ready, ds_free, done, ids, id_ready, id_free, dq_desc, dk_desc, dv_desc, n_items,
                 n_kb, group, n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h, dkv_cols_h, n_bkv,
                 head_group, cos, sin, rope_cols, TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_K: gl.constexpr, HEAD_DIM: gl.constexpr, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr,
                 DQ_LAG: gl.constexpr, EXACT_SCALE: gl.constexpr, SKIP_UNSEEN: gl.constexpr, ROPE: gl.constexpr):
    """One consumer warpgroup (``_bwd_consume_item``): the program's item, or (PERSISTENT) each of its items in the
    order ``_position`` deals them, or (DYNAMIC) as the producer hands them over (``_take``) until n_items, as
    ``_bwd_load`` takes them. (A program of one item runs no loop around it: the loop's values cost the d 128
    backward spills in its MMA loop.)"""
    s = gl.to_tensor(0)  # tiles so far (a loop-carried value in the item's loops)
    if DYNAMIC:
        t = 0
        item = _take(ids, id_ready, id_free, t)
        while item < n_items:
            s = _bwd_consume_item(item, t, s, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, ds_bufs, dq_smem, dk_smem,
                                  dv_smem, kv_ready, kv_free, ready, free, ds_ready, ds_free, done, dq_desc, dk_desc,
                                  dv_desc, n_kb, group, n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b,
                                  dkv_rows_h, dkv_cols_h, n_bkv, head_group, cos, sin, rope_cols, TILE, IS_CAUSAL,
                                  BLOCK_M, BLOCK_K, HEAD_DIM, PERSISTENT, DQ_LAG, EXACT_SCALE, SKIP_UNSEEN, ROPE)
            t += 1
            item = _take(ids, id_ready, id_free, t)
    elif PERSISTENT:
        t = 0
        for k in range(gl.cdiv(n_items, gl.num_programs(0))):
            item = _position(k)
            if item < n_items:  # the last round's items run out
                s = _bwd_consume_item(item, t, s, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, ds_bufs, dq_smem,
                                      dk_smem, dv_smem, kv_ready, kv_free, ready, free, ds_ready, ds_free, done,
                                      dq_desc, dk_desc, dv_desc, n_kb, group, n_heads, n_q, n_m, sm_scale, n_kv_heads,
                                      dkv_rows_b, dkv_rows_h, dkv_cols_h, n_bkv, head_group, cos, sin, rope_cols, TILE,
                                      IS_CAUSAL, BLOCK_M, BLOCK_K, HEAD_DIM, PERSISTENT, DQ_LAG, EXACT_SCALE,
                                      SKIP_UNSEEN, ROPE)
                t += 1
    else:
        _bwd_consume_item(_program_item(), 0, s, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, ds_bufs, dq_smem,
                          dk_smem, dv_smem, kv_ready, kv_free, ready, free, ds_ready, ds_free, done, dq_desc, dk_desc,
                          dv_desc, n_kb, group, n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h,
                          dkv_cols_h, n_bkv, head_group, cos, sin, rope_cols, TILE, IS_CAUSAL, BLOCK_M, BLOCK_K,
                          HEAD_DIM, PERSISTENT, DQ_LAG, EXACT_SCALE, SKIP_UNSEEN, ROPE)
    tma.store_wait(0)  # TMA has read shared memory (dQ's last tile too) before the program's shared memory goes


@gluon.jit
def _bwd_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_desc, delta_desc, dk_desc, dv_desc, counter_ptr,
                sm_scale, n_heads, n_kv_heads, n_bkv, n_q, n_k, q_rows_b, q_rows_h, q_cols_h, do_rows_b, do_rows_h,
                do_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, dkv_rows_b, dkv_rows_h, dkv_cols_h, head_group, cos, sin,
                rope_cols, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr, DQ_LAG: gl.constexpr, EXACT_SCALE: gl.constexpr,
                SKIP_UNSEEN: gl.constexpr, ROPE: gl.constexpr, num_warps: gl.constexpr):
    """Work item (key block of TILES x BLOCK_K keys, one of n_bkv batch x k/v heads; ``_bwd_item``): dK, dV of its
    keys summed over the query heads of the group, and their part of dQ, the items ``head_group`` batch x k/v heads
    at a time (``_bwd_item``). A program per item, or (PERSISTENT, d 64) a program per SM taking items in the order
    ``_position`` deals them, or (DYNAMIC, with PERSISTENT) from a counter (``counter_ptr``, an int32 zero) as the
    forward's do, its K and V in two buffers so that the next item's load runs under the last one's end. Q's
    (b, h, n, :) element sits at row b * q_rows_b + h * q_rows_h + n, column h * q_cols_h of its descriptor's 2-D
    view (dO, K, V, and dK, dV with dkv_*, likewise, K and V one block of the item's keys); L, D (B, H, n_q;
    ``lse_desc``, ``delta_desc`` their rows of BLOCK_M) and dQ (B, H, n_q, d, fp32; ``dq_desc`` its (B H n_q, d)
    view) are contiguous. EXACT_SCALE: ``_exact_scale`` of the head dim (not of the tile it is padded to).
    SKIP_UNSEEN, ROPE (dK rotated back by RoPE's tables cos, sin (n_k, rope_cols)): ``_bwd_consume_item``."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[-1]
    BLOCK_KEYS: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = BLOCK_KEYS // TILES
    KV_BUFS: gl.constexpr = 2 if PERSISTENT else 1
    group = n_heads // n_kv_heads
    n_m = n_q // BLOCK_M
    n_kb = n_k // BLOCK_KEYS
    n_items = n_kb * n_bkv

    q_bufs = _tile_buffers(q_desc, STAGES)
    do_bufs = _tile_buffers(do_desc, STAGES)
    k_bufs = _tile_buffers(k_desc, KV_BUFS)
    v_bufs = _tile_buffers(v_desc, KV_BUFS)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_KEYS, BLOCK_M], q_desc.dtype)
    ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_KEYS, BLOCK_M], ds_layout)
    stat_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES] + lse_desc.block_type.shape,
                                          lse_desc.layout)  # L_i, D_i of each stage
    dq_bufs = gl.allocate_shared_memory(gl.float32, [TILES] + dq_desc.block_type.shape, dq_desc.layout)
    IN_STAGES: gl.constexpr = _epilogue_in_stages(HEAD_DIM)
    gl.static_assert(not IN_STAGES or (STAGES >= TILES and BLOCK_M == BLOCK_K), "dK, dV tiles must fit the stages")
    gl.static_assert(not (IN_STAGES and PERSISTENT), "dK, dV through the stages: a program of one item")
    gl.static_assert(PERSISTENT or not DYNAMIC, "items from the counter: a persistent grid")
    dkdv_bufs = _tile_buffers(dk_desc, 1 if IN_STAGES else 2 * TILES)  # each consumer's dK, dV (one unused in stages)
    kv_ready = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # DYNAMIC
    id_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    id_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for u in gl.static_range(2):
        mbarrier.init(id_ready.index(u), count=1)
        mbarrier.init(id_free.index(u), count=TILES)  # both consumers took the item
    for u in gl.static_range(KV_BUFS):
        mbarrier.init(kv_ready.index(u), count=1)
        mbarrier.init(kv_free.index(u), count=TILES)  # both consumers done with the item's K and V
    if IN_STAGES:
        mbarrier.init(done, count=TILES)  # both consumers past their last tile
    for u in gl.static_range(STAGES):
        mbarrier.init(ready.index(u), count=1)
        mbarrier.init(free.index(u), count=TILES)  # both consumers release a stage
    for u in gl.static_range(2):
        mbarrier.init(ds_ready.index(u), count=TILES)  # both consumers' halves of dS^T written
        mbarrier.init(ds_free.index(u), count=TILES if _dq_split(HEAD_DIM) else 1)  # read by the dQ product(s)

    gl.warp_specialize([
        (_bwd_consume, (q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, ds_bufs, dq_bufs.index(0),
                        q_bufs.index(0) if IN_STAGES else dkdv_bufs.index(0),
                        do_bufs.index(0) if IN_STAGES else dkdv_bufs.index(1), kv_ready, kv_free, ready, free,
                        ds_ready, ds_free, done, ids, id_ready, id_free, dq_desc, dk_desc, dv_desc, n_items, n_kb,
                        group, n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h, dkv_cols_h, n_bkv,
                        head_group, cos, sin, rope_cols, 0, IS_CAUSAL, BLOCK_M, BLOCK_K, HEAD_DIM, PERSISTENT,
                        DYNAMIC, DQ_LAG, EXACT_SCALE, SKIP_UNSEEN, ROPE)),
        (_bwd_consume, (q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, ds_bufs, dq_bufs.index(1),
                        q_bufs.index(1) if IN_STAGES else dkdv_bufs.index(2),
                        do_bufs.index(1) if IN_STAGES else dkdv_bufs.index(3), kv_ready, kv_free, ready, free,
                        ds_ready, ds_free, done, ids, id_ready, id_free, dq_desc, dk_desc, dv_desc, n_items, n_kb,
                        group, n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h, dkv_cols_h, n_bkv,
                        head_group, cos, sin, rope_cols, 1, IS_CAUSAL, BLOCK_M, BLOCK_K, HEAD_DIM, PERSISTENT,
                        DYNAMIC, DQ_LAG, EXACT_SCALE, SKIP_UNSEEN, ROPE)),
        (_bwd_load, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs,
                     kv_ready, kv_free, ready, free, ids, id_ready, id_free, counter_ptr, n_items, n_kb, n_kv_heads,
                     group, n_heads, n_m, q_rows_b, q_rows_h, q_cols_h, do_rows_b, do_rows_h, do_cols_h, kv_rows_b,
                     kv_rows_h, kv_cols_h, n_bkv, head_group, IS_CAUSAL, BLOCK_M, PERSISTENT, DYNAMIC)),
    ], [4, 1], [CONSUMER_REGS, 24])


# ----------------------------------------------------------------------------------------- backward at tile width 256
# One consumer's dK and dV for 64 keys (wgmma's least M) at d 256 are 256 fp32 registers a thread: there the two
# consumers share a program's keys and split the work as FlashAttention-3 does at that head dim (its sm90
# configuration, hopper/flash_bwd_launch_template.h: one stage of dO, S and dP split by queries, dK, dV and dQ by
# head-dim columns), exchanging P^T and dS^T through shared memory.


@gluon.jit
def _bwd_wide_load(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_smem, stat_bufs, k_smem, v_smem,
                   kv_ready, q_ready, q_free, do_ready, do_free, n_kv_heads, group, n_heads, n_m, q_rows_b, q_rows_h,
                   q_cols_h, do_rows_b, do_rows_h, do_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, IS_CAUSAL: gl.constexpr,
                   BLOCK_M: gl.constexpr):
    """The producer warp of ``_bwd_wide_kernel``: the program's K and V, then per query tile i >= i_first of each
    query head of the group Q_i, L_i and D_i into stage s % STAGES and dO_i into its one buffer, each once both
    consumers are done with its last."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_KEYS: gl.constexpr = k_desc.block_type.shape[0]
    b, h_kv, key_start, i_first = _bwd_item(_program_item(), gl.num_programs(1), n_kv_heads, gl.num_programs(0), 1,
                                            BLOCK_KEYS, BLOCK_M, IS_CAUSAL)
    row = b * kv_rows_b + h_kv * kv_rows_h + key_start
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _load_tile(k_desc, row, h_kv * kv_cols_h, kv_ready, k_smem)
    _load_tile(v_desc, row, h_kv * kv_cols_h, kv_ready, v_smem)
    s = 0
    for g in range(group):
        h = h_kv * group + g
        for i in range(i_first, n_m):
            stage = s % stages
            mbarrier.wait(q_free.index(stage), ((s // stages) & 1) ^ 1)  # a new barrier passes the parity-1 wait
            mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
            _tma_load(lse_desc, [(b * n_heads + h) * n_m + i, 0], q_ready.index(stage), stat_bufs.index(2 * stage))
            _tma_load(delta_desc, [(b * n_heads + h) * n_m + i, 0], q_ready.index(stage),
                      stat_bufs.index(2 * stage + 1))
            _load_tile(q_desc, b * q_rows_b + h * q_rows_h + i * BLOCK_M, h * q_cols_h, q_ready.index(stage),
                       q_bufs.index(stage))
            mbarrier.wait(do_free, (s & 1) ^ 1)
            mbarrier.expect(do_ready, do_desc.block_type.nbytes)
            _load_tile(do_desc, b * do_rows_b + h * do_rows_h + i * BLOCK_M, h * do_cols_h, do_ready, do_smem)
            s += 1


@gluon.jit
def _bwd_wide_consume(q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, pds_bufs, dq_smem, kv_ready, q_ready, q_free,
                      do_ready, do_free, exchanged, done, dq_desc, dk_desc, dv_desc, group, n_heads, n_q, n_m,
                      sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h, dkv_cols_h, TILE: gl.constexpr,
                      IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, EXACT_SCALE: gl.constexpr):
    """One consumer warpgroup of ``_bwd_wide_kernel``, TILE its half: of each query tile i, S^T = K Q_i^T and
    dP^T = V dO_i^T for its half of the queries (P^T and dS^T as ``_bwd_consume_item`` makes them), written into
    its half of the tile's shared P^T and dS^T (two tiles' worth, alternating); once both halves are in
    (``exchanged``), dV += P^T dO_i, dK += dS^T Q_i and dQ_i += dS K for its half of the head dim's columns (dQ in
    parts of ``dq_smem``'s width, each added by a TMA reduce-add). dO_i is released after dV's product, Q_i after
    dK's. Then dK (scaled by 1 / sqrt(d)) and dV go out by TMA through its Q stage (both consumers done with the
    stages: ``done``)."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = q_bufs.dtype
    BLOCK_KEYS: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // TILES  # queries of S^T and dP^T this one computes
    COLS: gl.constexpr = HEAD_DIM // TILES  # columns of dK, dV and dQ this one computes
    DQ_COLS: gl.constexpr = dq_smem.type.shape[1]
    gl.static_assert(COLS == 2 * DQ_COLS, "a consumer's dQ columns in two parts")
    st_layout: gl.constexpr = _wgmma_layout(ROWS)  # S^T, dP^T: (keys, queries)
    acc_layout: gl.constexpr = _wgmma_layout(COLS)  # dK, dV: (keys, columns)
    key_rows: gl.constexpr = gl.SliceLayout(1, st_layout)
    query_cols: gl.constexpr = gl.SliceLayout(0, st_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # a row of L or D seen as a vector
    zero_st = gl.zeros([BLOCK_KEYS, ROWS], gl.float32, layout=st_layout)
    zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=_wgmma_layout(DQ_COLS))
    b, h_kv, key_start, i_first = _bwd_item(_program_item(), gl.num_programs(1), n_kv_heads, gl.num_programs(0), 1,
                                            BLOCK_KEYS, BLOCK_M, IS_CAUSAL)
    offs_key = key_start + gl.arange(0, BLOCK_KEYS, layout=key_rows)
    dk = gl.zeros([BLOCK_KEYS, COLS], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_KEYS, COLS], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_ready, 0)
    s = 0
    for g in range(group):
        h = h_kv * group + g
        for i in range(i_first, n_m):
            stage = s % stages
            mbarrier.wait(q_ready.index(stage), (s // stages) & 1)
            mbarrier.wait(do_ready, s & 1)
            q = q_bufs.index(stage)
            # K, V and dO's buffers indexed by s >> 30 (0, unknown to the compiler): their wgmma descriptors are made
            # where the products read them instead of kept across the loop (ptxas spilled them there)
            k_smem = k_bufs.index(s >> 30)
            v_smem = v_bufs.index(s >> 30)
            do_smem = do_bufs.index(s >> 30)
            st = warpgroup_mma(k_smem, q.slice(TILE * ROWS, ROWS).permute((1, 0)), zero_st, use_acc=False,
                               is_async=True)
            dpt = warpgroup_mma(v_smem, do_smem.slice(TILE * ROWS, ROWS).permute((1, 0)), zero_st, use_acc=False,
                                is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))  # S^T done, dP^T running
            lse = _reinterpret(stat_bufs.index(2 * stage), gl.float32, [BLOCK_M], flat).slice(TILE * ROWS, ROWS)
            offs_q = i * BLOCK_M + TILE * ROWS + gl.arange(0, ROWS, layout=query_cols)
            pt = _probabilities_t(st, lse.load(query_cols), offs_key, offs_q, i * BLOCK_M < key_start + BLOCK_KEYS,
                                  sm_scale, IS_CAUSAL, EXACT_SCALE)
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
            delta = _reinterpret(stat_bufs.index(2 * stage + 1), gl.float32, [BLOCK_M], flat).slice(TILE * ROWS, ROWS)
            dst = pt * (dpt - gl.expand_dims(delta.load(query_cols), 0))
            buf = s % 2  # both halves of tile s - 2 are read: this one's wait for tile s - 1 saw the other arrive
            pt_smem = pds_bufs.index(2 * buf)
            dst_smem = pds_bufs.index(2 * buf + 1)
            pt_smem.slice(TILE * ROWS, ROWS, dim=1).store(pt.to(dtype))
            dst_smem.slice(TILE * ROWS, ROWS, dim=1).store(dst.to(dtype))
            fence_async_shared()
            _thread_barrier()  # every thread's part is in shared memory before the MMAs read it
            mbarrier.arrive(exchanged.index(buf), count=1)
            mbarrier.wait(exchanged.index(buf), (s // 2) & 1)  # and the other's half
            dv = warpgroup_mma(pt_smem, do_smem.slice(TILE * COLS, COLS, dim=1), dv, is_async=True)
            dk = warpgroup_mma(dst_smem, q.slice(TILE * COLS, COLS, dim=1), dk, is_async=True)
            dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv, ))
            mbarrier.arrive(do_free, count=1)
            row = (b * n_heads + h) * n_q + i * BLOCK_M  # of dQ_i in dq_desc's (B H n_q, d) view
            ds = dst_smem.permute((1, 0))
            dq = warpgroup_mma(ds, k_smem.slice(TILE * COLS, DQ_COLS, dim=1), zero_dq, use_acc=False, is_async=True)
            dq_next = warpgroup_mma(ds, k_smem.slice(TILE * COLS + DQ_COLS, DQ_COLS, dim=1), zero_dq, use_acc=False,
                                    is_async=True)
            dq, dk = warpgroup_mma_wait(num_outstanding=1, deps=(dq, dk))  # dK's product retired too: Q_i is free
            mbarrier.arrive(q_free.index(stage), count=1)
            _tma_add_tile(dq, dq_smem, dq_desc, row, TILE * COLS)
            dq_next = warpgroup_mma_wait(num_outstanding=0, deps=(dq_next, ))
            _tma_add_tile(dq_next, dq_smem, dq_desc, row, TILE * COLS + DQ_COLS)
            s += 1
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)  # both consumers are done with every stage before either overwrites one
    out = _reinterpret(q_bufs.index(TILE), dtype, [2, BLOCK_KEYS, COLS], _tile_layout(dk_desc.layout))  # dK, dV
    out.index(0).store((dk * sm_scale).to(dtype))
    out.index(1).store(dv.to(dtype))
    fence_async_shared()
    _thread_barrier()  # every thread's part of both tiles is in shared memory before TMA reads them
    key_row = b * dkv_rows_b + h_kv * dkv_rows_h + key_start  # of dK, dV (``_load_tile``'s row)
    _store_tile(dk_desc, key_row, h_kv * dkv_cols_h, TILE * COLS, out.index(0))
    _store_tile(dv_desc, key_row, h_kv * dkv_cols_h, TILE * COLS, out.index(1))
    tma.store_wait(0)  # TMA has read shared memory (dQ's last part too) before the program's shared memory goes


@gluon.jit
def _bwd_wide_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, lse_desc, delta_desc, dk_desc, dv_desc, sm_scale,
                     n_heads, n_kv_heads, n_bkv, n_q, n_k, q_rows_b, q_rows_h, q_cols_h, do_rows_b, do_rows_h,
                     do_cols_h, kv_rows_b, kv_rows_h, kv_cols_h, dkv_rows_b, dkv_rows_h, dkv_cols_h,
                     IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     EXACT_SCALE: gl.constexpr, num_warps: gl.constexpr):
    """``_bwd_kernel``'s work for one program per item (its arguments; n_bkv unused) with both consumers on the
    item's keys (``_bwd_wide_consume``): shared memory for STAGES tiles of Q, one of dO, K and V, two tiles' P^T and
    dS^T and a dQ part a consumer (at d 256 and two stages 225 KB of the H100's 227)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_KEYS: gl.constexpr = k_desc.block_type.shape[0]
    gl.static_assert(STAGES >= TILES, "dK, dV go out through a stage of Q a consumer")
    group = n_heads // n_kv_heads
    n_m = n_q // BLOCK_M
    q_bufs = _tile_buffers(q_desc, STAGES)
    do_bufs = _tile_buffers(do_desc, 1)
    k_bufs = _tile_buffers(k_desc, 1)
    v_bufs = _tile_buffers(v_desc, 1)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_KEYS, BLOCK_M], q_desc.dtype)
    pds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, BLOCK_KEYS, BLOCK_M], pds_layout)  # P^T, dS^T; two tiles
    stat_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES] + lse_desc.block_type.shape,
                                          lse_desc.layout)  # L_i, D_i of each stage
    dq_bufs = gl.allocate_shared_memory(gl.float32, [TILES] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    do_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    exchanged = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(do_ready, count=1)
    mbarrier.init(do_free, count=TILES)
    mbarrier.init(done, count=TILES)
    for u in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(u), count=1)
        mbarrier.init(q_free.index(u), count=TILES)
    for u in gl.static_range(2):
        mbarrier.init(exchanged.index(u), count=TILES)  # both consumers' halves of P^T and dS^T written

    gl.warp_specialize([
        (_bwd_wide_consume, (q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, pds_bufs, dq_bufs.index(0), kv_ready,
                             q_ready, q_free, do_ready, do_free, exchanged, done, dq_desc, dk_desc, dv_desc, group,
                             n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h, dkv_cols_h, 0,
                             IS_CAUSAL, BLOCK_M, EXACT_SCALE)),
        (_bwd_wide_consume, (q_bufs, do_bufs, stat_bufs, k_bufs, v_bufs, pds_bufs, dq_bufs.index(1), kv_ready,
                             q_ready, q_free, do_ready, do_free, exchanged, done, dq_desc, dk_desc, dv_desc, group,
                             n_heads, n_q, n_m, sm_scale, n_kv_heads, dkv_rows_b, dkv_rows_h, dkv_cols_h, 1,
                             IS_CAUSAL, BLOCK_M, EXACT_SCALE)),
        (_bwd_wide_load, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_bufs, do_bufs.index(0), stat_bufs,
                          k_bufs.index(0), v_bufs.index(0), kv_ready, q_ready, q_free, do_ready, do_free, n_kv_heads,
                          group, n_heads, n_m, q_rows_b, q_rows_h, q_cols_h, do_rows_b, do_rows_h, do_cols_h,
                          kv_rows_b, kv_rows_h, kv_cols_h, IS_CAUSAL, BLOCK_M)),
    ], [4, 1], [CONSUMER_REGS, 24])


# (query tile, keys a consumer, stages, consumer registers): three stages, as DQ_LAG holds a stage longer on the
# tiles a consumer takes dQ's product (interleaved rounds on one H100, 27101ab: x0.979 two stages' time at
# 1 x 16 x 16,384 x 64, x0.954 at d 128, x0.998 at 4 x 32 x 2,048 x 64)
BWD_CONFIG = (64, 64, 3, 240)
BWD_CONFIGS = (BWD_CONFIG, (64, 64, 2, 240), (64, 64, 4, 240))  # what scripts/flash_gluon_probe.py times
# At tile width 256 (``_bwd_wide_kernel``): (query tile, keys a program, stages of Q, consumer registers)
BWD_WIDE_CONFIG = (64, 64, 2, 240)
BWD_WIDE_CONFIGS = (BWD_WIDE_CONFIG, )
_STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # a row of L or D, in order
BWD_ORDERS = ("heads", "dynamic")  # a persistent backward's items: dealt in turn (``_position``), or from a counter
# The backward's choices of heads whose items go together (``_bwd_item``, ``backward_schedule``): every head at once
# was 1.34x slower at 4 x 32 x 2,048 x 64 (its running programs read more Q and dO than L2 holds)
HEAD_GROUPS = (1, 2, 4, 8)
# FLASH_GLUON_BWD_SCHEDULE=0: ``backward_schedule`` as before 5603016 (dealt where even, else a program per item head
# by head), for A/B runs of the step
BWD_SCHEDULE = os.environ.get("FLASH_GLUON_BWD_SCHEDULE", "1") != "0"
# FLASH_GLUON_EPILOGUE_ROPE=0: the op's dK rotated back by a pass of its own, not in the backward's epilogue
# (``rotates_dk``), for A/B runs of the step
EPILOGUE_ROPE = os.environ.get("FLASH_GLUON_EPILOGUE_ROPE", "1") != "0"
# The tile widths where the backward runs no products on the query tiles a consumer's keys are all after (the
# second's first tile of each causal item: ``_bwd_unseen_tile``). On one H200 (e92c4980, the backward alone, 3 rounds)
# at d 64 0.390 ms against 0.402 with them at xl's 4 x 25 x 2,048 (the op's items: a counter, 4 heads at a time), 0.484
# against 0.492 at 4 x 32 x 2,048 (dealt), 2.988 against 3.050 at 1 x 16 x 16,384 (a counter, 4 heads); at the 2.7B's
# d 80 (tile 128, dQ split between the consumers) 0.383 against 0.378 (8 heads at a time): slower there.
SKIP_UNSEEN_WIDTHS = (64, )
# By tile width (``tile_dim``), the fewest keys the op runs the backward from: faster than the Triton backward there
# (d 64: 02900c9; d 128: bcf08a2; d 256: 7b289bb; ``backward_preferred``)
BWD_MIN_KEYS = {64: 512, 128: 512, 256: 512}


def _bwd_wide(width: int) -> bool:
    """Whether the backward at this tile width is ``_bwd_wide_kernel`` (both consumers on a program's keys)."""
    return width == 256


def _bwd_keys(width: int, config) -> int:
    """The keys a backward program takes: both consumers' (``_bwd_kernel``), or the ones they share (wide)."""
    return config[1] if _bwd_wide(width) else TILES.value * config[1]


def rotates_dk(d: int) -> bool:
    """Whether ``backward`` takes RoPE's tables at head dim d (``rope``) and rotates dK back in its epilogue: below
    tile width 256 (the wide kernel's epilogue does not), unless FLASH_GLUON_EPILOGUE_ROPE=0."""
    return EPILOGUE_ROPE and not _bwd_wide(tile_dim(d))


def backward_launch_arguments(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                              lse: torch.Tensor, is_causal: bool, config=None, delta=None, dq_acc=None, dkdv=None,
                              programs: int | None = None, dq_lag: bool | None = None, order: str = "heads",
                              head_group: int = 1, skip_unseen: bool | None = None, rope=None):
    """What ``backward`` launches: (kernel, grid, positional arguments, constexprs and launch options, (dQ fp32, dK,
    dV)).
    D = rowsum(dO O) ((B, H, n_q) fp32) and the fp32 dQ accumulator (zeros, contiguous like q) are made here unless
    given (flash_triton's backward makes both in one pass), and dK, dV unless ``dkdv`` gives them (k's shape, in a
    layout TMA can write: ``_rows_and_columns``; made in k's: ``flash_triton.empty_like_heads``). Inputs as
    ``backward_supports`` takes them; ``config`` one of BWD_CONFIGS (None: BWD_CONFIG; at tile width 256
    BWD_WIDE_CONFIG's form, and its default);
    ``programs``: a persistent grid of that many (d 64; None: a program per work item), taking the items in
    ``order`` (one of BWD_ORDERS); ``head_group``: the batch x k/v heads whose items go together (``_bwd_item``);
    ``dq_lag``: each tile's dQ product a tile later (``_bwd_consume_item``; None: on a program per item, where it is
    faster); ``skip_unseen``: no products on the query tiles a consumer's keys are all after (causal; None: at tile
    width 64, where it is faster: ``SKIP_UNSEEN_WIDTHS``); ``rope``: RoPE's tables (cos, sin) (n_k, d / 2), by which
    dK is rotated back as it is written (``rotates_dk``; None: not rotated)."""
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    width = tile_dim(d)
    wide = _bwd_wide(width)
    config = config or (BWD_WIDE_CONFIG if wide else BWD_CONFIG)
    block_m, block_k, stages, regs = config
    keys = _bwd_keys(width, config)
    if width not in BWD_MIN_KEYS or n_q % block_m or n_k % keys:
        raise ValueError(f"the Gluon backward takes d a multiple of 8 from 40 to 256 (``tile_dim``), n_q a multiple "
                         f"of {block_m} and n_k of {keys}; got d {d}, n_q {n_q}, n_k {n_k}")
    if order not in BWD_ORDERS or head_group < 1 or (wide and head_group > 1):
        raise ValueError(f"the Gluon backward's order must be one of {BWD_ORDERS} and head_group at least 1 (at tile "
                         f"width 256: 1); got {order!r}, {head_group} at d {d}")
    if rope is not None:
        if wide:
            raise ValueError(f"the Gluon backward rotates dK by RoPE's tables below tile width 256 (``rotates_dk``); "
                             f"got d {d}")
        check_tables("the Gluon backward", *rope, n_k, d)
    if programs is not None and _epilogue_in_stages.fn(width):  # .fn: without the constexpr wrapper (~4 us a call)
        raise ValueError(f"the Gluon backward's persistent grid takes d 64 only (above, dK and dV go out through the "
                         f"stages: a program of one item); got d {d}")
    if delta is None:
        delta = (do.float() * o.float()).sum(-1)
    if dq_acc is None:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = dkdv or (flash_triton.empty_like_heads(k) for _ in "kv")
    if not (dk.shape == dv.shape == k.shape and dk.stride() == dv.stride() and _rows_and_columns(dk, width)):
        raise ValueError(f"dkdv must be two tensors of k's shape {tuple(k.shape)} with the same strides, as TMA can "
                         f"write them (``_rows_and_columns``)")
    q_desc, q_where = _descriptor(q, block_m)
    do_desc, do_where = _descriptor(do, block_m)
    k_desc, kv_where = _descriptor(k, keys)  # a program's keys in one tile
    v_desc, _ = _descriptor(v, keys)
    # the columns of a dQ part: a consumer's half (``_dq_split``), or at 256 a quarter (two parts a consumer)
    dq_cols = width // 4 if wide else width // TILES.value if _dq_split.fn(width) else width
    dq_desc, _ = _descriptor(dq_acc, block_m, dq_cols)
    lse, delta = lse.contiguous(), delta.contiguous()
    lse_desc, delta_desc = (_tensor_descriptor(t, [t.numel() // block_m, block_m], [block_m, 1], [1, block_m],
                                             _STATS_LAYOUT) for t in (lse, delta))  # row (b H + h) n_q / BLOCK_M + i
    out_block = (block_k, width // TILES.value if wide else width)  # a consumer's dK, dV tile
    (dk_desc, dkv_where), (dv_desc, _) = (_descriptor(t, *out_block) for t in (dk, dv))
    n_kb = n_k // keys
    grid = (n_kb, batch * kv_heads, 1) if programs is None else (min(n_kb * batch * kv_heads, programs), 1, 1)
    dynamic = programs is not None and order == "dynamic"
    # the items handed out past the grid's first (unread without ``dynamic``: D stands in)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else delta
    args = (q_desc, do_desc, k_desc, v_desc, dq_desc, lse_desc, delta_desc, dk_desc, dv_desc)
    args += () if wide else (counter, )
    args += (1 / math.sqrt(d), heads, kv_heads, batch * kv_heads, n_q, n_k, *q_where, *do_where, *kv_where,
             *dkv_where)
    if not wide:  # RoPE's tables as they are, contiguous (unread without ``rope``: D stands in)
        cos, sin = (delta, delta) if rope is None else (t.contiguous() for t in rope)
        args += (head_group, cos, sin, d // 2)
    # FP fusion off, as in the Triton kernels: each score is rounded as the forward rounded it (S * scale, then - L).
    constexprs = dict(IS_CAUSAL=is_causal, STAGES=stages, CONSUMER_REGS=regs)  # in the kernel's order
    if not wide:
        constexprs.update(PERSISTENT=programs is not None, DYNAMIC=dynamic,
                          DQ_LAG=int(programs is None if dq_lag is None else dq_lag))
    constexprs.update(EXACT_SCALE=_exact_scale.fn(d))
    if not wide:
        constexprs.update(SKIP_UNSEEN=width in SKIP_UNSEEN_WIDTHS if skip_unseen is None else skip_unseen,
                          ROPE=rope is not None)
    constexprs.update(num_warps=4, enable_fp_fusion=False)
    return (_bwd_wide_kernel if wide else _bwd_kernel), grid, args, constexprs, (dq_acc, dk, dv)


def backward(do, q, k, v, o, lse, is_causal: bool, config=None, delta=None, dq_acc=None, dkdv=None,
             persistent: bool = False, dq_lag: bool | None = None, order: str = "heads", head_group: int = 1,
             skip_unseen: bool | None = None, rope=None):
    """(dQ, dK, dV) of ``forward``'s O and L (natural units) for the upstream gradient dO: dQ like q, or, with
    ``dq_acc`` (fp32) given, dS K added into it (dQ times sqrt(d), as flash_triton's fused backward leaves it); dK,
    dV (B, H_kv, n_k, d) in k's layout (in ``dkdv`` when given); ``config`` as ``backward_launch_arguments`` takes it;
    ``persistent``: a program per SM (d 64), else a program per item (the op's choice: ``backward_schedule``);
    ``order``, ``head_group``, ``dq_lag``, ``skip_unseen`` and ``rope`` as ``backward_launch_arguments`` takes them.
    Without D and ``dq_acc``, both come from flash_triton's preprocess pass, as in its backward, which runs this one
    where ``backward_preferred`` (so that scripts/flash_gluon_probe.py --backward, which checks it against float64,
    times what the op runs)."""
    given = dq_acc is not None
    if delta is None and not given:
        dq_acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        delta = flash_triton.backward_preprocess(o, do, dq_acc)
    kernel, grid, args, constexprs, (dq, dk, dv) = backward_launch_arguments(
        do, q, k, v, o, lse, is_causal, config, delta, dq_acc, dkdv, _programs(q.device) if persistent else None,
        dq_lag, order, head_group, skip_unseen, rope)
    _run(kernel, grid, args, constexprs)
    return (dq if given else torch.mul(dq, 1 / math.sqrt(q.shape[-1]), out=torch.empty_like(q))), dk, dv


def backward_supports(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> bool:
    """Whether ``backward`` takes these (B, H, n, d) inputs: those ``supports`` takes with n_k a multiple of a
    program's keys, and a dO of q's shape that TMA can read (its strides may differ from q's)."""
    width = tile_dim(q.shape[-1])
    if width not in BWD_MIN_KEYS:
        return False
    config = BWD_WIDE_CONFIG if _bwd_wide(width) else BWD_CONFIG
    if q.shape[2] % config[0] or k.shape[2] % _bwd_keys(width, config):
        return False
    return do.shape == q.shape and supports(q, k, v, is_causal) and _rows_and_columns(do, width) is not None


def backward_schedule(q: torch.Tensor, k: torch.Tensor, is_causal: bool, config=None) -> dict:
    """``backward``'s options for the op: at d 64 the persistent grid, its items dealt in turn where that gives every
    program an even share (``_share`` at most EVEN_SHARE, as ``schedule``), else handed out by a counter; above d 64
    a program per item. Either of the latter takes the items HEAD_GROUPS[i] heads at a time, the fewest whose
    programs end soonest (``_greedy_share``, within 1%).
    On one H200 (5603016, the backward alone, medians of 3 rounds: ``flash_gluon_probe.py --backward``): at
    4 x 32 x 2,048 x 64 dealt 0.518 ms against 0.537 from the counter, 0.571 a program per item; at xl's
    4 x 25 x 2,048 x 64 (shares up to 1.14x dealt) from the counter 0.427 (4 heads at a time 0.424) against 0.435 dealt
    and 0.455 a program per item; at the 2.7B preset's 2 x 32 x 2,048 x 80 a program per item 8 heads at a time
    0.401 against 0.434 head by head; at 1 x 16 x 16,384 x 64 all within 1.3% but dealt (1.40x)."""
    width = tile_dim(k.shape[-1])
    if _bwd_wide(width):
        return {}
    block_m, block_k = (config or BWD_CONFIG)[:2]
    batch, kv_heads, n_k, _ = k.shape
    keys = TILES.value * block_k
    shape = (batch * kv_heads, n_k // keys, q.shape[2] // block_m, is_causal, keys, block_m, _programs(q.device))
    persistent = not _epilogue_in_stages.fn(width)
    if persistent and _share(*shape) <= EVEN_SHARE:
        return {"persistent": True}
    if not BWD_SCHEDULE:
        return {}
    return {"head_group": _fewest_heads(shape), **({"persistent": True, "order": "dynamic"} if persistent else {})}


def backward_preferred(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> bool:
    """Whether flash_triton's backward should run this kernel: ``backward_supports`` and at least BWD_MIN_KEYS of
    the head dim's tile width keys.
    On one H100, both with the op's preprocess pass (results/profiles/flash_gluon_probe_h100_8a5575a.jsonl, medians
    of three interleaved rounds), the backward alone takes 3.08 ms at 16,384 keys (1 x 16 heads) against 3.83-4.45
    for the Triton backward, and is 1.24x at 8,192 (2 x 16), 1.22x at 4,096 (4 x 16), 1.19x at 2,048 (4 x 32);
    at 02900c9 1.16x at 1,024 (8 x 32) and 1.04x at 512 (16 x 32) (notes/flash_attention.md, session 22).
    d 128 (753ebf0, bcf08a2): 5.04 against 6.67 ms at 16,384 keys, 1.31x at 8,192, 1.33x at 4,096, 1.38x at 2,048,
    1.80x at 1,024, 1.20x at 512 (session 23). d 256 (``_bwd_wide_kernel``, aebe344 on an H100, 7b289bb on an H200):
    1.79 against 4.12 ms at 1 x 8 x 8,192, 2.16x at 4 x 16 x 2,048, 2.00x at 8 x 16 x 1,024, 1.80x at 16 x 16 x 512;
    d 192 in that tile 2.18x at 1 x 16 x 8,192, 1.78x at 8 x 16 x 512 (session 28)."""
    min_keys = BWD_MIN_KEYS.get(tile_dim(q.shape[-1]))
    return min_keys is not None and k.shape[-2] >= min_keys and backward_supports(do, q, k, v, is_causal)


# (BLOCK_M a consumer, BLOCK_N, STAGES, consumer registers): what ``forward`` runs by tile width (the first: the fastest
# at b17a373, BLOCK_N 64 8-14% slower, 128-row consumers spill), and what scripts/flash_gluon_probe.py times.
CONFIGS = {64: ((64, 128, 3, 240), (64, 128, 2, 240), (64, 128, 4, 240), (64, 64, 3, 240)),
           128: ((64, 128, 2, 240), (64, 64, 3, 240), (64, 64, 4, 240)),
           256: ((64, 64, 2, 240), (64, 32, 2, 240))}  # 197 and 131 KB of shared memory; O 128 registers a thread
# (at 256, BLOCK_N 32 0.71-0.79x cuDNN against 0.86-1.01x for 64: results/profiles/flash_gluon_probe_d256_configs_*)


# The heads side by side ((B, n, H, d), the model's layout) below the tile's width as a 3-D view, a block of one
# head (``_rows_and_columns``): right on the H100 (float64 checks at d 48, 80, 96; the 2.7B step 1.03x faster than
# with the Triton kernels, notes/flash_attention.md session 27). FLASH_GLUON_SIDE_BY_SIDE_3D=0: those heads go to the
# Triton kernels (scripts/flash_gluon_probe.py --side-by-side checks and times the 3-D views).
SIDE_BY_SIDE_3D = os.environ.get("FLASH_GLUON_SIDE_BY_SIDE_3D", "1") != "0"


def _rows_and_columns(t: torch.Tensor, width: int) -> tuple[list[int], list[int], tuple[int, int, int]] | None:
    """A view of t (B, H, n, d) for TMA tiles ``width`` columns wide, (sizes, strides), and where (b, h, i, :) sits
    in it: row b * rows_b + h * rows_h + i, column h * cols_h of a 2-D view; or, for the heads side by side below
    the tile's width (a 2-D tile would read the next head's columns, not TMA's zero fill: ``tile_dim``), with
    SIDE_BY_SIDE_3D, the 3-D view (B n, H, d) whose element (row, h * cols_h, :) it is (cols_h 1; its blocks one
    head: ``_load_tile``). Covers (B, H, n, d) contiguous and the (B, n, H, d) layout the model's heads are views
    of; None for other strides (or misaligned ones)."""
    batch, heads, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    elem = t.element_size()
    if sd != 1 or (sn * elem) % 16 or t.data_ptr() % 16:
        return None
    if (batch == 1 or sb == n * sn) and (heads == 1 or ((sh * elem) % 16 == 0 and (heads - 1) * sh + d <= sn)):
        if heads == 1 or d == width:
            return [batch * n, (heads - 1) * sh + d], [sn, 1], (n, 0, sh)  # the heads side by side in a row
        if SIDE_BY_SIDE_3D and d <= sh:
            return [batch * n, heads, d], [sn, sh, 1], (n, 0, 1)  # the same, a block of one head
    if (heads == 1 or sh == n * sn) and (batch == 1 or sb == heads * n * sn) and d <= sn:
        return [batch * heads * n, d], [sn, 1], (heads * n, n, 0)  # each head's rows one after another
    return None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config=None) -> bool:
    """Whether ``forward`` takes these (B, H, n, d) inputs: an sm_90 GPU, bf16/fp16, a head dim with a tile
    (``tile_dim``), whole tiles (n_q a multiple of two query tiles, n_k of a key tile; causal: n_q == n_k), and
    strides TMA can read (``_rows_and_columns``)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    width = tile_dim(q.shape[-1])
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype) or width is None:
        return False
    block_m, block_n, _, _ = config or CONFIGS[width][0]
    n_q, n_k = q.shape[2], k.shape[2]
    if n_q % (TILES.value * block_m) or n_k % block_n or (is_causal and n_q != n_k) or k.stride() != v.stride():
        return False
    return all(_rows_and_columns(t, width) is not None for t in (q, k, v))


def preferred(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> bool:
    """Whether flash_triton's forward should run this kernel (with ``schedule``'s options): it ``supports`` the
    inputs and they have at least MIN_KEYS keys. Measured on one H100 (results/profiles/attention_gluon_{on,off}_h100_
    a097623.jsonl, bf16, causal): at 16,384 keys the op's forward is 1.24x (d 64) and 1.29x (d 128) the Triton
    forward's, 1.04x and 1.00x cuDNN's. With the persistent grid head by head (flash_gluon_probe_h100_4c1d4d5.jsonl)
    0.198 against 0.226 ms at 4 x 32 x 2,048 x 64, 0.294 against 0.388 at d 128, 0.126 against 0.137 at
    8 x 32 x 1,024 x 64, and 0.092 against 0.091 at 16 x 32 x 512 x 64."""
    return k.shape[-2] >= MIN_KEYS and supports(q, k, v, is_causal)


# The head dims whose op forward folds the scale into the exponent (``schedule``). One H100, 1 x 16 x 16,384, items from
# the counter: d 64 1.179 / 1.227 / 1.206 ms folded against 1.224 / 1.260 / 1.230 (3e99f6b twice, 488dba1), 0.190 vs
# 0.194 at 4 x 32 x 2,048 x 64 (488dba1); d 128 1.737 / 1.886 against 1.834 / 1.804: not settled.
FOLDED_HEAD_DIMS = (64,)
EVEN_SHARE = 1.05  # ``schedule``: the largest program's share of a persistent grid's work over the mean, at most


def _costs(n_m: int, n_k_blocks: int, is_causal: bool, rows: int, block_n: int) -> list[int]:
    """A head's n_m work items, the heaviest first, each costing its tiles and one more for its start and end. The
    forward's items (``_tile``): ``rows`` queries against key tiles of ``block_n`` (n_k_blocks without the causal
    mask); the backward's (``_bwd_item``): ``rows`` keys against query tiles of ``block_n``."""
    return [(-(-(n_m - j) * rows // block_n) if is_causal else n_k_blocks) + 1 for j in range(n_m)]


@functools.cache
def _share(n_bh: int, n_m: int, n_k_blocks: int, is_causal: bool, rows: int, block_n: int, programs: int) -> float:
    """The largest program's share of the work over the mean when ``programs`` take n_bh x n_m items (``_costs``)
    head by head, each head's heaviest first, in the order ``_position`` deals them."""
    costs = _costs(n_m, n_k_blocks, is_causal, rows, block_n) * n_bh
    programs = min(programs, len(costs))  # the grid's size (``launch_arguments``)
    totals = [0] * programs
    for first in range(0, len(costs), programs):
        dealt = costs[first:first + programs]
        if (first // programs) % 2:  # the rounds go forward and backward
            dealt = [0] * (programs - len(dealt)) + dealt[::-1]
        for p, cost in enumerate(dealt):
            totals[p] += cost
    return max(totals) * programs / sum(costs)


def _fewest_heads(shape: tuple) -> int:
    """The fewest of HEAD_GROUPS heads at a time whose programs end within 1% of the soonest (``_greedy_share`` of
    ``shape``: n_bh, n_m, n_k_blocks, is_causal, rows, block_n, programs)."""
    shares = {group: _greedy_share(*shape, group) for group in HEAD_GROUPS}
    return min(group for group, share in shares.items() if share <= 1.01 * min(shares.values()))


@functools.cache
def _greedy_share(n_bh: int, n_m: int, n_k_blocks: int, is_causal: bool, rows: int, block_n: int, programs: int,
                  head_group: int) -> float:
    """The last program's end over the mean share when ``programs`` take n_bh x n_m items (``_costs``) in the
    order of the backward's ``_bwd_item`` and the forward's ``_tile`` (``head_group`` heads at a time, block by
    block) each as soon as it is free: a
    grid of a program per item, whose programs the hardware starts in order, or a persistent grid fed by a
    counter. (Graham's list scheduling; the heaviest items late in the order make the tail.)"""
    costs = _costs(n_m, n_k_blocks, is_causal, rows, block_n)
    free = [0] * min(programs, n_bh * n_m)  # each program's end so far, a heap
    for first in range(0, n_bh, head_group):
        for cost in costs:
            for _ in range(min(head_group, n_bh - first)):
                heapq.heapreplace(free, free[0] + cost)
    return max(free) * len(free) / (sum(costs) * n_bh)


def schedule(q: torch.Tensor, k: torch.Tensor, is_causal: bool, config=None) -> dict:
    """``forward``'s options for the op: a persistent grid, O written by TMA, its items head by head, dealt in turn
    where that gives every program an even share (``_share`` at most EVEN_SHARE: short sequences over many heads), else
    handed out by a counter (``order="dynamic"``) a few heads at a time, as the backward's (``_fewest_heads``: 4 at xl's
    4 x 25 x 2,048 x 64, where the modelled end goes from 1.086 to 1.060 of the mean; 0.1567 -> 0.1530 ms on an H200,
    484c1e4). On one H100 (4c1d4d5, 52acdb8): dealt, 0.198 ms at 4 x 32 x 2,048 x 64 against 0.236 for a program per
    item (whose programs' starts and ends do not overlap) and 0.225 dealt block by block (whose running programs read
    every head's K and V); at 1 x 16 x 16,384 x 64, where the dealt shares reach 1.54x the mean (1.77 ms), from the
    counter 1.217-1.225 against 1.252-1.254 for a program per item (d 128: 1.78-1.80 against 1.80-1.85). The scale
    folded into the exponent (``_softmax_tile``) at the head dims of FOLDED_HEAD_DIMS. Where O's TMA store does not fit
    (TMA_STORE_TILE_DIMS: d above 128), a program per item, as fast or faster than the persistent grids without it
    (e92e164, d 256: 0.544 ms at 1 x 8 x 8,192 against 0.565 from the counter and 0.713 dealt head by head; 3.652
    against 3.959 and 5.112 at 1 x 16 x 16,384)."""
    width = tile_dim(q.shape[-1])
    if width not in TMA_STORE_TILE_DIMS:
        return {}
    block_m, block_n = (config or CONFIGS[width][0])[:2]
    batch, heads, n_q, _ = q.shape
    shape = (batch * heads, n_q // (TILES.value * block_m), k.shape[2] // block_n, is_causal, TILES.value * block_m,
             block_n, _programs(q.device))
    options = {"persistent": True, "tma_store": True, "folded": q.shape[-1] in FOLDED_HEAD_DIMS}
    if _share(*shape) <= EVEN_SHARE:
        return {**options, "order": "heads"}
    return {**options, "order": "dynamic", "head_group": _fewest_heads(shape)}


@functools.cache
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a TMA block: the default for its 2-D tile, at the block's rank (a 3-D block of
    one head, [rows, 1, width], lands as that tile: ``_tile_layout``)."""
    tile = [block[0], block[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(tile, {**DTYPES, torch.float32: gl.float32}[dtype])
    return dataclasses.replace(layout, rank=len(block))


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int | None = None):
    """A TMA descriptor of t (B, H, n, d) in its view (``_rows_and_columns``), its tiles ``block_cols`` wide (None:
    the head dim's tile width), and where its heads sit in that view."""
    width = tile_dim(t.shape[-1])
    shape, strides, where = _rows_and_columns(t, width)
    block = (block_rows, *[1] * (len(shape) - 2), block_cols or width)
    return _tensor_descriptor(t, shape, strides, list(block), _smem_layout(block, t.dtype)), where


# A validated descriptor's fields but its base, by everything its checks read (dtype, alignment, sizes, strides,
# block, layout): ``_tensor_descriptor``.
_DESCRIPTOR_FIELDS: dict[tuple, dict] = {}


def _tensor_descriptor(t: torch.Tensor, shape: list, strides: list, block: list, layout) -> TensorDescriptor:
    """``TensorDescriptor(t, shape, strides, block, layout)``, its checks run once per (dtype, alignment, shape,
    strides, block, layout) and their fields copied after that (~5 us of host time each, and a forward + backward
    makes 13: at 4 x 32 x 2,048 the step's host time is about its GPU time, notes/flash_attention.md session 24)."""
    key = (t.dtype, t.data_ptr() % 16, *shape, *strides, *block, layout)
    fields = _DESCRIPTOR_FIELDS.get(key)
    if fields is None:
        if len(_DESCRIPTOR_FIELDS) >= 1024:
            _DESCRIPTOR_FIELDS.clear()
        fields = dict(vars(TensorDescriptor(t, shape, strides, block, layout)))
        del fields["base"]  # the template keeps no tensor alive
        _DESCRIPTOR_FIELDS[key] = fields
    descriptor = object.__new__(TensorDescriptor)
    vars(descriptor).update(fields, base=t)
    return descriptor


# The compiled kernel of each launch seen (sizes, strides, dtype, alignment, options): later launches call it
# directly, without the JIT's per-call re-specialization of every argument (~100 us of host time a call, more than
# the kernel itself at 4 x 32 x 2,048; the Triton launches keep such a cache too, flash_triton._launch).
_COMPILED: dict[tuple, object] = {}


def _specialization(arg) -> tuple | object:
    """What of a launch argument the compiled kernel depends on: a descriptor's device, dtype, base alignment, sizes,
    strides and block; a tensor's dtype and alignment; any other argument's value (integers are specialized)."""
    if isinstance(arg, TensorDescriptor):
        base = arg.base
        return (base.device, base.dtype, base.data_ptr() % 16, *arg.shape, *arg.strides, *arg.block_shape)
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16
    return arg


def _run(kernel, grid: tuple, args: tuple, constexprs: dict) -> None:
    """``kernel[grid](*args, **constexprs)``, through ``_COMPILED`` after the first launch of its specialization
    (which takes the kernel's remaining parameters in order; compile options such as ``enable_fp_fusion`` are
    compiled in)."""
    key = (kernel.fn.__name__, grid, *constexprs.items(), *map(_specialization, args))
    compiled = _COMPILED.get(key)
    if compiled is None:
        if len(_COMPILED) >= 1024:
            _COMPILED.clear()
        _COMPILED[key] = kernel[grid](*args, **constexprs)
    else:
        compiled[grid](*args, *(constexprs[name] for name in kernel.arg_names[len(args):]))


# The forward's kernel options by name (``launch_arguments``' keywords): what scripts/gluon_compile.py compiles and
# scripts/flash_gluon_probe.py checks and times, beside the defaults.
OPTIONS = {"": {}, "folded": {"folded": True}, "tma_store": {"tma_store": True}, "pingpong": {"pingpong": True}}
# A persistent grid's order of the work items (``_tile``): dealt in turn block by block or head by head
# (``_position``), or head by head as a counter hands them out (``dynamic``, ``_load``).
ORDERS = ("blocks", "heads", "dynamic")


def can_take_turns(config, is_causal: bool) -> bool:
    """Whether ``pingpong`` can run with ``config``: both consumers of a work item must run as many rounds, i.e. see
    the same key tiles (always without the causal mask; with it, when BLOCK_N is a multiple of TILES x BLOCK_M)."""
    block_m, block_n = config[0], config[1]
    return not is_causal or block_n % (TILES.value * block_m) == 0


def runs_with(options: dict, config, d: int, is_causal: bool) -> bool:
    """Whether ``forward`` runs ``options`` (an OPTIONS entry or the persistent grid's) with ``config`` at head dim
    d: ``pingpong`` where the consumers can take turns (``can_take_turns``), ``tma_store`` where O's tiles fit
    (TMA_STORE_TILE_DIMS); ``launch_arguments`` refuses the rest."""
    return ((not options.get("pingpong") or can_take_turns(config, is_causal))
            and (not options.get("tma_store") or tile_dim(d) in TMA_STORE_TILE_DIMS))


@functools.cache
def _programs(device: torch.device) -> int:
    """A persistent grid: one program per SM (a program's registers fill an SM)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config=None,
                     folded: bool = False, programs: int | None = None, out=None, tma_store: bool = False,
                     pingpong: bool = False, order: str = "blocks", head_group: int = 1):
    """What ``forward`` launches: (grid, positional arguments, constexprs, (O, L)), O and L allocated here unless
    ``out`` gives them (O in q's layout: ``flash_triton.empty_like_heads``; L (B, H, n_q) fp32 contiguous).
    ``programs``: the persistent grid's size (None: one program per work item), taking the items in ``order`` (one
    of ORDERS: ``_tile``), ``head_group`` heads at a time (not block by block: ``order="blocks"`` on a persistent
    grid). Also used to compile the kernel on a machine without a GPU (scripts/gluon_compile.py)."""
    block_m, block_n, stages, regs = config or CONFIGS[tile_dim(q.shape[-1])][0]
    batch, heads, n_q, d = q.shape
    block_major = programs is not None and order == "blocks"
    if order not in ORDERS or head_group < 1 or (block_major and head_group > 1):
        raise ValueError(f"order must be one of {ORDERS} and head_group at least 1 (1 block by block: order "
                         f"'blocks' on a persistent grid); got {order!r}, {head_group}")
    if tma_store and tile_dim(d) not in TMA_STORE_TILE_DIMS:
        raise ValueError(f"tma_store takes tile widths {TMA_STORE_TILE_DIMS} (O's tiles must fit the shared memory); "
                         f"got d {d}")
    if pingpong and not can_take_turns((block_m, block_n), is_causal):
        raise ValueError(f"pingpong needs both consumers to see the same key tiles: causal with BLOCK_N {block_n} "
                         f"not a multiple of {TILES.value} x BLOCK_M {block_m}")
    if out is None:
        out = (flash_triton.empty_like_heads(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
    o, lse = out
    q_desc, q_where = _descriptor(q, block_m)
    k_desc, kv_where = _descriptor(k, block_n)
    v_desc, _ = _descriptor(v, block_n)
    o_desc, o_where = _descriptor(o, block_m)
    n_tiles = n_q // (TILES.value * block_m) * batch * heads
    grid = (n_tiles if programs is None else min(n_tiles, programs), 1, 1)  # 3-D: the compiled kernel's launcher
    dynamic = programs is not None and order == "dynamic"
    # the items handed out past the grid's first (unread without ``dynamic``: L stands in)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else lse
    args = (q_desc, k_desc, v_desc, o_desc, o, lse, counter, 1 / math.sqrt(d), heads, heads // k.shape[1],
            batch * heads, n_q, k.shape[2], *q_where, *kv_where, *o_where, o.stride(0), o.stride(1), o.stride(2),
            head_group)
    constexprs = dict(IS_CAUSAL=is_causal, FOLDED=folded, TMA_STORE=tma_store, PINGPONG=pingpong, STAGES=stages,
                      CONSUMER_REGS=regs, BLOCK_MAJOR=block_major, DYNAMIC=dynamic,
                      num_warps=4, enable_fp_fusion=False)  # each rounding as written (``_softmax_tile``)
    return grid, args, constexprs, (o, lse)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, config=None, folded: bool = False,
            persistent: bool = False, out=None, tma_store: bool = False, pingpong: bool = False,
            order: str = "blocks", head_group: int = 1):
    """O (q's shape and layout) and L (natural logsumexp, (B, H, n_q) fp32) of q (B, H, n_q, d) and k, v
    (B, H_kv, n_k, d); the inputs must pass ``supports``. ``config`` overrides CONFIGS[tile_dim(d)][0]; ``folded``
    folds the scale into the exponent's multiply-add (``_softmax_tile``); ``persistent`` launches one program per SM,
    each taking work items in turn in ``order`` (``_tile``; else one program per item: as fast or faster where
    measured);
    ``out``: (O, L) to write (``launch_arguments``); ``tma_store`` writes O through shared memory and TMA,
    ``pingpong`` has the consumers take turns (``_consume``); ``head_group``: the items that many heads at a time
    (``_tile``)."""
    grid, args, constexprs, outputs = launch_arguments(q, k, v, is_causal, config, folded,
                                                       _programs(q.device) if persistent else None, out, tma_store,
                                                       pingpong, order, head_group)
    _run(_fwd_kernel, grid, args, constexprs)
    return outputs
