"""The Transformer LM in PyTorch, built from a ``ModelSpec``: the CS336 "basics" architecture.

token embedding -> n_layers x [x + attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm -> untied LM head.
Attention is causal multi-head self-attention with rotary position embeddings (RoPE, Su et al. 2021, on
adjacent pairs of features) and a backend chosen by name from ``torch_impl.attention``. No biases anywhere.
``model(token_ids)`` gives the logits; ``model(token_ids, targets)`` the mean cross-entropy, by the loss chosen at
construction (``loss=``, ``torch_impl.linear_cross_entropy.LOSSES``): "plain", ``cross_entropy`` of the logits, or
"fused", the LM head and the loss fused and chunked over tokens, never the (B, T, V) logits. SwiGLU's MLP runs
PyTorch's ops, or with ``mlp="gluon"`` (``MLPS``) our kernels with SwiGLU in the GEMMs' epilogues
(``torch_impl.swiglu_gluon``, sm_90 in bf16; PyTorch's ops elsewhere): the same parameters, the same function.

Single-device model code (like nanoGPT's model.py): parallelism is applied from outside by wrappers.
Parameter names are stable (``token_embeddings.weight``, ``layers.{i}.attn.q_proj.weight``, ...): they key
the numpy weight dicts that cross to the Flax model (``to_numpy_weights`` / ``load_numpy_weights``), with
linear weights in PyTorch's (out_features, in_features) layout.

References: CS336 assignment 1 (2025); Zhang & Sennrich 2019 (RMSNorm); Shazeer 2020 (SwiGLU).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from parallelism_calc.specs import ModelSpec
from torch_impl import nvtx
from torch_impl.attention import get_attention, get_packed_attention
from torch_impl.linear_cross_entropy import LOSSES, linear_cross_entropy
from torch_impl.qkv_projection import Rotate, project_qkv, qkv_weights

MLPS = ("torch", "gluon")  # SwiGLU's MLP: PyTorch's ops (compiled: Inductor's), or torch_impl.swiglu_gluon's op


class Linear(nn.Module):
    """y = x W^T without bias; W (out, in) ~ truncated normal, std sqrt(2 / (in + out)), cut at 3 std.

    The std is the untruncated normal's, as in ``trunc_normal_`` and the Flax model's
    ``jax.nn.initializers.truncated_normal``: the draws' own std is 0.98658 times it (tests/test_init_parity.py).
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (in_features + out_features))
        nn.init.trunc_normal_(self.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                chunk_size: int | None = None) -> torch.Tensor:
        """x (..., in) -> x W^T (..., out); with ``targets`` (x's leading dims), the mean cross-entropy of those
        logits instead, computed ``chunk_size`` tokens at a time without them (``linear_cross_entropy``: the LM
        head's fused loss, called through this module so that hooks on it, as our FSDP's gathering of the
        weight, see it)."""
        if targets is not None:
            return linear_cross_entropy(x, self.weight, targets, chunk_size)
        # F.linear, not x @ W.T: under autocast the transposed view's bf16 copy was written transposed (a
        # slower, uncoalesced kernel in the compiled step; notes/train_step.md).
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


class Embedding(nn.Module):
    """A lookup table (vocab, d_model) ~ truncated normal, std 1 (the untruncated normal's, as ``Linear``), cut at 3.
    Its gradient sums a token's rows in fp32 and rounds once: ``F.embedding``'s CUDA backward does; on the CPU
    (which sums in the weight's dtype) a bf16 or fp16 table is looked up as fp32. Indexing (``weight[ids]``) sums by
    ``index_put_(accumulate=True)``, which rounds after every row: with bf16 weights a running sum of ~1's stops
    growing at 256, and the xl 4 x 2,048 step's embedding gradient was 20-26% off fp32's in norm
    (scripts/grad_fidelity.py, notes/train_step.md session 50)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight.device.type != "cuda" and weight.dtype in (torch.bfloat16, torch.float16):
            return F.embedding(token_ids, weight.float()).to(weight.dtype)  # the same values; the sums in fp32
        return F.embedding(token_ids, weight)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g, computed in at least float32 and cast back to the input dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm has a fused backward that Inductor lowers better than the written-out formula (2.3 ms of
        # the xl 4 x 2,048 step; notes/train_step.md); same formula, same precision.
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return F.rms_norm(wide, (wide.shape[-1],), self.weight.to(wide.dtype), self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE on adjacent feature pairs (2k, 2k+1): rotate pair k of position i by i * theta^(-2k/d).

    The cos/sin tables are float32 (float64 for a float64 model); the rotation runs in at least float32.
    It takes heads in the projection's own layout, (B, T, H, d_head), as the Flax model does: the rotated
    q and k are written in that layout, SDPA's output follows their strides, and merging the heads for
    the output projection is a view, where rotating (B, H, T, d_head) cost a transposing copy of the
    attention output in the forward and of its gradient in the backward (notes/train_step.md).
    """

    def __init__(self, d_head: int, max_seq_len: int, theta: float, device=None, dtype=None):
        super().__init__()
        table_dtype = torch.promote_types(dtype or torch.float32, torch.float32)
        inv_freq = theta ** (-torch.arange(0, d_head, 2, device=device, dtype=torch.float64) / d_head)
        angles = torch.arange(max_seq_len, device=device, dtype=torch.float64)[:, None] * inv_freq  # (T, d/2)
        self.register_buffer("cos", angles.cos().to(table_dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(table_dtype), persistent=False)

    def tables(self, seq: int, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, d_head / 2) for positions (T,) (default 0..seq-1)."""
        if positions is None:  # a slice, not a gather: the compiled kernel reads the tables directly
            return self.cos[:seq], self.sin[:seq]
        return self.cos[positions], self.sin[positions]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., T, H, d_head), positions: (T,) (default 0..T-1) -> x rotated, same shape and dtype."""
        return Rotate.apply(x, *self.tables(x.shape[-3], positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on queries and keys; the kernel comes from the registry."""

    def __init__(self, spec: ModelSpec, rope: RotaryEmbedding, attention: str, device=None, dtype=None):
        super().__init__()
        d = spec.d_model
        self.n_heads = spec.n_heads
        self.q_proj = Linear(d, d, device=device, dtype=dtype)
        self.k_proj = Linear(d, d, device=device, dtype=dtype)
        self.v_proj = Linear(d, d, device=device, dtype=dtype)
        self.output_proj = Linear(d, d, device=device, dtype=dtype)
        self.rope = rope
        self.attention_name = attention
        self.attention = get_attention(attention)
        self.packed_attention = get_packed_attention(attention)  # None: the backend takes q, k, v only

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, d_model = x.shape
        # q, k and v as one product (torch_impl.qkv_projection), RoPE in the (B, T, H, d_head) layout; the kernels
        # take (B, H, T, d_head) views of it. A backend that takes the input and the weights makes the product,
        # applies RoPE and splits it itself.
        projections = (self.q_proj, self.k_proj, self.v_proj)
        cos, sin = self.rope.tables(seq, positions)
        weights = None if self.packed_attention is None else qkv_weights(projections)
        if weights is None:
            q, k, v = (t.transpose(1, 2) for t in project_qkv(x, projections, self.n_heads, cos, sin))
        with nvtx.range(f"attention {self.attention_name}"):  # (B, H, T, d_head)
            out = (self.attention(q, k, v, is_causal=True) if weights is None
                   else self.packed_attention(x, weights, cos, sin, self.n_heads))
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, attention={self.attention_name!r}"


class SwiGLU(nn.Module):
    """W2 (SiLU(W1 x) * W3 x); ``mlp`` (``MLPS``) "gluon": as one ``swiglu_gluon.swiglu_mlp`` op."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None, mlp: str = "torch"):
        super().__init__()
        if mlp not in MLPS:
            raise ValueError(f"SwiGLU: mlp {mlp!r}; accepted: {', '.join(MLPS)}")
        if mlp == "gluon":  # registers torch.ops.torch_impl.swiglu_mlp; imported here, not with this module:
            import torch_impl.swiglu_gluon  # noqa: F401  (Triton reads TRITON_INTERPRET when first imported)
        self.mlp = mlp
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp == "gluon":
            y, _, _, _ = torch.ops.torch_impl.swiglu_mlp(x.flatten(0, -2), self.w1.weight, self.w3.weight,
                                                         self.w2.weight)
            return y.unflatten(0, x.shape[:-1])
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))

    def extra_repr(self) -> str:
        return f"mlp={self.mlp!r}"


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x))."""

    def __init__(self, spec: ModelSpec, rope: RotaryEmbedding, attention: str, device=None, dtype=None,
                 mlp: str = "torch"):
        super().__init__()
        self.ln1 = RMSNorm(spec.d_model, spec.norm_eps, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(spec, rope, attention, device=device, dtype=dtype)
        self.ln2 = RMSNorm(spec.d_model, spec.norm_eps, device=device, dtype=dtype)
        self.ffn = SwiGLU(spec.d_model, spec.d_ff, device=device, dtype=dtype, mlp=mlp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d); positions (T,), default 0..T-1."""
        x = x + self.attn(self.ln1(x), positions)
        return x + self.ffn(self.ln2(x))


def run_blocks(blocks: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    """x through each of ``blocks`` in turn."""
    for block in blocks:
        x = block(x)
    return x


class Blocks(nn.ModuleList):
    """The Transformer blocks as one module: ``forward`` applies them in order. A ModuleList, so parameter names
    stay ``layers.{i}....``. ``span`` blocks at a time go through ``run_span`` (``run_blocks``), which
    ``torch_impl.parallelize.apply_compile`` may replace by a compiled one: every span is then one compiled region,
    and one graph serves them all (fewer regions to enter each step than one per block: notes/train_step.md)."""

    span: int | None = None  # None: all the blocks at once
    run_span = staticmethod(run_blocks)

    def __init__(self, modules=None):
        super().__init__(modules)
        self._span_hooks: OrderedDict[int, Callable[[tuple[nn.Module, ...]], None]] = OrderedDict()  # weakref-able

    def register_span_hook(self, hook: Callable[[tuple[nn.Module, ...]], None]) -> RemovableHandle:
        """``hook(blocks)`` runs before each span's blocks go through ``run_span``, eagerly, outside any compiled
        region (a block's own forward pre-hooks would be traced into it): where ``torch_impl.distributed.ZeRO2``
        waits for those blocks' gathered weights. Returns a handle whose ``remove()`` drops it."""
        handle = RemovableHandle(self._span_hooks)
        self._span_hooks[handle.id] = hook
        return handle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks, span = tuple(self), self.span or max(len(self), 1)
        for start in range(0, len(blocks), span):
            for hook in self._span_hooks.values():
                hook(blocks[start:start + span])
            x = self.run_span(blocks[start:start + span], x)
        return x


class TransformerLM(nn.Module):
    """Causal Transformer LM: token ids (B, T) -> logits (B, T, vocab); with targets (B, T), the mean loss.

    ``loss``: how ``forward(token_ids, targets)`` computes it, "plain" (the logits, then ``cross_entropy``) or
    "fused" (``linear_cross_entropy``, ``loss_chunk`` tokens at a time, None: its default); both equal to fp32
    round-off, in value and gradients (tests/test_linear_cross_entropy.py). ``mlp``: each block's SwiGLU through
    PyTorch's ops ("torch") or ``swiglu_gluon.swiglu_mlp`` ("gluon"; ``MLPS``)."""

    def __init__(self, spec: ModelSpec, attention: str = "naive", device=None, dtype=None, *, loss: str = "plain",
                 loss_chunk: int | None = None, mlp: str = "torch"):
        super().__init__()
        if spec.arch != "transformer":
            raise ValueError(f"TransformerLM needs arch='transformer'; spec {spec.name!r} is {spec.arch!r}")
        if loss not in LOSSES:
            raise ValueError(f"TransformerLM: loss {loss!r}; accepted: {', '.join(LOSSES)}")
        if loss_chunk is not None and (isinstance(loss_chunk, bool) or not isinstance(loss_chunk, int)
                                       or loss_chunk < 1):
            raise ValueError(f"TransformerLM: loss_chunk={loss_chunk!r} must be an integer >= 1 (or None)")
        self.spec = spec
        self.loss, self.loss_chunk = loss, loss_chunk
        get_attention(attention)  # fail early, with the list of backends
        # One RoPE table shared by every block; a buffer, so it follows .to(device) and is never trained.
        rope = RotaryEmbedding(spec.d_head, spec.context_length, spec.rope_theta, device=device, dtype=dtype)
        self.token_embeddings = Embedding(spec.vocab_size, spec.d_model, device=device, dtype=dtype)
        self.layers = Blocks(
            TransformerBlock(spec, rope, attention, device=device, dtype=dtype, mlp=mlp) for _ in range(spec.n_layers)
        )
        self.ln_final = RMSNorm(spec.d_model, spec.norm_eps, device=device, dtype=dtype)
        self.lm_head = Linear(spec.d_model, spec.vocab_size, device=device, dtype=dtype)

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids (B, T) -> logits (B, T, V); with targets (B, T), the mean cross-entropy (0-dim, fp32) by
        ``self.loss``: the fused loss never makes the logits."""
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be (batch, seq), got shape {tuple(token_ids.shape)}")
        if targets is not None and targets.shape != token_ids.shape:
            raise ValueError(f"targets {tuple(targets.shape)} must be shaped as token_ids {tuple(token_ids.shape)}")
        seq = token_ids.shape[1]
        self.spec.check_seq_len(seq)
        x = self.layers(self.token_embeddings(token_ids))  # (B, T, d), positions 0..T-1
        h = self.ln_final(x)  # (B, T, d)
        if targets is None:
            return self.lm_head(h)  # (B, T, V)
        if self.loss == "fused":
            return self.lm_head(h, targets=targets, chunk_size=self.loss_chunk)
        return cross_entropy(self.lm_head(h), targets)

    def extra_repr(self) -> str:
        return f"loss={self.loss!r}" + (f", loss_chunk={self.loss_chunk}" if self.loss_chunk else "")

    def to_numpy_weights(self) -> dict[str, np.ndarray]:
        """Every parameter as a float32 numpy copy, keyed by its stable name (PyTorch layout)."""
        return {name: p.detach().float().cpu().numpy().copy() for name, p in self.named_parameters()}

    @torch.no_grad()
    def load_numpy_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Copy weights (as from ``to_numpy_weights``) into this model; names and shapes must match exactly."""
        params = dict(self.named_parameters())
        missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        if missing or unexpected:
            raise ValueError(f"weight names differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, param in params.items():
            value = np.asarray(weights[name])
            if value.shape != tuple(param.shape):
                raise ValueError(f"weight {name!r}: shape {value.shape} != parameter shape {tuple(param.shape)}")
            param.copy_(torch.from_numpy(value))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in float32: logits (B, T, V), targets (B, T)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
