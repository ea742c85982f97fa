"""The SwiGLU-in-the-GEMM kernel of ``scripts/swiglu_probe.py`` (a probe: its timing runs on a GPU only) computes
h1 = x W1^T, h3 = x W3^T and SiLU(h1) * h3, checked in Triton's interpreter against float64 on fresh random inputs,
on shapes that are not multiples of its tiles."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location(
    "swiglu_probe", Path(__file__).resolve().parents[1] / "scripts" / "swiglu_probe.py")
swiglu_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(swiglu_probe)


# (M, N, K): partial tiles in every dimension; M = 150 is 10 row tiles of 16, more than GROUP_M (8): two groups
@pytest.mark.parametrize("m, n, k", [(40, 24, 48), (17, 70, 36), (150, 40, 20)])
@pytest.mark.parametrize("tma", [False, True])
def test_fused_swiglu_gemm_matches_float64(m, n, k, tma):
    """In fp32 (IEEE products, also on a GPU), pointer loads and TMA descriptors (rows of 16-byte multiples)."""
    seed = random.randrange(2**31)
    generator = torch.Generator().manual_seed(seed)
    x, w1, w3 = (torch.randn(*shape, generator=generator) for shape in ((m, k), (n, k), (n, k)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tma and device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need sm_90")
    h1, h3, g = swiglu_probe.swiglu_gemm(*(t.to(device) for t in (x, w1, w3)), config=(16, 16, 16, 4, 2), tma=tma)
    ref1, ref3 = x.double() @ w1.double().T, x.double() @ w3.double().T
    for got, want in ((h1, ref1), (h3, ref3), (g, F.silu(ref1) * ref3)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")
