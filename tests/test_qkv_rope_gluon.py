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


def test_the_host_refuses_what_the_kernel_does_not_take_in_one_line():
    """Shapes, dtypes and devices outside ``check_inputs`` fail before any launch, with one line naming them."""
    x, w = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(128, 128, dtype=torch.bfloat16)
    cos = torch.zeros(128, 32)
    for bad in ((x[:, :96], w, w, w[:, :96], cos, cos),  # K = 96: 1.5 k-tiles
                (x, w, w, w[:64], cos, cos),  # the weights differ
                (x, w, w, w, cos.double(), cos.double()),  # fp64 tables
                (x, w, w, w, cos, cos)):  # on the CPU
        with pytest.raises(ValueError, match=r"^qkv_rope_gemm: .*got x \(") as error:
            qkv_rope_gluon.qkv_rope_gemm(*bad)
        assert "\n" not in str(error.value)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("tokens, d_model, d_head, seq, config",
                         [(1024, 1600, 64, 512, 0),  # xl's widths: each weight's last tile half past d
                          (512, 640, 80, 256, 1),  # the 2.7B's head dim: heads across the tiles' halves
                          (256, 320, 64, 128, 2)])  # 5 heads: one tile and a half a weight, few tiles a program
def test_gpu_qkv_rope_gemm_matches_float64(tokens, d_model, d_head, seq, config):
    """Each weight's product, q's and k's rotated by the model's RoPE tables (row r at position r mod T), against
    the same in float64 from the same bf16 inputs, element by element; v's as it is."""
    seed = random.randrange(2**31)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, d_model, generator=generator, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(d_model, d_model, generator=generator, device="cuda", dtype=torch.bfloat16) * d_model ** -0.5
               for _ in range(3)]
    rope = RotaryEmbedding(d_head, seq, 10000.0, device="cuda")
    cos, sin = rope.tables(seq)
    got = qkv_rope_gluon.qkv_rope_gemm(x, *weights, cos.contiguous(), sin.contiguous(),
                                       qkv_rope_gluon.CONFIGS[config])
    cos64, sin64 = (t.double().repeat(tokens // seq, 1)[:, None] for t in (cos, sin))  # (tokens, 1, d_head / 2)
    for part, (w, rotated) in enumerate(zip(weights, (True, True, False))):
        want = (x.double() @ w.double().T).unflatten(-1, (-1, d_head))
        want = rotate_pairs(want, cos64, sin64) if rotated else want
        have = got[:, part * d_model:(part + 1) * d_model].unflatten(-1, (-1, d_head)).double()
        bound = 2e-2 * want.abs() + 2e-2 * want.abs().mean()
        assert ((have - want).abs() <= bound).all(), (seed, part, (have - want).abs().max().item())
