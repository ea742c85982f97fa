"""``DataParallelWrapper``: all the trainer needs of a data-parallel mode, in one place, so its loop has no branches.

``torch_impl.parallelize.apply_data_parallel`` returns one for every mode but fsdp2: our DDP family (ZeRO-1 is
``DDPBucketed`` with a ``ShardedOptimizer``) and ``FSDP`` subclass it; ``SingleProcess`` (``none``) and
``TorchDDP`` adapt the rest. The defaults are a replicated model's, whose gradients are full and averaged after
``finish_gradient_synchronization()``; ``FSDP`` overrides the class attributes, ``eval_module``,
``gather_full_params`` and ``shard_of`` (where a parameter lies in its full tensor: what ``torch_impl.checkpoint``
saves and loads by); ``ZeRO2``, whose weights are replicated and whose optimizer steps this rank's pieces of them,
``named_optimizer_params`` and ``shard_of``. The step that calls it: ``torch_impl.step.train_step``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch_impl.optim import Part


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the squares of every element (fp32), norms taken in at least fp32 with one multi-tensor launch per
    dtype: a launch or three per parameter took ~40 ms of host time a step at xl (notes/train_step.md)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    return sum(torch.stack(torch._foreach_norm(same, 2, dtype=torch.promote_types(dtype, torch.float32)))
               .float().square().sum() for dtype, same in by_dtype.items())


class DataParallelWrapper:
    """``module``: the bare model. ``mesh_axis``: the records' mesh name. ``sync_every_backward``: FSDP lands its
    reduce-scatters after every backward (it has no ``no_sync``). ``sharded_state``: the parameters (and their
    optimizer state) are per-rank shards; ``shard_of`` says where each lies in its full tensor."""

    mesh_axis, sync_every_backward, sharded_state = "dp", False, False
    _shard_ids: set[int] | frozenset[int] = frozenset()  # ids of this rank's parameter shards (FSDP's)
    process_group: dist.ProcessGroup | None = None
    module: torch.nn.Module

    def on_train_batch_start(self) -> None:
        """Before an optimizer step's first forward."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backwards inside accumulate their gradients locally (those of all micro-batches but the last)."""
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient communication: gradients are then averaged over the ranks (or sharded)."""

    def finish_in_parts(self) -> list[Part] | None:
        """``finish_gradient_synchronization`` without waiting: the gradients land in parts (``torch_impl.optim.Part``),
        in the order returned: ``ready()`` makes the current stream wait for the part's gradients. Without
        ``Part.terms`` every ``.grad`` is already the tensor its average will land in; with them (``DDPBucketed(
        mean="optimizer")``) the average is ``mean_of`` each parameter's terms, which its reader must compute
        (``MasterAdamW.step_parts`` does). Call every ``ready`` before reading the gradients. None: the gradients are
        all synchronized already (this default)."""
        self.finish_gradient_synchronization()
        return None

    @property
    def eval_module(self) -> torch.nn.Module:
        """What evaluation calls: the bare model."""
        return self.module

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter, full, keyed like ``module.named_parameters()`` (here the live ones)."""
        return dict(self.module.named_parameters())

    def named_optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what the optimizer steps, named as the bare model's parameters: those parameters
        (FSDP's shards), or ZeRO-2's pieces of them; the gradients are theirs."""
        return list(self.module.named_parameters())

    def grad_norm_squared(self) -> torch.Tensor:
        """The squared 2-norm (fp32) of the whole synchronized gradient: this rank's shards' squares summed over
        the ranks, the replicated parameters' (identical everywhere) counted once."""
        groups: tuple[list, list] = ([], [])  # (sharded, replicated) gradients
        for _, p in self.named_optimizer_params():
            if p.grad is not None:
                groups[0 if id(p) in self._shard_ids else 1].append(p.grad.detach())
        device = next(self.module.parameters()).device
        squares = torch.stack([_squares(g) if g else torch.zeros((), device=device) for g in groups])
        if self._shard_ids and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            dist.all_reduce(squares[:1], group=self.process_group)  # in place: a view of the sharded square
        return squares.sum()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / (global norm + 1e-6)); returns the global norm before."""
        norm = self.grad_norm_squared().sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for _, p in self.named_optimizer_params() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
        return norm

    def shard_of(self, param: torch.Tensor) -> tuple[torch.Size, int] | None:
        """Where ``param`` (a tensor of ``module``'s) lies in the full tensor it stands for: None when it is the
        full tensor (replicated); else (the full shape, the offset of its first element) for a 1-D shard of the
        flattened full tensor (elements past the full tensor's end are padding). Checkpoints save and load by it,
        so that any world size reads them (``torch_impl.checkpoint``)."""
        return None


class SingleProcess(DataParallelWrapper):
    """``none``: one process, nothing to synchronize."""

    def __init__(self, module: torch.nn.Module):
        self.module = module


class TorchDDP(DataParallelWrapper):
    """torch's ``DistributedDataParallel``: its hooks reduce inside the backward; its own ``no_sync``."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel):
        self.module, self.no_sync = ddp.module, ddp.no_sync
