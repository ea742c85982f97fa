"""Training checkpoints saved atomically by every rank of a job: shared state from rank 0, per-rank state each.

Layout of a checkpoint folder::

    DIR/latest                  the name of the newest complete checkpoint ("step-00000120")
    DIR/step-00000120/shared.pt rank 0: what every rank holds alike (full model, consolidated optimizer, ...)
    DIR/step-00000120/rank-00001.pt   rank 1: what only it holds (RNG states, FSDP shards, ...)

``save_checkpoint(directory, step, shared, local, rank=, world_size=)`` (a collective when the world size is
above 1): rank 0 makes ``step-N.tmp/``; every rank writes its file there (``torch.save`` to a temporary name,
then ``os.replace``); after a barrier rank 0 renames the folder to ``step-N`` and then points ``latest`` at it
(again a temporary file and ``os.replace``), and removes older checkpoints beyond ``keep``: by step number,
counting the one just saved, which always survives. Steps numbered above it are an earlier, longer run's in the
same folder (a run counts up): they are left alone and named on stderr, ``latest`` names the step just saved, and
the new run replaces them as it reaches their step numbers. A job killed at any moment leaves ``latest`` naming a
complete checkpoint (or no ``latest`` at all), never a partial one.
``load_checkpoint(directory, rank)`` reads the one ``latest`` names: ``shared`` and this rank's ``local``
(None when the checkpoint was written by fewer ranks); a file that cannot be read or a rank's file missing is
a ValueError naming it.

``capture_rng()`` / ``restore_rng(state)``: Python's ``random``, numpy's global generator, torch's CPU
generator and every CUDA device's, so a resumed run draws what the uninterrupted one would have.

Caveats: all ranks must see one file system (one node, or a shared one). Files are loaded with
``torch.load(weights_only=False)``, because they hold numpy and Python RNG states: load only checkpoints you
wrote. What goes into ``shared`` / ``local`` is the trainer's business (``torch_impl.train``).
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"
SHARED = "shared.pt"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _save_atomically(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _step_of(folder: Path) -> int | None:
    """The step number of a checkpoint folder ``step-N``; None for anything else (``.tmp`` staging, other names)."""
    match = re.fullmatch(r"step-(\d+)", folder.name)
    return int(match.group(1)) if match and folder.is_dir() else None


def _prune(root: Path, step: int, keep: int) -> None:
    """Remove checkpoints numbered up to ``step`` (just saved) beyond the ``keep`` highest; never higher ones."""
    steps = sorted((n, p) for p in root.iterdir() if (n := _step_of(p)) is not None)
    for old in [p for n, p in steps if n <= step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    later = [p.name for n, p in steps if n > step]
    if later:
        print(f"checkpoint: kept {', '.join(later)} in {root}, from an earlier run (above step {step}); "
              f"{LATEST!r} names {_step_name(step)}", file=sys.stderr, flush=True)


def save_checkpoint(directory: str | os.PathLike, step: int, shared: dict | None, local: dict, *, rank: int = 0,
                    world_size: int = 1, keep: int = 2) -> Path:
    """Write checkpoint ``step`` (see the module docstring); ``shared`` is used on rank 0 only. Collective."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    root = Path(directory)
    final = root / _step_name(step)
    staging = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a job killed while saving
        staging.mkdir()
    _barrier(world_size)
    if rank == 0:
        _save_atomically({**shared, "world_size": world_size, "step": step}, staging / SHARED)
    _save_atomically(local, staging / _rank_file(rank))
    _barrier(world_size)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a rerun)
        os.replace(staging, final)
        _write_text_atomically(root / LATEST, final.name)
        _prune(root, step, keep)
    _barrier(world_size)
    return final


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The folder ``latest`` names, or None if there is no complete checkpoint."""
    pointer = Path(directory) / LATEST
    if not pointer.exists():
        return None
    folder = Path(directory) / pointer.read_text().strip()
    return folder if (folder / SHARED).exists() else None


@dataclass
class Checkpoint:
    path: Path
    shared: dict
    local: dict | None  # None: this rank has no file (the checkpoint was written by fewer ranks)

    @property
    def world_size(self) -> int:
        return self.shared["world_size"]


def load_checkpoint(directory: str | os.PathLike, rank: int = 0) -> Checkpoint:
    """The latest checkpoint's shared state and this rank's own (a ValueError if there is none)."""
    folder = latest_checkpoint(directory)
    if folder is None:
        raise ValueError(f"no checkpoint in {directory} (no {LATEST!r} naming a complete step-* folder)")
    shared = _load(folder / SHARED)
    if not isinstance(shared, dict) or not isinstance(shared.get("world_size"), int):
        raise ValueError(f"{folder / SHARED}: not a checkpoint of this trainer (no world size)")
    missing = [_rank_file(r) for r in range(shared["world_size"]) if not (folder / _rank_file(r)).is_file()]
    if missing:
        raise ValueError(f"checkpoint {folder} is incomplete: {', '.join(missing)} missing (it was written by "
                         f"{shared['world_size']} ranks, each with its own file)")
    path = folder / _rank_file(rank)
    return Checkpoint(folder, shared, _load(path) if path.exists() else None)


def _load(path: Path) -> Any:
    """One checkpoint file; a ValueError naming it if it is not one (random bytes, cut short)."""
    try:
        # Our own files: they hold numpy / Python RNG states, which weights_only=True refuses.
        return torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, EOFError, RuntimeError, AttributeError, ImportError, IndexError,
            KeyError, TypeError, UnicodeDecodeError) as err:  # what torch.load raises on bytes it cannot read
        raise ValueError(f"{path}: not a readable checkpoint file ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else 'cut short'})") from None


def capture_rng() -> dict[str, Any]:
    """The states of Python's, numpy's (global), torch's CPU and every CUDA device's generators."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
