"""The training matrix (``torch_impl.bench.train_matrix``) on CPU: tiny cells through the real trainer, one
process and 2 gloo ranks under torchrun, a failing cell recorded as a row, and the table and five charts
regenerated from the records alone. The summary numbers are recomputed here from the epoch records.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from analysis.records import read_records
from torch_impl.bench.train_matrix import CHARTS, failure_line, main, parse_list

TRAIN_ARGS = "--val-batches 2 --builtin-mb 0.25 --cache-dir {cache}"


def _argv(tmp: Path, attention: str, dist: str) -> list[str]:
    return ["--attention", attention, "--dist", dist, "--nproc", "2", "--model", "tiny", "--batch-size", "2",
            "--seq-len", "16", "--epochs", "3", "--steps-per-epoch", "2", "--dtype", "fp32", "--device", "cpu",
            "--train-args", TRAIN_ARGS.format(cache=tmp / "cache"), "--cell-timeout", "120",
            "--out", str(tmp / "matrix.jsonl"), "--report-dir", str(tmp / "report")]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("matrix")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("GLOO_SOCKET_IFNAME", "lo")
        codes = [main(_argv(tmp, "sdpa", "none,bucketed")), main(_argv(tmp, "bogus", "none"))]
    return tmp, codes, read_records(tmp / "matrix.jsonl")


def test_cells_and_summaries(sweep):
    _, codes, records = sweep
    assert codes == [0, 1]  # the sweep with a failing cell reports it in its exit status
    summaries = [r for r in records if r.suite == "train_matrix"]
    assert [(s.metrics["attention"], s.metrics["dist"], s.world_size, s.status) for s in summaries] == [
        ("sdpa", "none", 1, "ok"), ("sdpa", "bucketed", 2, "ok"), ("bogus", "none", 1, "error")]
    for s in summaries[:2]:
        epochs = [r for r in records if r.suite == "train" and r.metrics.get("run") == s.metrics["run"]]
        assert [r.metrics["epoch"] for r in epochs] == [1, 2, 3] and s.metrics["epochs_done"] == 3
        assert s.implementation == epochs[0].implementation
        # Same local batch and steps everywhere: 2 ranks see twice the samples per epoch.
        assert s.metrics["samples_per_epoch"] == 2 * 2 * s.world_size
        assert s.tokens_per_s == statistics.median(r.tokens_per_s for r in epochs[1:])
        assert s.metrics["s_per_epoch"] == statistics.median(r.metrics["epoch_s"] for r in epochs[1:])
        assert s.metrics["wall_s"] > sum(r.metrics["epoch_s"] for r in epochs)
        assert s.metrics["val_loss"] == epochs[-1].metrics["val_loss"]
        assert s.peak_memory_bytes is None  # CPU
    failed = summaries[2]
    assert "unknown attention backend 'bogus'" in failed.error and failed.metrics["epochs_done"] == 0


def test_report_is_regenerated_from_records(sweep, tmp_path):
    tmp, _, _ = sweep
    table = (tmp / "report" / "train_matrix.md").read_text()
    assert table.count("\n") == 2 + 3  # header, rule, a row per cell
    assert "bucketed 25MB" in table and "unknown attention backend" in table
    for name in CHARTS:
        assert (tmp / "report" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert main(["--report-only", str(tmp / "matrix.jsonl"), "--report-dir", str(tmp_path)]) == 0
    assert (tmp_path / "train_matrix.md").read_text() == table
    assert sorted(p.stem for p in tmp_path.glob("*.png")) == sorted(CHARTS)


def test_flags_and_failure_lines(capsys):
    assert parse_list("sdpa, naive,sdpa", "--attention") == ["sdpa", "naive"]
    with pytest.raises(ValueError, match="accepted"):
        parse_list("none,ddp3", "--dist", ("none", "naive"))
    with pytest.raises(SystemExit):
        main(["--dist", "none,ddp3"])
    assert "ddp3" in capsys.readouterr().err
    text = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
            "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n=====\n  error_file: <N/A>\n")
    assert failure_line(text) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert failure_line("a\nb\n") == "b"


def test_train_runs_are_labelled_by_what_differs_and_their_step_losses_drawn(tmp_path):
    """Unnamed runs that differ only by MLP and seed get those in their labels (the same settings left out), and
    each step's losses become the loss_steps chart's means of STEP_WINDOW steps, counted on over a run's epochs;
    the chart is drawn where no run has two epochs (else the losses against epoch are)."""
    from analysis.records import Record
    from analysis.training import STEP_WINDOW, _step_rows, plot_train_runs, run_labels

    def epoch(mlp, seed, number, losses):
        return Record(suite="train", backend="torch", implementation="none", model="xl", batch_size=4, seq_len=2048,
                      dtype="bf16_mixed", mode="train_step", tokens_per_s=1000.0,
                      metrics={"epoch": number, "epoch_s": 1.0, "train_loss": losses[-1], "attention": "sdpa",
                               "mlp": mlp, "seed": seed, "train_losses": losses})

    losses = [float(i) for i in range(2 * STEP_WINDOW + 3)]
    records = [epoch("torch", 0, 1, losses), epoch("torch", 0, 2, losses), epoch("gluon", 1, 1, losses)]
    labels = run_labels(records)
    assert labels == ["torch none, batch 4, mlp torch, seed 0"] * 2 + ["torch none, batch 4, mlp gluon, seed 1"]
    named = [epoch("torch", seed, 1, losses) for seed in (0, 1)]
    for r in named:
        r.metrics["run"] = "index_lookup"
    assert run_labels(named + records[2:]) == ["index_lookup, seed 0", "index_lookup, seed 1",
                                               "torch none, batch 4"]  # what varies within a name
    rows = _step_rows(records, labels)
    first = rows[rows.cell == labels[0]]
    assert list(first.step) == [10, 20, 33, 43] and list(first.loss) == [4.5, 14.5, 4.5, 14.5]
    written = plot_train_runs(records, tmp_path / "runs")  # two epochs in a run: the losses against epoch
    assert [p.name for p in written] == ["runs_throughput.png", "runs_loss.png"]
    written = plot_train_runs(records[1:], tmp_path / "one")  # one epoch a run: against the step instead
    assert [p.name for p in written] == ["one_throughput.png", "one_loss_steps.png"]
