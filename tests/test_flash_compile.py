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
