"""q, k and v as one product, with RoPE, and a backward that packs their gradients in one kernel.

The attention's three projections of the same input run as one GEMM on the concatenated weights (3d x d): the
wider GEMM runs nearer the matmul ceiling, and the input's gradient is one GEMM (K = 3d) where three GEMMs and their
sum were. The backward of that product needs the gradient of the packed (B, T, 3, H, d_head) output: dq and dk
rotated back by RoPE (a rotation's transpose is the rotation by minus the angle), dv beside them. Inductor writes
that as a pointwise concatenation at a third of the copy bandwidth (7.2 ms a step at xl 4 x 2,048 where a copy takes
~2.5: notes/train_step.md, sessions 8, 17 and 42), so the product's backward is written out here (``QKVProduct``)
and the packing is one Triton kernel (``torch_impl.qkv_pack_triton``) behind ``pack_rotated_grads``, an opaque op to
torch.compile (PyTorch's ops off CUDA), the backward of ``rotate_split``.

The forward's RoPE (q and k rotated, v copied out beside them) is one kernel too, behind ``rotate_split``. An
attention backend that takes the input and the weights (``registry.register_packed_attention``: flash_triton, given
``qkv_weights``) makes the product (``QKVProduct``, or on sm_90 with RoPE in its epilogue), applies RoPE and splits it
in its forward and writes the product's gradient in its backward, so that the packing pass goes.

The parameters stay the three projections' (their names cross to the Flax model); ``qkv_product`` and
``project_qkv`` take the one product only where nothing hooks the projections' own calls (our FSDP with per-layer
units or a compute dtype does).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent pairs (2k, 2k+1) of x's last dim by the angles whose cos and sin are given
    (broadcasting against x's pairs), in at least float32; the result has x's dtype."""
    wide = x.to(torch.promote_types(x.dtype, cos.dtype))
    x_even, x_odd = wide[..., 0::2], wide[..., 1::2]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2)
    # No `.to` that returns its input: torch 2.11 compiled an autograd.Function whose forward ends in one (a
    # float32 model's rotation) into a zero gradient for x (measured, notes/flash_attention.md, session 7).
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)


def check_tables(op: str, cos: torch.Tensor, sin: torch.Tensor, seq: int, d_head: int) -> None:
    """RoPE's tables cos, sin of ``op``'s inputs: (T, d_head / 2) each."""
    tables = (seq, d_head // 2)
    if tuple(cos.shape) != tables or tuple(sin.shape) != tables:
        raise ValueError(f"{op}: cos and sin must be (T, d_head / 2) = {tables}; "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}")


def check_pack_inputs(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """dq, dk, dv (B, T, H, d_head) alike, d_head even; cos, sin (T, d_head / 2)."""
    if dq.ndim != 4 or dk.shape != dq.shape or dv.shape != dq.shape or dq.shape[-1] % 2:
        raise ValueError(f"pack_rotated_grads: dq, dk, dv must be (B, T, H, d_head) alike with d_head even; got "
                         f"{tuple(dq.shape)}, {tuple(dk.shape)}, {tuple(dv.shape)}")
    if len({dq.dtype, dk.dtype, dv.dtype}) != 1:
        raise ValueError(f"pack_rotated_grads: dq, dk, dv must share a dtype; got {dq.dtype}, {dk.dtype}, {dv.dtype}")
    check_tables("pack_rotated_grads", cos, sin, dq.shape[1], dq.shape[-1])


def check_split_inputs(product: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int) -> int:
    """product (B, T, 3 H d_head), d_head even; cos, sin (T, d_head / 2); returns d_head."""
    width = product.shape[-1] if product.ndim == 3 else 0
    if n_heads < 1 or not width or width % (3 * n_heads) or width // (3 * n_heads) % 2:
        raise ValueError(f"rotate_split: the product must be (B, T, 3 x n_heads x d_head) with d_head even and "
                         f"positive; got {tuple(product.shape)} for {n_heads} heads")
    d_head = width // (3 * n_heads)
    check_tables("rotate_split", cos, sin, product.shape[1], d_head)
    if len({product.device, cos.device, sin.device}) != 1:
        raise ValueError(f"rotate_split: the product and the tables must share a device; got {product.device}, "
                         f"{cos.device}, {sin.device}")
    return d_head


@torch.library.custom_op("torch_impl::rotate_split", mutates_args=())
def rotate_split(product: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (B, T, 3 d) product of x and [W_q; W_k; W_v] -> q, k, v, each (B, T, H, d_head) in an allocation of its
    own: q and k rotated by RoPE (tables cos, sin of shape (T, d_head / 2)), v as it is. v is copied, not a view: the
    attention saves it for its backward, and a view would keep the whole product alive beside q and k (2.5 GB more at
    xl 4 x 2,048, notes/train_step.md session 45). PyTorch's ops here; one Triton kernel on CUDA, where Inductor
    wrote RoPE at half the copy bandwidth and copied v in a kernel of its own (session 46)."""
    check_split_inputs(product, cos, sin, n_heads)
    q, k, v = product.unflatten(-1, (3, n_heads, -1)).unbind(2)
    cos, sin = cos[:, None], sin[:, None]  # (T, 1, d/2): broadcast over the heads
    return (rotate_pairs(q, cos, sin).contiguous(), rotate_pairs(k, cos, sin).contiguous(),
            v.clone(memory_format=torch.contiguous_format))  # never the input's storage (one row: v is contiguous)


@rotate_split.register_kernel("cuda")
def _(product, cos, sin, n_heads):
    from torch_impl.qkv_pack_triton import launch_split  # Triton on first use: it reads TRITON_INTERPRET on import

    check_split_inputs(product, cos, sin, n_heads)
    return launch_split(product, cos, sin, n_heads)


@rotate_split.register_fake
def _(product, cos, sin, n_heads):
    d_head = check_split_inputs(product, cos, sin, n_heads)
    batch, seq, _ = product.shape
    return tuple(product.new_empty(batch, seq, n_heads, d_head) for _ in range(3))


def _setup_tables(ctx, inputs, output) -> None:
    """Keep RoPE's tables (the inputs after the first ones) for the backward of either op."""
    ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)][-2:])


def _split_backward(ctx, dq, dk, dv):
    """``rotate_split``'s adjoint: the three gradients packed back into the product's, dq and dk rotated back."""
    cos, sin = ctx.saved_tensors
    return torch.ops.torch_impl.pack_rotated_grads(dq, dk, dv, cos, sin).flatten(2), None, None, None


rotate_split.register_autograd(_split_backward, setup_context=_setup_tables)


@torch.library.custom_op("torch_impl::pack_rotated_grads", mutates_args=())
def pack_rotated_grads(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """dq, dk, dv (B, T, H, d_head) -> (B, T, 3, H, d_head): dq and dk rotated by minus RoPE's angles (tables
    cos, sin of shape (T, d_head / 2)), dv as it is. PyTorch's ops here; one Triton kernel on CUDA."""
    check_pack_inputs(dq, dk, dv, cos, sin)
    cos, minus_sin = cos[:, None], -sin[:, None]  # (T, 1, d/2): broadcast over the heads
    return torch.stack((rotate_pairs(dq, cos, minus_sin), rotate_pairs(dk, cos, minus_sin), dv), dim=2)


@pack_rotated_grads.register_kernel("cuda")
def _(dq, dk, dv, cos, sin):
    from torch_impl.qkv_pack_triton import launch_pack  # Triton on first use: it reads TRITON_INTERPRET on import

    check_pack_inputs(dq, dk, dv, cos, sin)
    return launch_pack(dq, dk, dv, cos, sin)


@pack_rotated_grads.register_fake
def _(dq, dk, dv, cos, sin):
    check_pack_inputs(dq, dk, dv, cos, sin)
    batch, seq, n_heads, d_head = dq.shape
    return dq.new_empty(batch, seq, 3, n_heads, d_head)


def _pack_backward(ctx, grad):
    """``pack_rotated_grads``' adjoint: the packed gradient split, dq and dk rotated forward (``rotate_split``)."""
    cos, sin = ctx.saved_tensors
    return (*torch.ops.torch_impl.rotate_split(grad.flatten(2), cos, sin, grad.shape[3]), None, None)


pack_rotated_grads.register_autograd(_pack_backward, setup_context=_setup_tables)


AUTOCAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (never float64)
GRADIENT_ALIGN = 16  # elements: each weight's gradient starts at a multiple (MasterAdamW's kernel needs it)


def _autocast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """t as F.linear under autocast to ``dtype`` (None: autocast off) would take it."""
    return t.to(dtype) if dtype is not None and t.dtype in AUTOCAST_DTYPES else t


class QKVProduct(torch.autograd.Function):
    """(x, W_q, W_k, W_v) -> x [W_q; W_k; W_v]^T (B, T, 3d): the three projections as one product. Under autocast x
    and the weights are cast as F.linear casts them. Backward: the input's and the weights' gradients as one GEMM
    each, from the product's gradient (``pack_rotated_grads``'s, through ``rotate_split``'s autograd, or that of an
    attention of the product: ``registry.get_packed_attention``).

    Saved as three products save them: x once (they kept a cast copy each under autocast), and under autocast the
    weights' cast copy (here one, concatenated), else the weights themselves, concatenated again in the backward,
    so that a wrapper that frees gathered weights after the forward and gathers them again (our FSDP, FSDP2) does
    (a saved concatenation would keep every block's whole weight alive on every rank). The backward concatenates
    their transposes, which compiled is no op the forward ran: the partitioner then saves the weights, where it saved
    the forward's concatenation for a backward that repeated it."""

    @staticmethod
    def forward(ctx, x, w_q, w_k, w_v):
        ctx.dtypes = x.dtype, w_q.dtype
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        x, weight = _autocast(x, dtype), _autocast(torch.cat((w_q, w_k, w_v)), dtype)  # weight (3d, d)
        cast = weight.dtype != w_q.dtype
        ctx.save_for_backward(x, *((weight,) if cast else (w_q, w_k, w_v)))
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dx = (dy @ transposed_weights(weights).T).to(x_dtype) if ctx.needs_input_grad[0] else None
        dws = split_weight_grad((dy.flatten(0, 1).T @ x.flatten(0, 1)).to(w_dtype)) if any(
            ctx.needs_input_grad[1:4]) else (None,) * 3
        return (dx, *dws)


def transposed_weights(weights: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[W_q; W_k; W_v]^T (d, 3d) from the weights (or their one (3d, d) concatenation), for the product's input
    gradient dy @ it.T: on these transposes concatenated, not on a (3d, d) cat, which compiled would be shared with
    the forward's and saved in place of the weights (AOTAutograd's partitioner; a sharding wrapper could not free it),
    and cuBLAS runs dx on this column-major weight faster than on its rows: 0.197 against 0.204 ms at xl 4 x 2,048 on
    an H200 (scripts/gemm_probe.py; notes/train_step.md, session 47), 0.186 against 0.208 in the step (session 54).
    Compiled, Inductor writes the concatenation in one kernel (0.45 ms a step at xl); eager, PyTorch's cat of
    transposes takes 7x that."""
    return weights[0].T if len(weights) == 1 else torch.cat([w.T for w in weights], dim=1)


def split_weight_grad(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (3d, d) gradient of [W_q; W_k; W_v] as the three weights' gradients: views of it, or each its own
    allocation where a view would start unaligned (MasterAdamW's kernel needs GRADIENT_ALIGN)."""
    grads = grad.chunk(3)
    return tuple(g.clone() for g in grads) if grads[0].numel() % GRADIENT_ALIGN else grads


def qkv_weights(projections: tuple[nn.Module, nn.Module, nn.Module]) -> tuple[torch.Tensor, ...] | None:
    """The three projections' weights, or None where a projection's call is hooked (then each module is to be
    called as it is: ``project_qkv``)."""
    return None if any(_hooked(p) for p in projections) else tuple(p.weight for p in projections)


def _hooked(module: nn.Module) -> bool:
    """Does anything hook this module's calls or its backward (its own hooks, or every module's)?"""
    from torch.nn.modules import module as module_hooks

    return bool(module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
                or module._backward_hooks or module_hooks._global_forward_pre_hooks
                or module_hooks._global_forward_hooks or module_hooks._global_backward_pre_hooks
                or module_hooks._global_backward_hooks)


def qkv_product(x: torch.Tensor, projections: tuple[nn.Module, nn.Module, nn.Module]) -> torch.Tensor | None:
    """x [W_q; W_k; W_v]^T (B, T, 3d) of x (B, T, d) by the three projection modules' weights as one product
    (``QKVProduct``), or None where a projection's call is hooked (then each module is to be called as it is)."""
    weights = qkv_weights(projections)
    return None if weights is None else QKVProduct.apply(x, *weights)


def project_qkv(x: torch.Tensor, projections: tuple[nn.Module, nn.Module, nn.Module], n_heads: int,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, T, H, d_head) of x (B, T, d) by the three projection modules, q and k rotated by RoPE's tables
    cos, sin (T, d_head / 2): one product (``qkv_product``) split by ``rotate_split`` unless a projection's call is
    hooked, then each module called as it is."""
    product = qkv_product(x, projections)
    if product is None:
        q, k, v = (p(x).unflatten(-1, (n_heads, -1)) for p in projections)
        return Rotate.apply(q, cos, sin), Rotate.apply(k, cos, sin), v
    return torch.ops.torch_impl.rotate_split(product, cos, sin, n_heads)


class Rotate(torch.autograd.Function):
    """RoPE of q or k (B, T, H, d_head) by tables cos, sin (T, d_head / 2), its backward written out: the rotation
    by minus the angle, the same formula at the same precision. Autograd's own backward of the stack and slices
    made Inductor write one of dq, dk in float32 and cast it in a kernel of its own (1.1 ms a step at xl 4 x 2,048;
    notes/train_step.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate_pairs(x, cos[:, None], sin[:, None])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return rotate_pairs(grad, cos[:, None], -sin[:, None]), None, None
