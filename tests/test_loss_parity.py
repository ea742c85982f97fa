"""analysis.loss_parity on synthetic records: PyTorch and JAX runs pair only when they started from the same
weight file at the same learning rate, commit, model, global batch and dtype; a trainer's epochs are joined in
epoch order; the relative differences and the bf16 verdict are computed from the losses; the learning rate comes
from the command where the record has none; the CLI writes the table and chart, or one line when nothing pairs."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.loss_parity import BF16_RTOL, FIRST_STEPS, loss_parity, main, write_loss_parity
from analysis.records import Record, save_records


def _record(backend: str, command: str, *, suite: str = "e2e", commit: str = "abc", batch: int = 4,
            world_size: int = 1, **metrics) -> Record:
    r = Record(suite=suite, backend=backend, implementation=f"{backend} impl", model="xl", batch_size=batch,
               seq_len=512, dtype="bf16", mode="train_step", world_size=world_size, metrics=metrics)
    r.provenance.update(command=command, git_commit=commit)
    return r


def _losses(rng, n=12):
    return list(9.0 - np.cumsum(rng.uniform(0.05, 0.3, n)))


def test_pairs_by_weights_and_learning_rate():
    rng = np.random.default_rng()
    base = _losses(rng)
    near = [x * (1 + 1e-3) for x in base]  # within bf16 tolerance everywhere
    far = base[:FIRST_STEPS] + [x * 1.1 for x in base[FIRST_STEPS:]]  # parts after the first steps
    records = [
        _record("torch", "e2e.py --lr 1e-4 --save-weights /w.npz", losses=base),
        _record("jax", "e2e.py --lr 1e-4 --load-weights /w.npz", losses=near),
        _record("torch", "e2e.py --lr=1e-3 --save-weights /w.npz", losses=base),
        _record("jax", "e2e.py --load-weights /w.npz", losses=far, lr=1e-3),  # lr from the record
        _record("jax", "e2e.py --lr 1e-4", losses=base),  # no saved weights: not a parity run
        _record("jax", "e2e.py --lr 1e-4 --load-weights /other.npz", losses=base),  # other weights
        _record("jax", "e2e.py --lr 1e-4 --load-weights /w.npz", commit="def", losses=base),  # other commit
    ]
    table, curves = loss_parity(records)
    assert sorted(table["lr"]) == [1e-4, 1e-3]
    small = table[table["lr"] == 1e-4].iloc[0]
    assert small[f"max_rel_diff_first_{FIRST_STEPS}"] == pytest.approx(1e-3)
    assert small[f"within_bf16_first_{FIRST_STEPS}"]
    large = table[table["lr"] == 1e-3].iloc[0]
    assert large[f"max_rel_diff_first_{FIRST_STEPS}"] == 0 and large["max_rel_diff"] == pytest.approx(0.1)
    assert large[f"within_bf16_first_{FIRST_STEPS}"]  # the verdict is on the first steps only
    assert len(curves) == 2 * 2 * len(base)


def test_trainer_epochs_are_joined_in_order_and_batches_are_global():
    rng = np.random.default_rng()
    losses = _losses(rng, 8)
    off = [x * (1 + 2 * BF16_RTOL) for x in losses]
    records = [  # epochs written out of order; PyTorch 2 ranks x 2, JAX the mesh's 4
        _record("torch", "train.py --lr 1e-3 --init-weights /w.npz", suite="train", batch=2, world_size=2,
                epoch=2, run="t", train_losses=losses[4:], lr=1e-4),
        _record("torch", "train.py --lr 1e-3 --init-weights /w.npz", suite="train", batch=2, world_size=2,
                epoch=1, run="t", train_losses=losses[:4], lr=9e-4),
        _record("jax", "trainer.py --lr 1e-3 --init-weights /w.npz", suite="train", batch=4, epoch=1, run="j",
                train_losses=off[:4], lr=9e-4),
        _record("jax", "trainer.py --lr 1e-3 --init-weights /w.npz", suite="train", batch=4, epoch=2, run="j",
                train_losses=off[4:], lr=1e-4),
    ]
    table, _ = loss_parity(records)
    assert len(table) == 1
    row = table.iloc[0]
    assert (row["torch"], row["jax"], row["steps"], row["global_batch"]) == ("t", "j", 8, 4)
    assert row["max_rel_diff"] == pytest.approx(2 * BF16_RTOL) and not row[f"within_bf16_first_{FIRST_STEPS}"]


def test_cli_writes_the_table_and_chart_or_one_line(tmp_path, capsys):
    rng = np.random.default_rng()
    losses = _losses(rng)
    path = tmp_path / "parity.jsonl"
    save_records(path, _record("torch", "e2e.py --save-weights /w.npz", losses=losses))
    with pytest.raises(SystemExit) as exc:
        main([str(path), "--out", str(tmp_path / "lp.md")])
    assert exc.value.code != 0 and len(capsys.readouterr().err.strip().splitlines()) == 1
    save_records(path, _record("jax", "e2e.py --load-weights /w.npz", losses=losses))
    written = write_loss_parity(path, tmp_path / "lp.md")
    assert [p.name for p in written] == ["lp.md", "lp.png"] and all(p.stat().st_size > 0 for p in written)
    assert "| abc " in written[0].read_text()
