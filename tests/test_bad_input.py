"""Bad input to every command line: exit status 2 (or the documented one), one line on stderr naming the input and
what is accepted, no traceback, and no record or checkpoint lost or corrupted (issue 17).

``CASES`` is the one table: entry point, arguments, expected status and a piece of the expected message (plus an
optional check of what the case left behind). The cases of one entry point run in order in one interpreter
(``tests/_cli_runner.py``: ``runpy`` as ``python -m`` does, file descriptors 1 and 2 captured), so torch and jax
are imported once per entry point, not once per case; a few cases rely on an earlier one of their entry point
(the trainer's resume with another data set resumes the checkpoint its first case wrote). Placeholders in the
arguments (``{tmp}``, ``{good}``, ...) name the files of the ``world`` fixture. After all cases, the record file
and the checkpoints every case pointed at are byte for byte as they were.

Property-based tests (hypothesis) cover the calculator's flag parsing and the record reader: whatever the text,
a flag is parsed to a finite number in range or refused with a message, and a record file is read back exactly
or refused with a ValueError naming the line (never another exception).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.records import Record, append_records, read_records, timing_stats
from parallelism_calc import cli

REPO = Path(__file__).resolve().parent.parent
NO_CUDA = "no CUDA device is available"
TINY_TRAIN = ("--model tiny --seq-len 16 --batch-size 2 --epochs 1 --steps-per-epoch 2 --val-batches 1 "
              "--device cpu --no-progress --data {tmp}/a.npy --cache-dir {tmp}/cache")
TINY_STEP = "--model tiny --batch-size 1 --seq-len 8 --warmup 0 --steps 2 --device cpu"


def printed_records(result: dict, world: dict) -> None:
    """The records a benchmark could not write are on stdout, each one JSON line, readable as a Record."""
    lines = [line for line in result["stdout"].splitlines() if line.startswith("{")]
    assert lines, result["stdout"]
    assert all(Record.from_dict(json.loads(line)) for line in lines)


def diverged_record(name: str) -> Callable[[dict, dict], None]:
    def check(result: dict, world: dict) -> None:
        records = read_records(world["tmp"] / name)
        assert records and records[-1].status == "diverged" and "not finite" in records[-1].error
    return check


def no_index(result: dict, world: dict) -> None:
    """A refused report run leaves no partial output: the output folder holds nothing but its staging leftovers."""
    assert not any(p.name == "index.md" or p.suffix in (".md", ".png") for p in (world["tmp"] / "reports").rglob("*"))


def table_written(result: dict, world: dict) -> None:
    assert "| accumulator |" in (world["tmp"] / "new" / "folder" / "precision.md").read_text()


@dataclass(frozen=True, eq=False)  # hashed by identity: the outcomes are keyed by case
class Case:
    entry: str  # the module of `python -m`
    args: str  # formatted with the world's paths, then split like a shell
    message: str  # a piece of the one line on stderr (for status 2), or of stdout otherwise
    code: int = 2
    env: dict = field(default_factory=dict)
    check: Callable[[dict, dict], None] | None = None
    skip: str | None = None  # a reason to skip here


CALC, E2E, JAX_E2E, TRAIN = "parallelism_calc", "torch_impl.bench.e2e", "jax_impl.bench.e2e", "torch_impl.train"
PRECISION, ALLREDUCE, DDP = "torch_impl.bench.precision", "torch_impl.bench.allreduce", "torch_impl.bench.ddp"
LEADERBOARD = "torch_impl.bench.leaderboard"
ATTENTION, MATRIX = "torch_impl.bench.attention", "torch_impl.bench.train_matrix"
COLLECTIVES, JAX_TRAIN = "jax_impl.bench.collectives", "jax_impl.trainer"
TABLE, REPORTS = "analysis.table", "analysis.reports"  # TABLE: the old name of `REPORTS table`
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

CASES = [
    # the calculator (issue 17, item 7)
    Case(CALC, "strategies small --devices 4 --batch-tokens 0.5", "--batch-tokens: '0.5' is not a whole number"),
    Case(CALC, "strategies small --devices 4 --batch-tokens inf", "--batch-tokens: 'inf' is not a finite number"),
    Case(CALC, "collectives --bytes 1e9 --devices 2 --latency nan --json", "--latency: 'nan' is not a finite"),
    Case(CALC, "collectives --bytes inf --devices 2", "--bytes: 'inf' is not a finite number"),
    Case(CALC, "collectives --bytes 1e9 --devices 2 --bandwidth -1", "--bandwidth: '-1': must be > 0"),
    Case(CALC, "collectives --bytes 1e300 --devices 2 --bandwidth 1e-300 --json", "non-finite results"),
    Case(CALC, "small --explain --json", "--json: not allowed with argument --explain"),
    Case(CALC, "small --fsdp 4 --tp 3 --batch-tokens 16384", "the 12 devices (dp 1 x fsdp 4 x tp 3)"),
    Case(CALC, "small --fsdp 4 --tp 3", "FSDP x TP", code=0),  # the default batch fits the 12 devices
    Case(CALC, "small --seq-len 0", "--seq-len: '0': must be > 0"),
    Case(CALC, "small --prefetch-layers -1", "--prefetch-layers: '-1': must be >= 0"),
    # the step benchmark, both backends (items 3, 6)
    Case(E2E, "--sweep-seq-lens 128,0 --out {good}", "--sweep-seq-lens: '128,0': '0': must be > 0"),
    Case(E2E, "--sweep-seq-lens 128,abc --out {good}", "'abc' is not a number"),
    Case(E2E, "--sweep-seq-lens 12.5 --out {good}", "'12.5' is not a whole number"),
    Case(E2E, "--lr nan --out {good}", "--lr: 'nan' is not a finite number"),
    Case(E2E, "--batch-size 0 --out {good}", "--batch-size: '0': must be > 0"),
    Case(E2E, "--device cuda --out {good}", NO_CUDA, skip="cuda"),
    Case(E2E, "--out {file}/e2e.jsonl", "is a file, not a folder"),
    Case(E2E, "--out {ro}/e2e.jsonl", "not writable", skip="root"),
    Case(E2E, f"{TINY_STEP} --out /dev/full", "cannot write records to /dev/full", check=printed_records),
    Case(E2E, f"{TINY_STEP} --steps 3 --lr 1e30 --out {{tmp}}/diverged.jsonl", "diverged", code=1,
         check=diverged_record("diverged.jsonl")),
    Case(JAX_E2E, "--steps 0", "--steps: '0': must be > 0"),
    Case(JAX_E2E, f"{TINY_STEP} --out /dev/full", "cannot write records to /dev/full", check=printed_records),
    # the trainer (items 4, 6 and the tracebacks)
    Case(TRAIN, f"{TINY_TRAIN} --checkpoint-dir {{tmp}}/ck", "epoch 1/1", code=0),  # the checkpoint resumed below
    Case(TRAIN, f"{TINY_TRAIN} --checkpoint-dir {{tmp}}/ck --resume --data {{tmp}}/b.npy",
         "is not the data set the checkpoint"),
    Case(TRAIN, f"{TINY_TRAIN} --grad-clip nan", "--grad-clip: 'nan' is not a finite number"),
    Case(TRAIN, f"{TINY_TRAIN} --val-fraction 1.5", "--val-fraction: '1.5': must be > 0 and < 1"),
    Case(TRAIN, f"{TINY_TRAIN} --betas 0.9,nan", "each beta must be in [0, 1)"),
    Case(TRAIN, f"{TINY_TRAIN} --device cuda --dist bucketed", NO_CUDA, skip="cuda"),
    Case(TRAIN, f"{TINY_TRAIN} --resume --checkpoint-dir {{random_ck}}", "not a readable checkpoint index"),
    Case(TRAIN, f"{TINY_TRAIN} --resume --checkpoint-dir {{partial_ck}}", "__0_0.distcp missing"),
    Case(TRAIN, f"{TINY_TRAIN} --auto-resume --checkpoint-dir {{old_ck}}",
         "old format (shared.pt, rank-NNNNN.pt), which it no longer reads; it reads torch.distributed.checkpoint"),
    Case(TRAIN, f"{TINY_TRAIN} --out /dev/full", "cannot write records to /dev/full", check=printed_records),
    Case(TRAIN, f"{TINY_TRAIN} --lr 1e30 --steps-per-epoch 3 --out {{tmp}}/train_diverged.jsonl", "diverged",
         code=1, check=diverged_record("train_diverged.jsonl")),
    # the JAX trainer (issue 15, item 5)
    Case(JAX_TRAIN, f"{TINY_TRAIN} --grad-accum 0", "--grad-accum: '0': must be > 0"),
    Case(JAX_TRAIN, f"{TINY_TRAIN} --resume", "--resume needs --checkpoint-dir"),
    Case(JAX_TRAIN, f"{TINY_TRAIN} --resume --checkpoint-dir {{tmp}}/jax_empty", "no checkpoint in"),
    Case(JAX_TRAIN, f"{TINY_TRAIN} --lr 1e30 --steps-per-epoch 3 --out {{tmp}}/jax_diverged.jsonl", "diverged",
         code=1, check=diverged_record("jax_diverged.jsonl")),
    # the other benchmarks
    Case(PRECISION, "--table {tmp}/new/folder/precision.md", "accumulator", code=0, check=table_written),
    Case(PRECISION, "--out /dev/full", "cannot write records to /dev/full", check=printed_records),
    Case(PRECISION, "--device cuda", NO_CUDA, skip="cuda"),
    Case(PRECISION, "--table {file}/x.md", "is a file, not a folder"),
    Case(ALLREDUCE, "--sizes 1KB --out {good}", "needs 2 ranks or more"),
    Case(ALLREDUCE, "--backend nccl --sizes 1KB", "nccl needs CUDA", env={"WORLD_SIZE": "2", "RANK": "0"},
         skip="cuda"),
    Case(ALLREDUCE, "--backend gloo --sizes 1KB --timeout 5", "cannot start the process group at 127.0.0.1:{port}",
         env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"}),
    Case(ALLREDUCE, "--iters 0", "--iters: '0': must be > 0"),
    Case(DDP, "--bucket-mb nan --dist bucketed --out {good}", "every size must be finite and > 0"),
    Case(DDP, "--timeout 0 --out {good}", "--timeout: '0': must be > 0"),
    Case(DDP, "--device cuda --dist none --model tiny --out {good}", NO_CUDA, skip="cuda"),
    Case(LEADERBOARD, "--device cpu --model lm9b --out {good}", "unknown model preset 'lm9b'"),
    Case(LEADERBOARD, "--device cpu --model tiny --batch-size 3 --out {good}", "--batch-size 3 (global) is not "
         "divisible by the 2 ranks", env={"WORLD_SIZE": "2", "RANK": "0"}),
    Case(LEADERBOARD, "--device cpu --model tiny --nested-checkpoint --out {good}", "needs --ac-every K"),
    Case(LEADERBOARD, "--device cpu --model tiny --keep-attention --attention flash_triton --out {good}",
         "--keep-attention needs --ac-every K without --nested-checkpoint and --attention flash_triton"),
    Case(LEADERBOARD, "--device cpu --model tiny --keep-attention --ac-every 1 --out {good}",
         "--keep-attention needs --ac-every K"),
    Case(LEADERBOARD, "--device cpu --model tiny --layers 0", "--layers: '0': must be > 0"),
    Case(LEADERBOARD, "--device cpu --model tiny --dtype bf16_mixed --out {good}", "--dtype bf16_mixed with"),
    Case(LEADERBOARD, "--device cuda --model tiny --out {good}", "no CUDA device here", skip="cuda"),
    Case(CALC, "lm8b --loss cut", "--loss: invalid choice: 'cut'"),
    Case(ATTENTION, "--heads 0 --dry-run", "--heads: '0': must be > 0"),
    Case(ATTENTION, "--seq-lens 0,16 --dry-run", "--seq-lens: '0,16'"),
    Case(ATTENTION, "--report-only {tmp}/missing.jsonl", "missing.jsonl"),
    Case(MATRIX, "--nproc 0", "--nproc: '0': must be > 0"),
    Case(MATRIX, "--cell-timeout inf", "--cell-timeout: 'inf' is not a finite number"),
    Case(COLLECTIVES, "--iters 0", "--iters: '0': must be > 0"),
    Case(COLLECTIVES, "--out {file}/c.jsonl", "is a file, not a folder"),
    Case(COLLECTIVES, "--xla-options latency_hiding", "is not stock, tuned or xla_NAME=VALUE"),
    Case(COLLECTIVES, "--nccl {good}", "--nccl goes with --report-only"),
    # analysis (item 8)
    Case(REPORTS, "table {tmp}/metrics_list.jsonl", "field 'metrics' is list"),
    Case(REPORTS, "table {tmp}/future.jsonl", "schema_version 99: this code reads versions 1 to 1"),
    Case(REPORTS, "table {tmp}/wrong_type.jsonl", "field 'batch_size' is str"),
    Case(REPORTS, "table {tmp}/missing.jsonl", "no such file"),
    Case(TABLE, "{tmp}/missing.jsonl", "no such file"),
    Case(REPORTS, "{tmp}/wrong_suite --out {tmp}/reports", "lacks the metrics heads, head_dim, causal",
         check=no_index),
]


def _case_id(case: Case) -> str:
    return f"{case.entry.split('.')[-1]}: {case.args[:60]}"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """The files the cases point at: a good record file, checkpoints that cannot be resumed (random bytes; a
    chunk file missing; the earlier format), token files of equal size and different content, a file where a
    folder should be, a read-only folder, record files that break the schema, a busy port."""
    import torch

    from torch_impl import checkpoint as ckpt

    tmp = tmp_path_factory.mktemp("bad_input")
    good = tmp / "good.jsonl"
    append_records(good, [Record(suite="e2e", backend="torch", implementation="x", timing=timing_stats([1.0, 2.0])),
                          Record(suite="e2e", backend="jax", implementation="y", status="oom", error="out of memory")])
    random_ck = tmp / "random_ck" / "step-00000001"  # DCP's index file of random bytes
    random_ck.mkdir(parents=True)
    (random_ck / ".metadata").write_bytes(np.random.default_rng(0).bytes(4096))
    (random_ck / "__0_0.distcp").write_bytes(np.random.default_rng(1).bytes(4096))
    (random_ck.parent / "latest").write_text(random_ck.name)
    partial_ck = tmp / "partial_ck"  # a checkpoint whose chunk file is gone
    (ckpt.save_checkpoint(partial_ck, 1, trainer={"settings": {}}) / "__0_0.distcp").unlink()
    old_ck = tmp / "old_ck" / "step-00000001"  # this trainer's earlier format
    old_ck.mkdir(parents=True)
    torch.save({"world_size": 2, "step": 1, "settings": {}}, old_ck / "shared.pt")
    torch.save({"rng": None}, old_ck / "rank-00000.pt")
    (old_ck.parent / "latest").write_text(old_ck.name)
    rng = np.random.default_rng(2)
    np.save(tmp / "a.npy", rng.integers(0, 200, 4096, dtype=np.uint16))
    np.save(tmp / "b.npy", rng.integers(0, 200, 4096, dtype=np.uint16))  # same size, other tokens
    (tmp / "file").write_text("a file, not a folder\n")
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o555)
    record = Record(suite="e2e", backend="torch", implementation="x").to_dict()
    for name, change in (("metrics_list", {"metrics": [1, 2]}), ("future", {"schema_version": 99}),
                         ("wrong_type", {"batch_size": "eight"})):
        (tmp / f"{name}.jsonl").write_text(json.dumps({**record, **change}) + "\n")
    (tmp / "wrong_suite").mkdir()  # an e2e record filed under the attention suite
    append_records(tmp / "wrong_suite" / "runs.jsonl", Record(suite="attention", backend="torch",
                                                              implementation="x", timing=timing_stats([1.0])))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    yield {"tmp": tmp, "good": good, "random_ck": random_ck.parent, "partial_ck": partial_ck,
           "old_ck": old_ck.parent, "file": tmp / "file", "ro": tmp / "ro", "port": busy.getsockname()[1]}
    busy.close()


def _fill(text: str, world: dict) -> str:
    return text.format(**world)


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for path in paths:
        for p in sorted(path.rglob("*")) if path.is_dir() else [path]:
            h.update(str(p).encode() + (p.read_bytes() if p.is_file() else b""))
    return h.hexdigest()


@pytest.fixture(scope="module")
def outcomes(world, tmp_path_factory) -> dict:
    """Every case's {code, stdout, stderr}, keyed by the case: one interpreter per entry point, cases in order."""
    kept = [world["good"], world["random_ck"], world["partial_ck"], world["old_ck"]]
    before = _digest(*kept)
    results: dict[Case, dict] = {}
    folder = tmp_path_factory.mktemp("runner")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    for entry in dict.fromkeys(c.entry for c in CASES):
        cases = [c for c in CASES if c.entry == entry and _skip_reason(c) is None]
        if not cases:
            continue
        spec = [{"module": c.entry, "args": shlex.split(_fill(c.args, world)),
                 "env": {k: _fill(v, world) for k, v in c.env.items()}} for c in cases]
        (folder / "cases.json").write_text(json.dumps(spec))
        subprocess.run([sys.executable, str(REPO / "tests" / "_cli_runner.py"), str(folder / "cases.json"),
                        str(folder / "results.json")], cwd=world["tmp"], env=env, check=True, timeout=300)
        results.update(zip(cases, json.loads((folder / "results.json").read_text())))
    assert _digest(*kept) == before, "a case changed the record file or a checkpoint it pointed at"
    assert len(read_records(world["good"])) == 2
    return results


def _skip_reason(case: Case) -> str | None:
    if case.skip == "root" and IS_ROOT:
        return "root writes into read-only folders"
    if case.skip == "cuda":
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            import torch

            if torch.cuda.is_available():
                return "this machine has CUDA"
    return None


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bad_input(case: Case, outcomes, world) -> None:
    if (reason := _skip_reason(case)) is not None:
        pytest.skip(reason)
    result = outcomes[case]
    stderr = [line for line in result["stderr"].splitlines() if line.strip()]
    shown = f"status {result['code']}\nstdout: {result['stdout'][-1500:]}\nstderr: {result['stderr'][-3000:]}"
    assert result["code"] == case.code, shown
    assert "Traceback" not in result["stderr"], shown
    message = _fill(case.message, world)
    if case.code == 2:
        assert len(stderr) == 1, shown
        assert message in stderr[0], shown
    else:
        assert len(stderr) <= 1, shown  # a diverged run says so in one line, a good one says nothing
        assert message in result["stdout"] + result["stderr"], shown
    if case.check is not None:
        case.check(result, world)


# ----------------------------------------------------------------------------- properties


NUMBER_TEXT = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str),
                        st.text(max_size=12), st.sampled_from(["1e6", "0.5", "-0", "1_024", " 7 ", "nan", "-inf"]))


@given(NUMBER_TEXT)
def test_numeric_flags_parse_in_range_or_refuse(text: str) -> None:
    """Every flag type: a finite value in its range, or ArgumentTypeError (never another exception, never NaN)."""
    for parse, low, strict, kind in ((cli.positive_int, 0, True, int), (cli.nonnegative_int, 0, False, int),
                                     (cli.positive_float, 0, True, float), (cli.nonnegative_float, 0, False, float),
                                     (cli.fraction, 0, True, float), (cli.finite_float, -math.inf, False, float)):
        try:
            value = parse(text)
        except argparse.ArgumentTypeError as err:
            assert str(err)
            continue
        assert isinstance(value, kind) and math.isfinite(value)
        assert value > low if strict else value >= low
        assert math.isclose(value, float(text), rel_tol=1e-12)
        if parse is cli.fraction:
            assert value < 1


@given(st.lists(st.integers(min_value=-3, max_value=10**6), min_size=1, max_size=5))
def test_int_list_keeps_positive_lists_and_refuses_the_rest(values: list[int]) -> None:
    text = ",".join(map(str, values))
    if min(values) > 0:
        assert cli.int_list(text) == values
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="accepted: comma-separated integers > 0"):
            cli.int_list(text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(min_value=1, max_value=10**15), st.integers(min_value=1, max_value=64),
       st.floats(min_value=1e3, max_value=1e13), st.floats(min_value=0, max_value=1e-3))
def test_collectives_json_is_strict_and_agrees_with_its_inputs(capsys, nbytes, devices, bandwidth, latency):
    """Any valid inputs give strict JSON (``allow_nan`` off while parsing) whose times grow with the ring."""
    from parallelism_calc.__main__ import main

    assert main(["collectives", "--bytes", str(nbytes), "--devices", str(devices), "--bandwidth", repr(bandwidth),
                 "--latency", repr(latency), "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    ring = report["sections"][f"n{devices}"]["quantities"]
    expected = (devices - 1) / devices * nbytes / bandwidth + (devices - 1) * latency
    assert ring["all_gather"]["value"] == pytest.approx(expected)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=8)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(st.dictionaries(st.sampled_from(["suite", "backend", "implementation", "batch_size", "status", "error",
                                        "metrics", "timing", "schema_version", "world_size", "mfu", "bogus"]),
                       JSON_VALUES, max_size=6))
def test_record_reader_reads_back_or_names_the_line(tmp_path, changes: dict) -> None:
    """A record file with one record made arbitrary: read back exactly as written, or a ValueError naming the
    file and line 2; the good records around it never make it fail otherwise."""
    good = Record(suite="e2e", backend="torch", implementation="x").to_dict()
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, {**good, **changes}, good)))
    try:
        back = read_records(path)
    except ValueError as err:
        assert f"{path}:2: not a valid record" in str(err)
        return
    assert [r.to_dict() for r in back][1] == {**good, **changes}
