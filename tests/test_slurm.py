"""The Slurm recipes (``scripts/slurm/*.sbatch``) rendered for 1, 2 and 16 nodes, their commands checked by the
launchers' own parsers, so a typo in a flag fails here and not on a cluster.

Each recipe runs under bash with a fake ``srun`` and ``scontrol`` first on PATH and the ``SLURM_*`` variables an
allocation sets: ``scontrol show hostnames`` prints the job's nodes, ``srun`` writes its arguments and environment to
a JSON file and exits. The torchrun line is parsed by ``torch.distributed.run.get_args_parser()`` and the trainer's
flags by ``torch_impl.train.build_parser()`` (then ``TrainConfig``, which refuses incompatible settings); the JAX
line by ``jax_impl.trainer.build_parser()`` (then ``JaxTrainConfig``), its mesh resolved over the job's GPUs, a
resume only from a complete orbax checkpoint, and every task's environment
by ``jax_impl.distributed.cluster_from_env`` (the coordinator, process id and device each task would take). The
README's ``sbatch`` lines are rendered the same way and its multi-node torchrun line parsed. Bad parameters end the
recipe with one line and status 2. Hermetic: no network, no real Slurm; about 5 s (the parsers' imports).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from jax_impl.trainer import JaxTrainConfig, build_parser as jax_train_parser
from jax_impl.distributed import ClusterEnv, cluster_from_env
from parallelism_calc.specs import ParallelSpec
from torch_impl.train import TrainConfig, build_parser as train_parser

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "scripts" / "slurm"
JOB_ID = 4242
PORT = 20000 + JOB_ID % 20000  # the recipes' default

FAKE_SRUN = """#!{python}
import json, os, sys
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
"""
FAKE_SCONTROL = """#!{python}
import os, sys
if sys.argv[1:] != ["show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]:
    sys.exit(f"fake scontrol: unexpected arguments {{sys.argv[1:]}}")
print("\\n".join(os.environ["FAKE_HOSTS"].split(",")))
"""


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fake_slurm")
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (folder / name).write_text(text.format(python=sys.executable))
        (folder / name).chmod(0o755)
    return folder


def _strict(parser):
    """``parser`` without prefix matching, so a misspelt flag that happens to abbreviate a real one fails too."""
    parser.allow_abbrev = False
    return parser


def _hosts(nodes: int) -> list[str]:
    return [f"gpu{i:03d}" for i in range(1, nodes + 1)]


def _render(fake_bin: Path, run_dir: Path, recipe: str, nodes: int, gpus: int, args: list[str], *,
            env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run ``recipe`` as the batch step of a ``nodes`` x ``gpus`` job; its exit and the srun calls it made."""
    log = run_dir.parent / f"srun_{run_dir.name}.jsonl"
    log.unlink(missing_ok=True)
    job = {"PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "HOME": str(run_dir.parent),
           "FAKE_SRUN_LOG": str(log), "FAKE_HOSTS": ",".join(_hosts(nodes)), "SLURM_JOB_ID": str(JOB_ID),
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": f"gpu[001-{nodes:03d}]" if nodes > 1 else "gpu001",
           "SLURM_GPUS_PER_NODE": f"h100:{gpus}", "SLURM_NTASKS_PER_NODE": str(gpus), "SLURM_SUBMIT_DIR": str(ROOT),
           "RUN_DIR": str(run_dir), "PYTHON": sys.executable, **(env or {})}
    job = {k: v for k, v in job.items() if v is not None}
    proc = subprocess.run(["bash", str(RECIPES / recipe), *args], cwd=run_dir.parent, env=job, capture_output=True,
                          text=True, timeout=30)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def _srun(call: dict) -> tuple[dict[str, str], list[str]]:
    """The srun options a recipe passed (all of the ``--name=value`` form) and the command it runs."""
    argv = call["argv"]
    split = next(i for i, a in enumerate(argv) if not a.startswith("--"))
    options = dict(a[2:].split("=", 1) for a in argv[:split])
    assert set(options) <= {"nodes", "ntasks-per-node", "kill-on-bad-exit"}, options
    return options, argv[split:]


def _one_srun(proc: subprocess.CompletedProcess, calls: list[dict]) -> tuple[dict[str, str], list[str], dict]:
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 1, calls
    options, command = _srun(calls[0])
    return options, command, calls[0]["env"]


def _parse_torchrun(command: list[str]):
    """torchrun's arguments and the trainer's, each by its own parser; the trainer's settings must fit together."""
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"], command
    launcher = _strict(get_args_parser()).parse_args(command[3:])
    assert launcher.module and launcher.training_script == "torch_impl.train"
    trainer = _strict(train_parser()).parse_args(launcher.training_script_args)
    TrainConfig(**vars(trainer))  # settings the trainer accepts together
    return launcher, trainer


def _parse_jax(command: list[str]) -> JaxTrainConfig:
    """The JAX trainer's run, parsed by its own parser; its settings must fit together."""
    assert command[:3] == [sys.executable, "-m", "jax_impl.trainer"], command
    return JaxTrainConfig(**vars(_strict(jax_train_parser()).parse_args(command[3:])))


def _torch_job(fake_bin, run_dir, nodes, gpus, args, env=None):
    """The torchrun and trainer arguments of torch.sbatch for ``nodes`` x ``gpus`` (checked by their parsers)."""
    options, command, job_env = _one_srun(*_render(fake_bin, run_dir, "torch.sbatch", nodes, gpus, args, env=env))
    port = (env or {}).get("PORT", PORT)
    assert options == {"nodes": str(nodes), "ntasks-per-node": "1", "kill-on-bad-exit": "1"}  # a torchrun per node
    launcher, trainer = _parse_torchrun(command)
    assert (launcher.nnodes, launcher.nproc_per_node) == (str(nodes), str(gpus))
    assert (launcher.rdzv_backend, launcher.rdzv_endpoint, launcher.rdzv_id) == ("c10d", f"gpu001:{port}", str(JOB_ID))
    assert job_env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert job_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a fresh store for each restart (pytorch#135712)
    return launcher, trainer


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_torch_recipe_runs_a_torchrun_per_node(fake_bin, tmp_path, nodes):
    run_dir = tmp_path / "run"
    _, trainer = _torch_job(fake_bin, run_dir, nodes, 8, ["--model", "small", "--seq-len", "512"])
    assert (trainer.model, trainer.seq_len, trainer.dist) == ("small", 512, "fsdp")  # the recipe's default mode
    assert (trainer.out, trainer.checkpoint_dir, trainer.resume, trainer.auto_resume) == (
        f"{run_dir}/train.jsonl", f"{run_dir}/checkpoints", False, True)  # resumes when a checkpoint is there


def test_torch_recipe_resumes_and_passes_launcher_flags(fake_bin, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step-00000100")
    launcher, trainer = _torch_job(fake_bin, run_dir, 2, 4, ["--dist", "bucketed", "--bucket-mb", "100"],
                                   env={"TORCHRUN_ARGS": "--max-restarts 3", "PORT": "31000"})
    assert launcher.max_restarts == 3
    assert trainer.auto_resume and (trainer.dist, trainer.bucket_mb) == ("bucketed", 100.0)  # the user's flags win


@pytest.mark.parametrize("nodes, gpus", [(1, 1), (1, 8), (2, 8), (16, 8)])
def test_jax_recipe_runs_a_process_per_gpu(fake_bin, tmp_path, nodes, gpus):
    run_dir = tmp_path / "run"
    options, command, env = _one_srun(*_render(fake_bin, run_dir, "jax.sbatch", nodes, gpus,
                                               ["--model", "xl", "--dtype", "bf16"]))
    assert options == {"nodes": str(nodes), "ntasks-per-node": str(gpus), "kill-on-bad-exit": "1"}
    trainer = _parse_jax(command)
    assert (trainer.model, trainer.dtype, trainer.out, trainer.checkpoint_dir, trainer.resume) == (
        "xl", "bf16", f"{run_dir}/train.jsonl", f"{run_dir}/checkpoints", False)
    assert ParallelSpec.parse(trainer.mesh).resolve(nodes * gpus).fsdp == nodes * gpus  # one mesh over every GPU
    ntasks = nodes * gpus
    for task in sorted({0, gpus - 1, ntasks - 1}):  # what srun's tasks would see
        task_env = {**env, "SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % gpus)}
        expected = ClusterEnv("slurm", f"gpu001:{PORT}", ntasks, task, [task % gpus]) if ntasks > 1 else None
        assert cluster_from_env(task_env) == expected


def test_jax_recipe_resumes_from_a_complete_checkpoint_only(fake_bin, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "40.orbax-checkpoint-tmp-17").mkdir(parents=True)  # a save that was killed
    render = functools.partial(_render, fake_bin, run_dir, "jax.sbatch", 2, 8, ["--model", "small"])
    assert not _parse_jax(_one_srun(*render())[1]).resume
    (run_dir / "checkpoints" / "20").mkdir()
    assert _parse_jax(_one_srun(*render())[1]).resume


def test_readme_lines_render_and_parse(fake_bin, tmp_path):
    lines = re.findall(r"^(RUN_DIR=\S+ sbatch .*scripts/slurm/\w+\.sbatch.*)$", (ROOT / "README.md").read_text(),
                       re.MULTILINE)
    assert {re.search(r"scripts/slurm/(\w+\.sbatch)", line)[1] for line in lines} == {"torch.sbatch", "jax.sbatch"}
    for i, line in enumerate(lines):
        words = shlex.split(line)[2:]  # after RUN_DIR=... sbatch
        split = next(j for j, w in enumerate(words) if w.startswith("scripts/slurm/"))
        flags = dict(zip(words[:split:2], words[1:split:2]))
        nodes, gpus = int(flags.pop("--nodes")), int(flags.pop("--gpus-per-node"))
        assert flags in ({}, {"--ntasks-per-node": str(gpus)}), line
        recipe, args = Path(words[split]).name, words[split + 1:]
        proc, calls = _render(fake_bin, tmp_path / f"run{i}", recipe, nodes, gpus, args,
                              env={"SLURM_NTASKS_PER_NODE": flags.get("--ntasks-per-node")})
        _, command, _ = _one_srun(proc, calls)
        _parse_torchrun(command) if recipe == "torch.sbatch" else _parse_jax(command)
    by_hand = re.findall(r"^torchrun --nnodes .*$", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert by_hand
    for line in by_hand:  # the launch without Slurm
        _parse_torchrun([sys.executable, "-m", "torch.distributed.run", *shlex.split(line)[1:]])


@pytest.mark.parametrize("recipe, env, args, message", [
    ("torch.sbatch", {"RUN_DIR": None}, [], "set RUN_DIR to a folder on shared storage"),
    ("torch.sbatch", {"SLURM_JOB_ID": None}, [], "not inside a Slurm job"),
    ("torch.sbatch", {"SLURM_GPUS_PER_NODE": None}, [], "submit with --gpus-per-node G"),
    ("jax.sbatch", {"GPUS_PER_NODE": "two"}, [], "GPUs per node 'two' unknown or not a positive integer"),
    ("torch.sbatch", {"PORT": "70000"}, [], "PORT=70000 is not a TCP port"),
    ("torch.sbatch", {"REPO": "/nonexistent"}, [], "no repository at REPO=/nonexistent"),
    ("torch.sbatch", {}, ["--model", "tiny", "--out=x.jsonl"], "--out is set by the recipe"),
    ("torch.sbatch", {}, ["--checkpoint-dir", "ck"], "--checkpoint-dir is set by the recipe"),
    ("jax.sbatch", {"SLURM_NTASKS_PER_NODE": "1"}, [], "one task per GPU: submit with --ntasks-per-node 8 (now 1)"),
    ("jax.sbatch", {}, ["--resume"], "--resume is set by the recipe"),
    ("torch.sbatch", {}, ["--auto-resume"], "--auto-resume is set by the recipe"),
])
def test_bad_parameters_end_the_job_in_one_line(fake_bin, tmp_path, recipe, env, args, message):
    proc, calls = _render(fake_bin, tmp_path / "run", recipe, 2, 8, args, env=env)
    assert proc.returncode == 2 and not calls, (proc.returncode, calls)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"scripts/slurm/{recipe}: error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
