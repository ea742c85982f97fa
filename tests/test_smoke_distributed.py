"""Smoke test: torch.distributed collectives across 2 real processes (gloo on CPU; NCCL on >= 2 GPUs).

Each rank draws its tensor from a known per-rank seed derived from a fresh random base seed, so every rank
can regenerate all ranks' inputs and check the collectives against an independently computed float64
reference: all_reduce(SUM), all_gather (exact) and broadcast from a non-zero source (exact). As a negative
check, each rank also runs all_reduce(MAX) and feeds it to the same SUM checker, which must reject it.

Ranks write their findings (or their traceback) to ``rank{r}.json`` in ``tmp_path``; the parent asserts on
those files, so a failure inside a child fails the test with the child's message. The parent joins with a
deadline and kills the children if it passes, and the process group has its own timeout, so the test
cannot hang.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._dist import free_port

WORLD_SIZE = 2
SHAPE = (3, 37)
PG_TIMEOUT_S = 30  # collectives give up after this; the parent's deadline is longer
JOIN_DEADLINE_S = 90  # generous for a loaded 2-core CI machine; a healthy run takes a few seconds


def _rank_tensor(base_seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input, float32, reproducible anywhere from (base_seed, rank)."""
    gen = torch.Generator().manual_seed(base_seed * 1000 + rank)
    return torch.randn(SHAPE, generator=gen)  # (3, 37)


def _sum_reference(base_seed: int, world_size: int) -> torch.Tensor:
    return sum(_rank_tensor(base_seed, r).double() for r in range(world_size))  # (3, 37) float64


def _check_sum(got: torch.Tensor, base_seed: int, world_size: int) -> tuple[bool, float]:
    """The SUM checker: float32 all_reduce of world_size terms vs the float64 sum of the same terms."""
    ref = _sum_reference(base_seed, world_size)
    err = (got.double().cpu() - ref).abs()
    # Summing 2 float32 values of magnitude <~ 5 rounds once: error <= 2^-24 * |sum| ~ 3e-7.
    ok = bool((err <= 1e-6 + 1e-6 * ref.abs()).all())
    return ok, float(err.max())


def _worker(rank: int, world_size: int, port: int, base_seed: int, out_dir: str, backend: str) -> None:
    result: dict = {"rank": rank}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        assert dist.get_rank() == rank and dist.get_world_size() == world_size
        mine = _rank_tensor(base_seed, rank)

        # all_reduce(SUM) vs the independently regenerated float64 sum.
        t = mine.clone().to(device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        result["sum_ok"], result["sum_max_err"] = _check_sum(t, base_seed, world_size)

        # Negative check: a MAX reduction must fail the same SUM checker.
        t_bad = mine.clone().to(device)
        dist.all_reduce(t_bad, op=dist.ReduceOp.MAX)
        result["max_passes_sum_checker"], _ = _check_sum(t_bad, base_seed, world_size)

        # all_gather: slot r must hold exactly rank r's tensor.
        gathered = [torch.empty(SHAPE, device=device) for _ in range(world_size)]
        dist.all_gather(gathered, mine.clone().to(device))
        result["all_gather_ok"] = all(
            torch.equal(g.cpu(), _rank_tensor(base_seed, r)) for r, g in enumerate(gathered)
        )

        # broadcast from the last rank (non-zero, so "nothing happened" on rank 0 cannot pass).
        src = world_size - 1
        b = mine.clone().to(device)
        dist.broadcast(b, src=src)
        result["broadcast_ok"] = torch.equal(b.cpu(), _rank_tensor(base_seed, src))

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run_world(tmp_path: Path, backend: str, world_size: int = WORLD_SIZE) -> list[dict]:
    base_seed = secrets.randbelow(2**20)
    port = free_port()
    ctx = mp.start_processes(
        _worker,
        args=(world_size, port, base_seed, str(tmp_path), backend),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOIN_DEADLINE_S
    try:
        while not ctx.join(timeout=0.5):  # raises if a child raised or died (and kills the rest)
            if time.monotonic() > deadline:
                pytest.fail(f"{backend} workers did not finish within {JOIN_DEADLINE_S}s (seed={base_seed})")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # a child raised / died
        details = [f.read_text() for f in sorted(tmp_path.glob("rank*.json"))]
        pytest.fail(f"a {backend} worker failed (seed={base_seed}):\n{e}\nrank files: {details}")
    finally:
        for p in ctx.processes:  # only reached alive on the deadline / error paths
            if p.is_alive():
                p.kill()
                p.join(5)

    results = []
    for r in range(world_size):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result (seed={base_seed})"
        res = json.loads(f.read_text())
        assert "error" not in res, f"rank {r} failed (seed={base_seed}):\n{res['error']}"
        res["seed"] = base_seed
        results.append(res)
    return results


def _assert_world_ok(results: list[dict]) -> None:
    for res in results:
        assert res["sum_ok"], f"all_reduce(SUM) wrong on rank {res['rank']}: {res}"
        assert res["all_gather_ok"], f"all_gather wrong on rank {res['rank']}: {res}"
        assert res["broadcast_ok"], f"broadcast wrong on rank {res['rank']}: {res}"
        assert not res["max_passes_sum_checker"], f"SUM checker accepted a MAX reduction: {res}"


@pytest.fixture
def _gloo_on_loopback(monkeypatch):
    # Keep gloo on the loopback interface: hostname resolution on CI boxes can point at an unreachable
    # address. Spawned children inherit os.environ at start, and monkeypatch restores it afterwards.
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def test_sum_checker_rejects_wrong_sums():
    # The checker in isolation, no processes: the right sum passes, a sum missing one rank or with one
    # element nudged by 1e-3 does not.
    seed = secrets.randbelow(2**20)
    good = _sum_reference(seed, WORLD_SIZE).float()
    assert _check_sum(good, seed, WORLD_SIZE)[0]
    assert not _check_sum(_rank_tensor(seed, 0), seed, WORLD_SIZE)[0]
    nudged = good.clone()
    nudged[1, 5] += 1e-3
    assert not _check_sum(nudged, seed, WORLD_SIZE)[0]


@pytest.mark.usefixtures("_gloo_on_loopback")
def test_gloo_two_processes_collectives(tmp_path):
    _assert_world_ok(_run_world(tmp_path, "gloo"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")
def test_nccl_two_gpus_collectives(tmp_path):
    _assert_world_ok(_run_world(tmp_path, "nccl"))
