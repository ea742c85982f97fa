"""Where the JAX trainer's step time goes beyond the benchmark's step: ``python3 scripts/jax_trainer_probe.py OUT``.

Builds ``jax_impl.trainer``'s trainer (its flags after OUT, e.g. ``--model small --batch-size 8 --seq-len 512
--dtype bf16_mixed --attention dot_product_cudnn``) and times its compiled step five ways, 30 steps each after
5 untimed: ``trainer`` (as the loop runs it: a fresh batch drawn, placed and stepped, the loss read every step),
``same_host`` (one numpy batch placed anew each step), ``placed`` (one placed device batch, as
``jax_impl.bench.e2e`` runs it), ``no_sync`` (the trainer's way, the losses read once at the end) and
``eval`` (the jitted forward alone). Writes ``OUT/jax_trainer_probe.json`` (median and min ms per variant) and,
for ``trainer``, the kernel table of a ``jax.profiler`` trace (``OUT/trainer_kernels.md``: GPU time per step
against the step's wall time says whether the GPU or the host sets the pace).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from analysis.kernels import kernel_table, markdown, trace_kernel_times
from jax_impl.trainer import JaxTrainConfig, build, build_parser
from lm_data import global_batch_starts, prepare_data, windows_at

WARMUP, STEPS = 5, 30


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    cfg = JaxTrainConfig(**vars(build_parser().parse_args(argv[1:])))
    data = prepare_data(cfg.data, cfg.cache_dir, builtin_bytes=int(cfg.builtin_mb * 2**20))
    trainer = build(cfg, 1000)
    compile_s = trainer.compile(cfg.batch_size * cfg.grad_accum, cfg.seq_len)
    generator = np.random.default_rng(cfg.seed)

    def fresh() -> np.ndarray:
        starts = global_batch_starts(len(data.train), cfg.grad_accum, 1, cfg.batch_size, cfg.seq_len, generator)
        return windows_at(data.train, starts.reshape(-1), cfg.seq_len)

    same = fresh()
    placed = trainer.place_batch(same, cfg.grad_accum)

    def run_placed():
        trainer.params, trainer.opt_state, loss = trainer.train_step(trainer.params, trainer.opt_state, trainer.rest,
                                                                     placed)
        return loss

    variants = {
        "trainer": lambda: float(trainer.step(fresh())),
        "same_host": lambda: float(trainer.step(same)),
        "placed": lambda: float(run_placed()),
        "eval": lambda: float(trainer.eval_loss(same[: cfg.batch_size])),
    }
    results = {"compile_s": compile_s, "config": vars(cfg)}
    for name, step in variants.items():
        for _ in range(WARMUP):
            step()
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        results[name] = {"median_ms": statistics.median(times), "min_ms": min(times)}
        print(f"{name}: median {results[name]['median_ms']:.2f} ms, min {results[name]['min_ms']:.2f} ms", flush=True)
    start = time.perf_counter()
    losses = [trainer.step(fresh()) for _ in range(STEPS)]
    jax.block_until_ready(losses)
    results["no_sync"] = {"mean_ms": (time.perf_counter() - start) * 1e3 / STEPS}
    print(f"no_sync: mean {results['no_sync']['mean_ms']:.2f} ms", flush=True)
    trace_dir = out / "trace"
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(5):
            variants["trainer"]()
    traces = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if traces and jax.default_backend() == "gpu":
        rows = kernel_table(trace_kernel_times(traces[-1]), 5)
        (out / "trainer_kernels.md").write_text(markdown(rows, "the trainer's step: GPU time per step") + "\n")
        results["kernel_ms_per_step"] = sum(row.time_ms for row in rows)
        print(f"kernels: {results['kernel_ms_per_step']:.2f} ms per step", flush=True)
    (out / "jax_trainer_probe.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
