"""The stock reference: the same ``ModelSpec`` built only from stock PyTorch modules, as a user would write it.

``StockTransformerLM(spec, attention="sdpa_cudnn")`` is the baseline every step record is compared with
("x times stock"): ``nn.Embedding``, ``nn.RMSNorm``, ``nn.Linear(bias=False)``, ``F.silu`` and
``F.scaled_dot_product_attention`` (one of the SDPA backends of ``torch_impl.attention``, which only pick
SDPA's kernel). RoPE has no stock module; it is the plain adjacent-pair rotation in float32. Parameter names
and shapes equal ``torch_impl.model.TransformerLM``'s, so ``stock.load_state_dict(ours.state_dict())`` gives
both models the same weights (tests/test_stock.py checks the logits match). Built alone it has the stock
modules' own initialization (nn.Linear's uniform of std 1 / sqrt(3 in), nn.Embedding's untruncated N(0, 1)),
not the spec's: every run loads ours first (the e2e benchmark's ``build_model``). A baseline, not a second model
to maintain: no weight exchange, no options beyond the attention backend.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelism_calc.specs import ModelSpec
from torch_impl.attention import get_attention

SDPA_BACKENDS = ("sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient")


def rope_tables(spec: ModelSpec, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position i times theta^(-2k/d_head), each (context, d_head / 2), float32."""
    inv_freq = spec.rope_theta ** (-torch.arange(0, spec.d_head, 2, dtype=torch.float64) / spec.d_head)
    angles = torch.arange(spec.context_length, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (2k, 2k+1) of x (..., T, d_head), in at least float32, returned in x's dtype."""
    pairs = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2))  # (..., T, d/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str, device=None):
        super().__init__()
        self.n_heads = spec.n_heads
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (
            nn.Linear(spec.d_model, spec.d_model, bias=False, device=device) for _ in range(4))
        self.sdpa = get_attention(attention)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.n_heads, -1).transpose(1, 2)  # (B, H, T, d_head)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = self.sdpa(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, device=None):
        super().__init__()
        self.w1 = nn.Linear(spec.d_model, spec.d_ff, bias=False, device=device)
        self.w2 = nn.Linear(spec.d_ff, spec.d_model, bias=False, device=device)
        self.w3 = nn.Linear(spec.d_model, spec.d_ff, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str, device=None):
        super().__init__()
        self.ln1 = nn.RMSNorm(spec.d_model, eps=spec.norm_eps, device=device)
        self.attn = Attention(spec, attention, device)
        self.ln2 = nn.RMSNorm(spec.d_model, eps=spec.norm_eps, device=device)
        self.ffn = FeedForward(spec, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.ffn(self.ln2(x))


class StockTransformerLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab), from stock modules; the same names as ``TransformerLM``."""

    def __init__(self, spec: ModelSpec, attention: str = "sdpa", device=None):
        super().__init__()
        if attention not in SDPA_BACKENDS:
            raise ValueError(f"the stock model runs SDPA only: attention {attention!r}; "
                             f"accepted: {', '.join(SDPA_BACKENDS)}")
        self.spec = spec
        self.token_embeddings = nn.Embedding(spec.vocab_size, spec.d_model, device=device)
        self.layers = nn.ModuleList(Block(spec, attention, device) for _ in range(spec.n_layers))
        self.ln_final = nn.RMSNorm(spec.d_model, eps=spec.norm_eps, device=device)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False, device=device)
        cos, sin = rope_tables(spec, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        seq = token_ids.shape[1]
        cos, sin = self.cos[:seq], self.sin[:seq]
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.ln_final(x))
