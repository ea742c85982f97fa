"""Whose initial weights, whose train step? The CPU experiment of issue 15 item 3 (notes/jax.md).

Draws the initial weights of the PyTorch model (``torch.manual_seed(seed)``) and of the Flax model
(``nnx.Rngs(seed)``, through ``jax_impl.train.ShardedTrainer`` as the JAX e2e benchmark builds it), and trains
each set in each backend's step, as the e2e benchmarks run it: the fixed random batch
(``analysis.harness.fixed_batch``) every step, AdamW (lr ``--lr``, weight decay 0.01, betas (0.9, 0.999), eps
1e-8), fp32 with full-precision matmuls or ``--dtype bf16`` (torch autocast; JAX bf16 compute). The weights cross
as numpy dicts keyed by the stable names (``to_numpy_weights`` / ``load_numpy_weights``). Prints one line of
losses per run; the run "t/j" is torch's weights trained by JAX's step.

    python scripts/init_cross.py --d-model 256 --d-ff 1024 --heads 4 --layers 48 --seq 512 --lr 6.25e-3

Imports both backends, as tests/test_parity.py does: an experiment, not library code.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import torch

from analysis.harness import fixed_batch
from jax_impl.model import to_numpy_weights as jax_weights
from jax_impl.sharding import make_mesh
from jax_impl.train import ShardedTrainer, dtype_arguments, matmul_precision
from parallelism_calc.specs import ModelSpec, ParallelSpec
from torch_impl.model import TransformerLM
from torch_impl.parallelize import parallelize
from torch_impl.step import StepParts, train_step

WEIGHT_DECAY = 0.01  # the benchmarks' default (analysis.harness)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="seed of both backends' weights and of the batch")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--runs", default="t/t,t/j,j/t,j/j",
                   help="comma-separated WEIGHTS/STEP pairs: t (PyTorch) or j (JAX) for each")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_float32_matmul_precision("highest")
    spec = ModelSpec("init_cross", vocab_size=args.vocab, context_length=args.seq, d_model=args.d_model,
                     d_ff=args.d_ff, n_layers=args.layers, n_heads=args.heads)
    tokens = fixed_batch(args.seed, args.batch, args.seq, spec.vocab_size)  # (B, T + 1)
    mesh = make_mesh(ParallelSpec(), jax.devices("cpu")[:1])
    precision = matmul_precision(args.dtype)

    def jax_trainer() -> ShardedTrainer:
        return ShardedTrainer(spec, mesh, "dp", lr=args.lr, weight_decay=WEIGHT_DECAY, seed=args.seed,
                              **dtype_arguments(args.dtype))

    def initial(kind: str) -> dict[str, np.ndarray]:
        if kind == "t":
            torch.manual_seed(args.seed)
            return TransformerLM(spec).to_numpy_weights()
        with jax.default_matmul_precision(precision):
            return jax_weights(jax_trainer().model)

    def train_torch(weights: dict[str, np.ndarray]) -> list[float]:
        model = TransformerLM(spec)
        model.load_numpy_weights(weights)
        adamw = dict(fused=False, capturable=False, lr=args.lr, weight_decay=WEIGHT_DECAY)
        forward, _, optimizer = parallelize(model, dtype=args.dtype, adamw=adamw)
        parts, batch = StepParts(forward, optimizer, dtype=args.dtype), torch.from_numpy(tokens)
        return [float(train_step(parts, [(batch[:, :-1], batch[:, 1:])])[0]) for _ in range(args.steps)]

    def train_jax(weights: dict[str, np.ndarray]) -> list[float]:
        with jax.default_matmul_precision(precision):
            trainer = jax_trainer()
            trainer.load_weights(weights)
            return [float(trainer.step(tokens)) for _ in range(args.steps)]

    cache: dict[str, dict[str, np.ndarray]] = {}
    for run in args.runs.split(","):
        weights_kind, step_kind = run.split("/")
        weights = cache.setdefault(weights_kind, initial(weights_kind))
        start = time.perf_counter()
        losses = (train_torch if step_kind == "t" else train_jax)(weights)
        names = {"t": "torch", "j": "jax"}
        print(f"{names[weights_kind]} weights, {names[step_kind]} step, seed {args.seed}, {args.dtype}: "
              + " ".join(f"{x:.2f}" for x in losses)
              + f" | largest rise {max(np.diff(losses)):+.2f} | {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
