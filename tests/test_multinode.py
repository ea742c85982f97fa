"""Several nodes, proven on one host: the trainer launched as two "nodes" (two ``torchrun --nnodes 2 --node-rank 0|1
--nproc-per-node 1`` launchers side by side, meeting at a c10d rendezvous on localhost) trains exactly as one node
of two processes (``--nproc-per-node 2``) on gloo: the same losses and validation losses, and records with the same
world size, ranks and hosts; only where the ranks ran differs (two node ranks of one local rank each, against one
node of local ranks 0 and 1). The rendezvous port is found free; the launchers run with a deadline
(``tests._dist.run_launchers``: a hung rendezvous is killed and reported). About 15 s on 2 cores.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.records import read_records
from tests._dist import free_port, run_launchers

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--epochs", "2", "--steps-per-epoch", "2",
         "--val-batches", "1", "--device", "cpu", "--no-progress", "--dist", "bucketed", "--timeout", "60"]
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("multinode") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint16))
    return path


def _torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--local-addr", "127.0.0.1", *launcher,
            "-m", "torch_impl.train"]


def _train(commands: list[list[str]], tmp: Path, tokens: Path, name: str) -> list:
    """Run the launchers (each given the trainer's flags); the epoch records rank 0 wrote."""
    out = tmp / f"{name}.jsonl"
    args = [*TRAIN, "--data", str(tokens), "--cache-dir", str(tmp / "cache"), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    results = run_launchers([[*cmd, *args] for cmd in commands], env=env, cwd=tmp, timeout_s=TIMEOUT_S)
    for i, (code, output) in enumerate(results):
        assert code == 0, f"{name}: launcher {i} exited {code}:\n{output[-3000:]}"
    return read_records(out)


def test_two_nodes_train_as_one_node_of_two_processes(tokens, tmp_path):
    endpoint = f"localhost:{free_port()}"
    nodes = [_torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode",
                       "--rdzv-conf", f"is_host={int(node == 0)}")  # node 0 serves the store: no race for the port
             for node in (0, 1)]
    two_nodes = _train(nodes, tmp_path, tokens, "two_nodes")
    one_node = _train([_torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                                 str(free_port()))], tmp_path, tokens, "one_node")

    host = socket.gethostname()
    assert [r.metrics["epoch"] for r in two_nodes] == [r.metrics["epoch"] for r in one_node] == [1, 2]
    for two, one in zip(two_nodes, one_node):
        assert two.status == one.status == "ok"
        assert (two.world_size, two.mesh, two.implementation) == (one.world_size, one.mesh, one.implementation)
        assert two.world_size == 2
        assert two.metrics["train_losses"] == one.metrics["train_losses"]  # one thread, two ranks: bit for bit
        assert two.metrics["val_loss"] == one.metrics["val_loss"]
        assert two.metrics["samples_per_epoch"] == one.metrics["samples_per_epoch"]
        # The same ranks on the same host; two nodes of one local rank each against one node of two local ranks.
        assert [p["host"] for p in two.metrics["placement"]] == [p["host"] for p in one.metrics["placement"]] \
            == [host, host]
        assert sorted((p["node_rank"], p["local_rank"]) for p in two.metrics["placement"]) == [(0, 0), (1, 0)]
        assert [(p["node_rank"], p["local_rank"]) for p in one.metrics["placement"]] == [(0, 0), (0, 1)]
