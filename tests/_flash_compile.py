"""Compile the Triton FlashAttention kernels for an H100 (sm_90) on a machine without a GPU (see
tests/test_flash_compile.py): each kernel along each code path (causal or not, ragged or even tiles), with the
first configuration of its autotuning list.

Run as ``python -m tests._flash_compile`` without ``TRITON_INTERPRET`` (the interpreter replaces the kernels
by Python functions that cannot be compiled); prints one ``RESULT {json}`` line, one entry per case.
"""

import json
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import torch_impl.attention.flash_triton as ft

H100 = GPUTarget("cuda", 90, 32)
FP32_POINTERS = {"LSE", "DELTA"}


def signature(kernel, dtype: str, constexprs: dict) -> dict:
    """Argument types as the launcher passes them: upper-case names are tensors, sm_scale a float."""
    def kind(name):
        if name in constexprs:
            return "constexpr"
        if name == "sm_scale":
            return "fp32"
        if name.isupper():
            dq_fp32 = constexprs.get("ATOMIC_DQ") or constexprs.get("ZERO_DQ")  # the fused pass's dQ accumulator
            fp32 = name in FP32_POINTERS or (name == "DQ" and dq_fp32)
            return "*fp32" if fp32 else f"*{dtype}"
        return "i32"
    return {name: kind(name) for name in kernel.arg_names}


def head_dim(d: int) -> dict:
    return {"HEAD_DIM": d, "BLOCK_D": triton.next_power_of_2(d)}


# The code paths, each kernel at least once: causal or not (the forward), ragged or even tiles, a head dim tiled
# exactly (128) or padded (80 -> 128, masked), the widest (256, with the tiles the pruning keeps there), and fp32
# in IEEE precision (FMA dots instead of tensor cores); the dK/dV kernel of the two-pass backward and
# of the fused one (dQ by TMA reduce-adds, as on an H100).
CASES = [
    ("forward", ft._fwd_kernel, ft._fwd_tuned, {"IS_CAUSAL": True, "EVEN_M": False, "EVEN_N": False, **head_dim(80)}),
    ("forward", ft._fwd_kernel, ft._fwd_tuned, {"IS_CAUSAL": False, "EVEN_M": True, "EVEN_N": True, **head_dim(128)}),
    ("forward", ft._fwd_kernel, ft._fwd_tuned, {"IS_CAUSAL": True, "EVEN_M": True, "EVEN_N": True, **head_dim(256)}),
    ("dkdv", ft._bwd_dkdv_kernel, ft._dkdv_tuned, {"IS_CAUSAL": True, "EVEN_M": False, "EVEN_N": True,
                                                   "ATOMIC_DQ": False, "DQ_TMA": False, **head_dim(80)}),
    ("dkdv", ft._bwd_dkdv_kernel, ft._dkdv_tuned, {"IS_CAUSAL": True, "EVEN_M": True, "EVEN_N": False,
                                                   "ATOMIC_DQ": True, "DQ_TMA": True, **head_dim(256)}),
    ("dkdv", ft._bwd_dkdv_kernel, ft._dkdv_tuned, {"IS_CAUSAL": True, "EVEN_M": False, "EVEN_N": True,
                                                   "ATOMIC_DQ": True, "DQ_TMA": True, **head_dim(80)}),
    ("dq", ft._bwd_dq_kernel, ft._dq_tuned, {"IS_CAUSAL": True, "EVEN_M": True, "EVEN_N": False, **head_dim(80)}),
    ("dq", ft._bwd_dq_kernel, ft._dq_tuned, {"IS_CAUSAL": True, "EVEN_M": False, "EVEN_N": True, **head_dim(256)}),
    ("preprocess", ft._bwd_preprocess, None, {"ZERO_DQ": True, **head_dim(80)}),
    ("forward-fp32", ft._fwd_kernel, ft._fwd_tuned, {"IS_CAUSAL": True, "EVEN_M": False, "EVEN_N": False,
                                                     "DOT_PRECISION": "ieee", **head_dim(64)}),
]


def first_kept_config(tuned, constexprs: dict) -> tuple[dict, dict]:
    """The first configuration the autotuner's pruning keeps for these constexprs (e.g. BLOCK_D = 256): the one
    FLASH_TRITON_AUTOTUNE=0 runs where it fits in shared memory."""
    config = ft._kept_configs(tuned, constexprs)[0]
    return {k: config[k] for k in ("BLOCK_M", "BLOCK_N")}, {k: config[k] for k in ("num_warps", "num_stages")}


def compile_case(kernel, tuned, flags: dict) -> dict:
    """Lower one kernel to an sm_90 cubin; its shared memory in bytes, or the error's first line."""
    flags = {"DOT_PRECISION": "tf32", **flags} if "DOT_PRECISION" in kernel.arg_names else flags
    tiles, options = first_kept_config(tuned, flags) if tuned else ({"BLOCK_M": 128}, {})
    constexprs = {**flags, **tiles}
    dtype = "fp32" if flags.get("DOT_PRECISION") == "ieee" else "bf16"
    try:
        compiled = triton.compile(ASTSource(kernel, signature(kernel, dtype, constexprs), constexprs),
                                  target=H100, options={**options, "enable_fp_fusion": False})
    except Exception as err:  # reported to the test, which fails with it
        return {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0]}
    return {"ok": bool(compiled.asm["cubin"]), "shared": compiled.metadata.shared}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: the interpreter cannot compile"
    results = {f"{name}-{i}": {**compile_case(kernel, tuned, flags), "flags": flags}
               for i, (name, kernel, tuned, flags) in enumerate(CASES)}
    print("RESULT " + json.dumps(results))
