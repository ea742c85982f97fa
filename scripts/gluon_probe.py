"""Does Gluon's warp specialization work on this Triton for Hopper? A one-call probe for the FlashAttention issue
(GPU): ``python3 scripts/gluon_probe.py OUT [--shapes 8192x8192x8192,8192x6400x1600]``.

Triton 3.6's automatic warp specialization (``tl.range(..., warp_specialize=True)``) miscompiled our attention
loops (notes/flash_attention.md, session 7), which is what FlashAttention-3's structure needs: a producer warp
feeding TMA loads through a ring of shared-memory stages and consumer warpgroups running wgmma. Gluon
(``triton.experimental.gluon``) writes that structure by hand: ``gl.warp_specialize`` with a load partition and
an MMA partition synchronized by mbarriers. This probe does it for the simplest kernel with that structure,
C = A B^T in bf16 with fp32 accumulation, checks it against a float32 reference on random inputs and times it
against cuBLAS (``torch.matmul``) with ``triton.testing.do_bench`` in the same process. Writes OUT/gluon_probe.jsonl
(one row per shape and configuration; errors as rows). Not a record (notes/flash_attention.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, free, off_m, off_n, k_tiles, BLOCK_K: gl.constexpr):
    """One warp: TMA loads of A's and B's k-th tiles into stage k % STAGES once the MMAs have freed it."""
    stages: gl.constexpr = a_bufs.type.shape[0]
    for k in range(k_tiles):
        stage = k % stages
        mbarrier.wait(free.index(stage), ((k // stages) & 1) ^ 1)  # barriers start as if phase 1 had completed
        mbarrier.expect(ready.index(stage), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, k * BLOCK_K], ready.index(stage), a_bufs.index(stage))
        tma.async_copy_global_to_shared(b_desc, [off_n, k * BLOCK_K], ready.index(stage), b_bufs.index(stage))


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, free, k_tiles, acc_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr):
    """The kernel's warps: wgmma on each stage as it lands, one MMA in flight; a stage is freed once the MMA
    that read it has completed."""
    stages: gl.constexpr = a_bufs.type.shape[0]
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for k in range(k_tiles):
        stage = k % stages
        mbarrier.wait(ready.index(stage), (k // stages) & 1)
        acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the MMA of step k - 1 is done
        mbarrier.arrive(free.index((k + stages - 1) % stages), count=1, pred=k > 0)
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc,)),)  # a tuple: warp_specialize flattens it


@triton.constexpr_function
def _wgmma_layout(block_m, block_n, num_warps):
    """wgmma's accumulator layout: warps stacked along M (16 rows an instruction), the widest N instruction."""
    warps = [num_warps, 1] if block_m >= 16 * num_warps else [4, num_warps // 4]
    n = 256
    while n > block_n // warps[1] or block_n % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.jit
def ws_matmul_kernel(a_desc, b_desc, c_desc, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """C tile (pid_m, pid_n) = A B^T; A (M, K), B (N, K), C (M, N)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
    k_tiles = gl.cdiv(a_desc.shape[1], BLOCK_K)

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)

    acc_layout: gl.constexpr = _wgmma_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, ready, free, k_tiles, acc_layout, BLOCK_M, BLOCK_N)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, free, off_m, off_n, k_tiles, BLOCK_K)),
    ], [1], [40])[0]

    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)


def ws_matmul(a: torch.Tensor, b: torch.Tensor, block: tuple[int, int, int], stages: int, num_warps: int,
              maxnreg: int):
    """a (M, K) @ b (N, K)^T in bf16 through ``ws_matmul_kernel``."""
    m, n = a.shape[0], b.shape[0]
    block_m, block_n, block_k = block
    c = torch.empty(m, n, device=a.device, dtype=a.dtype)

    def desc(t, shape):
        return TensorDescriptor.from_tensor(t, shape, gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16))

    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    ws_matmul_kernel[grid](desc(a, [block_m, block_k]), desc(b, [block_n, block_k]), desc(c, [block_m, block_n]),
                           stages, num_warps=num_warps, maxnreg=maxnreg)
    return c


# (BLOCK_M, BLOCK_N, BLOCK_K), stages, warps of the MMA partition, registers a thread (the load partition's
# warpgroup counts too: (num_warps + 4) x 32 x maxnreg must fit the SM's 64 K registers)
CONFIGS = (((128, 128, 64), 4, 4, 240), ((128, 256, 64), 3, 8, 168), ((128, 128, 64), 4, 8, 168))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", default="8192x8192x8192,8192x6400x1600,8192x1600x6400,8192x1600x1600",
                        help="MxNxK, comma-separated")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("gluon_probe: needs a Hopper (sm_90) or newer GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        reference = a.float() @ b.float().T
        cublas_ms = triton.testing.do_bench(lambda: a @ b.T)
        cublas_err = ((a @ b.T).float() - reference).norm().item() / reference.norm().item()
        for block, stages, warps, maxnreg in CONFIGS:
            row = {"shape": shape, "block": block, "stages": stages, "num_warps": warps, "maxnreg": maxnreg,
                   "cublas_ms": cublas_ms,
                   "cublas_rel_err": cublas_err, "triton": triton.__version__, "torch": torch.__version__}
            try:
                out = ws_matmul(a, b, block, stages, warps, maxnreg)
                torch.cuda.synchronize()
                row["rel_err"] = (out.float() - reference).norm().item() / reference.norm().item()
                row["ms"] = triton.testing.do_bench(lambda: ws_matmul(a, b, block, stages, warps, maxnreg))
                row["tflops"] = 2 * m * n * k / row["ms"] / 1e9
                row["vs_cublas"] = cublas_ms / row["ms"]
            except Exception as err:  # a configuration that does not compile or run is a row, not the end
                row["error"] = f"{type(err).__name__}: {str(err)[-2000:]}"
                traceback.print_exc()
            rows.append(row)
            print(json.dumps({key: row.get(key) for key in ("shape", "block", "num_warps", "rel_err", "ms",
                                                            "cublas_ms", "vs_cublas", "error")}), flush=True)
    (args.out / "gluon_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
