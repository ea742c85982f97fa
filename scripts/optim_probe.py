"""How fast is the optimizer step alone? A one-call probe for the step issue (GPU): ``python3 scripts/optim_probe.py OUT``.

On the parameter shapes of ``--model`` (default xl), times ``--steps`` optimizer steps after 3 warm-up steps with
CUDA events, median: torch's fused AdamW over fp32 parameters and gradients (what the stock step runs under
autocast) and ``torch_impl.optim.MasterAdamW`` over bf16 parameters and gradients (fp32 masters and moments),
each with the bytes it must move per step (28 per parameter for both) and the bandwidth that makes, beside a
device-to-device copy of a 2 GiB buffer in the same process (the anchor: what HBM gives a plain stream); then
MasterAdamW averaging a second gradient as it loads it (``Part.terms``: ``DDPBucketed(mean="optimizer")`` on 2
ranks, 30 bytes a parameter).
Prints a table; writes OUT/optim_probe.json. Not a record: the e2e benchmark's ``optimizer`` phase is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from parallelism_calc.specs import get_model
from torch_impl.model import TransformerLM
from torch_impl.optim import MasterAdamW, Part
from torch_impl.timing import median_ms

BYTES_PER_PARAM = 28  # fused fp32 AdamW: read p, g, m, v, write p, m, v; MasterAdamW: bf16 g and p, fp32 w, m, v


def optimizer_step(shapes: list[torch.Size], master: bool, terms: int = 1):
    """One optimizer over fresh parameters of these shapes with random gradients: returns its ``step`` (with
    ``terms`` > 1, ``step_parts`` of one part whose gradients come as that many terms)."""
    dtype = torch.bfloat16 if master else torch.float32
    params = [torch.nn.Parameter(torch.randn(shape, device="cuda") * 0.02) for shape in shapes]
    optimizer = (MasterAdamW(params, lr=1e-4) if master
                 else torch.optim.AdamW(params, lr=1e-4, fused=True))
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype) * 1e-3
    if terms == 1:
        return optimizer.step
    part = Part(params, lambda: None, [[p.grad] + [torch.randn_like(p.grad) * 1e-3 for _ in range(terms - 1)]
                                       for p in params])
    return lambda: optimizer.step_parts([part])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 scripts/optim_probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for optim_probe.json")
    parser.add_argument("--model", default="xl", help="whose parameter shapes (default xl)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = [p.shape for p in TransformerLM(get_model(args.model), device="meta").parameters()]
    n_params = sum(s.numel() for s in shapes)
    buffer = torch.empty(2**29, device="cuda")  # 2 GiB
    copy_ms = median_ms(lambda: buffer.clone(), args.steps)
    rows = [{"variant": "copy 2 GiB (anchor)", "ms": copy_ms, "gb_per_s": 2 * buffer.nbytes / copy_ms / 1e6}]
    del buffer
    variants = [("torch fused AdamW, fp32", False, 1), ("MasterAdamW, bf16 + fp32 master", True, 1),
                ("MasterAdamW, 2 terms", True, 2)]
    for name, master, terms in variants:
        ms = median_ms(optimizer_step(shapes, master, terms), args.steps)
        per_param = BYTES_PER_PARAM + (terms - 1) * 2  # each term past the first: 2 more bytes read
        rows.append({"variant": name, "ms": ms, "gb_per_s": per_param * n_params / ms / 1e6})
        torch.cuda.empty_cache()
    for row in rows:
        print(f"{row['variant']:<36} {row['ms']:8.2f} ms {row['gb_per_s']:8.0f} GB/s")
    (args.out / "optim_probe.json").write_text(json.dumps(
        {"model": args.model, "n_params": n_params, "n_tensors": len(shapes), "device": torch.cuda.get_device_name(),
         "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
