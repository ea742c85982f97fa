"""ZeRO stage 1 by hand: ``ShardedOptimizer`` shards the optimizer state over the data-parallel ranks.

``ShardedOptimizer(params, optimizer_cls, **kwargs)`` is a ``torch.optim.Optimizer`` (param groups with their
own options, ``add_param_group``, ``zero_grad``, ``state_dict`` / ``load_state_dict``, lr schedulers). Every
parameter gets one owner rank, assigned greedily by size (largest first, each to the least-loaded rank;
ties go to the lower rank, and equal sizes keep their order, so every rank computes the same assignment
without talking). Each rank builds one inner ``optimizer_cls(..., **kwargs)`` over the parameters it owns,
with one inner group per outer group, so it holds ~1/N of the optimizer state (AdamW: m and v). Gradients
must already be averaged over the ranks when ``step()`` runs (a DDP wrapper, or a plain all-reduce);
``step()`` copies the outer groups' options (an lr scheduler's ``lr``...) into the inner groups, runs the
inner step on the owned parameters, then every owner broadcasts its updated parameters: the large ones
(>= 2^20 elements) in place, the small ones packed per (owner, dtype, device) into one buffer each, so no
step-time copy of the whole model is made; all are issued asynchronously and waited together. After
``step()`` every rank holds the same, updated, full parameters.

State dict format (a choice): ``state_dict()`` is a *collective* (every rank must call it) and returns, on
every rank, the full consolidated state in exactly the format ``optimizer_cls`` over all the parameters
would produce: ``{"state": {global_index: {...}}, "param_groups": [{options..., "params": [indices]}]}``
with indices numbering the parameters in group order. Tensors in it are on the CPU. It does not depend on
the world size: a checkpoint written by 2 ranks loads into 4 ranks, into one process, or into a plain
``optimizer_cls``; ``load_state_dict`` (not a collective) keeps the entries of the parameters this rank
owns and hands them to the inner optimizer, which moves them to each parameter's device and dtype. The
cost is one ``all_gather_object`` of the whole state at checkpoint time (every rank briefly holds all of it
on the CPU), which is fine for checkpoints and never happens in a training step.

Caveats: every rank must pass the same parameters in the same order with the same shapes (the assignment
is computed independently on each). ``step()`` is a collective too. A closure is evaluated once, locally.
Without an initialized process group it runs as a single process (world size 1) and equals the inner optimizer.

References: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(stage 1: optimizer state partitioning, the P_os term); PyTorch's ``ZeroRedundancyOptimizer`` (same idea,
with a consolidate-to-one-rank state dict); CS336 (Stanford, 2025) assignment 2, optimizer state sharding.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist


def _world(process_group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _to_cpu(value: Any) -> Any:
    """A copy of an optimizer-state value with every tensor detached on the CPU (picklable anywhere)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: ``optimizer_cls`` with its state sharded over the ranks (see the module docstring).

    ``params``: parameters or param-group dicts, as for any optimizer; ``optimizer_cls``: e.g.
    ``torch.optim.AdamW``; ``**kwargs``: its default options (``lr=``, ``weight_decay=``...).
    ``process_group`` (keyword only, not forwarded): the group to shard over (default: the world).
    """

    BROADCAST_INPLACE_NUMEL = 1 << 20  # parameters at least this large are broadcast without a copy

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict],
                 optimizer_cls: Callable[..., torch.optim.Optimizer], *,
                 process_group: dist.ProcessGroup | None = None, **kwargs: Any):
        self.optimizer_cls = optimizer_cls
        self.process_group = process_group
        self.rank, self.world_size = _world(process_group)
        self._loads = [0] * self.world_size  # elements owned per rank (the greedy assignment's bins)
        self._owner: dict[torch.Tensor, int] = {}  # parameter -> owning rank
        self.inner: torch.optim.Optimizer | None = None  # this rank's optimizer over its own parameters
        super().__init__(params, defaults=dict(kwargs))  # calls add_param_group once per group
        self.state = self.inner.state  # the optimizer state this rank holds: its own parameters' only

    # ------------------------------------------------------------------------------------------------
    # Param groups and ownership

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated and filled with defaults by ``Optimizer``), assign owners to its parameters
        greedily by size, and add the owned ones to the inner optimizer as a group with the same options."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = group["params"]
        # Largest first; sorted() is stable, so equal sizes keep their order on every rank.
        for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
            rank = min(range(self.world_size), key=lambda r: (self._loads[r], r))
            self._owner[params[i]] = rank
            self._loads[rank] += params[i].numel()
        mine = [p for p in params if self._owner[p] == self.rank]
        options = {k: v for k, v in group.items() if k != "params"}
        if self.inner is None:
            # An empty first group is fine: torch rejects an empty list of groups, not an empty group.
            self.inner = self.optimizer_cls([{"params": mine, **options}], **self.defaults)
        else:
            self.inner.add_param_group({"params": mine, **options})
        # Show the inner optimizer's own defaults (betas, eps...) in the outer group, as a plain one would.
        for key, value in self.inner.param_groups[-1].items():
            if key != "params":
                group.setdefault(key, value)

    def owner(self, param: torch.Tensor) -> int:
        """The rank that holds ``param``'s optimizer state and updates it."""
        return self._owner[param]

    @property
    def owned_numel(self) -> list[int]:
        """Elements of parameters owned by each rank (the balance of the assignment)."""
        return list(self._loads)

    # ------------------------------------------------------------------------------------------------
    # Step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """Inner step on this rank's parameters, then broadcast every parameter from its owner."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value  # schedulers and users edit the outer groups
        self.inner.step()
        self._broadcast_params()
        return loss

    def _broadcast_params(self) -> None:
        """Every owner sends its updated parameters: a large parameter (>= ``BROADCAST_INPLACE_NUMEL``
        elements) is broadcast in place, small ones are packed per (owner, dtype, device) into one flat
        buffer each, so the extra memory stays small (no step-time copy of the whole model)."""
        if self.world_size == 1:
            return
        flats: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        pending = []
        for group in self.param_groups:  # same order on every rank, so the collectives line up
            for p in group["params"]:
                owner = self._owner[p]
                if p.numel() >= self.BROADCAST_INPLACE_NUMEL and p.is_contiguous():
                    pending.append((self._broadcast(p.detach(), owner), owner, None, None))
                else:
                    flats[(owner, p.dtype, p.device)].append(p)
        for (owner, dtype, device), params in flats.items():
            if owner == self.rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            pending.append((self._broadcast(flat, owner), owner, flat, params))
        for work, owner, flat, params in pending:
            work.wait()
            if params is not None and owner != self.rank:
                offset = 0
                for p in params:
                    p.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _broadcast(self, tensor: torch.Tensor, owner: int):
        src = owner if self.process_group is None else dist.get_global_rank(self.process_group, owner)
        return dist.broadcast(tensor, src=src, group=self.process_group, async_op=True)

    # ------------------------------------------------------------------------------------------------
    # State dict: consolidated, world-size independent (see the module docstring)

    def _global_index(self) -> dict[torch.Tensor, int]:
        index: dict[torch.Tensor, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(p, len(index))
        return index

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Collective: the full optimizer state, as ``optimizer_cls`` over all parameters would give it (CPU)."""
        index = self._global_index()
        local = {index[p]: _to_cpu(s) for p, s in self.inner.state.items() if s}
        if self.world_size > 1:
            shards: list[Any] = [None] * self.world_size
            dist.all_gather_object(shards, local, group=self.process_group)
        else:
            shards = [local]
        state: dict[int, Any] = {}
        for shard in shards:
            state.update(shard)
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[p] for p in group["params"]]
            groups.append(packed)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a consolidated state dict (from ``state_dict()`` at any world size, or from ``optimizer_cls``);
        this rank keeps the state of the parameters it owns. Not a collective."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        inner_groups, inner_state = [], {}
        inner_index = 0
        for g, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"param group {g}: state dict has {len(saved['params'])} parameters, "
                                 f"this optimizer {len(group['params'])}")
            options = {k: v for k, v in saved.items() if k != "params"}
            group.update(options)
            ids = []
            for p, saved_id in zip(group["params"], saved["params"]):
                if self._owner[p] != self.rank:
                    continue
                if saved_id in state_dict["state"]:
                    inner_state[inner_index] = state_dict["state"][saved_id]
                ids.append(inner_index)
                inner_index += 1
            inner_groups.append({**options, "params": ids})
        # The inner optimizer validates sizes, deep-copies, and casts each tensor to its parameter's device.
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.state = self.inner.state

    def __repr__(self) -> str:
        return (f"ShardedOptimizer({self.optimizer_cls.__name__}, rank {self.rank}/{self.world_size}, "
                f"owned elements per rank {self._loads})")
