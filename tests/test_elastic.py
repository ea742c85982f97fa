"""Elastic restart (issue 23, item 4): under ``torchrun --max-restarts 1`` on gloo, rank 1 SIGKILLs itself in the
middle of epoch 2 (``TRAIN_FAULT_AT_STEP=1:5``: after step 5's backward, before its gradient synchronization; 3 steps
an epoch, a checkpoint after each); the launcher restarts the group once, the trainer resumes from the latest
checkpoint (``--auto-resume``, epoch 1's) and finishes with the losses of an uninterrupted run, bit for bit (one
thread per rank). The restarted run's launcher has ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torchrun's shared
store a restarted group can read the dead attempt's addresses and fail or hang (see ``process_group``'s docstring);
the uninterrupted run goes without it and must get the trainer's warning about that. The launchers run with a
deadline (``tests._dist.run_launchers``). About 20 s on 2 cores.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.records import read_records
from tests._dist import run_launchers
from torch_impl.train import FAULT_ENV, main

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--epochs", "3", "--steps-per-epoch", "3",
         "--val-batches", "1", "--device", "cpu", "--no-progress", "--dist", "bucketed", "--timeout", "60"]
TIMEOUT_S = 120
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
STORE_WARNING = "warning: torchrun --max-restarts with its shared TCPStore"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("elastic") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint16))
    return path


def _torchrun(tmp: Path, tokens: Path, name: str, **env: str) -> tuple[str, list]:
    """One ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` of the trainer with --auto-resume; its
    output and the records rank 0 wrote."""
    out = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "-m", "torch_impl.train", *TRAIN, "--data", str(tokens), "--cache-dir", str(tmp / "cache"),
           "--out", str(out), "--checkpoint-dir", str(tmp / f"{name}_ckpt"), "--auto-resume"]
    env = {**{k: v for k, v in os.environ.items() if k not in (FAULT_ENV, UNSHARED_STORE)}, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **env}
    [(code, output)] = run_launchers([cmd], env=env, cwd=tmp, timeout_s=TIMEOUT_S)
    assert code == 0, f"{name}: torchrun exited {code}:\n{output[-4000:]}"
    return output, read_records(out)


def test_a_killed_rank_restarts_the_group_and_resumes_to_the_uninterrupted_losses(tokens, tmp_path):
    output, records = _torchrun(tmp_path, tokens, "killed", **{FAULT_ENV: "1:5", UNSHARED_STORE: "1"})
    assert STORE_WARNING not in output, output[-4000:]
    assert output.count(f"{FAULT_ENV}: rank 1 kills itself in step 5") == 1, output[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in output, output[-4000:]  # the launcher saw the kill...
    assert "resumed from step 3" in output and "torchrun restart 1" in output, output[-4000:]  # ...and restarted
    ok = [r for r in records if r.status == "ok"]
    # Rank 0 may record the broken collective (status "error") before the launcher stops it: a race, allowed.
    assert all(r.status == "error" and "RuntimeError" in r.error for r in records if r.status != "ok"), records
    assert [(r.metrics["epoch"], r.metrics["restarts"]) for r in ok] == [(1, 0), (2, 1), (3, 1)]

    output, reference = _torchrun(tmp_path, tokens, "uninterrupted")
    assert "no checkpoint in" in output and "resumed" not in output, output[-4000:]
    assert output.count(STORE_WARNING) == 1, output[-4000:]  # rank 0 only
    assert [(r.status, r.metrics["epoch"], r.metrics["restarts"]) for r in reference] == [
        ("ok", 1, 0), ("ok", 2, 0), ("ok", 3, 0)]
    for resumed, whole in zip(ok, reference):
        assert resumed.metrics["train_losses"] == whole.metrics["train_losses"], resumed.metrics["epoch"]
        assert resumed.metrics["val_loss"] == whole.metrics["val_loss"], resumed.metrics["epoch"]


@pytest.mark.parametrize("argv,fault,message", [
    (["--auto-resume"], None, "--auto-resume needs --checkpoint-dir and no --resume"),
    (["--auto-resume", "--resume", "--checkpoint-dir", "ck"], None, "--auto-resume needs --checkpoint-dir and no"),
    ([], "5", f"{FAULT_ENV}='5': write RANK:STEP"),
    ([], "1:0", f"{FAULT_ENV}='1:0': write RANK:STEP"),
    ([], "1:5", f"{FAULT_ENV}: rank 1 does not exist on 1 rank(s)"),
])
def test_bad_elastic_input_is_one_line(tokens, tmp_path, monkeypatch, capsys, argv, fault, message):
    if fault is not None:
        monkeypatch.setenv(FAULT_ENV, fault)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["--data", str(tokens), "--cache-dir", str(tmp_path / "cache"), "--steps-per-epoch", "1", "--device",
              "cpu", "--no-progress", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err
