"""SwiGLU's MLP in Gluon GEMMs' epilogues (``torch_impl.swiglu_gluon``, the model's ``mlp="gluon"``): the ops
against float64 and finite differences on the CPU (their PyTorch path), the kernels on sm_90 against float64 from
the same bf16 inputs, element by element, and the model with them against the model without."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from parallelism_calc.specs import get_model
from torch_impl import swiglu_gluon
from torch_impl.model import TransformerLM

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="the Gluon kernels need sm_90")

def test_the_gluon_mlp_matches_the_model_in_float64():
    """``TransformerLM(..., mlp="gluon")`` (its MLPs as ``swiglu_mlp``, PyTorch's path off sm_90) gives the model's
    loss and the gradient of every parameter, float64 on fresh random weights and tokens, eager and with each block
    compiled (fullgraph: the op traces with no graph break)."""
    spec = get_model("tiny")
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    ours = TransformerLM(spec, dtype=torch.float64)
    fused = TransformerLM(spec, dtype=torch.float64, mlp="gluon")
    fused.load_state_dict(ours.state_dict())
    assert all(block.ffn.mlp == "gluon" for block in fused.layers)
    tokens = torch.randint(0, spec.vocab_size, (2, 9))
    want = ours(tokens[:, :-1], tokens[:, 1:])
    want_grads = torch.autograd.grad(want, list(ours.parameters()))
    for compiled in (False, True):
        if compiled:
            for block in fused.layers:
                block.compile(fullgraph=True, backend="aot_eager")
        got = fused(tokens[:, :-1], tokens[:, 1:])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"seed {seed}, compiled {compiled}")
        for a, b in zip(torch.autograd.grad(got, list(fused.parameters())), want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"seed {seed}, compiled {compiled}")


def test_an_unknown_mlp_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="mlp 'cuda'; accepted: torch, gluon"):
        TransformerLM(get_model("tiny"), mlp="cuda")


def test_e2e_and_the_trainer_take_the_mlp_under_autocast_too(tmp_path):
    """``--mlp gluon`` in e2e: the record says so in its metrics and implementation, and under bf16 autocast (fp32
    weights: the op's inputs cast as F.linear's are) its losses follow the PyTorch MLP's to bf16's rounding; the
    trainer refuses an unknown MLP in one line."""
    from analysis.records import read_records
    from torch_impl.bench import e2e
    from torch_impl.train import TrainConfig, build_parser

    out = tmp_path / "runs.jsonl"
    flags = ["--model", "tiny", "--batch-size", "2", "--seq-len", "24", "--warmup", "0", "--steps", "3",
             "--dtype", "bf16", "--device", "cpu", "--out", str(out)]
    assert e2e.main(flags) == 0
    assert e2e.main([*flags, "--mlp", "gluon"]) == 0
    plain, fused = read_records(out)
    assert fused.status == "ok" and (plain.metrics["mlp"], fused.metrics["mlp"]) == ("torch", "gluon")
    assert fused.implementation == plain.implementation + ", gluon mlp"
    assert fused.metrics["losses"] == pytest.approx(plain.metrics["losses"], rel=2e-2)
    assert build_parser().parse_args(["--mlp", "gluon"]).mlp == "gluon"
    with pytest.raises(ValueError, match="--mlp 'cuda'; accepted: torch, gluon"):
        TrainConfig(mlp="cuda", device="cpu")


def test_swiglu_product_passes_opcheck_and_gradcheck():
    """The forward's op: opcheck, and every output's gradient against finite differences (h1's and h3's own too,
    and g's alone)."""
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
@sm90
@pytest.mark.parametrize("shape", [(2048, 1664, 256), (256, 256, 64)])
@pytest.mark.parametrize("config", range(5))  # swiglu_gluon.CONFIGS (imported on a GPU only)
def test_gpu_gluon_swiglu_gemm_matches_float64(config, shape):
    """The Gluon kernel (sm_90) at each configuration, bf16 against float64 from the same bf16 inputs, element by
    element: 208-416 tiles (one to four a program: in ping-pong both consumers take turns on the ring), and 4-8
    tiles of one k-tile (fewer than the stages, a program of one tile)."""
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
@sm90
@pytest.mark.parametrize("shape", [(4096, 1664, 256), (2048, 1664, 256), (256, 256, 64)])
@pytest.mark.parametrize("config", range(3))  # swiglu_gluon.BACKWARD_CONFIGS (imported on a GPU only)
def test_gpu_gluon_swiglu_backward_gemm_matches_float64(config, shape):
    """The backward kernel (sm_90) at each configuration: d_gate and d_up from dg = dy W2 and h1, h3, bf16 against
    float64 from the same bf16 inputs, element by element; 416 tiles (three or four a program: each consumer's
    buffers and barriers reused, the turn passed back), 208 (one or two), and 4 tiles of one k-tile."""
    assert len(swiglu_gluon.BACKWARD_CONFIGS) == 3  # the parametrization's range
    m, n, k = shape
    seed = random.randrange(2**31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dy, w2, h1, h3 = (torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16)
                      for size in ((m, k), (k, n), (m, n), (m, n)))
    got = swiglu_gluon.swiglu_backward_gemm(dy, w2, h1, h3, swiglu_gluon.BACKWARD_CONFIGS[config])
    want = swiglu_gluon.swiglu_grads(dy.double() @ w2.double(), h1.double(), h3.double())
    _assert_within_bf16(got, want, (config, shape, seed))  # dg's rounding too


@pytest.mark.gpu
@sm90
def test_gpu_the_kernels_sigmoid_holds_far_from_zero():
    """Both kernels' sigmoid (``_sigmoid``: the special function unit's approximate ex2 and rcp, denormals flushed)
    where SiLU's gate reaches +-150: its exponential overflows to inf or flushes to 0 there, and the outputs must
    still be within bf16's rounding of float64, element by element."""
    m, n, k = 2048, 1664, 256
    seed = random.randrange(2**31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x, w1, w3 = (torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16)
                 for size in ((m, k), (n, k), (n, k)))
    w1 *= 4  # h1 = x W1^T: standard deviation 64
    got = swiglu_gluon.swiglu_gemm(x, w1, w3)
    ref1, ref3 = x.double() @ w1.double().T, x.double() @ w3.double().T
    assert ref1.abs().max() > 150, ref1.abs().max()
    _assert_within_bf16(got, (ref1, ref3, F.silu(ref1) * ref3), ("forward", seed))
    dy, w2 = (torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16) for size in ((m, k), (k, n)))
    h1, h3 = got[0], got[1]
    want = swiglu_gluon.swiglu_grads(dy.double() @ w2.double(), h1.double(), h3.double())
    _assert_within_bf16(swiglu_gluon.swiglu_backward_gemm(dy, w2, h1, h3), want, ("backward", seed))


def test_swiglu_mlp_passes_opcheck_and_gradcheck():
    """The whole MLP's op and its backward's op: opcheck, and every output's gradient against finite differences
    (y's alone: the fused backward's branch; all four, and g's alone: the unfused one)."""
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


@pytest.mark.gpu
@sm90
def test_gpu_the_gluon_mlp_is_as_close_to_float64_as_the_model(monkeypatch):
    """On sm_90, a bf16 model whose MLPs run both kernels (whole tiles: 256 tokens, d_model 256, d_ff 512): its loss
    and every parameter's gradient are as close to the float64 model's (same weights and tokens) as the bf16 model's
    without them, within a factor of two and bf16's rounding."""
    launches = []
    for name in ("swiglu_gemm", "swiglu_backward_gemm"):
        kernel = getattr(swiglu_gluon, name)
        monkeypatch.setattr(swiglu_gluon, name, lambda *a, kernel=kernel, name=name, **k: (launches.append(name),
                                                                                          kernel(*a, **k))[1])
    spec = get_model("tiny").replace(d_model=256, d_ff=512, n_layers=2, context_length=128)
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    models = {mlp: TransformerLM(spec, device="cuda", dtype=torch.bfloat16, mlp=mlp) for mlp in ("torch", "gluon")}
    models["float64"] = TransformerLM(spec, device="cuda", dtype=torch.float64)
    for name in ("gluon", "float64"):  # the bf16 weights, in each
        models[name].load_state_dict(models["torch"].state_dict())
    tokens = torch.randint(0, spec.vocab_size, (2, 129), device="cuda")
    results = {}
    for name, model in models.items():
        loss = model(tokens[:, :-1], tokens[:, 1:])
        results[name] = (loss.double(), [g.double() for g in torch.autograd.grad(loss, list(model.parameters()))])
    assert launches.count("swiglu_gemm") == launches.count("swiglu_backward_gemm") == spec.n_layers
    (want, want_grads), (base, base_grads), (got, got_grads) = results["float64"], results["torch"], results["gluon"]
    assert (got - want).abs() <= 2 * (base - want).abs() + 1e-2 * want.abs(), (seed, got, base, want)
    for name, a, b, c in zip(dict(models["float64"].named_parameters()), got_grads, base_grads, want_grads,
                             strict=True):
        assert (a - c).norm() <= 2 * (b - c).norm() + 1e-2 * c.norm(), (seed, name, (a - c).norm(), (b - c).norm())


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("shape", [(8192, 1600, 6400), (4096, 2560, 10240)])  # xl 4 x 2,048; 2.7B 2 x 2,048
def test_gpu_the_mlp_op_at_the_models_shapes_is_as_close_to_float64_as_pytorchs(monkeypatch, shape):
    """``swiglu_mlp`` forward and backward at the shapes the records run (25-40 k-tiles a tile, more than the ring's
    stages): y and the gradients of x, W1, W3 and W2 from the kernels against float64 from the same bf16 inputs, as
    close as the op's PyTorch path (cuBLAS in bf16, SwiGLU in fp32 rounded to bf16), in norm and element by element
    (within twice its error, and bf16's rounding of the largest element): a wrong tile or k-tile would show."""
    m, d, f = shape
    seed = random.randrange(2**31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs = [torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16) * scale
              for size, scale in (((m, d), 1.0), ((f, d), d ** -0.5), ((f, d), d ** -0.5), ((d, f), f ** -0.5))]
    dy = torch.randn(m, d, generator=generator, device="cuda", dtype=torch.bfloat16)

    def run(dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in inputs]
        y = swiglu_gluon.swiglu_mlp(*leaves)[0]
        return [y.detach().double(), *(g.double() for g in torch.autograd.grad(y, leaves, dy.to(dtype)))]

    want, got = run(torch.float64), run(torch.bfloat16)
    monkeypatch.setattr(swiglu_gluon, "_fits", lambda *args: False)  # the op's PyTorch path
    monkeypatch.setattr(swiglu_gluon, "_backward_fits", lambda *args: False)
    base = run(torch.bfloat16)
    for name, a, b, c in zip(("y", "dx", "dW1", "dW3", "dW2"), got, base, want, strict=True):
        assert (a - c).norm() <= 2 * (b - c).norm(), (seed, name, (a - c).norm() / c.norm(), (b - c).norm() / c.norm())
        worst = (a - c).abs().max()
        assert worst <= 2 * (b - c).abs().max() + 2**-8 * c.abs().max(), (seed, name, worst, (b - c).abs().max())


@pytest.mark.gpu
@sm90
def test_gpu_the_kernels_give_the_same_bits_call_after_call():
    """Each output tile's sum runs in one fixed order, so the same inputs must give the same bits every call: 100
    calls of each kernel at xl's shapes (8,192 tokens, 1,600 -> 6,400), a cuBLAS product on a second stream
    beside every other one (the programs then start at other times), each against the first call, bit for bit. A
    race in the rings, the epilogue's buffers or the turn between the consumers would show as a call that
    differs."""
    m, d, f = 8192, 1600, 6400
    generator = torch.Generator(device="cuda").manual_seed(random.randrange(2**31))
    x, dy, noise = (torch.randn(m, d, generator=generator, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w1, w3 = (torch.randn(f, d, generator=generator, device="cuda", dtype=torch.bfloat16) * d ** -0.5
              for _ in range(2))
    w2 = torch.randn(d, f, generator=generator, device="cuda", dtype=torch.bfloat16) * f ** -0.5
    side = torch.cuda.Stream()
    first = None
    for call in range(100):
        if call % 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                noise @ w1.T
        h1, h3, g = swiglu_gluon.swiglu_gemm(x, w1, w3)
        outputs = (h1, h3, g, *swiglu_gluon.swiglu_backward_gemm(dy, w2, h1, h3))
        if first is None:
            first = [t.clone() for t in outputs]
        differ = [name for name, a, b in zip(("h1", "h3", "g", "d_gate", "d_up"), outputs, first, strict=True)
                  if not torch.equal(a, b)]
        assert not differ, (call, differ)
    torch.cuda.synchronize()
