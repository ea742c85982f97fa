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
            return "*fp32" if name in FP32_POINTERS else f"*{dtype}"
        return "i32"
    return {name: kind(name) for name in kernel.arg_names}


def first_config(tuned) -> tuple[dict, dict]:
    config = tuned.configs[0]
    return dict(config.kwargs), {"num_warps": config.num_warps, "num_stages": config.num_stages}


CASES = [
    ("forward", ft._fwd_kernel, ft._fwd_tuned, {"IS_CAUSAL": True, "EVEN_M": False, "EVEN_N": False}),
    ("forward", ft._fwd_kernel, ft._fwd_tuned, {"IS_CAUSAL": False, "EVEN_M": True, "EVEN_N": True}),
    ("dkdv", ft._bwd_dkdv_kernel, ft._dkdv_tuned, {"IS_CAUSAL": True, "EVEN_M": False, "EVEN_N": True, "RAGGED": True}),
    ("dkdv", ft._bwd_dkdv_kernel, ft._dkdv_tuned, {"IS_CAUSAL": False, "EVEN_M": True, "EVEN_N": True, "RAGGED": False}),
    ("dq", ft._bwd_dq_kernel, ft._dq_tuned, {"IS_CAUSAL": True, "EVEN_M": True, "EVEN_N": False}),
    ("dq", ft._bwd_dq_kernel, ft._dq_tuned, {"IS_CAUSAL": False, "EVEN_M": True, "EVEN_N": True}),
    ("preprocess", ft._bwd_preprocess, None, {}),
]


def compile_case(kernel, tuned, flags: dict) -> dict:
    """Lower one kernel to an sm_90 cubin; its shared memory in bytes, or the error's first line."""
    tiles, options = first_config(tuned) if tuned else ({"BLOCK_M": 128}, {})
    constexprs = {"HEAD_DIM": 128, **flags, **tiles}
    try:
        compiled = triton.compile(ASTSource(kernel, signature(kernel, "bf16", constexprs), constexprs),
                                  target=H100, options=options)
    except Exception as err:  # reported to the test, which fails with it
        return {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0]}
    return {"ok": bool(compiled.asm["cubin"]), "shared": compiled.metadata.shared}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: the interpreter cannot compile"
    results = {f"{name}-{i}": {**compile_case(kernel, tuned, flags), "flags": flags}
               for i, (name, kernel, tuned, flags) in enumerate(CASES)}
    print("RESULT " + json.dumps(results))
