"""flash_triton on the model's one q, k, v product (``flash_triton_attention_of_product``; and on the input and the
weights, ``flash_triton_attention_of_input``, whose op makes the product rotated on sm_90): RoPE and the split in its
forward, the product's gradient written by its backward (``flash_backward_packed``: dK and dV into the product's
gradient by the kernels, dQ rotated back by a pass, dK by the Gluon kernel's epilogue or a pass, no packing pass),
against float64 on fresh random inputs: the reference rotates and splits the float64 product with PyTorch's ops
(``rotate_split``), attends in float64 and takes the product's gradient by autograd.

Without a GPU the kernels run under the Triton interpreter (conftest), fp32; ``@pytest.mark.gpu`` tests run bf16 at
lengths where the op takes the Gluon backward (sm_90), in the model's layout. Bounds: fp32 as
tests/test_flash_attention.py's (5e-6 relative, 1e-5 on the largest element: the rotations add one fp32 rounding);
bf16 likewise (1e-2 / 2e-2), and the packed route within the same bound of the route that packs in a pass of its
own (with the fused backward its dQ is rounded to bf16 once where the other rounds it twice)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from parallelism_calc.specs import MODELS
from torch_impl.model import RotaryEmbedding, TransformerLM
from torch_impl.qkv_projection import pack_rotated_grads, rotate_pairs, rotate_split

from tests.test_flash_attention import errors

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUNDS = {torch.float32: (5e-6, 1e-5), torch.bfloat16: (1e-2, 2e-2)}  # (relative Frobenius, largest element)


def _flash():
    from torch_impl.attention import flash_triton

    return flash_triton


def _inputs(batch, seq, heads, d, dtype, device):
    product = torch.randn(batch, seq, 3 * heads * d, device=device).to(dtype)
    cos, sin = RotaryEmbedding(d, seq, 10_000.0, device=device).tables(seq)
    d_out = torch.randn(batch, heads, seq, d, device=device).to(dtype)
    return product, cos, sin, d_out


def _reference(product, cos, sin, heads, d_out):
    """O (B, H, T, d) and the product's gradient in float64: rotate_split's PyTorch ops, causal softmax, autograd."""
    product = product.detach().double().cpu().requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in rotate_split(product, cos.double().cpu(), sin.double().cpu(), heads))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    out.backward(d_out.double().cpu())
    return out.detach(), product.grad


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    rel, big = errors(got.cpu(), want)
    bound_rel, bound_big = BOUNDS[dtype]
    assert rel < bound_rel and big < bound_big, f"{what}: {rel:.2e} / {big:.2e} against {bound_rel} / {bound_big}"


def _packed_route(product, cos, sin, heads, d_out):
    product = product.detach().requires_grad_()
    out = _flash().flash_triton_attention_of_product(product, cos, sin, heads)
    out.backward(d_out)
    return out.detach(), product.grad


# (batch, seq, heads, d): ragged tiles, one query (n = 1), a head dim between powers of two
CPU_CASES = [(2, 17, 2, 16), (1, 1, 3, 32), (1, 24, 2, 24)]


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "two-pass"])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "x".join(map(str, c)))
def test_packed_route_matches_float64(case, deterministic, seed):
    batch, seq, heads, d = case
    product, cos, sin, d_out = _inputs(batch, seq, heads, d, torch.float32, DEVICE)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, grad = _packed_route(product, cos, sin, heads, d_out)
    finally:
        torch.use_deterministic_algorithms(saved)
    want_out, want_grad = _reference(product, cos, sin, heads, d_out)
    assert grad.shape == product.shape and grad.dtype == product.dtype
    _check(out, want_out, torch.float32, f"O, seed {seed}")
    _check(grad, want_grad, torch.float32, f"the product's gradient, seed {seed}")


def test_ops_pass_opcheck(seed):
    """The forward and backward ops' fakes, schemas and autograd registration (torch.library.opcheck)."""
    flash = _flash()
    product, cos, sin, d_out = _inputs(1, 9, 2, 16, torch.float32, DEVICE)
    torch.library.opcheck(torch.ops.torch_impl.flash_attention_rope_forward.default,
                          (product.requires_grad_(), cos, sin, 2, True, False))
    o, lse, q, k, v = flash.flash_attention_rope_forward(product.detach(), cos, sin, 2, True, False)
    torch.library.opcheck(torch.ops.torch_impl.flash_attention_rope_backward.default,
                          (d_out, q, k, v, o, lse, cos, sin, True, False, False))


def test_bad_product_is_a_one_line_error():
    product, cos, sin, _ = _inputs(1, 8, 2, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="rotate_split: the product must be"):
        _flash().flash_triton_attention_of_product(product[..., :-8], cos, sin, 2)


@pytest.mark.skipif(os.environ.get("FLASH_PACKED_ROPE") == "0", reason="FLASH_PACKED_ROPE=0: the route is off")
def test_the_model_takes_the_packed_route_unless_a_projection_is_hooked(monkeypatch, seed):
    """flash_triton's blocks attend over the one product (its forward and backward of the product run once a block)
    and match the naive backend's logits and gradients in fp32; with a hook on a projection that block calls each
    module (``project_qkv``'s route, the product's passes one block fewer) and still matches."""
    spec = MODELS["tiny"]
    naive = TransformerLM(spec, attention="naive", device=DEVICE)
    flash = TransformerLM(spec, attention="flash_triton", device=DEVICE)
    flash.load_state_dict(naive.state_dict())
    assert naive.layers[0].attn.packed_attention is None
    module = _flash()
    passes = []
    for name in ("_forward_of_product", "_backward_of_product"):
        monkeypatch.setattr(module, name, lambda *a, run=getattr(module, name), name=name: passes.append(name)
                            or run(*a))
    tokens = torch.randint(0, spec.vocab_size, (2, 21), device=DEVICE)
    targets = torch.randint(0, spec.vocab_size, (2, 21), device=DEVICE)

    def run(model):
        model.zero_grad()
        passes.clear()
        loss = model(tokens, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_loss, want_grads = run(naive)
    for hooked in (False, True):
        handle = flash.layers[0].attn.q_proj.register_forward_hook(lambda *_: None) if hooked else None
        loss, grads = run(flash)
        if handle is not None:
            handle.remove()
        blocks = spec.n_layers - hooked
        assert sorted(passes) == ["_backward_of_product"] * blocks + ["_forward_of_product"] * blocks, passes
        assert abs(loss - want_loss) < 1e-5, (hooked, seed)
        for name, grad in grads.items():
            rel, _ = errors(grad.cpu(), want_grads[name].double().cpu())
            assert rel < 1e-4, f"{name} (hooked {hooked}): {rel:.2e}, seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", [True, False], ids=["dk_in_epilogue", "dk_pass"])
@pytest.mark.parametrize("case", [(2, 1024, 4, 64), (1, 2048, 2, 128), (2, 512, 3, 80)],
                         ids=lambda c: "x".join(map(str, c)))
def test_gpu_packed_route_bf16(case, epilogue, seed, monkeypatch):
    """bf16 on the GPU (the Gluon backward from 512 keys on sm_90, dK rotated back in its epilogue or by a pass:
    ``flash_gluon.rotates_dk``): the product's gradient against float64, and against the route that packs in a pass
    of its own (rotate_split, flash_attention, pack_rotated_grads)."""
    from torch_impl.attention import flash_gluon

    monkeypatch.setattr(flash_gluon, "EPILOGUE_ROPE", epilogue)
    batch, seq, heads, d = case
    product, cos, sin, d_out = _inputs(batch, seq, heads, d, torch.bfloat16, "cuda")
    out, grad = _packed_route(product, cos, sin, heads, d_out)
    want_out, want_grad = _reference(product, cos, sin, heads, d_out)
    _check(out, want_out, torch.bfloat16, f"O, seed {seed}")
    _check(grad, want_grad, torch.bfloat16, f"the product's gradient, seed {seed}")
    q, k, v = (t.transpose(1, 2) for t in rotate_split(product, cos, sin, heads))
    dq, dk, dv = _flash().flash_backward(d_out, q, k, v, *_flash().flash_forward(q, k, v, True), True)
    unpacked = pack_rotated_grads(*(t.transpose(1, 2) for t in (dq, dk, dv)), cos, sin).flatten(2)
    rel, big = errors(grad.cpu(), unpacked.double().cpu())
    assert rel < BOUNDS[torch.bfloat16][0] and big < BOUNDS[torch.bfloat16][1], f"{rel:.2e} / {big:.2e}, seed {seed}"


def _input_reference(x, weights, cos, sin, heads, d_out):
    """O and the gradients of x and the three weights in float64: the product, then ``_reference``'s attention."""
    x, *weights = (t.detach().double().cpu().requires_grad_() for t in (x, *weights))
    product = x @ torch.cat(weights).T
    q, k, v = (t.transpose(1, 2) for t in rotate_split(product, cos.double().cpu(), sin.double().cpu(), heads))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    out.backward(d_out.double().cpu())
    return out.detach(), [t.grad for t in (x, *weights)]


def _input_route(x, weights, cos, sin, heads, d_out):
    x, *weights = (t.detach().requires_grad_() for t in (x, *weights))
    out = _flash().flash_triton_attention_of_input(x, tuple(weights), cos, sin, heads)
    out.backward(d_out)
    return out.detach(), [t.grad for t in (x, *weights)]


def _input_inputs(batch, seq, heads, d, dtype, device):
    width = heads * d
    x = torch.randn(batch, seq, width, device=device).to(dtype)
    weights = [(torch.randn(width, width, device=device) * width ** -0.5).to(dtype) for _ in range(3)]
    cos, sin = RotaryEmbedding(d, seq, 10_000.0, device=device).tables(seq)
    return x, weights, cos, sin, torch.randn(batch, heads, seq, d, device=device).to(dtype)


def _stand_in_product(monkeypatch, heads: int) -> list:
    """flash_triton's attention of the input taken here, with PyTorch's ops standing in for the Gluon product
    (``qkv_rope_gemm``: sm_90 only); returns the list of x's shapes it is called with."""
    flash, calls = _flash(), []

    def stand_in(x, w_q, w_k, w_v, cos, sin):
        calls.append(x.shape)
        q, k, v = (x @ w.T for w in (w_q, w_k, w_v))
        c, s = cos[:, None], sin[:, None]
        rotated = [rotate_pairs(t.unflatten(-1, (heads, -1)), c, s).flatten(2) for t in (q, k)]
        return torch.cat((*rotated, v), dim=-1)

    monkeypatch.setattr(flash, "rope_product_runs", lambda *_: True)
    monkeypatch.setattr(flash, "_qkv_rope", lambda: SimpleNamespace(qkv_rope_gemm=stand_in))
    return calls


@pytest.mark.parametrize("case", CPU_CASES[:2], ids=lambda c: "x".join(map(str, c)))
def test_the_input_route_matches_float64(case, seed, monkeypatch):
    """The attention of the input as one op (``FlashAttentionOfInput``: the product rotated by RoPE, the attention of
    its views, the packed backward, then x's and the weights' GEMMs) with a stand-in for the Gluon product (PyTorch's
    ops: the route itself runs on sm_90 only) against float64, O and the gradients of x and of each weight."""
    batch, seq, heads, d = case
    calls = _stand_in_product(monkeypatch, heads)
    x, weights, cos, sin, d_out = _input_inputs(batch, seq, heads, d, torch.float32, DEVICE)
    out, grads = _input_route(x, weights, cos, sin, heads, d_out)
    want_out, want_grads = _input_reference(x, weights, cos, sin, heads, d_out)
    assert calls == [x.shape], calls  # the route was taken, its product made once
    assert all(g.shape == w.shape and g.dtype == torch.float32 for g, w in zip(grads, want_grads, strict=True))
    _check_input_grads(out, grads, want_out, want_grads, torch.float32, seed)


def _check_input_grads(out, grads, want_out, want_grads, dtype, seed) -> None:
    """O, x's gradient and the weights' as one (3 H d, d) gradient, as the product's is checked (at n = 1 dQ, so
    W_q's gradient, is rounding noise around zero)."""
    _check(out, want_out, dtype, f"O, seed {seed}")
    _check(grads[0], want_grads[0], dtype, f"x's gradient, seed {seed}")
    _check(torch.cat(grads[1:]), torch.cat(want_grads[1:]), dtype, f"the weights' gradient, seed {seed}")


def test_the_compiled_model_takes_the_input_route_as_eager(seed, monkeypatch):
    """The tiny model with flash_triton's attention of the input (a stand-in product), compiled whole (fullgraph,
    AOTAutograd through the ops' fakes and their autograd formula, whose weights' transposes are made outside the
    backward op) against eager: the same logits and gradients, each block's product made once a step."""
    spec = MODELS["tiny"]
    calls = _stand_in_product(monkeypatch, spec.n_heads)
    model = TransformerLM(spec, attention="flash_triton", device=DEVICE)
    tokens = torch.randint(0, spec.vocab_size, (2, 13), device=DEVICE)
    torch._dynamo.reset()
    results = []
    for run_model in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        calls.clear()
        logits = run_model(tokens)
        logits.square().mean().backward()
        assert len(calls) == spec.n_layers, calls
        results.append([logits.detach(), *(p.grad.clone() for p in model.parameters())])
    for got, want in zip(*results, strict=True):
        rel, _ = errors(got.cpu(), want.double().cpu())
        assert rel < 1e-5, f"{rel:.2e}, seed {seed}"


def test_the_input_ops_pass_opcheck(seed):
    """The attention of the input's forward and backward ops (PyTorch's product here): fakes, schemas, autograd."""
    flash = _flash()
    x, weights, cos, sin, d_out = _input_inputs(1, 9, 2, 16, torch.float32, DEVICE)
    torch.library.opcheck(torch.ops.torch_impl.flash_attention_input_forward.default,
                          (x.requires_grad_(), *(w.requires_grad_() for w in weights), cos, sin, 2, True, False))
    o, lse, product = flash.flash_attention_input_forward(x.detach(), *(w.detach() for w in weights), cos, sin, 2,
                                                          True, False)
    weight_t = torch.cat([w.detach().T for w in weights], dim=1)
    torch.library.opcheck(torch.ops.torch_impl.flash_attention_input_backward.default,
                          (d_out, x.detach(), weight_t, product, o, lse, cos, sin, 2, True, False, False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon product needs sm_90")
@pytest.mark.parametrize("case", [(2, 1024, 10, 64), (1, 1024, 8, 80)], ids=lambda c: "x".join(map(str, c)))
def test_gpu_the_input_route_bf16(case, seed, monkeypatch):
    """bf16 on sm_90, the Gluon product with RoPE in its epilogue (``qkv_rope_gemm``) under the attention of the
    input: O and the gradients of x and each weight against float64, and the route taken (its product made once)."""
    flash = _flash()
    batch, seq, heads, d = case
    x, weights, cos, sin, d_out = _input_inputs(batch, seq, heads, d, torch.bfloat16, "cuda")
    assert flash.rope_product_runs(x, tuple(weights), cos, sin)
    calls = []
    run = flash._qkv_rope().qkv_rope_gemm
    monkeypatch.setattr(flash._qkv_rope(), "qkv_rope_gemm", lambda *a: calls.append(1) or run(*a))
    out, grads = _input_route(x, weights, cos, sin, heads, d_out)
    want_out, want_grads = _input_reference(x, weights, cos, sin, heads, d_out)
    assert calls == [1], calls
    _check_input_grads(out, grads, want_out, want_grads, torch.bfloat16, seed)
