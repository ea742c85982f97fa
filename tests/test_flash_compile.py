"""The Triton FlashAttention kernels compile for an H100 (sm_90) here, without a GPU (tests/_flash_compile.py).

The interpreter that runs the kernels in the other CPU tests executes their Python, not Triton's compiler, so
code only the compiler rejects (a constexpr computed at run time, an unsupported layout) would first fail on
the GPU. Each kernel is lowered to a cubin along each code path and must fit in an H100's shared memory.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
H100_SHARED_BYTES = 227 * 1024  # per block, the opt-in maximum on sm_90


def test_every_kernel_path_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests._flash_compile"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))
    assert len(results) == 10
    failures = {case: r for case, r in results.items() if not r["ok"]}
    assert not failures, failures
    for case, r in results.items():
        assert 0 < r["shared"] <= H100_SHARED_BYTES, (case, r)


def test_ieee_fp32_tiles_stay_within_the_fma_budget_at_every_head_dim():
    """IEEE fp32 dots unroll into FMAs (no tensor cores): every kernel keeps, at every head dim, configurations
    whose unrolled products stay within ``IEEE_FMAS_PER_THREAD`` a thread (64 x 64 tiles at d 160-256 compiled for
    minutes a kernel on the H100's host), never falling back to the whole list; tensor-core dots keep more."""
    import triton

    import torch_impl.attention.flash_triton as ft

    for tuned in (ft._fwd_tuned, ft._dkdv_tuned, ft._dq_tuned):
        for d in range(8, 257, 8):
            block_d = triton.next_power_of_2(d)
            kept = ft._kept_configs(tuned, {"BLOCK_D": block_d, "DOT_PRECISION": "ieee"})
            assert kept, (tuned.fn.__name__, d)
            for c in kept:
                threads = 32 * c["num_warps"]
                assert c["BLOCK_M"] * c["BLOCK_N"] * block_d <= ft.IEEE_FMAS_PER_THREAD * threads, (d, c)
            tensor_cores = ft._kept_configs(tuned, {"BLOCK_D": block_d, "DOT_PRECISION": "tf32"})
            assert len(tensor_cores) > len(kept), (tuned.fn.__name__, d)
