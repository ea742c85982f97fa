"""The LM head and the cross-entropy fused, chunked over tokens: the mean loss of ``h W^T`` against the targets
without ever holding the (N, V) logits (issue 19 item 2; for lm8b at 2 x 32,768 tokens the plain loss's logits,
their fp32 copy and their gradient are tens of GB, notes/train_step.md).

``linear_cross_entropy(h, weight, targets, chunk_size=None, ignore_index=-100)`` equals
``F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=ignore_index)`` (``torch_impl.model``'s
``cross_entropy`` of the model's logits) in value and in its gradients with respect to h and weight:

* forward: for each chunk of ``chunk_size`` tokens, the chunk's logits ``h_c W^T`` (in the matmul's dtype, read
  in at least fp32, as the plain loss upcasts), their log-sum-exp (fp32, kept: N floats) and the target logits;
  the loss is the sum of ``lse - logit[target]`` over the tokens whose target is not ``ignore_index``, divided by
  their count (0 of them: NaN, as ``F.cross_entropy``).
* backward: each chunk's logits are recomputed, ``G = (softmax - onehot(target)) * grad / count`` (zero on
  ignored rows) is formed in fp32 and cast to the inputs' dtype (as autograd's backward of ``.float()`` casts
  it; on CUDA both chunk formulas are one compiled kernel each, ``_chunk_fn``), and ``dh_c = G W``,
  ``dW += G^T h_c`` (dW accumulated in at least fp32 over the chunks, cast to the weight's dtype at the end, each
  chunk's product added unrounded: ``_add_product``).

So the extra memory is one chunk's logits (``chunk x V``: the matmul's output, its fp32 copies in eager mode,
G in the input dtype) plus dW's accumulator, never ``N x V``. The price is one more ``N x V x d`` matmul (the backward's
recomputation: four products instead of three). ``DEFAULT_CHUNK_BYTES`` picks the chunk: the largest power of two
of tokens whose fp32 logits fit 512 MiB (lm8b, V = 151,936: 512 tokens, 311 MB).

Under autocast (``--dtype bf16``) h and the weight are cast to the autocast dtype first, exactly as autocast casts
``F.linear``'s inputs, so the logits are rounded as the plain path rounds them; inside the ops autocast is off.

Reads top to bottom: the chunk loops (plain PyTorch, any device) -> two custom ops,
``torch.ops.torch_impl.linear_cross_entropy_forward`` / ``_backward``, with fake implementations, opaque to
``torch.compile`` (no graph break, and Dynamo does not unroll the chunk loop: ~130 chunks for lm8b) ->
``LinearCrossEntropy``, the ``torch.autograd.Function`` that calls them -> ``linear_cross_entropy``, the checked
public entry point (what ``TransformerLM(loss="fused")`` calls through its LM head).

Caveats: targets must lie in [0, V) or equal ``ignore_index`` (an out-of-range target fails in the gather on a
CPU, a device-side assert on CUDA; no check, since one would synchronize with the device). The loss is the
mean only (``reduction="mean"``), no label smoothing, no z-loss. dW's fp32 accumulator is V x d x 4 bytes
(lm8b: 2.5 GB); on a CPU, with bf16 inputs, each chunk's G is widened to fp32 for that product (chunk x V x 4
bytes more).

References: Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models" (cut cross-entropy);
Liger-Kernel's ``FusedLinearCrossEntropy`` (chunked over tokens; it computes the gradients in the forward
instead of recomputing); PyTorch's "Python custom operators" tutorial.
"""

# No ``from __future__ import annotations``: the custom ops infer their schemas from real annotation objects.
import functools
import warnings

import torch
import torch.nn.functional as F

from parallelism_calc.memory import DEFAULT_LOSS_CHUNK_BYTES, LOSSES, default_loss_chunk

__all__ = ["DEFAULT_CHUNK_BYTES", "IGNORE_INDEX", "LOSSES", "LinearCrossEntropy", "default_chunk_size",
           "linear_cross_entropy"]

# The model's losses (``TransformerLM(loss=...)``, the CLIs' ``--loss``): plain = the LM head's logits, then
# ``torch_impl.model.cross_entropy``; fused = ``linear_cross_entropy``, no logits (``LOSSES``, imported above: the
# calculator's vocabulary, which predicts their memory).
IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it count for nothing, in the loss or its mean
DEFAULT_CHUNK_BYTES = DEFAULT_LOSS_CHUNK_BYTES  # one chunk's fp32 logits at most this (see default_chunk_size)


def default_chunk_size(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits (chunk x V x 4 bytes) fit ``chunk_bytes``,
    at least 1. lm8b (V = 151,936): 512 tokens, 311 MB. The formula lives in ``parallelism_calc.memory``
    (``default_loss_chunk``), whose memory prediction of this loss uses it too."""
    return default_loss_chunk(vocab_size, chunk_bytes)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # at least fp32: fp64 stays fp64


# ----------------------------------------------------------------------------------------- one chunk's math


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, wide: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, target logit) of each row of ``logits`` (c, V), read as ``wide`` (the plain loss's .float())."""
    x = logits.to(wide)
    return torch.logsumexp(x, dim=-1), x.gather(1, targets[:, None]).squeeze(1)


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                row_scale: torch.Tensor) -> torch.Tensor:
    """G = (softmax - onehot(target)) * row_scale in ``logits``' dtype (as autograd's backward of .float() casts it),
    from the chunk's logits (c, V); lse and row_scale (c,) in the dtype the softmax is computed in."""
    x = logits.to(lse.dtype)
    onehot = targets[:, None] == torch.arange(x.shape[1], device=x.device)
    return ((x - lse[:, None]).exp() - onehot.to(x.dtype)).mul(row_scale[:, None]).to(logits.dtype)


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _chunk_fn(fn, device: torch.device):
    """``fn`` compiled on CUDA: one kernel reading the chunk's logits once in their dtype, where eager PyTorch makes
    their fp32 copy and passes over it 4-5 times (~130 ms a step for lm8b's 32,768 tokens a GPU on an H200,
    notes/leaderboard.md); eager elsewhere (the same arithmetic, which the CPU tests check against float64)."""
    return _compiled(fn) if device.type == "cuda" else fn


# ----------------------------------------------------------------------------------------- the chunk loops


def _forward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
             ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, 0-dim, fp32 or wider; lse (N,), the same dtype): h (N, d), weight (V, d), targets (N,)."""
    n, wide = h.shape[0], _wide(h.dtype)
    lse = torch.empty(n, dtype=wide, device=h.device)
    total = torch.zeros((), dtype=wide, device=h.device)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0)
    stats = _chunk_fn(_chunk_stats, h.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        logits = F.linear(h[rows], weight)  # (c, V): the plain path's logits (read in fp32 by _chunk_stats)
        lse[rows], picked = stats(logits, safe_targets[rows], wide)
        total += torch.where(valid[rows], lse[rows] - picked, 0).sum()
        del logits
    return total / valid.sum(), lse


def _backward(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
              chunk_size: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh (N, d) in h's dtype, dW (V, d) in the weight's dtype) for the loss's gradient ``grad`` (0-dim)."""
    n, wide = h.shape[0], lse.dtype
    valid = targets != ignore_index
    # (N,): d loss / d (lse - picked); 0 on ignored rows (also when all are: F.cross_entropy's zero gradient)
    row_scale = torch.where(valid, grad.to(wide) / valid.sum(), 0)
    safe_targets = torch.where(valid, targets, 0)
    dh = torch.empty_like(h)
    dw = torch.zeros(weight.shape, dtype=_wide(weight.dtype), device=weight.device)
    grad_of = _chunk_fn(_chunk_grad, h.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(start + chunk_size, n))
        logits = F.linear(h[rows], weight)  # (c, V) recomputed, as the forward rounded it
        g = grad_of(logits, lse[rows], safe_targets[rows], row_scale[rows])  # (c, V) in h's dtype
        del logits
        torch.mm(g, weight, out=dh[rows])
        _add_product(dw, g.t(), h[rows])
        del g
    return dh, dw.to(weight.dtype)


# aten::addmm.dtype_out: cuBLAS writes the fp32 product of bf16/fp16 matrices (CUDA only; torch >= 2.8). Written
# without a GPU at hand: if this build refuses it, _add_product warns once and rounds the products instead.
_ADDMM_OUT_DTYPE = [hasattr(torch.ops.aten.addmm, "dtype_out")]


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in place: a and b in the inputs' dtype, acc in at least fp32, the product never rounded to the
    inputs' dtype (so dW is as accurate as the plain path's one product, which is rounded once, at its end):
    one addmm where the dtypes agree; on CUDA, cuBLAS's fp32 output of the bf16/fp16 product; elsewhere (CPU) the
    inputs widened first (their products are exact in fp32)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _ADDMM_OUT_DTYPE[0]:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except RuntimeError as err:  # its checks run on the host, before anything is written
            _ADDMM_OUT_DTYPE[0] = False
            warnings.warn(f"linear_cross_entropy: addmm(out_dtype=) refused ({str(err).splitlines()[0]}); dW's "
                          "per-chunk products are rounded to the inputs' dtype before the fp32 sum", stacklevel=2)
    if a.is_cuda:  # the product rounded to the inputs' dtype, then added (a V x d temporary)
        acc += a @ b
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


# ----------------------------------------------------------------------------------------- custom ops


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False)


@torch.library.custom_op("torch_impl::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                                 ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, per-token log-sum-exp) chunk by chunk; an opaque op to torch.compile."""
    with _no_autocast(h.device), torch.no_grad():
        return _forward(h, weight, targets, chunk_size, ignore_index)


@linear_cross_entropy_forward.register_fake
def _(h, weight, targets, chunk_size, ignore_index):
    wide = _wide(h.dtype)
    return h.new_empty((), dtype=wide), h.new_empty(h.shape[:1], dtype=wide)


@torch.library.custom_op("torch_impl::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                  lse: torch.Tensor, chunk_size: int,
                                  ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, dW) chunk by chunk, recomputing each chunk's logits."""
    with _no_autocast(h.device), torch.no_grad():
        return _backward(grad, h, weight, targets, lse, chunk_size, ignore_index)


@linear_cross_entropy_backward.register_fake
def _(grad, h, weight, targets, lse, chunk_size, ignore_index):
    return torch.empty_like(h), torch.empty_like(weight)


# ----------------------------------------------------------------------------------------- autograd


class LinearCrossEntropy(torch.autograd.Function):
    """``LinearCrossEntropy.apply(h, weight, targets, chunk_size, ignore_index)``: the mean cross-entropy of
    ``h W^T`` (h (N, d), weight (V, d), targets (N,) int64), chunked; saves h, weight, targets and the fp32
    log-sum-exp (N,), nothing V-sized. Unchecked: call ``linear_cross_entropy``."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                ignore_index: int) -> torch.Tensor:
        loss, lse = torch.ops.torch_impl.linear_cross_entropy_forward(h, weight, targets, chunk_size, ignore_index)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        dh, dw = torch.ops.torch_impl.linear_cross_entropy_backward(grad, h, weight, targets, lse, ctx.chunk_size,
                                                                    ctx.ignore_index)
        return dh, dw, None, None, None


# ----------------------------------------------------------------------------------------- public entry point


def _autocast_inputs(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h and weight as autocast would hand them to ``F.linear``: floating tensors other than fp64 cast to the
    autocast dtype of h's device, when autocast is on there; unchanged otherwise."""
    device_type = h.device.type
    if not torch.is_autocast_enabled(device_type):
        return h, weight
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype not in (dtype, torch.float64) else t

    return cast(h), cast(weight)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = None,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h W^T`` against ``targets``, never materialising them: h (..., d),
    weight (V, d) (the LM head's, tied or not), targets (...) integer, the same leading dims as h; ``chunk_size``
    tokens at a time (None: ``default_chunk_size(V)``); targets equal to ``ignore_index`` are left out of the
    loss and its mean. The result is 0-dim, fp32 (fp64 for fp64 inputs), and equals
    ``F.cross_entropy(F.linear(h, weight).float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index)``
    (module docstring). Bad shapes, dtypes or chunk sizes: ValueError, one line."""
    if weight.ndim != 2 or h.ndim < 1 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: h (..., d) and weight (V, d) must share d; got h "
                         f"{tuple(h.shape)}, weight {tuple(weight.shape)}")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: targets {tuple(targets.shape)} must be h's leading dims "
                         f"{tuple(h.shape[:-1])}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"linear_cross_entropy: targets must be integer token ids, got {targets.dtype}")
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0])
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size={chunk_size!r} must be an integer >= 1")
    h, weight = _autocast_inputs(h, weight)
    if h.dtype != weight.dtype or not h.is_floating_point():
        raise ValueError(f"linear_cross_entropy: h and weight must have one floating dtype, got {h.dtype} and "
                         f"{weight.dtype}")
    if h.device != weight.device or targets.device != h.device:
        raise ValueError(f"linear_cross_entropy: h, weight and targets must be on one device, got {h.device}, "
                         f"{weight.device}, {targets.device}")
    h2 = h.reshape(-1, h.shape[-1])  # (N, d)
    return LinearCrossEntropy.apply(h2, weight, targets.reshape(-1).long(), chunk_size, ignore_index)
