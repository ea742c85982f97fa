"""Smoke test: a real Triton kernel (row-wise softmax, tests/_triton_kernels.py) is correct on CPU under
``TRITON_INTERPRET=1`` and natively on CUDA.

``TRITON_INTERPRET`` must be set before ``triton`` is first imported, and another test module may already
have imported triton in this pytest process, so every check runs the kernel module as a script in a fresh
subprocess with the environment it needs (``=1`` for CPU, unset for the native GPU run). The subprocess
prints one ``RESULT {json}`` line; the assertions live here.

Each run uses a fresh random seed (printed on failure), ragged column counts (not a multiple of the
32-wide block) and a float64 torch reference. The same checker must also flag two deliberately broken
kernel variants (floor instead of ceil block count; masked lanes padded with 0 instead of -inf) on the
ragged shapes -- and pass them on the exact-multiple shape, where those bugs are invisible.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# triton-lang/triton#9171: triton <= 3.6's interpreter converts loop bounds with int() of a 1-element numpy
# array, which recent numpy refuses, so any kernel looping to a runtime bound fails under TRITON_INTERPRET=1
# (seen on the GPU image: triton 3.6 + numpy 2.5.2). Triton 3.9 (CI) squeezes first and works. We skip only
# on that exact error from triton's interpreter with triton < 3.9; the native CUDA test covers that image.
_KNOWN_INTERPRETER_BUG = "only 0-dimensional arrays can be converted to Python scalars"
BUG_NONE = 0  # mirrors tests/_triton_kernels.py (not imported here: that would import triton in-process)


def _triton_version() -> tuple[int, int]:
    major, minor = importlib.metadata.version("triton").split(".")[:2]
    return int(major), int(minor)


def _numpy_version() -> str:
    return importlib.metadata.version("numpy")


def _run_kernel_check(*, interpret: bool, device: str, dtypes: list[str], rtols: list[float],
                      timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    seed = secrets.randbelow(2**31)
    cmd = [sys.executable, "-m", "tests._triton_kernels", "--device", device, "--seed", str(seed),
           "--dtypes", ",".join(dtypes), "--rtol", *map(str, rtols)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if (interpret and proc.returncode != 0 and _KNOWN_INTERPRETER_BUG in proc.stderr
            and "interpreter.py" in proc.stderr and _triton_version() < (3, 9)):
        pytest.skip(f"triton {importlib.metadata.version('triton')}'s interpreter cannot run runtime-bound "
                    f"loops with numpy {_numpy_version()} (triton-lang/triton#9171); CI's triton 3.9 can")
    assert proc.returncode == 0, (
        f"kernel check subprocess failed (seed={seed}, rc={proc.returncode})\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line (seed={seed}), got stdout:\n{proc.stdout[-4000:]}"
    return json.loads(lines[0].removeprefix("RESULT "))


def _assert_results(res: dict, *, expect_interpret: bool, device_type: str, dtypes: list[str]) -> None:
    seed = res["seed"]
    assert res["interpret"] is expect_interpret, f"TRITON_INTERPRET in the subprocess: {res['interpret']}"
    assert res["launcher_rejects_bad_inputs"] == [True, True, True], res["launcher_rejects_bad_inputs"]
    cases = res["cases"]
    assert {c["dtype"] for c in cases} == set(dtypes)

    correct = [c for c in cases if c["bug"] == BUG_NONE]
    broken = [c for c in cases if c["bug"] != BUG_NONE]
    assert correct and broken
    for c in correct:
        assert c["out_dtype"] == c["dtype"] and c["out_device"] == device_type, c
        assert c["ok"], f"correct kernel disagrees with the float64 reference (seed={seed}): {c}"
    # Negative check: the same checker must reject each broken variant wherever the bug can show
    # (ragged column counts), and -- as a sanity check on the test shapes -- cannot on exact multiples.
    for c in broken:
        if c["ragged"]:
            assert not c["ok"], f"checker missed broken variant bug={c['bug']} (seed={seed}): {c}"
        else:
            assert c["ok"], f"bug={c['bug']} should be invisible on an exact-multiple shape: {c}"
    assert sum(1 for c in broken if not c["ok"]) >= 2 * len(dtypes)


def test_triton_softmax_interpreter_cpu_matches_float64_reference():
    # float32 under the interpreter is numpy float32 arithmetic: exp and the sum over <= 77 terms are each
    # within a few ulp (6e-8), so 1e-5 relative (+1e-7 absolute floor for tiny probabilities) is generous
    # yet ~1000x below the errors the broken variants produce.
    res = _run_kernel_check(interpret=True, device="cpu", dtypes=["float32"], rtols=[1e-5], timeout=120)
    _assert_results(res, expect_interpret=True, device_type="cpu", dtypes=["float32"])


@pytest.mark.gpu
def test_triton_softmax_native_cuda_matches_float64_reference():
    # Natively compiled (TRITON_INTERPRET unset in the subprocess); the reference is float64 softmax of the
    # same already-quantised input, so only the kernel's own error counts:
    # * float32: tl.exp lowers to ex2.approx after a multiply by log2(e) (relative error ~ |x - m| * 2^-24
    #   + 2 ulp, ~1e-6 for |x - m| <= 20), plus the float32 sum over <= 77 terms (<= 77 * 6e-8 worst case)
    #   and the division: 2e-5 relative covers the worst case.
    # * float16 / bfloat16: accumulation is float32 (error as above); the final round to the output dtype
    #   costs at most half an ulp, 2^-11 (fp16) / 2^-9 (bf16) relative. We allow 2x that: 2^-10 / 2^-8.
    #   The 1e-7 absolute floor covers fp16 subnormal outputs (spacing 2^-24 = 6e-8).
    dtypes = ["float32", "float16", "bfloat16"]
    res = _run_kernel_check(interpret=False, device="cuda", dtypes=dtypes, rtols=[2e-5, 2**-10, 2**-8],
                            timeout=300)
    _assert_results(res, expect_interpret=False, device_type="cuda", dtypes=dtypes)
