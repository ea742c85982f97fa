"""``torch_impl.checkpoint``: DCP checkpoints that outlive the topology (issue 23, item 5), and its folders.

* Resharding: the trainer saves on 2 gloo ranks after epoch 1 and resumes on 1 and on 4 ranks (the same global
  batch: one row per micro-batch, 4 // ranks micro-batches), for DDP (resumed as one process without a process
  group, and as ZeRO-2 on 4), ZeRO-1, ZeRO-2 (its optimizer state in pieces: resumed by FSDP on 4), our FSDP, and
  across modes (FSDP's checkpoint resumed by ZeRO-1 on 1 rank and by individual DDP on 4): epoch 2's losses are
  the uninterrupted 2-rank run's to float32 round-off (ranks sum in other orders: ~1e-7 relative measured, rtol
  1e-5 asserted). The model's odd dimensions put FSDP's shard boundaries inside rows at 2 and at 4 ranks. Each
  case about 15 s on 2 cores.
* ``_boxes``: the boxes a flat range of a row-major tensor is saved as tile exactly that range, in order.
* A save that fails on one of 2 ranks (DCP's writer raising on rank 1) leaves ``latest`` naming the previous
  checkpoint, which loads whole; the next save clears the staging folder.
* A folder of the earlier format (``shared.pt``, ``rank-NNNNN.pt``) is refused with one line saying what is read.
* Pruning: by step number, never the step just saved, and an earlier run's higher-numbered steps left alone
  (issue 17, item 1). One process, no training.

Tiny model (d_model 36, d_ff 71, vocab 251, 3 heads), 16-token sequences, one intra-op thread per rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from parallelism_calc.specs import MODELS
from tests._dist import run_ranks
from torch_impl import checkpoint as ckpt
from torch_impl.model import TransformerLM
from torch_impl.parallelize import apply_data_parallel
from torch_impl.train import TrainConfig, run_training

GLOBAL_BATCH = 4
DIMS = dict(d_model=36, n_heads=3, d_ff=71, vocab_size=251)  # shard boundaries fall inside rows


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reshard") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, DIMS["vocab_size"], 8192, dtype=np.uint16))
    return str(path)


def _cfg(tokens: str, world_size: int, **changes) -> TrainConfig:
    # one row per micro-batch: the validation windows (val_batches x batch_size) are the same at every world size
    base = dict(model="tiny", **DIMS, seq_len=16, batch_size=1, grad_accum=GLOBAL_BATCH // world_size, epochs=2,
                steps_per_epoch=2, lr=3e-3, warmup_steps=1, grad_clip=1.0, adam_eps=1e-4, val_batches=2,
                data=tokens, cache_dir=str(Path(tokens).parent / "cache"), device="cpu", progress=False, seed=7)
    return TrainConfig(**{**base, **changes})


def _save_on_ranks(rank: int, world_size: int, tokens: str, mode: str, folder: str) -> dict:
    """The uninterrupted run, then one stopped after epoch 1 with its checkpoint in ``folder``."""
    whole = run_training(_cfg(tokens, world_size, dist=mode))
    run_training(_cfg(tokens, world_size, dist=mode, checkpoint_dir=folder, stop_after_epochs=1))
    return {"losses": whole.train_losses, "val": whole.val_losses}


def _resume(rank: int, world_size: int, tokens: str, mode: str, folder: str) -> dict:
    result = run_training(_cfg(tokens, world_size, dist=mode, checkpoint_dir=folder, resume=True))
    return {"start": result.start_step, "losses": result.train_losses, "val": result.val_losses}


@pytest.mark.parametrize("saved,on_one,on_four", [
    ("bucketed", "none", "zero2"),  # DDP; one process without a process group; ZeRO-2's pieces read DDP's tensors
    ("zero1", "zero1", "zero1"),
    ("zero2", "zero2", "fsdp"),  # ZeRO-2's pieces of the optimizer state, read by FSDP's shards
    ("fsdp", "fsdp", "fsdp"),
    ("fsdp", "zero1", "individual"),  # another mode reads FSDP's full tensors
])
def test_saved_on_two_ranks_resumes_on_one_and_four(tokens, tmp_path, saved, on_one, on_four):
    folder = tmp_path / "saved"
    whole = run_ranks(_save_on_ranks, 2, tokens, saved, str(folder), timeout_s=120)[0]
    assert (folder / "latest").read_text() == "step-00000002"
    files = sorted(p.name for p in (folder / "step-00000002").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files  # DCP's, one file per rank
    for world_size, mode in ((1, on_one), (4, on_four)):
        copy = tmp_path / f"on_{world_size}"  # the resumed run saves too: each resumes from its own copy
        shutil.copytree(folder, copy)
        if mode == "none":
            resumed = _resume(0, 1, tokens, mode, str(copy))
        else:
            resumed = run_ranks(_resume, world_size, tokens, mode, str(copy), timeout_s=120)[0]
        what = f"saved by {saved} on 2 ranks, resumed by {mode} on {world_size}"
        assert resumed["start"] == 2, what
        np.testing.assert_allclose(resumed["losses"], whole["losses"][2:], rtol=1e-5, err_msg=what)
        np.testing.assert_allclose(resumed["val"], whole["val"][1:], rtol=1e-5, err_msg=what)


# ----------------------------------------------------------------------------- the boxes of a flat range


@pytest.mark.parametrize("shape", [(7,), (3, 4), (1, 5), (4, 1), (2, 3, 4)])
def test_boxes_tile_a_flat_range_in_order(shape):
    full = torch.arange(int(np.prod(shape))).view(shape)
    for start in range(full.numel() + 1):
        for stop in range(start, full.numel() + 1):
            boxes = ckpt._boxes(shape, start, stop)
            pieces = [full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                      for offsets, sizes in boxes]
            got = torch.cat(pieces) if pieces else torch.empty(0, dtype=full.dtype)
            assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop, boxes)
            assert len(boxes) <= 2 * len(shape) - 1, (shape, start, stop, boxes)


# ----------------------------------------------------------------------------- a failed save


def _failed_save(rank: int, world_size: int, folder: str) -> dict:
    torch.manual_seed(0)
    spec = MODELS["tiny"]
    _, wrapper, optimizer = apply_data_parallel(TransformerLM(spec), "fsdp", adamw=dict(lr=1e-2, fused=False))
    x = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        wrapper(x[:, :-1]).float().logsumexp(-1).mean().backward()
        wrapper.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()

    step()
    ckpt.save_checkpoint(folder, 1, wrapper, optimizer, trainer={"step": 1})
    saved = {k: v.clone() for k, v in wrapper.gather_full_params().items()}
    step()
    real_write = ckpt.dcp.FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        if rank == 1:
            raise OSError("disk full (injected)")
        return real_write(self, plan, planner)

    ckpt.dcp.FileSystemWriter.write_data = failing_write
    try:
        ckpt.save_checkpoint(folder, 2, wrapper, optimizer, trainer={"step": 2})
        error = None
    except RuntimeError as err:
        error = str(err)
    finally:
        ckpt.dcp.FileSystemWriter.write_data = real_write
    latest = (Path(folder) / "latest").read_text()
    found = ckpt.read_checkpoint(folder)
    ckpt.load_train_state(found, wrapper, optimizer)
    loaded = wrapper.gather_full_params()
    staged = (Path(folder) / "step-00000002.tmp").is_dir()
    ckpt.save_checkpoint(folder, 2, wrapper, optimizer, trainer={"step": 2})
    return {"error": error, "latest": latest, "step": found.step, "trainer": found.trainer, "staged": staged,
            "same": all(torch.equal(loaded[k], v) for k, v in saved.items()),
            "after": sorted(p.name for p in Path(folder).iterdir())}


def test_a_failed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    for rank, out in enumerate(run_ranks(_failed_save, 2, str(tmp_path), timeout_s=60)):
        assert out["error"] and "failed on rank(s) [1]" in out["error"] and "disk full" in out["error"], out
        assert "\n" not in out["error"], out["error"]
        assert (out["latest"], out["step"], out["trainer"]) == ("step-00000001", 1, {"step": 1}), (rank, out)
        assert out["staged"] and out["same"], (rank, out)
        assert out["after"] == ["latest", "step-00000001", "step-00000002"], (rank, out)


# ----------------------------------------------------------------------------- the earlier format


def test_an_old_format_checkpoint_is_refused_in_one_line(tmp_path):
    old = tmp_path / "step-00000004"
    old.mkdir()
    torch.save({"world_size": 1, "step": 4}, old / "shared.pt")
    torch.save({"rng": None}, old / "rank-00000.pt")
    (tmp_path / "latest").write_text(old.name)
    with pytest.raises(ValueError) as err:
        ckpt.read_checkpoint(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "old format (shared.pt, rank-NNNNN.pt)" in message, message
    assert "torch.distributed.checkpoint folders (with .metadata)" in message, message


# ----------------------------------------------------------------------------- pruning


def _save(folder: Path, step: int, keep: int = 2) -> None:
    ckpt.save_checkpoint(folder, step, trainer={"value": step}, keep=keep)


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step-*"))


def test_a_new_run_keeps_its_checkpoint_beside_an_earlier_longer_run(tmp_path, capsys):
    for step in (20, 40, 60):  # the earlier run: keeps 40 and 60
        _save(tmp_path, step)
    assert _steps(tmp_path) == ["step-00000040", "step-00000060"]
    _save(tmp_path, 20)  # a new run in the same folder, stopped after its first epoch
    assert (tmp_path / "latest").read_text() == "step-00000020"
    assert _steps(tmp_path) == ["step-00000020", "step-00000040", "step-00000060"]  # nothing of either run lost
    loaded = ckpt.read_checkpoint(tmp_path)
    assert (loaded.step, loaded.world_size, loaded.trainer) == (20, 1, {"value": 20})
    assert "step-00000040, step-00000060" in capsys.readouterr().err
    for step in (40, 60, 80):  # the new run goes on: its own steps replace the earlier run's, then prune
        _save(tmp_path, step)
    assert _steps(tmp_path) == ["step-00000060", "step-00000080"]
    assert ckpt.read_checkpoint(tmp_path).trainer["value"] == 80


def test_prunes_by_step_number_past_the_padding(tmp_path):
    for step in (99_999_999, 100_000_000, 100_000_001):  # "step-100000000" sorts before "step-99999999" as text
        _save(tmp_path, step)
    assert _steps(tmp_path) == ["step-100000000", "step-100000001"]
    assert ckpt.read_checkpoint(tmp_path).step == 100_000_001


def test_keep_one_and_foreign_names(tmp_path):
    (tmp_path / "step-notes").mkdir()  # not a checkpoint: never touched
    (tmp_path / "step-00000009.tmp").mkdir()  # a staging folder (of a killed save): not pruned
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=1)
    assert _steps(tmp_path) == ["step-00000003", "step-00000009.tmp", "step-notes"]
