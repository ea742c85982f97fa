"""FlashAttention2Triton as PyTorch custom ops (issue 14, item 2): ``torch.library.opcheck`` of the forward and
backward ops, ``torch.compile(fullgraph=True)`` through them (the attention call alone, the autograd.Function and
the model), and the fp32 dot precision that follows PyTorch's TF32 setting (issue 17, item 5).

On the CPU the kernels run under the Triton interpreter (tiny shapes) and compile uses the ``aot_eager``
backend (Dynamo + AOTAutograd, which is what traces the ops' fake implementations and autograd formula; no C
compiler needed); ``@pytest.mark.gpu`` repeats the compile tests with Inductor on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_impl.attention.flash_triton as ft
from parallelism_calc.specs import MODELS
from torch_impl.attention import FlashAttention2Triton, get_attention
from torch_impl.model import TransformerLM

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORWARD = torch.ops.torch_impl.flash_attention_forward.default
BACKWARD = torch.ops.torch_impl.flash_attention_backward.default


def inputs(heads=4, kv_heads=2, n_q=9, n_k=13, d=16, device=DEVICE, dtype=torch.float32):
    """q (2, heads, n_q, d), k and v (2, kv_heads, n_k, d) requiring grad, and dO."""
    q = torch.randn(2, heads, n_q, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, n_k, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(2, heads, n_q, d, device=device, dtype=dtype)


def grads(fn, q, k, v, grad_out, is_causal):
    """O and (dQ, dK, dV) of fn on fresh leaves."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, is_causal)
    out.backward(grad_out)
    return out.detach(), (q.grad, k.grad, v.grad)


def assert_same(a, b, what: str, tol: float = 1e-6) -> None:
    """Compiled and eager run the same kernels: equal up to float noise."""
    for x, y in zip(a, b):
        assert x.shape == y.shape and torch.allclose(x, y, rtol=tol, atol=tol), f"{what}: {(x - y).abs().max():.2e}"


# ------------------------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "two-pass"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_opcheck_forward_and_backward(is_causal, deterministic):
    """Schema, fake implementations (shapes, strides, dtypes), autograd registration and AOT dispatch."""
    q, k, v, grad_out = inputs(n_q=5, n_k=7)
    torch.library.opcheck(FORWARD, (q, k, v, is_causal, False))
    o, lse = FORWARD(q.detach(), k.detach(), v.detach(), is_causal, False)
    torch.library.opcheck(BACKWARD, (grad_out, q.detach(), k.detach(), v.detach(), o, lse, is_causal, False,
                                     deterministic))


@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "two-pass"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_outputs_keep_the_model_layout(is_causal, deterministic, seed):
    """q, k, v and dO as the model makes them, (B, H, n, d) views of (B, n, H, d): O, dK and dV come out in that
    layout (O's heads then merge for the output projection without a copy, and dV's for its product), dQ contiguous
    (as its fp32 accumulator), real and fake alike (opcheck), with the values of contiguous inputs."""
    q, k, v, grad_out = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in inputs(n_q=5, n_k=7))
    o, lse = FORWARD(q, k, v, is_causal, False)
    grads_ = BACKWARD(grad_out, q, k, v, o, lse, is_causal, False, deterministic)
    for name, t in zip(("O", "dK", "dV"), (o, *grads_[1:])):
        assert t.transpose(1, 2).is_contiguous() and not t.is_contiguous(), (name, t.stride())
    assert grads_[0].is_contiguous()
    torch.library.opcheck(FORWARD, (q, k, v, is_causal, False))
    torch.library.opcheck(BACKWARD, (grad_out, q, k, v, o, lse, is_causal, False, deterministic))
    contiguous = [t.contiguous() for t in (q, k, v, grad_out)]
    want_o, want_lse = FORWARD(*contiguous[:3], is_causal, False)
    want = BACKWARD(contiguous[3], *contiguous[:3], want_o, want_lse, is_causal, False, deterministic)
    assert_same([o, lse, *grads_], [want_o, want_lse, *want], f"model layout, causal={is_causal}, seed={seed}")


# ------------------------------------------------------------------------------------------ torch.compile


class _GraphRecorder:
    """A torch.compile backend that keeps each graph's call targets, then runs the graph eagerly."""

    def __init__(self) -> None:
        self.targets: list = []
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        for module in gm.modules():  # an autograd.Function's forward and backward are nested graphs
            if isinstance(module, torch.fx.GraphModule):
                self.targets += [node.target for node in module.graph.nodes if node.op == "call_function"]
        return gm.forward


@pytest.mark.parametrize("entry", ["flash_attention", "FlashAttention2Triton.apply", "registry"])
def test_compile_fullgraph_matches_eager(entry, seed):
    """fullgraph=True (a graph break would raise): the same output and gradients as eager, with GQA and n_q != n_k;
    the compiled graph holds the forward op as one node, never the Triton kernels themselves."""
    fn = {"flash_attention": ft.flash_attention, "FlashAttention2Triton.apply": FlashAttention2Triton.apply,
          "registry": get_attention("flash_triton")}[entry]

    def attention_block(q, k, v, is_causal):  # a little model code around the call
        return fn(q * 1.5, k, v.relu(), is_causal).sin()

    q, k, v, grad_out = inputs()
    torch._dynamo.reset()
    recorder = _GraphRecorder()
    compiled = torch.compile(attention_block, fullgraph=True, backend=recorder)
    for is_causal in (False, True):
        out, (dq, dk, dv) = grads(compiled, q, k, v, grad_out, is_causal)
        want_out, want_grads = grads(attention_block, q, k, v, grad_out, is_causal)
        assert_same([out, dq, dk, dv], [want_out, *want_grads], f"{entry}, causal={is_causal}, seed={seed}")
    assert recorder.graphs == 2, recorder.graphs  # one per is_causal value: no break, no other recompile
    names = [str(target) for target in recorder.targets]
    assert any("torch_impl.flash_attention_forward" in name for name in names), names
    assert not any("triton_kernel_wrapper" in name for name in names), names


def test_compile_aot_autograd_traces_the_backward_op(seed):
    """aot_eager: AOTAutograd traces forward and backward through the fake implementations; same results."""
    q, k, v, grad_out = inputs(n_q=6, n_k=6, kv_heads=4)
    torch._dynamo.reset()
    compiled = torch.compile(ft.flash_attention, fullgraph=True, backend="aot_eager")
    out, got = grads(compiled, q, k, v, grad_out, True)
    want_out, want = grads(ft.flash_attention, q, k, v, grad_out, True)
    assert_same([out, *got], [want_out, *want], f"aot_eager, seed={seed}")


def test_compiled_model_with_flash_triton_matches_eager(seed):
    """The tiny model (d_head 16) with attention='flash_triton', compiled whole with fullgraph=True."""
    spec = MODELS["tiny"]
    model = TransformerLM(spec, attention="flash_triton", device=DEVICE)
    tokens = torch.randint(0, spec.vocab_size, (1, 11), device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for run_model in (model, compiled):
        model.zero_grad(set_to_none=True)
        logits = run_model(tokens)
        logits.square().mean().backward()
        results.append([logits.detach(), *(p.grad.clone() for p in model.parameters())])
    assert_same(results[1], results[0], f"compiled model, seed={seed}", tol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("attention", "deterministic"), [("flash_triton", False), ("flash_triton", True),
                                                          ("sdpa", False)], ids=["fused", "two-pass", "sdpa"])
def test_model_grads_match_float64(attention, deterministic, backend, seed):
    """The tiny model (fp32), eager and compiled, against the same weights in float64 with SDPA: an independent
    reference, so a wrong kernel cannot pass by agreeing with itself; SDPA in fp32 beside ours tells a kernel's
    failure from the compiler's. (Torch 2.11 compiled the float32 RoPE into zero dq, dk with every attention;
    notes/flash_attention.md, session 7.) Inductor on the GPU only: its CPU compile costs minutes."""
    spec = MODELS["tiny"]
    model = TransformerLM(spec, attention=attention, device=DEVICE)
    reference = TransformerLM(spec, attention="sdpa", device=DEVICE, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, spec.vocab_size, (2, 37), device=DEVICE)
    torch._dynamo.reset()
    run_model = model if backend == "eager" else torch.compile(model, fullgraph=True, backend=backend)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)  # the flag our backward follows
    try:
        run_model(tokens).square().mean().backward()
    finally:
        torch.use_deterministic_algorithms(saved)
    reference(tokens).square().mean().backward()
    errors = {name: ((p.grad.double() - want.grad).norm() / want.grad.norm()).item()
              for (name, p), want in zip(model.named_parameters(), reference.parameters())}
    wrong = {name: f"{err:.2e}" for name, err in errors.items() if not err < 1e-4}
    assert not wrong, f"gradients off (relative error): {wrong} (tf32 {ft.tf32_allowed()}, seed={seed})"


# --------------------------------------------------------------------------------------- fp32 precision


def test_fp32_dot_precision_follows_pytorch(monkeypatch):
    """IEEE fp32 dots by default; TF32 once PyTorch's matmuls may use it; bf16/fp16 never ask for IEEE."""
    seen = []
    real_launch = ft._launch

    def spy(tuned, kernel, name, *args, **meta):
        if name != "delta":  # the D = rowsum(dO * O) pass has no products
            seen.append((name, meta["DOT_PRECISION"]))
        return real_launch(tuned, kernel, name, *args, **meta)

    monkeypatch.setattr(ft, "_launch", spy)
    q, k, v, grad_out = inputs(n_q=4, n_k=4)
    kernels = ["fwd", "dkdv"] if ft.INTERPRET or ft._has_tma(q.device) else ["fwd", "dkdv", "dq"]  # fused or two-pass
    for allowed, expected in ((False, "ieee"), (True, "tf32")):
        monkeypatch.setattr(ft, "tf32_allowed", lambda allowed=allowed: allowed)
        seen.clear()
        grads(ft.flash_attention, q, k, v, grad_out, True)
        grads(FlashAttention2Triton.apply, q, k, v, grad_out, True)
        assert seen == [(name, expected) for name in kernels] * 2, seen
    assert ft._dot_precision(torch.float16, tf32=False) == ft._dot_precision(torch.bfloat16, False) == "tf32"


_SETTINGS = """
import torch
from torch_impl.attention.flash_triton import tf32_allowed
print(tf32_allowed(), end=" ")
for setting in SETTINGS:
    exec(setting)
    print(tf32_allowed(), end=" ")
"""


@pytest.mark.parametrize("settings,expected", [
    (["torch.set_float32_matmul_precision('high')", "torch.set_float32_matmul_precision('highest')",
      "torch.backends.cuda.matmul.allow_tf32 = True"], "False True False True"),
    (["torch.backends.cuda.matmul.fp32_precision = 'tf32'", "torch.backends.cuda.matmul.fp32_precision = 'ieee'"],
     "False True False"),
], ids=["legacy", "fp32_precision"])
def test_tf32_allowed_reads_pytorch_settings(settings, expected):
    """In a fresh process each (PyTorch refuses to mix its legacy and new TF32 APIs in one)."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision") and "fp32_precision" in settings[0]:
        pytest.skip("this torch has no fp32_precision API")
    code = _SETTINGS.replace("SETTINGS", repr(settings))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == expected.split()


# -------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 80])
def test_gpu_inductor_compile_fullgraph(d, seed):
    """Inductor on CUDA (the issue's failure: CompilationError in _fwd_inner): bf16, GQA, the same results as eager."""
    q, k, v, grad_out = inputs(heads=8, kv_heads=2, n_q=1000, n_k=1000, d=d, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(ft.flash_attention, fullgraph=True)
    out, got = grads(compiled, q, k, v, grad_out, True)
    want_out, want = grads(ft.flash_attention, q, k, v, grad_out, True)
    # O, dK, dV: the same bits. dQ: the fused backward adds its fp32 tiles in a varying order, then rounds to bf16.
    assert_same([out, *got[1:]], [want_out, *want[1:]], f"inductor d={d}, seed={seed}", tol=0)
    assert_same(got[:1], want[:1], f"inductor dQ, d={d}, seed={seed}", tol=1e-2)


@pytest.mark.gpu
def test_gpu_opcheck_bf16():
    q, k, v, grad_out = inputs(heads=4, kv_heads=1, n_q=300, n_k=200, d=80, dtype=torch.bfloat16)
    torch.library.opcheck(FORWARD, (q, k, v, True, False))
    o, lse = FORWARD(q.detach(), k.detach(), v.detach(), True, False)
    for deterministic in (False, True):
        torch.library.opcheck(BACKWARD, (grad_out, q.detach(), k.detach(), v.detach(), o, lse, True, False,
                                         deterministic))
