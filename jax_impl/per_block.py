"""A train step whose host runs the blocks span by span: one compiled forward and one compiled backward serve every
span of ``blocks_per_program`` consecutive blocks, so nothing is stacked and nothing grows with depth.

Why: the scanned step (``jax.lax.scan`` over stacked block parameters, ``jax_impl.model``) compiles in
seconds, but XLA slices each layer's weights out of their stacks and writes each layer's saved activations and
weight gradients into stacks with device copies, because a cuBLAS or cuDNN call can neither read a slice of a
stack nor write into one: ~84 GB a step at xl 4 x 2,048, ~30 ms of a 265 ms step on an H100
(notes/jax.md). Unrolling the blocks in one program removes the copies but its compile grows with depth (xl
did not finish in 140 s). Here the blocks are separate (``TransformerLM(scan_layers=False)``), and the host
calls, per step:

    x, saved[0] = first_forward(embedding + span 0, tokens)   one program: the lookup, then the first span
    x, saved[s] = span_forward(span s, x)                  one program per span length, called for every later span
    loss, grads of the head, dx = head(x, tokens)          one program
    grads[s], dx = span_backward(span s, saved[s], dx)     one program per span length, last span first
    grads of span 0 and the embedding = first_backward(saved[0], dx)
    params, opt_state, loss = update(params, opt_state, grads, loss)   one program (state donated)

Every program takes flat lists of arrays and the whole token batch (inputs and targets are sliced inside: an eager
slice would cost a host-to-device copy and a dispatch per step), and the state's flat leaves are kept between
steps (``_FlatCache``), so the step's host work before its first program is a dictionary lookup: the GPU waits
for the host only once per step, for the first dispatch after the loss was read.

``span_forward`` is ``jax.vjp`` of the span's blocks (each under the ``remat`` policy's ``jax.checkpoint``, so
``saved`` holds what that policy keeps); its pullback's residuals leave the program as arrays, except those that
are the program's own inputs (the blocks' weights, the RoPE tables and the span's input x), which
``span_backward`` takes again instead of receiving copies. Dispatch is asynchronous, so the host runs ahead
of the GPU whenever a span's work outlasts the host's cost of calling it (1.1-2.4 ms a program on the H100 host
measured: xl at 4 x 2,048 is GPU-bound, at 4 x 512 host-bound even in spans of 4 blocks; notes/jax.md). What is
given up: XLA cannot schedule across programs (on a mesh, no overlap of one span's collectives with another's
compute); on one GPU there is little to overlap.

Public names: ``PerBlockStep(model, tx, param_shardings, opt_shardings, tokens_sharding, *, remat="none",
grad_accum=1, blocks_per_program=BLOCKS_PER_PROGRAM)`` (``model`` gives the structure: an unrolled
``TransformerLM``, its values unused), called as the scanned step's jitted function, ``(params, opt_state, rest,
tokens) -> (params, opt_state, loss)`` with params and opt_state donated. The loss comes out of the update's
program, so reading it waits for the whole step, as for the one-program step (a loss read straight from the
head's program is ready before the backward runs: a benchmark waiting on it would time the host, not the step).
``.compile(params, opt_state, rest, tokens)`` compiles every program ahead of time for those shapes and returns
the step; ``.as_text()`` the compiled programs' HLO; ``.loss(params, rest, tokens)`` the mean loss through
forward programs only; ``.loss_and_grads(params, rest, tokens)``.

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
BLOCKS_PER_PROGRAM = 4  # consecutive blocks run by one program (the last span may be shorter; notes/jax.md)
# XLA options of every program ``PerBlockStep.compile`` compiles: XLA's dot merger made the q, k and v products
# (they share their input) one GEMM over concatenated weights, and paid for the concatenates and slices around it
# more than it saved (xl 4 x 2,048 on one H100: 2.7 ms a step of GPU time; notes/jax.md, session 16).
COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


class _FlatCache:
    """The flat leaves of the trees the last update returned, so that the next step need not flatten them again
    (flax ``Variable`` pytrees cost the host milliseconds to flatten at xl): ``leaves(tree)`` is a lookup for
    those trees (by identity; the cache holds them, so an id is not reused while cached) and a flatten else."""

    def __init__(self):
        self._trees: dict[int, tuple[Any, list]] = {}

    def leaves(self, tree) -> list:
        hit = self._trees.get(id(tree))
        return hit[1] if hit is not None and hit[0] is tree else jax.tree.leaves(tree)

    def store(self, *flat: tuple[Any, list]) -> list:
        """The trees of ``(treedef, leaves)`` pairs, cached in place of the trees cached before."""
        trees = [jax.tree.unflatten(treedef, leaves) for treedef, leaves in flat]
        self._trees = {id(tree): (tree, leaves) for tree, (_, leaves) in zip(trees, flat)}
        return trees


class _Programs:
    """The forward and backward programs of a span of consecutive blocks, over flat lists of arrays (a dispatch
    then flattens no module state): the span's blocks' parameters one after another; the pullback's layout is
    fixed by the first trace of each input signature (one per span length).

    With ``embed`` (``(embedding leaves, tokens (B, T+1)) -> x``), the first span's programs: their leaves start
    with the embedding's ``n_embed``, their input is the token batch, and the backward returns the embedding's
    gradient with the blocks' and no dx. So the step's first program has a span of blocks' work in it: after
    the last step's loss was read, the idle GPU waits for one dispatch, not for an embedding's and a span's."""

    def __init__(self, block_def, block_tree, rope_def, rope_tree, apply_block, embed=None, n_embed: int = 0):
        self.layout: dict[tuple, tuple[Any, tuple[int | None, ...]]] = {}  # input signature -> pullback layout

        def run(leaves, rope_leaves, x):
            if embed is not None:
                x = embed(leaves[:n_embed], x)
            rope = nnx.merge(rope_def, jax.tree.unflatten(rope_tree, rope_leaves))
            per_block = block_tree.num_leaves
            for i in range(n_embed, len(leaves), per_block):
                x = apply_block(nnx.merge(block_def, jax.tree.unflatten(block_tree, leaves[i:i + per_block])), x,
                                rope)
            return x

        def forward(leaves, rope_leaves, x):
            if embed is None:
                y, pullback = jax.vjp(run, leaves, rope_leaves, x)
            else:  # x is the integer token batch: not differentiated
                y, pullback = jax.vjp(lambda leaves, rope_leaves: run(leaves, rope_leaves, x), leaves, rope_leaves)
            inputs = [*leaves, *rope_leaves, x]
            position = {id(leaf): i for i, leaf in enumerate(inputs)}
            residuals, tree = jax.tree.flatten(pullback)
            self.layout[_signature(inputs)] = (tree, tuple(position.get(id(leaf)) for leaf in residuals))
            return y, [leaf for leaf in residuals if id(leaf) not in position]

        def backward(leaves, rope_leaves, x, saved, dy):
            inputs = [*leaves, *rope_leaves, x]
            tree, where = self.layout[_signature(inputs)]
            rest = iter(saved)
            pullback = jax.tree.unflatten(tree, [next(rest) if i is None else inputs[i] for i in where])
            grads, _, *dx = pullback(dy)
            return grads, (dx[0] if dx else None)

        self.apply = jax.jit(run)  # the forward alone (evaluation)
        self.forward = jax.jit(forward)
        self.backward = jax.jit(backward, donate_argnums=() if embed else (4,))  # dy's buffer can take dx


def _signature(leaves) -> tuple:
    return tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


class PerBlockStep:
    """One training step of an unrolled ``TransformerLM`` run block by block from the host (module docstring)."""

    def __init__(self, model: TransformerLM, tx: optax.GradientTransformation, p_shardings, o_shardings,
                 tokens_sharding: NamedSharding, *, remat: str = "none", grad_accum: int = 1,
                 blocks_per_program: int = BLOCKS_PER_PROGRAM):
        if not grad_accum >= 1:
            raise ValueError(f"grad_accum={grad_accum} must be >= 1")
        if not blocks_per_program >= 1:
            raise ValueError(f"blocks_per_program={blocks_per_program} must be >= 1")
        if model.scan_layers:
            raise ValueError("PerBlockStep runs separate blocks: build the model with scan_layers=False")
        self.grad_accum, self.blocks_per_program = grad_accum, blocks_per_program
        self.n_layers = len(model.layers)
        params = nnx.state(model, nnx.Param)
        self._tree = jax.tree.structure(params)
        # Where each part's leaves sit in the flat parameter list (and so in the flat gradient list).
        position = jax.tree.unflatten(self._tree, range(self._tree.num_leaves))
        self._embed_at, self._norm_at, self._head_at = (
            jax.tree.leaves(position[name]) for name in ("token_embeddings", "ln_final", "lm_head"))
        block_at = [jax.tree.leaves(position[BLOCKS][i]) for i in range(self.n_layers)]
        self._span_at = [sum(block_at[i:i + blocks_per_program], [])  # each span's blocks' leaves, in order
                         for i in range(0, self.n_layers, blocks_per_program)]
        self._span_at[0] = self._embed_at + self._span_at[0]  # the first span's programs embed the tokens
        trees = {name: jax.tree.structure(params[name]) for name in ("token_embeddings", "ln_final", "lm_head")}
        defs = {name: nnx.graphdef(getattr(model, name)) for name in ("token_embeddings", "ln_final", "lm_head")}
        activations = NamedSharding(tokens_sharding.mesh, P(*tokens_sharding.spec[:1], None, None))  # (B, T, d)

        def part(name, leaves):  # a module of the model from its flat parameters
            return nnx.merge(defs[name], jax.tree.unflatten(trees[name], leaves))

        def embed(embed_leaves, tokens):  # tokens (B, T+1): the inputs are tokens[:, :-1]
            x = part("token_embeddings", embed_leaves)(tokens[:, :-1])
            return jax.lax.with_sharding_constraint(x, activations)

        def head_loss(norm_leaves, head_leaves, x, tokens):  # the targets are tokens[:, 1:]
            return cross_entropy(part("lm_head", head_leaves)(part("ln_final", norm_leaves)(x)), tokens[:, 1:])

        blocks = (nnx.graphdef(model.layers[0]), jax.tree.structure(params[BLOCKS][0]), nnx.graphdef(model.rope),
                  jax.tree.structure(nnx.state(model.rope)),
                  block_transform(remat=check_remat(remat), activation_sharding=activations, prevent_cse=False))
        self._programs = [_Programs(*blocks, embed=embed, n_embed=len(self._embed_at))]  # the first span's
        if len(self._span_at) > 1:
            self._programs.append(_Programs(*blocks))  # every later span's

        self._opt_tree = None  # the optimizer state's structure (that of its shardings may differ: no Variables)

        def update(param_leaves, opt_leaves, grad_leaves, loss):  # the loss passes through: ready with the step
            params, grads = (jax.tree.unflatten(self._tree, leaves) for leaves in (param_leaves, grad_leaves))
            grads = jax.lax.with_sharding_constraint(grads, p_shardings)
            params, opt_state = optimizer_update(tx, grads, jax.tree.unflatten(self._opt_tree, opt_leaves), params)
            return jax.tree.leaves(params), jax.tree.leaves(opt_state), loss

        def accumulate(total, loss, grads):  # float32 sums of the micro-batches' losses and gradients
            return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total, (loss, grads))

        self._head = jax.jit(jax.value_and_grad(head_loss, argnums=(0, 1, 2)))
        self._head_loss = jax.jit(head_loss)
        replicated = NamedSharding(tokens_sharding.mesh, P())
        self._update = jax.jit(update, out_shardings=(jax.tree.leaves(p_shardings), jax.tree.leaves(o_shardings),
                                                      replicated), donate_argnums=(0, 1))
        self._accumulate = jax.jit(accumulate, donate_argnums=(0,))
        self._mean = jax.jit(lambda total: jax.tree.map(lambda t: t / grad_accum, total), donate_argnums=(0,))
        self._compiled: dict[tuple[Callable, int], Any] = {}  # (program, leaves of its first argument) -> compiled
        self._flat = _FlatCache()

    def _call(self, program, *args):
        return self._compiled.get((program, len(args[0])), program)(*args)

    def _split(self, param_leaves: list):
        """The flat parameters of each span (the first with the embedding's in front), the final norm and the
        head, and each span's programs."""
        pick = lambda at: [param_leaves[i] for i in at]  # noqa: E731
        spans = [pick(at) for at in self._span_at]
        programs = [self._programs[min(i, 1)] for i in range(len(spans))]
        return spans, programs, pick(self._norm_at), pick(self._head_at)

    def loss_and_grads(self, params: nnx.State, rest: nnx.State, tokens: jax.Array):
        """The loss of ``tokens`` (B, T+1) and the gradient of every parameter, shaped like ``params``."""
        loss, grads = self._loss_and_grad_leaves(self._flat.leaves(params), rest, tokens)
        return loss, jax.tree.unflatten(self._tree, grads)

    def _loss_and_grad_leaves(self, param_leaves: list, rest: nnx.State, tokens: jax.Array):
        """The loss and the parameters' gradients as a flat list (``loss_and_grads``)."""
        spans, programs, norm, head = self._split(param_leaves)
        rope = jax.tree.leaves(rest["rope"])
        x, saved = tokens, []  # the first span's programs take the tokens
        for span, program in zip(spans, programs):
            span_input = x
            x, kept = self._call(program.forward, span, rope, x)
            saved.append((span_input, kept))
        loss, (d_norm, d_head, dx) = self._call(self._head, norm, head, x, tokens)
        grads: list[Any] = [None] * self._tree.num_leaves
        for at, leaves in ((self._norm_at, d_norm), (self._head_at, d_head)):
            for i, leaf in zip(at, leaves):
                grads[i] = leaf
        for at, span, program in zip(reversed(self._span_at), reversed(spans), reversed(programs)):
            span_input, kept = saved.pop()
            d_span, dx = self._call(program.backward, span, rope, span_input, kept, dx)
            for i, leaf in zip(at, d_span):
                grads[i] = leaf
        return loss, grads

    def loss(self, params: nnx.State, rest: nnx.State, tokens: jax.Array) -> jax.Array:
        """The mean loss of ``tokens`` (B, T+1), forward programs only (nothing saved for a backward)."""
        spans, programs, norm, head = self._split(self._flat.leaves(params))
        rope = jax.tree.leaves(rest["rope"])
        x = tokens
        for span, program in zip(spans, programs):
            x = self._call(program.apply, span, rope, x)
        return self._call(self._head_loss, norm, head, x, tokens)

    def __call__(self, params, opt_state, rest, tokens):
        """``(params, opt_state, rest, tokens) -> (params, opt_state, loss)``; tokens (B, T+1), or
        (grad_accum, B / grad_accum, T+1) micro-batches whose mean loss and gradient make one update."""
        param_leaves = self._flat.leaves(params)
        if self.grad_accum == 1:
            loss, grads = self._loss_and_grad_leaves(param_leaves, rest, tokens)
        else:
            total = None
            for micro_tokens in tokens:
                loss_grads = self._loss_and_grad_leaves(param_leaves, rest, micro_tokens)
                total = (jax.tree.map(lambda g: g.astype(jnp.float32), loss_grads) if total is None
                         else self._call(self._accumulate, total, *loss_grads))
            loss, grads = self._call(self._mean, total)
        param_leaves, opt_leaves, loss = self._call(self._update, param_leaves, self._opt_leaves(opt_state), grads,
                                                    loss)
        # The loss's copy to the host queued behind the update, so that a caller reading it waits for the step,
        # not for the step and then a copy the read would only start (~0.6 ms on the H100 host measured).
        loss.copy_to_host_async()
        return *self._flat.store((self._tree, param_leaves), (self._opt_tree, opt_leaves)), loss

    def _opt_leaves(self, opt_state) -> list:
        """The optimizer state's flat leaves; its structure, for the update's program, is the first one's."""
        leaves = self._flat.leaves(opt_state)
        if self._opt_tree is None:
            self._opt_tree = jax.tree.structure(opt_state)
        if len(leaves) != self._opt_tree.num_leaves:
            raise ValueError(f"the optimizer state has {len(leaves)} arrays where the first one had "
                             f"{self._opt_tree.num_leaves}: pass the state the trainer's optimizer made")
        return leaves

    def compile(self, params, opt_state, rest, tokens) -> PerBlockStep:
        """Compile every program ahead of time for these shapes (a step then compiles nothing); returns self."""
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), tree)
        micro = tokens if self.grad_accum == 1 else tokens[0]
        param_leaves = jax.tree.leaves(params)
        spans, programs, norm, head = self._split(param_leaves)
        rope = jax.tree.leaves(rest["rope"])
        loss, grads = jax.eval_shape(self._loss_and_grad_leaves, param_leaves, rest, micro)
        calls, x = [], micro
        for span, program in {(len(span), program): (span, program)  # one pair per program and span length
                              for span, program in zip(spans, programs)}.values():
            program_input = micro if program is programs[0] else x
            y, kept = jax.eval_shape(program.forward, span, rope, program_input)
            calls += [(program.forward, (span, rope, program_input)),
                      (program.backward, (span, rope, program_input, kept, y))]
            x = y
        calls += [(self._head, (norm, head, x, micro)),
                  (self._update, (param_leaves, self._opt_leaves(opt_state), grads, loss))]
        if self.grad_accum > 1:
            total = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), (loss, grads))
            calls += [(self._accumulate, (total, loss, grads)), (self._mean, (total,))]
        for program, args in calls:
            self._compiled[program, len(args[0])] = program.lower(*abstract(args)).compile(COMPILER_OPTIONS)
        return self

    def as_text(self) -> str:
        """The optimized HLO of every compiled program (after ``compile``), one after another."""
        return "\n".join(compiled.as_text() for compiled in self._compiled.values())
