"""Does a kernel option change the gradient more than another does? The bf16 step's gradients against an fp32
reference at the same weights (GPU): ``python3 scripts/grad_fidelity.py OUT [--variants ...] [trainer flags]``.

Trains with the trainer's flags (default: xl 4 x 2,048, bf16_mixed, flash_triton, PyTorch's MLP, each block's CUDA
graphs, 150 steps on the built-in corpus) and keeps its weights. Then, at the initial weights and at the trained
ones, for each variant (ATTENTION:MLP, default the four of flash_triton and sdpa_cudnn with the torch and gluon MLP)
builds the step as the trainer does (``torch_impl.train.build``) and computes the loss and the gradients on
``--batches`` fresh training batches, and the same in fp32 as the reference (products in full fp32, no TF32,
sdpa_efficient's attention, eager, one sequence at a time). Per parameter kind (``ffn.w1``, ``attn.q_proj``, ...)
and variant, over the batches: the relative error ||g - r|| / ||r||, the cosine of g and r, the scale of g along
r, <g, r> / <r, r> - 1 (a systematic shrink or growth, which rounding noise does not make), and the share of
elements whose sign differs from r's (what AdamW's normalized step sees); and the loss's difference from the
reference. Writes OUT/grad_fidelity.json (per tensor too) and prints the table. Not a record: it asks whether a
kernel option's loss curves can differ for a numerical reason (notes/train_step.md, session 50).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

from lm_data import prepare_data
from torch_impl.data import get_batch
from torch_impl.model import TransformerLM, cross_entropy
from torch_impl.step import autocast
from torch_impl.train import TrainConfig, build, build_parser, run_training

DEFAULT_TRAIN = ("--model xl --batch-size 4 --seq-len 2048 --dtype bf16_mixed --attention flash_triton --mlp torch "
                 "--compile --cuda-graph blocks --epochs 1 --steps-per-epoch 150 --val-batches 0 --lr 1e-4 "
                 "--device cuda --no-progress --cache-dir /tmp/data").split()
DEFAULT_VARIANTS = "flash_triton:torch,flash_triton:gluon,sdpa_cudnn:torch,sdpa_cudnn:gluon"
REFERENCE_ATTENTION = {"cuda": "sdpa_efficient", "cpu": "sdpa"}  # fp32, memory linear in the sequence on a GPU
SUMS = ("err2", "ref2", "dot", "got2", "sign_diff", "elements")


def kind(name: str) -> str:
    """A parameter's kind: its name without the block index and the ``.weight`` (``layers.3.ffn.w1.weight`` ->
    ``ffn.w1``)."""
    return re.sub(r"\.weight$", "", re.sub(r"^layers\.\d+\.", "", name))


def sums(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The sums ``summary`` reads, of one gradient against its reference (fp32)."""
    got = got.float()
    return {"err2": float((got - ref).square().sum()), "ref2": float(ref.square().sum()),
            "dot": float((got * ref).sum()), "got2": float(got.square().sum()),
            "sign_diff": float((torch.sign(got) != torch.sign(ref)).sum()), "elements": float(ref.numel())}


def summary(total: dict[str, float]) -> dict[str, float]:
    """Relative error, cosine, scale along the reference minus 1 and the share of signs that differ, from
    ``sums`` added over tensors and batches."""
    return {"rel_err": (total["err2"] / total["ref2"]) ** 0.5,
            "cosine": total["dot"] / (total["got2"] * total["ref2"]) ** 0.5,
            "scale": total["dot"] / total["ref2"] - 1.0, "sign_diff": total["sign_diff"] / total["elements"]}


def _load(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])


def reference_grads(weights: dict[str, torch.Tensor], spec, batches, device) -> tuple[list[float], list[dict]]:
    """The fp32 loss and gradients of each batch, one sequence at a time (the mean over a batch's equal-length
    sequences is the mean of theirs)."""
    torch.manual_seed(0)
    model = TransformerLM(spec, attention=REFERENCE_ATTENTION[device.type], device=device)
    _load(model, weights)
    losses, grads = [], []
    for inputs, targets in batches:
        total = 0.0
        for row in range(inputs.shape[0]):
            loss = cross_entropy(model(inputs[row:row + 1]), targets[row:row + 1]) / inputs.shape[0]
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append({n: p.grad.detach().cpu() for n, p in model.named_parameters()})  # 6 GB a batch at xl
        model.zero_grad(set_to_none=True)
    del model
    return losses, grads


def variant_sums(cfg: TrainConfig, spec, points: dict[str, dict], batches, device) -> dict[str, dict]:
    """For each weight point: each batch's loss and each tensor's ``sums`` against the point's reference."""
    parts = build(cfg, spec, device, world_size=1, total_steps=1)
    model = parts.wrapper.module
    out = {}
    for point, ref in points.items():
        _load(model, ref["weights"])
        losses, per_tensor = [], {}
        for (inputs, targets), ref_grads in zip(batches, ref["grads"]):
            with autocast(cfg.dtype, device):
                loss = cross_entropy(parts.forward(inputs), targets)
            loss.backward()
            losses.append(float(loss.detach()))
            for n, p in model.named_parameters():
                s = sums(p.grad, ref_grads[n].to(device))
                per_tensor[n] = {k: per_tensor.get(n, {}).get(k, 0.0) + v for k, v in s.items()}
            model.zero_grad(set_to_none=True)
        out[point] = {"losses": losses, "loss_minus_ref": [a - b for a, b in zip(losses, ref["losses"])],
                      "tensors": per_tensor}
    del parts, model
    return out


def kinds_of(per_tensor: dict[str, dict]) -> dict[str, dict]:
    """``summary`` per parameter kind and over every parameter ("all")."""
    groups: dict[str, dict] = {}
    for name, s in per_tensor.items():
        for key in (kind(name), "all"):
            groups[key] = {k: groups.get(key, {}).get(k, 0.0) + s[k] for k in SUMS}
    return {key: summary(total) for key, total in sorted(groups.items())}


def _free() -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"ATTENTION:MLP,... (default {DEFAULT_VARIANTS})")
    parser.add_argument("--batches", type=int, default=4, help="fresh training batches per point (default 4)")
    args, train_args = parser.parse_known_args(argv)
    cfg = TrainConfig(**vars(build_parser().parse_args(train_args or DEFAULT_TRAIN)))
    variants = [tuple(v.split(":")) for v in args.variants.split(",")]
    if any(len(v) != 2 for v in variants) or args.batches < 1 or cfg.loss != "plain":
        print("grad_fidelity: --variants as ATTENTION:MLP,..., --batches >= 1 and --loss plain (the logits' "
              "cross-entropy) are accepted", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    spec = cfg.spec()
    dtype = torch.bfloat16 if cfg.dtype == "bf16_mixed" else torch.float32  # the weights the step computes with

    torch.manual_seed(cfg.seed)  # as train.build draws them
    initial = {n: p.detach().cpu() for n, p in TransformerLM(spec, device=device).named_parameters()}
    training = run_training(cfg, keep_params=True)
    _free()
    data = prepare_data(cfg.data, cfg.cache_dir, builtin_bytes=int(cfg.builtin_mb * 2**20),
                        val_fraction=cfg.val_fraction)
    generator = np.random.default_rng(cfg.seed + 10_000)  # not a batch the training drew in the same order
    batches = [get_batch(data.train, cfg.batch_size, cfg.seq_len, device, generator) for _ in range(args.batches)]

    torch.set_float32_matmul_precision("highest")
    points = {}
    for point, weights in (("initial", initial), (f"trained_{len(training.train_losses)}", training.params)):
        weights = {n: w.to(dtype).float().to(device) for n, w in weights.items()}
        losses, grads = reference_grads(weights, spec, batches, device)
        points[point] = {"weights": weights, "losses": losses, "grads": grads}
        print(f"grad_fidelity: reference at {point}: losses {[round(v, 4) for v in losses]}", flush=True)
    torch.set_float32_matmul_precision("high")
    _free()

    results = {"train": vars(cfg), "batches": args.batches, "reference": {p: v["losses"] for p, v in points.items()},
               "variants": {}}
    for attention, mlp in variants:
        name = f"{attention}:{mlp}"
        by_point = variant_sums(dataclasses.replace(cfg, attention=attention, mlp=mlp), spec, points, batches, device)
        _free()
        results["variants"][name] = {p: {**v, "kinds": kinds_of(v["tensors"])} for p, v in by_point.items()}
        (args.out / "grad_fidelity.json").write_text(json.dumps(results, indent=1, default=str))
        for point, v in results["variants"][name].items():
            print(f"\n{name} at {point}: loss - reference {np.mean(v['loss_minus_ref']):+.5f} "
                  f"(per batch {[round(d, 5) for d in v['loss_minus_ref']]})")
            print(f"  {'kind':24} {'rel_err':>9} {'1 - cosine':>10} {'scale':>10} {'sign_diff':>9}")
            for key, s in v["kinds"].items():
                print(f"  {key:24} {s['rel_err']:9.2e} {1 - s['cosine']:10.2e} {s['scale']:+10.2e} "
                      f"{s['sign_diff']:9.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
