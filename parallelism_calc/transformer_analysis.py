"""Full-Transformer accounting of a ``ModelSpec`` preset, as a ``Report``: the predictions measured runs are
checked against.

Parameters; FLOPs per token of the forward and backward passes (``compute``); activation bytes per token for
every checkpointing policy and attention kernel at the chosen precision (``memory``); and per-device memory
under DDP, ZeRO-1/2/3, FSDP and FSDP x TP for a global batch on the chosen mesh (``memory.per_device_memory``).
"""

from __future__ import annotations

from parallelism_calc.compute import forward_flops
from parallelism_calc.memory import (ATTENTION, CHECKPOINTING, STRATEGIES, activation_bytes_per_token,
                                     get_precision, per_device_memory)
from parallelism_calc.report import Quantity, Report, Section
from parallelism_calc.specs import ModelSpec, ParallelSpec

STRATEGY_TITLES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP",
                   "fsdp_tp": "FSDP x TP"}


def transformer_report(spec: ModelSpec, *, mesh: ParallelSpec, batch_tokens: int, seq_len: int,
                       precision: str = "bf16_autocast", checkpointing: str = "none", attention: str = "naive",
                       device_bytes: float = 80e9, prefetch_layers: int = 1) -> Report:
    """The report of ``python -m parallelism_calc PRESET`` for a Transformer preset (module docstring)."""
    if spec.arch != "transformer":
        raise ValueError(f"the Transformer accounting needs arch='transformer'; {spec.name!r} is {spec.arch!r}")
    spec.check_seq_len(seq_len)
    if batch_tokens % seq_len:
        raise ValueError(f"batch_tokens={batch_tokens} is not a whole number of {seq_len}-token sequences")
    prec = get_precision(precision)
    d, v, n = spec.d_model, spec.vocab_size, spec.n_params()
    fwd = forward_flops(spec, 1, seq_len) / seq_len

    model = Section("model", "Parameters and FLOPs", (
        Quantity("n_params", "parameters", n, "params", "V d + L (4 d^2 + 3 d F + 2 d) + d + d V",
                 f"{v:,} * {d:,} + {spec.n_layers} * (4 * {d:,}^2 + 3 * {d:,} * {spec.d_ff:,} + 2 * {d:,}) "
                 f"+ {d:,} + {d:,} * {v:,}"),
        Quantity("forward_flops_per_token", f"forward FLOPs per token at T = {seq_len:,}", fwd, "FLOP/token",
                 "2 L (4 d^2 + 3 d F + 2 T d) + 2 d V  (attention counted full T x T)"),
        Quantity("backward_flops_per_token", "backward FLOPs per token", 2 * fwd, "FLOP/token", "2 x forward"),
        Quantity("step_flops", f"training step FLOPs for {batch_tokens:,} tokens", 3 * fwd * batch_tokens, "FLOP",
                 "3 x forward per token x tokens"),
    ))

    activations = Section("activations", f"Activations saved for backward per token ({prec.name}, TP {mesh.tp})", tuple(
        Quantity(f"{policy}_{kernel}", f"checkpointing {policy}, {kernel} attention",
                 activation_bytes_per_token(spec, seq_len, prec, policy, kernel, mesh.tp).total_bytes, "bytes/token")
        for policy in CHECKPOINTING for kernel in ATTENTION
    ), notes=("Counted tensor by tensor from our PyTorch model (RMSNorm keeps fp32 copies; autocast keeps a bf16 "
              "copy per consumer), checked against autograd's saved tensors in tests/test_calc_memory.py.",))

    world = mesh.world_size
    if batch_tokens % world:
        raise ValueError(f"batch_tokens={batch_tokens} is not divisible by the {world} devices (dp {mesh.dp} x fsdp "
                         f"{mesh.fsdp} x tp {mesh.tp}), over which the DDP, ZeRO and FSDP rows spread it as data "
                         "parallelism")
    memory_rows = []
    for strategy in STRATEGIES:
        layout = mesh if strategy == "fsdp_tp" else world  # the 1-D strategies spread over every device
        m = per_device_memory(spec, strategy, layout, batch_tokens, seq_len, prec, checkpointing, attention,
                              prefetch_layers)
        parts = ", ".join(f"{name} {getattr(m, name) / 1e9:,.2f}" for name in
                          ("params", "grads", "master", "optimizer", "activations", "gathered", "cast_weights"))
        fits = "fits" if m.total <= device_bytes else "does not fit"
        memory_rows.append(Quantity(strategy, f"{STRATEGY_TITLES[strategy]}", m.total, "bytes",
                                    "params + grads + master + optimizer + activations + gathered + cast_weights",
                                    f"{parts} (GB)", note=f"{fits} in {device_bytes / 1e9:g} GB"))
    fsdp_tp = f"dp {mesh.dp} x fsdp {mesh.fsdp} x tp {mesh.tp}"
    memory = Section("memory", f"Per-device memory over {world} devices", tuple(memory_rows), notes=(
        f"DDP and ZeRO-1/2/3 / FSDP spread over all {world} devices as data parallelism; FSDP x TP uses the mesh "
        f"{fsdp_tp} (state sharded over fsdp x tp, the norm gains over fsdp only; replicated over dp).",
        "ZeRO-3 and FSDP are the same accounting; both hold the all-gathered working set of "
        f"{1 + prefetch_layers} units (a block or the embedding / LM head), gathered in the compute dtype and "
        "freed after each unit's forward (so no autocast weight copies live until backward).",
    ))

    return Report(
        title=f"{spec.name}: d_model {d:,}, d_ff {spec.d_ff:,}, {spec.n_layers} layers, {spec.n_heads} heads, "
              f"vocab {v:,}; batch {batch_tokens:,} tokens of T = {seq_len:,}",
        assumptions=(
            f"Precision {prec.name}: parameters {prec.param_bytes} B, gradients {prec.grad_bytes} B, fp32 master "
            f"{prec.master_bytes} B, AdamW moments {prec.optimizer_bytes} B per parameter; activations "
            f"{prec.activation_bytes} B per element.",
            f"Checkpointing {checkpointing!r}, {attention} attention in the memory table; untied embedding and "
            "LM head; the loss keeps an fp32 log-softmax.",
            "FLOPs: matrix products only, 2 per multiply-add; the backward pass is twice the forward.",
        ),
        sections=(model, activations, memory),
        inputs={"model": spec.name, "mesh": mesh.degrees(), "batch_tokens": batch_tokens, "seq_len": seq_len,
                "precision": prec.name, "checkpointing": checkpointing, "attention": attention,
                "device_bytes": device_bytes},
    )
