"""Inside one self-attention layer, the matmuls against the softmax: ``python -m torch_impl.bench.attention_parts``.

The CS336 profiling question (e): how does the softmax's time compare with the attention matmuls' time, and how does
that ratio compare with the ratio of their FLOPs? Runs the model's naive attention (``q kᵀ / sqrt(d)``, causal
mask, softmax, weights @ v: ``torch_impl.attention.naive``) at one layer's shapes of a preset (batch x heads x
sequence x head dim) under ``torch.profiler`` (``torch_impl.profiling``), forward alone and forward + backward,
and records each kernel category's device time per call (matmul, reduction-softmax, elementwise: the mask and the
scaling) next to the FLOPs of the matmuls (4 B H N² d forward, twice that backward) and of the softmax (5 B H N²
forward: max, subtract, exp, sum, divide; 4 B H N² backward). One record per pass, suite "attention_parts"::

    python -m torch_impl.bench.attention_parts --model xl --batch-size 4 --seq-len 512 --dtype fp32 \\
        --out results/attention_parts_h100.jsonl
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

import torch

from analysis.records import Record, provenance, save_records
from parallelism_calc.cli import ArgumentParser, error_boundary, positive_int, writable_path
from parallelism_calc.specs import MODELS, get_model
from torch_impl.attention.naive import future_mask, naive_attention
from torch_impl.device import device_name, pick_device
from torch_impl.profiling import profile_steps

PASSES = ("forward", "forward_backward")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# FLOPs per score entry (B H N² of them): the two matmuls count 2 d each; the softmax's elementwise work
MATMUL_FLOPS = {"forward": 4, "forward_backward": 4 + 8}  # times d
SOFTMAX_FLOPS = {"forward": 5, "forward_backward": 5 + 4}


def measure(model: str, batch_size: int, seq_len: int, dtype: str, device: torch.device, calls: int) -> list[Record]:
    spec = get_model(model)
    heads, head_dim = spec.n_heads, spec.d_model // spec.n_heads
    shape = (batch_size, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=TORCH_DTYPES[dtype], requires_grad=True) for _ in range(3))
    future = future_mask(seq_len, seq_len, device)
    grad = torch.randn(shape, device=device, dtype=q.dtype)

    def forward() -> None:
        with torch.no_grad():
            naive_attention(q, k, v, True, future)

    def forward_backward() -> None:
        naive_attention(q, k, v, True, future).backward(grad)
        q.grad = k.grad = v.grad = None

    records = []
    entries = batch_size * heads * seq_len**2
    for mode, fn in zip(PASSES, (forward, forward_backward)):
        for _ in range(3):  # warm-up: allocator, cuBLAS handles
            fn()
        rows = profile_steps(fn, calls, None, tag=mode)  # the kernel table is the result; no trace is written
        ms = {row.category: row.time_ms for row in rows}
        matmul_flops, softmax_flops = MATMUL_FLOPS[mode] * entries * head_dim, SOFTMAX_FLOPS[mode] * entries
        records.append(Record(
            suite="attention_parts", backend="torch", implementation="naive attention, one layer", model=spec.name,
            model_dims=dataclasses.asdict(spec), batch_size=batch_size, seq_len=seq_len, dtype=dtype, mode=mode,
            timed_steps=calls, flops_per_step=matmul_flops + softmax_flops,
            metrics={"heads": heads, "head_dim": head_dim, **{f"{c}_ms": t for c, t in ms.items()},
                     "matmul_flops": matmul_flops, "softmax_flops": softmax_flops,
                     "kernels": {name: t for row in rows for name, t in row.kernels}},
            provenance=provenance(device_name(device)),
        ))
    return records


@error_boundary(prog="python -m torch_impl.bench.attention_parts")
def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m torch_impl.bench.attention_parts", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="xl", choices=[m for m in MODELS if get_model(m).arch == "transformer"],
                        help="preset whose heads and head dim set the layer's shapes (default xl)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences (default 4)")
    parser.add_argument("--seq-len", type=positive_int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--dtype", choices=list(TORCH_DTYPES), default="fp32", help="fp32 (no TF32) or bf16")
    parser.add_argument("--calls", type=positive_int, default=10, help="profiled calls per pass (default 10)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", type=writable_path, help="append the records to this JSON Lines file")
    args = parser.parse_args(argv)
    if args.dtype == "fp32":
        torch.set_float32_matmul_precision("highest")
    records = measure(args.model, args.batch_size, args.seq_len, args.dtype, pick_device(args.device), args.calls)
    for r in records:
        m = r.metrics
        print(f"{r.mode}: matmul {m.get('matmul_ms', 0):.3f} ms ({m['matmul_flops'] / 1e9:.1f} GFLOP), softmax "
              f"{m.get('reduction-softmax_ms', 0):.3f} ms ({m['softmax_flops'] / 1e9:.2f} GFLOP), elementwise "
              f"{m.get('elementwise_ms', 0):.3f} ms per call")
    if args.out:
        save_records(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
