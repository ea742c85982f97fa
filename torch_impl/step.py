"""One training step, the same for the trainer, the e2e benchmark and the DDP benchmark.

``train_step(parts, micro_batches, mark)`` runs forward (with the loss), backward, the data-parallel wrapper's
gradient synchronization and the optimizer over one or more micro-batches (gradient accumulation, the
wrapper's ``no_sync`` for all but the last), calling ``mark(phase)`` at the end of each phase with the names of
``analysis.records.STEP_PHASES``: forward, backward, comm (only with a wrapper), optimizer. Pass
``torch_impl.timing.PhaseTimer.mark`` to time it without stalling the device; every suite's records then carry
the same phase names. ``StepParts`` holds what the step calls (torchtitan's train step and the CS336 training
loop have the same shape: zero the gradients, forward, backward, clip, step).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from parallelism_calc.compute import MODES  # what a step runs: forward, forward_backward, train_step
from torch_impl.linear_cross_entropy import LOSSES
from torch_impl.model import cross_entropy

# When the optimizer steps: "after" every gradient is synchronized, or "overlapped": a part at a time as the
# data-parallel wrapper's parts land (``finish_in_parts``), where the optimizer can (``MasterAdamW.step_parts``) and
# nothing needs every gradient first (no clipping); the first parts' update then hides the last parts' communication
OPTIMIZER_STEPS = ("overlapped", "after")


def autocast(dtype: str, device: torch.device):
    """bf16 autocast for ``--dtype bf16``; the parameters' own dtype otherwise (fp32, bf16_mixed's bf16)."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class StepParts:
    """What one step calls. ``forward``: the model, or the module its data-parallel wrapper gives;
    ``wrapper``: that ``DataParallelWrapper`` (None: one process, or fsdp2, whose communication sits in the
    backward); ``scheduler`` steps after the optimizer; ``grad_clip`` > 0 clips the global gradient norm (it
    needs the wrapper, which knows how the gradients are spread over the ranks); ``loss_fn`` (logits, targets)
    -> the mean loss, or None: ``forward(inputs, targets)`` returns the loss itself (``TransformerLM(loss=
    "fused")``, whose LM head and loss are fused: no logits; ``for_loss`` picks)."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    dtype: str = "fp32"  # analysis.harness.DTYPES
    wrapper: Any = None
    scheduler: Any = None
    grad_clip: float = 0.0
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = cross_entropy
    optimizer_step: str = "overlapped"  # OPTIMIZER_STEPS

    def __post_init__(self) -> None:
        if self.grad_clip > 0 and self.wrapper is None:
            raise ValueError("StepParts: grad_clip needs the data-parallel wrapper (it computes the global norm)")
        if self.optimizer_step not in OPTIMIZER_STEPS:
            raise ValueError(f"StepParts: optimizer_step {self.optimizer_step!r}; accepted: "
                             f"{', '.join(OPTIMIZER_STEPS)}")

    @property
    def overlapped(self) -> bool:
        """Whether the optimizer steps the wrapper's parts as they land (see ``OPTIMIZER_STEPS``)."""
        return (self.optimizer_step == "overlapped" and self.wrapper is not None and self.grad_clip == 0
                and hasattr(self.optimizer, "step_parts"))


def for_loss(loss: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``StepParts.loss_fn`` for a model built with ``TransformerLM(loss=loss)``: ``cross_entropy`` of the logits
    for "plain", None for "fused" (the model's forward takes the targets)."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r}; accepted: {', '.join(LOSSES)}")
    return None if loss == "fused" else cross_entropy


def _loss(parts: StepParts, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if parts.loss_fn is None:
        return parts.forward(inputs, targets)
    return parts.loss_fn(parts.forward(inputs), targets)


def _no_mark(phase: str) -> None:
    pass


def train_step(parts: StepParts, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
               mark: Callable[[str], None] = _no_mark, mode: str = "train_step"
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step over the micro-batches ((inputs, targets) pairs of token ids): (the mean loss, detached; the
    gradient norm before clipping, or None), both tensors on the device (reading them waits for it). Gradients
    are released (set to None) after the step, so a captured step makes them inside its graph.
    ``mode`` forward runs the forward alone, without gradients; forward_backward stops before the
    synchronization and the optimizer."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; accepted: {', '.join(MODES)}")
    k, wrapper = len(micro_batches), parts.wrapper
    if wrapper is not None:
        wrapper.on_train_batch_start()
    total, norm, landing = None, None, None
    for j, (inputs, targets) in enumerate(micro_batches):
        last = j == k - 1
        with contextlib.nullcontext() if last or wrapper is None else wrapper.no_sync():
            with autocast(parts.dtype, inputs.device), torch.set_grad_enabled(mode != "forward"):
                loss = _loss(parts, inputs, targets) / k
            mark("forward")
            if mode != "forward":
                loss.backward()
                mark("backward")
        if mode == "train_step" and wrapper is not None and (last or wrapper.sync_every_backward):
            if last and parts.overlapped:
                landing = wrapper.finish_in_parts()  # the gradients land as the optimizer steps them
            else:
                wrapper.finish_gradient_synchronization()
            mark("comm")
        total = loss.detach() if total is None else total + loss.detach()
    if mode == "train_step":
        if parts.grad_clip > 0:
            norm = wrapper.clip_grad_norm_(parts.grad_clip)
        if landing is not None:
            parts.optimizer.step_parts(landing)
        else:
            parts.optimizer.step()
        if parts.scheduler is not None:
            parts.scheduler.step()
    if mode != "forward":
        parts.optimizer.zero_grad(set_to_none=True)
    if mode == "train_step":
        mark("optimizer")
    return total, norm
