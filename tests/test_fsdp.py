"""FSDP on 2 and 3 gloo ranks against non-parallel training of the tiny TransformerLM.

fp32: each rank wraps the same model in ``FSDP``, trains on its slice of the batch with AdamW over the
shards, and after every step ``gather_full_params()`` must equal a single-process model trained with AdamW
on the whole batch (up to float32 summation order). fp16: ``FSDP(compute_dtype=torch.float16)`` against a
non-parallel model that casts the same way, written here independently of FSDP's code: every
Linear / Embedding weight is an fp32 master seen through a ``torch.nn.utils.parametrize`` cast to fp16 and
the layer's floating inputs are cast to fp16, so weights compute in fp16 and gradients land in fp32.
Also checked: the wrapped model keeps its parameter names; every rank holds 1/N of each sharded weight
(padded) in fp32 and the replicated parameters whole; no gathered weight is alive between forward and
backward, and at most the unit in use and the prefetched ones at any time (a block's unit also its rank-major
buffer while its weights are copied out); at most two units' full-size gradients wait for their reduce-scatter
after backward; gradients arrive fp32; no warnings. Units of a block: one all-gather per block and pass, one
reduce-scatter per block, with activation checkpointing too.
"""

from __future__ import annotations

import copy
import math
import secrets
import time
import warnings

import pytest
import torch
import torch.distributed
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

from parallelism_calc.specs import MODELS
from tests._dist import run_ranks
from torch_impl.distributed import FSDP
from torch_impl.distributed.fsdp import is_sharded_layer
from torch_impl.model import TransformerLM, cross_entropy

BATCH, SEQ, STEPS, LR = 6, 16, 3, 1e-3
# AdamW's update is ~lr * g / (|g| + eps): with the default eps (1e-8), an element whose gradient is within
# float32 round-off of zero can flip its update by ~lr when only the summation order changes. eps = 1e-4
# bounds that sensitivity (|d update| <= lr * |d g| / eps) without changing what the test exercises.
ADAM_EPS = 1e-4


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = MODELS["tiny"].vocab_size
    return (torch.randint(vocab, (STEPS, BATCH, SEQ), generator=gen),
            torch.randint(vocab, (STEPS, BATCH, SEQ), generator=gen))


class _CastTo(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.dtype)


def _casting_reference(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` whose Linear / Embedding layers compute in ``dtype`` on fp32 master weights."""
    ref = copy.deepcopy(model)
    layers = [m for m in ref.modules() if type(m).__name__ in ("Linear", "Embedding")]
    for layer in layers:
        parametrize.register_parametrization(layer, "weight", _CastTo(dtype), unsafe=True)
        layer.register_forward_pre_hook(
            lambda _m, args: tuple(a.to(dtype) if a.is_floating_point() else a for a in args))
    return ref


def _ref_named_params(ref: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("parametrizations.weight.original", "weight"): p for n, p in ref.named_parameters()}


def _unit_sizes(model: nn.Module, world_size: int, gather_unit: str) -> list[int]:
    """Elements each all-gather brings (padded per weight), from the parameter names alone: "block", the 2-D
    weights of each ``layers.{i}`` together and the others one by one; "layer", every 2-D weight alone."""
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            parts = name.split(".")
            key = ".".join(parts[:2]) if gather_unit == "block" and parts[0] == "layers" else name
            units[key] = units.get(key, 0) + math.ceil(p.numel() / world_size) * world_size
    return list(units.values())


def _body(rank: int, world_size: int, seed: int, compute_dtype: torch.dtype | None,
          reduce_dtype: torch.dtype | None = None, gather_unit: str = "block") -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FSDP must not warn in normal use
        torch.manual_seed(seed)
        model = TransformerLM(MODELS["tiny"])
        names = [n for n, _ in model.named_parameters()]
        shapes = {n: p.shape for n, p in model.named_parameters()}
        sharded = {n for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2}
        largest = max(_unit_sizes(model, world_size, gather_unit))
        ref = copy.deepcopy(model) if compute_dtype is None else _casting_reference(model, compute_dtype)
        ref_params = _ref_named_params(ref)
        model_init = copy.deepcopy(model)
        if rank == 1:  # the wrapper must start every rank from rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        fsdp = FSDP(model, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, gather_unit=gather_unit)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1)
        xs, ys = _data(seed)
        per = BATCH // world_size
        out: dict = {"param_err": [], "loss": [], "ref_loss": [], "gathered_after_forward": []}
        for step in range(STEPS):
            opt.zero_grad()
            loss = cross_entropy(fsdp(xs[step, rank * per:(rank + 1) * per]),
                                 ys[step, rank * per:(rank + 1) * per])
            out["gathered_after_forward"].append(_gathered_bytes_settled(fsdp))
            loss.backward()
            out.setdefault("pending_after_backward", []).append(fsdp.pending_gradient_bytes())
            fsdp.finish_gradient_synchronization()
            ref_opt.zero_grad()
            if compute_dtype is None:  # fp32: one process on the whole batch
                ref_loss = cross_entropy(ref(xs[step]), ys[step])
                ref_loss.backward()
            else:  # the casting reference, slice by slice: the same fp16 computation as each rank's
                ref_loss = 0.0
                for r in range(world_size):
                    slice_loss = cross_entropy(ref(xs[step, r * per:(r + 1) * per]), ys[step, r * per:(r + 1) * per])
                    slice_loss.backward()  # fp16 gradients, accumulated in the fp32 masters
                    ref_loss = ref_loss + slice_loss.detach() / world_size
                for p in ref.parameters():
                    p.grad /= world_size
            if step == 0:
                full_grads = _gather_grads_or_none(fsdp, world_size)
                out["grad_rel_err"] = max(((full_grads[n] - p.grad).norm() / p.grad.norm()).item()
                                          for n, p in ref_params.items())
                out["grad_dtypes"] = sorted({str(p.grad.dtype) for p in fsdp.parameters()})
                # Negative control: the same model without any cast, on the whole batch.
                no_cast = copy.deepcopy(model_init)
                cross_entropy(no_cast(xs[step]), ys[step]).backward()
                out["no_cast_grad_rel_err"] = max(((full_grads[n] - p.grad).norm() / p.grad.norm()).item()
                                                  for n, p in no_cast.named_parameters())
            opt.step()
            ref_opt.step()
            full = fsdp.gather_full_params()
            out["param_err"].append(max((full[n] - p).abs().max().item() for n, p in ref_params.items()))
            mean_loss = loss.detach().clone()
            torch.distributed.all_reduce(mean_loss)
            out["loss"].append(mean_loss.item() / world_size)  # equal slices: the mean of the means
            out["ref_loss"].append(ref_loss.item())
        out["keys_equal"] = list(full) == names and all(full[n].shape == shapes[n] for n in names)
        out["full_dtypes"] = sorted({str(t.dtype) for t in full.values()})
        out["names_kept"] = [n for n, _ in fsdp.module.named_parameters()] == names
        out["sharded_names"] = sorted(fsdp.sharded_param_names())
        out["expected_sharded"] = sorted(sharded)
        params = dict(fsdp.module.named_parameters())
        out["sharded_bytes"] = sum(params[n].numel() * params[n].element_size() for n in sharded)
        out["expected_sharded_bytes"] = sum(math.ceil(shapes[n].numel() / world_size) * 4 for n in sharded)
        out["total_sharded_bytes"] = sum(shapes[n].numel() * 4 for n in sharded)
        out["replicated_full"] = all(params[n].shape == shapes[n] for n in names if n not in sharded)
        out["master_dtypes"] = sorted({str(p.dtype) for p in fsdp.parameters()})
        out["state_dtypes"] = sorted({str(t.dtype) for s in opt.state.values() for k, t in s.items() if k != "step"})
        out["peak_gathered"] = fsdp.peak_gathered_bytes
        # the unit in use and the ones prefetched; a block's unit also its rank-major buffer while copied out
        out["units_gathered"] = 1 + fsdp.prefetch_layers + (gather_unit == "block")
        out["largest_gathered"] = largest * (2 if compute_dtype == torch.float16 else 4)
        out["largest_reduced"] = largest * (reduce_dtype or compute_dtype or torch.float32).itemsize
        out["all_gathered"] = sum(math.ceil(shapes[n].numel() / world_size) * world_size for n in sharded) * \
            (2 if compute_dtype == torch.float16 else 4)
        out["warnings_as_errors"] = True
    return out


def _gathered_bytes_settled(fsdp: FSDP, deadline_s: float = 2.0) -> int:
    """``fsdp.gathered_bytes()`` once gloo lets go: its worker thread drops its reference to a finished
    asynchronous collective's tensors a moment after ``wait()`` returns, so a buffer can outlive FSDP's
    last reference by milliseconds. Poll briefly; a buffer FSDP (or autograd) really kept stays."""
    end = time.monotonic() + deadline_s
    while fsdp.gathered_bytes() and time.monotonic() < end:
        time.sleep(0.01)
    return fsdp.gathered_bytes()


def _check_common(res: dict, world_size: int, compute_dtype) -> None:
    assert res["keys_equal"] and res["names_kept"]
    assert res["sharded_names"] == res["expected_sharded"]
    assert res["full_dtypes"] == res["master_dtypes"] == res["state_dtypes"] == res["grad_dtypes"] == ["torch.float32"]
    # Per-rank bytes of the sharded weights: exactly 1/N of each (padded), so ~ total / N.
    assert res["sharded_bytes"] == res["expected_sharded_bytes"]
    assert res["sharded_bytes"] <= res["total_sharded_bytes"] / world_size + 4 * len(res["expected_sharded"])
    assert res["replicated_full"]
    # Gathered weights: none kept from forward to backward; at most the current unit + the prefetched ones.
    assert res["gathered_after_forward"] == [0] * STEPS
    assert 0 < res["peak_gathered"] <= res["units_gathered"] * res["largest_gathered"]
    assert res["peak_gathered"] < res["all_gathered"]
    # Full-size gradient buffers: at most two reduce-scatters in flight at the end of backward, not every unit's.
    assert all(0 < b <= 2 * res["largest_reduced"] for b in res["pending_after_backward"]), res["pending_after_backward"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("gather_unit", ["block", "layer"])
def test_fsdp_fp32_matches_single_process(world_size, gather_unit):
    seed = secrets.randbelow(2**20)
    results = run_ranks(_body, world_size, seed, None, None, gather_unit, timeout_s=90)
    for r, res in enumerate(results):
        _check_common(res, world_size, None)
        assert res["grad_rel_err"] < 1e-5, (seed, r, res["grad_rel_err"])
        # Summation order only (see ADAM_EPS): ~1e-7 measured. AdamW would hide a wrong gradient *scale*:
        # hence the gradient check above.
        assert max(res["param_err"]) < 1e-2 * LR, (seed, r, res["param_err"])
        for a, b in zip(res["loss"], res["ref_loss"]):
            assert a == pytest.approx(b, rel=1e-5), (seed, r)


def test_fsdp_fp16_compute_matches_casting_reference():
    # fp32 reduce-scatter: the only difference from the casting reference is float32 summation order (none
    # at all for 2 ranks), so gradients and AdamW's parameters match to float32 round-off...
    seed = secrets.randbelow(2**20)
    results = run_ranks(_body, 2, seed, torch.float16, torch.float32, timeout_s=90)
    for r, res in enumerate(results):
        _check_common(res, 2, torch.float16)
        assert res["grad_rel_err"] < 1e-6, (seed, r, res["grad_rel_err"])
        # ...while a model that does not cast is ~1e-3 away (fp16 round-off): the cast really happens.
        assert res["no_cast_grad_rel_err"] > 1e-4, (seed, r, res["no_cast_grad_rel_err"])
        assert max(res["param_err"]) < 1e-6, (seed, r, res["param_err"])
        for a, b in zip(res["loss"], res["ref_loss"]):
            assert a == pytest.approx(b, rel=1e-6), (seed, r)


def test_fsdp_fp16_default_reduce_in_fp16():
    # The default reduces in the compute dtype (as torch FSDP2): gradients within fp16 round-off of the
    # casting reference, and still fp32 (the master dtype) when they arrive.
    seed = secrets.randbelow(2**20)
    for r, res in enumerate(run_ranks(_body, 2, seed, torch.float16, timeout_s=90)):
        _check_common(res, 2, torch.float16)
        assert res["grad_rel_err"] < 2e-3, (seed, r, res["grad_rel_err"])  # fp16 epsilon ~ 1e-3
        assert res["loss"][0] == pytest.approx(res["ref_loss"][0], rel=1e-6), seed  # same first forward


class _Toy(nn.Module):
    """torch.nn layers: an Embedding tied to a Linear head, a Linear with bias, a LayerNorm, an unused
    Linear and a frozen one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.frozen = nn.Linear(7, 6, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: one shard, gradients from both uses
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.norm(self.lin(self.emb(x)))))


def _body_toy(rank: int, world_size: int, seed: int) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(seed)
        model = _Toy()
        ref = copy.deepcopy(model)
        fsdp = FSDP(model)
        gen = torch.Generator().manual_seed(seed + 1)
        x, y = torch.randint(11, (4, 5), generator=gen), torch.randint(11, (4, 5), generator=gen)
        per = 4 // world_size
        cross_entropy(fsdp(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        fsdp.finish_gradient_synchronization()
        cross_entropy(ref(x), y).backward()
        grads = _gather_grads_or_none(fsdp, world_size)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        return {
            "names": list(grads) == list(ref_grads),
            "none_match": {n: (grads[n] is None, ref_grads[n] is None) for n in ref_grads},
            "err": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items() if g is not None),
            "n_sharded": len(fsdp.sharded_param_names()),
        }


def _gather_grads_or_none(fsdp: FSDP, world_size: int) -> dict[str, torch.Tensor | None]:
    shapes = {n: t.shape for n, t in fsdp.gather_full_params().items()}
    grads = {}
    for name, p in fsdp.module.named_parameters():
        if p.grad is None:  # the same on every rank (sharded and replicated alike)
            grads[name] = None
        elif name in fsdp.sharded_param_names():
            pieces = [torch.empty_like(p.grad) for _ in range(world_size)]
            torch.distributed.all_gather(pieces, p.grad)
            grads[name] = torch.cat(pieces)[:shapes[name].numel()].view(shapes[name])
        else:
            grads[name] = p.grad.clone()
    return grads


def test_fsdp_tied_bias_frozen_unused():
    seed = secrets.randbelow(2**20)
    for r, res in enumerate(run_ranks(_body_toy, 2, seed, timeout_s=60)):
        assert res["names"], (seed, r)
        assert res["n_sharded"] == 4  # emb/head (tied: one), lin, frozen, unused
        for name, (got, want) in res["none_match"].items():
            assert got == want, (seed, r, name)  # frozen and unused parameters get no gradient
        assert res["err"] < 1e-6, (seed, r, res["err"])


def test_sharded_layer_detection():
    class Embedding(nn.Module):  # a user class named like ours, with a 2-D weight
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3, 4))

    class Linear(nn.Module):  # named Linear but with a 1-D weight: replicated
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3))

    assert is_sharded_layer(nn.Linear(2, 3)) and is_sharded_layer(nn.Embedding(5, 2))
    assert is_sharded_layer(Embedding()) and not is_sharded_layer(Linear())
    assert not is_sharded_layer(nn.LayerNorm(4)) and not is_sharded_layer(nn.Conv1d(2, 2, 1))


# ----------------------------------------------------------------------------- bitwise, and why not against the whole batch


def _body_bitwise(rank: int, world_size: int, seed: int) -> dict:
    """fp32 FSDP with SGD (no optimizer to hide a difference) against two single-process references: the whole
    batch at once, and the batch in rank-sized slices whose gradients are added (each slice's mean loss over
    world_size)."""
    torch.manual_seed(seed)
    model = TransformerLM(MODELS["tiny"])
    whole, sliced = copy.deepcopy(model), copy.deepcopy(model)
    fsdp = FSDP(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (fsdp, whole, sliced)]
    xs, ys = _data(seed)
    per = BATCH // world_size
    out = {"vs_sliced": [], "vs_whole": []}
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        cross_entropy(fsdp(xs[step, rank * per:(rank + 1) * per]), ys[step, rank * per:(rank + 1) * per]).backward()
        fsdp.finish_gradient_synchronization()
        cross_entropy(whole(xs[step]), ys[step]).backward()
        for r in range(world_size):
            (cross_entropy(sliced(xs[step, r * per:(r + 1) * per]), ys[step, r * per:(r + 1) * per])
             / world_size).backward()
        for opt in opts:
            opt.step()
        full = fsdp.gather_full_params()
        for key, ref in (("vs_sliced", sliced), ("vs_whole", whole)):
            out[key].append({n: (full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()})
    return out


def test_fsdp_fp32_is_bitwise_the_single_process_step_summed_by_rank():
    """Our fp32 FSDP equals, bit for bit, the single-process step that sums the gradients of each rank's slice
    (power-of-two scalings are exact and two ranks' sum is commutative); against the whole batch in one product
    it differs by float32 round-off, because the matrix products then sum the batch in their own order
    (the README's note on the CS336 FSDP test)."""
    seed = secrets.randbelow(2**20)
    for rank, res in enumerate(run_ranks(_body_bitwise, 2, seed, timeout_s=90)):
        for step, errs in enumerate(res["vs_sliced"]):
            assert not any(errs.values()), (seed, rank, step, {n: e for n, e in errs.items() if e})
        worst = max(max(errs.values()) for errs in res["vs_whole"])
        assert worst < 1e-6, (seed, rank, worst)


# ----------------------------------------------------------------------------- units: collectives per step


def _body_counts(rank: int, world_size: int, seed: int, gather_unit: str, checkpointed: bool) -> dict:
    """Collectives of one training step, counted, and its gradients against one process on the whole batch."""
    import torch_impl.distributed.fsdp as fsdp_module
    from torch_impl.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(seed)
    model = TransformerLM(MODELS["tiny"])
    ref = copy.deepcopy(model)
    if checkpointed:
        apply_activation_checkpointing(model, every=1)
    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    fsdp = FSDP(model, gather_unit=gather_unit)
    real = fsdp_module._all_gather_flat, fsdp_module._reduce_scatter_flat
    fsdp_module._all_gather_flat = counted("all_gather", real[0])
    fsdp_module._reduce_scatter_flat = counted("reduce_scatter", real[1])
    try:
        xs, ys = _data(seed)
        per = BATCH // world_size
        cross_entropy(fsdp(xs[0, rank * per:(rank + 1) * per]), ys[0, rank * per:(rank + 1) * per]).backward()
        fsdp.finish_gradient_synchronization()
    finally:
        fsdp_module._all_gather_flat, fsdp_module._reduce_scatter_flat = real
    cross_entropy(ref(xs[0]), ys[0]).backward()
    grads = _gather_grads_or_none(fsdp, world_size)
    names = {n.replace(".blocks.0", ""): n for n in grads}  # a segment of one block: layers.{i}.blocks.0....
    err = max(((grads[names[n]] - p.grad).norm() / p.grad.norm()).item() for n, p in ref.named_parameters())
    return {**counts, "grad_rel_err": err}


@pytest.mark.parametrize("gather_unit, checkpointed, gathers, reduce_scatters", [
    # tiny: 2 blocks of 7 weights, the embedding and the LM head. Block units: forward 4 gathers (embedding, 2
    # blocks, head), backward 3 (the head and the 2 blocks, whose saved weights are gathered again once each: the
    # embedding saves none); one reduce-scatter per unit. Layers: 16 + 15 gathers, 16 reduce-scatters.
    ("block", False, 7, 4), ("layer", False, 31, 16),
    # checkpointed blocks save no weight: their recomputation gathers them (once a block), the head's is saved.
    ("block", True, 7, 4)])
def test_units_gather_each_block_once_a_pass(gather_unit, checkpointed, gathers, reduce_scatters):
    seed = secrets.randbelow(2**20)
    for rank, res in enumerate(run_ranks(_body_counts, 2, seed, gather_unit, checkpointed, timeout_s=90)):
        assert (res["all_gather"], res["reduce_scatter"]) == (gathers, reduce_scatters), (rank, res)
        assert res["grad_rel_err"] < 1e-5, (seed, rank, res["grad_rel_err"])


# ----------------------------------------------------------------------------- compiled blocks


def _body_compiled(rank: int, world_size: int, seed: int) -> dict:
    """FSDP over blocks compiled by ``parallelize`` (each block's forward; the gathers eager around it): one
    step's gradients against one eager process on the whole batch, and what Dynamo made of it."""
    from torch._dynamo.utils import counters

    from torch_impl.parallelize import parallelize

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(seed)
    model = TransformerLM(MODELS["tiny"])
    ref = copy.deepcopy(model)
    fsdp, wrapper, _ = parallelize(model, "fsdp", adamw={}, compile=True)
    xs, ys = _data(seed)
    per = BATCH // world_size
    loss = cross_entropy(fsdp(xs[0, rank * per:(rank + 1) * per]), ys[0, rank * per:(rank + 1) * per])
    after_forward = _gathered_bytes_settled(fsdp)
    loss.backward()
    wrapper.finish_gradient_synchronization()
    cross_entropy(ref(xs[0]), ys[0]).backward()
    grads = _gather_grads_or_none(fsdp, world_size)
    return {"err": max(((grads[n] - p.grad).norm() / p.grad.norm()).item() for n, p in ref.named_parameters()),
            "graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "gathered_after_forward": after_forward}


def test_fsdp_over_compiled_blocks():
    """One graph serves every block, with no break (the hooks stay outside it), the compiled region's saved weights
    go through the pack hook (nothing gathered is kept from forward to backward) and the gradients are right."""
    seed = secrets.randbelow(2**20)
    for rank, res in enumerate(run_ranks(_body_compiled, 2, seed, timeout_s=300)):
        assert (res["graphs"], res["breaks"], res["gathered_after_forward"]) == (1, 0, 0), (rank, res)
        assert res["err"] < 1e-5, (seed, rank, res["err"])


# ----------------------------------------------------------------------------- NCCL


def _body_nccl(rank: int, world_size: int, seed: int, compute_dtype: torch.dtype | None) -> dict:
    """One step of FSDP on NCCL (the tiny model on this rank's GPU): its gradients against one process on the whole
    batch in fp32."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(seed)
    model = TransformerLM(MODELS["tiny"]).to(device)
    ref = copy.deepcopy(model)
    fsdp = FSDP(model, compute_dtype=compute_dtype)
    xs, ys = (t[0].to(device) for t in _data(seed))
    per = BATCH // world_size
    cross_entropy(fsdp(xs[rank * per:(rank + 1) * per]), ys[rank * per:(rank + 1) * per]).backward()
    fsdp.finish_gradient_synchronization()
    cross_entropy(ref(xs), ys).backward()
    grads = _gather_grads_or_none(fsdp, world_size)
    return {n: ((grads[n].float() - p.grad).norm() / p.grad.norm()).item() for n, p in ref.named_parameters()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")
@pytest.mark.parametrize("compute_dtype, tolerance", [(None, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 1e-2)])
def test_fsdp_on_nccl_matches_single_process(compute_dtype, tolerance):
    """NCCL's averaging (AVG for fp32 and bf16, fp16 divided first): every gradient within its dtype's round-off of
    one process's. A bf16 PREMUL_SUM whose factor NCCL read as zero gave every sharded weight a zero gradient
    (relative error 1) in a first version."""
    seed = secrets.randbelow(2**20)
    for rank, errs in enumerate(run_ranks(_body_nccl, 2, seed, compute_dtype, timeout_s=120, backend="nccl")):
        worst = max(errs, key=errs.get)
        assert errs[worst] < tolerance, (seed, rank, worst, errs[worst])
