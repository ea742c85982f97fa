"""``torch_impl.checkpoint``'s pruning: by step number, never the step just saved, and an earlier run's
higher-numbered steps left alone (issue 17, item 1). One process, tiny dicts, no training."""

from __future__ import annotations

from pathlib import Path

from torch_impl import checkpoint as ckpt


def _save(folder: Path, step: int, keep: int = 2) -> None:
    ckpt.save_checkpoint(folder, step, {"value": step}, {"rank_value": step}, keep=keep)


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step-*"))


def test_a_new_run_keeps_its_checkpoint_beside_an_earlier_longer_run(tmp_path, capsys):
    for step in (20, 40, 60):  # the earlier run: keeps 40 and 60
        _save(tmp_path, step)
    assert _steps(tmp_path) == ["step-00000040", "step-00000060"]
    _save(tmp_path, 20)  # a new run in the same folder, stopped after its first epoch
    assert (tmp_path / "latest").read_text() == "step-00000020"
    assert _steps(tmp_path) == ["step-00000020", "step-00000040", "step-00000060"]  # nothing of either run lost
    loaded = ckpt.load_checkpoint(tmp_path)
    assert loaded.shared["step"] == 20 and loaded.local == {"rank_value": 20}
    assert "step-00000040, step-00000060" in capsys.readouterr().err
    for step in (40, 60, 80):  # the new run goes on: its own steps replace the earlier run's, then prune
        _save(tmp_path, step)
    assert _steps(tmp_path) == ["step-00000060", "step-00000080"]
    assert ckpt.load_checkpoint(tmp_path).shared["value"] == 80


def test_prunes_by_step_number_past_the_padding(tmp_path):
    for step in (99_999_999, 100_000_000, 100_000_001):  # "step-100000000" sorts before "step-99999999" as text
        _save(tmp_path, step)
    assert _steps(tmp_path) == ["step-100000000", "step-100000001"]
    assert ckpt.load_checkpoint(tmp_path).shared["step"] == 100_000_001


def test_keep_one_and_foreign_names(tmp_path):
    (tmp_path / "step-notes").mkdir()  # not a checkpoint: never touched
    (tmp_path / "step-00000009.tmp").mkdir()  # a staging folder (of a killed save): not pruned
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=1)
    assert _steps(tmp_path) == ["step-00000003", "step-00000009.tmp", "step-notes"]
