"""Faults (issue 17, What to build 3): the trainer SIGKILLed while it writes a record and while it saves a checkpoint,
and a rank SIGKILLed under torchrun on gloo.

The trainer runs as its CLI in a child process that kills itself with SIGKILL at one chosen point (a real kill,
at a point chosen rather than hoped for): half-way through the bytes of epoch 2's record, or after epoch 2's
checkpoint files are written but before their folder is renamed into place. Afterwards the record file reads
(the cut line skipped with a warning), ``latest`` names a complete checkpoint, and ``--resume`` continues: the
last epoch's losses are those of an uninterrupted run (one thread: bit for bit), the cut line is set aside in
``<name>.corrupt``. Under torchrun, rank 1 kills itself in its second step: the job must end well within the
process-group timeout, non-zero, with a message naming rank 1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from analysis.records import read_records

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--epochs", "3", "--steps-per-epoch", "2",
         "--val-batches", "1", "--device", "cpu", "--no-progress"]

# Runs the trainer's CLI with one kill point armed (sys.argv[1]: "record" or "checkpoint"; the rest: its flags).
KILLED_TRAINER = """
import os, signal, sys
from analysis import records
from torch_impl import checkpoint
point, argv = sys.argv[1], sys.argv[2:]
calls = {"n": 0}

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "record":  # epoch 2's record: half its line reaches the file, then the kill
    real_append = records.append_records
    def append(path, batch):
        calls["n"] += 1
        if calls["n"] < 2:
            return real_append(path, batch)
        import json
        line = json.dumps(batch[0].to_dict(), sort_keys=True).encode()
        with open(path, "ab") as f:
            f.write(line[: len(line) // 2])
        die()
    records.append_records = append
else:  # epoch 2's checkpoint: its files written in step-N.tmp, the kill before the folder's rename
    real_replace = os.replace
    def replace(src, dst):
        if str(src).endswith(".tmp") and os.path.isdir(src):
            calls["n"] += 1
            if calls["n"] == 2:
                die()
        return real_replace(src, dst)
    checkpoint.os.replace = replace
from torch_impl.train import main
sys.exit(main(argv))
"""

# Runs the trainer under torchrun; rank 1 kills itself in its second optimizer step.
KILLED_RANK = """
import os, signal, sys
import torch_impl.train as train
real_step = train.train_step
steps = {"n": 0}
def step(*args, **kwargs):
    steps["n"] += 1
    if os.environ.get("RANK") == "1" and steps["n"] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(*args, **kwargs)
train.train_step = step
sys.exit(train.main())
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint16))
    return path


def _train(args: list[str], cwd: Path, kill: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", KILLED_TRAINER, kill, *args] if kill else [sys.executable, "-m", "torch_impl.train",
                                                                           *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("kill", ["record", "checkpoint"])
def test_sigkill_while_writing_then_resume(kill, tokens, tmp_path):
    args = [*TRAIN, "--data", str(tokens), "--cache-dir", str(tmp_path / "cache"),
            "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "train.jsonl")]
    killed = _train(args, tmp_path, kill=kill)
    assert killed.returncode == -9, killed.stderr[-2000:]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after_kill = read_records(tmp_path / "train.jsonl")
    assert [("truncated last line" in str(w.message)) for w in caught] == ([True] if kill == "record" else [])
    assert [r.metrics["epoch"] for r in after_kill] == [1]  # epoch 2's record: cut (record) or not yet (checkpoint)
    latest = (tmp_path / "ck" / "latest").read_text()
    assert latest == ("step-00000004" if kill == "record" else "step-00000002"), latest
    assert (tmp_path / "ck" / latest / ".metadata").is_file()  # a whole DCP checkpoint

    resumed = _train([*args, "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from step {int(latest.split('-')[1])}" in resumed.stdout
    records = read_records(tmp_path / "train.jsonl")  # whole again: the cut line was set aside
    assert [r.metrics["epoch"] for r in records] == ([1, 3] if kill == "record" else [1, 2, 3])
    if kill == "record":
        assert (tmp_path / "train.jsonl.corrupt").read_text().startswith('{"backend": "torch"')

    reference = _train([*args[:args.index("--checkpoint-dir")], "--out", str(tmp_path / "reference.jsonl")],
                       tmp_path)
    assert reference.returncode == 0, reference.stderr[-2000:]
    uninterrupted = read_records(tmp_path / "reference.jsonl")[-1].metrics
    assert records[-1].metrics["train_losses"] == uninterrupted["train_losses"]
    assert records[-1].metrics["val_loss"] == uninterrupted["val_loss"]


def test_a_killed_rank_ends_the_torchrun_job_naming_it(tokens, tmp_path):
    timeout = 60  # the process group's: the job must end well before it
    script = tmp_path / "killed_rank.py"
    script.write_text(KILLED_RANK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), *TRAIN, "--data", str(tokens), "--cache-dir", str(tmp_path / "cache"), "--dist", "bucketed",
           "--timeout", str(timeout), "--out", str(tmp_path / "train.jsonl")]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=3 * timeout)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert elapsed < timeout, f"the job took {elapsed:.0f} s"
    assert re.search(r"rank\s*:\s*1\b", output) and "SIGKILL" in output, output[-3000:]
    assert not (tmp_path / "train.jsonl").exists() or all(r.status in ("ok", "error")
                                                          for r in read_records(tmp_path / "train.jsonl"))
