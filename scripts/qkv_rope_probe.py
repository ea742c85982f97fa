"""Does RoPE pay in the epilogue of the q, k, v product? A one-call probe for the step issue (GPU, sm_90):
``python3 scripts/qkv_rope_probe.py OUT [--models xl,2.7B] [--reps 30]``.

The model's path (``qkv_projection``: the three weights concatenated, cuBLAS's product, then q and k rotated and the
three split by ``rotate_split``'s Triton pass) against ``torch_impl.qkv_rope_gluon.qkv_rope_gemm`` (the weights read
where they are, the product rotated in its epilogue) at each configuration, at each model's attention shapes (batch x
sequence tokens). Each call is replayed from a CUDA graph between CUDA events (median of ``--reps``; the host's
launch path left out). Each Gluon row first compares its q, k, v with the model path's, relative to their largest
magnitude (a wrong kernel is not timed). Prints the rows and writes OUT/qkv_rope_probe.json as it measures them.
Not a record: it finds whether the lever exists (notes/train_step.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"xl": (4, 2048), "2.7B": (2, 2048)}  # batch, sequence: the records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", default="xl,2.7B", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := [m for m in models if m not in SHAPES]:
        parser.error(f"--models: unknown {', '.join(unknown)}; accepted: {', '.join(SHAPES)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("qkv_rope_probe: needs an sm_90 GPU (the Gluon kernel)", file=sys.stderr)
        return 2
    from parallelism_calc.specs import get_model
    from torch_impl import qkv_rope_gluon
    from torch_impl.model import RotaryEmbedding
    from torch_impl.qkv_pack_triton import launch_split
    from torch_impl.timing import median_ms

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []

    def add(row: dict) -> None:  # printed and written as measured: a call cut short keeps what it had
        rows.append(row)
        print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        (args.out / "qkv_rope_probe.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))

    for name in models:
        spec = get_model(name)
        batch, seq = SHAPES[name]
        d, heads = spec.d_model, spec.n_heads
        tokens, flops = batch * seq, 2 * batch * seq * d * 3 * d
        x = torch.randn(batch, seq, d, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(d, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5 for _ in range(3)]
        rope = RotaryEmbedding(d // heads, seq, spec.rope_theta, device="cuda")
        cos, sin = (t.contiguous() for t in rope.tables(seq))

        weight_cat = torch.cat(weights)

        def product():  # as QKVProduct's forward: the weights concatenated at every call, then cuBLAS
            return F.linear(x, torch.cat(weights))

        def model_path():
            return launch_split(product().view(batch, seq, 3 * d), cos, sin, heads)

        expected = torch.stack(model_path(), dim=2).float()  # (B, T, 3, H, d_head)
        scale = expected.abs().max().item()
        product_out = product().view(batch, seq, 3 * d)
        base = {"model": name, "tokens": tokens, "d_model": d}
        for variant, fn, fn_flops in (
                ("cuBLAS product (weights concatenated) + split pass", model_path, flops),
                ("(the concatenation and cuBLAS's product)", product, flops),
                ("(cuBLAS's product alone)", lambda: F.linear(x, weight_cat), flops),
                ("(the split pass alone)", lambda: launch_split(product_out, cos, sin, heads), None)):
            ms = median_ms(fn, args.reps, graph=True)
            add({**base, "variant": variant, "ms": ms, **({"tflops": fn_flops / ms / 1e9} if fn_flops else {})})
        for i, config in enumerate(qkv_rope_gluon.CONFIGS):
            variant = f"gluon product with RoPE, config {i} {config}"
            try:
                got = qkv_rope_gluon.qkv_rope_gemm(x, *weights, cos, sin, config)
                diff = (got.view(batch, seq, 3, heads, -1).float() - expected).abs().max().item() / scale
                if not diff <= 0.02:  # NaN too: bf16's rounding of a value differs by 2^-8 of it at most, twice
                    add({**base, "variant": variant, "error": f"wrong: {diff:.3g} of the largest"})
                    continue
                ms = median_ms(lambda: qkv_rope_gluon.qkv_rope_gemm(x, *weights, cos, sin, config), args.reps,
                               graph=True)
                add({**base, "variant": variant, "ms": ms, "tflops": flops / ms / 1e9, "max_diff": diff})
            except Exception as error:  # noqa: BLE001 (a config that does not compile, fit or run: a row)
                add({**base, "variant": variant, "error": f"{type(error).__name__}: {str(error)[:300]}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
