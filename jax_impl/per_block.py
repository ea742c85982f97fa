"""A train step whose host runs the blocks one at a time: one compiled forward and one compiled backward serve
every block, so nothing is stacked and nothing grows with depth.

Why: the scanned step (``jax.lax.scan`` over stacked block parameters, ``jax_impl.model``) compiles in
seconds, but XLA slices each layer's weights out of their stacks and writes each layer's saved activations and
weight gradients into stacks with device copies, because a cuBLAS or cuDNN call can neither read a slice of a
stack nor write into one: ~84 GB a step at xl 4 x 2,048, ~30 ms of a 265 ms step on an H100
(notes/jax.md). Unrolling the blocks in one program removes the copies but its compile grows with depth (xl
did not finish in 140 s). Here the blocks are separate (``TransformerLM(scan_layers=False)``), and the host
calls, per step:

    x = embed(tokens)                                   one program
    x, saved[i] = block_forward(block i, x)             one program, called n_layers times
    loss, grads of the head, dx = head(x, targets)      one program
    grads[i], dx = block_backward(block i, saved[i], dx)   one program, called n_layers times, last first
    grads of the embedding = embed_backward(tokens, dx)
    params, opt_state = update(params, opt_state, grads)   one program (parameters and state donated)

``block_forward`` is ``jax.vjp`` of the block (under the ``remat`` policy's ``jax.checkpoint``, so ``saved``
holds what that policy keeps); its pullback's residuals leave the program as arrays, except those that are
the program's own inputs (the block's weights, the RoPE tables and its input x), which ``block_backward`` takes
again instead of receiving copies. Dispatch is asynchronous, so the host runs ahead of the GPU whenever a
block's work outlasts the ~0.1 ms the host spends calling it (xl at 4 x 512 and beyond); programs are compiled
once, so compile time does not grow with depth. What is given up: XLA cannot schedule across programs (on a
mesh, no overlap of one block's collectives with another's compute); on one GPU there is nothing to overlap.

Public names: ``PerBlockStep(model, tx, param_shardings, opt_shardings, tokens_sharding, *, remat="none",
grad_accum=1)`` (``model`` gives the structure: an unrolled ``TransformerLM``, its values unused),
called as the scanned step's jitted function, ``(params, opt_state, rest, tokens) -> (params, opt_state,
loss)`` with params and opt_state donated; ``.compile(params, opt_state, rest, tokens)`` compiles every
program ahead of time (for those shapes) and returns the step; ``.as_text()`` the compiled programs' HLO;
``.loss(params, rest, tokens)`` the mean loss through forward programs only; ``.loss_and_grads(...)``.

References: the ``jax.vjp`` docs (the returned pullback is a pytree, so it can leave a ``jax.jit``);
torchtitan's per-block ``torch.compile`` (the PyTorch twin: one compiled region that serves every block).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_impl.model import TransformerLM, cross_entropy
from jax_impl.train import block_transform, check_remat, optimizer_update

BLOCKS = "layers"  # the unrolled model's list of blocks in the parameter state


class _Programs:
    """The block's forward and backward programs (the pullback's structure, fixed by the first trace)."""

    def __init__(self, block_def, rope_def, apply_block):
        self.structure: dict[Any, tuple[Any, tuple[int | None, ...]]] = {}  # input shapes -> pullback layout

        def run(block_state, rope_state, x):
            return apply_block(nnx.merge(block_def, block_state), x, nnx.merge(rope_def, rope_state))

        def forward(block_state, rope_state, x):
            y, pullback = jax.vjp(run, block_state, rope_state, x)
            inputs = jax.tree.leaves((block_state, rope_state, x))
            position = {id(leaf): i for i, leaf in enumerate(inputs)}
            leaves, tree = jax.tree.flatten(pullback)
            self.structure[_signature(inputs)] = (tree, tuple(position.get(id(leaf)) for leaf in leaves))
            return y, [leaf for leaf in leaves if id(leaf) not in position]

        def backward(block_state, rope_state, x, saved, dy):
            inputs = jax.tree.leaves((block_state, rope_state, x))
            tree, where = self.structure[_signature(inputs)]
            rest = iter(saved)
            pullback = jax.tree.unflatten(tree, [next(rest) if i is None else inputs[i] for i in where])
            grads, _, dx = pullback(dy)
            return grads, dx

        self.run = run
        self.forward = jax.jit(forward)
        self.backward = jax.jit(backward, donate_argnums=(4,))  # dy's buffer can take dx


def _signature(leaves) -> tuple:
    return tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def _assemble(params: nnx.State, parts: dict[tuple, nnx.State]) -> nnx.State:
    """A state shaped like ``params`` from sub-states keyed by their path in it (e.g. ("layers", 3))."""
    flat = [(prefix + path, leaf) for prefix, part in parts.items() for path, leaf in nnx.to_flat_state(part)]
    return nnx.from_flat_state(flat)


class PerBlockStep:
    """One training step of an unrolled ``TransformerLM`` run block by block from the host (module docstring)."""

    def __init__(self, model: TransformerLM, tx: optax.GradientTransformation, p_shardings, o_shardings,
                 tokens_sharding: NamedSharding, *, remat: str = "none", grad_accum: int = 1):
        if not grad_accum >= 1:
            raise ValueError(f"grad_accum={grad_accum} must be >= 1")
        self.grad_accum = grad_accum
        if model.scan_layers:
            raise ValueError("PerBlockStep runs separate blocks: build the model with scan_layers=False")
        self.n_layers = len(model.layers)
        block_def, self._rope_def = nnx.graphdef(model.layers[0]), nnx.graphdef(model.rope)
        embed_def, norm_def, head_def = (nnx.graphdef(m) for m in (model.token_embeddings, model.ln_final,
                                                                    model.lm_head))
        activations = NamedSharding(tokens_sharding.mesh, P(*tokens_sharding.spec[:1], None, None))  # (B, T, d)
        self._blocks = _Programs(block_def, self._rope_def, block_transform(
            remat=check_remat(remat), activation_sharding=activations, prevent_cse=False))

        def embed(embed_state, inputs):
            return jax.lax.with_sharding_constraint(nnx.merge(embed_def, embed_state)(inputs), activations)

        def head_loss(norm_state, head_state, x, targets):
            logits = nnx.merge(head_def, head_state)(nnx.merge(norm_def, norm_state)(x))
            return cross_entropy(logits, targets)

        def embed_backward(embed_state, inputs, dx):
            _, pullback = jax.vjp(lambda state: embed(state, inputs), embed_state)
            return pullback(dx)[0]

        def update(params, opt_state, grads):
            grads = jax.lax.with_sharding_constraint(grads, p_shardings)
            return optimizer_update(tx, grads, opt_state, params)

        def accumulate(total, loss, grads):  # float32 sums of the micro-batches' losses and gradients
            return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, (loss, grads))

        def apply(block_state, rope_state, x):  # a block's forward alone (evaluation)
            return self._blocks.run(block_state, rope_state, x)

        self._embed = jax.jit(embed)
        self._apply = jax.jit(apply)
        self._head_loss = jax.jit(head_loss)
        self._head = jax.jit(jax.value_and_grad(head_loss, argnums=(0, 1, 2)))
        self._embed_backward = jax.jit(embed_backward)
        self._update = jax.jit(update, out_shardings=(p_shardings, o_shardings), donate_argnums=(0, 1))
        self._accumulate = jax.jit(accumulate, donate_argnums=(0,))
        self._mean = jax.jit(lambda total: jax.tree.map(lambda t: t / grad_accum, total), donate_argnums=(0,))
        self._compiled: dict[Callable, Any] = {}

    def _call(self, program, *args):
        return self._compiled.get(program, program)(*args)

    def loss_and_grads(self, params: nnx.State, rest: nnx.State, tokens: jax.Array):
        """The loss of ``tokens`` (B, T+1) and the gradient of every parameter, shaped like ``params``."""
        blocks, rope = params[BLOCKS], rest["rope"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self._call(self._embed, params["token_embeddings"], inputs)
        saved = []
        for i in range(self.n_layers):
            block_input = x
            x, kept = self._call(self._blocks.forward, blocks[i], rope, x)
            saved.append((block_input, kept))
        loss, (d_norm, d_head, dx) = self._call(self._head, params["ln_final"], params["lm_head"], x, targets)
        parts = {("ln_final",): d_norm, ("lm_head",): d_head}
        for i in reversed(range(self.n_layers)):
            block_input, kept = saved.pop()
            parts[(BLOCKS, i)], dx = self._call(self._blocks.backward, blocks[i], rope, block_input, kept, dx)
        parts[("token_embeddings",)] = self._call(self._embed_backward, params["token_embeddings"], inputs, dx)
        return loss, _assemble(params, parts)

    def loss(self, params: nnx.State, rest: nnx.State, tokens: jax.Array) -> jax.Array:
        """The mean loss of ``tokens`` (B, T+1), forward programs only (nothing saved for a backward)."""
        x = self._call(self._embed, params["token_embeddings"], tokens[:, :-1])
        for i in range(self.n_layers):
            x = self._call(self._apply, params[BLOCKS][i], rest["rope"], x)
        return self._call(self._head_loss, params["ln_final"], params["lm_head"], x, tokens[:, 1:])

    def __call__(self, params, opt_state, rest, tokens):
        """``(params, opt_state, rest, tokens) -> (params, opt_state, loss)``; tokens (B, T+1), or
        (grad_accum, B / grad_accum, T+1) micro-batches whose mean loss and gradient make one update."""
        if self.grad_accum == 1:
            loss, grads = self.loss_and_grads(params, rest, tokens)
        else:
            total = None
            for micro_tokens in tokens:
                loss_grads = self.loss_and_grads(params, rest, micro_tokens)
                total = (jax.tree.map(lambda g: g.astype(jnp.float32), loss_grads) if total is None
                         else self._call(self._accumulate, total, *loss_grads))
            loss, grads = self._call(self._mean, total)
        params, opt_state = self._call(self._update, params, opt_state, grads)
        return params, opt_state, loss

    def compile(self, params, opt_state, rest, tokens) -> PerBlockStep:
        """Compile every program ahead of time for these shapes (a step then compiles nothing); returns self."""
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), tree)
        micro = tokens if self.grad_accum == 1 else tokens[0]
        blocks, rope = params[BLOCKS], rest["rope"]
        x = jax.eval_shape(self._embed, params["token_embeddings"], micro[:, :-1])
        _, kept = jax.eval_shape(self._blocks.forward, blocks[0], rope, x)
        loss, grads = jax.eval_shape(self.loss_and_grads, params, rest, micro)
        calls = [(self._embed, (params["token_embeddings"], micro[:, :-1])),
                 (self._blocks.forward, (blocks[0], rope, x)),
                 (self._head, (params["ln_final"], params["lm_head"], x, micro[:, 1:])),
                 (self._blocks.backward, (blocks[0], rope, x, kept, x)),
                 (self._embed_backward, (params["token_embeddings"], micro[:, :-1], x)),
                 (self._update, (params, opt_state, grads))]
        if self.grad_accum > 1:
            total = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), (loss, grads))
            calls += [(self._accumulate, (total, loss, grads)), (self._mean, (total,))]
        for program, args in calls:
            self._compiled[program] = program.lower(*abstract(args)).compile()
        return self

    def as_text(self) -> str:
        """The optimized HLO of every compiled program (after ``compile``), one after another."""
        return "\n".join(compiled.as_text() for compiled in self._compiled.values())
