"""Parity of the Flax model (jax_impl.model) with the PyTorch reference (torch_impl.model).

For ``MODELS["tiny"]`` in float32 on CPU: fresh random weights from the PyTorch model cross to Flax as a
numpy dict, fresh random token ids go through both, and the logits and the gradient of the loss with
respect to every parameter must agree, for every pair of attention backends (torch "naive"/"sdpa" x jax
"naive"/"dot_product"). Negative controls (a perturbed weight, an untransposed kernel, RoPE on split
halves instead of adjacent pairs) show that the same metric does fail when the models differ.

The metric, everywhere in this file: relative error = max|jax - torch| / max|torch| (max over all entries
of the tensor; one number per logits tensor or per parameter gradient).

Seeds: each test draws a fresh seed (so every run checks new weights and tokens) and prints it in its
failure message; set PARITY_SEED=<int> to replay one.

JAX runs on the CPU with the highest matmul precision (on a GPU machine JAX would otherwise pick the
GPU and TF32 matmuls, which are not float32 accurate).
"""

from __future__ import annotations

import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jax_impl import model as jax_model
from parallelism_calc.specs import MODELS
from torch_impl import model as torch_model

SPEC = MODELS["tiny"]
BATCH = 2
SEQ = SPEC.context_length  # the full RoPE table
TOLERANCE = 1e-4  # relative error (max|jax - torch| / max|torch|) allowed in float32
BROKEN = 1e-2  # a relative error this large means the models really differ (negative controls)


def relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    """max|actual - reference| / max|reference|."""
    actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    return float(np.max(np.abs(actual - reference)) / np.max(np.abs(reference)))


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("PARITY_SEED", secrets.randbelow(2**31)))


@pytest.fixture(autouse=True)
def jax_on_cpu_highest_precision():
    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        yield


def make_case(seed: int, torch_attention: str = "naive"):
    """A torch model with fresh random weights, and token ids / targets (B, T) drawn from the same seed."""
    torch.manual_seed(seed)
    model = torch_model.TransformerLM(SPEC, attention=torch_attention)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, SPEC.vocab_size, size=(BATCH, SEQ), dtype=np.int64)
    targets = rng.integers(0, SPEC.vocab_size, size=(BATCH, SEQ), dtype=np.int64)
    return model, tokens, targets


def jax_from_numpy(weights: dict[str, np.ndarray], attention: str) -> jax_model.TransformerLM:
    model = jax_model.TransformerLM(SPEC, rngs=nnx.Rngs(0), attention=attention)
    jax_model.load_numpy_weights(model, weights)
    return model


def torch_logits_and_grads(model, tokens, targets):
    """Logits (B, T, V) and {stable name: d loss / d parameter} in PyTorch layout."""
    model.zero_grad()
    logits = model(torch.from_numpy(tokens))
    torch_model.cross_entropy(logits, torch.from_numpy(targets)).backward()
    grads = {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
    return logits.detach().numpy(), grads


@nnx.jit
def _jax_loss_grads(model, tokens, targets):
    """(d loss / d params as a State of nnx.Param, logits (B, T, V)); jitted: one compile per backend."""

    def loss_fn(m):
        logits = m(tokens)
        return jax_model.cross_entropy(logits, targets), logits

    return nnx.grad(loss_fn, has_aux=True)(model)


def jax_logits_and_grads(model, tokens, targets):
    """Logits (B, T, V) and {stable name: d loss / d parameter}, mapped to PyTorch names and layout."""
    grads, logits = _jax_loss_grads(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(targets, jnp.int32))
    # A clone of the model holding the gradients as its parameters: to_numpy_weights then maps them to the
    # stable names and transposes the kernels, exactly as it does for weights.
    grad_model = nnx.clone(model)
    nnx.update(grad_model, grads)
    return np.asarray(logits), jax_model.to_numpy_weights(grad_model)


def test_weight_names_and_shapes_match_torch(seed):
    torch_lm, _, _ = make_case(seed)
    flax_lm = jax_model.TransformerLM(SPEC, rngs=nnx.Rngs(seed))
    torch_shapes = {name: tuple(p.shape) for name, p in torch_lm.named_parameters()}
    flax_shapes = {name: w.shape for name, w in jax_model.to_numpy_weights(flax_lm).items()}
    assert list(flax_shapes) == list(torch_shapes)  # same names, same order
    assert flax_shapes == torch_shapes


@pytest.mark.parametrize("torch_attention", ["naive", "sdpa"])
@pytest.mark.parametrize("jax_attention", ["naive", "dot_product"])
def test_logits_and_gradients_match_torch(seed, torch_attention, jax_attention):
    torch_lm, tokens, targets = make_case(seed, torch_attention)
    flax_lm = jax_from_numpy(torch_lm.to_numpy_weights(), jax_attention)

    torch_logits, torch_grads = torch_logits_and_grads(torch_lm, tokens, targets)
    jax_logits, jax_grads = jax_logits_and_grads(flax_lm, tokens, targets)

    err = relative_error(jax_logits, torch_logits)
    assert err <= TOLERANCE, f"logits: relative error {err:.3g} (seed {seed})"
    assert set(jax_grads) == set(torch_grads)
    errors = {name: relative_error(jax_grads[name], torch_grads[name]) for name in torch_grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"gradient of {worst}: relative error {errors[worst]:.3g} (seed {seed})"


def test_loss_matches_torch(seed):
    torch_lm, tokens, targets = make_case(seed)
    flax_lm = jax_from_numpy(torch_lm.to_numpy_weights(), "naive")
    with torch.no_grad():
        torch_loss = torch_model.cross_entropy(torch_lm(torch.from_numpy(tokens)), torch.from_numpy(targets)).item()
    jax_loss = float(jax_model.cross_entropy(flax_lm(jnp.asarray(tokens, jnp.int32)), jnp.asarray(targets)))
    assert abs(jax_loss - torch_loss) <= TOLERANCE * abs(torch_loss), (jax_loss, torch_loss, seed)


# --- negative controls: the parity metric must become large when the models really differ ---------------


def _torch_logits(torch_lm, tokens) -> np.ndarray:
    with torch.no_grad():
        return torch_lm(torch.from_numpy(tokens)).numpy()


def test_parity_detects_one_perturbed_weight(seed):
    torch_lm, tokens, _ = make_case(seed)
    weights = torch_lm.to_numpy_weights()
    weights = {name: w.copy() for name, w in weights.items()}  # torch's arrays share memory with the model
    weights["layers.1.ffn.w2.weight"][3, 5] += 1.0  # one entry of one matrix in the last block
    err = relative_error(np.asarray(jax_from_numpy(weights, "naive")(jnp.asarray(tokens))), _torch_logits(torch_lm, tokens))
    assert err > BROKEN, f"a perturbed weight went unnoticed: relative error {err:.3g} (seed {seed})"


def test_parity_detects_an_untransposed_kernel(seed):
    # q_proj is square, so loading it in the wrong layout passes every shape check: only the numbers tell.
    torch_lm, tokens, _ = make_case(seed)
    weights = torch_lm.to_numpy_weights()
    weights["layers.0.attn.q_proj.weight"] = weights["layers.0.attn.q_proj.weight"].T.copy()
    err = relative_error(np.asarray(jax_from_numpy(weights, "naive")(jnp.asarray(tokens))), _torch_logits(torch_lm, tokens))
    assert err > BROKEN, f"a transposed kernel went unnoticed: relative error {err:.3g} (seed {seed})"


def test_parity_detects_rope_on_split_halves(seed, monkeypatch):
    # The other common RoPE convention (GPT-NeoX / Llama HF: pair feature k with k + D/2) must not pass.
    def rope_split_halves(self, x):  # x (B, T, H, D)
        seq, half = x.shape[1], x.shape[-1] // 2
        cos, sin = self.cos[...][:seq, None, :], self.sin[...][:seq, None, :]  # (T, 1, D/2)
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate((x1 * cos - x2 * sin, x1 * sin + x2 * cos), axis=-1)

    torch_lm, tokens, _ = make_case(seed)
    flax_lm = jax_from_numpy(torch_lm.to_numpy_weights(), "naive")
    torch_logits = _torch_logits(torch_lm, tokens)
    assert relative_error(np.asarray(flax_lm(jnp.asarray(tokens))), torch_logits) <= TOLERANCE
    monkeypatch.setattr(jax_model.RotaryEmbedding, "__call__", rope_split_halves)
    err = relative_error(np.asarray(flax_lm(jnp.asarray(tokens))), torch_logits)
    assert err > BROKEN, f"RoPE on split halves went unnoticed: relative error {err:.3g} (seed {seed})"
