"""The Gluon FlashAttention kernels (``torch_impl/attention/flash_gluon.py``) on a machine without a GPU.

Their numerics are checked on the GPU (``tests/test_flash_attention.py``, ``test_gpu_gluon_in_the_op``, and
``scripts/flash_gluon_probe.py`` against float64); here: the 2-D views their TMA descriptors read (every element of
q, k, v where the kernels' row and column arithmetic says it is), the launches' arguments in the order the kernels
take them (the forward's cached launch passes them positionally), their compilation for sm_90 with ptxas's
report (no serialized wgmma, no spills in the MMA loops), and what flash_triton's backward hands the Gluon backward.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_impl.attention import flash_gluon

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    """The module of scripts/NAME.py, imported as a top-level module (scripts/ is not a package)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _view_of(t: torch.Tensor):
    """t's 2-D TMA view as flash_gluon describes it (tiles as wide as its head dim), and the (rows_b, rows_h, cols_h)
    map of (b, h, i)."""
    shape, strides, where = flash_gluon._rows_and_columns(t, t.shape[-1])
    return torch.as_strided(t, shape, strides, t.storage_offset()), where


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("batch,heads", [(2, 3), (1, 4), (3, 1), (1, 1)])
def test_tma_view_addresses_every_element(layout, batch, heads):
    n, d = 8, 16
    if layout == "bnhd":  # the model's heads: a (B, H, n, d) view of (B, n, H, d)
        t = torch.arange(batch * n * heads * d, dtype=torch.float32).reshape(batch, n, heads, d).transpose(1, 2)
    else:
        t = torch.arange(batch * heads * n * d, dtype=torch.float32).reshape(batch, heads, n, d)
    view, (rows_b, rows_h, cols_h) = _view_of(t)
    b, h, i = torch.meshgrid(torch.arange(batch), torch.arange(heads), torch.arange(n), indexing="ij")
    rows = (b * rows_b + h * rows_h + i).reshape(-1)
    cols = (h * cols_h).reshape(-1)[:, None] + torch.arange(d)
    assert torch.equal(view[rows[:, None], cols], t.reshape(-1, d))


def test_tma_view_refuses_strides_it_cannot_read():
    t = torch.zeros(2, 4, 8, 32)
    assert flash_gluon._rows_and_columns(t[..., ::2], 16) is None  # the head dim not contiguous
    assert flash_gluon._rows_and_columns(t.transpose(0, 2), 32) is None  # sequence before heads before batch
    assert flash_gluon._rows_and_columns(torch.zeros(2, 4, 8, 17)[..., :16], 16) is None  # rows not 16-byte aligned


def test_host_next_power_of_two_is_tritons():
    import triton

    from torch_impl.attention import flash_triton

    assert all(flash_triton.next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 5000))


def test_tile_dim_is_the_next_tile_width_for_multiples_of_eight():
    assert {d: flash_gluon.tile_dim(d) for d in range(8, 257, 8) if flash_gluon.tile_dim(d)} == {
        **dict.fromkeys(range(40, 65, 8), 64), **dict.fromkeys(range(72, 129, 8), 128),
        **dict.fromkeys(range(136, 257, 8), 256)}
    assert flash_gluon.tile_dim(84) is None and flash_gluon.tile_dim(127) is None and flash_gluon.tile_dim(264) is None


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("heads", [1, 3])
def test_padded_view_ends_each_row_at_the_head_dim(layout, heads, monkeypatch):
    """Below the tile's width a row of the 2-D view must end at d, so that TMA fills the tile's other columns with
    zeros: each head's rows one after another, or the heads side by side only where there is one head (the next
    head's columns would be read; with SIDE_BY_SIDE_3D, the default, a 3-D view takes them: the test below)."""
    monkeypatch.setattr(flash_gluon, "SIDE_BY_SIDE_3D", False)
    n, d = 8, 80
    base = torch.arange(2 * heads * n * d, dtype=torch.bfloat16)
    t = base.reshape(2, n, heads, d).transpose(1, 2) if layout == "bnhd" else base.reshape(2, heads, n, d)
    found = flash_gluon._rows_and_columns(t, flash_gluon.tile_dim(d))
    if layout == "bnhd" and heads > 1:
        assert found is None and flash_gluon._rows_and_columns(t, d) is not None  # tiles of d columns read it
        return
    (rows, cols), strides, (rows_b, rows_h, cols_h) = found
    assert rows == 2 * heads * n and cols == d and strides == [d, 1] and (heads == 1 or cols_h == 0)


def test_not_chosen_without_an_sm90_gpu():
    q = torch.zeros(1, 2, 8192, 64, dtype=torch.bfloat16)
    assert not flash_gluon.supports(q, q, q, True) and not flash_gluon.preferred(q, q, q, True)


@pytest.mark.parametrize("programs", [None, 132, 10_000])
def test_launch_arguments_match_the_kernel_signature(programs):
    """The arguments in the kernel's order and the grid three numbers (the compiled kernel's launcher reads a 3-D
    grid: ``_run``)."""
    q = torch.zeros(2, 4, 1024, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 1024, 64, dtype=torch.bfloat16)
    grid, args, options, (o, lse) = flash_gluon.launch_arguments(q, k, k, True, programs=programs)
    names = flash_gluon._fwd_kernel.arg_names
    constexprs = [name for name in options if name != "enable_fp_fusion"]  # a launch option, not a parameter
    assert len(args) + len(constexprs) == len(names) and constexprs == names[len(args):]
    assert options["enable_fp_fusion"] is False  # each rounding as written: L exact for one-hot rows
    block_m = flash_gluon.CONFIGS[64][0][0]
    items = 1024 // (flash_gluon.TILES.value * block_m) * 2 * 4
    assert grid == (items if programs is None else min(items, programs), 1, 1)
    assert o.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == torch.float32


def test_kernel_compiles_for_sm90_without_serialized_wgmma():
    """ptxas's verdict on the default configurations (scripts/gluon_compile.py --check --first): a wgmma left in
    flight across a loop's back edge made ptxas serialize all of them (warning C7514): the forward took 1.20-1.23x
    as long on the H100."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gluon_compile.py"), "--check", "--first"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    report = "\n".join(line for line in (run.stdout + run.stderr).splitlines() if "leaked" not in line)
    assert run.returncode == 0, report[-3000:]
    assert "d64_" in run.stdout and "d128_" in run.stdout, report[-3000:]


def _sass(*lines: str) -> str:
    """cuobjdump-style SASS, one instruction a line at addresses 0x0000, 0x0010, ..."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;" for i, line in enumerate(lines))


def test_spills_counted_only_inside_the_mma_loops():
    spills_in_mma_loops = _script("gluon_compile").spills_in_mma_loops
    code = _sass("STL [R1], R0",  # spilled once at the start: not counted
                 "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ",  # outer loop (0x10-0x70) around the inner one
                 "LDL R2, [R1]",  # a reload in the inner loop (0x20-0x50)
                 "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24",
                 "STL [R1+0x4], R3",  # a store in the inner loop
                 "@P0 BRA 0x20",
                 "LDL R4, [R1+0x4]",  # in the outer loop only: once per head
                 "@P1 BRA 0x10",
                 "EXIT",
                 "@!P0 BRA 0x90",  # the retry of an mbarrier wait, out of line ...
                 "BRA 0x20")  # ... jumping back across the EXIT: not a loop
    assert spills_in_mma_loops(code) == (1, 1, 4)
    no_mma = code.replace("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "NOP")
    assert spills_in_mma_loops(no_mma) == (1, 2, 7)  # the inner loop without wgmma: the outer one is the MMA loop


def test_pingpong_needs_consumers_with_the_same_key_tiles():
    """Taking turns deadlocks if one consumer runs a round more than the other: causal with BLOCK_N = BLOCK_M."""
    q = torch.zeros(1, 2, 1024, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pingpong"):
        flash_gluon.launch_arguments(q, q, q, True, (64, 64, 3, 240), pingpong=True)
    flash_gluon.launch_arguments(q, q, q, False, (64, 64, 3, 240), pingpong=True)  # full attention: the same tiles
    flash_gluon.launch_arguments(q, q, q, True, (64, 128, 3, 240), pingpong=True)


def test_runs_with_is_what_launch_arguments_accepts():
    """The scripts skip the option sets ``runs_with`` refuses: exactly those ``launch_arguments`` raises for."""
    for d in (64, 80, 256):
        q = torch.zeros(1, 2, 1024, d, dtype=torch.bfloat16)
        for config in flash_gluon.CONFIGS[flash_gluon.tile_dim(d)]:
            for options in flash_gluon.OPTIONS.values():
                for is_causal in (False, True):
                    try:
                        flash_gluon.launch_arguments(q, q, q, is_causal, config, **options)
                        accepted = True
                    except ValueError:
                        accepted = False
                    assert flash_gluon.runs_with(options, config, d, is_causal) == accepted, (d, config, options)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_launch_arguments_match_the_kernel_signature(d):
    """Both backward kernels: a program per 128 keys (two consumers' 64) below tile width 256, per 64 keys (shared by
    the consumers, ``_bwd_wide_kernel``) at it, the unseen tiles skipped at width 64 only, dK rotated where RoPE's
    tables (n_k, d / 2) are given below 256; what is not a tile width, or tables of another shape, is a usage
    error."""
    q = torch.zeros(2, 4, 1024, d, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 1024, d, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 1024)
    kernel, grid, args, options, (dq, dk, dv) = flash_gluon.backward_launch_arguments(q, q, k, k, q, lse, True)
    assert kernel is (flash_gluon._bwd_wide_kernel if d == 256 else flash_gluon._bwd_kernel)
    names = kernel.arg_names
    constexprs = [name for name in options if name != "enable_fp_fusion"]  # a launch option, not a parameter
    assert len(args) + len(constexprs) == len(names) and constexprs == names[len(args):]
    assert grid == (1024 // (64 if d == 256 else flash_gluon.TILES.value * flash_gluon.BWD_CONFIG[1]), 2 * 2, 1)
    assert dq.dtype == torch.float32 and dq.shape == q.shape and dk.shape == dv.shape == k.shape
    tables = (torch.zeros(1024, d // 2), torch.zeros(1024, d // 2))
    if d != 256:
        assert options["SKIP_UNSEEN"] == (d == 64) and not options["ROPE"]
        _, _, args, options, _ = flash_gluon.backward_launch_arguments(q, q, k, k, q, lse, True, rope=tables)
        assert options["ROPE"] and dict(zip(kernel.arg_names, args))["rope_cols"] == d // 2
    rope, error = ((tables, "rotates dK by RoPE's tables below tile width 256") if d == 256 else
                   ((tables[0][:512], tables[1][:512]), r"cos and sin must be \(T, d_head / 2\)"))
    with pytest.raises(ValueError, match=error):
        flash_gluon.backward_launch_arguments(q, q, k, k, q, lse, True, rope=rope)
    for d in (32, 264):
        with pytest.raises(ValueError, match="Gluon backward takes d a multiple of 8 from 40 to 256"):
            flash_gluon.backward_launch_arguments(*(torch.zeros(1, 2, 1024, d, dtype=torch.bfloat16),) * 5,
                                                  torch.zeros(1, 2, 1024), True)


@pytest.mark.parametrize("batch", [1, 2])
def test_side_by_side_heads_below_the_tile_are_a_3d_view_of_one_head_a_block(batch, monkeypatch):
    """With SIDE_BY_SIDE_3D, the model's (B, n, H, d) heads below the tile's width are the 3-D view (B n, H, d):
    element (b, h, i, :) at (b rows_b + i, h cols_h, :), and a descriptor's block is one head's rows, [rows, 1,
    width] (TMA's zero fill past d, as in a 2-D view that ends at d)."""
    monkeypatch.setattr(flash_gluon, "SIDE_BY_SIDE_3D", True)
    n, heads, d = 8, 3, 80
    t = torch.arange(batch * n * heads * d, dtype=torch.bfloat16).reshape(batch, n, heads, d).transpose(1, 2)
    shape, strides, (rows_b, rows_h, cols_h) = flash_gluon._rows_and_columns(t, flash_gluon.tile_dim(d))
    view = torch.as_strided(t, shape, strides, t.storage_offset())
    b, h, i = torch.meshgrid(torch.arange(batch), torch.arange(heads), torch.arange(n), indexing="ij")
    rows, cols = (b * rows_b + h * rows_h + i).reshape(-1), (h * cols_h).reshape(-1)
    assert shape[-1] == d and torch.equal(view[rows, cols], t.reshape(-1, d))
    descriptor, _ = flash_gluon._descriptor(t, 64)
    assert descriptor.block_shape == [64, 1, 128] and descriptor.layout.rank == 3
    at_width = torch.zeros(batch, n, heads, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert flash_gluon._rows_and_columns(at_width, 128)[:2] == ([batch * n, 3 * 128], [3 * 128, 1])  # 2-D there


@pytest.mark.parametrize("d", [48, 64, 80, 128, 192, 256])
def test_padded_head_dims_launch_tiles_of_their_tile_width(d):
    """A head dim below its tile runs the tile's kernel: every descriptor's block as wide as the tile (dQ's half of
    it where both consumers split its columns, a quarter at 256, where dK and dV are a consumer's half too), its view
    d columns wide (TMA's zero fill past them), and the exact multiply-add of the scale only where 1 / sqrt(d) is a
    power of two (d 64 and 256), not where the tile's would be."""
    width = flash_gluon.tile_dim(d)
    q = torch.zeros(2, 4, 1024, d, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 1024, d, dtype=torch.bfloat16)
    kernel, _, args, options, _ = flash_gluon.backward_launch_arguments(q, q, k, k, q, torch.zeros(2, 4, 1024), True)
    descriptors = dict(zip(kernel.arg_names, args))
    parts = {"dq_desc": 4 if width == 256 else 2 if flash_gluon._dq_split.fn(width) else 1,
             **dict.fromkeys(("dk_desc", "dv_desc"), 2 if width == 256 else 1)}
    for name in ("q_desc", "do_desc", "k_desc", "v_desc", "dk_desc", "dv_desc", "dq_desc"):
        assert descriptors[name].block_shape[1] == width // parts.get(name, 1), name
        assert descriptors[name].shape[-1] == d, name
    assert options["EXACT_SCALE"] == (d in (64, 256))
    _, args, _, _ = flash_gluon.launch_arguments(q, k, k, True)
    for name, desc in zip(flash_gluon._fwd_kernel.arg_names, args[:4]):
        assert desc.block_shape[1] == width and desc.shape[-1] == d, name


class _Kernel:
    """A Gluon kernel as ``_run`` calls it: ``kernel[grid](*args, **constexprs)`` compiles (recorded) and returns the
    compiled kernel, whose ``[grid](*args)`` launches (recorded)."""

    def __init__(self, kernel):
        self.fn, self.arg_names = kernel.fn, kernel.arg_names
        self.compiles, self.launches = [], []

    def __getitem__(self, grid):
        def compile_and_launch(*args, **constexprs):
            self.compiles.append((grid, args, constexprs))
            return _Compiled(self)

        return compile_and_launch


class _Compiled:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args: self.kernel.launches.append((grid, args))


def test_cached_launch_compiles_once_per_specialization_and_passes_parameters_in_order(monkeypatch):
    """``_run``: the first launch of a specialization goes through the JIT (keywords, the compile option included),
    the next ones call the compiled kernel with the kernel's parameters in its order; another shape compiles again."""
    monkeypatch.setattr(flash_gluon, "_COMPILED", {})
    kernel = _Kernel(flash_gluon._bwd_kernel)

    def launch(n):
        q = torch.zeros(2, 4, n, 64, dtype=torch.bfloat16)
        k = torch.zeros(2, 2, n, 64, dtype=torch.bfloat16)
        _, grid, args, options, _ = flash_gluon.backward_launch_arguments(q, q, k, k, q, torch.zeros(2, 4, n), True)
        flash_gluon._run(kernel, grid, args, options)
        return grid, args, options

    grid, args, options = launch(1024)
    assert len(kernel.compiles) == 1 and kernel.compiles[0][2] == options and options["enable_fp_fusion"] is False
    launch(1024)
    params = tuple(options[name] for name in flash_gluon._bwd_kernel.arg_names[len(args):])
    assert len(kernel.compiles) == 1 and len(kernel.launches) == 1
    (launch_grid, launched), = kernel.launches
    assert launch_grid == grid and len(launched) == len(args) + len(params) and launched[len(args):] == params
    assert "enable_fp_fusion" in options and "enable_fp_fusion" not in flash_gluon._bwd_kernel.arg_names
    launch(2048)
    assert len(kernel.compiles) == 2 and len(kernel.launches) == 1


def test_descriptor_copies_are_validated_descriptors_and_keep_no_tensor(monkeypatch):
    """``_tensor_descriptor``: the same fields as a TensorDescriptor made (and checked) afresh, the given base; the
    template it copies holds no tensor (it would keep the tensor's memory alive)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    monkeypatch.setattr(flash_gluon, "_DESCRIPTOR_FIELDS", {})
    for n in (1024, 1024, 2048):
        t = torch.zeros(2, 4, n, 64, dtype=torch.bfloat16)
        descriptor, where = flash_gluon._descriptor(t, 64)
        shape, strides, _ = flash_gluon._rows_and_columns(t, 64)
        fresh = TensorDescriptor(t, shape, strides, [64, 64], flash_gluon._smem_layout((64, 64), t.dtype))
        assert descriptor.base is t and vars(descriptor).keys() == vars(fresh).keys()
        assert all(getattr(descriptor, f) == getattr(fresh, f) for f in vars(fresh) if f != "base")
    assert len(flash_gluon._DESCRIPTOR_FIELDS) == 2 and not any(
        isinstance(v, torch.Tensor) for fields in flash_gluon._DESCRIPTOR_FIELDS.values() for v in fields.values())


def test_exact_scale_is_the_power_of_two_head_dims():
    """The backward's one multiply-add for fl(S^T scale) - L only where 1 / sqrt(d) is a power of two."""
    assert [d for d in range(8, 264, 8) if flash_gluon._exact_scale.fn(d)] == [16, 64, 256]


class _GluonBackwardStandIn:
    """flash_gluon as flash_triton's backward calls it, with the kernel replaced by float64 autograd: it checks the D
    and the zeroed fp32 dQ accumulator it is given, adds dS K (dQ times sqrt(d)) into the accumulator and writes dK,
    dV into the outputs it is handed (``dkdv``, in k's layout: the model's heads as views); ``rotates``: what its
    ``rotates_dk`` says (given RoPE's tables, it rotates dK back as it writes it)."""

    def __init__(self, rotates: bool = False):
        self.calls, self.rotates, self.rotated = 0, rotates, 0

    def preferred(self, q, k, v, is_causal):  # the forward: the Triton one
        return False

    def backward_preferred(self, do, q, k, v, is_causal):
        return True

    def backward_schedule(self, q, k, is_causal):
        return {"persistent": True}

    def rotates_dk(self, d):
        return self.rotates

    def backward(self, do, q, k, v, o, lse, is_causal, delta=None, dq_acc=None, dkdv=None, persistent=False,
                 rope=None):
        self.calls += 1
        assert rope is None or self.rotates  # only where it said it rotates dK
        assert torch.allclose(delta, (do.double() * o.double()).sum(-1).float(), atol=1e-5)
        assert dq_acc.dtype == torch.float32 and dq_acc.is_contiguous() and not dq_acc.any()
        assert all(t.shape == k.shape and t.stride() == dkdv[0].stride() for t in dkdv)  # (the product's: packed)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=is_causal)
        dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double())
        dq_acc += dq.float() * math.sqrt(q.shape[-1])  # dS K: the caller scales it
        if rope is not None:  # dK rotated back by minus RoPE's angles, as the kernel's epilogue does
            self.rotated += 1
            cos, sin = (t.double() for t in rope)
            even, odd = dk[..., 0::2], dk[..., 1::2]
            dk = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1).flatten(-2)
        dkdv[0].copy_(dk)
        dkdv[1].copy_(dv)
        return None, *dkdv


def test_flash_triton_backward_hands_the_gluon_kernel_its_inputs_and_outputs(monkeypatch):
    """Where ``backward_preferred`` holds, flash_triton's backward runs the preprocess pass (D, dQ zeroed), the Gluon
    backward into them and into the op's dK, dV, and copies dQ out: (B, n, H, d) inputs, as the model passes them."""
    from torch_impl.attention import flash_triton

    stand_in = _GluonBackwardStandIn()
    monkeypatch.setattr(flash_triton, "_gluon", lambda: stand_in)
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 64, 4, 16, generator=gen).transpose(1, 2) for _ in range(4))
    o, lse = flash_triton.flash_forward(q, k, v, True)
    dq, dk, dv = flash_triton.flash_backward(do, q, k, v, o, lse, True)
    assert stand_in.calls == 1
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True),
                               (q64, k64, v64), do.double())
    for got, ref in zip((dq, dk, dv), want):
        assert torch.allclose(got.double(), ref, atol=1e-4, rtol=1e-4)
    flash_triton.flash_backward(do, q, k, v, o, lse, True, deterministic=True)  # the two-pass backward: not Gluon
    assert stand_in.calls == 1


@pytest.mark.parametrize("rotates", [True, False], ids=["epilogue", "pass"])
def test_packed_backward_rotates_dk_once_in_the_kernel_or_a_pass(rotates, monkeypatch):
    """On the model's q, k, v product (``flash_backward_packed``) dK is rotated back once: by the Gluon kernel where
    its ``rotates_dk`` holds (then only dQ's pass runs), else by a pass of its own; the product's gradient matches
    float64 either way."""
    from torch_impl.attention import flash_triton
    from tests.test_flash_packed_rope import _inputs, _reference

    stand_in = _GluonBackwardStandIn(rotates)
    monkeypatch.setattr(flash_triton, "_gluon", lambda: stand_in)
    passes = []
    rotate_back = flash_triton.launch_rotate_back
    monkeypatch.setattr(flash_triton, "launch_rotate_back", lambda *a, **kw: passes.append(1) or rotate_back(*a, **kw))
    product, cos, sin, d_out = _inputs(2, 64, 3, 16, torch.float32, "cpu")
    _, want = _reference(product, cos, sin, 3, d_out)
    out, lse, q, k, v = flash_triton.flash_attention_rope_forward(product, cos, sin, 3, True, False)
    grad = flash_triton._backward_of_product(d_out, q, k, v, out, lse, cos, sin, True, False, False)
    assert stand_in.calls == 1 and stand_in.rotated == rotates and len(passes) == 2 - rotates
    assert torch.allclose(grad.double(), want, atol=1e-4, rtol=1e-4)


def _dealt_shares(costs: list[int], programs: int) -> list[int]:
    """Each program's work when it takes item k * P + p in even rounds k, k * P + P - 1 - p in odd ones (the kernel's
    ``_position``), written out item by item."""
    totals = [0] * programs
    for p in range(programs):
        for k in range(-(-len(costs) // programs)):
            item = k * programs + (p if k % 2 == 0 else programs - 1 - p)
            totals[p] += costs[item] if item < len(costs) else 0
    return totals


@pytest.mark.parametrize("n_bh,n_m,is_causal,programs", [(128, 16, True, 132), (16, 128, True, 132),
                                                          (3, 5, True, 4), (7, 3, False, 5), (2, 2, False, 132)])
def test_persistent_share_is_the_dealt_maximum(n_bh, n_m, is_causal, programs):
    """``_share`` against the dealing written out: causal items of 128 queries over key tiles of 128 cost their tiles
    (the head's j-th heaviest: n_m - j) plus one."""
    costs = [(n_m - j if is_causal else 8) + 1 for j in range(n_m)] * n_bh
    totals = _dealt_shares(costs, min(programs, len(costs)))
    want = max(totals) * len(totals) / sum(costs)
    assert flash_gluon._share(n_bh, n_m, 8, is_causal, 128, 128, programs) == pytest.approx(want)


def test_op_schedule_deals_the_items_where_shares_are_even(monkeypatch):
    """Short sequences over many heads: the persistent grid's items dealt head by head; 1 x 16 x 16,384 (dealt
    shares up to ~1.5x the mean on 132 SMs) and xl's 4 x 25 x 2,048 (1.14x): handed out by a counter, the fewest heads
    at a time whose modelled end is within 1% of the soonest (head by head at 16,384, 4 at xl's)."""
    monkeypatch.setattr(flash_gluon, "_programs", lambda device: 132)
    short = torch.empty(4, 32, 2048, 64, dtype=torch.bfloat16)
    long = torch.empty(1, 16, 16384, 64, dtype=torch.bfloat16)
    xl = torch.empty(4, 25, 2048, 64, dtype=torch.bfloat16)
    options = {"persistent": True, "tma_store": True, "folded": 64 in flash_gluon.FOLDED_HEAD_DIMS}
    assert flash_gluon.schedule(short, short, True) == {**options, "order": "heads"}
    assert flash_gluon.schedule(long, long, True) == {**options, "order": "dynamic", "head_group": 1}
    assert flash_gluon.schedule(xl, xl, True) == {**options, "order": "dynamic", "head_group": 4}
    _, args, options, _ = flash_gluon.launch_arguments(xl, xl, xl, True, programs=132, order="dynamic", head_group=4)
    assert dict(zip(flash_gluon._fwd_kernel.arg_names, args))["head_group"] == 4 and not options["BLOCK_MAJOR"]
    grid, args, options, _ = flash_gluon.launch_arguments(long, long, long, True, programs=132, order="dynamic")
    assert grid == (132, 1, 1) and options["DYNAMIC"] and not options["BLOCK_MAJOR"]
    counter = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int32)
    assert counter.shape == (1,) and counter.item() == 0  # a fresh zero each launch
    flash_gluon.launch_arguments(short, short, short, True, programs=132, order="heads")
    for bad in ({"order": "diagonal"}, {"order": "blocks", "head_group": 2}, {"head_group": 0}):
        with pytest.raises(ValueError, match="order must be one of .*head_group at least 1"):
            flash_gluon.launch_arguments(short, short, short, True, programs=132, **bad)
    wide = torch.empty(1, 8, 8192, 256, dtype=torch.bfloat16)
    assert flash_gluon.schedule(wide, wide, True) == {}  # d 256: a program per item, O stored from registers
    with pytest.raises(ValueError, match=r"tma_store takes tile widths \(64, 128\).*got d 256"):
        flash_gluon.launch_arguments(wide, wide, wide, True, tma_store=True)


def test_backward_schedule_and_its_persistent_grid(monkeypatch):
    """The backward's persistent grid (d 64 only) dealt where its programs' shares are even, else fed by a counter, a
    few heads at a time where that ends the last program sooner (xl's 100 heads: 4, the 2.7B preset's 64 at d 80:
    8, a program per item); its grid of one program per SM at most."""
    monkeypatch.setattr(flash_gluon, "_programs", lambda device: 132)
    short, long = torch.empty(4, 32, 2048, 64), torch.empty(1, 16, 16384, 64)
    xl, big = torch.empty(4, 25, 2048, 64), torch.empty(2, 32, 2048, 80)
    assert flash_gluon.backward_schedule(short, short, True) == {"persistent": True}
    dynamic = {"persistent": True, "order": "dynamic"}
    assert flash_gluon.backward_schedule(long, long, True) == {**dynamic, "head_group": 1}
    assert flash_gluon.backward_schedule(xl, xl, True) == {**dynamic, "head_group": 4}
    assert flash_gluon.backward_schedule(big, big, True) == {"head_group": 8}
    q = torch.zeros(2, 4, 1024, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 1024)
    _, grid, _, options, _ = flash_gluon.backward_launch_arguments(q, q, q, q, q, lse, True, programs=132)
    assert grid == (64, 1, 1) and options["PERSISTENT"]  # 8 key blocks x 8 heads: fewer items than programs
    big = torch.zeros(4, 32, 2048, 64, dtype=torch.bfloat16)
    _, grid, _, _, _ = flash_gluon.backward_launch_arguments(big, big, big, big, big, torch.zeros(4, 32, 2048), True,
                                                             programs=132)
    assert grid == (132, 1, 1)
    for d in (128, 256):  # dK, dV through the stages: a program per item (at 256 head by head)
        wide = torch.zeros(2, 4, 1024, d, dtype=torch.bfloat16)
        assert flash_gluon.backward_schedule(wide, wide, True) == ({} if d == 256 else {"head_group": 1})
        with pytest.raises(ValueError, match="persistent grid takes d 64 only"):
            flash_gluon.backward_launch_arguments(wide, wide, wide, wide, wide, lse, True, programs=132)


def _bwd_item(item: int, n_bkv: int, n_kb: int, head_group: int) -> tuple[int, int]:
    """The kernel's ``_bwd_item`` written out: item -> (batch x k/v head, key block)."""
    per_group = n_kb * head_group
    first = item // per_group * head_group
    heads = min(n_bkv - first, head_group)
    r = item % per_group
    return first + r % heads, r // heads


@pytest.mark.parametrize("n_bkv,n_kb,head_group,programs", [(100, 16, 4, 132), (64, 16, 8, 132), (12, 4, 8, 5),
                                                            (3, 7, 1, 4), (5, 3, 2, 132)])
def test_greedy_share_is_the_list_schedule_of_the_kernels_order(n_bkv, n_kb, head_group, programs):
    """Every (head, key block) once in ``_bwd_item``'s order, groups of ``head_group`` heads (the last one short),
    each group's heaviest block first; ``_greedy_share`` is the share of programs that each take the next item as
    soon as they are free, simulated here clock tick by clock tick."""
    order = [_bwd_item(item, n_bkv, n_kb, head_group) for item in range(n_bkv * n_kb)]
    assert sorted(order) == [(bh, block) for bh in range(n_bkv) for block in range(n_kb)]
    for item in range(1, len(order)):
        (bh0, block0), (bh1, block1) = order[item - 1], order[item]
        assert bh1 // head_group > bh0 // head_group or block1 >= block0  # within a group, block by block
    costs = [2 * (n_kb - block) + 1 for _, block in order]  # causal: 2 query tiles of 64 a block of 128 keys
    ends, pending, clock = [0] * min(programs, len(costs)), list(costs), 0
    while pending:
        for p in range(len(ends)):
            if ends[p] <= clock and pending:
                ends[p] = clock + pending.pop(0)
        clock += 1
    want = max(ends) * len(ends) / sum(costs)
    share = flash_gluon._greedy_share(n_bkv, n_kb, 2 * n_kb, True, 128, 64, programs, head_group)
    assert share == pytest.approx(want)


def test_backward_items_from_a_counter_a_few_heads_at_a_time():
    """``order="dynamic"``: a persistent grid fed by a fresh int32 zero counter; ``head_group`` goes to the kernel as
    it is; a grid of a program per item ignores the order; anything else is a usage error."""
    q = torch.zeros(4, 25, 2048, 64, dtype=torch.bfloat16)
    lse = torch.zeros(4, 25, 2048)
    kernel, grid, args, options, _ = flash_gluon.backward_launch_arguments(q, q, q, q, q, lse, True, programs=132,
                                                                          order="dynamic", head_group=8)
    named = dict(zip(kernel.arg_names, args))
    assert options["PERSISTENT"] and options["DYNAMIC"] and grid == (132, 1, 1)
    assert named["counter_ptr"].dtype == torch.int32 and named["counter_ptr"].tolist() == [0]
    assert named["head_group"] == 8 and named["n_bkv"] == 100
    _, grid, _, options, _ = flash_gluon.backward_launch_arguments(q, q, q, q, q, lse, True, order="dynamic")
    assert not options["DYNAMIC"] and grid == (16, 100, 1)
    for bad in ({"order": "blocks"}, {"head_group": 0}):
        with pytest.raises(ValueError, match="order must be one of .*head_group at least 1"):
            flash_gluon.backward_launch_arguments(q, q, q, q, q, lse, True, programs=132, **bad)


def test_op_ab_timeline_rows_are_each_kernels_median_time_and_gap():
    """scripts/flash_op_ab.py's timeline: per kernel of a step, the median over the steps after the first of its
    time (ms) and of the idle time before it (us: from the last kernel's end, the last step's for the first)."""
    kernel_rows = _script("flash_op_ab").kernel_rows
    steps, kernels, clock = 4, [], 0.0
    for step in range(steps):
        for name, length, gap in (("fwd", 1000.0, 5.0), ("bwd", 3000.0 + step, 2.0 + step)):
            clock += gap
            kernels.append((clock, clock + length, name))
            clock += length
    rows = kernel_rows(kernels, steps)
    assert [r["kernel"] for r in rows] == ["fwd", "bwd"]
    assert rows[0]["ms"] == 1.0 and rows[0]["gap_before_us"] == 5.0
    assert rows[1]["ms"] == pytest.approx(3.002) and rows[1]["gap_before_us"] == 4.0  # steps 1-3: 3, 4, 5
    assert kernel_rows(kernels[:-1], steps) == [{"error": "7 kernels in 4 steps"}]


@pytest.mark.parametrize("argv,most", [(["--head-dims", "32"], 256), (["--head-dims", "80,x"], 256),
                                       (["--shapes", "1x16x1024x260"], 256), (["--shapes", "1x16x1024x132"], 256),
                                       (["--backward", "--shapes", "1x16x1024x264"], 256)])
def test_probe_refuses_head_dims_without_a_tile_in_one_line(argv, most, tmp_path, capsys, monkeypatch):
    """scripts/flash_gluon_probe.py: a head dim the kernels have no tile for (up to 256, forward and backward) is a
    usage error naming what is accepted, before anything needs a GPU."""
    monkeypatch.delenv("FLASH_GLUON", raising=False)  # the probe's import sets it: unset again afterwards
    with pytest.raises(SystemExit) as exit_:
        _script("flash_gluon_probe").main([str(tmp_path), *argv])
    assert exit_.value.code == 2 and f"multiples of 8 from 40 to {most}" in capsys.readouterr().err
