"""Run a function on N gloo ranks on the CPU, with deadlines, and bring back each rank's result or traceback.

    from tests._dist import run_ranks, run_ranks_outcomes

    def _body(rank, world_size, seed):          # module level, so that spawn can pickle it by name
        ...                                      # the default gloo group is initialized here
        return {"params": [p.detach() for p in model.parameters()]}   # anything picklable (CPU tensors ok)

    results = run_ranks(_body, 2, seed, timeout_s=60)   # [result of rank 0, result of rank 1]

``run_ranks(fn, world_size, *args, timeout_s=60, pg_timeout_s=20)`` spawns ``world_size`` fresh processes
(``torch.multiprocessing`` with the spawn start method, so nothing of the parent's torch state is shared).
Each child sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR=127.0.0.1 / MASTER_PORT (a free port) and
``GLOO_SOCKET_IFNAME=lo``, uses one intra-op thread, initializes the default group through our
``torch_impl.distributed.init_distributed(backend="gloo", device="cpu", timeout_s=pg_timeout_s)``, calls
``fn(rank, world_size, *args)``, writes ``("ok", result)`` or ``("error", traceback)`` to a pickle file, and
then destroys the group. The parent polls with a wall-clock deadline ``timeout_s``; at the deadline it kills
the children that are still alive. ``run_ranks`` raises ``RankFailure`` (an ``AssertionError``, so pytest
prints it as a test failure) carrying every failed rank's traceback, or the ranks that timed out / died.

``run_ranks_outcomes(...)`` takes the same arguments but never raises for a child's failure: it returns one
``RankOutcome(rank, result, error, exitcode, timed_out)`` per rank, for tests where a rank is *meant* to
fail (e.g. rank 1 raises or ``os._exit``s before a collective, and rank 0 must get an exception from the
group's timeout instead of hanging; keep ``pg_timeout_s`` well under ``timeout_s`` for those).

``run_launchers(commands, env=..., cwd=..., timeout_s=...)`` starts several command lines side by side (e.g. two
``torchrun --nnodes 2 --node-rank 0|1`` launchers, two "nodes" on one host), each in its own process group, and
returns each one's ``(returncode, output)``; at the deadline it kills every group still running and raises
``RankFailure`` with their output, so a stuck rendezvous ends the test with a message instead of a hang.

Caveats: ``fn`` and ``args`` must be picklable (functions at module level of an importable module: the
``tests`` folder is a package, so ``tests.test_x._body`` works). Each spawned child imports torch
(~1-2 s). A port taken between choosing it and binding it is retried with a fresh port (up to 3 tries).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

from torch_impl.distributed.process_group import free_port  # the tests take it from here too

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_PG_TIMEOUT_S = 20.0
_PORT_TRIES = 3
_PORT_ERRORS = ("address already in use", "eaddrinuse")


class RankFailure(AssertionError):
    """One or more ranks raised, died or timed out; the message holds every rank's story."""


@dataclass
class RankOutcome:
    rank: int
    result: Any = None  # fn's return value (when error is None and not timed_out)
    error: str | None = None  # the child's traceback, or a description of how it died
    exitcode: int | None = None  # the process's exit code (None if it had to be killed)
    timed_out: bool = False  # still alive at the deadline (and killed)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def _child(rank: int, world_size: int, port: int, out_dir: str, pg_timeout_s: float,
           fn: Callable[..., Any], args: tuple, backend: str = "gloo") -> None:
    """Runs in each spawned process (index = rank)."""
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
    })
    outcome: tuple[str, Any]
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share a small CI machine
        from torch_impl.distributed import init_distributed

        init_distributed(backend=backend, timeout_s=pg_timeout_s, device="cpu" if backend == "gloo" else None)
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt/SystemExit
        outcome = ("error", traceback.format_exc())
    path = Path(out_dir, f"rank{rank}.pkl")
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - an unpicklable result is a failure, not a crash
        payload = pickle.dumps(("error", f"rank {rank}: result is not picklable:\n{traceback.format_exc()}"))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(payload)
    tmp.rename(path)  # atomic: the parent never reads half a file
    try:
        import torch.distributed as dist

        if dist.is_initialized() and outcome[0] == "ok":
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already written
        pass


def _run_once(fn, world_size, args, timeout_s, pg_timeout_s, backend) -> list[RankOutcome]:
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as out_dir:
        ctx = mp.start_processes(_child, args=(world_size, free_port(), out_dir, pg_timeout_s, fn, args, backend),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        procs = ctx.processes
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [p.is_alive() for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        outcomes = []
        for rank, p in enumerate(procs):
            path = Path(out_dir, f"rank{rank}.pkl")
            outcome = RankOutcome(rank, exitcode=None if alive[rank] else p.exitcode, timed_out=alive[rank])
            if path.exists():
                status, value = pickle.loads(path.read_bytes())
                if status == "ok":
                    outcome.result = value
                else:
                    outcome.error = value
            elif alive[rank]:
                outcome.error = f"rank {rank} was still running after {timeout_s:g}s and was killed"
            else:
                outcome.error = f"rank {rank} died with exit code {p.exitcode} without reporting a result"
            if outcome.timed_out and outcome.error is None:  # reported, then hung in teardown
                outcome.timed_out = False
            outcomes.append(outcome)
        return outcomes


def run_ranks_outcomes(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                       pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S, backend: str = "gloo") -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend`` (gloo on the CPU, or nccl with
    rank r on cuda:r); one ``RankOutcome`` per rank."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    for attempt in range(_PORT_TRIES):
        outcomes = _run_once(fn, world_size, args, timeout_s, pg_timeout_s, backend)
        port_clash = any(o.error and any(s in o.error.lower() for s in _PORT_ERRORS) for o in outcomes)
        if not port_clash:
            break
    return outcomes


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
              pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend`` (gloo, or nccl with rank r on
    cuda:r); the list of results by rank.

    Raises ``RankFailure`` with every failed rank's traceback if any rank raised, died or timed out.
    """
    outcomes = run_ranks_outcomes(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s,
                                  backend=backend)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        name = getattr(fn, "__qualname__", repr(fn))
        parts = [f"rank {o.rank}{' (timed out)' if o.timed_out else ''}:\n{o.error}" for o in failed]
        raise RankFailure(f"{len(failed)} of {world_size} ranks failed in {name}:\n\n" + "\n\n".join(parts))
    return [o.result for o in outcomes]


def run_launchers(commands: list[list[str]], *, env: dict[str, str], cwd: str | os.PathLike,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> list[tuple[int, str]]:
    """Run ``commands`` side by side, each in a new process group; ``(returncode, stdout + stderr)`` of each.

    Raises ``RankFailure`` with every command's output so far if any is still running after ``timeout_s``
    (all their process groups are killed first, the launchers' workers included)."""
    with tempfile.TemporaryDirectory(prefix="launchers_") as folder:
        logs = [open(Path(folder, f"launcher{i}.log"), "w+") for i in range(len(commands))]
        procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                 for cmd, log in zip(commands, logs)]
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            stuck = [i for i, p in enumerate(procs) if p.poll() is None]
            for p in procs:  # a finished launcher's group may still hold orphaned workers
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in procs:
                p.wait(5)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    if stuck:
        raise RankFailure(f"launchers {stuck} still running after {timeout_s:g}s and killed:\n\n"
                          + "\n\n".join(f"launcher {i}: {' '.join(commands[i])}\n{outputs[i][-3000:]}"
                                          for i in range(len(commands))))
    return [(p.returncode, out) for p, out in zip(procs, outputs)]
