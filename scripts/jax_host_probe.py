"""How much host time the per-block JAX step spends per step: ``python3 scripts/jax_host_probe.py OUT MODEL B T``.

Builds ``ShardedTrainer(..., block_loop="per_block")`` (bf16 weights with fp32 masters, cuDNN attention, remat
``none`` at T <= 512, else ``qkv_mlp_norms``), compiles it, and after 3 untimed steps times 10 steps three ways:
``synced`` (the loss read every step, as the e2e benchmark does), ``dispatch`` (the host's time to return
from ``step`` without waiting: what it spends enqueueing one step) and ``pipelined`` (10 steps enqueued, one
wait: the GPU's pace when the host runs ahead). Then ``cProfile`` of 3 synced steps (the 25 functions of most
own time). Writes ``OUT/jax_host_probe.json`` and ``OUT/jax_host_probe_cprofile.txt``. Not a record: it says
whether the host or the GPU sets the per-block step's pace (notes/jax.md).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from analysis.harness import fixed_batch
from jax_impl.sharding import make_mesh
from jax_impl.train import ShardedTrainer
from parallelism_calc.specs import MODELS, ParallelSpec

STEPS = 10


def main(argv: list[str]) -> int:
    out, model, batch, seq = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    attention = "dot_product_cudnn" if jax.default_backend() == "gpu" else "dot_product"
    out.mkdir(parents=True, exist_ok=True)
    spec = MODELS[model]
    trainer = ShardedTrainer(spec, make_mesh(ParallelSpec(), jax.devices()[:1]), "dp", lr=1e-4,
                             param_dtype=jnp.bfloat16, attention=attention,
                             remat="none" if seq <= 512 else "qkv_mlp_norms", block_loop="per_block")
    compile_s = trainer.compile(batch, seq)
    tokens = fixed_batch(0, batch, seq, spec.vocab_size)
    for _ in range(3):
        float(trainer.step(tokens))
    times: dict[str, list[float]] = {"synced": [], "dispatch": []}
    for _ in range(STEPS):
        start = time.perf_counter()
        float(trainer.step(tokens))
        times["synced"].append((time.perf_counter() - start) * 1e3)
    for _ in range(STEPS):
        jax.block_until_ready(trainer.params)
        start = time.perf_counter()
        loss = trainer.step(tokens)
        times["dispatch"].append((time.perf_counter() - start) * 1e3)
        float(loss)
    start = time.perf_counter()
    losses = [trainer.step(tokens) for _ in range(STEPS)]
    float(losses[-1])
    pipelined = (time.perf_counter() - start) * 1e3 / STEPS
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        float(trainer.step(tokens))
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    (out / "jax_host_probe_cprofile.txt").write_text(text.getvalue())
    result = {"model": model, "batch": batch, "seq": seq, "compile_s": compile_s, "pipelined_ms": pipelined,
              **{f"{k}_median_ms": statistics.median(v) for k, v in times.items()},
              **{f"{k}_ms": v for k, v in times.items()}, "device": jax.devices()[0].device_kind,
              "jax": jax.__version__}
    (out / "jax_host_probe.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
