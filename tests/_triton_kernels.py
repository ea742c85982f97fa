"""A small but real Triton kernel for the smoke tests: row-wise softmax over column blocks.

Used by ``tests/test_smoke_triton.py``, which runs this module as a script in a subprocess
(``python -m tests._triton_kernels --device cpu|cuda ...``) so that ``TRITON_INTERPRET`` is decided before
``triton`` is first imported, whatever order pytest imports test modules in.

Reads top to bottom like the real kernel files: the Triton kernel -> a launcher that checks shapes/dtypes
and allocates the output -> a self-check (``main``) that compares against a float64 torch reference on
fresh random inputs and prints one JSON line.

The kernel walks each row in blocks of ``BLOCK_N`` columns with an online (running max, running sum)
pass and then a write pass, so a row longer than one block and a ragged last block both exercise the
loop bound and the mask. ``BUG`` (a constexpr) selects deliberately broken variants so the test can
prove its checker catches them:

* ``BUG_NONE``          -- the correct kernel;
* ``BUG_FLOOR_BLOCKS``  -- ``n_cols // BLOCK_N`` blocks instead of ``cdiv`` (drops the ragged tail);
* ``BUG_PAD_ZERO``      -- masked lanes padded with 0 instead of -inf (they leak into the denominator).

Both bugs are invisible when ``n_cols`` is a multiple of ``BLOCK_N``; the test uses ragged sizes.
Caveat: a single row must fit the float32 running sum (fine for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

BUG_NONE = 0
BUG_FLOOR_BLOCKS = 1
BUG_PAD_ZERO = 2

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _softmax_rows_kernel(
    x_ptr,  # (n_rows, n_cols), last dim contiguous
    y_ptr,  # (n_rows, n_cols), last dim contiguous
    n_cols,
    stride_x_row,
    stride_y_row,
    BLOCK_N: tl.constexpr,
    BUG: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x_row
    y_row = y_ptr + row.to(tl.int64) * stride_y_row
    if BUG == 1:  # BUG_FLOOR_BLOCKS
        n_blocks = n_cols // BLOCK_N
    else:
        n_blocks = tl.cdiv(n_cols, BLOCK_N)
    if BUG == 2:  # BUG_PAD_ZERO
        pad = 0.0
    else:
        pad = float("-inf")

    # Pass 1: running max m and running sum l of exp(x - m), in float32.
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.full((), 0.0, tl.float32)
    for b in range(0, n_blocks):
        cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=pad).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new

    # Pass 2: write exp(x - m) / l.
    for b in range(0, n_blocks):
        cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=pad).to(tl.float32)
        y = tl.exp(x - m) / l
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def softmax_rows(x: torch.Tensor, block_n: int = 32, bug: int = BUG_NONE) -> torch.Tensor:
    """Softmax over the last dim of a 2-D tensor ``x`` (n_rows, n_cols); returns a new tensor of x's dtype.

    Accumulates in float32 whatever the input dtype. ``x`` may have any row stride (e.g. a column slice)
    but its last dim must be contiguous. Output rows of a broken variant (``bug != 0``) may be left
    uninitialised where the bug skips them; the output is zero-filled so that is deterministic.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (n_rows, n_cols), got shape {tuple(x.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"x.dtype must be one of {_SUPPORTED_DTYPES}, got {x.dtype}")
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        raise ValueError(f"x must be non-empty, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"x's last dim must be contiguous, got strides {x.stride()}")
    if block_n <= 0 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a positive power of two, got {block_n}")
    if bug not in (BUG_NONE, BUG_FLOOR_BLOCKS, BUG_PAD_ZERO):
        raise ValueError(f"unknown bug variant {bug}")
    y = torch.zeros((n_rows, n_cols), dtype=x.dtype, device=x.device)  # (n_rows, n_cols)
    _softmax_rows_kernel[(n_rows,)](x, y, n_cols, x.stride(0), y.stride(0), BLOCK_N=block_n, BUG=bug)
    return y


# --------------------------------------------------------------------------------------------------------
# Self-check, run as ``python -m tests._triton_kernels`` by tests/test_smoke_triton.py.
# --------------------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _check(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> dict:
    """Compare y against a float64 torch softmax of the same (already quantised) input x."""
    ref = torch.softmax(x.double().cpu(), dim=-1)
    got = y.double().cpu()
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    return {
        "ok": bool(torch.isfinite(got).all() and (err <= bound).all()),
        "max_abs_err": float(err.max()),
        "max_err_over_bound": float((err / bound).max()),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--dtypes", default="float32", help="comma-separated: float32,float16,bfloat16")
    p.add_argument("--rtol", type=float, nargs="+", required=True, help="one per dtype")
    p.add_argument("--atol", type=float, default=1e-7)
    args = p.parse_args()

    gen = torch.Generator().manual_seed(args.seed)
    block_n = 32
    # Ragged on purpose: several blocks with a short tail, an exact multiple, a row shorter than a block.
    shapes = [(5, 77), (3, 64), (4, 7), (2, 33)]
    dtypes = args.dtypes.split(",")
    if len(args.rtol) != len(dtypes):
        raise SystemExit("need one --rtol per dtype")

    out = {"interpret": os.environ.get("TRITON_INTERPRET", "") == "1", "seed": args.seed, "cases": []}
    for dtype_name, rtol in zip(dtypes, args.rtol):
        dtype = _DTYPES[dtype_name]
        for n_rows, n_cols in shapes:
            # 3x wider than needed and sliced, so the row stride differs from n_cols.
            wide = (2.0 * torch.randn(n_rows, 3 * n_cols, generator=gen)).to(dtype).to(args.device)
            x = wide[:, n_cols : 2 * n_cols]  # (n_rows, n_cols), row stride 3 * n_cols
            for bug in (BUG_NONE, BUG_FLOOR_BLOCKS, BUG_PAD_ZERO):
                y = softmax_rows(x, block_n=block_n, bug=bug)
                res = _check(x, y, rtol=rtol, atol=args.atol)
                res.update(
                    dtype=dtype_name,
                    shape=[n_rows, n_cols],
                    ragged=n_cols % block_n != 0,
                    bug=bug,
                    out_dtype=str(y.dtype).removeprefix("torch."),
                    out_device=y.device.type,
                )
                out["cases"].append(res)

    # The launcher must reject bad inputs before launching anything.
    rejected = []
    bad_inputs = [
        torch.zeros(4, device=args.device),  # 1-D
        torch.zeros(2, 3, dtype=torch.int32, device=args.device),  # int dtype
        torch.zeros(3, 4, device=args.device).t(),  # last dim not contiguous
    ]
    for bad in bad_inputs:
        try:
            softmax_rows(bad)
            rejected.append(False)
        except (TypeError, ValueError):
            rejected.append(True)
    out["launcher_rejects_bad_inputs"] = rejected
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
