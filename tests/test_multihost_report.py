"""``analysis.multihost``: runs launched as several nodes or processes, or restarted, set beside the same
configuration on one host, from records made up here with random losses: a trainer's epochs joined by run name (a
restarted epoch's latest record kept), step benchmarks one record a run, the reference the first one-host run, and
the CLI's one-line error when nothing pairs."""

from __future__ import annotations

import random

import pytest

from analysis.multihost import launch, main, multihost_table, runs
from analysis.records import Record, timing_stats

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _placement(nodes: int, per_node: int) -> list[dict]:
    return [{"host": "h", "node_rank": n, "local_rank": r} for n in range(nodes) for r in range(per_node)]


def _epoch(run: str, epoch: int, losses: list[float], nodes: int = 1, restarts: int = 0, ms: float = 50.0,
           settings: dict | None = None, command: str = "python3 /repo/torch_impl/train.py") -> Record:
    return Record(suite="train", backend="torch", implementation="bucketed 25MB", model="small", batch_size=8,
                  seq_len=512, dtype="bf16", mode="train_step", world_size=2, timing=timing_stats([ms, ms]),
                  peak_memory_bytes=3 * 2**30,
                  metrics={"run": run, "epoch": epoch, "train_losses": losses, "val_loss": losses[-1] + 1,
                           "placement": _placement(nodes, 2 // nodes), "restarts": restarts, "dist": "bucketed"},
                  provenance={"git_commit": COMMIT, "settings": settings or {}, "command": command})


def _e2e(processes: int, losses: list[float], ms: float) -> Record:
    return Record(suite="processes", backend="jax", implementation="jit fsdp", model="xl", batch_size=8,
                  seq_len=1024, dtype="bf16", mode="train_step", world_size=2, timing=timing_stats([ms]),
                  peak_memory_bytes=40 * 2**30,
                  metrics={"processes": processes, "local_devices": 2 // processes, "losses": losses,
                           "predicted_memory_bytes": 35 * 2**30, "strategy": "fsdp",
                           "compiled_memory": {"estimate_bytes": 39 * 2**30}},
                  provenance={"git_commit": COMMIT})


def test_launches_are_set_beside_one_host_and_their_losses_compared():
    rng = random.Random()
    epochs = [[rng.uniform(2, 9) for _ in range(4)] for _ in range(3)]
    other = [x + 0.5 for x in epochs[2]]
    records = [_epoch("one_node", e + 1, epochs[e], settings={"OMP_NUM_THREADS": "1"},
                      command="torchrun --nproc-per-node 2 /other/checkout/torch_impl/train.py") for e in range(3)]
    records += [_epoch("two_nodes", e + 1, epochs[e], nodes=2, ms=60.0,
                       settings={"CUDA_VISIBLE_DEVICES": "0"}) for e in range(3)]
    # the restarted run: epoch 2 recorded by the killed attempt (other losses), then again after the restart
    records += [_epoch("elastic", 1, epochs[0]), _epoch("elastic", 2, other),
                _epoch("elastic", 2, epochs[1], restarts=1), _epoch("elastic", 3, other, restarts=1)]
    records += [_e2e(1, [5.0, 4.0], 100.0), _e2e(2, [5.0, 4.5], 110.0)]
    records.append(_epoch("alone", 1, epochs[0], nodes=2))  # no one-host run of its configuration: no row
    records[-1].model = "xl"
    records.append(_epoch("patched", 1, other, nodes=2, command="python3 -c --seed 0"))  # other code: no row

    table = multihost_table(records)
    rows = {(r["suite"], r["run"], r["launch"]): r for r in table.to_dict("records")}
    assert list(rows) == [
        ("train", "one_node", "1 node x 2 rank, OMP_NUM_THREADS=1"),
        ("train", "two_nodes", "2 nodes x 1 rank, a GPU visible a rank"),
        ("train", "elastic", "1 node x 2 rank, restarted 1x"),
        ("processes", "-", "1 process x 2 GPU"),
        ("processes", "-", "2 processes x 1 GPU"),
    ], table
    assert rows["train", "one_node", "1 node x 2 rank, OMP_NUM_THREADS=1"]["losses vs one host"] == "reference"
    two = rows["train", "two_nodes", "2 nodes x 1 rank, a GPU visible a rank"]
    assert (two["losses vs one host"], two["x one host"]) == ("identical (12 steps)", pytest.approx(1.2))
    elastic = rows["train", "elastic", "1 node x 2 rank, restarted 1x"]
    assert elastic["losses vs one host"] == f"first 8 equal, then max abs diff {0.5:.3g} (12 steps)"
    assert elastic["val loss"] == pytest.approx(other[-1] + 1)
    jax = table[table.suite == "processes"].to_dict("records")
    assert [r["losses vs one host"] for r in jax] == ["reference", "first 1 equal, then max abs diff 0.5 (2 steps)"]
    assert (jax[1]["peak GiB"], jax[1]["predicted GiB"], jax[1]["XLA's estimate GiB"]) == (40.0, 35.0, 39.0)
    assert [r.name for r in runs(records)].count("elastic") == 1


def test_a_step_benchmark_with_other_loss_counts_is_told_and_launch_words():
    table = multihost_table([_e2e(1, [5.0, 4.0], 100.0), _e2e(2, [5.0], 90.0)])
    assert table["losses vs one host"].tolist() == ["reference", "1 losses against 2"]
    assert launch(_epoch("x", 1, [1.0]))[1] and not launch(_epoch("x", 1, [1.0], nodes=2))[1]


def test_cli_writes_the_table_or_says_what_is_missing(tmp_path, capsys):
    from analysis.records import append_records

    path = tmp_path / "runs.jsonl"
    append_records(path, [_e2e(1, [5.0, 4.0], 100.0), _e2e(2, [5.0, 4.0], 100.0)])
    assert main([str(path), "--out", str(tmp_path / "m.md")]) == 0
    text = (tmp_path / "m.md").read_text()
    assert "identical (2 steps)" in text and "](m.png)" in text  # the chart beside the table, shown in it
    assert (tmp_path / "m.png").stat().st_size > 0 and (tmp_path / "m.pdf").read_bytes()[:5] == b"%PDF-"
    append_records(tmp_path / "alone.jsonl", [_e2e(1, [5.0], 1.0)])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "alone.jsonl"), "--out", str(tmp_path / "n.md")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run launched as several nodes" in err


def test_trainer_runs_are_compared_over_the_epochs_both_ran():
    """A run stopped after epoch 1 (``--stop-after-epochs``) is set beside the whole run over epoch 1; one resumed
    for epoch 2 beside one that stopped after epoch 1 shares no epoch with it: no row."""
    rng = random.Random()
    epochs = [[rng.uniform(2, 9) for _ in range(3)] for _ in range(2)]
    whole = [_epoch("whole", e + 1, epochs[e], ms=40.0 + e) for e in range(2)]
    table = multihost_table([*whole, _epoch("stopped", 1, epochs[0], ms=44.0)])
    assert table["losses vs one host"].tolist() == ["reference", "identical (3 steps)"]
    assert table["x one host"].tolist() == [1.0, pytest.approx(44.0 / 40.0)]  # against the reference's epoch 1
    assert table["epochs"].tolist() == ["1-2", "1"]
    assert multihost_table([_epoch("stopped", 1, epochs[0]), _epoch("resumed", 2, epochs[1])]).empty


def test_the_chart_needs_a_step_time_beside_the_reference(tmp_path):
    """No run with both step times: no chart, and the page says why in one line."""
    from analysis.multihost import plot_multihost, write_multihost

    records = [_e2e(1, [5.0, 4.0], 100.0), _e2e(2, [5.0, 4.0], 100.0)]
    records[1].timing = None
    assert plot_multihost(multihost_table(records), tmp_path / "x.png") is None and not list(tmp_path.iterdir())
    assert "No chart: no run has a step time" in write_multihost(records, tmp_path / "m.md").read_text()
