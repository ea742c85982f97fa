"""Token batches as torch tensors on a device; the datasets themselves are framework-free (``lm_data``).

* ``batch_at(dataset, starts, context_length, device)``: the windows at ``starts`` (``lm_data.windows_at``) as
  inputs ``x`` and next-token targets ``y``, both ``(B, T)`` int64 on ``device`` (pinned and copied without
  blocking to a GPU).
* ``get_batch(dataset, batch_size, context_length, device, generator)``: CS336's ``get_batch``, ``batch_size``
  random windows (``lm_data.sample_starts`` then ``batch_at``).
* ``validation_batches(dataset, batch_size, context_length, n_batches, device, rank, world_size)``: this
  rank's share of the fixed validation batches (``lm_data.validation_batch_starts``), batch b on rank
  b % world_size.

References: CS336 (Stanford, 2025) assignment 1, section 5.1 (``get_batch``).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from lm_data import sample_starts, validation_batch_starts, windows_at


def batch_at(dataset: np.ndarray, starts: np.ndarray, context_length: int,
             device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Windows ``dataset[s : s + context_length + 1]`` for each start: (inputs, targets), (B, T) int64 each."""
    windows = torch.from_numpy(windows_at(dataset, starts, context_length))  # (B, T + 1)
    device = torch.device(device)
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def get_batch(dataset: np.ndarray, batch_size: int, context_length: int, device: str | torch.device = "cpu",
              generator: np.random.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CS336's ``get_batch``: ``batch_size`` random windows; (inputs, targets), (B, T) int64 on ``device``."""
    generator = generator if generator is not None else np.random.default_rng()
    starts = sample_starts(len(dataset), batch_size, context_length, generator)
    return batch_at(dataset, starts, context_length, device)


def validation_batches(dataset: np.ndarray, batch_size: int, context_length: int, n_batches: int,
                       device: str | torch.device = "cpu", rank: int = 0,
                       world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the first ``n_batches`` validation batches (batch b goes to rank b % world_size);
    the last batch may be short when the split has fewer windows. Same windows at any world size."""
    for starts in validation_batch_starts(len(dataset), batch_size, context_length, n_batches)[rank::world_size]:
        yield batch_at(dataset, starts, context_length, device)
