"""``python -m jax_impl.bench.e2e`` on meshes of the 8 fake CPU devices, and multi-process JAX.

Checked: a train step on meshes dp=2 x fsdp=2 x tp=2 and fsdp=4 x tp=2 gives the 1-device losses (fp32,
rel. 1e-5) and a record with the mesh, world size 8, per-device TFLOP/s (step FLOPs / 8), the compiled
step's memory analysis and parallelism_calc's prediction; forward and forward_backward modes run on a
mesh; ``--profile`` writes a trace; bad meshes are one-line errors; ``cluster_from_env`` reads the
launchers' variables; and two processes joined by ``jax.distributed`` (2 CPU devices each, gloo
collectives) train on one 4-device mesh to the same losses as one process with 4 devices, process 0
alone writing the record.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

from analysis.records import read_records  # noqa: E402
from jax_impl.bench import e2e as jax_e2e  # noqa: E402
from jax_impl.device import max_over_processes  # noqa: E402
from jax_impl.distributed import ClusterEnv, cluster_from_env  # noqa: E402
from parallelism_calc.compute import step_flops  # noqa: E402
from parallelism_calc.specs import MODELS  # noqa: E402
from tests._dist import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--model", "tiny", "--batch-size", "8", "--seq-len", "16", "--warmup", "1", "--steps", "2",
         "--device", "cpu"]


def _run(tmp_path: Path, *extra: str) -> "jax_e2e.Record":
    out = tmp_path / "runs.jsonl"
    before = len(read_records(out)) if out.exists() else 0
    assert jax_e2e.main([*FLAGS, *extra, "--out", str(out)]) == 0
    records = read_records(out)
    assert len(records) == before + 1
    return records[-1]


def test_meshes_train_like_one_device(tmp_path):
    seed = str(np.random.SeedSequence().entropy % 1000)
    single = _run(tmp_path, "--seed", seed)
    assert single.world_size == 1 and single.mesh == {"dp": 1, "fsdp": 1, "tp": 1}
    assert single.metrics["back_to_back_mean_ms"] > 0
    for mesh, degrees, strategy in (("dp=2,fsdp=2,tp=2", (2, 2, 2), "fsdp_tp"), ("fsdp=4,tp=2", (1, 4, 2), "fsdp_tp")):
        run = _run(tmp_path, "--seed", seed, "--mesh", mesh)
        np.testing.assert_allclose(run.metrics["losses"], single.metrics["losses"], rtol=1e-5, err_msg=mesh)
        assert run.world_size == 8 and run.mesh == dict(zip(("dp", "fsdp", "tp"), degrees))
        assert run.metrics["strategy"] == strategy
        assert run.implementation == f"jit naive {strategy}"
        flops = step_flops(MODELS["tiny"], 8, 16, "train_step")
        assert run.flops_per_step == flops
        assert run.tflops == pytest.approx(flops / 8 / (run.timing["median_ms"] / 1e3) / 1e12)
        memory = run.metrics["compiled_memory"]
        assert memory["estimate_bytes"] == memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
        assert memory["alias"] > 0  # parameters and optimizer state are donated
        assert run.metrics["predicted_memory_bytes"] > 0 and run.metrics["predicted_strategy"] == "fsdp_tp"
    # Sharding divides the per-device state: the compiled step's arguments shrink with the mesh.
    assert run.metrics["compiled_memory"]["argument"] < single.metrics["compiled_memory"]["argument"] / 2


def test_forward_modes_profile_and_errors(tmp_path):
    forward = _run(tmp_path, "--mode", "forward", "--mesh", "fsdp=-1")
    backward = _run(tmp_path, "--mode", "forward_backward", "--mesh", "dp=4,tp=2", "--remat",
                    "--profile", str(tmp_path / "trace"))
    assert forward.mesh == {"dp": 1, "fsdp": 8, "tp": 1} and forward.metrics["strategy"] == "fsdp"
    assert forward.metrics["loss_first"] == forward.metrics["loss_last"]  # nothing trains
    assert backward.metrics["strategy"] == "tp" and backward.implementation == "jit naive remat tp"
    assert backward.metrics["loss_first"] == pytest.approx(forward.metrics["loss_first"], rel=1e-5)
    assert any(p.is_file() for p in (tmp_path / "trace").rglob("*"))
    for mesh, message in (("dp=3", "needs 3 devices|not divisible"), ("pp=2", "cannot parse mesh"),
                          ("dp=16", "needs 16 devices")):
        with pytest.raises(SystemExit, match=message):
            jax_e2e.main([*FLAGS, "--mesh", mesh])
    with pytest.raises(SystemExit, match="names one device"):
        jax_e2e.main([*FLAGS[:-1], "cuda:0", "--mesh", "dp=2"])


def test_cluster_from_env():
    assert cluster_from_env({}) is None
    assert cluster_from_env({"WORLD_SIZE": "1", "RANK": "0"}) is None
    assert cluster_from_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}) \
        == ClusterEnv("jax", "h:1", 4, 3)
    torchrun = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "WORLD_SIZE": "8", "RANK": "5",
                "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert cluster_from_env(torchrun) == ClusterEnv("torchrun", "node0:29501", 8, 5, [1])
    assert cluster_from_env({"SLURM_NTASKS": "2"}) == ClusterEnv("auto")
    srun_task = {"JAX_COORDINATOR_ADDRESS": "gpu001:24242", "SLURM_NTASKS": "16", "SLURM_PROCID": "9",
                 "SLURM_LOCALID": "1"}  # scripts/slurm/jax.sbatch's tasks (tests/test_slurm.py renders it)
    assert cluster_from_env(srun_task) == ClusterEnv("slurm", "gpu001:24242", 16, 9, [1])
    with pytest.raises(ValueError, match="SLURM_LOCALID is not: run each process as a task of srun"):
        cluster_from_env({k: v for k, v in srun_task.items() if k != "SLURM_LOCALID"})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID missing"):
        cluster_from_env({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        cluster_from_env({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"})


def test_two_processes_train_one_mesh_like_one_process(tmp_path):
    seed = str(np.random.SeedSequence().entropy % 1000)
    flags = [*FLAGS, "--seed", seed, "--mesh", "fsdp=2,tp=2"]
    out = tmp_path / "two.jsonl"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": "2", "JAX_DISTRIBUTED_TIMEOUT_S": "60"}
    procs = [subprocess.Popen([sys.executable, "-m", "jax_impl.bench.e2e", *flags, "--out", str(out)],
                              env={**env, "JAX_PROCESS_ID": str(i)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    (two,) = read_records(out)  # process 0 alone writes
    one = _run(tmp_path, "--seed", seed, "--mesh", "fsdp=2,tp=2")
    assert two.world_size == one.world_size == 4
    np.testing.assert_allclose(two.metrics["losses"], one.metrics["losses"], rtol=1e-5)



@pytest.mark.parametrize("peaks", [[43_860_483_840, 939_908_864], [6_465_513_472, 0], [2**31 - 1, 2**31], [5, -1]])
def test_peak_memory_over_processes_keeps_64_bits(peaks):
    """The worst process's peak gathered as JAX's multi-process gather carries it: each process's array through
    ``jnp.asarray``, 32-bit without x64 (the old int64 gather brought a 43.9 GB peak back as 0.9 GB from two GPU
    processes, results/profiles/jax_memory_probe_2xh200_d0bff64.txt); -1 (no memory stats somewhere): unknown."""
    import jax.numpy as jnp

    sent = []

    def gather(local):  # this process's array, then every process's, stacked as JAX's gather returns them
        sent.append(np.asarray(jnp.asarray(local)))
        return np.stack(sent)

    for value in peaks[:-1]:
        max_over_processes(value, gather)
    assert max_over_processes(peaks[-1], gather) == (-1 if -1 in peaks else max(peaks))


@pytest.mark.parametrize("family", ["AF_INET", "AF_INET6"])
def test_a_taken_coordinator_port_is_one_line_not_a_crash(family):
    """Process 0 of a torchrun launch serves JAX's coordinator on MASTER_PORT + 1 (IPv4 and IPv6); taken on either,
    that port is a ValueError before ``jax.distributed.initialize`` (whose service died of a segmentation fault on
    a 2-GPU machine)."""
    import socket

    from jax_impl.distributed import initialize_from_env

    try:
        taken = socket.socket(getattr(socket, family), socket.SOCK_STREAM)
    except OSError:
        pytest.skip(f"no {family} on this host")
    with taken:
        if family == "AF_INET6":
            taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::" if family == "AF_INET6" else "", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port - 1), "WORLD_SIZE": "2", "RANK": "0",
               "JAX_DISTRIBUTED_TIMEOUT_S": "5"}  # were the check gone: JAX's own failure, soon
        with pytest.raises(ValueError, match=rf"^the JAX coordinator's port {port} \(MASTER_PORT \+ 1\) is in use"):
            initialize_from_env(env)
