"""Quick GPU probe of FlashAttention2Triton: bf16 correctness against fp64, and the leaderboard timings
next to cuDNN / flash SDPA in the same process. Development aid; the benchmark of record is
``python -m torch_impl.bench.attention``.

    PYTHONPATH=. python3 scripts/flash_probe.py [--all-checks] [--no-bench]
"""

import math

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from torch_impl.attention.flash_triton import FlashAttention2Triton


def reference(q, k, v, causal):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(), -math.inf)
    return torch.softmax(s, -1) @ v.double()


def check(shape_q, n_k, causal, dtype):
    q = torch.randn(*shape_q, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(*shape_q[:-2], n_k, shape_q[-1], device="cuda", dtype=dtype, requires_grad=True) for _ in "kv")
    o = FlashAttention2Triton.apply(q, k, v, causal)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = reference(q64, k64, v64, causal)
    g64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    print(f"check {shape_q} n_k={n_k} causal={causal} {dtype}: O {rel(o, o64):.2e} "
          + " ".join(f"d{n} {rel(g, r):.2e}" for n, g, r in zip("qkv", grads, g64)))


def bench(d, dtype=torch.bfloat16, n=16384, heads=16):
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in "qkv")
    do = torch.randn_like(q)
    fns = {
        "triton": lambda: FlashAttention2Triton.apply(q, k, v, True),
        "cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v),
        "flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v),
    }
    flops = 4 * heads * n * n * d / 2
    for name, fn in fns.items():
        fwd = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        def step():
            out = fn()
            out.backward(do)
        both = triton.testing.do_bench(step, warmup=50, rep=200, grad_to_none=[q, k, v], return_mode="median")
        print(f"d={d} {name:7s} fwd {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s)  fwd+bwd {both:.3f} ms "
              f"({3.5 * flops / both / 1e9:.0f} TFLOP/s)")


def _sdpa(backend, q, k, v):
    with sdpa_kernel(backend):
        return sdpa(q, k, v, is_causal=True)


if __name__ == "__main__":
    import sys

    torch.manual_seed(0)
    checks = [((1, 3, 1000, 128), 777, True, torch.bfloat16), ((2, 2, 513, 64), 1100, False, torch.float16)]
    if "--all-checks" in sys.argv:
        checks += [((2, 4, 1024, 64), 1024, True, torch.bfloat16), ((1, 2, 300, 32), 300, True, torch.float32),
                   ((1, 2, 256, 16), 256, False, torch.bfloat16)]
    for args in checks:
        check(*args)
    if "--no-bench" not in sys.argv:
        for d in (64, 128):
            bench(d)
