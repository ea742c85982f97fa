"""SwiGLU's MLP in the epilogues of persistent, warp-specialized Hopper GEMMs written in Gluon, forward and backward
(sm_90, Triton 3.6's Gluon): ``TransformerLM(..., mlp="gluon")``, the e2e benchmark's and the trainer's ``--mlp
gluon``.

* ``swiglu_mlp(x, W1, W3, W2)``: the whole MLP as one op opaque to torch.compile, y = (SiLU(x W1^T) x W3^T) W2^T
  with h1, h3 and g beside it. Its forward is ``swiglu_product``: both products and SiLU(h1) h3 in one kernel
  (``swiglu_gemm_kernel``). Its backward computes SwiGLU's backward in the epilogue of dg = dy W2
  (``swiglu_backward``: ``swiglu_backward_kernel``), so dg is never written, then dx and the weights' gradients
  with cuBLAS. Off sm_90, off bf16, or on shapes that are not whole tiles, each op runs PyTorch's ops instead.
* ``swiglu_gemm`` and ``swiglu_backward_gemm``: the kernels' hosts; ``CONFIGS`` and ``BACKWARD_CONFIGS`` their
  tilings, the first of each the default.

Triton's own pipelining ran the fused product at ~510 TFLOP/s where cuBLAS runs the two products at ~730
(notes/train_step.md, session 47), so the structure here is the one Hopper GEMMs at cuBLAS's speed use (CUTLASS's
"ping-pong"; scripts/gluon_probe.py is its non-persistent ancestor): a one-warp producer TMA-loads x's, W1's and
W3's k-tiles into a ring of shared-memory stages, and two consumer warpgroups take the program's output tiles in
turn, so that one's epilogue (SiLU, the product, three TMA stores) runs while the other's wgmmas run. A consumer's
tile is (BLOCK_M, BLOCK_N) of h1 and the same of h3, computed as one product: a stage holds W1's k-tile above W3's,
so each wgmma is 2 BLOCK_N wide: a wgmma reads its x tile from shared memory once per instruction, so a wide
instruction reads it less often per FLOP (Triton's Gluon tutorials reach cuBLAS's speed with 256 wide ones). A
COOPERATIVE configuration puts both consumers on each tile instead, half its rows each (slower at every
configuration measured). Timed from CUDA graphs on the H200 at xl's shapes (notes/train_step.md, session 48): the
forward runs both products and SwiGLU in cuBLAS's time for the two products alone, 1.16x cuBLAS's products with
the compiled SwiGLU; the backward 1.12x cuBLAS's dg with the compiled backward. ``scripts/swiglu_probe.py`` times
them, ``scripts/step_probe.py`` (``+gsw2``) puts them in the step.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from torch_impl.gluon_hopper import thread_barrier as _thread_barrier
from torch_impl.gluon_hopper import tma_load as _tma_load
from torch_impl.gluon_hopper import tma_store as _tma_store

CONSUMERS = gl.constexpr(2)  # consumer warpgroups a program


@gluon.jit
def _tile_at(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """Output tile ``tile`` -> (row tile, column tile): GROUP_M row tiles down a column before the next column (the
    weights' tiles stay in L2 while x's rows stream)."""
    group = GROUP_M * tiles_n
    first_m = (tile // group) * GROUP_M
    rows = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % group) % rows, (tile % group) // rows


@gluon.jit
def _load(x_desc, w1_desc, w3_desc, x_bufs, w_bufs, ready, free, n_tiles, tiles_m, tiles_n, k_tiles,
          GROUP_M: gl.constexpr, W_KN: gl.constexpr):
    """The producer (one warp): the program's tiles in order, each tile's k-tiles into the ring; the j-th k-tile
    of the program goes to stage j % STAGES once its (j // STAGES)-th previous use is freed, W1's k-tile in the
    top half of the stage's weight buffer and W3's in the bottom half; without W3 (``None``), W1's k-tile is the
    stage's weight buffer (the backward's W2, stored (K, N) with ``W_KN``, else (N, K))."""
    stages: gl.constexpr = x_bufs.type.shape[0]
    block_m: gl.constexpr = x_desc.block_type.shape[0]
    block_k: gl.constexpr = x_desc.block_type.shape[1]
    block_n: gl.constexpr = w1_desc.block_type.shape[1 if W_KN else 0]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + (1 if w3_desc is None else 2) * w1_desc.block_type.nbytes
    j = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_m, pid_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
        for k in range(k_tiles):
            stage = j % stages
            mbarrier.wait(free.index(stage), ((j // stages) & 1) ^ 1)  # barriers start as if phase 1 had completed
            mbarrier.expect(ready.index(stage), nbytes)
            _tma_load(x_desc, [pid_m * block_m, k * block_k], ready.index(stage), x_bufs.index(stage))
            w = w_bufs.index(stage)
            if W_KN:
                _tma_load(w1_desc, [k * block_k, pid_n * block_n], ready.index(stage), w)
            elif w3_desc is None:
                _tma_load(w1_desc, [pid_n * block_n, k * block_k], ready.index(stage), w)
            else:
                _tma_load(w1_desc, [pid_n * block_n, k * block_k], ready.index(stage), w.slice(0, block_n))
                _tma_load(w3_desc, [pid_n * block_n, k * block_k], ready.index(stage), w.slice(block_n, block_n))
            j += 1


@gluon.jit
def _consume(x_bufs, w_bufs, ready, free, turn, out_bufs, h1_desc, h3_desc, g_desc, n_tiles, tiles_m,
             tiles_n, k_tiles, CONSUMER: gl.constexpr, GROUP_M: gl.constexpr, acc_layout: gl.constexpr,
             COOPERATIVE: gl.constexpr):
    """Consumer CONSUMER (one warpgroup). Ping-pong: the program's tiles CONSUMER, CONSUMER + 2, ..., whole. A
    consumer starts a tile's k-tiles only once the other has finished the program's tile before it (``turn``, the
    ordering barrier of CUTLASS's ping-pong): both read one ring, and a wait on a stage's barrier tells its fills
    apart only by their parity, so a consumer waiting two or more fills ahead would take another tile's data.
    Cooperative: every tile of the program, its half of the tile's rows; a stage is freed once both have read it,
    so the producer cannot refill it before the slower one's wait has passed, and neither can be a fill ahead:
    no ``turn``. One wgmma a k-tile, two in flight at most, a stage freed once the one that read it is done; then
    h1, h3 rounded and split apart in registers (a thread holds column c of both), g = SiLU(h1) h3 from the rounded
    h1 and h3 (as the unfused step computes it), each out by TMA through ``_store_out``: with one output buffer
    (OUT_BUFS = 1) h1's and h3's stores are waited for before the next output is written, so only g's last store
    runs while the next tile's products start."""
    block_m: gl.constexpr = x_bufs.type.shape[1]  # the program's tile's rows
    rows: gl.constexpr = h1_desc.block_type.shape[0]  # this consumer's: block_m, or half of it
    block_n: gl.constexpr = h1_desc.block_type.shape[1]
    dtype: gl.constexpr = h1_desc.dtype
    takers: gl.constexpr = 1 if COOPERATIVE else CONSUMERS  # consumers a tile goes round
    i = 0 if COOPERATIVE else CONSUMER  # the tile's index among the program's tiles
    r = 0  # this consumer's tiles so far
    first_tile = gl.program_id(0) + (0 if COOPERATIVE else CONSUMER) * gl.num_programs(0)
    for tile in range(first_tile, n_tiles, takers * gl.num_programs(0)):
        pid_m, pid_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
        acc = _products(x_bufs, w_bufs, ready, free, turn, gl.zeros((rows, 2 * block_n), gl.float32, acc_layout),
                        i * k_tiles, k_tiles, r, CONSUMER, COOPERATIVE, False)
        h1, h3 = _halves(acc.to(dtype))
        gate = h1.to(gl.float32)
        g = (gate * _sigmoid(gate) * h3.to(gl.float32)).to(dtype)
        off_m = pid_m * block_m + (CONSUMER * rows if COOPERATIVE else 0)
        _store_out(h1, h1_desc, out_bufs, 3 * r, off_m, pid_n * block_n)
        _store_out(h3, h3_desc, out_bufs, 3 * r + 1, off_m, pid_n * block_n)
        _store_out(g, g_desc, out_bufs, 3 * r + 2, off_m, pid_n * block_n)
        i += takers
        r += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _products(x_bufs, w_bufs, ready, free, turn, acc, first, k_tiles, r, CONSUMER: gl.constexpr,
              COOPERATIVE: gl.constexpr, W_KN: gl.constexpr):
    """``acc`` plus one output tile's products, from the program's k-tiles first, first + 1, ... of the ring: one
    wgmma a k-tile, two in flight at most, a stage freed once the wgmma that read it is done. In ping-pong the
    consumer waits for its turn first (its r-th tile) and passes it on once its last k-tile's wait has passed
    (``_consume``); cooperative, it reads its share of x's rows. The weight buffer is (N, K), read transposed, or
    (K, N) with ``W_KN``."""
    stages: gl.constexpr = x_bufs.type.shape[0]
    rows: gl.constexpr = acc.type.shape[0]
    if not COOPERATIVE:  # the other's r-th (consumer 1) or (r - 1)-th (consumer 0) tile is done: 0 goes first
        mbarrier.wait(turn.index(CONSUMER), (r & 1) ^ (1 - CONSUMER))
    for k in range(k_tiles):
        j = first + k
        stage = j % stages
        mbarrier.wait(ready.index(stage), (j // stages) & 1)
        x = x_bufs.index(stage)
        if COOPERATIVE:
            x = x.slice(CONSUMER * rows, rows)
        w = w_bufs.index(stage)
        if not W_KN:
            w = w.permute((1, 0))
        acc = warpgroup_mma(x, w, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # k-tile k - 1's is done
        mbarrier.arrive(free.index((j + stages - 1) % stages), count=1, pred=k > 0)
    if not COOPERATIVE:  # every k-tile's wait has passed: the other may start its next tile while these finish
        mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(free.index((first + k_tiles - 1) % stages), count=1)  # the tile's last stage
    return acc


@gluon.jit
def _consume_backward(dy_bufs, w_bufs, ready, free, turn, epi_bufs, epi_bar, h1_desc, h3_desc, dgate_desc, dup_desc,
                      n_tiles, tiles_m, tiles_n, k_tiles, CONSUMER: gl.constexpr, GROUP_M: gl.constexpr,
                      acc_layout: gl.constexpr, W_KN: gl.constexpr, PLAIN: gl.constexpr):
    """Consumer CONSUMER of the backward (ping-pong, ``_consume``): a tile of dg = dy W2 rounded to bf16 as the
    unfused step's product is, then SwiGLU's backward (``swiglu_grads``, in fp32) a half tile at a time: h1's and
    h3's half tiles TMA-loaded into ``epi_bufs`` (the left half's while the tile's products run, the right half's
    while the left half's gradients are computed), read in the accumulator's layout, d_gate and d_up written over
    them and TMA-stored (each thread's few columns a row, coalesced by TMA, not loaded and stored one pair at a
    time). ``PLAIN``: dg itself out as d_gate,
    no loads and no SwiGLU (the same GEMM without its epilogue's work, for the probe)."""
    block_m: gl.constexpr = dy_bufs.type.shape[1]
    half: gl.constexpr = h1_desc.block_type.shape[1]
    dtype: gl.constexpr = dy_bufs.dtype
    half_layout: gl.constexpr = _acc_layout(block_m, half)
    i = CONSUMER  # the tile's index among the program's tiles
    r = 0  # this consumer's tiles so far
    for tile in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), n_tiles, CONSUMERS * gl.num_programs(0)):
        pid_m, pid_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * block_m
        off_n = pid_n * 2 * half
        tma.store_wait(pendings=0)  # the last tile's outputs have left the buffers
        if not PLAIN:
            _load_pair(h1_desc, h3_desc, epi_bufs, epi_bar, off_m, off_n)
        acc = _products(dy_bufs, w_bufs, ready, free, turn, gl.zeros((block_m, 2 * half), gl.float32, acc_layout),
                        i * k_tiles, k_tiles, r, CONSUMER, False, W_KN)
        # each half in the layout of a half as wide accumulator: the same registers, no data moves
        left, right = _halves(acc.to(dtype))
        if PLAIN:
            epi_bufs.index(0).store(gl.convert_layout(left, half_layout))
            epi_bufs.index(1).store(gl.convert_layout(right, half_layout))
            fence_async_shared()
            _tma_store(dgate_desc, [off_m, off_n], epi_bufs.index(0))
            _tma_store(dgate_desc, [off_m, off_n + half], epi_bufs.index(1))
        else:  # the right half's h1 and h3 land while the left half's gradients are computed
            mbarrier.wait(epi_bar, 0)  # two loads a tile: the first's phase is 0, the second's 1
            gate, up = epi_bufs.index(0).load(half_layout), epi_bufs.index(1).load(half_layout)
            _thread_barrier()  # every thread has read the left half before TMA writes the right one over it
            _load_pair(h1_desc, h3_desc, epi_bufs, epi_bar, off_m, off_n + half)
            d_gate, d_up = _dswiglu(gl.convert_layout(left, half_layout), gate, up)
            mbarrier.wait(epi_bar, 1)
            gate, up = epi_bufs.index(0).load(half_layout), epi_bufs.index(1).load(half_layout)
            _store_pair(d_gate, d_up, epi_bufs, dgate_desc, dup_desc, off_m, off_n)
            d_gate, d_up = _dswiglu(gl.convert_layout(right, half_layout), gate, up)
            tma.store_wait(pendings=0)  # the left half's stores have read the buffers
            _store_pair(d_gate, d_up, epi_bufs, dgate_desc, dup_desc, off_m, off_n + half)
        i += CONSUMERS
        r += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _load_pair(h1_desc, h3_desc, bufs, bar, off_m, off_n):
    """h1's and h3's blocks at (off_m, off_n) into ``bufs`` by TMA, landing on ``bar``."""
    mbarrier.expect(bar, 2 * h1_desc.block_type.nbytes)
    _tma_load(h1_desc, [off_m, off_n], bar, bufs.index(0))
    _tma_load(h3_desc, [off_m, off_n], bar, bufs.index(1))


@gluon.jit
def _halves(t):
    """A (rows, columns) tensor's left and right halves, in registers (a thread holds column c of both)."""
    return gl.split(gl.permute(gl.reshape(t, (t.shape[0], 2, t.shape[1] // 2)), (0, 2, 1)))


@gluon.jit
def _dswiglu(grad, h1, h3):
    """SwiGLU's backward on one block, (d_gate, d_up) in h1's dtype, from dg (``grad``) and the forward's h1, h3, in
    fp32 as ``swiglu_grads``."""
    grad, gate, up = grad.to(gl.float32), h1.to(gl.float32), h3.to(gl.float32)
    sigmoid = _sigmoid(gate)
    grad_sigmoid = grad * sigmoid
    return ((grad_sigmoid * up * (1.0 + gate * (1.0 - sigmoid))).to(h1.dtype),
            (grad_sigmoid * gate).to(h1.dtype))


@gluon.jit
def _store_pair(d_gate, d_up, bufs, dgate_desc, dup_desc, off_m, off_n):
    """d_gate and d_up into ``bufs`` (whose h1 and h3 every thread has read), then out by TMA to (off_m, off_n)."""
    bufs.index(0).store(d_gate)
    bufs.index(1).store(d_up)
    fence_async_shared()
    _tma_store(dgate_desc, [off_m, off_n], bufs.index(0))
    _tma_store(dup_desc, [off_m, off_n], bufs.index(1))


@gluon.jit
def _sigmoid(x):
    """1 / (1 + 2^(-x log2(e))) by the special function unit's approximate ex2 and rcp (PTX ``.approx.ftz``, each
    within 2 ulp of fp32, far below bf16's rounding of what it feeds): 4 instructions an element, where ``gl.exp``
    and the division's range checks took ~12, and the backward's epilogue was as long as its products
    (notes/train_step.md, session 54)."""
    e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634], dtype=gl.float32,
                                  is_pure=True, pack=1)
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _store_out(value, desc, out_bufs, q, off_m, off_n):
    """A consumer's q-th output tile out by TMA through its buffer q % OUT_BUFS, once the store that used the buffer
    OUT_BUFS tiles before has read it (bulk stores complete in order). One buffer waits for each store; in
    ping-pong its drain hides under the other consumer's wgmmas, and the shared memory it frees deepens the ring.
    Cooperative, both consumers store at once and nothing runs under the drain."""
    buffers: gl.constexpr = out_bufs.type.shape[0]
    tma.store_wait(pendings=buffers - 1)
    buf = out_bufs.index(q % buffers)
    buf.store(value)
    fence_async_shared()
    _tma_store(desc, [off_m, off_n], buf)


@triton.constexpr_function
def _acc_layout(block_m, block_n):
    """wgmma's accumulator layout for one warpgroup (4 warps stacked along M, 16 rows an instruction) and the
    widest instruction that divides block_n."""
    n = 256
    while n > block_n or block_n % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _barriers(STAGES: gl.constexpr, READERS: gl.constexpr):
    """The ring's barriers: a stage's ``ready`` (its TMA loads landed) and ``free`` (its READERS consumers are done
    with it), and the consumers' ``turn`` (``_products``)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=READERS)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(c), count=1)
    return ready, free, turn


@gluon.jit
def swiglu_gemm_kernel(x_desc, w1_desc, w3_desc, h1_desc, h3_desc, g_desc, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, OUT_BUFS: gl.constexpr,
                       COOPERATIVE: gl.constexpr):
    """h1 = x W1^T, h3 = x W3^T, g = SiLU(h1) h3 for x (M, K), W1 and W3 (N, K); a program per SM, its tiles
    the grid's program_id, + num_programs, ...; whole tiles only (M, N multiples of the tile, K of BLOCK_K). The
    outputs' blocks are a consumer's: (BLOCK_M, BLOCK_N) in ping-pong, (BLOCK_M / 2, BLOCK_N) cooperative."""
    block_m: gl.constexpr = x_desc.block_type.shape[0]
    rows: gl.constexpr = h1_desc.block_type.shape[0]
    gl.static_assert(rows * (2 if COOPERATIVE else 1) == block_m, "a consumer's output block: its share of the rows")
    block_n: gl.constexpr = h1_desc.block_type.shape[1]
    block_k: gl.constexpr = x_desc.block_type.shape[1]
    gl.static_assert(STAGES >= 2, "a ring of one stage deadlocks: a stage is freed only after the next one's wait")
    tiles_m = gl.cdiv(x_desc.shape[0], block_m)
    tiles_n = gl.cdiv(w1_desc.shape[0], block_n)
    k_tiles = gl.cdiv(x_desc.shape[1], block_k)
    n_tiles = tiles_m * tiles_n

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    # a stage's weights: W1's k-tile above W3's (an NVMMA layout is one per row width, not per shape)
    w_bufs = gl.allocate_shared_memory(w1_desc.dtype, [STAGES, 2 * block_n, block_k], w1_desc.layout)
    out0 = gl.allocate_shared_memory(h1_desc.dtype, [OUT_BUFS] + h1_desc.block_type.shape, h1_desc.layout)
    out1 = gl.allocate_shared_memory(h1_desc.dtype, [OUT_BUFS] + h1_desc.block_type.shape, h1_desc.layout)
    ready, free, turn = _barriers(STAGES, CONSUMERS if COOPERATIVE else 1)
    acc_layout: gl.constexpr = _acc_layout(rows, 2 * block_n)
    gl.warp_specialize([
        (_consume, (x_bufs, w_bufs, ready, free, turn, out0, h1_desc, h3_desc, g_desc, n_tiles, tiles_m,
                    tiles_n, k_tiles, 0, GROUP_M, acc_layout, COOPERATIVE)),
        (_consume, (x_bufs, w_bufs, ready, free, turn, out1, h1_desc, h3_desc, g_desc, n_tiles, tiles_m,
                    tiles_n, k_tiles, 1, GROUP_M, acc_layout, COOPERATIVE)),
        (_load, (x_desc, w1_desc, w3_desc, x_bufs, w_bufs, ready, free, n_tiles, tiles_m, tiles_n, k_tiles,
                 GROUP_M, False)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def swiglu_backward_kernel(dy_desc, w2_desc, h1_desc, h3_desc, dgate_desc, dup_desc, GROUP_M: gl.constexpr,
                           STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, W_KN: gl.constexpr,
                           PLAIN: gl.constexpr):
    """SwiGLU's backward in the epilogue of dg = dy W2, for dy (M, K), W2 (K, N) (``W_KN``; else W2^T, (N, K)) and
    the forward's h1, h3 (M, N): d_gate and d_up (M, N) out, dg never written (``_consume_backward``; ``PLAIN``:
    dg itself out as d_gate); ping-pong, whole tiles. The (M, N) matrices' blocks are half a tile wide."""
    block_m: gl.constexpr = dy_desc.block_type.shape[0]
    block_k: gl.constexpr = dy_desc.block_type.shape[1]
    block_n: gl.constexpr = w2_desc.block_type.shape[1 if W_KN else 0]
    gl.static_assert(STAGES >= 2, "a ring of one stage deadlocks: a stage is freed only after the next one's wait")
    gl.static_assert(2 * h1_desc.block_type.shape[1] == block_n, "the epilogue's blocks: half a tile wide")
    tiles_m = gl.cdiv(dy_desc.shape[0], block_m)
    tiles_n = gl.cdiv(w2_desc.shape[1 if W_KN else 0], block_n)
    k_tiles = gl.cdiv(dy_desc.shape[1], block_k)
    n_tiles = tiles_m * tiles_n
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    w_bufs = gl.allocate_shared_memory(w2_desc.dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
    epi0 = gl.allocate_shared_memory(h1_desc.dtype, [2] + h1_desc.block_type.shape, h1_desc.layout)
    epi1 = gl.allocate_shared_memory(h1_desc.dtype, [2] + h1_desc.block_type.shape, h1_desc.layout)
    epi_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(epi_bars.index(c), count=1)
    ready, free, turn = _barriers(STAGES, 1)
    acc_layout: gl.constexpr = _acc_layout(block_m, block_n)
    gl.warp_specialize([
        (_consume_backward, (dy_bufs, w_bufs, ready, free, turn, epi0, epi_bars.index(0), h1_desc, h3_desc,
                             dgate_desc, dup_desc, n_tiles, tiles_m, tiles_n, k_tiles, 0, GROUP_M, acc_layout, W_KN,
                             PLAIN)),
        (_consume_backward, (dy_bufs, w_bufs, ready, free, turn, epi1, epi_bars.index(1), h1_desc, h3_desc,
                             dgate_desc, dup_desc, n_tiles, tiles_m, tiles_n, k_tiles, 1, GROUP_M, acc_layout, W_KN,
                             PLAIN)),
        (_load, (dy_desc, w2_desc, None, dy_bufs, w_bufs, ready, free, n_tiles, tiles_m, tiles_n, k_tiles,
                 GROUP_M, W_KN)),
    ], [4, 1], [CONSUMER_REGS, 24])


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


# (BLOCK_M, BLOCK_N, BLOCK_K), stages, a consumer's registers, a consumer's output buffers, cooperative: a program's
# tile is (BLOCK_M, BLOCK_N) of h1 and of h3. Shared memory (sm_90: 227 KB a block): the stages (x's, W1's and W3's
# k-tiles) and each consumer's output buffers, at most 224.3 KiB here. Compiled for sm_90 with Triton 3.6 on a CPU
# host: 168 registers, no spills; wgmmas 2 BLOCK_N wide. At xl's 8,192 x 1,600 x 2 x 6,400 on the H200, timed from CUDA
# graphs (session 48): the first 0.445 ms (754 TFLOP/s with SwiGLU), the second 0.461, the cooperative ones
# 0.490-0.508, against cuBLAS's two products at 0.444 and with the compiled SwiGLU at 0.516 in the same run.
CONFIGS = (((128, 64, 64), 6, 232, 1, False), ((128, 64, 64), 5, 232, 2, False), ((128, 128, 64), 4, 232, 1, True),
           ((128, 128, 64), 3, 232, 2, True), ((256, 64, 64), 4, 232, 1, True))


def _fits(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, config=CONFIGS[0]) -> bool:
    """x (M, K) and W1, W3 (N, K) of one K, none empty, M, N and K whole tiles of ``config``."""
    block_m, block_n, block_k = config[0]
    (m, k), n = x.shape, w1.shape[0]
    return (w1.shape == w3.shape and k == w1.shape[1] and m * n * k > 0
            and not (m % block_m or n % block_n or k % block_k))


def swiglu_gemm(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, config=CONFIGS[0], group_m: int = 8):
    """(h1, h3, g) of x (M, K) and W1, W3 (N, K), contiguous bf16, whole tiles; ``group_m`` row tiles down a
    column before the next (``_tile_at``)."""
    if not _fits(x, w1, w3, config):
        raise ValueError(f"swiglu_gemm: x (M, K) and W1, W3 (N, K) of one K, none empty, M, N, K multiples of the "
                         f"tile {config[0]}; got {tuple(x.shape)}, {tuple(w1.shape)}, {tuple(w3.shape)}")
    (m, k), n = x.shape, w1.shape[0]
    (block_m, block_n, block_k), stages, regs, out_bufs, cooperative = config
    rows = block_m // 2 if cooperative else block_m  # a consumer's
    h1, h3, g = (x.new_empty(m, n) for _ in range(3))
    programs = min(torch.cuda.get_device_properties(x.device).multi_processor_count,
                   (m // block_m) * (n // block_n))
    swiglu_gemm_kernel[(programs,)](
        _descriptor(x, [block_m, block_k]), _descriptor(w1, [block_n, block_k]), _descriptor(w3, [block_n, block_k]),
        *(_descriptor(t, [rows, block_n]) for t in (h1, h3, g)), GROUP_M=group_m, STAGES=stages, CONSUMER_REGS=regs,
        OUT_BUFS=out_bufs, COOPERATIVE=cooperative, num_warps=4)
    return h1, h3, g


# The backward kernel's ((BLOCK_M, BLOCK_N, BLOCK_K), stages, a consumer's registers, W2 read as W2^T (N, K)): a
# consumer's tile is (BLOCK_M, BLOCK_N) of dg. Shared memory: the ring (32 KB a stage at 128 x 128 x 64) and each
# consumer's h1 and h3 half tiles (32 KB). Compiled for sm_90 with Triton 3.9 on a CPU host: no spills (360 bytes
# before the sigmoid on the SFU and the right half's loads under the left half's arithmetic, session 54).
BACKWARD_CONFIGS = (((128, 128, 64), 5, 240, False), ((128, 128, 64), 5, 240, True), ((128, 128, 64), 4, 240, True))


def _backward_fits(dy: torch.Tensor, w2: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor,
                   config=BACKWARD_CONFIGS[0]) -> bool:
    """dy (M, K), W2 (K, N), h1 and h3 (M, N), none empty, M, N and K whole tiles of ``config`` (``_fits`` of the
    backward)."""
    block_m, block_n, block_k = config[0]
    (m, k), n = dy.shape, w2.shape[-1]
    return (w2.shape == (k, n) and h1.shape == h3.shape == (m, n) and m * n * k > 0
            and not (m % block_m or n % block_n or k % block_k))


def swiglu_backward_gemm(dy: torch.Tensor, w2: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor,
                         config=BACKWARD_CONFIGS[0], group_m: int = 8,
                         plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) = ``swiglu_grads(dy W2, h1, h3)`` in bf16 for dy (M, K), W2 (K, N), h1 and h3 (M, N),
    contiguous bf16, whole tiles, with dg = dy W2 rounded to bf16 in registers and never written (W2 copied to W2^T
    first where ``config`` reads it so: its k-tiles as the forward's weights are). ``plain``: (dg, garbage), the
    kernel's GEMM without its epilogue's work (the probe's yardstick)."""
    (block_m, block_n, block_k), stages, regs, transposed = config
    (m, k), n = dy.shape, w2.shape[-1]
    if not _backward_fits(dy, w2, h1, h3, config):
        raise ValueError(f"swiglu_backward_gemm: dy (M, K), W2 (K, N), h1 and h3 (M, N), none empty, M, N, K "
                         f"multiples of the tile {config[0]}; got {tuple(dy.shape)}, {tuple(w2.shape)}, "
                         f"{tuple(h1.shape)}, {tuple(h3.shape)}")
    d_gate, d_up = torch.empty_like(h1), torch.empty_like(h3)
    programs = min(torch.cuda.get_device_properties(dy.device).multi_processor_count,
                   (m // block_m) * (n // block_n))
    swiglu_backward_kernel[(programs,)](
        _descriptor(dy, [block_m, block_k]),
        _descriptor(w2.T.contiguous(), [block_n, block_k]) if transposed else _descriptor(w2, [block_k, block_n]),
        *(_descriptor(t, [block_m, block_n // 2]) for t in (h1, h3, d_gate, d_up)), GROUP_M=group_m, STAGES=stages,
        CONSUMER_REGS=regs, W_KN=not transposed, PLAIN=plain, num_warps=4)
    return d_gate, d_up


@torch.library.custom_op("torch_impl::swiglu_product", mutates_args=())
def swiglu_product(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(h1, h3, g) = (x W1^T, x W3^T, SiLU(h1) h3) of x (M, K) and W1, W3 (N, K): ``swiglu_gemm`` on an sm_90 GPU
    with bf16 inputs in whole tiles, else PyTorch's ops; an opaque op to torch.compile."""
    if (x.is_cuda and x.dtype == w1.dtype == w3.dtype == torch.bfloat16 and _fits(x, w1, w3)
            and torch.cuda.get_device_capability(x.device) == (9, 0)):
        return swiglu_gemm(x.contiguous(), w1.contiguous(), w3.contiguous())
    h1, h3 = x @ w1.T, x @ w3.T
    return h1, h3, torch.nn.functional.silu(h1) * h3


@swiglu_product.register_fake
def _(x, w1, w3):
    return tuple(x.new_empty(x.shape[0], w1.shape[0]) for _ in range(3))


def _save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output[:2])  # x, W1, W3, h1, h3: what the unfused step saves
    ctx.set_materialize_grads(False)  # h1's and h3's gradients None where unused, not zeros added in


def swiglu_grads(dg: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of h1 and h3 from g's for g = SiLU(h1) h3, in fp32 (float64 for float64): the formula of
    ``_backward``, of ``swiglu_backward_gemm``'s epilogue, and of swiglu_probe.py's unfused backward."""
    wide = torch.promote_types(h1.dtype, torch.float32)
    gate, up, grad = h1.to(wide), h3.to(wide), dg.to(wide)
    sigmoid = torch.sigmoid(gate)
    return grad * up * sigmoid * (1 + gate * (1 - sigmoid)), grad * gate * sigmoid


def _gate_up_grads(dg, dh1, dh3, h1, h3):
    """The gradients of h1 and h3 in h1's dtype: SwiGLU's backward from g's gradient (None: zero) in fp32, with
    h1's and h3's own gradients (outputs too; None where unused) added in."""
    d_gate, d_up = swiglu_grads(torch.zeros_like(h1) if dg is None else dg, h1, h3)
    wide = d_gate.dtype
    d_gate = d_gate if dh1 is None else d_gate + dh1.to(wide)
    d_up = d_up if dh3 is None else d_up + dh3.to(wide)
    return d_gate.to(h1.dtype), d_up.to(h1.dtype)


@torch.library.custom_op("torch_impl::sum_of_products", mutates_args=())
def sum_of_products(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """a b + c d as two GEMMs, the second accumulating in place into the first's output (cuBLAS's beta = 1). An
    opaque op, since Inductor lowers ``torch.addmm(a @ b, c, d)`` out of place: a copy of a b (26 MB at xl 4 x 2,048,
    0.64 ms a step) before the second GEMM."""
    return torch.mm(a, b).addmm_(c, d)


@sum_of_products.register_fake
def _(a, b, c, d):
    return a.new_empty(a.shape[0], b.shape[1])


def _input_grads(d_gate, d_up, x, w1, w3):
    """dx = d_gate W1 + d_up W3 (``sum_of_products``), and W1's and W3's gradients."""
    return sum_of_products(d_gate, w1, d_up, w3), d_gate.T @ x, d_up.T @ x


def _backward(ctx, dh1, dh3, dg):
    """SwiGLU's backward in fp32 (float64 for float64; Inductor writes it as one pointwise kernel), then the
    inputs' gradients."""
    x, w1, w3, h1, h3 = ctx.saved_tensors
    return _input_grads(*_gate_up_grads(dg, dh1, dh3, h1, h3), x, w1, w3)


swiglu_product.register_autograd(_backward, setup_context=_save)


@torch.library.custom_op("torch_impl::swiglu_backward", mutates_args=())
def swiglu_backward(dy: torch.Tensor, w2: torch.Tensor, h1: torch.Tensor,
                    h3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) from y's gradient dy (M, K), W2 (K, N) and h1, h3 (M, N) of y = (SiLU(h1) h3) W2^T:
    ``swiglu_backward_gemm`` on an sm_90 GPU with bf16 inputs in whole tiles, else dg = dy W2 and ``swiglu_grads``."""
    if (dy.is_cuda and dy.dtype == w2.dtype == h1.dtype == h3.dtype == torch.bfloat16 and _backward_fits(dy, w2, h1, h3)
            and torch.cuda.get_device_capability(dy.device) == (9, 0)):
        return swiglu_backward_gemm(dy.contiguous(), w2.contiguous(), h1.contiguous(), h3.contiguous())
    return _gate_up_grads(dy @ w2, None, None, h1, h3)


@swiglu_backward.register_fake
def _(dy, w2, h1, h3):
    return torch.empty_like(h1), torch.empty_like(h3)


@torch.library.custom_op("torch_impl::swiglu_mlp", mutates_args=())
def swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h1, h3, g): SwiGLU's whole MLP, y = g W2^T with (h1, h3, g) as ``swiglu_product`` makes them, for x (M, K),
    W1 and W3 (N, K), W2 (K, N). Its backward computes SwiGLU's backward in the epilogue of dg = dy W2
    (``swiglu_backward``), so dg is never written where that kernel runs and y alone has a gradient; no double
    backward; ``TransformerLM(..., mlp="gluon")``'s MLP."""
    h1, h3, g = swiglu_product(x, w1, w3)
    return g @ w2.T, h1, h3, g


@swiglu_mlp.register_fake
def _(x, w1, w3, w2):
    return x.new_empty(x.shape[0], w2.shape[0]), *(x.new_empty(x.shape[0], w1.shape[0]) for _ in range(3))


def _save_mlp(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, *output[1:])  # x, W1, W3, W2, h1, h3, g
    ctx.set_materialize_grads(False)


def _backward_mlp(ctx, dy, dh1, dh3, dg):
    """d_gate and d_up by ``swiglu_backward`` where only y has a gradient, else from dg = dy W2 plus g's own
    gradient (``_gate_up_grads``); then the inputs' gradients and W2's, dy^T g."""
    x, w1, w3, w2, h1, h3, g = ctx.saved_tensors
    if dy is not None and dh1 is None and dh3 is None and dg is None:
        d_gate, d_up = swiglu_backward(dy, w2, h1, h3)
    else:
        grad = dg if dy is None else dy @ w2 if dg is None else torch.addmm(dg, dy, w2)
        d_gate, d_up = _gate_up_grads(grad, dh1, dh3, h1, h3)
    return *_input_grads(d_gate, d_up, x, w1, w3), None if dy is None else dy.T @ g


swiglu_mlp.register_autograd(_backward_mlp, setup_context=_save_mlp)
for _device in ("cuda", "cpu"):  # under autocast, as F.linear: its inputs in bf16, the op itself run outside it
    torch.library.register_autocast(swiglu_mlp, _device, torch.bfloat16)
