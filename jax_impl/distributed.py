"""Multi-host JAX: ``jax.distributed.initialize`` from the launcher's environment, when there is one.

``initialize_from_env()`` is called first by every JAX CLI, so the same command runs on one host or many:

* ``JAX_COORDINATOR_ADDRESS`` (host:port), ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``: explicit;
* torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` > 1, ``RANK``): the launcher the
  PyTorch side uses, coordinator port ``MASTER_PORT`` + 1 so it never collides with a torch store on the
  same port; with several processes per host (``LOCAL_WORLD_SIZE`` > 1) each one takes only its
  ``LOCAL_RANK``-th device, as torchrun's one-process-per-GPU convention has it;
* SLURM tasks (``srun``) with ``JAX_COORDINATOR_ADDRESS`` alone: that coordinator (the
  recipe ``scripts/slurm/jax.sbatch`` names its first node and a port), process ``SLURM_PROCID`` of
  ``SLURM_NTASKS``, taking its node's ``SLURM_LOCALID``-th device (one task per GPU, every GPU visible to each);
* SLURM (``SLURM_NTASKS`` > 1) or Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1): JAX's own cluster detection;
* otherwise nothing: a single process.

``JAX_DISTRIBUTED_TIMEOUT_S`` (default 300) bounds how long processes wait for each other at start-up, so a
missing host ends the job with JAX's error instead of a hang. After initialization ``jax.devices()`` lists
every host's devices; meshes from ``jax_impl.sharding.make_mesh`` span them, and only process 0 should
write results (``jax.process_index() == 0``). Calling it twice is harmless.

References: the JAX "Multi-process environments" guide (``jax.distributed.initialize`` and its cluster
auto-detection); torchrun's environment variables (PyTorch elastic docs).
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 300


@dataclass(frozen=True)
class ClusterEnv:
    """Where the coordinator is and who this process is; ``None`` fields: let JAX detect them."""

    source: str  # "jax", "torchrun", "slurm" or "auto" (JAX's SLURM / Open MPI detection)
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list[int] | None = None  # torchrun with several processes per host: [LOCAL_RANK]


def _int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} must be an integer") from None


def cluster_from_env(env: dict[str, str] | None = None) -> ClusterEnv | None:
    """The multi-process set-up the environment describes (module docstring), or None for one process."""
    env = dict(os.environ if env is None else env)
    explicit = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
    present = [name for name in explicit if name in env]
    if present == ["JAX_COORDINATOR_ADDRESS"] and "SLURM_NTASKS" in env:
        if _int(env, "SLURM_NTASKS") == 1:
            return None  # a job of one task: one process, nothing to join
        for name in ("SLURM_PROCID", "SLURM_LOCALID"):
            if name not in env:
                raise ValueError(f"JAX_COORDINATOR_ADDRESS and SLURM_NTASKS={env['SLURM_NTASKS']} set but {name} "
                                 "is not: run each process as a task of srun")
        return ClusterEnv("slurm", env["JAX_COORDINATOR_ADDRESS"], _int(env, "SLURM_NTASKS"),
                          _int(env, "SLURM_PROCID"), [_int(env, "SLURM_LOCALID")])
    if present:
        if len(present) != len(explicit):
            missing = sorted(set(explicit) - set(present))
            raise ValueError(f"{', '.join(present)} set but {', '.join(missing)} missing; set all three")
        return ClusterEnv("jax", env["JAX_COORDINATOR_ADDRESS"], _int(env, "JAX_NUM_PROCESSES"),
                          _int(env, "JAX_PROCESS_ID"))
    if "WORLD_SIZE" in env and _int(env, "WORLD_SIZE") > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
            if name not in env:
                raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} but {name} is not set (launch with torchrun)")
        address = f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT') + 1}"
        local = [_int(env, "LOCAL_RANK")] if _int_or(env, "LOCAL_WORLD_SIZE") > 1 and "LOCAL_RANK" in env else None
        return ClusterEnv("torchrun", address, _int(env, "WORLD_SIZE"), _int(env, "RANK"), local)
    if _int_or(env, "SLURM_NTASKS") > 1 or _int_or(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return ClusterEnv("auto")
    return None


def _int_or(env: dict[str, str], name: str, default: int = 1) -> int:
    return _int(env, name) if name in env else default


def initialize_from_env(env: dict[str, str] | None = None) -> ClusterEnv | None:
    """``jax.distributed.initialize`` for the environment's cluster (if any, and not yet done); returns it."""
    import jax

    cluster = cluster_from_env(env)
    if cluster is None or jax.distributed.is_initialized():
        return cluster
    timeout_s = int((env or os.environ).get("JAX_DISTRIBUTED_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if cluster.process_id == 0 and cluster.coordinator_address:
        check_coordinator_port(cluster)
    jax.distributed.initialize(coordinator_address=cluster.coordinator_address,
                               num_processes=cluster.num_processes, process_id=cluster.process_id,
                               local_device_ids=cluster.local_device_ids, initialization_timeout=timeout_s)
    return cluster


def check_coordinator_port(cluster: ClusterEnv) -> None:
    """Process 0 serves the coordinator on its address's port, on every interface (IPv4 and IPv6): a port already
    taken on either is a ValueError here, where JAX's service logs "Address already in use" and the process dies of
    a segmentation fault (seen once in four ``torchrun --standalone`` launches of two processes, whose MASTER_PORT
    + 1 was taken)."""
    port = int(cluster.coordinator_address.rsplit(":", 1)[1])
    for family, wildcard in ((socket.AF_INET, ""), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host: nothing to take there
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closing port is free
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((wildcard, port))
            except OSError as err:
                if err.errno != errno.EADDRINUSE:  # e.g. IPv6 switched off: not a taken port
                    continue
                how = "MASTER_PORT + 1" if cluster.source == "torchrun" else "JAX_COORDINATOR_ADDRESS"
                raise ValueError(f"the JAX coordinator's port {port} ({how}) is in use on this host: launch again "
                                 "(torchrun --standalone picks another port), or set JAX_COORDINATOR_ADDRESS="
                                 "host:PORT with a free port (and JAX_NUM_PROCESSES, JAX_PROCESS_ID)") from None


def process_layout() -> dict[str, int]:
    """How this run's devices are split into processes, for the records: the process count and this process's
    devices (one each under torchrun's one process a GPU)."""
    import jax

    return {"processes": jax.process_count(), "local_devices": jax.local_device_count()}
