"""q, k and v as one product with RoPE (torch_impl.qkv_projection): its gradients against float64 references on fresh
random inputs, the packing kernel (under the Triton interpreter without a GPU) against the PyTorch ops, and the
model's route (one product, or the modules called one by one when something hooks them)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallelism_calc.specs import MODELS
from torch_impl.model import RotaryEmbedding, TransformerLM
from torch_impl.qkv_pack_triton import launch_pack, launch_split
from torch_impl.qkv_projection import QKVProduct, pack_rotated_grads, rotate_pairs, rotate_split

TINY = MODELS["tiny"]


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    return torch.Generator().manual_seed(seed), seed


def qkv_projection(x, w_q, w_k, w_v, cos, sin, n_heads):
    """The model's route: the one product, then RoPE and the split (whose backward packs the gradients)."""
    return rotate_split(QKVProduct.apply(x, w_q, w_k, w_v), cos, sin, n_heads)


def three_products(x, w_q, w_k, w_v, cos, sin, n_heads):
    """The reference: three products, each head rotated by RoPE, autograd's own gradients."""
    q, k, v = (F.linear(x, w).unflatten(-1, (n_heads, -1)) for w in (w_q, w_k, w_v))
    return rotate_pairs(q, cos[:, None], sin[:, None]), rotate_pairs(k, cos[:, None], sin[:, None]), v


def inputs(generator, batch=2, seq=7, n_heads=3, d_head=8, dtype=torch.float64, positions=None):
    d = n_heads * d_head
    x = torch.randn(batch, seq, d, dtype=dtype, generator=generator, requires_grad=True)
    weights = [torch.randn(d, d, dtype=dtype, generator=generator, requires_grad=True) for _ in range(3)]
    cos, sin = RotaryEmbedding(d_head, 32, 10_000.0, dtype=dtype).tables(seq, positions)
    return x, weights, cos, sin, n_heads


@pytest.mark.parametrize("shuffled", [False, True])
def test_one_product_is_the_three_products_in_float64(shuffled):
    generator, seed = fresh_generator()
    positions = torch.randperm(32, generator=generator)[:7] if shuffled else None
    x, weights, cos, sin, n_heads = inputs(generator, positions=positions)
    assert torch.autograd.gradcheck(lambda *t: qkv_projection(*t, cos, sin, n_heads), (x, *weights)), seed
    grads_out = [torch.randn(2, 7, n_heads, 8, dtype=torch.float64, generator=generator) for _ in range(3)]
    ours = qkv_projection(x, *weights, cos, sin, n_heads)
    # v in an allocation of its own: a view would keep the whole product alive while the attention keeps v
    assert ours[2].untyped_storage().nbytes() == ours[2].numel() * ours[2].element_size()
    ours_grads = torch.autograd.grad(ours, (x, *weights), grads_out)
    reference = three_products(x, *weights, cos, sin, n_heads)
    reference_grads = torch.autograd.grad(reference, (x, *weights), grads_out)
    for got, want in zip((*ours, *ours_grads), (*reference, *reference_grads)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")


def test_under_autocast_it_is_as_near_float64_as_the_three_products():
    """bf16 autocast: outputs bf16, gradients in the inputs' dtypes, and each no further from the float64 values
    than the three products under autocast are (the one product rounds dx once, where three bf16 GEMMs and their
    bf16 sum round it four times)."""
    generator, seed = fresh_generator()
    x, weights, cos, sin, n_heads = inputs(generator, dtype=torch.float32)
    grads_out = [torch.randn(2, 7, n_heads, 8, generator=generator).bfloat16() for _ in range(3)]
    leaves64 = [t.detach().double().requires_grad_() for t in (x, *weights)]
    truth = three_products(*leaves64, cos.double(), sin.double(), n_heads)
    truth = (*truth, *torch.autograd.grad(truth, leaves64, [g.double() for g in grads_out]))
    errors = []
    for route in (qkv_projection, three_products):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = route(x, *weights, cos, sin, n_heads)
        got = (*out, *torch.autograd.grad(out, (x, *weights), grads_out))
        assert [t.dtype for t in got] == [torch.bfloat16] * 3 + [torch.float32] * 4, seed
        errors.append([((g.double() - t).abs().max() / t.abs().max()).item() for g, t in zip(got, truth)])
    ours, reference = errors
    assert max(reference) < 2e-2, (seed, reference)  # bf16 rounding, not a wrong formula
    assert all(o <= 1.5 * r + 1e-3 for o, r in zip(ours, reference)), (seed, ours, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "heads_first"])
def test_packing_kernel_is_the_pytorch_packing(dtype, layout):
    """The Triton kernel (interpreted without a GPU) against the op's PyTorch ops, with dq laid out as the
    attention kernels may return it ((B, H, T, d) storage seen as (B, T, H, d)), and d_head 12 below its tile."""
    generator, seed = fresh_generator()
    batch, seq, n_heads, d_head = 2, 5, 3, 12
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def grad():
        t = torch.randn(batch, n_heads, seq, d_head, generator=generator).to(dtype)
        return (t.transpose(1, 2) if layout == "heads_first" else t.transpose(1, 2).contiguous()).to(device)

    dq, dk, dv = grad(), grad(), grad()
    cos, sin = (t.to(device) for t in RotaryEmbedding(d_head, 16, 10_000.0).tables(seq))
    expected = pack_rotated_grads(dq.cpu(), dk.cpu(), dv.cpu(), cos.cpu(), sin.cpu())
    got = launch_pack(dq, dk, dv, cos, sin).cpu()
    assert got.shape == (batch, seq, 3, n_heads, d_head) and got.dtype == dtype
    ulp = 0 if dtype == torch.float32 else 2.0 ** -7  # one bf16 unit: the interpreter's rounding, FMA contraction
    torch.testing.assert_close(got.float(), expected.float(), rtol=ulp + 1e-6, atol=1e-6, msg=f"seed {seed}")
    torch.testing.assert_close(got[:, :, 2], dv.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ["contiguous", "strided"])
def test_split_kernel_is_the_pytorch_split(dtype, rows):
    """The forward's Triton kernel (interpreted without a GPU) against the op's PyTorch ops and against RoPE of the
    three parts: q and k rotated, v equal to its part, each contiguous in an allocation of its own; d_head 12 below
    its tile, the product's rows strided (a view of a wider buffer, or batch-major storage seen as (B, T, 3d)) or
    not, more rows than a program's block, one row (where v's part is contiguous), one position of several batches."""
    generator, seed = fresh_generator()
    n_heads, d_head = 3, 12
    width = 3 * n_heads * d_head
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for batch, seq in ((2, 5), (3, 30), (1, 1), (3, 1)):
        if rows == "strided" and seq == 1:  # (T, B, 3d) storage: the batch's stride is not T x the position's
            wide = torch.randn(seq, batch, width, generator=generator).to(dtype).to(device).transpose(0, 1)
        else:
            wide = torch.randn(batch, seq, width + (4 if rows == "strided" else 0), generator=generator)
            wide = wide.to(dtype).to(device)
        product = wide[..., :width]
        cos, sin = (t.to(device) for t in RotaryEmbedding(d_head, 32, 10_000.0).tables(seq))
        expected = rotate_split(product.cpu(), cos.cpu(), sin.cpu(), n_heads)
        got = [t.cpu() for t in launch_split(product, cos, sin, n_heads)]
        parts = product.cpu().unflatten(-1, (3, n_heads, d_head)).unbind(2)
        for t in expected:
            assert t.is_contiguous() and t.shape == (batch, seq, n_heads, d_head) and t.dtype == dtype
            assert t.untyped_storage().data_ptr() != product.untyped_storage().data_ptr()
        rotated = rotate_pairs(parts[0], cos.cpu()[:, None], sin.cpu()[:, None])
        torch.testing.assert_close(expected[0], rotated, rtol=0, atol=0)
        torch.testing.assert_close(expected[2], parts[2], rtol=0, atol=0)
        ulp = 0 if dtype == torch.float32 else 2.0 ** -7  # one bf16 unit: the interpreter's rounding, FMA contraction
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == dtype and g.is_contiguous()
            torch.testing.assert_close(g.float(), e.float(), rtol=ulp + 1e-6, atol=1e-6, msg=f"seed {seed}")


def test_split_rejects_what_it_cannot_split():
    cos = torch.zeros(5, 4)
    with pytest.raises(ValueError, match=r"\(B, T, 3 x n_heads x d_head\) with d_head even"):
        rotate_split(torch.zeros(2, 5, 70), cos, cos, 3)
    with pytest.raises(ValueError, match=r"\(B, T, 3 x n_heads x d_head\) with d_head even"):
        rotate_split(torch.zeros(2, 5, 63), cos, cos, 3)  # d_head 7
    with pytest.raises(ValueError, match=r"cos and sin must be \(T, d_head / 2\)"):
        rotate_split(torch.zeros(2, 5, 72), cos[:4], cos, 3)
    for product, n_heads in ((torch.zeros(5, 72), 3), (torch.zeros(2, 5, 72), 0), (torch.zeros(2, 5, 0), 3)):
        with pytest.raises(ValueError, match="with d_head even and positive"):
            rotate_split(product, cos, cos, n_heads)
    with pytest.raises(ValueError, match="must share a device"):
        rotate_split(torch.zeros(2, 5, 72), cos.to("meta"), cos, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_split_and_packing_are_custom_ops_with_each_other_as_backward(dtype):
    """torch.library.opcheck of both ops (schema, fake against real, autograd registration, AOT dispatch) on fresh
    inputs, and in float64 gradcheck: each op's backward is the other (a rotation's adjoint is the rotation back)."""
    generator, seed = fresh_generator()
    batch, seq, n_heads, d_head = 2, 5, 3, 8
    cos, sin = (t.to(torch.float64 if dtype == torch.float64 else torch.float32)
                for t in RotaryEmbedding(d_head, 16, 10_000.0).tables(seq))
    product = torch.randn(batch, seq, 3 * n_heads * d_head, generator=generator).to(dtype).requires_grad_()
    grads = [torch.randn(batch, seq, n_heads, d_head, generator=generator).to(dtype).requires_grad_()
             for _ in range(3)]
    torch.library.opcheck(torch.ops.torch_impl.rotate_split.default, (product, cos, sin, n_heads))
    torch.library.opcheck(torch.ops.torch_impl.pack_rotated_grads.default, (*grads, cos, sin))
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda p: rotate_split(p, cos, sin, n_heads), (product,)), seed
        assert torch.autograd.gradcheck(lambda *g: pack_rotated_grads(*g, cos, sin), grads), seed


def test_packing_rejects_what_it_cannot_pack():
    dq = torch.zeros(2, 5, 3, 8)
    cos = torch.zeros(5, 4)
    with pytest.raises(ValueError, match=r"cos and sin must be \(T, d_head / 2\)"):
        pack_rotated_grads(dq, dq, dq, cos[:4], cos)
    with pytest.raises(ValueError, match="share a dtype"):
        pack_rotated_grads(dq, dq.double(), dq, cos, cos)
    with pytest.raises(ValueError, match="d_head even"):
        pack_rotated_grads(torch.zeros(2, 5, 3, 7), torch.zeros(2, 5, 3, 7), torch.zeros(2, 5, 3, 7), cos, cos)


def test_model_gradients_match_the_modules_called_one_by_one():
    """The model's one product against the route a hook forces (each projection called): same loss, same
    gradient for every parameter, float64."""
    generator, seed = fresh_generator()
    torch.manual_seed(seed)
    model = TransformerLM(TINY, dtype=torch.float64)
    tokens = torch.randint(0, TINY.vocab_size, (2, 9), generator=generator)
    grads = []
    for hooked in (False, True):
        handles = [m.register_forward_pre_hook(lambda *a: None) for m in model.modules() if hooked and
                   m.__class__.__name__ == "Linear"]
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for handle in handles:
            handle.remove()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-10, atol=1e-12, msg=f"{name} {seed}")


def test_compiled_block_matches_eager():
    """torch.compile(fullgraph=True) traces the autograd.Function and the packing op with no graph break."""
    generator, seed = fresh_generator()
    torch.manual_seed(seed)
    model = TransformerLM(TINY)
    block = model.layers[0]
    x = torch.randn(2, 9, TINY.d_model, generator=generator, requires_grad=True)
    eager_out = block(x)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), (x, *block.parameters()))
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), (x, *block.parameters()))
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")


@pytest.mark.parametrize("autocast", [False, True])
def test_it_saves_the_weights_themselves_or_autocasts_one_copy(autocast):
    """Without autocast the saved weights are the parameters themselves (a wrapper that frees gathered weights after
    the forward, our FSDP or FSDP2, frees them: a saved concatenation would keep every block's whole weight alive);
    under autocast one bf16 copy of the concatenation and one of x, where three products kept three of each."""
    generator, _ = fresh_generator()
    x, weights, cos, sin, n_heads = inputs(generator, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            qkv_projection(x, *weights, cos, sin, n_heads)
    d = x.shape[-1]
    if autocast:
        assert [tuple(t.shape) for t in saved if t.dtype == torch.bfloat16] == [tuple(x.shape), (3 * d, d)]
    else:
        assert all(any(t is w for t in saved) for w in weights) and not [t for t in saved if t.shape == (3 * d, d)]


def test_compiled_it_saves_the_weights_not_their_concatenation():
    """Compiled, AOTAutograd's partitioner saves what the backward needs: the backward's concatenation must not be
    one it can share with the forward's (it would save that in place of the weights: measured before 2026-11-28's
    fix), so the compiled product saves the weights, as eager does (bf16 weights, no autocast: FSDP2's case)."""
    generator, _ = fresh_generator()
    x, weights, cos, sin, n_heads = inputs(generator, dtype=torch.float32)
    x = x.to(torch.bfloat16).requires_grad_()
    weights = [torch.nn.Parameter(w.detach().to(torch.bfloat16)) for w in weights]  # a model's: Dynamo's parameters
    d = x.shape[-1]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: qkv_projection(x, *weights, cos, sin, n_heads),
                             backend="aot_eager_decomp_partition", fullgraph=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        q, k, v = compiled(x)
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()
    assert (3 * d, d) not in saved and saved.count((d, d)) == 3, saved
    assert all(w.grad is not None for w in weights)


def test_float64_under_autocast_stays_float64():
    """Autocast leaves float64 alone, so does the product (a float64 model under autocast runs as without it)."""
    generator, seed = fresh_generator()
    x, weights, cos, sin, n_heads = inputs(generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = qkv_projection(x, *weights, cos, sin, n_heads)
    for a, b in zip(got, qkv_projection(x, *weights, cos, sin, n_heads)):
        assert a.dtype == torch.float64 and torch.equal(a, b), seed


@pytest.mark.parametrize("n_heads, d_head", [(3, 6), (2, 8)])
def test_weight_gradients_start_aligned(n_heads, d_head):
    """The three weights' gradients are views of one product where each starts at a multiple of 16 elements
    (MasterAdamW's kernel needs it), else each its own allocation (d = 18: d^2 = 324)."""
    generator, _ = fresh_generator()
    x, weights, cos, sin, _ = inputs(generator, n_heads=n_heads, d_head=d_head, dtype=torch.float32)
    grads = torch.autograd.grad(sum(t.sum() for t in qkv_projection(x, *weights, cos, sin, n_heads)), weights)
    shared = len({g.untyped_storage().data_ptr() for g in grads}) == 1
    assert shared == ((n_heads * d_head) ** 2 % 16 == 0)
    assert all(g.storage_offset() % 16 == 0 for g in grads)
