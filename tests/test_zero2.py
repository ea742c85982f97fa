"""ZeRO-2 (``ZeRO2``) on 2 and 3 gloo ranks against plain single-process training of the same model.

Tiny Transformer, small buckets (some hold several parameters, the largest ones one each), so slices cut
parameters mid-way and leave some ranks empty pieces. Each rank trains on its slice of the global batch in two
micro-batches (``no_sync`` on the first), with a StepLR schedule on ``wrapper.optimizer``; the reference trains
on the whole batch in one process. Fresh seed per run, printed in the messages.

* fp32 weights: the weights equal the reference AdamW's after every step (float32 summation order only); the
  pieces of every parameter, over the ranks, tile it exactly once (``shard_of``); each rank keeps 1/N of the
  optimizer state (2 floats per element of its slices) and no full-size gradient (``.grad`` released).
* bf16 weights (``param_dtype``, no autocast), at a learning rate whose updates are below bf16's rounding of most
  weights: the fp32 master pieces follow single-process ``MasterAdamW`` within the rounding of bf16 gradients, and
  the weights are the masters rounded to bf16, on every rank alike; the optimizer's state dict carries the masters
  (a fresh wrapper loaded from it steps exactly as the first), a model state dict alone resets them to its weights,
  and with fp32 weights the state holds no master copy.
* On 2 GPUs (NCCL's AVG reduce-scatter and in-place all-gather): two steps against one process, fp32 and bf16
  gradients.
"""

from __future__ import annotations

import contextlib
import copy
import math
import secrets

import pytest
import torch

from parallelism_calc.specs import MODELS
from tests._dist import run_ranks

SPEC = MODELS["tiny"]
ROWS, SEQ, ACCUM, STEPS = 12, 8, 2, 3  # 12 rows: 2 and 3 ranks split them evenly, in 2 equal micro-batches
BUCKET_MB = 0.05  # 52 KB: the 512 x 64 embedding and LM head alone, the rest packed with neighbours
BF16_LR = 1e-4  # bf16 weights: updates below half a bf16 step of most weights, which only fp32 masters keep
# eps: Adam moves an element by up to lr * dg / eps for a gradient error dg near a zero gradient; the float32
# summation order of the average (dg ~ 1e-8) then moves it by ~1e-7 at most, a tenth of the 1e-6 compared (at eps
# 1e-4, tests/test_zero.py's worst of 300 seeds was 7e-7)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)


def _model(seed: int):
    from torch_impl.model import TransformerLM

    torch.manual_seed(seed)
    return TransformerLM(SPEC)


def _tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, SPEC.vocab_size, (STEPS, ROWS, SEQ + 1), generator=gen)


def _loss(model, rows: torch.Tensor) -> torch.Tensor:
    from torch_impl.model import cross_entropy

    return cross_entropy(model(rows[:, :-1]), rows[:, 1:])


def _body(rank: int, world_size: int, seed: int, bf16: bool) -> dict:
    from torch_impl.distributed import ZeRO2

    model = _model(seed)
    model.layers.span = 1  # each block a span: its gathered weights waited for by a span hook of its own
    wrapper = ZeRO2(model, torch.optim.AdamW, bucket_size_mb=BUCKET_MB, param_dtype=torch.bfloat16 if bf16 else None,
                    **_adamw(bf16))
    schedule = torch.optim.lr_scheduler.StepLR(wrapper.optimizer, step_size=2, gamma=0.5)
    tokens = _tokens(seed)
    weights, masters, released, norms = [], [], [], []

    def read_weights():
        weights.append({n: p.detach().float().clone() for n, p in model.named_parameters()})

    for step in range(STEPS):
        wrapper.on_train_batch_start()
        micro = tokens[step].chunk(world_size)[rank].chunk(ACCUM)
        for j, rows in enumerate(micro):
            with wrapper.no_sync() if j < ACCUM - 1 else contextlib.nullcontext():
                (_loss(wrapper, rows) / ACCUM).backward()
            if step and not j:  # the last step's weights, read after the forward that waited for their gathers
                read_weights()
        wrapper.finish_gradient_synchronization()
        released.append(all(p.grad is None for p in model.parameters()))
        norms.append(wrapper.grad_norm_squared().item())
        wrapper.optimizer.step()
        wrapper.optimizer.zero_grad(set_to_none=True)
        schedule.step()
        masters.append({n: (wrapper.shard_of(piece)[1], piece.detach().clone())
                        for n, piece in wrapper.named_optimizer_params()})
    wrapper.wait_for_weights()  # no forward follows the last step
    read_weights()
    state = wrapper.optimizer.state
    return {"weights": weights, "masters": masters, "released": released, "norms": norms,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "state_numel": sum(t.numel() for s in state.values() for k, t in s.items()
                               if k in ("exp_avg", "exp_avg_sq")),
            "slice_numel": sum(s.master.numel() for s in wrapper._slices.values()),
            "buckets": [len(u.params) for u in wrapper._units],
            "lr": wrapper.optimizer.param_groups[0]["lr"]}


def _adamw(bf16: bool) -> dict:
    return {**ADAMW, "lr": BF16_LR} if bf16 else ADAMW


def _reference(seed: int, bf16: bool) -> list[tuple[float, dict]]:
    """Per step: the weights (with bf16, MasterAdamW's fp32 masters) of one process on the whole batch, and the
    squared norm of its gradient (in float64)."""
    from torch_impl.optim import MasterAdamW

    model = _model(seed)
    opt = (MasterAdamW(model.parameters(), kernel=False, **_adamw(bf16)) if bf16 else
           torch.optim.AdamW(model.parameters(), **ADAMW))
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    out = []
    for rows in _tokens(seed):
        _loss(model, rows).backward()
        norm = sum(p.grad.double().pow(2).sum() for p in model.parameters()).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        out.append((norm, {n: (opt.state[p]["master"] if bf16 else p).detach().float().clone()
                           for n, p in model.named_parameters()}))
    return out


def _assembled(results: list[dict], step: int, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Each parameter put together from every rank's pieces; each element must come from exactly one piece."""
    full, count = {}, {}
    for name, shape in shapes.items():
        full[name] = torch.zeros(math.prod(shape))
        count[name] = torch.zeros(math.prod(shape), dtype=torch.int64)
    for res in results:
        for name, (offset, piece) in res["masters"][step].items():
            full[name][offset:offset + piece.numel()] = piece
            count[name][offset:offset + piece.numel()] += 1
    assert all(bool((c == 1).all()) for c in count.values()), "the pieces do not tile every parameter once"
    return {name: full[name].view(shape) for name, shape in shapes.items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_fp32_matches_single_process(world_size):
    seed = secrets.randbelow(2**20)
    results = run_ranks(_body, world_size, seed, False, timeout_s=120)
    ref = _reference(seed, bf16=False)
    shapes = {n: p.shape for n, p in _model(seed).named_parameters()}
    total = sum(math.prod(s) for s in shapes.values())
    for r, res in enumerate(results):
        what = f"rank {r} of {world_size}, seed {seed}"
        assert res["dtypes"] == ["torch.float32"] and all(res["released"]), what
        assert max(res["buckets"]) > 1 and min(res["buckets"]) == 1, (what, res["buckets"])  # shared and alone
        for step, (norm, params) in enumerate(ref):
            # the gradient's scale (Adam's update hardly sees it): the global norm, over every rank's pieces
            assert res["norms"][step] == pytest.approx(norm, rel=1e-4), (what, step)
            for name, value in params.items():
                # float32 summation order of the gradient average only
                torch.testing.assert_close(res["weights"][step][name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what} step {step} {name}: {m}")
        # 1/N of the optimizer state: AdamW's two moments over this rank's slices (total / N, padded)
        assert res["slice_numel"] - total / world_size < world_size * len(res["buckets"]), (what, res)
        assert res["state_numel"] == 2 * sum(p.numel() for _, p in res["masters"][-1].values()), what
        assert res["lr"] == pytest.approx(ADAMW["lr"] * 0.5), what  # StepLR stepped the pieces' optimizer
    for step in range(STEPS):
        _assembled(results, step, shapes)  # the master pieces are the weights themselves here
    assert sum(sum(p.numel() for _, p in res["masters"][0].values()) for res in results) == total


def test_zero2_bf16_weights_follow_master_adamw():
    seed = secrets.randbelow(2**20)
    world_size = 2
    results = run_ranks(_body, world_size, seed, True, timeout_s=120)
    ref = _reference(seed, bf16=True)
    init = {n: p.detach() for n, p in _model(seed).named_parameters()}
    shapes = {n: p.shape for n, p in init.items()}
    for step, (norm, params) in enumerate(ref):
        for res in results:  # bf16 gradients: the norm to their rounding (measured: 1e-4 to 2e-4)
            assert res["norms"][step] == pytest.approx(norm, rel=2e-3), (seed, step)
        masters = _assembled(results, step, shapes)
        for name, value in params.items():
            what = f"seed {seed} step {step} {name}"
            # The weights: the masters rounded to bf16, identical on every rank.
            for res in results:
                assert torch.equal(res["weights"][step][name], masters[name].bfloat16().float()), what
            # The masters: MasterAdamW's, but for bf16 gradients rounded in another order (each rank's micro-batches
            # accumulated in bf16, then averaged): an element whose gradient is near 0 may move by up to 2 lr more or
            # less; the whole tensor's move agrees to 0.7-1.2% (norm of the difference / norm of the move; 3 seeds).
            # AdamW on the bf16 weights alone (no fp32 master) is 1.0 or more away: it loses the small updates.
            moved = (value - init[name]).norm().item()
            assert (masters[name] - value).norm().item() < 0.1 * moved, (what, moved)
    assert all(res["dtypes"] == ["torch.bfloat16"] and all(res["released"]) for res in results)


def _zero2_step(wrapper, rows: torch.Tensor, rank: int, world_size: int) -> None:
    """One optimizer step of ``wrapper`` on this rank's share of ``rows``."""
    _loss(wrapper, rows.chunk(world_size)[rank]).backward()
    wrapper.finish_gradient_synchronization()
    wrapper.optimizer.step()
    wrapper.optimizer.zero_grad(set_to_none=True)


def _body_resume(rank: int, world_size: int, seed: int) -> dict:
    """bf16 weights: 2 steps, then the model's and the optimizer's state dicts into a fresh wrapper (other initial
    weights), then one more step on both: the fresh one must have taken the fp32 masters, not the bf16 weights."""
    from torch_impl.distributed import ZeRO2

    kwargs = dict(bucket_size_mb=BUCKET_MB, param_dtype=torch.bfloat16, **_adamw(True))
    first = ZeRO2(_model(seed), torch.optim.AdamW, **kwargs)
    tokens = _tokens(seed)
    for rows in tokens[:2]:
        _zero2_step(first, rows, rank, world_size)
    fresh = ZeRO2(_model(seed + 1), torch.optim.AdamW, **kwargs)
    fresh.module.load_state_dict(first.module.state_dict())
    fresh.optimizer.load_state_dict(copy.deepcopy(first.optimizer.state_dict()))  # as read from a file: not shared
    masters_equal = all(torch.equal(a, b) for (_, a), (_, b) in zip(first.named_optimizer_params(),
                                                                    fresh.named_optimizer_params()))
    # The model alone: its masters become its weights, so a step at lr 0 keeps the loaded weights.
    model_only = ZeRO2(_model(seed + 2), torch.optim.AdamW, **kwargs)
    model_only.module.load_state_dict(first.module.state_dict())
    model_only.optimizer.param_groups[0]["lr"] = 0.0
    loaded = [p.detach().clone() for p in first.module.parameters()]
    for wrapper in (first, fresh, model_only):
        _zero2_step(wrapper, tokens[2], rank, world_size)
        wrapper.wait_for_weights()
    return {"masters_equal": masters_equal,
            "weights_equal": all(torch.equal(a, b) for a, b in zip(first.module.parameters(),
                                                                   fresh.module.parameters())),
            "model_only_kept": all(torch.equal(a, b) for a, b in zip(loaded, model_only.module.parameters()))}


def _body_fp32_state(rank: int, world_size: int, seed: int) -> list[str]:
    """The optimizer state's keys after a step with fp32 weights: the pieces are the weights, no master copy."""
    from torch_impl.distributed import ZeRO2

    wrapper = ZeRO2(_model(seed), torch.optim.AdamW, bucket_size_mb=BUCKET_MB, **ADAMW)
    _zero2_step(wrapper, _tokens(seed)[0], rank, world_size)
    return sorted({key for state in wrapper.optimizer.state.values() for key in state})


def test_zero2_bf16_state_dict_carries_the_masters():
    results = run_ranks(_body_resume, 2, secrets.randbelow(2**20), timeout_s=120)
    assert all(res == {"masters_equal": True, "weights_equal": True, "model_only_kept": True}
               for res in results), results
    keys = run_ranks(_body_fp32_state, 2, secrets.randbelow(2**20), timeout_s=120)
    assert keys == [["exp_avg", "exp_avg_sq", "step"]] * 2, keys


def _body_nccl(rank: int, world_size: int, seed: int, comm_dtype: torch.dtype | None, engine: str = "nccl",
               on_cpu: bool = False) -> dict:
    """Two steps of ZeRO-2 on NCCL (the tiny LM on this rank's GPU, fused AdamW), its weights gathered by ``engine``:
    each weight's move against one process's on the whole batch (``on_cpu``: the same on gloo, to try the test
    without GPUs)."""
    from torch_impl.distributed import ZeRO2

    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    model, ref = _model(seed).to(device), _model(seed).to(device)
    model.layers.span = 1
    wrapper = ZeRO2(model, torch.optim.AdamW, bucket_size_mb=BUCKET_MB, comm_dtype=comm_dtype, fused=True,
                    engine=engine, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **ADAMW)
    for rows in _tokens(seed)[:2].to(device):
        _zero2_step(wrapper, rows, rank, world_size)
        _loss(ref, rows).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    wrapper.wait_for_weights()
    weights = dict(model.named_parameters())
    return {n: ((weights[n] - p).norm() / (p - q).norm()).item()
            for (n, p), q in zip(ref.named_parameters(), _model(seed).to(device).parameters())}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")
@pytest.mark.parametrize("engine", ["nccl", "copy_engines"])
@pytest.mark.parametrize("comm_dtype, tolerance", [(None, 1e-3), (torch.bfloat16, 3e-2)])
def test_zero2_on_nccl_matches_single_process(comm_dtype, tolerance, engine):
    """NCCL's reduce-scatter (AVG), then the weights gathered by NCCL in place or by the copy engines into the peers'
    symmetric memory: each weight's move over two steps within float32's (or bf16 gradients') round-off of one
    process's (norm of the difference / norm of the move; on 2 gloo ranks 1e-6 and 3e-3)."""
    seed = secrets.randbelow(2**20)
    for rank, errs in enumerate(run_ranks(_body_nccl, 2, seed, comm_dtype, engine, timeout_s=120, backend="nccl")):
        worst = max(errs, key=errs.get)
        assert errs[worst] < tolerance, (seed, comm_dtype, engine, rank, worst, errs[worst])


def _body_bad_engine(rank: int, world_size: int) -> list[str]:
    """The messages of an engine ZeRO2 and DDPBucketed cannot use here: copy engines on gloo, an unknown name."""
    from torch_impl.distributed import DDPBucketed, ZeRO2

    messages = []
    for engine in ("copy_engines", "ring"):
        for make in (lambda: ZeRO2(_model(0), torch.optim.AdamW, bucket_size_mb=BUCKET_MB, engine=engine, **ADAMW),
                     lambda: DDPBucketed(_model(0), BUCKET_MB, engine=engine)):
            try:
                make()
            except ValueError as err:
                messages.append(str(err))
    return messages


def test_data_parallel_refuses_an_engine_it_cannot_run():
    for messages in run_ranks(_body_bad_engine, 2, timeout_s=120):
        assert len(messages) == 4, messages
        for message, who in zip(messages[:2], ("ZeRO2", "DDPBucketed")):
            assert f"{who} engine='copy_engines' needs NCCL on CUDA devices" in message, message
            assert "use engine='nccl'" in message, message
        for message, who in zip(messages[2:], ("ZeRO2", "DDPBucketed")):
            assert f"{who} engine='ring'; accepted: nccl, copy_engines" in message, message
