"""The Transformer LM in JAX / Flax NNX, mirroring ``torch_impl/model.py`` layer for layer.

token embedding -> n_layers x [x + attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm -> untied LM head.
Attention is causal multi-head self-attention with rotary position embeddings (RoPE on ADJACENT feature
pairs (2k, 2k+1), as the PyTorch model) and a backend chosen by name from ``jax_impl.attention``
("naive" or "dot_product"). No biases anywhere. Initialization follows the PyTorch model: linear kernels
~ truncated normal with std sqrt(2 / (in + out)) cut at 3 std, embeddings ~ truncated normal std 1 cut
at 3, norm gains = 1 (the same distributions, not the same numbers: exchange weights to compare).

Public names:
* ``TransformerLM(spec, *, rngs, attention="naive", param_dtype=jnp.float32, dtype=None)``:
  ``model(token_ids (B, T) int, *, apply_block=None) -> logits (B, T, V)``. ``apply_block(block, x, rope)``
  replaces ``block(x, rope)`` for every block (the train step's hook for remat and sharding constraints,
  so those transforms stay outside the model). ``param_dtype`` is the storage dtype of the
  parameters, ``dtype`` the compute dtype (None: compute in ``param_dtype``), e.g. float32 parameters with
  bfloat16 compute. Logits come back in the compute dtype (as the PyTorch model returns its own dtype);
  ``cross_entropy`` upcasts them to float32. RMSNorm, RoPE and the naive softmax always run in float32.
* ``to_numpy_weights(model)`` / ``load_numpy_weights(model, weights)``: float32 numpy arrays keyed by the
  PyTorch model's ``named_parameters()`` names, linear weights in PyTorch's (out, in) layout (Flax stores
  kernels (in, out), so they are transposed on the way in and out). This module never imports torch.
* ``logical_axes(model)``: the logical axis names of every parameter, keyed by the same names, for the
  JAX layout (a kernel's names are (in, out)).
* ``copy_weights(source, target)``: every parameter by stable name, between scanned and unrolled models too.
* ``cross_entropy(logits, targets)``: mean next-token loss in float32.

Logical axes (MaxText style): every parameter is created through ``nnx.with_partitioning(init, names)``,
which stores the names in the variable's sharding metadata (``out_sharding`` in Flax 0.12), where
``nnx.get_partition_spec`` / ``nnx.get_named_sharding`` find them. A rules table elsewhere
(``jax_impl.sharding``) maps logical names to mesh axes; the model holds no mesh code. The names:

    "vocab"  the vocabulary dimension      token_embeddings (vocab, embed), lm_head (embed, vocab)
    "embed"  the residual stream, d_model  every matrix, norm gains (embed,)
    "heads"  n_heads * d_head (= d_model)  q/k/v kernels (embed, heads), output_proj (heads, embed)
    "mlp"    the SwiGLU hidden width d_ff  w1, w3 (embed, mlp), w2 (mlp, embed)

Caveats:
* Flax 0.12 shards variables eagerly when they carry sharding names and a mesh is in context; built with
  no mesh in context (``jax.sharding.get_abstract_mesh()`` empty), the model switches eager sharding off
  while it creates its parameters, so it builds as plain single-device arrays. Built under
  ``jax.set_mesh(mesh)`` it leaves Flax's default alone, and then ``nnx.logical_axis_rules`` must map the
  logical names onto the mesh axes.
* The RoPE tables (cos, sin for ``spec.context_length`` positions, computed in float64 and stored as
  float32 like the PyTorch buffers) are ``RopeTable`` variables, not ``nnx.Param``: filter state by
  ``nnx.Param`` to get the trainable parameters (the optimizer, parameter counts and weight exchange do).
* Sequences longer than ``spec.context_length`` raise a ValueError (shapes are static, so also under jit).

References: CS336 assignment 1 (2025); Su et al. 2021 (RoPE); Zhang & Sennrich 2019 (RMSNorm);
Shazeer 2020 (SwiGLU); MaxText's logical axis annotations; the Flax NNX "Scale up on multiple devices" guide.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_impl.attention import KEEP_THEIR_OUTPUT, get_attention
from parallelism_calc.specs import ModelSpec

# Logical axis names (see the module docstring for which parameter uses which).
VOCAB = "vocab"
EMBED = "embed"
HEADS = "heads"
MLP = "mlp"
# checkpoint_name tags of a block's intermediates, which remat policies name (jax_impl.train.REMAT_POLICIES):
ATTENTION_OUTPUT = "attention_output"  # the attention core's output (B, T, H, D)
QKV = ("query", "key", "value")  # the attention core's inputs (B, T, H, D), queries and keys after RoPE
MLP_GATE, MLP_UP = "mlp_gate", "mlp_up"  # SwiGLU's w1 x and w3 x (B, T, d_ff)
MLP_PRODUCT = "mlp_product"  # SiLU(w1 x) * w3 x, the input of w2 (B, T, d_ff)
NORMED = ("attention_input", "mlp_input")  # the outputs of ln1 and ln2 (B, T, d)
ATTENTION_RESIDUAL = "attention_residual"  # x + attn(ln1(x)), the input of ln2 (B, T, d)
LAYERS = "layers"  # the leading axis of the stacked block parameters (scan_layers); never sharded


def _truncated_normal(std: float):
    """Truncated normal with std ``std`` (of the untruncated normal), cut at +-3 std, like torch's trunc_normal_."""
    return nnx.initializers.truncated_normal(stddev=std, lower=-3.0, upper=3.0)


@contextlib.contextmanager
def _eager_sharding_only_under_a_mesh() -> Iterator[None]:
    """Create variables unsharded when no mesh is in context (logical names need a mesh and rules)."""
    if jax.sharding.get_abstract_mesh().empty:
        with nnx.use_eager_sharding(False):
            yield
    else:
        yield


class RopeTable(nnx.Variable):
    """A precomputed RoPE table (cos or sin): state of the model, never trained (not an ``nnx.Param``)."""


class Linear(nnx.Module):
    """y = x @ kernel without bias; kernel (in, out) ~ truncated normal, std sqrt(2 / (in + out)), cut at 3 std."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str, str], *, rngs: nnx.Rngs,
                 param_dtype, dtype):
        std = math.sqrt(2.0 / (in_features + out_features))
        init = nnx.with_partitioning(_truncated_normal(std), axes)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))  # (in, out)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.astype(self.dtype) @ self.kernel[...].astype(self.dtype)  # (..., in) -> (..., out)


@jax.custom_vjp
def lookup(table: jax.Array, token_ids: jax.Array) -> jax.Array:
    """``table[token_ids]`` whose gradient is summed into the table in float32 whatever the table's dtype.

    The gradient of a lookup adds each token's row into the table's row of that token: a scatter-add, whose
    atomic adds collide on the rows of frequent tokens. In bf16 (a ``bf16_mixed`` table) XLA emits them as
    compare-and-swap loops, which serialize under real text's skew (one H100, ``small``, 4,096 byte tokens per
    step: 13.8 ms, more than the rest of the step); float32 adds are native atomics."""
    return jnp.take(table, token_ids, axis=0)


def _lookup_fwd(table, token_ids):
    return lookup(table, token_ids), (table, token_ids)


def _lookup_bwd(residuals, grad):
    table, token_ids = residuals
    rows = grad.reshape(-1, table.shape[-1]).astype(jnp.float32)  # (B T, d)
    summed = jnp.zeros(table.shape, jnp.float32).at[token_ids.reshape(-1)].add(rows)
    return summed.astype(table.dtype), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


class Embedding(nnx.Module):
    """A lookup table (vocab, d_model) ~ truncated normal, std 1, cut at 3 (its gradient summed in float32)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, rngs: nnx.Rngs, param_dtype, dtype):
        init = nnx.with_partitioning(_truncated_normal(1.0), (VOCAB, EMBED))
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, embedding_dim), param_dtype))  # (V, d)
        self.dtype = dtype

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return lookup(self.embedding[...], token_ids).astype(self.dtype)  # (B, T) -> (B, T, d)


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * g, computed in float32 and cast back to the input dtype."""

    def __init__(self, d_model: int, eps: float, *, rngs: nnx.Rngs, param_dtype):
        init = nnx.with_partitioning(nnx.initializers.ones, (EMBED,))
        self.scale = nnx.Param(init(rngs.params(), (d_model,), param_dtype))  # (d,)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class RotaryEmbedding(nnx.Module):
    """RoPE on adjacent feature pairs (2k, 2k+1): rotate pair k of position i by i * theta^(-2k/d)."""

    def __init__(self, d_head: int, max_seq_len: int, theta: float):
        # float64 on the host, then float32, exactly as the PyTorch buffers are made.
        inv_freq = theta ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)  # (d/2,)
        angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq  # (T_max, d/2)
        self.cos = RopeTable(jnp.asarray(np.cos(angles).astype(np.float32)))
        self.sin = RopeTable(jnp.asarray(np.sin(angles).astype(np.float32)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (B, T, H, D) at positions 0..T-1 -> x rotated, same shape and dtype (math in float32)."""
        seq = x.shape[1]
        cos = self.cos[...][:seq, None, :]  # (T, 1, D/2), broadcasts over batch and heads
        sin = self.sin[...][:seq, None, :]
        return rotate_pairs(x, cos, sin)


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (B, T, H, D) with each pair (2k, 2k+1) rotated by the angle whose tables cos, sin (T, 1, D/2) hold, math
    in float32, result in x's dtype.

    One elementwise expression over the pairs and the pairs swapped, which XLA makes one loop fusion at memory
    bandwidth forward and backward; a stack of the two rotated halves was a concatenate fusion at about half of
    it (one H100, xl 4 x 2,048: RoPE 4.8 -> 3.2 ms a step; notes/jax.md, session 16)."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)  # (B, T, H, D/2, 2): (x_2k, x_2k+1)
    signed_sin = sin[..., None] * jnp.array([-1.0, 1.0], jnp.float32)
    return (pairs * cos[..., None] + pairs[..., ::-1] * signed_sin).reshape(x.shape).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with RoPE on queries and keys; the kernel comes from the registry."""

    def __init__(self, spec: ModelSpec, attention: str, *, rngs: nnx.Rngs, param_dtype, dtype):
        d = spec.d_model
        self.n_heads = spec.n_heads
        self.q_proj = Linear(d, d, (EMBED, HEADS), rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.k_proj = Linear(d, d, (EMBED, HEADS), rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.v_proj = Linear(d, d, (EMBED, HEADS), rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.output_proj = Linear(d, d, (HEADS, EMBED), rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.attention_name = attention

    def __call__(self, x: jax.Array, rope: RotaryEmbedding) -> jax.Array:
        batch, seq, d_model = x.shape
        heads = (batch, seq, self.n_heads, d_model // self.n_heads)  # (B, T, H, D)
        q = checkpoint_name(rope(self.q_proj(x).reshape(heads)), QKV[0])
        k = checkpoint_name(rope(self.k_proj(x).reshape(heads)), QKV[1])
        v = checkpoint_name(self.v_proj(x).reshape(heads), QKV[2])
        out = get_attention(self.attention_name)(q, k, v)  # (B, T, H, D)
        if self.attention_name not in KEEP_THEIR_OUTPUT:
            out = checkpoint_name(out, ATTENTION_OUTPUT)
        return self.output_proj(out.reshape(batch, seq, d_model))  # (B, T, d)


class SwiGLU(nnx.Module):
    """w2(SiLU(w1 x) * w3 x)."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, param_dtype, dtype):
        self.w1 = Linear(d_model, d_ff, (EMBED, MLP), rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, (MLP, EMBED), rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, (EMBED, MLP), rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = checkpoint_name(self.w1(x), MLP_GATE), checkpoint_name(self.w3(x), MLP_UP)  # (B, T, d_ff)
        return self.w2(checkpoint_name(jax.nn.silu(gate) * up, MLP_PRODUCT))  # (B, T, d)


class TransformerBlock(nnx.Module):
    """Pre-norm block: x + attn(RMSNorm(x)), then + SwiGLU(RMSNorm(x))."""

    def __init__(self, spec: ModelSpec, attention: str, *, rngs: nnx.Rngs, param_dtype, dtype):
        self.ln1 = RMSNorm(spec.d_model, spec.norm_eps, rngs=rngs, param_dtype=param_dtype)
        self.attn = CausalSelfAttention(spec, attention, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.ln2 = RMSNorm(spec.d_model, spec.norm_eps, rngs=rngs, param_dtype=param_dtype)
        self.ffn = SwiGLU(spec.d_model, spec.d_ff, rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    def __call__(self, x: jax.Array, rope: RotaryEmbedding) -> jax.Array:
        x = checkpoint_name(x + self.attn(checkpoint_name(self.ln1(x), NORMED[0]), rope), ATTENTION_RESIDUAL)
        return x + self.ffn(checkpoint_name(self.ln2(x), NORMED[1]))


# ``apply_block(block, x, rope) -> block(x, rope)``, or a transform of it: the hook through which a train
# step rematerializes blocks or pins activation shardings from outside (the model stays single-device).
ApplyBlock = Callable[["TransformerBlock", jax.Array, RotaryEmbedding], jax.Array]


def _call_block(block: TransformerBlock, x: jax.Array, rope: RotaryEmbedding) -> jax.Array:
    return block(x, rope)


class TransformerLM(nnx.Module):
    """Causal Transformer LM: token ids (B, T) -> logits (B, T, vocab) in the compute dtype."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs, attention: str = "naive", param_dtype=jnp.float32,
                 dtype=None, scan_layers: bool = True):
        if spec.arch != "transformer":
            raise ValueError(f"TransformerLM needs arch='transformer'; spec {spec.name!r} is {spec.arch!r}")
        get_attention(attention)  # fail early, with the list of backends
        self.spec = spec
        self.attention_name = attention
        self.param_dtype = jnp.dtype(param_dtype)
        self.dtype = jnp.dtype(dtype if dtype is not None else param_dtype)  # compute dtype
        kw = dict(rngs=rngs, param_dtype=self.param_dtype, dtype=self.dtype)
        with _eager_sharding_only_under_a_mesh():
            # One RoPE table shared by every block (passed to each call), never trained.
            self.rope = RotaryEmbedding(spec.d_head, spec.context_length, spec.rope_theta)
            self.token_embeddings = Embedding(spec.vocab_size, spec.d_model, **kw)
            if scan_layers:  # one block whose parameters carry a leading (n_layers,) axis
                self.layers = _stacked_blocks(spec, attention, rngs, self.param_dtype, self.dtype)
            else:
                self.layers = nnx.List([TransformerBlock(spec, attention, **kw) for _ in range(spec.n_layers)])
            self.ln_final = RMSNorm(spec.d_model, spec.norm_eps, rngs=rngs, param_dtype=self.param_dtype)
            self.lm_head = Linear(spec.d_model, spec.vocab_size, (EMBED, VOCAB), **kw)

    def __call__(self, token_ids: jax.Array, *, apply_block: ApplyBlock | None = None) -> jax.Array:
        """Logits (B, T, V) of ``token_ids`` (B, T); ``apply_block`` (see ``ApplyBlock``) runs each block."""
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be (batch, seq), got shape {tuple(token_ids.shape)}")
        if not jnp.issubdtype(token_ids.dtype, jnp.integer):
            raise ValueError(f"token_ids must be integers, got dtype {token_ids.dtype}")
        self.spec.check_seq_len(token_ids.shape[1])
        apply_block = apply_block or _call_block
        x = self.token_embeddings(token_ids)  # (B, T, d)
        if self.scan_layers:
            block_def, stacked = nnx.split(self.layers)
            stacked = _kernels_in(stacked, self.dtype)  # one cast of every layer's weights, not one per layer

            def one_layer(x, layer_state):  # layer_state: the stacked state's slice of one layer
                return apply_block(nnx.merge(block_def, layer_state), x, self.rope), None

            x, _ = jax.lax.scan(one_layer, x, stacked)  # (B, T, d)
        else:
            for layer in self.layers:
                x = apply_block(layer, x, self.rope)  # (B, T, d)
        return self.lm_head(self.ln_final(x))  # (B, T, V)

    @property
    def scan_layers(self) -> bool:
        """Whether ``layers`` is one block of stacked parameters run by ``jax.lax.scan`` (else a list)."""
        return isinstance(self.layers, TransformerBlock)


def _kernels_in(state: nnx.State, dtype) -> nnx.State:
    """``state`` with its linear kernels cast to ``dtype`` (the compute dtype), the norm gains left as they are
    (RMSNorm uses them in float32). Each Linear would cast its kernel anyway, so the values are the same;
    cast once for the stacked weights of all layers, the backward pass reuses the copy instead of casting
    every layer's weights again, and each weight gradient reaches float32 in one conversion of the stack."""

    def cast(path, variable):
        value = variable.get_value()
        return variable.replace(value.astype(dtype)) if path[-1] == "kernel" and value.dtype != dtype else variable

    return nnx.map_state(cast, state)


def _stacked_blocks(spec: ModelSpec, attention: str, rngs: nnx.Rngs, param_dtype, dtype) -> TransformerBlock:
    """``spec.n_layers`` blocks as one, every parameter stacked on a leading "layers" axis: one vmapped
    initializer (each layer its own split of the key), so initialization and compilation do not grow with
    depth (MaxText's ``scan_layers``)."""

    @nnx.split_rngs(splits=spec.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def make(rngs: nnx.Rngs) -> TransformerBlock:
        return TransformerBlock(spec, attention, rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    return make(rngs)


# ----------------------------------------------------------------------------------------------------
# Stable names, logical axes and weight exchange with the PyTorch model
# ----------------------------------------------------------------------------------------------------


class _Entry(NamedTuple):
    """Where a stable PyTorch name lives: a Flax parameter, its layer on the stacked axis (None: not
    stacked) and whether the PyTorch layout is the transpose (linear kernels)."""

    param: nnx.Param
    layer: int | None
    transpose: bool


def _param_table(model: TransformerLM) -> dict[str, _Entry]:
    """Stable PyTorch name -> ``_Entry``, in torch's ``named_parameters()`` order."""
    table = {"token_embeddings.weight": _Entry(model.token_embeddings.embedding, None, False)}
    blocks = ([(model.layers, i) for i in range(model.spec.n_layers)] if model.scan_layers
              else [(layer, None) for layer in model.layers])
    for i, (block, layer) in enumerate(blocks):
        table[f"layers.{i}.ln1.weight"] = _Entry(block.ln1.scale, layer, False)
        for proj in ("q_proj", "k_proj", "v_proj", "output_proj"):
            table[f"layers.{i}.attn.{proj}.weight"] = _Entry(getattr(block.attn, proj).kernel, layer, True)
        table[f"layers.{i}.ln2.weight"] = _Entry(block.ln2.scale, layer, False)
        for w in ("w1", "w2", "w3"):
            table[f"layers.{i}.ffn.{w}.weight"] = _Entry(getattr(block.ffn, w).kernel, layer, True)
    table["ln_final.weight"] = _Entry(model.ln_final.scale, None, False)
    table["lm_head.weight"] = _Entry(model.lm_head.kernel, None, True)
    return table


def axis_names(param: nnx.Variable) -> tuple[str, ...]:
    """The logical names stored by ``nnx.with_partitioning`` (``out_sharding``; older 0.12 keys as fallback)."""
    metadata = param.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if metadata.get(key):
            return tuple(metadata[key])
    return ()


def logical_axes(model: TransformerLM) -> dict[str, tuple[str, ...]]:
    """Logical axis names of every parameter (JAX layout: kernels (in, out)), keyed by the stable names; one
    layer's names for a stacked parameter (its leading "layers" axis left out)."""
    return {name: axis_names(e.param)[e.layer is not None:] for name, e in _param_table(model).items()}


def to_numpy_weights(model: TransformerLM) -> dict[str, np.ndarray]:
    """Every parameter as a float32 numpy array keyed by its stable name, in PyTorch layout ((out, in) linears)."""
    host: dict[int, np.ndarray] = {}  # one fresh host copy per Flax parameter (a stacked one serves all layers)
    weights = {}
    for name, entry in _param_table(model).items():
        key = id(entry.param)
        if key not in host:
            host[key] = np.asarray(jax.device_get(entry.param.get_value())).astype(np.float32)
        value = host[key] if entry.layer is None else host[key][entry.layer]
        weights[name] = np.ascontiguousarray(value.T if entry.transpose else value)
    return weights


def load_numpy_weights(model: TransformerLM, weights: dict[str, np.ndarray]) -> None:
    """Copy weights (PyTorch names and layout, as from ``to_numpy_weights``) into ``model`` in place.

    Names and shapes must match exactly (else a ValueError, and nothing is changed); values are cast to the
    model's parameter dtype and placed with each parameter's current sharding (a stacked parameter is
    assembled from its layers' weights).
    """
    table = _param_table(model)
    missing, unexpected = sorted(set(table) - set(weights)), sorted(set(weights) - set(table))
    if missing or unexpected:
        raise ValueError(f"weight names differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    parts: dict[int, tuple[nnx.Param, dict[int | None, np.ndarray]]] = {}  # Flax parameter -> layer -> value
    for name, entry in table.items():
        value = np.asarray(weights[name])
        value = value.T if entry.transpose else value  # PyTorch (out, in) -> Flax (in, out)
        shape = tuple(entry.param.get_value().shape)[entry.layer is not None:]
        if value.shape != shape:
            expected = shape[::-1] if entry.transpose else shape
            raise ValueError(
                f"weight {name!r}: shape {np.asarray(weights[name]).shape} != parameter shape {expected} "
                f"(PyTorch layout)"
            )
        parts.setdefault(id(entry.param), (entry.param, {}))[1][entry.layer] = value
    new_values = []
    for param, layers in parts.values():
        current = param.get_value()
        value = layers[None] if None in layers else np.stack([layers[i] for i in range(len(layers))])
        value = value.astype(current.dtype)  # each device (of any process) takes its shard of the host copy
        new_values.append((param, jax.make_array_from_callback(value.shape, current.sharding,
                                                               lambda i, v=value: v[i])))
    for param, value in new_values:
        param.set_value(value)


def copy_weights(source: TransformerLM, target: TransformerLM) -> None:
    """Set every parameter and RoPE table of ``target`` to ``source``'s, by stable name, in place; either model
    may be scanned or unrolled (a stacked parameter gives or takes one slice per layer). Works under a trace
    (e.g. a jitted initializer that draws the scanned model's weights and returns an unrolled model's)."""
    if source.spec != target.spec:
        raise ValueError(f"copy_weights needs the same spec, got {source.spec.name!r} and {target.spec.name!r}")
    sources, targets = _param_table(source), _param_table(target)
    value_of = {}  # one read of each source parameter
    layers: dict[int, tuple[nnx.Param, dict[int | None, jax.Array]]] = {}  # target parameter -> layer -> value
    for name, entry in sources.items():
        key = id(entry.param)
        if key not in value_of:
            value_of[key] = entry.param.get_value()
        value = value_of[key] if entry.layer is None else value_of[key][entry.layer]
        want = targets[name]
        layers.setdefault(id(want.param), (want.param, {}))[1][want.layer] = value
    for param, values in layers.values():
        value = values[None] if None in values else jnp.stack([values[i] for i in range(len(values))])
        param.set_value(value.astype(param.get_value().dtype))
    for table in ("cos", "sin"):
        getattr(target.rope, table).set_value(getattr(source.rope, table).get_value())


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32: logits (B, T, V), targets (B, T) int -> scalar."""
    logits = logits.astype(jnp.float32)
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
    return jnp.mean(log_normalizer - target_logits)
