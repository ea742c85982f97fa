"""``python -m parallelism_calc``: what a model costs and how it shards, in a second, without torch or jax.

    python -m parallelism_calc xxl --fsdp 16 --tp 4 [--explain] [--json]      the CS336 XXL analysis
    python -m parallelism_calc small --fsdp 4 --batch-tokens 32768            a Transformer preset's accounting
    python -m parallelism_calc strategies xxl --devices 64 --batch-tokens 1e6 DP / FSDP / TP / FSDP x TP
    python -m parallelism_calc collectives --bytes 1e9 --devices 2 4 8        ring collective times

Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from parallelism_calc.collectives import (ring_all_gather_time, ring_all_reduce_time, ring_reduce_scatter_time,
                                          whole_buffer_ring_all_reduce_time)
from parallelism_calc.ffn_analysis import xxl_report
from parallelism_calc.memory import ATTENTION, CHECKPOINTING, LOSSES, PRECISIONS
from parallelism_calc.report import Quantity, Report, Section
from parallelism_calc.scaling import CS336_V5P, Roofline
from parallelism_calc.specs import HARDWARE, MODELS, ModelSpec, ParallelSpec, get_hardware, get_model
from parallelism_calc.strategy_analysis import strategies_report
from parallelism_calc.transformer_analysis import transformer_report


from parallelism_calc.cli import (ArgumentParser as _Parser, BadInput, error_boundary, nonnegative_float,
                                  nonnegative_int, positive_float, positive_int)


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help=f"model preset: {', '.join(MODELS)}")
    dims = parser.add_argument_group("model dimensions (override the preset's)")
    for flag, field in (("--d-model", "d_model"), ("--d-ff", "d_ff"), ("--layers", "n_layers"),
                        ("--heads", "n_heads"), ("--vocab", "vocab_size"), ("--context", "context_length")):
        dims.add_argument(flag, dest=field, type=positive_int, help=f"{field}")


def _add_roofline(parser: argparse.ArgumentParser) -> None:
    hw = parser.add_argument_group("hardware (default: TPU v5p as CS336 rounds it, C = 4.6e14, W_ici = 1.8e11, "
                                   "M_X = 2, M_Y = 1)")
    hw.add_argument("--hardware", choices=list(HARDWARE), help="take C, W_ici and memory from a HardwareSpec preset")
    hw.add_argument("--flops", type=positive_float, help="C: bf16 FLOP/s per chip")
    hw.add_argument("--ici-bandwidth", type=positive_float, help="W_ici: bytes/s of one mesh axis, both directions")
    hw.add_argument("--mx", type=positive_int, help="M_X: mesh axes the FSDP/DP dimension spans (default 2)")
    hw.add_argument("--my", type=positive_int, help="M_Y: mesh axes the TP dimension spans (default 1)")


def _spec(args: argparse.Namespace) -> ModelSpec:
    spec = get_model(args.model)
    changes = {f: getattr(args, f) for f in ("d_model", "d_ff", "n_layers", "n_heads", "vocab_size",
                                             "context_length") if getattr(args, f) is not None}
    return spec.replace(**changes) if changes else spec


def _roofline(args: argparse.Namespace) -> Roofline:
    base = Roofline.from_hardware(get_hardware(args.hardware), CS336_V5P.axes_x, CS336_V5P.axes_y) \
        if args.hardware else CS336_V5P
    return Roofline(args.flops or base.flops, args.ici_bandwidth or base.bandwidth,
                    args.mx or base.axes_x, args.my or base.axes_y)


def _mesh(args: argparse.Namespace, spec: ModelSpec) -> ParallelSpec:
    """The mesh of --dp/--fsdp/--tp, checked against --devices and the model's divisibility."""
    mesh = ParallelSpec(dp=args.dp, fsdp=args.fsdp, tp=args.tp)
    if args.devices is not None:
        mesh = mesh.resolve(args.devices)
    elif not mesh.is_resolved:
        raise ValueError("a -1 mesh degree needs --devices to fill it in")
    if spec.d_ff % mesh.tp:
        raise ValueError(f"TP degree {mesh.tp} does not divide d_ff = {spec.d_ff}")
    if spec.arch == "transformer" and spec.n_heads % mesh.tp:
        raise ValueError(f"TP degree {mesh.tp} does not divide n_heads = {spec.n_heads}")
    return mesh


def _add_mesh(parser: argparse.ArgumentParser) -> None:
    mesh = parser.add_argument_group("mesh")
    for axis in ("dp", "fsdp", "tp"):
        mesh.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree (default 1; -1 fills --devices)")
    mesh.add_argument("--devices", type=positive_int, help="world size the degrees must multiply to")


def _emit(report: Report, args: argparse.Namespace) -> int:
    """The report as text, or as strict JSON (a non-finite value is an error, never ``NaN`` / ``Infinity``)."""
    if args.json:
        bad = [f"{s.key}.{q.key}" for s in report.sections for q in s.quantities
               if isinstance(q.value, float) and not math.isfinite(q.value)]
        if bad:
            raise ValueError(f"the inputs give non-finite results ({', '.join(bad)}); check them")
        print(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    else:
        print(report.to_text(explain=args.explain))
    return 0


def _add_output(parser: argparse.ArgumentParser) -> None:
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--explain", action="store_true", help="print each formula with the numbers substituted")
    output.add_argument("--json", action="store_true",
                        help="print the results as JSON (each quantity carries its formula and substituted "
                             "numbers, so --explain is not needed, nor accepted, with it)")


# ------------------------------------------------------------------------------------------- subcommands


def report_main(argv: list[str]) -> int:
    parser = _Parser(prog="python -m parallelism_calc", description=__doc__.split("\n\n")[0],
                     epilog="Other subcommands: strategies, collectives (each with --help).")
    _add_model(parser)
    _add_mesh(parser)
    parser.add_argument("--batch-tokens", type=positive_int,
                        help="global batch in tokens (default: XXL the smallest compute-bound batch, "
                             "Transformers 4 sequences per data-parallel rank, rounded up to a multiple of the "
                             "devices)")
    parser.add_argument("--budget-gb", type=positive_float,
                        help="per-device budget for the smallest N_FSDP (default: --hardware's memory, else 95, a TPU v5p)")
    parser.add_argument("--device-memory-gb", type=positive_float,
                        help="device size for 'how many devices' and 'fits' (default: --hardware's memory, else 80, "
                             "an H100)")
    lm = parser.add_argument_group("Transformer presets")
    lm.add_argument("--seq-len", type=positive_int, help="sequence length (default: the preset's context)")
    lm.add_argument("--precision", choices=list(PRECISIONS), default="bf16_autocast",
                    help="training precision (default bf16_autocast: fp32 state, bf16 activations)")
    lm.add_argument("--checkpointing", choices=CHECKPOINTING, default="none", help="activation checkpointing")
    lm.add_argument("--attention", choices=ATTENTION, default="naive", help="attention kernel (naive or flash)")
    lm.add_argument("--prefetch-layers", type=nonnegative_int, default=1,
                    help="FSDP layers gathered ahead (default 1)")
    lm.add_argument("--loss", choices=LOSSES, default="plain",
                    help="plain: the logits, then the cross-entropy (keeps an fp32 log-softmax); fused: the LM head "
                         "and the loss chunked over tokens, never the logits (default plain)")
    _add_roofline(parser)
    _add_output(parser)
    args = parser.parse_args(argv)
    spec = _spec(args)
    mesh = _mesh(args, spec)
    hardware_bytes = get_hardware(args.hardware).memory_bytes if args.hardware else None
    device_bytes = args.device_memory_gb * 1e9 if args.device_memory_gb else hardware_bytes or 80e9
    if spec.arch == "ffn_only":
        budget_bytes = args.budget_gb * 1e9 if args.budget_gb else hardware_bytes or 95e9
        report = xxl_report(spec, fsdp=mesh.fsdp, tp=mesh.tp, roofline=_roofline(args),
                            batch_tokens=args.batch_tokens, budget_bytes=budget_bytes, device_bytes=device_bytes)
    else:
        seq_len = args.seq_len or spec.context_length
        # 4 sequences per data-parallel rank, rounded up to a multiple of the devices (the 1-D strategies'
        # data-parallel ranks)
        batch = args.batch_tokens or math.lcm(4 * mesh.dp * mesh.fsdp, mesh.world_size) * seq_len
        report = transformer_report(spec, mesh=mesh, batch_tokens=batch, seq_len=seq_len,
                                    precision=args.precision, checkpointing=args.checkpointing,
                                    attention=args.attention, device_bytes=device_bytes,
                                    prefetch_layers=args.prefetch_layers, loss=args.loss,
                                    hardware=get_hardware(args.hardware) if args.hardware else None)
    return _emit(report, args)


def strategies_main(argv: list[str]) -> int:
    parser = _Parser(prog="python -m parallelism_calc strategies",
                     description="DP, FSDP, TP and FSDP x TP of a model's FFN: FLOPs and communication of forward "
                                 "and backward, and the largest degree before communication dominates.")
    _add_model(parser)
    parser.add_argument("--batch-tokens", type=positive_int, required=True, help="global batch in tokens")
    parser.add_argument("--devices", type=positive_int, required=True, help="number of devices")
    parser.add_argument("--fsdp", type=positive_int, help="FSDP degree of the 2D split (default: devices / --tp)")
    parser.add_argument("--tp", type=positive_int, default=1, help="TP degree of the 2D split (default 1)")
    _add_roofline(parser)
    _add_output(parser)
    args = parser.parse_args(argv)
    spec = _spec(args)
    fsdp = args.fsdp or args.devices // args.tp
    n_matrices = 2 if spec.arch == "ffn_only" else 3  # SwiGLU has three D x F matrices
    report = strategies_report(spec.d_model, spec.d_ff, batch_tokens=args.batch_tokens, n_devices=args.devices,
                               fsdp=fsdp, tp=args.tp, roofline=_roofline(args), n_matrices=n_matrices, name=spec.name)
    return _emit(report, args)


def collectives_main(argv: list[str]) -> int:
    parser = _Parser(prog="python -m parallelism_calc collectives",
                     description="Ring all-gather, reduce-scatter and all-reduce times (alpha-beta model).")
    parser.add_argument("--bytes", type=positive_float, required=True, help="size V of the full buffer in bytes")
    parser.add_argument("--devices", type=positive_int, nargs="+", required=True, help="ring sizes, e.g. 2 4 8")
    parser.add_argument("--bandwidth", type=positive_float,
                        help="bytes/s per device, one direction (default: --hardware's interconnect)")
    parser.add_argument("--hardware", choices=list(HARDWARE), default="h100", help="default bandwidth (h100)")
    parser.add_argument("--latency", type=nonnegative_float, default=0.0, help="seconds per ring step (default 0)")
    _add_output(parser)
    args = parser.parse_args(argv)
    w = args.bandwidth or get_hardware(args.hardware).interconnect_bw
    v, lat = args.bytes, args.latency
    ops = (("all_gather", "all-gather", ring_all_gather_time, "(n-1)/n * V/W + (n-1) lat"),
           ("reduce_scatter", "reduce-scatter", ring_reduce_scatter_time, "(n-1)/n * V/W + (n-1) lat"),
           ("all_reduce", "all-reduce (reduce-scatter + all-gather)", ring_all_reduce_time,
            "2 (n-1)/n * V/W + 2 (n-1) lat"),
           ("whole_buffer_all_reduce", "all-reduce, whole buffer around the ring", whole_buffer_ring_all_reduce_time,
            "2 (n-1) * (V/W + lat)"))
    sections = tuple(
        Section(f"n{n}", f"{n} devices", tuple(
            Quantity(key, label, fn(v, n, w, lat), "s", formula, f"V = {v:.4g}, n = {n}, W = {w:.4g}, lat = {lat:g}")
            for key, label, fn, formula in ops))
        for n in args.devices)
    report = Report(title=f"Ring collectives of {v:.4g} bytes at {w:.4g} B/s per device",
                    assumptions=("Ring algorithm, one direction per link at W bytes/s, `lat` seconds per step; "
                                 "V is the full (gathered or reduced) buffer.",),
                    sections=sections, inputs={"bytes": v, "bandwidth": w, "latency": lat, "devices": args.devices})
    return _emit(report, args)


SUBCOMMANDS = {"strategies": strategies_main, "collectives": collectives_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    run = SUBCOMMANDS.get(argv[0], report_main) if argv else report_main
    try:
        return error_boundary(run, prog="python -m parallelism_calc")(argv[1:] if run is not report_main else argv)
    except BadInput as exit:
        return exit.code


if __name__ == "__main__":
    sys.exit(main())
