"""FlashAttention-2 in plain PyTorch: the readable reference for the Triton kernel (``flash_triton.py``).

``FlashAttention2Torch.apply(q, k, v, is_causal=False)`` computes softmax(q k^T / sqrt(d) + mask) v tile by
tile, as Algorithm 1 (forward) and Algorithm 2 (backward) of Dao 2023 describe, and never materializes the
(n_queries, n_keys) score matrix: the forward keeps a running row maximum ``m`` and row sum ``l`` (the online
softmax, Milakov & Gimelshein 2018) and saves only the output O and one log-sum-exp row statistic
L = m + log(l); the backward recomputes each probability tile P = exp(S - L) from L.

Shapes: q is (..., H, n_q, d), k and v are (..., H_kv, n_k, d) with the same leading dims (no broadcasting);
the leading dims are flattened into one batch axis N inside. H_kv may divide H (grouped-query attention, as in
``FlashAttention2Triton`` and SDPA's ``enable_gqa``): query head h reads key/value head h // (H / H_kv), and dK,
dV sum over each group (k and v are expanded to H heads inside; a reference, not a memory saving). Any lengths work: the last tile of each axis is
simply shorter (ragged tiles are slices, no padding). n_q may differ from n_k. With ``is_causal`` the mask is
top-left aligned, as in the CS336 reference and ``torch_impl.attention.naive``: query i sees keys j <= i, so
every query sees at least key 0 and no row is empty.

Saved for backward, in this order: ``ctx.save_for_backward(L, q, k, v, o)``; L comes FIRST and is the only
tensor shaped (..., n_q). L is float32 for float32/bfloat16/float16 inputs and float64 for float64 inputs.

References:
  * T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023
    (arXiv:2307.08691), Algorithm 1 (forward) and Algorithm 2 (backward, with D = rowsum(dO * O)).
  * T. Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", 2022.
  * Stanford CS336 (2025) assignment 2, the FlashAttention-2 part (interface and top-left causal mask).

Caveats:
  * This is a reference, not a fast kernel: Python loops over tiles, one small matmul per tile pair.
    It is O(n) in extra memory (tile-sized blocks plus the fp32 dQ accumulator) but slow.
  * Compute precision: tiles are upcast to float32 (float64 for float64 inputs), so bf16/fp16 inputs
    get exact products with fp32 accumulation, like the tensor-core kernel, but P stays fp32 in P V
    (a Triton kernel usually casts P to the input dtype first, so it is slightly less accurate).
    The output and the gradients are cast back to the input dtype.
  * The backward uses the saved (input-dtype) O in D = rowsum(dO * O), as FA2 does.
  * No dropout, no attention bias, no sliding window.
  * Not ``torch.compile``d: CPU tests must not need a C compiler.
"""

from __future__ import annotations

import math

import torch

from torch_impl.attention.registry import register_attention

# Tile sizes (rows of Q per tile, rows of K/V per tile). 64 x 64 follows the paper's B_r x B_c sketch and
# keeps each tile matmul big enough that the Python loop is not the only cost on a CPU.
Q_TILE = 64
K_TILE = 64

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_HEAD_DIM = 256


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (a reference); everything narrower computes and keeps statistics in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a ValueError saying what is wrong, or return if q, k, v are a valid attention input."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., n, d), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has unsupported dtype {t.dtype}; supported: "
                             f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.ndim == k.ndim == v.ndim and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]
            and k.shape[:-2] == v.shape[:-2]):
        raise ValueError("q, k, v must have the same leading (batch) dims, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.ndim >= 3 and (k.shape[-3] == 0 or q.shape[-3] % k.shape[-3] != 0):
        raise ValueError(f"q has {q.shape[-3]} heads (dim -3) and k, v {k.shape[-3]}; accepted: a number of "
                         "query heads that is a multiple of the key/value heads (grouped-query attention)")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError("q, k, v must have the same head dim (last dim), got "
                         f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length (dim -2), got {k.shape[-2]} and {v.shape[-2]}")
    d = q.shape[-1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if k.shape[-2] == 0:
        raise ValueError("need at least one key (k and v have length 0): softmax over no keys is undefined")


def _causal_tile_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, device) -> torch.Tensor | None:
    """(Bq, Bk) bool, True where key j is in the future of query i (j > i), or None if no entry is masked."""
    if k_stop - 1 <= q_start:  # the whole tile is on or below the diagonal
        return None
    rows = torch.arange(q_start, q_stop, device=device)[:, None]  # (Bq, 1)
    cols = torch.arange(k_start, k_stop, device=device)[None, :]  # (1, Bk)
    return cols > rows


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  q_tile: int = Q_TILE, k_tile: int = K_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1. q (N, n_q, d), k and v (N, n_k, d) -> O (N, n_q, d) in q's dtype, L (N, n_q) fp32/fp64."""
    batch, n_q, d = q.shape
    n_k = k.shape[1]
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)  # (N, n_q, d)
    lse = torch.empty(batch, n_q, dtype=cdt, device=q.device)  # (N, n_q)
    for q0 in range(0, n_q, q_tile):
        q1 = min(q0 + q_tile, n_q)
        q_i = q[:, q0:q1].to(cdt)  # (N, Bq, d)
        o_i = torch.zeros(batch, q1 - q0, d, dtype=cdt, device=q.device)  # unnormalized output (N, Bq, d)
        l_i = torch.zeros(batch, q1 - q0, dtype=cdt, device=q.device)  # running row sum (N, Bq)
        m_i = torch.full((batch, q1 - q0), float("-inf"), dtype=cdt, device=q.device)  # running row max
        # Causal: key tiles that start after this tile's last query are fully masked; skip them. Key tile 0
        # always comes first and every query sees key 0, so m_i is finite after the first step (no NaN).
        k_stop = min(n_k, q1) if is_causal else n_k
        for k0 in range(0, k_stop, k_tile):
            k1 = min(k0 + k_tile, n_k)
            k_j, v_j = k[:, k0:k1].to(cdt), v[:, k0:k1].to(cdt)  # (N, Bk, d)
            s = q_i @ k_j.transpose(1, 2) * scale  # (N, Bq, Bk)
            if is_causal and (mask := _causal_tile_mask(q0, q1, k0, k1, q.device)) is not None:
                s = s.masked_fill(mask, float("-inf"))
            m_new = torch.maximum(m_i, s.amax(dim=-1))  # (N, Bq)
            p = torch.exp(s - m_new[..., None])  # (N, Bq, Bk), unnormalized probabilities
            alpha = torch.exp(m_i - m_new)  # (N, Bq), rescales what was accumulated under the old max
            l_i = alpha * l_i + p.sum(dim=-1)
            o_i = alpha[..., None] * o_i + p @ v_j  # (N, Bq, d)
            m_i = m_new
        out[:, q0:q1] = (o_i / l_i[..., None]).to(q.dtype)
        lse[:, q0:q1] = m_i + torch.log(l_i)
    return out, lse


def flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, is_causal: bool, q_tile: int = Q_TILE, k_tile: int = K_TILE
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 2. q, o, grad_out (N, n_q, d), k, v (N, n_k, d), lse (N, n_q) -> dq, dk, dv in input dtypes."""
    batch, n_q, d = q.shape
    n_k = k.shape[1]
    cdt = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d)
    lse = lse.to(cdt)
    delta = (grad_out.to(cdt) * o.to(cdt)).sum(dim=-1)  # D = rowsum(dO * O), (N, n_q)
    dq = torch.zeros(batch, n_q, d, dtype=cdt, device=q.device)  # accumulated over key tiles (N, n_q, d)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    for k0 in range(0, n_k, k_tile):  # outer loop over key tiles: dK_j, dV_j accumulate locally
        k1 = min(k0 + k_tile, n_k)
        k_j, v_j = k[:, k0:k1].to(cdt), v[:, k0:k1].to(cdt)  # (N, Bk, d)
        dk_j = torch.zeros_like(k_j)
        dv_j = torch.zeros_like(v_j)
        # Causal: query tiles that end before this key tile starts see none of it; start at the first that does.
        q_start = (k0 // q_tile) * q_tile if is_causal else 0
        for q0 in range(q_start, n_q, q_tile):
            q1 = min(q0 + q_tile, n_q)
            q_i = q[:, q0:q1].to(cdt)  # (N, Bq, d)
            do_i = grad_out[:, q0:q1].to(cdt)  # (N, Bq, d)
            s = q_i @ k_j.transpose(1, 2) * scale  # (N, Bq, Bk)
            if is_causal and (mask := _causal_tile_mask(q0, q1, k0, k1, q.device)) is not None:
                s = s.masked_fill(mask, float("-inf"))
            p = torch.exp(s - lse[:, q0:q1, None])  # recomputed probabilities (N, Bq, Bk); masked -> 0
            dv_j += p.transpose(1, 2) @ do_i  # dV_j += P^T dO_i
            dp = do_i @ v_j.transpose(1, 2)  # dP = dO_i V_j^T, (N, Bq, Bk)
            ds = p * (dp - delta[:, q0:q1, None])  # dS = P * (dP - D_i)
            dq[:, q0:q1] += ds @ k_j * scale  # dQ_i += dS K_j / sqrt(d)
            dk_j += ds.transpose(1, 2) @ q_i * scale  # dK_j += dS^T Q_i / sqrt(d)
        dk[:, k0:k1] = dk_j.to(k.dtype)
        dv[:, k0:k1] = dv_j.to(v.dtype)
    return dq.to(q.dtype), dk, dv


def _kv_group(q: torch.Tensor, k: torch.Tensor) -> int:
    """How many query heads share one key/value head (1 without grouped-query attention)."""
    return q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1


def _expand_heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """(..., H_kv, n, d) -> (..., H_kv * group, n, d): head h of the result is head h // group of t."""
    return t if group == 1 else t.repeat_interleave(group, dim=-3)


class FlashAttention2Torch(torch.autograd.Function):
    """FlashAttention-2 forward and backward, tiled, in PyTorch. ``.apply(q, k, v, is_causal=False)``.

    q (..., n_q, d), k and v (..., n_k, d) -> O (..., n_q, d) in the input dtype. Saves (L, q, k, v, O) with
    L (..., n_q) the row log-sum-exp of the scaled, masked scores (float32; float64 for float64 inputs).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        check_inputs(q, k, v)
        lead, n_q, n_k, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
        nb = math.prod(lead)  # leading dims flattened into one batch axis N (explicit: -1 fails for n == 0)
        group = _kv_group(q, k)
        k_all, v_all = _expand_heads(k, group), _expand_heads(v, group)  # (..., H, n_k, d)
        o, lse = flash_forward(q.reshape(nb, n_q, d), k_all.reshape(nb, n_k, d), v_all.reshape(nb, n_k, d),
                               bool(is_causal))
        o = o.reshape(*lead, n_q, d)  # (..., n_q, d)
        lse = lse.reshape(*lead, n_q)  # (..., n_q)
        ctx.save_for_backward(lse, q, k, v, o)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        lse, q, k, v, o = ctx.saved_tensors
        nb, n_q, n_k, d = math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1]
        group = _kv_group(q, k)
        k_all, v_all = _expand_heads(k, group), _expand_heads(v, group)
        dq, dk, dv = flash_backward(
            q.reshape(nb, n_q, d), k_all.reshape(nb, n_k, d), v_all.reshape(nb, n_k, d), o.reshape(nb, n_q, d),
            lse.reshape(nb, n_q), grad_out.reshape(nb, n_q, d), ctx.is_causal)
        # Grouped heads: (..., H_kv, group, n_k, d) summed over the group, in the compute dtype.
        dk, dv = (g.reshape(*t.shape[:-3], t.shape[-3], group, n_k, d).to(_compute_dtype(t.dtype)).sum(-3)
                  .to(t.dtype) if group > 1 else g for g, t in ((dk, k), (dv, v)))
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None


@register_attention("flash_torch")
def flash_torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
    """The model's backend: q (..., n_q, d), k and v (..., n_k, d) -> (..., n_q, d)."""
    return FlashAttention2Torch.apply(q, k, v, is_causal)


__all__ = ["FlashAttention2Torch", "flash_torch_attention", "flash_forward", "flash_backward", "check_inputs",
           "Q_TILE", "K_TILE"]
