"""The Flax model on its own (jax_impl.model): parameter counts, logical axes, weight exchange, errors,
bf16 compute, causality, the lookup's float32 gradient sums. Parity with the PyTorch model is tested in test_parity.py.

Runs on the CPU with the highest matmul precision, so the float32 comparisons below mean float32.
"""

from __future__ import annotations

import secrets

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_impl import model as jax_model
from jax_impl.attention import ATTENTION_BACKENDS
from jax_impl.model import TransformerLM, cross_entropy, load_numpy_weights, logical_axes, lookup, to_numpy_weights
from parallelism_calc.specs import MODELS

TINY = MODELS["tiny"]
AXIS_NAMES = {"vocab", "embed", "heads", "mlp"}


@pytest.fixture(autouse=True)
def jax_on_cpu_highest_precision():
    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        yield


def random_tokens(seed: int, batch: int = 2, seq: int = 16) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, TINY.vocab_size, dtype=jnp.int32)


@nnx.jit
def forward(model: TransformerLM, tokens: jax.Array) -> jax.Array:
    """model(tokens), jitted: one compile per model configuration beats compiling every op eagerly."""
    return model(tokens)


def n_params(model: TransformerLM) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def relative_error(actual, reference) -> float:
    """max|actual - reference| / max|reference| (as in test_parity.py)."""
    actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    return float(np.max(np.abs(actual - reference)) / np.max(np.abs(reference)))


# --- parameters ----------------------------------------------------------------------------------------


def test_parameter_count_tiny():
    assert n_params(TransformerLM(TINY, rngs=nnx.Rngs(0))) == TINY.n_params()


def test_parameter_count_small_without_allocating():
    spec = MODELS["small"]
    abstract = nnx.eval_shape(lambda: TransformerLM(spec, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)  # shapes only, nothing allocated
    assert n_params(abstract) == spec.n_params() == 128_625_408


def test_every_parameter_has_logical_axes_of_its_rank():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    axes = logical_axes(model)
    flax_shapes = {name: tuple(w.shape) for name, w in to_numpy_weights(model).items()}  # PyTorch layout
    assert set(axes) == set(flax_shapes)
    assert sum(int(np.prod(s)) for s in flax_shapes.values()) == TINY.n_params()  # the names cover every parameter
    for name, names in axes.items():
        assert len(names) == len(flax_shapes[name]), name
        assert set(names) <= AXIS_NAMES, name
    expected_suffixes = {
        "token_embeddings.weight": ("vocab", "embed"),
        "ln1.weight": ("embed",), "ln2.weight": ("embed",), "ln_final.weight": ("embed",),
        "q_proj.weight": ("embed", "heads"), "k_proj.weight": ("embed", "heads"),
        "v_proj.weight": ("embed", "heads"), "output_proj.weight": ("heads", "embed"),
        "w1.weight": ("embed", "mlp"), "w3.weight": ("embed", "mlp"), "w2.weight": ("mlp", "embed"),
        "lm_head.weight": ("embed", "vocab"),
    }
    for name, names in axes.items():
        (expected,) = [v for suffix, v in expected_suffixes.items() if name.endswith(suffix)]
        assert names == expected, name


@pytest.mark.parametrize("scan_layers", [True, False])
def test_flax_partition_spec_api_sees_the_logical_axes(scan_layers):
    # nnx.get_partition_spec is what the sharding code uses: with no rules in context it returns the names.
    model = TransformerLM(TINY, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    params = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(params)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    value_leaves = jax.tree.leaves(params)
    assert len(spec_leaves) == len(value_leaves) == 2 + 9 * (1 if scan_layers else TINY.n_layers) + 1
    for spec, value in zip(spec_leaves, value_leaves):
        assert len(spec) == value.ndim and set(spec) <= AXIS_NAMES | {"layers"}
    q_proj = specs["layers"]["attn"] if scan_layers else specs["layers"][0]["attn"]
    assert tuple(q_proj["q_proj"]["kernel"].get_value()) == ("layers",) * scan_layers + ("embed", "heads")
    assert tuple(specs["lm_head"]["kernel"].get_value()) == ("embed", "vocab")


def _equations(fn, *args) -> int:
    """How many equations the traced program of ``fn(*args)`` has, counting those of nested jaxprs."""
    def count(jaxpr) -> int:
        return len(jaxpr.eqns) + sum(count(sub) for sub in jax.extend.core.subjaxprs(jaxpr))

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def test_scanned_programs_do_not_grow_with_depth():
    """Init and forward trace to the same program at 2 and 6 layers with scan_layers; unrolled they grow."""
    tokens = random_tokens(0)

    def sizes(scan_layers):
        out = []
        for n_layers in (2, 6):
            spec = TINY.replace(n_layers=n_layers)
            init = lambda: nnx.state(TransformerLM(spec, rngs=nnx.Rngs(0), scan_layers=scan_layers))  # noqa: E731
            graphdef, state = nnx.split(TransformerLM(spec, rngs=nnx.Rngs(0), scan_layers=scan_layers))
            out.append((_equations(init), _equations(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)))
        return out

    (init2, fwd2), (init6, fwd6) = sizes(True)
    assert (init2, fwd2) == (init6, fwd6)
    (init2, fwd2), (init6, fwd6) = sizes(False)
    assert init6 > 2 * init2 and fwd6 > 2 * fwd2


@pytest.mark.parametrize("seed", [secrets.randbelow(2**31)])
def test_scanned_and_unrolled_models_agree_on_logits_and_gradients(seed):
    scanned = TransformerLM(TINY, rngs=nnx.Rngs(seed))
    unrolled = TransformerLM(TINY, rngs=nnx.Rngs(seed + 1), scan_layers=False)
    load_numpy_weights(unrolled, to_numpy_weights(scanned))
    tokens = random_tokens(seed)

    @nnx.jit
    def loss_and_grads(model):
        return nnx.value_and_grad(lambda m: cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]))(model)

    (loss_s, grads_s), (loss_u, grads_u) = loss_and_grads(scanned), loss_and_grads(unrolled)
    assert abs(float(loss_s) - float(loss_u)) <= 1e-6 * abs(float(loss_u))
    def as_weights(model, grads):  # gradients by stable name, through the model's own name table
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)
        return to_numpy_weights(nnx.merge(graphdef, grads, rest))

    got, want = as_weights(scanned, grads_s), as_weights(unrolled, grads_u)
    for name in want:
        assert relative_error(got[name], want[name]) <= 1e-5, name


# --- weight exchange -----------------------------------------------------------------------------------


def test_numpy_round_trip_is_exact():
    source = TransformerLM(TINY, rngs=nnx.Rngs(1))
    target = TransformerLM(TINY, rngs=nnx.Rngs(2))
    weights = to_numpy_weights(source)
    assert all(w.dtype == np.float32 for w in weights.values())
    load_numpy_weights(target, weights)
    again = to_numpy_weights(target)
    assert list(again) == list(weights)
    for name in weights:
        np.testing.assert_array_equal(again[name], weights[name], err_msg=name)
    tokens = random_tokens(0)
    np.testing.assert_array_equal(np.asarray(forward(target, tokens)), np.asarray(forward(source, tokens)))


def test_exported_linear_weights_are_in_torch_layout():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    weights = to_numpy_weights(model)
    assert weights["layers.0.ffn.w1.weight"].shape == (TINY.d_ff, TINY.d_model)  # (out, in)
    assert weights["lm_head.weight"].shape == (TINY.vocab_size, TINY.d_model)
    np.testing.assert_array_equal(weights["lm_head.weight"].T, np.asarray(model.lm_head.kernel.get_value()))


def test_load_rejects_wrong_names_and_shapes_and_changes_nothing():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    good = to_numpy_weights(model)
    other = to_numpy_weights(TransformerLM(TINY, rngs=nnx.Rngs(1)))

    missing = dict(other)
    del missing["layers.1.ffn.w3.weight"]
    with pytest.raises(ValueError, match="missing.*layers.1.ffn.w3.weight"):
        load_numpy_weights(model, missing)

    unexpected = {**other, "layers.2.ln1.weight": np.ones(TINY.d_model, np.float32)}
    with pytest.raises(ValueError, match="unexpected.*layers.2.ln1.weight"):
        load_numpy_weights(model, unexpected)

    renamed = dict(other)
    renamed["layers.0.attn.q.weight"] = renamed.pop("layers.0.attn.q_proj.weight")
    with pytest.raises(ValueError, match="q_proj"):
        load_numpy_weights(model, renamed)

    wrong_shape = {**other, "layers.0.ffn.w1.weight": other["layers.0.ffn.w1.weight"].T}  # (in, out): Flax layout
    with pytest.raises(ValueError, match="layers.0.ffn.w1.weight"):
        load_numpy_weights(model, wrong_shape)

    # The shape error came after other weights had been checked: still nothing may have been loaded.
    after = to_numpy_weights(model)
    for name in good:
        np.testing.assert_array_equal(after[name], good[name], err_msg=name)


# --- bad inputs ----------------------------------------------------------------------------------------


def test_sequence_longer_than_context_raises():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    model(random_tokens(0, seq=TINY.context_length))  # exactly the context length is fine
    with pytest.raises(ValueError, match="context_length"):
        model(random_tokens(0, seq=TINY.context_length + 1))


def test_unknown_attention_raises_with_the_accepted_names():
    with pytest.raises(ValueError, match="accepted: dot_product, dot_product_cudnn, naive, pallas_flash"):
        TransformerLM(TINY, rngs=nnx.Rngs(0), attention="flash")
    assert set(ATTENTION_BACKENDS) == {"naive", "dot_product", "dot_product_cudnn", "pallas_flash"}


def test_other_bad_inputs_raise():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="batch, seq"):
        model(jnp.zeros((8,), jnp.int32))
    with pytest.raises(ValueError, match="integers"):
        model(jnp.zeros((1, 8), jnp.float32))
    with pytest.raises(ValueError, match="arch"):
        TransformerLM(MODELS["xxl"], rngs=nnx.Rngs(0))


# --- numerics ------------------------------------------------------------------------------------------


def test_attention_backends_agree():
    naive = TransformerLM(TINY, rngs=nnx.Rngs(3), attention="naive")
    fused = TransformerLM(TINY, rngs=nnx.Rngs(3), attention="dot_product")  # same seed: same weights
    tokens = random_tokens(1)
    assert relative_error(forward(fused, tokens), forward(naive, tokens)) <= 1e-5


def test_cudnn_backend_is_never_a_silent_fallback():
    # On a machine without cuDNN the forced implementation fails loudly instead of quietly running XLA's.
    from jax_impl.attention import dot_product_cudnn_attention

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present: cuDNN may run")
    q = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="cuDNN"):
        dot_product_cudnn_attention(q, q, q)


def test_pallas_flash_matches_naive_forward_and_backward():
    # The Pallas kernels under the Pallas interpreter (the CPU branch of jax.lax.platform_dependent): the
    # same kernel code the GPU compiles, against the materialized softmax, values and all three gradients.
    from jax_impl.attention import naive_attention, pallas_flash_attention

    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32) for _ in range(3))
    cotangent = jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        out = {}
        for name, fn in (("naive", naive_attention), ("pallas", jax.jit(pallas_flash_attention))):
            value, vjp = jax.vjp(fn, q, k, v)
            out[name] = (value, *vjp(cotangent))
    for got, want in zip(out["pallas"], out["naive"]):
        assert relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("attention", ["naive", "dot_product"])
def test_bf16_compute_is_close_to_float32(attention):
    reference = TransformerLM(TINY, rngs=nnx.Rngs(4), attention=attention)
    # Same seed, so the same float32 parameters; only the compute dtype differs.
    bf16 = TransformerLM(TINY, rngs=nnx.Rngs(4), attention=attention, dtype=jnp.bfloat16)
    assert bf16.lm_head.kernel.get_value().dtype == jnp.float32
    tokens = random_tokens(2)
    logits = forward(bf16, tokens)
    assert logits.dtype == jnp.bfloat16  # logits come back in the compute dtype
    # bfloat16 keeps 8 significant bits, so each rounding is off by up to 2^-9 ~ 0.2 %; activations and
    # weights are rounded before every matmul (two blocks of 7 matmuls, then the head) and the residual
    # stream is kept in bf16, so errors of a few tenths of a percent up to ~1 % of the largest logit are
    # expected (measured 0.6-0.8 % over seeds on tiny, ~1.2 % for "small" at T=512 on a GPU). 3 % leaves
    # room for other seeds and still catches real bugs: a wrong layout or RoPE convention is off by O(1)
    # (test_parity.py).
    err = relative_error(logits.astype(jnp.float32), forward(reference, tokens))
    assert err <= 3e-2, f"bf16 vs float32 logits: relative error {err:.3g}"
    loss32, loss16 = float(cross_entropy(forward(reference, tokens), tokens)), float(cross_entropy(logits, tokens))
    assert abs(loss16 - loss32) <= 1e-2 * loss32, (loss16, loss32)


def test_bf16_parameters_forward_runs():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
    logits = forward(model, random_tokens(0))
    assert logits.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32))))
    weights = to_numpy_weights(model)  # exported as float32 all the same
    assert all(w.dtype == np.float32 for w in weights.values())


@pytest.mark.parametrize("attention", ["naive", "dot_product"])
def test_causality(attention):
    model = TransformerLM(TINY, rngs=nnx.Rngs(5), attention=attention)
    tokens = random_tokens(3, batch=2, seq=24)
    t = 10
    changed = tokens.at[:, t + 1:].set((tokens[:, t + 1:] + 1 + jnp.arange(24 - t - 1)) % TINY.vocab_size)
    before, after = np.asarray(forward(model, tokens)), np.asarray(forward(model, changed))
    np.testing.assert_allclose(after[:, : t + 1], before[:, : t + 1], rtol=0, atol=1e-6)
    assert np.abs(after[:, t + 1:] - before[:, t + 1:]).max() > 1e-2  # the later positions did change


def test_jit_matches_eager():
    model = TransformerLM(TINY, rngs=nnx.Rngs(6))
    tokens = random_tokens(4)
    assert relative_error(forward(model, tokens), model(tokens)) <= 1e-6


def test_cross_entropy_matches_numpy():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 7)
    x = np.asarray(logits, np.float64)
    log_probs = x - np.log(np.exp(x).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1).mean()
    assert float(cross_entropy(logits, targets)) == pytest.approx(expected, rel=1e-6)
    assert cross_entropy(logits.astype(jnp.bfloat16), targets).dtype == jnp.float32


def test_rope_table_is_not_a_parameter():
    model = TransformerLM(TINY, rngs=nnx.Rngs(0))
    assert model.rope.cos.get_value().shape == (TINY.context_length, TINY.d_head // 2)
    assert not isinstance(model.rope.cos, nnx.Param) and isinstance(model.rope.cos, jax_model.RopeTable)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lookup_gradient_sums_repeated_tokens_in_float32(dtype):
    """The embedding lookup's gradient against a float64 ``np.add.at`` on skewed ids (most of them repeated)."""
    rng = np.random.default_rng()
    vocab, d = 50, 8
    table = jnp.asarray(rng.standard_normal((vocab, d)), dtype)
    ids = rng.zipf(1.5, size=(4, 64)) % vocab  # a few rows take most tokens, as in text
    grad_out = rng.standard_normal((4, 64, d))
    expected = np.zeros((vocab, d))
    np.add.at(expected, ids.reshape(-1), np.asarray(jnp.asarray(grad_out, dtype), np.float64).reshape(-1, d))
    out, vjp = jax.vjp(lambda t: lookup(t, jnp.asarray(ids)), table)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(table)[ids])
    (grad,) = vjp(jnp.asarray(grad_out, dtype))
    assert grad.dtype == dtype
    rtol = 1e-5 if dtype == jnp.float32 else 2.0**-8  # float32 sums (of up to 256 terms), one rounding to dtype
    np.testing.assert_allclose(np.asarray(grad, np.float64), expected, rtol=rtol, atol=1e-5)
