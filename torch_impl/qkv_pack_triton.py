"""The Triton kernels of ``torch_impl.qkv_projection``, each one pass at the copy bandwidth: ``rotate_split`` (the
forward) q and k of the one q, k, v product rotated by RoPE and v, each into a (B, T, H, d_head) tensor of its own;
``pack_rotated_grads`` (the backward) dq and dk rotated back and dv, packed side by side as the product's
(B, T, 3, H, d_head) gradient; ``launch_rotate_back``, dq or dk rotated back (and scaled) from any layout into any,
in place too: what the FlashAttention backward that writes the product's gradient itself
(``flash_triton.flash_backward_packed``) leaves of that packing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotated_back(x, cos, sin):
    """A (rows, d_head) tile of dq or dk rotated by minus RoPE's angles (tables (rows, d_head / 2)) in the tables'
    precision: even column x_2k cos + x_2k+1 sin, odd column x_2k+1 cos - x_2k sin."""
    x_even, x_odd = tl.split(tl.reshape(x.to(cos.dtype), (x.shape[0], x.shape[1] // 2, 2)))
    rotated = tl.join(x_even * cos + x_odd * sin, x_odd * cos - x_even * sin)
    return tl.reshape(rotated, x.shape)


@triton.jit
def _head_tile(src, batch, position, head, stride_b, stride_t, stride_h, cols, mask):
    """The (rows, d_head) tile of one head of a (B, T, H, d_head) tensor of these strides (last dim contiguous)."""
    return tl.load(src + (batch * stride_b + position * stride_t + head * stride_h)[:, None] + cols[None, :], mask=mask)


@triton.jit
def _program_rows(cos, sin, n_rows, seq, table_t, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """This program's rows (b, t) and head, as (rows, head, batch, position, cols, mask, cos, sin): int64 rows (offsets
    may pass 2^31), the (rows, d_head) tile's mask, and RoPE's tables' (rows, d_head / 2) tiles at the positions."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    batch, position = rows // seq, rows % seq
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < HEAD_DIM)[None, :]
    pairs = tl.arange(0, BLOCK_D // 2)
    table = position[:, None] * table_t + pairs[None, :]
    table_mask = (rows < n_rows)[:, None] & (pairs < HEAD_DIM // 2)[None, :]
    return (rows, tl.program_id(1), batch, position, cols, mask, tl.load(cos + table, mask=table_mask),
            tl.load(sin + table, mask=table_mask))


@triton.jit
def _pack_kernel(dq, dk, dv, cos, sin, out, n_rows, seq, n_heads,
                 q_b, q_t, q_h, k_b, k_t, k_h, v_b, v_t, v_h, table_t,
                 HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head of BLOCK_ROWS rows (b, t): out[b, t, :, head] = (dq rotated back, dk rotated back, dv)."""
    rows, head, batch, position, cols, mask, cos_tile, sin_tile = _program_rows(
        cos, sin, n_rows, seq, table_t, HEAD_DIM, BLOCK_ROWS, BLOCK_D)
    row_width = n_heads * HEAD_DIM
    dst = out + (rows * 3 * row_width + head * HEAD_DIM)[:, None] + cols[None, :]
    q_tile = _head_tile(dq, batch, position, head, q_b, q_t, q_h, cols, mask)
    tl.store(dst, _rotated_back(q_tile, cos_tile, sin_tile).to(out.dtype.element_ty), mask=mask)
    k_tile = _head_tile(dk, batch, position, head, k_b, k_t, k_h, cols, mask)
    tl.store(dst + row_width, _rotated_back(k_tile, cos_tile, sin_tile).to(out.dtype.element_ty), mask=mask)
    tl.store(dst + 2 * row_width, _head_tile(dv, batch, position, head, v_b, v_t, v_h, cols, mask), mask=mask)


@triton.jit
def _rotate_back_kernel(src, dst, cos, sin, n_rows, seq, n_heads, s_b, s_t, s_h, d_b, d_t, d_h, table_t, scale,
                        HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head of BLOCK_ROWS rows (b, t): dst[b, t, head] = src[b, t, head] * scale rotated by minus RoPE's angles,
    in the tables' precision (at least src's: ``launch_rotate_back``), rounded once to dst's dtype (src and dst (B, T, H, d_head) of any strides, the last
    contiguous; the same tensor: in place, each element read by the program that writes it)."""
    rows, head, batch, position, cols, mask, cos_tile, sin_tile = _program_rows(
        cos, sin, n_rows, seq, table_t, HEAD_DIM, BLOCK_ROWS, BLOCK_D)
    tile = _head_tile(src, batch, position, head, s_b, s_t, s_h, cols, mask).to(cos.dtype.element_ty) * scale
    out = dst + (batch * d_b + position * d_t + head * d_h)[:, None] + cols[None, :]
    tl.store(out, _rotated_back(tile, cos_tile, sin_tile).to(dst.dtype.element_ty), mask=mask)


PACK_BLOCK_ROWS = 64  # rows (b, t) of one head a program: 3 x 64 x d_head elements in and out


def _tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's tables, contiguous, in the precision ``rotate_pairs`` computes in: the wider of theirs and ``dtype``."""
    wide = torch.promote_types(cos.dtype, dtype)
    return cos.to(wide).contiguous(), sin.to(wide).contiguous()


@triton.jit
def _split_kernel(product, cos, sin, q, k, v, n_rows, seq, n_heads, stride_b, stride_t, table_t,
                  HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head of BLOCK_ROWS rows (b, t) of the (B, T, 3 d) product: q and k rotated by RoPE's angles (the rotation
    back by minus them), v as it is, each into its contiguous (B, T, H, d_head) output."""
    rows, head, batch, position, cols, mask, cos_tile, sin_tile = _program_rows(
        cos, sin, n_rows, seq, table_t, HEAD_DIM, BLOCK_ROWS, BLOCK_D)
    row_width = n_heads * HEAD_DIM
    dst = (rows * row_width + head * HEAD_DIM)[:, None] + cols[None, :]
    q_tile = _head_tile(product, batch, position, head, stride_b, stride_t, HEAD_DIM, cols, mask)
    tl.store(q + dst, _rotated_back(q_tile, cos_tile, -sin_tile).to(q.dtype.element_ty), mask=mask)
    k_tile = _head_tile(product + row_width, batch, position, head, stride_b, stride_t, HEAD_DIM, cols, mask)
    tl.store(k + dst, _rotated_back(k_tile, cos_tile, -sin_tile).to(k.dtype.element_ty), mask=mask)
    v_tile = _head_tile(product + 2 * row_width, batch, position, head, stride_b, stride_t, HEAD_DIM, cols, mask)
    tl.store(v + dst, v_tile, mask=mask)


def launch_split(product: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton split (a (B, T, 3 d) product of any strides whose last dim is contiguous)."""
    batch, seq, width = product.shape
    d_head = width // (3 * n_heads)
    product = product if product.stride(-1) == 1 else product.contiguous()
    cos, sin = _tables(cos, sin, product.dtype)
    q, k, v = (product.new_empty(batch, seq, n_heads, d_head) for _ in range(3))
    n_rows = batch * seq
    grid = (triton.cdiv(n_rows, PACK_BLOCK_ROWS), n_heads)
    _split_kernel[grid](product, cos, sin, q, k, v, n_rows, seq, n_heads, *product.stride()[:2], cos.stride(0),
                        HEAD_DIM=d_head, BLOCK_ROWS=PACK_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(d_head))
    return q, k, v


def launch_pack(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """The Triton packing (any strides of dq, dk, dv whose last dim is contiguous)."""
    batch, seq, n_heads, d_head = dq.shape
    dq, dk, dv = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv))
    cos, sin = _tables(cos, sin, dq.dtype)
    out = dq.new_empty(batch, seq, 3, n_heads, d_head)
    n_rows = batch * seq
    grid = (triton.cdiv(n_rows, PACK_BLOCK_ROWS), n_heads)
    _pack_kernel[grid](dq, dk, dv, cos, sin, out, n_rows, seq, n_heads,
                       *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], cos.stride(0),
                       HEAD_DIM=d_head, BLOCK_ROWS=PACK_BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(d_head))
    return out


def launch_rotate_back(src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       scale: float = 1.0) -> None:
    """dst = src * scale rotated by minus RoPE's angles (tables cos, sin (T, d_head / 2)), src and dst (B, T, H,
    d_head) of any strides whose last dim is contiguous (the same tensor: in place), computed in the widest of the
    tables', src's and dst's precisions and rounded once to dst's dtype."""
    batch, seq, n_heads, d_head = dst.shape
    if src.shape != dst.shape or src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError(f"launch_rotate_back: src and dst must be (B, T, H, d_head) alike, the last dim contiguous; "
                         f"got {tuple(src.shape)} strides {src.stride()}, {tuple(dst.shape)} strides {dst.stride()}")
    cos, sin = _tables(cos, sin, torch.promote_types(src.dtype, dst.dtype))
    n_rows = batch * seq
    grid = (triton.cdiv(n_rows, PACK_BLOCK_ROWS), n_heads)
    _rotate_back_kernel[grid](src, dst, cos, sin, n_rows, seq, n_heads, *src.stride()[:3], *dst.stride()[:3],
                              cos.stride(0), scale, HEAD_DIM=d_head, BLOCK_ROWS=PACK_BLOCK_ROWS,
                              BLOCK_D=triton.next_power_of_2(d_head))
