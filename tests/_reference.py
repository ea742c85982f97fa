"""An independent float64 numpy forward pass of the Transformer LM, written from the CS336 equations.

It reads the stable-named weight dict (linear weights in (out, in) layout) that both backends export, so
each backend is checked against the same plain reference rather than against each other alone.
"""

from __future__ import annotations

import numpy as np

from parallelism_calc.specs import ModelSpec


def _rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """x: (H, T, d). Pair (2k, 2k+1) at position i is rotated by the angle i * theta^(-2k/d)."""
    _, seq, d = x.shape
    angle = np.arange(seq)[:, None] * theta ** (-np.arange(0, d, 2) / d)  # (T, d/2)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * np.cos(angle) - x[..., 1::2] * np.sin(angle)
    out[..., 1::2] = x[..., 0::2] * np.sin(angle) + x[..., 1::2] * np.cos(angle)
    return out


def reference_logits(spec: ModelSpec, weights: dict[str, np.ndarray], token_ids: np.ndarray) -> np.ndarray:
    """Logits (B, T, V) in float64 for token ids (B, T)."""
    w = {name: np.asarray(value, dtype=np.float64) for name, value in weights.items()}
    heads, d_head = spec.n_heads, spec.d_head
    out = []
    for sequence in token_ids:
        seq = len(sequence)
        x = w["token_embeddings.weight"][sequence]  # (T, d)
        for i in range(spec.n_layers):
            p = f"layers.{i}."
            h = _rms_norm(x, w[p + "ln1.weight"], spec.norm_eps)
            q, k, v = (h @ w[p + f"attn.{n}_proj.weight"].T for n in "qkv")
            q, k, v = (t.reshape(seq, heads, d_head).transpose(1, 0, 2) for t in (q, k, v))  # (H, T, dh)
            q, k = _rope(q, spec.rope_theta), _rope(k, spec.rope_theta)
            scores = q @ k.transpose(0, 2, 1) / np.sqrt(d_head)  # (H, T, T)
            scores = np.where(np.tril(np.ones((seq, seq), dtype=bool)), scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = (probs @ v).transpose(1, 0, 2).reshape(seq, spec.d_model)
            x = x + attn @ w[p + "attn.output_proj.weight"].T
            h = _rms_norm(x, w[p + "ln2.weight"], spec.norm_eps)
            a, b = h @ w[p + "ffn.w1.weight"].T, h @ w[p + "ffn.w3.weight"].T
            x = x + (a / (1 + np.exp(-a)) * b) @ w[p + "ffn.w2.weight"].T
        out.append(_rms_norm(x, w["ln_final.weight"], spec.norm_eps) @ w["lm_head.weight"].T)
    return np.stack(out)
