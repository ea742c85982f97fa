"""DP, FSDP, TP and FSDP x TP side by side for one FFN stack: FLOPs and communication of the forward and
backward passes, and the largest degree before communication dominates (the CS336 parallelism analysis).

Per block of ``n_matrices`` D x F matrices, with the costs of ``scaling.block_costs``. A strategy is
compute-bound when its math hides its collectives: for pure DP / FSDP / TP there is one kind of collective,
so overlapping changes nothing; for FSDP x TP both readings are given (overlapped: max; serialized: sum).
"""

from __future__ import annotations

from parallelism_calc.report import Quantity, Report, Section
from parallelism_calc.scaling import BlockCosts, Roofline, block_costs, max_tp_degree, min_batch_per_data_rank

PASSES = ("forward", "backward")


def _pass_quantities(prefix: str, costs: BlockCosts, flops: float) -> list[Quantity]:
    return [
        Quantity(f"{prefix}_flops", f"{prefix}: FLOPs per device per block", flops, "FLOP"),
        Quantity(f"{prefix}_math_s", f"{prefix}: math per block", costs.math, "s"),
        Quantity(f"{prefix}_weight_comm_s", f"{prefix}: weight collectives per block", costs.weight_comm, "s"),
        Quantity(f"{prefix}_tp_comm_s", f"{prefix}: TP activation collectives per block", costs.tp_comm, "s"),
        Quantity(f"{prefix}_compute_bound_overlapped", f"{prefix}: compute-bound, collectives overlapped",
                 costs.compute_bound(overlapped=True)),
        Quantity(f"{prefix}_compute_bound_serial", f"{prefix}: compute-bound, collectives serialized",
                 costs.compute_bound(overlapped=False)),
    ]


def strategies_report(d_model: int, d_ff: int, *, batch_tokens: float, n_devices: int, fsdp: int, tp: int,
                      roofline: Roofline, n_matrices: int = 2, name: str = "model") -> Report:
    """The four strategies on ``n_devices`` (FSDP x TP split as ``fsdp`` x ``tp``) for a batch of B tokens."""
    if fsdp * tp != n_devices:
        raise ValueError(f"FSDP x TP = {fsdp} x {tp} = {fsdp * tp} != {n_devices} devices")
    d, f, b, r, n = d_model, d_ff, batch_tokens, roofline, n_devices
    layouts = {  # strategy -> (X, Y, weights sharded over X)
        "dp": (n, 1, False),
        "fsdp": (n, 1, True),
        "tp": (1, n, False),
        "fsdp_tp": (fsdp, tp, True),
    }
    titles = {"dp": f"Data parallel over {n}", "fsdp": f"FSDP over {n}", "tp": f"Tensor parallel over {n}",
              "fsdp_tp": f"FSDP {fsdp} x TP {tp}"}
    sections = []
    for key, (x, y, sharded) in layouts.items():
        quantities: list[Quantity] = []
        for backward in (False, True):
            costs = block_costs(d, f, b, r, x=x, y=y, shard_weights=sharded, backward=backward, n_matrices=n_matrices)
            flops = (2 if backward else 1) * n_matrices * 2 * b * d * f / (x * y)
            quantities += _pass_quantities(PASSES[backward], costs, flops)
        quantities += _largest_degree(key, d, f, b, r, n_matrices)
        sections.append(Section(key, titles[key], tuple(quantities)))
    return Report(
        title=f"{name}: DP, FSDP, TP and FSDP x TP over {n} devices, batch {b:,.0f} tokens",
        assumptions=(
            f"Blocks of {n_matrices} D x F matrices (D = {d:,}, F = {d_ff:,}); bf16 weights, gradients and "
            "activations on the wire; attention and embeddings ignored.",
            f"C = {r.flops:.4g} FLOP/s, W_ici = {r.bandwidth:.4g} B/s, M_X = {r.axes_x}, M_Y = {r.axes_y}; "
            "a collective of V bytes over an axis takes V / (M W_ici).",
            "Backward: twice the math; FSDP all-gathers the weights again and reduce-scatters the gradients, DP "
            "all-reduces them, TP runs the mirror collectives of its forward.",
        ),
        sections=tuple(sections),
        inputs={"d_model": d, "d_ff": f, "n_matrices": n_matrices, "batch_tokens": b, "devices": n,
                "fsdp": fsdp, "tp": tp},
    )


def _largest_degree(strategy: str, d: int, f: int, b: float, r: Roofline, n_matrices: int) -> list[Quantity]:
    """The largest degree before communication dominates, for a global batch of B tokens."""
    if strategy in ("dp", "fsdp"):  # B / X > alpha / M_X
        x_max = b / min_batch_per_data_rank(r)
        return [Quantity("max_degree", "largest data-parallel degree (B / X > alpha / M_X)", x_max, "degree",
                         "B * M_X / alpha", f"{b:,.0f} * {r.axes_x} / {r.alpha:.2f}")]
    if strategy == "tp":
        return [Quantity(f"max_degree_{p}", f"largest TP degree, {p}", max_tp_degree(f, r, p == "backward", n_matrices),
                         "degree", "(n/2) * passes * F * M_Y / alpha") for p in PASSES]
    k = {"overlapped": 1, "serial": 4}  # B / N > k alpha^2 / (M_X M_Y F'), F' = (n/2) F, at the best split
    return [Quantity(f"max_devices_{reading}", f"most devices at the best split, {reading}",
                     b * r.axes_x * r.axes_y * f * n_matrices / 2 / (factor * r.alpha**2), "devices",
                     f"B M_X M_Y F' / ({factor} alpha^2)") for reading, factor in k.items()]
