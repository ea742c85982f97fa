"""Mixed precision, measured: ``python -m torch_impl.bench.precision [--device cuda] [--out FILE]``.

Two experiments of CS336 assignment 2 (section 1.1.3), produced by code so that nothing is typed by hand:

* accumulation — add 0.01 to a running sum 1,000 times with the accumulator and the addend in fp32, fp16 or
  bf16 (and the half-precision addend upcast before the add); the exact answer is 10. Rounding the
  accumulator to a short mantissa loses the small addends once the sum is large, which is why mixed
  precision keeps accumulators and master weights in fp32.
* autocast — the dtypes the CS336 ToyModel (fc1 -> ReLU -> LayerNorm -> fc2) sees under ``torch.autocast``:
  parameters, fc1 output, LayerNorm output, logits, loss and gradients. Matmuls run in the low precision,
  the loss in fp32, parameters and their gradients stay fp32; LayerNorm (a reduction) runs in fp32 under
  CUDA autocast but stays in the low precision under CPU autocast (each record names its device).

Each row is a record (suite "precision"); the two tables are printed (and written with ``--table``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

from analysis.records import Record, save_records
from parallelism_calc.cli import ArgumentParser, error_boundary, writable_path
from torch_impl.device import pick_device

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (accumulator, addend, cast the addend to the accumulator's dtype before adding)
ACCUMULATIONS = [("fp32", "fp32", False), ("fp16", "fp16", False), ("bf16", "bf16", False),
                 ("fp32", "fp16", False), ("fp32", "fp16", True), ("fp32", "bf16", False), ("fp32", "bf16", True)]


def accumulate(accumulator: str, addend: str, upcast: bool, steps: int = 1000, value: float = 0.01,
               device: str = "cpu") -> float:
    """sum_{i < steps} value with the sum kept in ``accumulator`` and each term in ``addend`` precision."""
    total = torch.tensor(0, dtype=DTYPES[accumulator], device=device)
    term = torch.tensor(value, dtype=DTYPES[addend], device=device)
    for _ in range(steps):
        total += term.to(total.dtype) if upcast else term
    return float(total)


class ToyModel(nn.Module):
    """The CS336 ToyModel: fc1 -> ReLU -> LayerNorm -> fc2 (no biases in the linears)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))


def autocast_dtypes(dtype: str, device: str = "cpu") -> dict[str, str]:
    """The dtype of each tensor of one ToyModel training step under ``torch.autocast(device, dtype)``."""
    torch.manual_seed(0)
    model = ToyModel(16, 4).to(device)
    seen: dict[str, str] = {}
    for name in ("fc1", "ln"):
        getattr(model, name).register_forward_hook(
            lambda module, args, out, name=name: seen.__setitem__(f"{name} output", str(out.dtype)))
    x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)
    with torch.autocast(device, dtype=DTYPES[dtype]):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
    loss.backward()
    return {"parameters": _one_dtype(p.dtype for p in model.parameters()), **seen, "logits": str(logits.dtype),
            "loss": str(loss.dtype), "gradients": _one_dtype(p.grad.dtype for p in model.parameters())}


def _one_dtype(dtypes) -> str:
    return ", ".join(sorted({str(d) for d in dtypes}))


def records(device: str, autocast: list[str]) -> list[Record]:
    rows = []
    for acc, add, upcast in ACCUMULATIONS:
        result = accumulate(acc, add, upcast, device=device)
        rows.append(Record(suite="precision", backend="torch", implementation="accumulation", dtype=acc,
                           metrics={"accumulator": acc, "addend": add + (" -> " + acc if upcast else ""),
                                    "result": result, "abs_error": abs(result - 10.0)}))
    for dtype in autocast:
        rows.append(Record(suite="precision", backend="torch", implementation="autocast", dtype=dtype,
                           metrics=autocast_dtypes(dtype, device)))
    for row in rows:
        row.provenance["device_name"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return rows


def tables(rows: list[Record]) -> str:
    """The two Markdown tables of a run, built from its records."""
    acc = [r.metrics for r in rows if r.implementation == "accumulation"]
    lines = ["Accumulating 0.01 one thousand times (exact: 10)", "",
             "| accumulator | addend | result | abs. error |", "|:--|:--|--:|--:|"]
    lines += [f"| {m['accumulator']} | {m['addend']} | {m['result']:.6f} | {m['abs_error']:.2e} |" for m in acc]
    auto = [r for r in rows if r.implementation == "autocast"]
    if auto:
        keys = list(auto[0].metrics)
        lines += ["", "ToyModel dtypes under torch.autocast", "",
                  "| tensor | " + " | ".join(f"autocast {r.dtype}" for r in auto) + " |",
                  "|:--|" + "--|" * len(auto)]
        lines += [f"| {k} | " + " | ".join(r.metrics[k] for r in auto) + " |" for k in keys]
    return "\n".join(lines)


@error_boundary(prog="python -m torch_impl.bench.precision")
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m torch_impl.bench.precision", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default cpu)")
    parser.add_argument("--autocast", default="bf16,fp16", help="autocast dtypes, comma-separated (default bf16,fp16)")
    parser.add_argument("--out", type=writable_path, help="append the records to this JSON Lines file")
    parser.add_argument("--table", type=writable_path, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    autocast = [d for d in args.autocast.split(",") if d]
    unknown = [d for d in autocast if d not in ("bf16", "fp16")]
    if unknown:
        parser.error(f"autocast dtype(s) {unknown}; accepted: bf16, fp16")
    pick_device(args.device)
    rows = records(args.device, autocast)
    if args.out:
        save_records(args.out, rows)
    text = tables(rows)
    print(text)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
