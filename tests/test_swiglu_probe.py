"""The SwiGLU-in-the-GEMM kernel of ``scripts/swiglu_probe.py`` (a probe: its timing runs on a GPU only) computes
h1 = x W1^T, h3 = x W3^T and SiLU(h1) * h3, checked in Triton's interpreter against float64 on fresh random inputs,
on shapes that are not multiples of its tiles."""

from __future__ import annotations

import functools
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


@functools.cache  # its op registers once a process
def _swiglu_gluon():
    """scripts/swiglu_gluon.py (its Gluon kernel runs on sm_90 only; the op's PyTorch path everywhere)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    spec = importlib.util.spec_from_file_location(
        "swiglu_gluon", Path(__file__).resolve().parents[1] / "scripts" / "swiglu_gluon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("forward", ["fused_forward", "fused_mlp_forward"])
def test_fused_swiglu_modules_match_the_model_in_float64(forward):
    """``fused_forward`` (step_probe's ``+gsw``) and ``fused_mlp_forward`` (``+gsw2``) bound to the model's SwiGLU
    give the model's output and the gradients of x and of all three weights, float64 on fresh random inputs, eager
    and compiled (fullgraph: the ops trace with no graph break)."""
    import types

    from torch_impl.model import SwiGLU

    swiglu_gluon = _swiglu_gluon()
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    module = SwiGLU(16, 24, dtype=torch.float64)
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    want = module(x)
    want_grads = torch.autograd.grad(want.square().sum(), (x, *module.parameters()))
    module.forward = types.MethodType(getattr(swiglu_gluon, forward), module)
    for run in (module, torch.compile(module, fullgraph=True, backend="aot_eager")):
        got = run(x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
        for a, b in zip(torch.autograd.grad(got.square().sum(), (x, *module.parameters())), want_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"seed {seed}")


def test_swiglu_product_passes_opcheck_and_gradcheck():
    """The forward's op: opcheck, and every output's gradient against finite differences (h1's and h3's own too,
    and g's alone)."""
    swiglu_gluon = _swiglu_gluon()
    inputs = (torch.randn(6, 4, dtype=torch.float64, requires_grad=True),
              *(torch.randn(5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)))
    torch.library.opcheck(swiglu_gluon.swiglu_product, inputs)
    torch.autograd.gradcheck(swiglu_gluon.swiglu_product, inputs)
    torch.autograd.gradcheck(lambda *t: swiglu_gluon.swiglu_product(*t)[2], inputs)
    torch.autograd.gradcheck(lambda *t: swiglu_gluon.swiglu_product(*t)[0], inputs)


def _assert_within_bf16(got, want, context) -> None:
    """Each kernel output element by element against its float64 reference: within bf16's rounding, with room."""
    for a, b in zip(got, want, strict=True):
        bound = 2e-2 * b.abs() + 2e-2 * b.abs().mean()
        assert ((a.double() - b).abs() <= bound).all(), (*context, (a.double() - b).abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 1664, 256), (256, 256, 64)])
@pytest.mark.parametrize("config", range(5))  # swiglu_gluon.CONFIGS (imported on a GPU only)
def test_gpu_gluon_swiglu_gemm_matches_float64(config, shape):
    """The Gluon kernel (sm_90) at each configuration, bf16 against float64 from the same bf16 inputs, element by
    element: 208-416 tiles (one to four a program: in ping-pong both consumers take turns on the ring), and 4-8
    tiles of one k-tile (fewer than the stages, a program of one tile)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs sm_90")
    swiglu_gluon = _swiglu_gluon()
    assert len(swiglu_gluon.CONFIGS) == 5  # the parametrization's range
    m, n, k = shape
    seed = random.randrange(2**31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x, w1, w3 = (torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16)
                 for size in ((m, k), (n, k), (n, k)))
    got = swiglu_gluon.swiglu_gemm(x, w1, w3, swiglu_gluon.CONFIGS[config])
    ref1, ref3 = x.double() @ w1.double().T, x.double() @ w3.double().T
    _assert_within_bf16(got, (ref1, ref3, F.silu(ref1) * ref3), (config, shape, seed))


def test_swiglu_grads_match_autograd_and_bad_shapes_are_refused():
    """``swiglu_grads`` (the backward kernel's epilogue formula, the op's backward and the probe's unfused one)
    against autograd through F.silu(h1) * h3 in float64; the backward kernel's host refuses shapes that are not
    whole tiles with one line naming them, before any launch."""
    swiglu_gluon = _swiglu_gluon()
    seed = random.randrange(2**31)
    generator = torch.Generator().manual_seed(seed)
    h1, h3, dg = (torch.randn(7, 9, generator=generator, dtype=torch.float64) * 3 for _ in range(3))
    h1.requires_grad_(True)
    h3.requires_grad_(True)
    want = torch.autograd.grad(F.silu(h1) * h3, (h1, h3), dg)
    for a, b in zip(swiglu_gluon.swiglu_grads(dg, h1.detach(), h3.detach()), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
    dy, w2, h = torch.zeros(256, 96), torch.zeros(96, 256), torch.zeros(256, 256)  # K = 96: 1.5 k-tiles
    with pytest.raises(ValueError, match=r"swiglu_backward_gemm: .*got \(256, 96\), \(96, 256\)"):
        swiglu_gluon.swiglu_backward_gemm(dy, w2, h, h)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 1664, 256), (2048, 1664, 256), (256, 256, 64)])
@pytest.mark.parametrize("config", range(3))  # swiglu_gluon.BACKWARD_CONFIGS (imported on a GPU only)
def test_gpu_gluon_swiglu_backward_gemm_matches_float64(config, shape):
    """The backward kernel (sm_90) at each configuration: d_gate and d_up from dg = dy W2 and h1, h3, bf16 against
    float64 from the same bf16 inputs, element by element; 416 tiles (three or four a program: each consumer's
    buffers and barriers reused, the turn passed back), 208 (one or two), and 4 tiles of one k-tile."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs sm_90")
    swiglu_gluon = _swiglu_gluon()
    assert len(swiglu_gluon.BACKWARD_CONFIGS) == 3  # the parametrization's range
    m, n, k = shape
    seed = random.randrange(2**31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dy, w2, h1, h3 = (torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16)
                      for size in ((m, k), (k, n), (m, n), (m, n)))
    got = swiglu_gluon.swiglu_backward_gemm(dy, w2, h1, h3, swiglu_gluon.BACKWARD_CONFIGS[config])
    want = swiglu_gluon.swiglu_grads(dy.double() @ w2.double(), h1.double(), h3.double())
    _assert_within_bf16(got, want, (config, shape, seed))  # dg's rounding too


def test_swiglu_mlp_passes_opcheck_and_gradcheck():
    """The whole MLP's op and its backward's op: opcheck, and every output's gradient against finite differences
    (y's alone: the fused backward's branch; all four, and g's alone: the unfused one)."""
    swiglu_gluon = _swiglu_gluon()
    inputs = (torch.randn(6, 4, dtype=torch.float64, requires_grad=True),
              *(torch.randn(5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)),
              torch.randn(4, 5, dtype=torch.float64, requires_grad=True))
    torch.library.opcheck(swiglu_gluon.swiglu_mlp, inputs)
    torch.library.opcheck(swiglu_gluon.swiglu_backward, (torch.randn(6, 4, dtype=torch.float64), inputs[3].detach(),
                                                         torch.randn(6, 5, dtype=torch.float64),
                                                         torch.randn(6, 5, dtype=torch.float64)))
    torch.autograd.gradcheck(swiglu_gluon.swiglu_mlp, inputs)
    torch.autograd.gradcheck(lambda *t: swiglu_gluon.swiglu_mlp(*t)[0], inputs)
    torch.autograd.gradcheck(lambda *t: swiglu_gluon.swiglu_mlp(*t)[3], inputs)
