"""Full-Transformer accounting of a ``ModelSpec`` preset, as a ``Report``: the predictions measured runs are
checked against.

Parameters; FLOPs per token of the forward and backward passes (``compute``); activation bytes per token for
every checkpointing policy and attention kernel at the chosen precision (``memory``); what the loss saves and holds
(plain or fused, ``memory.loss_buffer_bytes``); per-device memory under DDP, ZeRO-1/2/3, FSDP and FSDP x TP for a
global batch on the chosen mesh (``memory.per_device_memory``); and, given a GPU ``HardwareSpec``, the train
step's time floor at its datasheet rates (``roofline.step_time_floor``).
"""

from __future__ import annotations

from parallelism_calc.compute import forward_flops
from parallelism_calc.memory import (ATTENTION, CHECKPOINTING, LOSSES, STRATEGIES, activation_bytes_per_token,
                                     get_precision, loss_buffer_bytes, per_device_memory)
from parallelism_calc.report import Quantity, Report, Section
from parallelism_calc.roofline import Ceilings, step_time_floor
from parallelism_calc.specs import HardwareSpec, ModelSpec, ParallelSpec

STRATEGY_TITLES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP",
                   "fsdp_tp": "FSDP x TP"}


def transformer_report(spec: ModelSpec, *, mesh: ParallelSpec, batch_tokens: int, seq_len: int,
                       precision: str = "bf16_autocast", checkpointing: str = "none", attention: str = "naive",
                       device_bytes: float = 80e9, prefetch_layers: int = 1, loss: str = "plain",
                       hardware: HardwareSpec | None = None) -> Report:
    """The report of ``python -m parallelism_calc PRESET`` for a Transformer preset (module docstring)."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; accepted: {', '.join(LOSSES)}")
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
                 activation_bytes_per_token(spec, seq_len, prec, policy, kernel, mesh.tp, loss=loss).total_bytes,
                 "bytes/token")
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
                              prefetch_layers, loss=loss)
        names = ("params", "grads", "master", "optimizer", "activations", "gathered", "cast_weights") + (
            ("loss_buffers",) if loss == "fused" else ())
        parts = ", ".join(f"{name} {getattr(m, name) / 1e9:,.2f}" for name in names)
        fits = "fits" if m.total <= device_bytes else "does not fit"
        memory_rows.append(Quantity(strategy, f"{STRATEGY_TITLES[strategy]}", m.total, "bytes", " + ".join(names),
                                    f"{parts} (GB)", note=f"{fits} in {device_bytes / 1e9:g} GB"))
    fsdp_tp = f"dp {mesh.dp} x fsdp {mesh.fsdp} x tp {mesh.tp}"
    memory = Section("memory", f"Per-device memory over {world} devices", tuple(memory_rows), notes=(
        f"DDP and ZeRO-1/2/3 / FSDP spread over all {world} devices as data parallelism; FSDP x TP uses the mesh "
        f"{fsdp_tp} (state sharded over fsdp x tp, the norm gains over fsdp only; replicated over dp).",
        "ZeRO-3 and FSDP are the same accounting; both hold the all-gathered working set of "
        f"{1 + prefetch_layers} units (a block or the embedding / LM head), gathered in the compute dtype and "
        "freed after each unit's forward (so no autocast weight copies live until backward).",
    ))

    tokens = batch_tokens // (mesh.dp * mesh.fsdp)  # one data-parallel rank's tokens
    loss_rows = []
    for kind in LOSSES:
        saved = activation_bytes_per_token(spec, seq_len, prec, loss=kind).terms
        kept = saved.get("extra.loss_log_softmax", saved.get("extra.loss_lse"))
        buffers = loss_buffer_bytes(spec, tokens, prec, kind)
        formula = ("saved 4 V N; buffers: forward N V (p + 4), backward N V (4 + 4)" if kind == "plain" else
                   "saved 4 N; buffers: forward c V (4 + 4), backward c V (4 + p) + V d 4")
        loss_rows.append(Quantity(f"{kind}_saved", f"{kind}: saved for backward", kept * tokens, "bytes", formula))
        loss_rows.append(Quantity(f"{kind}_peak", f"{kind}: working buffers at their peak", buffers.peak, "bytes",
                                  f"max(forward {buffers.forward:.4g}, backward {buffers.backward:.4g})"))
    loss_section = Section("loss", f"The loss on one data-parallel rank ({tokens:,} tokens; --loss {loss})",
                           tuple(loss_rows), notes=(
        "p = the logits' dtype bytes; c = the fused loss's chunk (memory.default_loss_chunk). The rows above count "
        "what the chosen loss saves; the fused loss's buffers too (loss_buffers), the plain loss's not (this "
        "all-at-once sum leaves them out; the timeline peak, per_device_memory(peak_model='timeline'), adds them: "
        "notes/train_step.md, notes/fidelity.md).",))

    sections = [model, activations, loss_section, memory]
    if hardware is not None:
        sections.append(_floor_section(spec, mesh, batch_tokens, seq_len, prec, checkpointing, loss, hardware))

    return Report(
        title=f"{spec.name}: d_model {d:,}, d_ff {spec.d_ff:,}, {spec.n_layers} layers, {spec.n_heads} heads, "
              f"vocab {v:,}; batch {batch_tokens:,} tokens of T = {seq_len:,}",
        assumptions=(
            f"Precision {prec.name}: parameters {prec.param_bytes} B, gradients {prec.grad_bytes} B, fp32 master "
            f"{prec.master_bytes} B, AdamW moments {prec.optimizer_bytes} B per parameter; activations "
            f"{prec.activation_bytes} B per element.",
            f"Checkpointing {checkpointing!r}, {attention} attention in the memory table; untied embedding and "
            "LM head; " + ("the loss keeps an fp32 log-softmax." if loss == "plain" else
                           "the fused loss keeps an fp32 log-sum-exp per token and holds one chunk of logits and "
                           "dW's fp32 accumulator."),
            "FLOPs: matrix products only, 2 per multiply-add; the backward pass is twice the forward.",
        ),
        sections=tuple(sections),
        inputs={"model": spec.name, "mesh": mesh.degrees(), "batch_tokens": batch_tokens, "seq_len": seq_len,
                "precision": prec.name, "checkpointing": checkpointing, "attention": attention,
                "device_bytes": device_bytes, "loss": loss, "hardware": hardware.name if hardware else None},
    )


def _floor_section(spec: ModelSpec, mesh: ParallelSpec, batch_tokens: int, seq_len: int, prec, checkpointing: str,
                   loss: str, hardware: HardwareSpec) -> Section:
    """The train step's time floor (``roofline.step_time_floor``) on ``hardware``'s datasheet rates: the FSDP row's
    sharding when the mesh has an fsdp axis, else DDP's; the recomputation of ``checkpointing`` and of the fused
    loss included."""
    if mesh.tp > 1:
        return Section("floor", f"Step time floor on {hardware.name}", (), notes=(
            "Not modelled with tensor parallelism (the floor knows data parallelism and FSDP).",))
    world = mesh.world_size
    strategy = "none" if world == 1 else "fsdp" if mesh.fsdp > 1 else "ddp"
    rates = hardware.bf16_flops if prec.autocast or prec.activation_bytes == 2 else hardware.fp32_flops
    ceilings = Ceilings(rates, hardware.memory_bw, hardware.interconnect_bw)
    floor = step_time_floor(spec, batch_tokens / world / seq_len, seq_len, "train_step", prec, ceilings, strategy,
                            world, recompute_blocks=int(checkpointing == "full"),
                            selective=checkpointing == "selective", loss=loss)
    parts = (("matmul_s", "matrix products (recomputation included)"), ("optimizer_s", "AdamW"),
             ("casts_s", "autocast weight casts"), ("elementwise_s", "elementwise kernels"),
             ("comm_s", f"communication ({strategy}, exposed)"))
    return Section("floor", f"Step time floor on {world} x {hardware.name} (datasheet rates)", tuple(
        Quantity(key, label, getattr(floor, key), "s") for key, label in parts) + (
        Quantity("total_s", "the step's floor (nothing overlapped)", floor.total_s, "s",
                 "matmul + optimizer + casts + elementwise + comm"),), notes=(
        f"C = {rates:.4g} FLOP/s, W = {hardware.memory_bw:.4g} B/s, bus {hardware.interconnect_bw:.4g} B/s: datasheet "
        "peaks, which kernels do not reach (parallelism_calc.roofline; measured ceilings give a higher floor).",))
