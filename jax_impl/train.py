"""A sharded, jitted training step for the Flax model: AdamW over a (dp, fsdp, tp) mesh, MaxText style.

``ShardedTrainer`` owns the model state (split into a graphdef, the trainable ``nnx.Param`` state and the
rest, i.e. the RoPE tables), the optax AdamW state and one jitted step:

    tokens (B, T+1) int  --device_put with batch_sharding-->  inputs (B, T), targets (B, T)
    loss, grads = value_and_grad(cross_entropy(model(inputs), targets))     # fp32 loss
                  (the mean over grad_accum micro-batches, lax.scan, when accumulating)
    grads = with_sharding_constraint(grads, param shardings)                # see sharding.py's docstring
    params, opt_state = [clip_by_global_norm ->] AdamW(grads, opt_state, params)   # fp32 master weights

Public names:
* ``ShardedTrainer(spec, mesh, strategy, *, lr, weight_decay=0.0, seed=0, compute_dtype=None, param_dtype=None,
  remat="none", attention="naive", b1=0.9, b2=0.999, eps=1e-8, block_loop="scan", grad_clip=0.0,
  grad_accum=1)``: ``lr`` a number or an optax schedule (a function of the update count, from 0);
  ``grad_clip > 0`` chains ``optax.clip_by_global_norm`` before AdamW (the norm over every parameter, as
  torch's ``clip_grad_norm_``);
  - parameters are created already sharded (``jax_impl.sharding.create_sharded_model``: no device ever
    holds a full copy of a sharded parameter); the AdamW state is created by a jitted ``tx.init`` whose
    ``out_shardings`` give each moment (mu, nu) its parameter's sharding and the step count replicated;
  - ``.step(tokens) -> loss`` (a float32 scalar ``jax.Array``; ``float()`` it to wait): places the batch
    with ``batch_sharding(mesh, strategy)`` (ValueError if B is not divisible by the data-parallel degree
    dp x fsdp, or tokens are not a 2-D integer array with T+1 >= 2), runs the jitted step, keeps the new
    params / optimizer state. With ``grad_accum`` A > 1 the B rows are A micro-batches of B / A rows in
    order (rows ``[j B/A, (j+1) B/A)`` are micro-batch j), each split over the data-parallel devices;
  - ``block_loop`` (``BLOCK_LOOPS``): "scan" (default), "unrolled" or "per_block" (``jax_impl.per_block``:
    the host runs one compiled program per span of ``blocks_per_program`` blocks (default
    ``jax_impl.per_block.BLOCKS_PER_PROGRAM``); ``.train_step`` is then a ``PerBlockStep``);
  - ``.compile(batch_size, seq_len) -> seconds``: compile the step ahead of time for that batch shape;
  - ``.eval_loss(tokens) -> loss``: the mean loss of a (B, T+1) batch, no update (a jitted forward);
  - ``.load_weights(weights)``: start from numpy weights keyed by the stable names (e.g. PyTorch's);
  - ``.model``: an ``nnx.Module`` view of the current state (for ``assert_params_sharded``,
    ``to_numpy_weights``, evaluation); ``.master_model``: the float32 weights the optimizer updates (the
    masters, below); ``.params`` / ``.opt_state`` / ``.rest``: the raw states;
    ``.param_shardings`` / ``.opt_shardings`` / ``.batch_sharding``: the shardings used;
    ``.train_step``: the jitted function ``(params, opt_state, rest, tokens) -> (params, opt_state, loss)``
    (params and opt_state donated).
* ``MasterState(master, inner)``, ``optimizer_update(tx, grads, opt_state, params)``, ``cast_params``: the
  optimizer step with or without float32 master weights (below).
* ``make_train_step(graphdef, tx, param_shardings, opt_shardings, rest_shardings, batch_sharding, *,
  remat="none", grad_accum=1)``: that jitted function on its own, for callers (benchmarks) that hold their own
  state; with ``grad_accum`` A > 1 its tokens are (A, B / A, T+1), placed with ``micro_batch_sharding``.
* ``dtype_arguments(dtype)`` / ``matmul_precision(dtype)``: what a ``--dtype`` means here; ``step_name(...)``:
  how records name a step.
* ``make_loss_fn(graphdef, batch_sharding, *, remat="none")``: its loss ``(params, rest, tokens) -> loss``
  (for forward-only or forward+backward benchmarks); ``block_transform(*, remat="none",
  activation_sharding=None, prevent_cse=True)``: the model hook it uses (below); ``REMAT_POLICIES``: the
  names ``remat`` accepts.

Precision: parameters are stored in float32 (the master weights); ``compute_dtype=jnp.bfloat16`` builds
the model with ``dtype=bfloat16``, so every matmul casts its operands to bf16 while RMSNorm, RoPE, the
softmax and the loss stay float32 (``jax_impl.model``). Gradients come back in float32 (the parameters'
dtype) and AdamW updates the float32 weights. ``param_dtype=jnp.bfloat16`` (the benchmarks' ``--dtype
bf16_mixed``, PyTorch's ``MasterAdamW`` twin; Micikevicius et al. 2018) stores the parameters in bf16, so
neither the forward nor the backward casts a weight and the gradients come back in bf16; the optimizer
state is a ``MasterState``: float32 masters (the initial weights, drawn in float32) and AdamW's moments,
and each step updates the masters and writes their bf16 rounding as the new parameters.

Activations and rematerialization: the step calls the model with ``apply_block=block_transform(...)``
(the model's hook, so model code stays single-device and transform-free). It pins every block's input and
output (B, T, d) to the batch sharding (batch over the rules' "batch" axes, T and d replicated: the
Megatron layout between blocks), and unless ``remat="none"`` wraps each block in ``jax.checkpoint`` (over
the block's split state; ``nnx.remat`` trips over the RoPE table shared by all blocks) with a policy of what
to keep for the backward pass: "full" keeps only the block inputs, "dots" the outputs of the weight
products, "dots_attention" those and the attention output, "qkv_mlp" (by the model's ``checkpoint_name``
tags) the attention's inputs after RoPE and its results and SwiGLU's two products, "qkv_mlp_norms" those
and the norms' outputs and the residual between attention and MLP, "qkv_mlp_norms_product" also SwiGLU's
elementwise product; the rest of each block is recomputed. With
``block_loop="scan"`` (the default) the blocks are one ``lax.scan`` over stacked parameters
(``jax_impl.model``), so tracing, compiling and initializing do not grow with depth; the policy then also
decides what the scan stacks per layer.

References: MaxText ``train.py`` (``train_step``: jit with in/out shardings from the logical-axis rules,
donated state, fp32 loss; its ``gradient_accumulation_steps`` scan) and ``maxtext_utils.get_abstract_state``
(optimizer state sharded like the parameters); the Flax NNX "Scale up on multiple devices" guide (``nnx.split`` / jitted init with
``out_shardings``); the optax ``tree_map_params`` docs; Chen et al. 2016 (gradient checkpointing).

Caveats:
* Axis types are Auto (``jax_impl.sharding``): GSPMD propagates shardings inside a block from the
  parameters and the pinned block inputs (token ids and block boundaries, above). Under Auto axes GSPMD
  may pick replicated gradients for some parameters, hence the explicit gradient constraint; the jit's
  ``out_shardings`` then pin the new parameters and moments to the rules' shardings.
* On meshes with dp, fsdp and tp all above 1, XLA's SPMD partitioner (seen with JAX 0.10 on CPU) warns of
  "involuntary full rematerialization" for a few backward cotangents it reshards from the batch split to
  the fsdp-split embed dim (with or without the block constraints): correct, but extra communication.
  fsdp x tp and dp x tp meshes do not show it.
* Donation: params and opt_state passed to ``train_step`` are invalid after the call (their buffers are
  reused); ``ShardedTrainer.step`` swaps in the new state, so never keep references to old leaves. On
  backends that cannot donate (older CPU jaxlibs) JAX warns and copies instead.
* The loss is the mean over all B x T tokens of the global batch (the same number on any mesh), so sharded
  and single-device runs take identical steps up to float reassociation in the reductions; compare them
  at ``jax.default_matmul_precision("highest")``, since TPU/GPU defaults use bf16/TF32 matmul passes.
* Gradient accumulation is a ``lax.scan`` over the micro-batches inside the one jitted step (one compile,
  gradients summed in float32 then divided by A: the mean over the global batch, as the PyTorch trainer's
  loss / grad_accum per micro-batch, equal to float round-off). Multi-host data loading is not here (the
  global batch is placed from one host). The training loop (epochs, schedule, checkpoints) is
  ``jax_impl.trainer``.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.model import (ATTENTION_OUTPUT, ATTENTION_RESIDUAL, MLP_GATE, MLP_PRODUCT, MLP_UP, NORMED, QKV,
                            ApplyBlock, TransformerLM, cross_entropy, load_numpy_weights)
from jax_impl.sharding import batch_sharding, create_sharded_model, param_shardings
from parallelism_calc.specs import ModelSpec


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _saved_attention(prim, *_, **params) -> bool:
    """The attention core's results: our backends' output (named ``ATTENTION_OUTPUT`` in the model), or
    what cuDNN's fused forward returns for its backward (output and softmax statistics; its output is not
    also named), so that the backward pass never runs the attention forward again."""
    return prim.name.startswith("dot_product_attention_fwd") or (
        prim.name == "name" and params.get("name") == ATTENTION_OUTPUT)


def _saving(*names: str):
    """A policy keeping the intermediates tagged ``names`` (``jax_impl.model``) and the attention's results."""
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(*names), _saved_attention)


# --remat: what each block keeps for the backward pass; the rest is recomputed there (jax.checkpoint policies).
REMAT_POLICIES = {
    "none": None,  # no rematerialization: every residual is kept
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the weight products' outputs
    "dots_attention": jax.checkpoint_policies.save_from_both_policies(  # those and the attention's results
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        _saved_attention),
    # By name: the attention's inputs (after RoPE) and results and SwiGLU's two products; the norms, RoPE and
    # SwiGLU's product are recomputed ...
    "qkv_mlp": _saving(*QKV, MLP_GATE, MLP_UP),
    # ... or those and the norms' outputs and the residual stream between attention and MLP (only SwiGLU's
    # elementwise product is recomputed) ...
    "qkv_mlp_norms": _saving(*QKV, MLP_GATE, MLP_UP, *NORMED, ATTENTION_RESIDUAL),
    # ... or also that product, as PyTorch's autograd keeps it (the backward then writes no (B, T, d_ff) tensor
    # beyond the two gradients).
    "qkv_mlp_norms_product": _saving(*QKV, MLP_GATE, MLP_UP, MLP_PRODUCT, *NORMED, ATTENTION_RESIDUAL),
}


# How a step runs the blocks: "scan": one lax.scan over stacked parameters inside the step's one program (init
# and compile do not grow with depth); "unrolled": a Python loop over separate blocks traced into that program
# (its compile grows with depth); "per_block": separate blocks, the host calling one compiled forward and one
# compiled backward per block (``jax_impl.per_block``: no stacks and so none of the scan's copies).
BLOCK_LOOPS = ("scan", "unrolled", "per_block")


def check_block_loop(block_loop: str) -> str:
    if block_loop not in BLOCK_LOOPS:
        raise ValueError(f"block_loop {block_loop!r}; accepted: {', '.join(BLOCK_LOOPS)}")
    return block_loop


def check_remat(remat: str) -> str:
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat {remat!r}; accepted: {', '.join(REMAT_POLICIES)}")
    return remat


def block_transform(*, remat: str = "none", activation_sharding: NamedSharding | None = None,
                    prevent_cse: bool = True) -> ApplyBlock:
    """The ``apply_block`` hook of ``TransformerLM.__call__`` for a train step: pins each block's input and
    output (B, T, d) to ``activation_sharding`` (batch split, the rest replicated), and unless ``remat`` is
    "none" wraps each block in ``jax.checkpoint`` with that ``REMAT_POLICIES`` policy. ``prevent_cse=False``
    is safe (and faster) where the blocks run inside ``lax.scan`` (the ``jax.checkpoint`` docs)."""
    policy = REMAT_POLICIES[check_remat(remat)]

    def constrain(x: jax.Array) -> jax.Array:
        return x if activation_sharding is None else jax.lax.with_sharding_constraint(x, activation_sharding)

    def plain(block, x, rope):
        return constrain(block(constrain(x), rope))

    def rematerialized(block, x, rope):
        # jax.checkpoint over a pure function of the block's state (nnx.remat would try to write the shared
        # RoPE table back into the outer trace); the state arrays are the traced parameters, so gradients flow.
        block_def, block_state = nnx.split(block)
        rope_def, rope_state = nnx.split(rope)

        @functools.partial(jax.checkpoint, policy=policy, prevent_cse=prevent_cse)
        def run(block_state, rope_state, x):
            return plain(nnx.merge(block_def, block_state), x, nnx.merge(rope_def, rope_state))

        return run(block_state, rope_state, x)

    return plain if remat == "none" else rematerialized


def opt_state_shardings(tx: optax.GradientTransformation, params: nnx.State, p_shardings: nnx.State,
                        mesh: Mesh):
    """Shardings for ``tx.init(params)``: every parameter-shaped leaf (AdamW's mu, nu) like its parameter,
    everything else (the step count) replicated."""
    abstract = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract, p_shardings,
        transform_non_params=lambda _: replicated, is_leaf=_is_variable)


class MasterState(NamedTuple):
    """The optimizer state when the parameters are stored in bf16 (``--dtype bf16_mixed``): their float32
    master copies and the inner optimizer's state (AdamW's moments), which updates the masters."""

    master: Any
    inner: Any


def cast_params(params, dtype):
    """``params`` with every floating-point leaf cast to ``dtype``."""
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def optimizer_update(tx: optax.GradientTransformation, grads, opt_state, params):
    """One optimizer step: ``tx`` on the parameters, or, under a ``MasterState``, on their float32 masters, the
    parameters then being the new masters rounded to their own dtype (as PyTorch's ``MasterAdamW``): one pass
    that reads the bf16 gradient, master and moments and writes them and the bf16 weight back."""
    if isinstance(opt_state, MasterState):
        updates, inner = tx.update(cast_params(grads, jnp.float32), opt_state.inner, opt_state.master)
        master = optax.apply_updates(opt_state.master, updates)
        params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
        return params, MasterState(master, inner)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def make_loss_fn(graphdef, tokens_sharding: NamedSharding, *, remat: str = "none"):
    """``loss_fn(params, rest, tokens (B, T+1)) -> float32 loss`` (inputs ``[:, :-1]``, targets ``[:, 1:]``):
    the tokens pinned to ``tokens_sharding``, every block's activations to the batch sharding, the blocks
    rematerialized by ``REMAT_POLICIES[remat]``."""
    activations = NamedSharding(tokens_sharding.mesh, P(*tokens_sharding.spec[:1], None, None))  # (B, T, d)
    check_remat(remat)

    def loss_fn(params, rest, tokens):
        tokens = jax.lax.with_sharding_constraint(tokens, tokens_sharding)  # (B, T+1), batch split
        model = nnx.merge(graphdef, params, rest)
        apply_block = block_transform(remat=remat, activation_sharding=activations,
                                      prevent_cse=not model.scan_layers)
        logits = model(tokens[:, :-1], apply_block=apply_block)  # (B, T, V), compute dtype
        return cross_entropy(logits, tokens[:, 1:])  # float32

    return loss_fn


def micro_batch_sharding(tokens_sharding: NamedSharding) -> NamedSharding:
    """The sharding of accumulated tokens (A, B / A, T+1): micro-batches whole on every device, each split as
    ``tokens_sharding`` splits a batch."""
    return NamedSharding(tokens_sharding.mesh, P(None, *tokens_sharding.spec))


def make_train_step(graphdef, tx: optax.GradientTransformation, p_shardings, o_shardings, rest_shardings,
                    tokens_sharding: NamedSharding, *, remat: str = "none", grad_accum: int = 1):
    """The jitted step ``(params, opt_state, rest, tokens) -> (params, opt_state, loss)``: tokens (B, T+1), or
    (grad_accum, B / grad_accum, T+1) micro-batches whose mean loss and gradient make one update.

    params and opt_state are donated; in/out shardings are pinned to the given ones (the loss replicated).
    """
    if not grad_accum >= 1:
        raise ValueError(f"grad_accum={grad_accum} must be >= 1")
    replicated = NamedSharding(tokens_sharding.mesh, P())
    loss_fn = make_loss_fn(graphdef, tokens_sharding, remat=remat)

    def loss_and_grads(params, rest, tokens):
        if grad_accum == 1:
            return jax.value_and_grad(loss_fn)(params, rest, tokens)

        def add_micro_batch(total, micro_tokens):  # micro_tokens (B / A, T+1)
            loss_and_grad = jax.value_and_grad(loss_fn)(params, rest, micro_tokens)
            return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, loss_and_grad), None

        # Sums in float32 whatever the parameters' dtype (bf16 weights' gradients too).
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (jnp.zeros(()), params))
        total, _ = jax.lax.scan(add_micro_batch, zeros, tokens)
        return jax.tree.map(lambda x: x / grad_accum, total)

    def train_step(params, opt_state, rest, tokens):
        loss, grads = loss_and_grads(params, rest, tokens)
        grads = jax.lax.with_sharding_constraint(grads, p_shardings)  # grads follow the params
        params, opt_state = optimizer_update(tx, grads, opt_state, params)
        return params, opt_state, loss

    step_tokens = tokens_sharding if grad_accum == 1 else micro_batch_sharding(tokens_sharding)
    return jax.jit(
        train_step,
        in_shardings=(p_shardings, o_shardings, rest_shardings, step_tokens),
        out_shardings=(p_shardings, o_shardings, replicated),
        donate_argnums=(0, 1),
    )


def dtype_arguments(dtype: str) -> dict[str, Any]:
    """``ShardedTrainer``'s ``compute_dtype`` and ``param_dtype`` for a ``--dtype`` (``analysis.harness.DTYPES``):
    fp32 computes in float32; bf16 computes in bf16 over float32 weights; bf16_mixed stores bf16 weights with
    float32 masters (``MasterState``)."""
    return {"compute_dtype": None if dtype == "fp32" else jnp.bfloat16,
            "param_dtype": jnp.bfloat16 if dtype == "bf16_mixed" else None}


def matmul_precision(dtype: str) -> str:
    """``jax.default_matmul_precision`` for a ``--dtype``: "highest" for fp32 (float32 products, as PyTorch's
    default; JAX's default on a GPU would use TF32 passes), else "default"."""
    return "highest" if dtype == "fp32" else "default"


def step_name(attention: str, remat: str, *, block_loop: str = "scan", strategy: str | None = None) -> str:
    """How records name a JAX step: e.g. "jit naive", "jit dot_product remat:dots fsdp_tp" (``strategy``: on a
    mesh of several devices), "... unrolled" or "... per_block" where the blocks do not run as a scan
    (``BLOCK_LOOPS``)."""
    remat_part = {"none": "", "full": " remat"}.get(remat, f" remat:{remat}")
    name = f"jit {attention}{remat_part}" + ("" if check_block_loop(block_loop) == "scan" else f" {block_loop}")
    return name if strategy is None else f"{name} {strategy}"


class ShardedTrainer:
    """AdamW training of ``TransformerLM(spec)`` on ``mesh`` under ``strategy``'s rules (module docstring)."""

    def __init__(self, spec: ModelSpec, mesh: Mesh, strategy: str, *, lr: float, weight_decay: float = 0.0,
                 seed: int = 0, compute_dtype=None, param_dtype=None, remat: str = "none",
                 attention: str = "naive", b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                 block_loop: str = "scan", grad_clip: float = 0.0, grad_accum: int = 1,
                 blocks_per_program: int | None = None):
        self.spec, self.mesh, self.strategy, self.grad_accum = spec, mesh, strategy, grad_accum
        self.block_loop = check_block_loop(block_loop)
        self.param_dtype = jnp.dtype(param_dtype or jnp.float32)
        if self.param_dtype != jnp.float32 and compute_dtype is None:
            compute_dtype = self.param_dtype  # low-precision weights compute in their own dtype
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        self.remat = check_remat(remat)
        model = create_sharded_model(spec, mesh, strategy, seed=seed, attention=attention, dtype=compute_dtype,
                                     scan_layers=block_loop == "scan")  # float32 weights, drawn as PyTorch draws them
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.param_shardings = param_shardings(params, mesh, strategy)
        self.rest_shardings = param_shardings(self.rest, mesh, strategy)  # no logical names: replicated
        self.batch_sharding = batch_sharding(mesh, strategy)
        self.tx = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)  # torch's AdamW defaults
        if grad_clip > 0:
            self.tx = optax.chain(optax.clip_by_global_norm(grad_clip), self.tx)
        inner_shardings = opt_state_shardings(self.tx, params, self.param_shardings, mesh)
        inner = jax.jit(self.tx.init, out_shardings=inner_shardings)(params)
        if self.param_dtype == jnp.float32:
            self.params, self.opt_state, self.opt_shardings = params, inner, inner_shardings
        else:  # the float32 weights become the masters; the model's weights are their rounded copies
            self.opt_state, self.opt_shardings = MasterState(params, inner), MasterState(self.param_shardings,
                                                                                          inner_shardings)
            self.params = self._rounded(params)
        if block_loop == "per_block":
            from jax_impl.per_block import PerBlockStep  # (it builds on this module's block_transform)

            span = {} if blocks_per_program is None else {"blocks_per_program": blocks_per_program}
            self.train_step = PerBlockStep(model, self.tx, self.param_shardings, self.opt_shardings,
                                           self.batch_sharding, remat=remat, grad_accum=grad_accum, **span)
            self._eval_loss = self.train_step.loss
        else:
            self.train_step = make_train_step(self.graphdef, self.tx, self.param_shardings, self.opt_shardings,
                                              self.rest_shardings, self.batch_sharding, remat=remat,
                                              grad_accum=grad_accum)
            self._eval_loss = jax.jit(make_loss_fn(self.graphdef, self.batch_sharding, remat="none"),
                                      in_shardings=(self.param_shardings, self.rest_shardings,
                                                    self.batch_sharding),
                                      out_shardings=NamedSharding(mesh, P()))

    def _rounded(self, master):
        """``master`` cast to the parameters' dtype, placed with the parameters' shardings."""
        cast = functools.partial(cast_params, dtype=self.param_dtype)
        return jax.jit(cast, out_shardings=self.param_shardings)(master)

    @property
    def data_parallel_degree(self) -> int:
        """How many ways the batch is split (the product of the mesh axes of the "batch" rule)."""
        spec = self.batch_sharding.spec
        axes = spec[0] if len(spec) else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

    @property
    def model(self) -> TransformerLM:
        """The current parameters as a module (shares the arrays; do not keep it across ``step`` calls)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    @property
    def master_model(self) -> TransformerLM:
        """The float32 weights the optimizer updates as a module: the masters (``MasterState``) where the
        parameters are stored in a lower precision, else ``model``."""
        if isinstance(self.opt_state, MasterState):
            return nnx.merge(self.graphdef, self.opt_state.master, self.rest)
        return self.model

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Replace the weights by ``weights`` (stable PyTorch names and layout, ``load_numpy_weights``),
        each placed with its current sharding (the masters, and the parameters rounded from them, under a
        ``MasterState``). Call before the first step (the moments start at zero)."""
        model = self.master_model
        load_numpy_weights(model, weights)
        loaded = nnx.state(model, nnx.Param)
        if isinstance(self.opt_state, MasterState):
            self.opt_state = self.opt_state._replace(master=loaded)
            self.params = self._rounded(loaded)
        else:
            self.params = loaded

    def place_batch(self, tokens, micro_batches: int = 1) -> jax.Array:
        """Check ``tokens`` (B, T+1) and place it with the batch sharding; with ``micro_batches`` A > 1, as
        (A, B / A, T+1) with ``micro_batch_sharding`` (rows ``[j B/A, (j+1) B/A)`` are micro-batch j)."""
        shape = tuple(np.shape(tokens))
        dtype = np.dtype(getattr(tokens, "dtype", np.asarray(tokens).dtype))
        if len(shape) != 2 or shape[1] < 2:
            raise ValueError(f"tokens must be (batch, seq + 1) with seq >= 1, got shape {shape}")
        if not np.issubdtype(dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {dtype}")
        if shape[0] % micro_batches:
            raise ValueError(f"batch size {shape[0]} is not {micro_batches} micro-batches of equal size")
        degree = self.data_parallel_degree
        if shape[0] // micro_batches % degree:
            raise ValueError(
                f"batch size {shape[0] // micro_batches} is not divisible by the data-parallel degree {degree} "
                f"(batch split over {self.batch_sharding.spec} of mesh {dict(self.mesh.shape)})")
        self.spec.check_seq_len(shape[1] - 1)
        host = np.asarray(tokens, dtype=np.int32)  # every process holds the global batch (multi-host too)
        sharding = self.batch_sharding
        if micro_batches > 1:
            host, sharding = host.reshape(micro_batches, -1, shape[1]), micro_batch_sharding(sharding)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def compile(self, batch_size: int, seq_len: int) -> float:
        """Compile the step ahead of time for batches of ``batch_size`` sequences of ``seq_len + 1`` tokens (the
        later ``step`` calls run that executable, so no step pays for compiling); the seconds it took."""
        start = time.perf_counter()
        tokens = self.place_batch(np.zeros((batch_size, seq_len + 1), np.int32), self.grad_accum)
        if self.block_loop == "per_block":  # every block program, compiled once for all blocks
            self.train_step = self.train_step.compile(self.params, self.opt_state, self.rest, tokens)
        else:
            self.train_step = self.train_step.lower(self.params, self.opt_state, self.rest, tokens).compile()
        return time.perf_counter() - start

    def step(self, tokens) -> jax.Array:
        """One AdamW step on ``tokens`` (B, T+1) (inputs ``[:, :-1]``, targets ``[:, 1:]``; with ``grad_accum``
        A > 1, A micro-batches of B / A rows in order); returns the loss (the micro-batches' mean)."""
        tokens = self.place_batch(tokens, self.grad_accum)
        self.params, self.opt_state, loss = self.train_step(self.params, self.opt_state, self.rest, tokens)
        return loss

    def eval_loss(self, tokens) -> jax.Array:
        """The mean loss of ``tokens`` (B, T+1), parameters unchanged (the forward of the jitted step)."""
        return self._eval_loss(self.params, self.rest, self.place_batch(tokens))
