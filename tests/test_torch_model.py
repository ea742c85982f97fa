"""The PyTorch TransformerLM against the float64 numpy reference, plus its contracts (names, errors, causality)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from parallelism_calc.specs import MODELS
from tests._reference import reference_logits
from torch_impl.attention import get_attention
from torch_impl.model import RotaryEmbedding, TransformerLM

TINY = MODELS["tiny"]


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**31)


def random_tokens(spec, batch, seq, seed):
    return np.random.default_rng(seed).integers(0, spec.vocab_size, size=(batch, seq))


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_float64_model_matches_numpy_reference(attention):
    seed = fresh_seed()
    torch.manual_seed(seed)
    model = TransformerLM(TINY, attention=attention, dtype=torch.float64)
    tokens = random_tokens(TINY, 2, 37, seed)  # a length that is no power of two
    logits = model(torch.from_numpy(tokens)).detach().numpy()
    weights = {n: p.detach().numpy() for n, p in model.named_parameters()}
    expected = reference_logits(TINY, weights, tokens)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-10 * np.abs(expected).max())


def test_float32_model_matches_reference_and_broken_rope_does_not():
    seed = fresh_seed()
    torch.manual_seed(seed)
    model = TransformerLM(TINY)
    tokens = random_tokens(TINY, 2, 20, seed)
    expected = reference_logits(TINY, model.to_numpy_weights(), tokens)
    error = lambda m: np.abs(m(torch.from_numpy(tokens)).detach().numpy() - expected).max() / np.abs(expected).max()
    assert error(model) < 1e-5  # float32 rounding over two blocks
    model.layers[0].attn.rope.sin.neg_()  # rotate the wrong way: a real bug the check must see
    assert error(model) > 1e-3


@pytest.mark.parametrize("positions", [None, "shuffled"])
def test_rope_backward_is_the_true_gradient(positions):
    """RoPE's written-out backward (rotation by minus the angle) against float64 finite differences, and the
    float32 rotation against the float64 one; heads in the (B, T, H, d_head) layout the model uses."""
    seed = fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    rope64 = RotaryEmbedding(8, 16, 10_000.0, dtype=torch.float64)
    x = torch.randn(2, 11, 3, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    pos = None if positions is None else torch.randperm(16, generator=generator)[:11]
    assert torch.autograd.gradcheck(lambda t: rope64(t, pos), (x,)), seed
    rope32 = RotaryEmbedding(8, 16, 10_000.0)
    torch.testing.assert_close(rope32(x.detach().float(), pos).double(), rope64(x.detach(), pos),
                               rtol=1e-6, atol=1e-6)


def test_parameter_count_and_stable_names():
    model = TransformerLM(TINY)
    assert sum(p.numel() for p in model.parameters()) == TINY.n_params()
    names = set(model.to_numpy_weights())
    assert {"token_embeddings.weight", "layers.1.attn.q_proj.weight", "layers.0.ffn.w3.weight",
            "layers.1.ln2.weight", "ln_final.weight", "lm_head.weight"} <= names
    assert model.to_numpy_weights()["layers.0.ffn.w1.weight"].shape == (TINY.d_ff, TINY.d_model)  # (out, in)


@pytest.mark.parametrize("preset", ["small", "medium", "large", "xl", "2.7B"])
def test_module_parameter_count_equals_spec_on_meta_device(preset):
    with torch.device("meta"):
        model = TransformerLM(MODELS[preset])
    assert sum(p.numel() for p in model.parameters()) == MODELS[preset].n_params()


def test_numpy_weights_round_trip_and_errors():
    source, target = TransformerLM(TINY), TransformerLM(TINY)
    weights = source.to_numpy_weights()
    target.load_numpy_weights(weights)
    for name, value in target.to_numpy_weights().items():
        np.testing.assert_array_equal(value, weights[name])
    with pytest.raises(ValueError, match="missing"):
        target.load_numpy_weights({k: v for k, v in weights.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="shape"):
        target.load_numpy_weights({**weights, "ln_final.weight": np.ones(3, np.float32)})


def test_causal_future_tokens_do_not_change_past_logits():
    model = TransformerLM(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (1, 24))
    changed = tokens.clone()
    changed[0, 12:] = torch.randint(0, TINY.vocab_size, (12,))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="accepted: .*naive"):
        TransformerLM(TINY, attention="nope")
    with pytest.raises(ValueError, match="context_length"):
        TransformerLM(TINY)(torch.zeros(1, TINY.context_length + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="ffn_only"):
        TransformerLM(MODELS["xxl"])
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention("flash_nope")


@pytest.mark.parametrize("attention", ["naive", "sdpa", "sdpa_flash"])  # ours: tests/test_flash_attention.py
@pytest.mark.parametrize("n_queries,n_keys", [(7, 7), (5, 9)])
def test_reference_backends_match_float64_softmax(attention, n_queries, n_keys):
    q, k, v = (torch.randn(2, 3, n, 16, dtype=torch.float64) for n in (n_queries, n_keys, n_keys))
    scores = q @ k.transpose(-1, -2) / 4.0
    mask = torch.ones(n_queries, n_keys, dtype=torch.bool).tril()  # query i sees keys 0..i
    expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
    torch.testing.assert_close(get_attention(attention)(q, k, v, is_causal=True), expected)
    expected_full = torch.softmax(scores, -1) @ v
    torch.testing.assert_close(get_attention(attention)(q, k, v, is_causal=False), expected_full)


LAZY_TRITON = """
import os, sys
import torch
import torch_impl.model
from torch_impl.attention import ATTENTION_BACKENDS, get_attention
assert not {"triton", "torch_impl.attention.flash_triton"} & set(sys.modules), "the model imported Triton"
assert list(ATTENTION_BACKENDS) == ["naive", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_torch",
                                    "flash_triton"]
os.environ["TRITON_INTERPRET"] = "1"  # still read: Triton is imported below, on first use
q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
expected = get_attention("sdpa")(q, k, v)
torch.testing.assert_close(ATTENTION_BACKENDS["flash_triton"](q, k, v), expected, rtol=1e-4, atol=1e-5)
from torch_impl.attention import FlashAttention2Triton
assert get_attention("flash_triton") is ATTENTION_BACKENDS["flash_triton"]
module = "torch_impl.attention.flash_triton"
assert get_attention("flash_triton").__module__ == FlashAttention2Triton.__module__ == module
torch.testing.assert_close(FlashAttention2Triton.apply(q, k, v, True), expected, rtol=1e-4, atol=1e-5)
"""


def test_importing_the_model_leaves_triton_to_the_first_use_of_flash_triton():
    """Triton reads TRITON_INTERPRET when first imported, so ``import torch_impl.model`` must not import it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", LAZY_TRITON], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_forced_sdpa_kernels_compile_whole_and_never_fall_back():
    q = torch.randn(1, 2, 8, 16)
    compiled = torch.compile(get_attention("sdpa_flash"), fullgraph=True)  # fullgraph: no graph break
    torch.testing.assert_close(compiled(q, q, q), get_attention("sdpa")(q, q, q))
    with pytest.raises(RuntimeError, match="No viable backend"):  # no cuDNN on a CPU tensor, and no fallback
        get_attention("sdpa_cudnn")(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["naive", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"])
def test_cuda_bf16_autocast_close_to_float64_reference(attention):
    seed = fresh_seed()
    torch.manual_seed(seed)
    model = TransformerLM(MODELS["tiny"].replace(context_length=256), attention=attention, device="cuda")
    tokens = random_tokens(TINY, 4, 256, seed)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(torch.from_numpy(tokens).cuda()).float().cpu().numpy()
    expected = reference_logits(model.spec, model.to_numpy_weights(), tokens)
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 2e-3 per product); over two blocks and the
    # LM head the errors add up to ~1e-2 of the logit scale, so 3e-2 leaves room without hiding a bug
    # (a wrong mask or rotation gives errors of order 1).
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 3e-2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_embedding_gradient_sums_a_frequent_tokens_rows_in_fp32(device):
    """A token's gradient is the sum of its rows' upstream gradients; with bf16 weights that sum must not be rounded
    to bf16 row by row (CUDA's ``index_put_(accumulate=True)``, what ``weight[ids]``'s backward runs, does: past 256
    rows of ~1 a bf16 running sum stops growing), only once at the end."""
    from torch_impl.model import Embedding

    seed = fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    vocab, dim, rows = 64, 32, 8192
    table = Embedding(vocab, dim, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (rows,), generator=generator)  # ~1,000 rows a token
    upstream = (1 + 0.1 * torch.randn(rows, dim, generator=generator)).to(torch.bfloat16)
    table(ids.to(device)).backward(upstream.to(device))
    want = torch.zeros(vocab, dim, dtype=torch.float64).index_add_(0, ids, upstream.double())
    got = table.weight.grad.double().cpu()
    # one rounding of each sum to bf16: at most 2^-9 relative per element
    assert ((got - want).abs() <= 2.0 ** -8 * want.abs()).all(), f"seed {seed}"
