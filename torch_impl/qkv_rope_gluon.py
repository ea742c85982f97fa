"""The attention's q, k, v product with RoPE in its epilogue: one persistent, warp-specialized Hopper GEMM in Gluon
(sm_90, Triton 3.6's Gluon), the structure of ``torch_impl.swiglu_gluon``'s (its producer, ring, ping-pong consumers
and TMA stores, whose helpers it uses).

``qkv_rope_gemm(x, W_q, W_k, W_v, cos, sin)`` is x [W_q; W_k; W_v]^T (B, T, 3 d) for x (B, T, K) with the q and k
columns rotated by RoPE: each head's adjacent pairs (2j, 2j + 1) at position t by the angles of the tables' row t
(cos, sin of shape (T, d_head / 2)), in fp32 from the accumulator, rounded to bf16 once. The model's path makes the
product with cuBLAS (the weights concatenated first: ``qkv_projection.QKVProduct``), then rotates q and k and splits
the three in a pass of their own (``qkv_projection.rotate_split``: 2.1 ms a step at xl 4 x 2,048 on an H200,
notes/train_step.md session 53): here the weights are read where they are (one TMA descriptor each) and the product
leaves the kernel rotated.

An output tile is one weight's (BLOCK_M, BLOCK_N); a weight whose rows are not whole tiles (xl's d 1,600 = 12.5 x 128)
gets a last tile whose missing rows TMA reads as zeros and whose columns past d are not stored (they would be the
next weight's). ``scripts/qkv_rope_probe.py`` times it against cuBLAS's product and the split pass.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from torch_impl.gluon_hopper import tma_load as _tma_load
from torch_impl.swiglu_gluon import (CONSUMERS, _acc_layout, _barriers, _descriptor, _halves, _products, _store_out,
                                     _tile_at)


@gluon.jit
def _load(x_desc, wq_desc, wk_desc, wv_desc, x_bufs, w_bufs, ready, free, n_tiles, tiles_m, tiles_w, k_tiles,
          GROUP_M: gl.constexpr):
    """The producer (one warp): the program's tiles in order, each tile's k-tiles into the ring (stage j % STAGES
    for the program's j-th k-tile, once its previous use is freed); a tile's weight rows from W_q, W_k or W_v, the
    column tile's third of the product (rows past d read as zeros)."""
    stages: gl.constexpr = x_bufs.type.shape[0]
    block_m: gl.constexpr = x_desc.block_type.shape[0]
    block_k: gl.constexpr = x_desc.block_type.shape[1]
    block_n: gl.constexpr = wq_desc.block_type.shape[0]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + wq_desc.block_type.nbytes
    j = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_at(tile, tiles_m, 3 * tiles_w, GROUP_M)
        part = pid_n // tiles_w
        row = (pid_n % tiles_w) * block_n
        for k in range(k_tiles):
            stage = j % stages
            mbarrier.wait(free.index(stage), ((j // stages) & 1) ^ 1)  # barriers start as if phase 1 had completed
            mbarrier.expect(ready.index(stage), nbytes)
            _tma_load(x_desc, [pid_m * block_m, k * block_k], ready.index(stage), x_bufs.index(stage))
            if part == 0:
                _tma_load(wq_desc, [row, k * block_k], ready.index(stage), w_bufs.index(stage))
            elif part == 1:
                _tma_load(wk_desc, [row, k * block_k], ready.index(stage), w_bufs.index(stage))
            else:
                _tma_load(wv_desc, [row, k * block_k], ready.index(stage), w_bufs.index(stage))
            j += 1


@gluon.jit
def _rotated(x, cos, sin, first_row, first_col, seq, HEAD_DIM: gl.constexpr):
    """A (rows, columns) fp32 block of q or k whose element (r, c) is the product's (first_row + r, first_col + c)
    rotated by RoPE: each head's pair (2j, 2j + 1) at position (first_row + r) mod seq by the angle whose cos and
    sin are the tables' (position, j) (contiguous fp32, HEAD_DIM / 2 columns): even x_2j cos - x_2j+1 sin, odd
    x_2j sin + x_2j+1 cos, as ``qkv_projection.rotate_pairs`` (in a wgmma accumulator both columns of a pair are
    one thread's; flash_gluon's ``_rotated_back`` is the rotation by minus the angles)."""
    ROWS: gl.constexpr = x.type.shape[0]
    PAIRS: gl.constexpr = x.type.shape[1] // 2
    even, odd = gl.split(gl.reshape(x, [ROWS, PAIRS, 2]))
    layout: gl.constexpr = even.type.layout
    positions = (first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))) % seq
    pairs = (first_col // 2 + gl.arange(0, PAIRS, layout=gl.SliceLayout(0, layout))) % (HEAD_DIM // 2)
    offs = gl.expand_dims(positions, 1) * (HEAD_DIM // 2) + gl.expand_dims(pairs, 0)
    c = gl.load(cos + offs)
    s = gl.load(sin + offs)
    rotated = gl.reshape(gl.join(even * c - odd * s, even * s + odd * c), [ROWS, 2 * PAIRS])
    return gl.convert_layout(rotated, x.type.layout)  # the same registers: x's layout back, for the caller's branches


@gluon.jit
def _consume(x_bufs, w_bufs, ready, free, turn, out_bufs, out_desc, cos, sin, seq, width, n_tiles, tiles_m, tiles_w,
             k_tiles, CONSUMER: gl.constexpr, GROUP_M: gl.constexpr, HEAD_DIM: gl.constexpr,
             acc_layout: gl.constexpr):
    """Consumer CONSUMER (one warpgroup, ping-pong: the program's tiles CONSUMER, CONSUMER + 2, ...; swiglu_gluon's
    ``_consume``): a tile's products, then each half of its columns rotated where it is q's or k's, rounded to
    bf16 and stored by TMA, unless it starts past the weight's ``width`` rows."""
    block_m: gl.constexpr = x_bufs.type.shape[1]
    block_n: gl.constexpr = w_bufs.type.shape[1]
    half: gl.constexpr = block_n // 2
    dtype: gl.constexpr = out_desc.dtype
    i = CONSUMER  # the tile's index among the program's tiles
    r = 0  # this consumer's tiles so far
    for tile in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), n_tiles, CONSUMERS * gl.num_programs(0)):
        pid_m, pid_n = _tile_at(tile, tiles_m, 3 * tiles_w, GROUP_M)
        acc = _products(x_bufs, w_bufs, ready, free, turn, gl.zeros((block_m, block_n), gl.float32, acc_layout),
                        i * k_tiles, k_tiles, r, CONSUMER, False, False)
        part = pid_n // tiles_w
        col = (pid_n % tiles_w) * block_n  # in the weight's rows: the product's column part * width + col
        off_m = pid_m * block_m
        left, right = _halves(acc)
        if part < 2:
            left = _rotated(left, cos, sin, off_m, col, seq, HEAD_DIM)
        _store_out(left.to(dtype), out_desc, out_bufs, 2 * r, off_m, part * width + col)
        if col + half < width:
            if part < 2:
                right = _rotated(right, cos, sin, off_m, col + half, seq, HEAD_DIM)
            _store_out(right.to(dtype), out_desc, out_bufs, 2 * r + 1, off_m, part * width + col + half)
        i += CONSUMERS
        r += 1
    tma.store_wait(pendings=0)


@gluon.jit
def qkv_rope_kernel(x_desc, wq_desc, wk_desc, wv_desc, out_desc, cos, sin, seq, GROUP_M: gl.constexpr,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """x [W_q; W_k; W_v]^T with q and k rotated by RoPE, for x (M, K) and the weights (d, K): the output (M, 3 d)
    in blocks of (BLOCK_M, BLOCK_N / 2); a program per SM, its tiles the grid's program_id, + num_programs, ..."""
    block_m: gl.constexpr = x_desc.block_type.shape[0]
    block_k: gl.constexpr = x_desc.block_type.shape[1]
    block_n: gl.constexpr = wq_desc.block_type.shape[0]
    gl.static_assert(STAGES >= 2, "a ring of one stage deadlocks: a stage is freed only after the next one's wait")
    gl.static_assert(2 * out_desc.block_type.shape[1] == block_n, "the output's blocks: half a tile wide")
    width = wq_desc.shape[0]
    tiles_m = gl.cdiv(x_desc.shape[0], block_m)
    tiles_w = gl.cdiv(width, block_n)
    k_tiles = gl.cdiv(x_desc.shape[1], block_k)
    n_tiles = tiles_m * 3 * tiles_w
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(wq_desc.dtype, [STAGES] + wq_desc.block_type.shape, wq_desc.layout)
    out0 = gl.allocate_shared_memory(out_desc.dtype, [1] + out_desc.block_type.shape, out_desc.layout)
    out1 = gl.allocate_shared_memory(out_desc.dtype, [1] + out_desc.block_type.shape, out_desc.layout)
    ready, free, turn = _barriers(STAGES, 1)
    acc_layout: gl.constexpr = _acc_layout(block_m, block_n)
    gl.warp_specialize([
        (_consume, (x_bufs, w_bufs, ready, free, turn, out0, out_desc, cos, sin, seq, width, n_tiles, tiles_m,
                    tiles_w, k_tiles, 0, GROUP_M, HEAD_DIM, acc_layout)),
        (_consume, (x_bufs, w_bufs, ready, free, turn, out1, out_desc, cos, sin, seq, width, n_tiles, tiles_m,
                    tiles_w, k_tiles, 1, GROUP_M, HEAD_DIM, acc_layout)),
        (_load, (x_desc, wq_desc, wk_desc, wv_desc, x_bufs, w_bufs, ready, free, n_tiles, tiles_m, tiles_w, k_tiles,
                 GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, 24])


# ((BLOCK_M, BLOCK_N, BLOCK_K), stages, a consumer's registers): the ring's stages hold x's and one weight's k-tiles
# (32 KB at 128 x 128 x 64), each consumer one output block (16 KB). On one H200 (53db535, 04645e3; from CUDA graphs)
# at xl's 8,192 x 1,600 -> 3 x 1,600: 0.195-0.199 ms with 4 stages, 0.210 with 5, 0.214 with 6; at the 2.7B's
# 4,096 x 2,560 -> 3 x 2,560: 0.233-0.236, 0.221-0.224, 0.221-0.225.
CONFIGS = (((128, 128, 64), 4, 232), ((128, 128, 64), 5, 232), ((128, 128, 64), 6, 232))


def input_problem(x: torch.Tensor, weights: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor,
                  config=CONFIGS[0]) -> str | None:
    """What ``qkv_rope_gemm`` cannot take of these inputs, or None: x (B, T, K) and the three weights (d, K) bf16,
    the tables cos, sin (T, d_head / 2) fp32 (``RotaryEmbedding.tables(T)``), all contiguous on one CUDA device; B T
    a multiple of BLOCK_M, K of BLOCK_K, d of half a tile and of d_head."""
    (block_m, block_n, block_k), _, _ = config
    if x.ndim != 3 or any(w.ndim != 2 for w in weights) or cos.ndim != 2 or sin.shape != cos.shape:
        return "x must be (B, T, K), the weights (d, K), cos and sin (T, d_head / 2) alike"
    (batch, seq, k), d, d_head = x.shape, weights[0].shape[0], 2 * cos.shape[1]
    if any(w.shape != (d, k) for w in weights) or cos.shape[0] != seq or not batch * seq * d * k * d_head:
        return "the weights must be (d, K) alike with x's K, the tables T rows long, no size 0"
    for size, name, multiple in ((batch * seq, "B T", block_m), (k, "K", block_k), (d, "d", block_n // 2),
                                 (d, "d", d_head)):
        if size % multiple:
            return f"{name} {size} must be a multiple of {multiple}"
    if not (x.dtype == weights[0].dtype == weights[1].dtype == weights[2].dtype == torch.bfloat16
            and cos.dtype == sin.dtype == torch.float32):
        return "x and the weights must be bf16, the tables fp32"
    tensors = (x, *weights, cos, sin)
    if not all(t.is_cuda and t.device == x.device and t.is_contiguous() for t in tensors):
        return "every input must be contiguous on one CUDA device"
    return None


def qkv_rope_gemm(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, config=CONFIGS[0], group_m: int = 8) -> torch.Tensor:
    """x [W_q; W_k; W_v]^T (B, T, 3 d) with q's and k's columns at position t rotated by RoPE (the module's doc),
    for inputs ``input_problem`` finds nothing wrong with (else a one-line ValueError); ``group_m`` row tiles down a
    column before the next."""
    problem = input_problem(x, (w_q, w_k, w_v), cos, sin, config)
    if problem is not None:
        raise ValueError(f"qkv_rope_gemm: {problem}; got x {tuple(x.shape)} {x.dtype} on {x.device}, the weights "
                         f"{[tuple(w.shape) for w in (w_q, w_k, w_v)]} {w_q.dtype}, cos {tuple(cos.shape)} "
                         f"{cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")
    (block_m, block_n, block_k), stages, regs = config
    (batch, seq, _), d = x.shape, w_q.shape[0]
    out = x.new_empty(batch, seq, 3 * d)
    rows = x.view(batch * seq, -1)
    n_tiles = (batch * seq // block_m) * 3 * -(-d // block_n)
    programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count, n_tiles)
    qkv_rope_kernel[(programs,)](
        _descriptor(rows, [block_m, block_k]), *(_descriptor(w, [block_n, block_k]) for w in (w_q, w_k, w_v)),
        _descriptor(out.view(batch * seq, -1), [block_m, block_n // 2]), cos, sin, seq, GROUP_M=group_m,
        HEAD_DIM=2 * cos.shape[1], STAGES=stages, CONSUMER_REGS=regs, num_warps=4)
    return out
