"""The Gluon kernels shadowed by the Triton ones inside a real training step (GPU):
``python3 scripts/flash_shadow.py OUT [e2e flags]``.

Every call of flash_triton's forward and backward that takes the Gluon kernels (``flash_gluon.preferred``,
``backward_preferred``) is run again on the same inputs with them off (``FLASH_GLUON=0``: the Triton kernels),
and the two results compared: the largest element error of O, dQ, dK and dV relative to the Triton result's
largest element, and of L in absolute terms. The e2e benchmark drives the step with the flags given (default xl
4 x 2,048, bf16_mixed, compiled per block, no CUDA graphs: the comparison synchronizes). Writes OUT/shadow.json
(every call's errors, in order) and prints the calls whose error passes ``--flag`` (default 0.05,
far above bf16 rounding: a wrong result, not a different order of sums). Not a record: it finds where a training
run and the kernels' tests disagree (notes/flash_attention.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from torch_impl.attention import flash_triton

DEFAULT_E2E = ("--model xl --batch-size 4 --seq-len 2048 --dtype bf16_mixed --attention flash_triton --compile "
               "--warmup 3 --steps 14").split()


def _triton(fn, *args, **kwargs):
    """fn with the Gluon kernels off (flash_triton reads FLASH_GLUON at each call)."""
    before = os.environ.get("FLASH_GLUON")
    os.environ["FLASH_GLUON"] = "0"
    try:
        return fn(*args, **kwargs)
    finally:
        if before is None:
            del os.environ["FLASH_GLUON"]
        else:
            os.environ["FLASH_GLUON"] = before


def _error(got: torch.Tensor, want: torch.Tensor, relative: bool = True) -> float:
    diff = (got.float() - want.float()).abs().max()
    return float(diff / want.float().abs().max().clamp_min(1e-30) if relative else diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--flag", type=float, default=0.05, help="the error that marks a call (default 0.05)")
    args, e2e_args = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    calls: list[dict] = []
    forward, backward = flash_triton.flash_forward, flash_triton.flash_backward
    backward_packed = flash_triton.flash_backward_packed  # the model's route with flash_triton
    gluon = flash_triton._gluon()
    if gluon is None:
        print("flash_shadow: the Gluon kernels cannot run here (an sm_90 GPU and Triton's Gluon are needed)")
        return 2

    def shadow_forward(q, k, v, is_causal, tf32=False):
        o, lse = forward(q, k, v, is_causal, tf32)
        if gluon.preferred(*(flash_triton._as_heads(t) for t in (q, k, v)), is_causal):
            o_t, lse_t = _triton(forward, q, k, v, is_causal, tf32)
            calls.append({"call": len(calls), "pass": "forward", "shape": list(q.shape), "O": _error(o, o_t),
                          "L": _error(lse, lse_t, relative=False)})
        return o, lse

    def shadowed(run, split, do, q, k, v, is_causal, deterministic, *args):
        """run(do, q, k, v, *args), and where the Gluon backward took it, run again with the Triton kernels: the
        errors of dQ, dK, dV (``split``: the result's three gradients)."""
        grads = run(do, q, k, v, *args)
        if not deterministic and gluon.backward_preferred(*(flash_triton._as_heads(t) for t in (do, q, k, v)),
                                                          is_causal):
            want = _triton(run, do, q, k, v, *args)
            calls.append({"call": len(calls), "pass": "backward", "shape": list(q.shape),
                          **{name: _error(g, w) for name, g, w in zip(("dQ", "dK", "dV"), split(grads), split(want))}})
        return grads

    def shadow_backward(do, q, k, v, o, lse, is_causal, tf32=False, deterministic=False):
        return shadowed(backward, tuple, do, q, k, v, is_causal, deterministic, o, lse, is_causal, tf32, deterministic)

    def shadow_backward_packed(do, q, k, v, o, lse, cos, sin, is_causal, tf32=False, deterministic=False):
        return shadowed(backward_packed, lambda g: g.unflatten(-1, (3, -1)).unbind(2), do, q, k, v, is_causal,
                        deterministic, o, lse, cos, sin, is_causal, tf32, deterministic)

    flash_triton.flash_forward, flash_triton.flash_backward = shadow_forward, shadow_backward
    flash_triton.flash_backward_packed = shadow_backward_packed
    from torch_impl.bench.e2e import main as e2e

    code = e2e([*(e2e_args or DEFAULT_E2E), "--out", str(args.out / "e2e.jsonl")])
    (args.out / "shadow.json").write_text(json.dumps(calls, indent=1))
    worst = {key: max((c.get(key, 0.0) for c in calls), default=0.0) for key in ("O", "L", "dQ", "dK", "dV")}
    print(f"flash_shadow: {len(calls)} calls compared; largest errors {worst}")
    for c in calls:
        if max(c.get(key, 0.0) for key in ("O", "dQ", "dK", "dV")) > args.flag:
            print(f"flash_shadow: call {c['call']} ({c['pass']}, {c['shape']}): {c}")
    return code


if __name__ == "__main__":
    sys.exit(main())
