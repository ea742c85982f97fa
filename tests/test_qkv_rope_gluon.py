"""The q, k, v product with RoPE in its epilogue (``torch_impl.qkv_rope_gluon``): on sm_90, bf16 against float64 from
the same bf16 inputs, element by element; everywhere, its host's refusal of inputs it does not take."""

from __future__ import annotations

import random

import pytest
import torch

from torch_impl import qkv_rope_gluon
from torch_impl.model import RotaryEmbedding
from torch_impl.qkv_projection import rotate_pairs

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="the Gluon kernels need sm_90")


@pytest.mark.parametrize("change, problem", [
    (dict(x=(128, 128)), "must be (B, T, K)"),
    (dict(w_v=(192, 128)), "the weights must be (d, K) alike"),
    (dict(cos=(128, 32), sin=(128, 32)), "the tables T rows long"),
    (dict(x=(1, 64, 128)), "B T 64 must be a multiple of 128"),
    (dict(x=(2, 64, 96), w_q=(128, 96), w_k=(128, 96), w_v=(128, 96)), "K 96 must be a multiple of 64"),
    (dict(w_q=(96, 128), w_k=(96, 128), w_v=(96, 128)), "d 96 must be a multiple of 64"),
    (dict(cos=(64, 40), sin=(64, 40)), "d 128 must be a multiple of 80"),
    (dict(dtype=torch.float16), "must be bf16"),
    (dict(), "on one CUDA device"),
])
def test_the_host_names_what_the_kernel_does_not_take_in_one_line(change, problem):
    """Each input outside ``input_problem`` fails before any launch with one line naming it; every case is one
    violation of inputs that are otherwise right but for their device (the CPU: the last check, here)."""
    shapes = {"x": (2, 64, 128), "w_q": (128, 128), "w_k": (128, 128), "w_v": (128, 128), "cos": (64, 32),
              "sin": (64, 32)}
    shapes.update({k: v for k, v in change.items() if k != "dtype"})
    dtype = change.get("dtype", torch.bfloat16)
    inputs = [torch.zeros(shapes[name], dtype=dtype if name[0] in "xw" else torch.float32)
              for name in ("x", "w_q", "w_k", "w_v", "cos", "sin")]
    with pytest.raises(ValueError, match=r"^qkv_rope_gemm: ") as error:
        qkv_rope_gluon.qkv_rope_gemm(*inputs)
    assert problem in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("batch, seq, d_model, d_head, config",
                         [(2, 512, 1600, 64, 0),  # xl's widths: each weight's last tile half past d
                          (2, 256, 640, 80, 1),  # the 2.7B's head dim: heads across the tiles' halves
                          (2, 128, 320, 64, 2)])  # 5 heads: two tiles and a half a weight, few tiles a program
def test_gpu_qkv_rope_gemm_matches_float64(batch, seq, d_model, d_head, config):
    """Each weight's product, q's and k's rotated by the model's RoPE tables, against the same in float64 from the
    same bf16 inputs, element by element; v's as it is. (A last tile's right half stored past d would overwrite the
    next weight's first columns in a race with their own store: caught here only when it lands last.)"""
    seed = random.randrange(2**31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, seq, d_model, generator=generator, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(d_model, d_model, generator=generator, device="cuda", dtype=torch.bfloat16) * d_model ** -0.5
               for _ in range(3)]
    rope = RotaryEmbedding(d_head, seq, 10000.0, device="cuda")
    cos, sin = rope.tables(seq)
    got = qkv_rope_gluon.qkv_rope_gemm(x, *weights, cos.contiguous(), sin.contiguous(),
                                       qkv_rope_gluon.CONFIGS[config])
    cos64, sin64 = (t.double()[:, None] for t in (cos, sin))  # (T, 1, d_head / 2): broadcast over B and the heads
    for part, (w, rotated) in enumerate(zip(weights, (True, True, False))):
        want = (x.double() @ w.double().T).unflatten(-1, (-1, d_head))
        want = rotate_pairs(want, cos64, sin64) if rotated else want
        have = got[..., part * d_model:(part + 1) * d_model].unflatten(-1, (-1, d_head)).double()
        bound = 2e-2 * want.abs() + 2e-2 * want.abs().mean()
        assert ((have - want).abs() <= bound).all(), (seed, part, (have - want).abs().max().item())
