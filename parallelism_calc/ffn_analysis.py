"""The CS336 (2025, assignment 2) XXL analysis of an FFN-only model, as a ``Report``.

(a) parameters, fp32 training state, bf16 activations saved for backward, how many devices that fills;
(b) per-device memory when the state and half of the activations are sharded over N_FSDP devices, and the
    smallest N_FSDP under a per-device budget;
(c) the forward pass's compute-bound batch sizes in the TPU Scaling Book's notation (``scaling``), for the
    chosen X = FSDP and Y = TP degrees and for the best split of N = X Y, under both readings of the book
    (collectives overlapped: the larger cost must hide under the math; or serialized: their sum must);
(d) what lowers that batch at full throughput, each trick with the smallest compute-bound batch it gives on
    the same N devices (collectives overlapped, as (c)'s first reading).
"""

from __future__ import annotations

import math

from parallelism_calc.memory import (devices_needed, fsdp_half_activation_bytes, get_precision,
                                     handout_activation_bytes_per_token, min_fsdp_degree, state_bytes)
from parallelism_calc.report import Quantity, Report, Section
from parallelism_calc.scaling import (BF16, Roofline, block_costs, max_tp_degree, min_batch_per_device_2d,
                                      optimal_fsdp_degree)
from parallelism_calc.specs import ModelSpec

FP32 = get_precision("fp32")  # master weights (param_bytes), gradients, AdamW m and v: 4 + 4 + 8 bytes
STATE_PARTS = {"master weights (fp32)": FP32.param_bytes, "accumulated gradients (fp32)": FP32.grad_bytes,
               "AdamW first and second moments (fp32)": FP32.optimizer_bytes}


def xxl_report(spec: ModelSpec, *, fsdp: int, tp: int, roofline: Roofline, batch_tokens: float | None = None,
               budget_bytes: float = 95e9, device_bytes: float = 80e9) -> Report:
    """The report of ``python -m parallelism_calc xxl --fsdp X --tp Y`` (module docstring)."""
    if spec.arch != "ffn_only":
        raise ValueError(f"the FFN analysis needs an ffn_only spec; {spec.name!r} is {spec.arch!r}")
    d, f, layers, x, y, r = spec.d_model, spec.d_ff, spec.n_layers, fsdp, tp, roofline
    n = x * y
    probe = block_costs(d, f, 1.0, r, x=x, y=y)
    b_over, b_serial = probe.min_batch(overlapped=True), probe.min_batch(overlapped=False)
    batch = batch_tokens if batch_tokens is not None else b_over
    batch_note = "--batch-tokens" if batch_tokens is not None else "default: the smallest compute-bound batch, (c)"
    if batch is None:
        raise ValueError(f"TP degree {y} exceeds F M_Y / alpha = {max_tp_degree(f, r):.1f}: no batch is "
                         "compute-bound, so pass --batch-tokens")
    p, state, act_token = spec.n_params(), state_bytes(spec, FP32), handout_activation_bytes_per_token(spec)
    act = act_token * batch
    total = state + act

    memory = Section("memory", "(a) Memory on one device", (
        Quantity("n_params", "parameters", p, "params", "L * 2 * D * F", f"{layers} * 2 * {d:,} * {f:,}"),
        *(Quantity(f"state_{i}", name, p * width, "bytes", f"{width} * P", f"{width} * {p:,}")
          for i, (name, width) in enumerate(STATE_PARTS.items())),
        Quantity("state_bytes", "fp32 training state", state, "bytes", "16 bytes/param * P", f"16 * {p:,}"),
        Quantity("devices_for_state", f"{device_bytes / 1e9:g} GB devices for the state alone"
                 + (" (H100s)" if device_bytes == 80e9 else ""),
                 devices_needed(state, device_bytes), "devices", "ceil(state / device memory)",
                 f"ceil({state:,} / {device_bytes:,.0f})"),
        Quantity("activation_bytes_per_token", "bf16 activations saved for backward", act_token, "bytes/token",
                 "L * (D + F) * 2 bytes", f"{layers} * ({d:,} + {f:,}) * 2"),
        Quantity("batch_tokens", "batch", batch, "tokens", note=batch_note),
        Quantity("activation_bytes", "activations of the batch (A)", act, "bytes", "activations/token * B",
                 f"{act_token:,} * {batch:,.1f}"),
        Quantity("total_bytes", "state + activations", total, "bytes", "state + A", f"{state:,} + {act:,.0f}"),
        Quantity("devices_needed", f"{device_bytes / 1e9:g} GB devices to hold it", devices_needed(total, device_bytes),
                 "devices", "ceil((state + A) / device memory)", f"ceil({total:,.0f} / {device_bytes:,.0f})"),
    ))

    n_min = min_fsdp_degree(spec, batch, budget_bytes)
    n_min_state = min_fsdp_degree(spec, 0, budget_bytes)
    per_device = fsdp_half_activation_bytes(spec, batch, x)
    sharding = Section("fsdp_memory", f"(b) Memory per device, state and half the activations sharded over N_FSDP", (
        Quantity("per_device_bytes", f"per device at N_FSDP = {x}", per_device, "bytes",
                 "(state + A/2) / N_FSDP + A/2", f"({state:,} + {act / 2:,.0f}) / {x} + {act / 2:,.0f}"),
        Quantity("budget_bytes", "per-device budget", budget_bytes, "bytes"),
        Quantity("min_fsdp", "smallest N_FSDP within budget", n_min, "devices",
                 "ceil((state + A/2) / (budget - A/2))",
                 f"ceil(({state:,} + {act / 2:,.0f}) / ({budget_bytes:,.0f} - {act / 2:,.0f}))",
                 note="" if n_min else "none: the unsharded half of the activations alone exceeds the budget"),
        Quantity("min_fsdp_state_only", "smallest N_FSDP for the state alone (A = 0)", n_min_state, "devices",
                 "ceil(state / budget)", f"ceil({state:,} / {budget_bytes:,.0f})"),
    ))

    at_batch = block_costs(d, f, batch, r, x=x, y=y)
    per_dev_2d = {o: min_batch_per_device_2d(f, r, overlapped=o) for o in (True, False)}

    def tokens(value: float | None, divisor: int) -> float | None:
        return None if value is None else value / divisor

    compute = Section("compute_bound", f"(c) Forward pass: when is X = {x} (FSDP) x Y = {y} (TP) compute-bound?", (
        Quantity("alpha", "alpha = C / W_ici", r.alpha, "", "C / W_ici", f"{r.flops:.4g} / {r.bandwidth:.4g}"),
        Quantity("math_s", "math per block at the batch", at_batch.math, "s", "2 * 2 * B * D * F / (X * Y * C)",
                 f"4 * {batch:,.1f} * {d:,} * {f:,} / ({x} * {y} * {r.flops:.4g})"),
        Quantity("fsdp_comm_s", "FSDP all-gather of weights per block", at_batch.weight_comm, "s",
                 "2 * 2 * D * F / (Y * W_ici * M_X)", f"4 * {d:,} * {f:,} / ({y} * {r.bandwidth:.4g} * {r.axes_x})"),
        Quantity("tp_comm_s", "TP all-gather + reduce-scatter per block", at_batch.tp_comm, "s",
                 "2 * 2 * B * D / (X * W_ici * M_Y)", f"4 * {batch:,.1f} * {d:,} / ({x} * {r.bandwidth:.4g} * {r.axes_y})"),
        Quantity("min_batch_overlapped", "smallest compute-bound batch, collectives overlapped", b_over, "tokens",
                 "B > X * alpha / M_X (math >= max(FSDP, TP); needs Y < F M_Y / alpha)",
                 f"{x} * {r.alpha:.2f} / {r.axes_x}", note="" if b_over else "none: TP alone is comm-bound"),
        Quantity("per_device_batch_overlapped", "  per device, B / (X * Y)", tokens(b_over, n), "tokens/device",
                 "B / (X * Y)", f"{b_over or 0:,.1f} / {n}"),
        Quantity("per_fsdp_rank_batch_overlapped", "  per FSDP rank, B / X", tokens(b_over, x), "tokens",
                 "B / X", f"{b_over or 0:,.1f} / {x}"),
        Quantity("min_batch_serial", "smallest compute-bound batch, collectives serialized", b_serial, "tokens",
                 "B > (F / (Y M_X)) / (F / (X Y alpha) - 1 / (X M_Y))  (math >= FSDP + TP)",
                 f"({f:,} / ({y} * {r.axes_x})) / ({f:,} / ({n} * {r.alpha:.2f}) - 1 / ({x} * {r.axes_y}))",
                 note="" if b_serial else "none: TP alone is comm-bound"),
        Quantity("per_device_batch_serial", "  per device, B / (X * Y)", tokens(b_serial, n), "tokens/device",
                 "B / (X * Y)", f"{b_serial or 0:,.1f} / {n}"),
        Quantity("per_fsdp_rank_batch_serial", "  per FSDP rank, B / X", tokens(b_serial, x), "tokens",
                 "B / X", f"{b_serial or 0:,.1f} / {x}"),
        Quantity("max_tp", "TP degree beyond which TP alone is comm-bound", max_tp_degree(f, r), "degree",
                 "Y < F * M_Y / alpha", f"{f:,} * {r.axes_y} / {r.alpha:.2f}"),
        Quantity("best_per_device_batch_overlapped", f"best split of N = {n}: per-device batch, overlapped",
                 per_dev_2d[True], "tokens/device", "alpha^2 / (M_X M_Y F)  (at Y = F M_Y / alpha)",
                 f"{r.alpha:.2f}^2 / ({r.axes_x} * {r.axes_y} * {f:,})"),
        Quantity("best_per_device_batch_serial", f"best split of N = {n}: per-device batch, serialized",
                 per_dev_2d[False], "tokens/device", "4 alpha^2 / (M_X M_Y F)  (at X = X_opt)",
                 f"4 * {r.alpha:.2f}^2 / ({r.axes_x} * {r.axes_y} * {f:,})"),
        Quantity("x_opt", "  X_opt at that batch", optimal_fsdp_degree(per_dev_2d[False] * n, f, n, r), "degree",
                 "sqrt(B N M_X / (F M_Y))",
                 f"sqrt({per_dev_2d[False] * n:,.1f} * {n} * {r.axes_x} / ({f:,} * {r.axes_y}))"),
    ), notes=(
        "The batch is B tokens in total; each of the X FSDP ranks sees B / X, shared by its Y TP ranks.",
        "Every block costs the same, so these thresholds hold for the whole model (times above are per block).",
    ))

    return Report(
        title=f"{spec.name}: FFN-only model, {layers} blocks of D={d:,} -> F={f:,} -> D, FSDP {x} x TP {y}",
        assumptions=(
            "Blocks of two bias-free linear layers D -> F -> D, no activation function, attention, embedding "
            "or output layer (the CS336 XXL simplification).",
            "fp32 master weights, accumulated gradients and AdamW state (16 bytes/parameter); bf16 activations "
            "and gradient communication (2 bytes); no activation checkpointing.",
            "Activations saved for backward: the input of each linear layer (D and F values per token per block).",
            f"Scaling Book roofline: C = {r.flops:.4g} FLOP/s, W_ici = {r.bandwidth:.4g} B/s, M_X = {r.axes_x}, "
            f"M_Y = {r.axes_y}; a collective of V bytes over an axis takes V / (M W_ici).",
            "Forward pass only in (c); the FSDP weights all-gather, TP activations all-gather in and "
            "reduce-scatter out (bf16).",
        ),
        sections=(memory, sharding, compute, smaller_batch_section(f, x, y, r, b_over, b_serial)),
        inputs={"model": spec.name, "fsdp": x, "tp": y, "batch_tokens": batch_tokens,
                "budget_bytes": budget_bytes, "device_bytes": device_bytes,
                "roofline": {"C": r.flops, "W_ici": r.bandwidth, "M_X": r.axes_x, "M_Y": r.axes_y}},
    )


PIPELINE_STAGES = 4  # (d)'s pipeline: stages taken out of the FSDP degree (fewer where X has no factor 4)
MICRO_BATCHES_PER_STAGE = 4  # micro-batches per step = 4 x stages: the bubble it leaves


def smaller_batch_section(f: int, x: int, y: int, r: Roofline, b_over: float | None,
                          b_serial: float | None) -> Section:
    """(d): the forward pass compute-bound at a smaller global batch B on the same N = X Y devices. With the
    collectives overlapped the FSDP condition is B / X > alpha * (w / 2) / M_X, w the bytes of each gathered
    weight (module docstring; ``scaling``), so B falls with fewer FSDP ranks per layer, fewer bytes per weight,
    or more bandwidth per rank; TP's own limit (Y < F M_Y / alpha) bounds how far the degree can move to TP."""
    n = x * y
    fp8 = 1  # bytes per weight gathered in fp8 (bf16: BF16 = 2)
    stages = math.gcd(x, PIPELINE_STAGES)
    micro = MICRO_BATCHES_PER_STAGE * stages
    best_2d = min_batch_per_device_2d(f, r, overlapped=True) * n

    def scaled(factor: float) -> float | None:  # (c)'s overlapped batch, X alpha / M_X, times the trick's factor
        return None if b_over is None else b_over * factor  # None: TP alone is comm-bound at this Y
    return Section("smaller_batch", "(d) A smaller batch at full throughput: what each trick gives on the same devices", (
        Quantity("overlap", "overlap the collectives with the math (serialized -> overlapped)", b_over, "tokens",
                 "B > X alpha / M_X  instead of (c)'s serialized bound", f"{x} * {r.alpha:.2f} / {r.axes_x}",
                 note=f"from {b_serial:,.0f} tokens serialized (Scaling Book, Training)" if b_serial else ""),
        Quantity("fp8_gather", "gather the weights in fp8 (1 byte instead of 2)",
                 scaled(fp8 / BF16), "tokens",
                 "B > X alpha (w / 2) / M_X, w = 1 byte", f"{x} * {r.alpha:.2f} * (1 / 2) / {r.axes_x}",
                 note="halves the FSDP all-gather (FP8-LM, Peng et al. 2023; torchao float8 all-gather)"),
        Quantity("more_tp", "move degree from FSDP to TP (Y -> F M_Y / alpha, X = N / Y)", best_2d, "tokens",
                 "B > N alpha^2 / (M_X M_Y F)", f"{n} * {r.alpha:.2f}^2 / ({r.axes_x} * {r.axes_y} * {f:,})",
                 note=f"at Y = {max_tp_degree(f, r):.1f} (Scaling Book, Training: mixed FSDP and TP)"),
        Quantity("pipeline", f"pipeline {stages} stages of the layers (FSDP over X / {stages})",
                 scaled(1 / stages) if stages > 1 else None, "tokens",
                 "B > (X / P) alpha / M_X  (each stage gathers only its layers; stages pass activations)",
                 f"({x} / {stages}) * {r.alpha:.2f} / {r.axes_x}",
                 note=(f"idle bubble (P - 1) / (m + P - 1) = {(stages - 1) / (micro + stages - 1):.1%} at m = "
                       f"{micro} micro-batches (GPipe, Huang et al. 2019)") if stages > 1 else
                      f"X = {x} has no factor of {PIPELINE_STAGES} to give the pipeline"),
    ), notes=(
        "Each row changes one thing in (c)'s overlapped setting; the changes combine (e.g. fp8 gathers halve any "
        "FSDP-bound row).",
        "Also possible, not computed here: hierarchical sharding (gather over the fastest links only, W up), "
        "keeping gathered weights across micro-batches when memory allows (ZeRO-2 rather than ZeRO-3).",
    ))
