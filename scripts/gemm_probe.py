"""How fast is each GEMM of a training step, and the LM head with its loss? A one-call probe for the step issue
(GPU): ``python3 scripts/gemm_probe.py OUT [--model xl] [--tokens 8192]``.

Times, in bf16 with CUDA events (median of ``--reps`` after 3 warm-up calls), every matrix product of one train
step of ``--model`` at ``--tokens`` tokens: for each weight (N, K) of ``nn.Linear`` layout the forward x W^T, the
input gradient dy W and the weight gradient dy^T x, with their TFLOP/s and their time per step (48 blocks count
48 times). The LM head is timed at the spec's vocabulary and padded to a multiple of ``--pad`` (a vocabulary of
50,257 leaves every logits row at an odd address: cuBLAS cannot use its aligned kernels), then the head with its
loss, forward and backward, in the ways the step could run it. Prints tables; writes OUT/gemm_probe.json. Not a
record: the e2e benchmark makes those; this finds what to fix (notes/train_step.md).
``--graph``: each product captured in a CUDA graph, as the step's blocks run, timed by its replays, and the memsets
cuBLAS puts before its kernel counted (torch.profiler; the step's kernel table has one before ~240 products a step,
each with a gap: notes/train_step.md, session 49). cuBLAS's settings (``CUBLAS_WORKSPACE_CONFIG``,
``TORCH_BLAS_PREFER_CUBLASLT``) are the environment's, kept in the output's provenance: a run per setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from analysis.records import provenance
from parallelism_calc.specs import get_model
from torch_impl.model import cross_entropy
from torch_impl.timing import capture_step, median_ms


# the step's weights as (name, N, K, uses per step, whether the step's dx takes W column-major); names in
# parentheses are alternatives, not in the step's sum
def weights(spec, pad: int) -> list[tuple[str, int, int, int, bool]]:
    """(name, N, K, uses per step, dx on W column-major) for every weight of the step (q, k and v as one product,
    whose backward concatenates the weights' transposes: torch_impl.qkv_projection), then alternatives: the three
    products apart, the head padded to a multiple of ``pad``."""
    d, f, layers, vocab = spec.d_model, spec.d_ff, spec.n_layers, spec.vocab_size
    padded = -(-vocab // pad) * pad
    return [("q+k+v", 3 * d, d, layers, True), ("o", d, d, layers, False), ("w1|w3", f, d, 2 * layers, False),
            ("w2", d, f, layers, False), (f"head {vocab}", vocab, d, 1, False),
            ("(q|k|v apart)", d, d, 3 * layers, False), (f"(head padded {padded})", padded, d, 1, False)]


def memsets_per_call(fn, calls: int = 5) -> float:
    """GPU memsets per ``fn()`` call (torch.profiler's "Memset" events over ``calls`` calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum("Memset" in e.name for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA) / calls


def gemm_rows(spec, tokens: int, pad: int, reps: int, graph: bool = False) -> list[dict]:
    rows = []
    for name, n, k, uses, column_major_dx in weights(spec, pad):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w_other = w.t().contiguous().t()  # the same (N, K) matrix, column-major: cuBLAS's other layout
        dx_w, other_w = (w_other, w) if column_major_dx else (w, w_other)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        for product, fn in (("forward x W^T", lambda: x @ w.t()), ("input grad dy W", lambda: dy @ dx_w),
                            ("weight grad dy^T x", lambda: dy.t() @ x),
                            ("(weight grad (x^T dy)^T)", lambda: (x.t() @ dy).t()),
                            (f"(input grad, W {'in rows' if column_major_dx else 'column-major'})",
                             lambda: dy @ other_w)):
            try:
                replay = capture_step(fn, warmup=3) if graph else fn  # one graph, timed and its memsets counted
                ms = median_ms(replay, reps)
                extra = {"memsets": memsets_per_call(replay)} if graph else {}
            except RuntimeError as error:  # an alternative this torch or GPU lacks: a row that says so
                rows.append({"weight": name, "product": product, "M": tokens, "N": n, "K": k, "uses": uses,
                             "error": (str(error).splitlines() or [repr(error)])[0]})
                continue
            rows.append({"weight": name, "product": product, "M": tokens, "N": n, "K": k, "uses": uses, "ms": ms,
                         "tflops": 2 * tokens * n * k / ms / 1e9, "ms_per_step": ms * uses, **extra})
        del x, w, w_other, dx_w, other_w, dy
    return rows


def head_rows(spec, tokens: int, pad: int, reps: int) -> list[dict]:
    """The LM head and its loss, forward and backward, from the final norm's output h (tokens, d) in bf16."""
    vocab, padded = spec.vocab_size, -(-spec.vocab_size // pad) * pad
    h = torch.randn(1, tokens, spec.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vocab, spec.d_model, device="cuda", dtype=torch.bfloat16) * 0.02)
    targets = torch.randint(vocab, (1, tokens), device="cuda")
    compiled_loss = torch.compile(cross_entropy)

    def eager_head_compiled_loss():  # the step today: eager F.linear, then the compiled float32 loss
        return compiled_loss(F.linear(h, weight), targets)

    def padded_head_compiled_loss():  # the weight padded with zero rows; the loss sees the first `vocab` logits
        logits = F.linear(h, F.pad(weight, (0, 0, 0, padded - vocab)))
        return compiled_loss(logits[..., :vocab], targets)

    def head_and_loss(w, y):
        return cross_entropy(F.linear(h, w), y)

    def padded_head_and_loss(w, y):
        return cross_entropy(F.linear(h, F.pad(w, (0, 0, 0, padded - vocab)))[..., :vocab], y)

    variants = {"eager head, compiled loss": eager_head_compiled_loss,
                f"padded head ({padded}), compiled loss": padded_head_compiled_loss,
                "head and loss compiled": lambda c=torch.compile(head_and_loss): c(weight, targets),
                f"padded head ({padded}) and loss compiled": lambda c=torch.compile(padded_head_and_loss):
                    c(weight, targets)}
    reference = None
    rows = []
    for name, loss_fn in variants.items():
        def step():
            h.grad = weight.grad = None
            loss = loss_fn()
            loss.backward()
            return loss
        ms = median_ms(step, reps)
        loss = step()
        grads = (h.grad.float(), weight.grad.float())
        if reference is None:
            reference = (loss.item(), grads)
        error = max((g - r).abs().max().item() / r.abs().max().item() for g, r in zip(grads, reference[1]))
        rows.append({"variant": name, "ms": ms, "loss": loss.item(), "loss_diff": abs(loss.item() - reference[0]),
                     "grad_max_rel_diff": error, "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        torch.cuda.reset_peak_memory_stats()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="xl")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x sequence)")
    parser.add_argument("--pad", type=int, default=128, help="pad the vocabulary to a multiple of this")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--graph", action="store_true",
                        help="time each product's CUDA graph replays and count cuBLAS's memsets a call")
    parser.add_argument("--no-head", action="store_true", help="the products only: skip the LM head with its loss")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_probe: needs a CUDA device", file=sys.stderr)
        return 2
    spec = get_model(args.model)
    gemms = gemm_rows(spec, args.tokens, args.pad, args.reps, args.graph)
    print(f"{'weight':>22} {'product':>20} {'M x N x K':>20} {'ms':>8} {'TFLOP/s':>8} {'ms/step':>8}"
          + (f" {'memsets':>8}" if args.graph else ""))
    for r in gemms:
        if "error" in r:
            print(f"{r['weight']:>22} {r['product']:>20}: {r['error']}")
            continue
        print(f"{r['weight']:>22} {r['product']:>20} {r['M']}x{r['N']}x{r['K']:>6} {r['ms']:8.3f} {r['tflops']:8.1f}"
              f" {r['ms_per_step']:8.2f}" + (f" {r['memsets']:8.1f}" if args.graph else ""))
    in_step = [r for r in gemms if "(" not in r["weight"] + r["product"] and "error" not in r]
    print(f"the step's GEMMs: {sum(r['ms_per_step'] for r in in_step):.1f} ms per step")
    heads = [] if args.no_head else head_rows(spec, args.tokens, args.pad, args.reps)
    for r in heads:
        print(f"{r['variant']:>40} {r['ms']:8.3f} ms  loss diff {r['loss_diff']:.1e}  grad diff "
              f"{r['grad_max_rel_diff']:.1e}  peak {r['peak_gib']:.1f} GiB")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_probe.json").write_text(json.dumps(
        {"model": args.model, "tokens": args.tokens, "graph": args.graph, "device": torch.cuda.get_device_name(),
         "torch": torch.__version__, "gemms": gemms, "head_and_loss": heads,
         "provenance": provenance(torch.cuda.get_device_name())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
