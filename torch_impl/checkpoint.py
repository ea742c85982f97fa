"""Training checkpoints in ``torch.distributed.checkpoint`` (DCP) format: atomic, and readable at any world size.

Layout of a checkpoint folder (DCP's files inside a step folder)::

    DIR/latest                           the name of the newest complete checkpoint ("step-00000120")
    DIR/step-00000120/.metadata          DCP's index: every entry's full shape and dtype, and where its chunks lie
    DIR/step-00000120/__0_0.distcp ...   the chunks, one file per rank that wrote some

What a checkpoint holds, as logical entries that do not depend on the topology (torchtitan's choice): every tensor
is the *full* tensor under its name, whichever rank holds which part of it, so any world size and any of the
trainer's data-parallel modes loads what any other saved::

    model.<name>             an entry of the bare model's ``state_dict()``, full shape
    optim.<name>.<key>       the optimizer state of parameter <name> (AdamW: exp_avg, exp_avg_sq, step;
                             ``MasterAdamW`` also master), full shape
    optim_groups             the optimizer's param groups: options and parameter names
    trainer                  the caller's own objects (settings, schedule, data position: ``torch_impl.train``)
    checkpoint               step, world size and format version
    rng.<rank>               each rank's RNG states (``capture_rng``)

Who writes what: a replicated tensor (DDP's parameters, every rank's alike) is written once (DCP's deduplication);
ZeRO-1's optimizer state by the rank that owns the parameter; our FSDP's parameters and their AdamW moments, which
are 1-D shards of the flattened, padded weight (``FSDP``), as the boxes of the full weight that each shard covers (a
flat range of a row-major matrix: a partial row, whole rows, a partial row), with their global offsets. Loading
is the same in reverse: each rank asks for the boxes it holds now (``DataParallelWrapper.shard_of`` says which) and
DCP reads them from whatever chunks overlap, in place into the live parameters; the optimizer state is read into
new tensors and handed to ``optimizer.load_state_dict``. Two custom DCP planners (``_SavePlanner``,
``_LoadPlanner``) add these boxes to DCP's default plans; everything else (pickled objects, deduplication,
resharding reads, the files) is DCP's own. torch's ``get_state_dict`` / ``set_state_dict`` do not fit: they would
save our FSDP's 1-D shards as if replicated, and ZeRO-1's ``state_dict()`` gathers the whole state on every rank.

``save_checkpoint(directory, step, wrapper, optimizer, trainer=..., keep=2)`` (a collective when a process group
is initialized): rank 0 makes ``step-N.tmp/``; DCP writes into it (every rank its chunks, rank 0 the metadata);
after a barrier rank 0 renames the folder to ``step-N`` and then points ``latest`` at it (a temporary file and
``os.replace``), and removes older checkpoints beyond ``keep``: by step number, counting the one just saved, which
always survives. Steps numbered above it are an earlier, longer run's in the same folder (a run counts up): they
are left alone and named on stderr, ``latest`` names the step just saved, and the new run replaces them as it
reaches their step numbers. A job killed at any moment, or a save that fails on any rank, leaves ``latest``
naming a complete checkpoint (or no ``latest`` at all), never a partial one; the next save clears the staging
folder. ``read_checkpoint(directory)`` (collective) reads the latest's small objects (``Checkpoint``: step, world
size, ``trainer``, this rank's RNG states: rank 0's for a rank the saving run did not have), so the caller can
check its settings before ``load_train_state(checkpoint, wrapper, optimizer)`` (collective) loads the tensors.
A checkpoint of this trainer's earlier format (``shared.pt`` and ``rank-NNNNN.pt``), a folder without DCP metadata,
unreadable metadata or a chunk file missing is a one-line ValueError naming it.

``capture_rng()`` / ``restore_rng(state)``: Python's ``random``, numpy's global generator, torch's CPU
generator and every CUDA device's, so a resumed run draws what the uninterrupted one would have.

Caveats: all ranks must see one file system (one node, or a shared one). DCP unpickles the metadata and the
objects (``torch.load(weights_only=False)``: they hold numpy and Python RNG states): load only checkpoints you
wrote. Names are the bare model's (``wrapper.module``), so they do not change with the mode or ``--compile``.
The optimizer's param-group options are restored as saved (as ``load_state_dict`` does), implementation flags
such as ``fused`` included.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torch_impl.distributed.zero import ShardedOptimizer

LATEST = "latest"
METADATA = ".metadata"  # DCP's index file in a checkpoint folder
FORMAT = 2  # 1 was this trainer's own (shared.pt and rank-NNNNN.pt)
OLD_FILES = ("shared.pt", "rank-00000.pt")  # what format 1 left in a step folder


# ----------------------------------------------------------------------------- entries: full tensors, held in boxes


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the boxes that tile elements [start, stop) of a row-major tensor of ``shape``, in order:
    each box's elements are consecutive in the flattened tensor (a partial row, whole rows, a partial row)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape))]
    inner = math.prod(shape[1:])  # elements of one row
    first, end = -(-start // inner), stop // inner  # the whole rows: [first, end)

    def part(row: int, lo: int, hi: int) -> list:  # elements [lo, hi) of one row
        return [((row, *o), (1, *s)) for o, s in _boxes(shape[1:], lo - row * inner, hi - row * inner)]

    if first > end:  # inside one row
        return part(end, start, stop)
    head = part(first - 1, start, first * inner) if start < first * inner else []
    whole = [((first, *[0] * (len(shape) - 1)), (end - first, *shape[1:]))] if end > first else []
    return head + whole + (part(end, end * inner, stop) if stop > end * inner else [])


@dataclass
class _Entry:
    """A full tensor of ``shape`` of which this rank holds ``pieces``: {offsets: a view of that box}."""

    shape: torch.Size
    pieces: dict[torch.Size, torch.Tensor]

    @property
    def properties(self) -> TensorProperties:
        return TensorProperties.create_from_tensor(next(iter(self.pieces.values())))


def _entry(tensor: torch.Tensor, layout: tuple[torch.Size, int] | None) -> _Entry:
    """``tensor`` as boxes of the full tensor it stands for: the whole of it (``layout`` None), or (full shape,
    offset) for a 1-D shard of the flattened full tensor (padding past its end ignored)."""
    if layout is None:
        return _Entry(tensor.shape, {torch.Size([0] * tensor.dim()): tensor})
    shape, start = layout
    flat = tensor.view(-1)
    pieces, pos = {}, 0
    for offsets, sizes in _boxes(tuple(shape), start, min(start + flat.numel(), math.prod(shape))):
        n = math.prod(sizes)
        pieces[torch.Size(offsets)] = flat[pos:pos + n].view(sizes)
        pos += n
    return _Entry(torch.Size(shape), pieces)


def _names(wrapper) -> dict[int, str]:
    """The optimizer's parameters (the model's, FSDP's shards, ZeRO-2's pieces) by the model's names."""
    return {id(p): name for name, p in wrapper.named_optimizer_params()}


def _holds_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether this rank keeps ``param``'s optimizer state: ZeRO-1 on its owner only, other optimizers everywhere."""
    return not isinstance(optimizer, ShardedOptimizer) or optimizer.owner(param) == optimizer.rank


def _optim_params(wrapper, optimizer) -> list[tuple[str, torch.Tensor]]:
    names = _names(wrapper)
    return [(names[id(p)], p) for group in optimizer.param_groups for p in group["params"]]


def _model_entries(wrapper) -> dict[str, _Entry]:
    """The bare model's state dict, in place (views of the live tensors, FSDP's shards as their boxes)."""
    return {f"model.{name}": _entry(t.detach(), wrapper.shard_of(t))
            for name, t in wrapper.module.state_dict(keep_vars=True).items()}


def _optimizer_entries(wrapper, optimizer) -> tuple[dict[str, _Entry], dict[str, Any]]:
    """(tensor entries, other objects) of the optimizer state this rank holds; a state tensor shaped like its
    parameter is laid out like it (FSDP's moments are shards too)."""
    entries, objects = {}, {}
    for name, p in _optim_params(wrapper, optimizer):
        for key, value in (optimizer.state.get(p) or {}).items():
            if isinstance(value, torch.Tensor):
                layout = wrapper.shard_of(p) if value.shape == p.shape else None
                entries[f"optim.{name}.{key}"] = _entry(value.detach(), layout)
            else:
                objects[f"optim.{name}.{key}"] = value
    return entries, objects


def _groups(wrapper, optimizer) -> list[dict[str, Any]]:
    names = _names(wrapper)
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups]


# ----------------------------------------------------------------------------- DCP planners for the boxes


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner for the objects, plus one write item per box of ``entries``."""

    def __init__(self, entries: dict[str, _Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries

    def create_local_plan(self):
        plan = super().create_local_plan()
        boxes = [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, view.shape),
                                                       properties=entry.properties, size=entry.shape))
                 for fqn, entry in self.entries.items() for offsets, view in entry.pieces.items()]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *boxes])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        entry = self.entries.get(index.fqn)
        return super().lookup_object(index) if entry is None else entry.pieces[index.offset]


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for the objects, plus the reads that fill each box of ``entries``."""

    def __init__(self, entries: dict[str, _Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries

    def create_local_plan(self):
        plan = super().create_local_plan()
        reads = [item for fqn, entry in self.entries.items() for item in create_read_items_for_chunk_list(
            fqn, self.metadata.state_dict_metadata[fqn],
            [ChunkStorageMetadata(offsets, view.shape) for offsets, view in entry.pieces.items()])]
        return dataclasses.replace(plan, items=[*plan.items, *reads])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        entry = self.entries.get(index.fqn)
        return super().lookup_tensor(index) if entry is None else entry.pieces[index.offset]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _dcp(call, folder: Path, objects: dict[str, Any], planner) -> None:
    """``dcp.save`` / ``dcp.load`` of ``objects`` (and the planner's entries) in ``folder``; a failure on any rank
    (DCP's ``CheckpointException``, a ``BaseException``) becomes a one-line RuntimeError on every rank."""
    storage = ({"storage_writer": dcp.FileSystemWriter(folder)} if call is dcp.save
               else {"storage_reader": dcp.FileSystemReader(folder)})
    try:
        with warnings.catch_warnings():  # one process without a group: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            call(objects, planner=planner, no_dist=not _distributed(), **storage)
    except CheckpointException as err:
        exc = next(iter(err.failures.values()))[0]
        what = "save" if call is dcp.save else "load"
        raise RuntimeError(f"checkpoint {what} in {folder} failed on rank(s) {sorted(err.failures)}: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


# ----------------------------------------------------------------------------- folders


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _barrier() -> None:
    if _distributed() and dist.get_world_size() > 1:
        dist.barrier()


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


def save_checkpoint(directory: str | os.PathLike, step: int, wrapper=None, optimizer=None, *,
                    trainer: dict | None = None, keep: int = 2) -> Path:
    """Write checkpoint ``step`` of ``wrapper``'s model (a ``DataParallelWrapper``), ``optimizer``'s state, the
    caller's ``trainer`` objects and every rank's RNG states (see the module docstring). Collective."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    rank, world_size = _rank_and_world()
    root = Path(directory)
    final = root / _step_name(step)
    staging = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a job killed while saving
        staging.mkdir()
    _barrier()
    entries: dict[str, _Entry] = {}
    objects: dict[str, Any] = {"checkpoint": {"format": FORMAT, "step": step, "world_size": world_size},
                               "trainer": trainer or {}, f"rng.{rank}": capture_rng()}
    if wrapper is not None:
        entries.update(_model_entries(wrapper))
    if optimizer is not None:
        optim, other = _optimizer_entries(wrapper, optimizer)
        entries.update(optim)
        objects.update(other, optim_groups=_groups(wrapper, optimizer))
    _dcp(dcp.save, staging, objects, _SavePlanner(entries))  # ends with a collective: every rank's chunks written
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # the same step saved again (a rerun)
        os.replace(staging, final)
        _write_text_atomically(root / LATEST, final.name)
        _prune(root, step, keep)
    _barrier()
    return final


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The folder ``latest`` names, or None if there is no complete checkpoint."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    folder = Path(directory) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def _metadata(folder: Path) -> Metadata:
    """DCP's index of ``folder``, checked: a ValueError naming what is wrong (old format, unreadable, incomplete)."""
    if not (folder / METADATA).is_file():
        if any((folder / name).is_file() for name in OLD_FILES):
            raise ValueError(f"{folder}: a checkpoint in this trainer's old format (shared.pt, rank-NNNNN.pt), "
                             f"which it no longer reads; it reads torch.distributed.checkpoint folders (with "
                             f"{METADATA}): start a new run, or resume it with the code that wrote it")
        raise ValueError(f"{folder}: not a checkpoint (no {METADATA}; accepted: a torch.distributed.checkpoint "
                         "folder written by this trainer)")
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except Exception as err:  # noqa: BLE001 - whatever unpickling random bytes raises
        raise ValueError(f"{folder / METADATA}: not a readable checkpoint index ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else 'cut short'})") from None
    if not isinstance(metadata, Metadata) or "checkpoint" not in metadata.state_dict_metadata:
        raise ValueError(f"{folder}: not a checkpoint of this trainer (no 'checkpoint' entry)")
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"checkpoint {folder} is incomplete: {', '.join(missing)} missing (of {len(files)} files)")
    return metadata


@dataclass
class Checkpoint:
    path: Path
    metadata: Metadata
    step: int
    world_size: int  # of the run that saved it
    trainer: dict  # the caller's objects
    rng: dict  # this rank's RNG states (rank 0's where the saving run had fewer ranks)


def read_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """The latest checkpoint's small objects (a ValueError if there is none, or it is not one). Collective."""
    folder = latest_checkpoint(directory)
    if folder is None:
        raise ValueError(f"no checkpoint in {directory} (no {LATEST!r} naming a complete step-* folder)")
    metadata = _metadata(folder)
    rank, _ = _rank_and_world()
    rng = f"rng.{rank}" if f"rng.{rank}" in metadata.state_dict_metadata else "rng.0"
    objects = {"checkpoint": None, "trainer": None, rng: None}
    _dcp(dcp.load, folder, objects, _LoadPlanner({}))
    meta = objects["checkpoint"]
    return Checkpoint(folder, metadata, meta["step"], meta["world_size"], objects["trainer"], objects[rng])


def load_train_state(checkpoint: Checkpoint, wrapper, optimizer=None) -> None:
    """Load ``checkpoint``'s model into ``wrapper``'s (in place) and its optimizer state into ``optimizer``, at
    this run's world size and mode. Collective."""
    saved = checkpoint.metadata.state_dict_metadata
    entries = _model_entries(wrapper)
    objects: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}  # the optimizer state's destinations
    held: dict[str, dict[str, str]] = {}  # parameter name -> {state key: entry name} of the state this rank keeps
    if optimizer is not None:
        objects["optim_groups"] = None
        for name, p in _optim_params(wrapper, optimizer):
            if not _holds_state(optimizer, p):
                continue
            prefix, layout = f"optim.{name}.", wrapper.shard_of(p)
            full = p.shape if layout is None else torch.Size(layout[0])
            held[name] = {k[len(prefix):]: k for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]}
            for key in held[name].values():
                md = saved[key]
                if not isinstance(md, TensorStorageMetadata):
                    objects[key] = None
                elif md.size == full:  # per element: laid out like its parameter (FSDP's moments are shards)
                    tensors[key] = torch.zeros(p.shape, dtype=md.properties.dtype, device=p.device)
                    entries[key] = _entry(tensors[key], layout)
                else:  # AdamW's step: on the CPU, where load_state_dict wants it (it moves it if needed)
                    tensors[key] = torch.zeros(md.size, dtype=md.properties.dtype)
                    entries[key] = _entry(tensors[key], None)
    unknown = [key for key in [*entries, *objects] if key not in saved]
    if unknown:
        raise ValueError(f"{checkpoint.path}: no {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''} in "
                         "the checkpoint: it was saved from another model or optimizer")
    for key, entry in entries.items():
        if saved[key].size != entry.shape:
            raise ValueError(f"{checkpoint.path}: {key} is {tuple(saved[key].size)} in the checkpoint, "
                             f"{tuple(entry.shape)} here")
    _dcp(dcp.load, checkpoint.path, objects, _LoadPlanner(entries))
    if optimizer is None:
        return
    groups = objects["optim_groups"]
    if [g["params"] for g in groups] != [g["params"] for g in _groups(wrapper, optimizer)]:
        raise ValueError(f"{checkpoint.path}: the optimizer's parameter groups differ from the checkpoint's")
    index = {name: i for i, (name, _) in enumerate(_optim_params(wrapper, optimizer))}
    state = {index[name]: {k: tensors[key] if key in tensors else objects[key] for k, key in keys.items()}
             for name, keys in held.items() if keys}
    optimizer.load_state_dict({"state": state, "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                                                 for g in groups]})


# ----------------------------------------------------------------------------- RNG states


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
