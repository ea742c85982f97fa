"""How do ways of writing a block's projections compile? A one-call probe for the step issue (GPU):
``python3 scripts/block_probe.py OUT [--model xl] [--batch 4] [--seq 2048] [--variants apart,cat,cat+w13/slices]``.

One Transformer block of ours in bf16, compiled alone as the step compiles it (``fullgraph``, static shapes),
forward and backward from a random input, timed with CUDA events (median of ``--reps`` after 3 warm-up calls),
then profiled: its kernels with their time per call. A variant names how ``CausalSelfAttention.forward`` makes
q, k and v (``ATTENTION``), optionally ``+w13`` (SwiGLU's W1 and W3 as one product on their concatenated
weights) and ``/slices`` (Inductor lowers every ``cat`` as producers writing into slices of one buffer, not as
one pointwise kernel that loads every input). The Triton source of each variant's slowest generated kernel is
copied to OUT from Inductor's cache. Prints a table; writes OUT/block_probe.json. Not a record
(notes/train_step.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from parallelism_calc.specs import get_model
from torch_impl import model as ours
from torch_impl.profiling import is_kernel
from torch_impl.timing import median_ms

MODEL_FORWARD = ours.CausalSelfAttention.forward


def projections(self, x, how: str):
    """q, k, v as (B, T, H, d_head) before RoPE, computed the way ``how`` says."""
    batch, seq, d_model = x.shape
    split = (batch, seq, self.n_heads, d_model // self.n_heads)
    if how == "apart":
        return (F.linear(x, p.weight).view(split) for p in (self.q_proj, self.k_proj, self.v_proj))
    if how == "qk_cat":
        q, k = F.linear(x, torch.cat((self.q_proj.weight, self.k_proj.weight))).split(d_model, dim=-1)
        return q.view(split), k.view(split), F.linear(x, self.v_proj.weight).view(split)
    weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
    q, k, v = (t.view(split) for t in F.linear(x, weight).split(d_model, dim=-1))
    return q, k, (v.contiguous() if how == "cat_vcontig" else v)


def written(how: str):
    def forward(self, x, positions=None):
        batch, seq, d_model = x.shape
        q, k, v = projections(self, x, how)
        q, k, v = self.rope(q, positions).transpose(1, 2), self.rope(k, positions).transpose(1, 2), v.transpose(1, 2)
        out = self.attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))
    return forward


# how CausalSelfAttention.forward is written ("model": as torch_impl/model.py has it now)
ATTENTION = {"model": MODEL_FORWARD, "apart": written("apart"), "cat": written("cat"),
             "cat_vcontig": written("cat_vcontig"), "qk_cat": written("qk_cat")}
SWIGLU_FORWARD = ours.SwiGLU.forward


def swiglu_w13(self, x):
    """W2 (SiLU(a) * b) with a | b = x [W1; W3]^T: one product of width 2 d_ff."""
    a, b = F.linear(x, torch.cat((self.w1.weight, self.w3.weight))).chunk(2, dim=-1)
    return self.w2(F.silu(a) * b)


# every cat as a ConcatKernel: its inputs' producers write into slices of the output (the options this torch has)
CAT_AS_SLICES = {name: 0 for name in ("max_pointwise_cat_inputs", "max_complex_pointwise_cat_inputs")
                 if hasattr(torch._inductor.config, name)}


def parse_variant(variant: str) -> tuple[str, bool, bool]:
    """'cat+w13/slices' -> ('cat', True, True): the q/k/v form, W1|W3 as one product, cats as slices."""
    rest, slices = (variant[:-len("/slices")], True) if variant.endswith("/slices") else (variant, False)
    attention, w13 = (rest[:-len("+w13")], True) if rest.endswith("+w13") else (rest, False)
    return attention, w13, slices


def run(variant: str, spec, batch: int, seq: int, attention: str, reps: int, out: Path) -> dict:
    """``measure`` with the variant's forwards and Inductor options in place, the model's restored after."""
    attention_form, w13, slices = parse_variant(variant)
    ours.CausalSelfAttention.forward = ATTENTION[attention_form]
    ours.SwiGLU.forward = swiglu_w13 if w13 else SWIGLU_FORWARD
    try:
        with torch._inductor.config.patch(CAT_AS_SLICES if slices else {}):
            return measure(variant, spec, batch, seq, attention, reps, out)
    finally:
        ours.CausalSelfAttention.forward, ours.SwiGLU.forward = MODEL_FORWARD, SWIGLU_FORWARD


def measure(variant: str, spec, batch: int, seq: int, attention: str, reps: int, out: Path) -> dict:
    tag = variant.replace("/", "_").replace("+", "_")  # for file names
    cache = tempfile.mkdtemp(prefix=f"inductor_{tag}_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a fresh cache: this variant's generated code alone
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ours.TransformerLM(spec.replace(n_layers=1), attention, device="cuda").to(torch.bfloat16)
    block = model.layers[0]
    block.compile(fullgraph=True, dynamic=False)
    x = torch.randn(batch, seq, spec.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn_like(x)

    def step():
        x.grad = None
        for p in block.parameters():
            p.grad = None
        block(x).backward(grad_out)

    ms = median_ms(step, reps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            step()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.self_device_time_total / 4e3) for e in prof.key_averages() if is_kernel(e)),
                     key=lambda k: -k[1])
    slowest = next((name for name, _ in kernels if name.startswith("triton_")), None)
    source = None
    if slowest:
        for path in Path(cache).rglob("*.py"):
            if f"def {slowest}(" in path.read_text(errors="ignore"):
                source = out / f"block_probe_{tag}_{slowest[:60]}.py"
                source.write_text(path.read_text())
                break
    return {"variant": variant, "ms": ms, "grad_x_norm": x.grad.float().norm().item(),
            "kernels": [(name[:100], round(t, 4)) for name, t in kernels[:20]],
            "slowest_triton_source": source.name if source else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="xl")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--attention", default="sdpa_cudnn")
    parser.add_argument("--variants", default=",".join(ATTENTION))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if parse_variant(v)[0] not in ATTENTION]
    if unknown:
        print(f"block_probe: unknown variants {unknown}; accepted: one of {', '.join(ATTENTION)}, then optionally"
              " +w13, then optionally /slices", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("block_probe: needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    spec = get_model(args.model)
    spec = spec.replace(context_length=max(args.seq, spec.context_length))
    print(f"block_probe: torch {torch.__version__}; /slices sets {CAT_AS_SLICES}", flush=True)
    results = []
    for variant in args.variants.split(","):
        r = run(variant, spec, args.batch, args.seq, args.attention, args.reps, args.out)
        results.append(r)
        print(f"{variant:>12}: {r['ms']:.3f} ms fwd+bwd; |dx| {r['grad_x_norm']:.4g}; top: "
              + "; ".join(f"{n[:50]} {t:.3f}" for n, t in r["kernels"][:6]), flush=True)
    (args.out / "block_probe.json").write_text(json.dumps(
        {"model": args.model, "batch": args.batch, "seq": args.seq, "device": torch.cuda.get_device_name(),
         "torch": torch.__version__, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
