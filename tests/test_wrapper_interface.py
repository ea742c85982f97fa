"""Every trainer mode's ``DataParallelWrapper`` (``torch_impl.distributed.interface``), as
``torch_impl.parallelize.apply_data_parallel`` returns it: ``none`` in this process, the others on 2 gloo ranks.

Each wrapper must have every method and attribute of the interface, callable; one optimizer step over 2
micro-batches driven only through it (``on_train_batch_start``, ``no_sync`` on the first micro-batch,
``finish_gradient_synchronization`` as ``sync_every_backward`` says) must give the global batch's gradient norm
(``grad_norm_squared``, ``clip_grad_norm_``) and parameters (``gather_full_params``) of a plain single-process
step; ``eval_module`` must run; ``shard_of`` must say where each parameter lies in its full tensor (None for every
parameter unless ``sharded_state``; else the full weight's flat slice at its offset, as ``gather_full_params``
gives it: what checkpoints save and load by, ``tests/test_checkpoint.py``). Fresh seed per run, printed in the
messages; tiny model, fp32.
"""

from __future__ import annotations

import contextlib
import secrets

import torch

from parallelism_calc.specs import MODELS
from tests._dist import run_ranks
from torch_impl.distributed import DataParallelWrapper
from torch_impl.model import TransformerLM, cross_entropy
from torch_impl.parallelize import apply_data_parallel
from torch_impl.train import DIST_MODES

SPEC = MODELS["tiny"]
ROWS, SEQ, ACCUM = 4, 16, 2  # global batch rows, tokens per row, micro-batches per rank
ADAMW = dict(lr=1e-3, eps=1e-4, weight_decay=0.0, fused=False)
METHODS = ("on_train_batch_start", "no_sync", "finish_gradient_synchronization", "gather_full_params",
           "grad_norm_squared", "clip_grad_norm_", "shard_of")


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _step(rank: int, world_size: int, seed: int, mode: str) -> dict:
    torch.manual_seed(seed)
    forward, wrapper, optimizer = apply_data_parallel(TransformerLM(SPEC), mode, bucket_mb=0.01, adamw=ADAMW)
    assert isinstance(wrapper, DataParallelWrapper), mode
    assert all(callable(getattr(wrapper, name)) for name in METHODS), mode
    assert isinstance(wrapper.eval_module, torch.nn.Module) and isinstance(wrapper.module, torch.nn.Module)
    tokens = _batch(seed).chunk(world_size)[rank].chunk(ACCUM)  # this rank's rows, as micro-batches
    wrapper.on_train_batch_start()
    for j, micro in enumerate(tokens):
        last = j == len(tokens) - 1
        with contextlib.nullcontext() if last else wrapper.no_sync():
            (cross_entropy(forward(micro[:, :-1]), micro[:, 1:]) / len(tokens)).backward()
        if last or wrapper.sync_every_backward:
            wrapper.finish_gradient_synchronization()
    norm_sq = wrapper.grad_norm_squared().item()
    norm = wrapper.clip_grad_norm_(1e9).item()  # a bound above the norm: no clipping
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = wrapper.eval_module(tokens[0][:, :-1])  # (B, T, V)
    full = {k: v.detach().clone() for k, v in wrapper.gather_full_params().items()}
    for name, p in wrapper.module.named_parameters():
        layout = wrapper.shard_of(p)
        assert (layout is not None) == (wrapper.sharded_state and p.dim() == 1 and full[name].dim() == 2), (mode, name)
        if layout is not None:  # this rank's slice of the flattened full weight (padding past its end)
            shape, start = layout
            assert shape == full[name].shape, (mode, name)
            piece = full[name].reshape(-1)[start:start + p.numel()]
            assert torch.equal(p.detach()[:piece.numel()], piece), (mode, name)
    return {"norm_sq": norm_sq, "norm": norm, "params": full, "logits": tuple(logits.shape),
            "mesh_axis": wrapper.mesh_axis, "sync_every_backward": wrapper.sync_every_backward,
            "sharded_state": wrapper.sharded_state}


def _ranks_body(rank: int, world_size: int, seed: int) -> dict:
    return {mode: _step(rank, world_size, seed, mode) for mode in DIST_MODES if mode != "none"}


def _reference(seed: int) -> dict:
    torch.manual_seed(seed)
    model = TransformerLM(SPEC)
    tokens = _batch(seed)
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    norm_sq = sum(p.grad.double().pow(2).sum() for p in model.parameters()).item()
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    return {"norm_sq": norm_sq, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def test_every_mode_implements_the_interface():
    seed = secrets.randbelow(2**31)
    ref = _reference(seed)
    results = {"none": [_step(0, 1, seed, "none")]}
    ranks = run_ranks(_ranks_body, 2, seed, timeout_s=180, pg_timeout_s=60)
    results.update({mode: [r[mode] for r in ranks] for mode in ranks[0]})
    assert set(results) == set(DIST_MODES)
    for mode, per_rank in results.items():
        for rank, out in enumerate(per_rank):
            what = f"{mode} rank {rank}, seed {seed}"
            fsdp = mode == "fsdp"
            assert (out["mesh_axis"], out["sync_every_backward"], out["sharded_state"]) == (
                ("fsdp", True, True) if fsdp else ("dp", False, False)), what
            assert abs(out["norm_sq"] - ref["norm_sq"]) <= 1e-4 * ref["norm_sq"], (what, out["norm_sq"], ref)
            assert abs(out["norm"] ** 2 - out["norm_sq"]) <= 1e-5 * out["norm_sq"], what
            assert out["logits"] == (ROWS // len(per_rank) // ACCUM, SEQ, SPEC.vocab_size), what
            assert set(out["params"]) == set(ref["params"]), what
            for name, value in ref["params"].items():
                torch.testing.assert_close(out["params"][name], value, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{what} {name}: {m}")
