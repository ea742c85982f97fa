"""MasterAdamW (``torch_impl.optim``): bf16 parameters, fp32 master weights, one kernel per group.

Checked against ``torch.optim.AdamW`` run in float64 on the same initial weights and the same (bf16) gradients,
on fresh random inputs: the Triton kernel (under the interpreter without a GPU) and the PyTorch path alike.
"""

import os

import pytest
import torch

from torch_impl.optim import BLOCK, MasterAdamW

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(3, 5), (BLOCK + 7,), (2, BLOCK // 2 + 1), (1,)]  # ragged chunks, a tensor over two chunks, one element
# The interpreter rounds fp32 -> bf16 by its own rule (up to one unit in the last place off round-to-nearest-even)
ULPS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 0
HYPER = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(DEVICE)) for shape in SHAPES]


def _grads(step: int, skip: int | None = None) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(shape, generator=gen).bfloat16().to(DEVICE) for shape in SHAPES]
    if skip is not None:
        grads[skip] = None
    return grads


def assert_rounded_from(param: torch.Tensor, master: torch.Tensor) -> None:
    """The bf16 weight is its fp32 master rounded to nearest even (within ``ULPS`` under the interpreter)."""
    bits = lambda t: t.detach().view(torch.int16).int()  # noqa: E731
    assert (bits(param) - bits(master.bfloat16())).abs().max() <= ULPS


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
def test_matches_float64_adamw(kernel):
    params = _params(seed=torch.seed() % 2**31)
    reference = [torch.nn.Parameter(p.detach().double()) for p in params]
    optimizer = MasterAdamW(params, **HYPER, kernel=kernel)
    expected = torch.optim.AdamW(reference, **HYPER, foreach=False)
    assert all(p.dtype == torch.bfloat16 for p in params)
    for step in range(3):
        for p, r, g in zip(params, reference, _grads(step)):
            p.grad, r.grad = g, g.double()
        optimizer.step()
        expected.step()
    for p, r in zip(params, reference):
        state, ref_state = optimizer.state[p], expected.state[r]
        torch.testing.assert_close(state["master"].double(), r.detach(), rtol=0, atol=2e-6)
        torch.testing.assert_close(state["exp_avg"].double(), ref_state["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(state["exp_avg_sq"].double(), ref_state["exp_avg_sq"], rtol=1e-5, atol=1e-7)
        assert_rounded_from(p, state["master"])
        assert state["step"].item() == 3


def test_parameter_without_gradient_is_left_alone():
    params = _params(seed=1)
    before = [p.detach().clone() for p in params]  # fp32: the masters
    optimizer = MasterAdamW(params, **HYPER)
    for p, g in zip(params, _grads(0, skip=1)):
        p.grad = g
    optimizer.step()
    assert torch.equal(optimizer.state[params[1]]["master"], before[1])
    assert torch.equal(params[1].detach(), before[1].bfloat16())
    assert not optimizer.state[params[1]]["exp_avg"].any()
    assert not torch.equal(optimizer.state[params[0]]["master"], before[0])


def test_state_dict_round_trip_continues_the_same():
    first, second = _params(seed=2), _params(seed=3)
    a, b = MasterAdamW(first, **HYPER), MasterAdamW(second, **HYPER)
    for p, g in zip(first, _grads(0)):
        p.grad = g
    a.step()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():  # the model's own state dict, as a checkpoint restores it
        for p, q in zip(first, second):
            q.copy_(p)
    for p, q in zip(first, second):
        for name in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][name], b.state[q][name])
    for step in (1, 2):
        for p, q, g in zip(first, second, _grads(step)):
            p.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    for p, q in zip(first, second):
        assert torch.equal(a.state[p]["master"], b.state[q]["master"])
        assert torch.equal(p, q)


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
def test_step_in_parts_is_the_same_step_and_waits_before_each_part(kernel):
    """``step_parts``: each part's ``ready`` is called before its update (here it hands the part its gradients,
    the latest moment a data-parallel wrapper's would land), parameters in no part are updated last, and the
    weights and state end bit for bit as ``step()`` leaves them, over two groups and a missing gradient."""
    seed = torch.seed() % 2**31
    whole, parted = _params(seed), _params(seed)
    a = MasterAdamW([{"params": whole[:2]}, {"params": whole[2:]}], **HYPER, kernel=kernel)
    b = MasterAdamW([{"params": parted[:2]}, {"params": parted[2:]}], **HYPER, kernel=kernel)
    calls = []
    for step in range(3):
        grads = _grads(step, skip=step if step < len(SHAPES) else None)
        for p, g in zip(whole, grads):
            p.grad = g
        for p, g in zip(parted, grads):  # the gradients' tensors are set, their values land at ready()
            p.grad = None if g is None else torch.full_like(g, float("nan"))

        def ready(indices, grads=grads):
            calls.append(indices)
            for i in indices:
                if grads[i] is not None:
                    parted[i].grad.copy_(grads[i])
        parts = [([parted[3], parted[0]], lambda: ready((3, 0))), ([parted[2]], lambda: ready((2,)))]
        ready((1,))  # parted[1] is in no part: its gradient must be in before the call
        a.step()
        b.step_parts(parts)
    assert calls == [(1,), (3, 0), (2,)] * 3
    for p, q in zip(whole, parted):
        assert torch.equal(p, q)
        for name in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][name], b.state[q][name]), name


def _terms(step: int, world_size: int) -> list[list[torch.Tensor]]:
    """Each parameter's gradient on ``world_size`` ranks: x + d_q with the d_q summing to 0, all multiples of 1/64
    below 2 (exact in bf16, and so are their fp32 sums): the mean is x whatever rounding the kernel's platform does
    (the interpreter's bf16 rounding breaks ties its own way), and each rank's own term is not it."""
    gen = torch.Generator().manual_seed(2000 + step)
    terms = []
    for shape in SHAPES:
        x = torch.randint(-30, 31, shape, generator=gen) / 64
        d = torch.randint(-30, 31, (world_size - 1, *shape), generator=gen) / 64
        d = torch.cat([d, -d.sum(0, keepdim=True)])
        terms.append([(x + d[q]).bfloat16().to(DEVICE) for q in range(world_size)])
    return terms


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
def test_step_in_parts_averages_the_terms_as_it_loads_them(kernel, world_size):
    """``Part.terms`` (each parameter's gradient on every rank, ``DDPBucketed(mean="optimizer")``): the update is
    ``step()``'s with each ``.grad`` set to ``mean_of`` its terms, bit for bit, over two groups, a part without
    terms and a parameter with no gradient anywhere (the rounding of means on fresh bf16 values: on the GPU, in
    tests/test_ddp.py's overlapped steps)."""
    from torch_impl.optim import Part, mean_of

    seed = torch.seed() % 2**31
    whole, parted = _params(seed), _params(seed)
    a = MasterAdamW([{"params": whole[:2]}, {"params": whole[2:]}], **HYPER, kernel=kernel)
    b = MasterAdamW([{"params": parted[:2]}, {"params": parted[2:]}], **HYPER, kernel=kernel)
    rank = world_size - 1  # this rank's own gradient is the last term
    for step in range(3):
        terms = _terms(step, world_size)
        for i, (p, q) in enumerate(zip(whole, parted)):  # parameter 1: no gradient on any rank (terms, .grad None)
            p.grad = None if i == 1 else mean_of(terms[i])
            q.grad = None if i == 1 else terms[i][rank]
        a.step()
        b.step_parts([Part([parted[3], parted[1], parted[0]], lambda: None, [terms[3], terms[1], terms[0]]),
                      Part([parted[2]], lambda: None, [terms[2]])])
        assert not torch.equal(terms[0][rank], mean_of(terms[0]))
    for p, q in zip(whole, parted):
        assert torch.equal(p, q)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[p][name], b.state[q][name]), (seed, name)


def test_step_in_parts_refuses_a_parameter_twice_or_not_its_own():
    params = _params(seed=6)
    optimizer = MasterAdamW(params)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    for parts in ([([params[0]], None), ([params[0]], None)], [([torch.nn.Parameter(torch.zeros(2))], None)]):
        with pytest.raises(ValueError, match="in two parts or not this optimizer's"):
            optimizer.step_parts([(ps, lambda: None) for ps, _ in parts])


def test_a_model_learns_in_bf16_with_master_weights():
    from parallelism_calc.specs import MODELS
    from torch_impl.model import TransformerLM, cross_entropy

    torch.manual_seed(0)
    model = TransformerLM(MODELS["tiny"], device=DEVICE)
    optimizer = MasterAdamW(model.parameters(), lr=1e-2)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokens = torch.randint(0, MODELS["tiny"].vocab_size, (2, 17), device=DEVICE)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("kwargs, message", [
    (dict(param_dtype=torch.float16), "param_dtype"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(lr=float("nan")), "lr"),
    (dict(weight_decay=-1.0), "weight_decay"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MasterAdamW(_params(seed=4), **kwargs)


def test_non_contiguous_gradient_is_refused_by_the_kernel():
    params = _params(seed=5)
    optimizer = MasterAdamW(params, kernel=True)
    for p, g in zip(params, _grads(0)):
        p.grad = g.t().contiguous().t() if g.dim() == 2 else g  # same shape, column-major
    with pytest.raises(ValueError, match="a gradient .3, 5. that is not contiguous"):
        optimizer.step()


def _hopper_accesses(full: bool, terms: int = 1) -> list[str]:
    """The global loads and stores of the kernel compiled offline for sm_90 (no GPU needed; run without the
    interpreter, which replaces the JIT functions)."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torch_impl.optim import ALIGN, _adamw_master_kernel as kernel

    types = ["*i32", "*i32", "*i32", "*i64", "*i64", "*i64", "i32", "*fp32", "*fp32", "*fp32", "*fp32"] + ["fp32"] * 7
    pointers = [i for i, t in enumerate(types) if t.startswith("*")]
    source = ASTSource(fn=kernel, signature=dict(zip(kernel.arg_names, types + ["constexpr"] * 5)),
                       constexprs={"PARAM_DTYPE": tl.bfloat16, "BLOCK": BLOCK, "ALIGN": ALIGN, "FULL": full,
                                   "TERMS": terms},
                       attrs={(i,): [["tt.divisibility", 16]] for i in pointers})  # as the launcher sees tables
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    return re.findall(r"\b(?:ld|st)\.global(?:\.v\d)?\.b\d+", ptx)


@pytest.mark.parametrize("full, vector, terms", [(True, True, 1), (False, False, 1), (True, True, 2)],
                         ids=["whole_chunks", "tails", "whole_chunks_two_terms"])
def test_whole_chunks_compile_to_vector_loads_for_hopper(full, vector, terms):
    """Whole chunks move 16 bytes per access (the address hints hold, for the peers' gradients too), the masked
    tails one element each."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import json; from tests.test_optim import _hopper_accesses; "
            f"print(json.dumps(_hopper_accesses({full}, {terms})))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    accesses = json.loads(run.stdout.splitlines()[-1])
    # one element per access: a bf16 gradient or weight, or an fp32 store (the scalar loads left read the tables)
    narrow = [a for a in accesses if a.endswith(".b16") or a == "st.global.b32"]
    assert (not narrow) == vector and any(".v4." in a for a in accesses) == vector, accesses
