"""End-to-end step benchmark of the Flax model: ``python -m jax_impl.bench.e2e --model tiny``.

The JAX twin of ``torch_impl.bench.e2e``: the same flags, the same fixed random batch (numpy's generator,
same seed), the same AdamW hyperparameters and the same record, so the two backends compare field by field.
The step is one ``jax.jit`` (forward, backward and the optax update fused, parameters and optimizer state
donated), so only whole-step times are recorded; the first call compiles and is a warm-up step.
``--load-weights`` starts from the PyTorch model's weights (``--save-weights`` there).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from analysis.benchmark import failure_record, fixed_batch, resolve_spec, run_benchmark, step_record
from analysis.records import Record
from jax_impl.model import TransformerLM, cross_entropy, load_numpy_weights, to_numpy_weights


def pick_device(name: str) -> jax.Device:
    """``--device``: auto (JAX's default device), cpu, cuda or cuda:N (the N-th GPU)."""
    platform, _, index = name.partition(":")
    if name == "auto":
        return jax.devices()[0]
    if platform not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"--device {name!r}; accepted: auto, cpu, cuda, cuda:N")
    try:
        devices = jax.devices("cpu" if platform == "cpu" else "gpu")
    except RuntimeError:
        raise ValueError(f"--device {name}: JAX has no {platform} backend here; accepted: cpu, auto") from None
    if int(index or 0) >= len(devices):
        raise ValueError(f"--device {name}: only {len(devices)} {platform} device(s)")
    return devices[int(index or 0)]


def device_name(device: jax.Device) -> str:
    return "cpu" if device.platform == "cpu" else device.device_kind


def peak_memory_bytes(device: jax.Device) -> int | None:
    stats = device.memory_stats()  # None on the CPU backend
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def measure(args: argparse.Namespace) -> Record:
    device = pick_device(args.device)
    # fp32 means full fp32 matmuls, as PyTorch's default (JAX's default on a GPU would use TF32).
    precision = "highest" if args.dtype == "fp32" else "default"
    with jax.default_device(device), jax.default_matmul_precision(precision):
        return measure_on_device(args, device)


def measure_on_device(args: argparse.Namespace, device: jax.Device) -> Record:
    spec, seq_len = resolve_spec(args)
    compute_dtype = jnp.bfloat16 if args.dtype == "bf16" else None
    model = TransformerLM(spec, rngs=nnx.Rngs(args.seed), attention=args.attention, dtype=compute_dtype)
    if args.load_weights:
        load_numpy_weights(model, dict(np.load(args.load_weights)))
    if args.save_weights:
        np.savez(args.save_weights, **to_numpy_weights(model))
    tokens = jnp.asarray(fixed_batch(args.seed, args.batch_size, seq_len, spec.vocab_size), dtype=jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(args.lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=args.weight_decay)  # torch's defaults
    opt_state = tx.init(params)

    def loss_fn(params, inputs, targets):
        return cross_entropy(nnx.merge(graphdef, params, rest)(inputs), targets)

    @jax.jit
    def forward(params, inputs, targets):
        return loss_fn(params, inputs, targets)

    @jax.jit
    def forward_backward(params, inputs, targets):
        return jax.value_and_grad(loss_fn)(params, inputs, targets)

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def step() -> float:
        nonlocal params, opt_state
        if args.mode == "forward":
            loss = forward(params, inputs, targets)
        elif args.mode == "forward_backward":
            loss, _ = jax.block_until_ready(forward_backward(params, inputs, targets))
        else:
            params, opt_state, loss = jax.block_until_ready(train_step(params, opt_state, inputs, targets))
        return float(loss)  # float() waits for the device

    losses = [step() for _ in range(args.warmup)]
    step_ms = []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        step_ms.append((time.perf_counter() - start) * 1e3)
    return step_record(
        args, spec, seq_len, backend="jax", implementation=f"jit {args.attention}",
        device_name=device_name(device), step_times_ms=step_ms, peak_memory_bytes=peak_memory_bytes(device),
        metrics={"loss_first": losses[0], "loss_last": losses[-1], "losses": losses},
    )


def failed_record(args: argparse.Namespace, err: RuntimeError) -> Record:
    """The record of a run that ran out of memory or failed, so the failure is a row, not a gap."""
    oom = "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower()
    return failure_record(args, err, backend="jax", implementation=f"jit {args.attention}",
                          device_name=device_name(pick_device(args.device)), oom=oom)


def main(argv: list[str] | None = None) -> int:
    return run_benchmark(argv, prog="python -m jax_impl.bench.e2e", description=__doc__.splitlines()[0],
                         measure=measure, on_failure=failed_record)


if __name__ == "__main__":
    sys.exit(main())
