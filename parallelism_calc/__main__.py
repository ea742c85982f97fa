"""``python -m parallelism_calc MODEL [--dp N] [--fsdp N] [--tp N]``: what a model costs and how it shards.

For now: parameters, FLOPs per token and the memory of weights, gradients and AdamW state under the
chosen mesh; the full report (activations, collectives, compute-bound batch sizes) is built on this.
"""

from __future__ import annotations

import argparse
import sys

from parallelism_calc.compute import forward_flops
from parallelism_calc.specs import MODELS, ParallelSpec, get_model

FP32 = 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parallelism_calc",
        description="Memory, FLOPs and sharding of a model preset, without torch or jax.",
    )
    parser.add_argument("model", help=f"model preset: {', '.join(MODELS)}")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP degree (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    return parser


def report(model: str, parallel: ParallelSpec) -> str:
    spec = get_model(model)
    n = spec.n_params()
    shards = parallel.fsdp * parallel.tp  # weights, gradients and optimizer state are split over fsdp x tp
    state_bytes = n * FP32 * 4  # fp32 master weights + gradients + AdamW first and second moments
    lines = [
        f"model {spec.name} ({spec.arch}): d_model {spec.d_model:,}, d_ff {spec.d_ff:,}, layers {spec.n_layers}",
        f"parameters: {n:,} ({n / 1e9:.2f} B)",
        f"forward FLOPs per token at sequence length 1: {forward_flops(spec, 1, 1):,.0f}",
        f"mesh: dp={parallel.dp} fsdp={parallel.fsdp} tp={parallel.tp} (world size {parallel.world_size})",
        f"fp32 weights + gradients + AdamW state: {state_bytes / 1e9:,.1f} GB total, "
        f"{state_bytes / shards / 1e9:,.1f} GB per device over fsdp x tp = {shards}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(report(args.model, ParallelSpec(dp=args.dp, fsdp=args.fsdp, tp=args.tp)))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
