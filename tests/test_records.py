"""Tests for analysis.records: JSON Lines round trip, validation, error locations, a truncated last line (set
aside by the writer, skipped by the reader), timing statistics, provenance, and that importing the module
stays stdlib-only."""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from analysis.records import SETTINGS_PREFIXES, Record, append_records, provenance, read_records, timing_stats

REPO = Path(__file__).resolve().parent.parent


def random_record(rng: random.Random, **overrides) -> Record:
    """A record with fresh random values in every kind of field (scalars, nested dicts, metrics)."""
    fields = dict(
        suite=rng.choice(["e2e", "attention", "allreduce"]),
        backend=rng.choice(["torch", "jax"]),
        implementation=f"impl-{rng.randrange(10**6)}",
        model=rng.choice(["small", "medium", None]),
        model_dims={"d_model": rng.choice([64, 768]), "n_layers": rng.randrange(1, 48)},
        batch_size=rng.randrange(1, 512),
        seq_len=rng.choice([128, 1024, 8192]),
        dtype=rng.choice(["fp32", "bf16"]),
        mode="train_step",
        world_size=8,
        mesh={"dp": 2, "fsdp": 2, "tp": 2},
        warmup_steps=rng.randrange(5),
        timed_steps=rng.randrange(1, 50),
        timing=timing_stats(rng.uniform(1, 100) for _ in range(5)),
        phases={"forward": timing_stats([rng.uniform(1, 10)])},
        tokens_per_s=rng.uniform(1e3, 1e7),
        flops_per_step=rng.uniform(1e12, 1e16),
        tflops=rng.uniform(1, 900),
        mfu=rng.random(),
        peak_memory_bytes=rng.randrange(2**40),
        metrics={"loss": rng.uniform(0, 10), "note": "x" * rng.randrange(1, 5)},
    )
    fields.update(overrides)
    return Record(**fields)


def test_round_trip_appends_and_reads_back(tmp_path: Path) -> None:
    rng = random.Random()
    first = [random_record(rng), random_record(rng, status="oom", error="out of memory", timing=None)]
    second = random_record(rng)
    path = tmp_path / "sub" / "runs.jsonl"
    append_records(path, first)
    append_records(path, second)  # a single record appends too, after the first batch
    back = read_records(path)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in [*first, second]]
    assert back[0].median_ms == first[0].timing["median_ms"]
    assert back[1].median_ms is None
    assert len(path.read_text().splitlines()) == 3


def test_failed_record_requires_message() -> None:
    for status in ("oom", "error"):
        with pytest.raises(ValueError, match="needs an error message"):
            Record(suite="e2e", backend="torch", implementation="sdpa", status=status)
    record = Record(suite="e2e", backend="jax", implementation="flax", status="oom", error="RESOURCE_EXHAUSTED")
    assert record.error == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize(
    ("field", "value"), [("backend", "tensorflow"), ("backend", "Torch"), ("status", "failed"), ("status", "OK")]
)
def test_invalid_backend_or_status_rejected(field: str, value: str) -> None:
    fields = {"suite": "e2e", "backend": "torch", "implementation": "sdpa", field: value}
    with pytest.raises(ValueError, match=f"Record.{field}="):
        Record(**fields)


def test_unknown_field_rejected() -> None:
    data = Record(suite="e2e", backend="torch", implementation="sdpa").to_dict()
    with pytest.raises(ValueError, match="unknown fields \\['colour'\\]"):
        Record.from_dict({**data, "colour": "red"})


@pytest.mark.parametrize("bad_line", ["{not json", '{"suite": "e2e"}', '{"suite": "e2e", "backend": "mxnet", '
                                      '"implementation": "x"}', "[1, 2]"])  # fmt: skip
def test_malformed_line_names_file_and_line(tmp_path: Path, bad_line: str) -> None:
    path = tmp_path / "runs.jsonl"
    append_records(path, random_record(random.Random()))
    with path.open("a") as f:
        f.write("\n" + bad_line + "\n")  # a blank line is skipped but still counted
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:3: not a valid record"):
        read_records(path)


def _write_truncated(path: Path, rng: random.Random) -> tuple[list[Record], str]:
    """Two good records, then a third cut mid-line (a writer killed, a full disk); returns them and the cut."""
    good = [random_record(rng), random_record(rng)]
    append_records(path, good)
    line = json.dumps(random_record(rng).to_dict(), sort_keys=True)
    fragment = line[: rng.randrange(1, len(line) - 1)]
    with path.open("a") as f:
        f.write(fragment)
    return good, fragment


def test_append_after_a_truncated_last_line_sets_it_aside(tmp_path: Path, capsys) -> None:
    """Issue 17, item 2: the new record is not glued onto the broken line; the fragment is kept and reported."""
    rng = random.Random()
    path = tmp_path / "runs.jsonl"
    good, fragment = _write_truncated(path, rng)
    new = random_record(rng)
    append_records(path, new)
    corrupt = tmp_path / "runs.jsonl.corrupt"
    assert capsys.readouterr().err == f"{path}:3: a truncated last line ({len(fragment)} bytes) moved to {corrupt}\n"
    assert corrupt.read_text() == fragment + "\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is whole again: read without a warning
        back = read_records(path)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in [*good, new]]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 3


def test_reader_skips_a_truncated_last_line_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    good, _ = _write_truncated(path, random.Random())
    with pytest.warns(UserWarning, match=f"^{re.escape(str(path))}:3: skipped a truncated last line"):
        back = read_records(path)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in good]


def test_a_broken_line_in_the_middle_is_still_refused(tmp_path: Path) -> None:
    """What the old writer left: a fragment glued onto the next record, with records after it."""
    rng = random.Random()
    path = tmp_path / "runs.jsonl"
    _write_truncated(path, rng)
    with path.open("a") as f:
        f.write(json.dumps(random_record(rng).to_dict()) + "\n")
    append_records(path, random_record(rng))
    assert not (tmp_path / "runs.jsonl.corrupt").exists()  # the file ends with a newline: nothing to set aside
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:3: not a valid record"):
        read_records(path)


def test_a_whole_last_line_without_newline_only_gets_one(tmp_path: Path) -> None:
    rng = random.Random()
    path = tmp_path / "runs.jsonl"
    first, second = random_record(rng), random_record(rng)
    path.write_text(json.dumps(first.to_dict()))  # valid, written by hand without the final newline
    append_records(path, second)
    assert [r.to_dict() for r in read_records(path)] == [first.to_dict(), second.to_dict()]
    assert not (tmp_path / "runs.jsonl.corrupt").exists()


def test_timing_stats_against_hand_computation() -> None:
    stats = timing_stats([10.0, 1.0, 3.0, 2.0])
    # sorted 1, 2, 3, 10: median (2 + 3) / 2; mean 16 / 4; deviations -3, -2, -1, 6 -> sample var 50 / 3
    assert stats == pytest.approx(
        {"median_ms": 2.5, "mean_ms": 4.0, "std_ms": math.sqrt(50 / 3), "min_ms": 1.0, "max_ms": 10.0}
    )
    assert timing_stats(iter([7.5])) == {"median_ms": 7.5, "mean_ms": 7.5, "std_ms": 0.0, "min_ms": 7.5, "max_ms": 7.5}
    with pytest.raises(ValueError):
        timing_stats([])


def test_provenance_filled_in() -> None:
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    prov = Record(suite="e2e", backend="torch", implementation="sdpa").provenance
    assert "git_commit" in prov and "git_dirty" in prov
    if os.environ.get("RESULTS_GIT_COMMIT"):  # a tree without history, told its commit (the GPU machines)
        assert (prov["git_commit"], prov["git_dirty"]) == (os.environ["RESULTS_GIT_COMMIT"], None)
    else:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        assert prov["git_commit"] == head.stdout.strip() and isinstance(prov["git_dirty"], bool)
    date = datetime.datetime.fromisoformat(prov["date"])
    assert date.tzinfo is not None
    assert before <= date <= datetime.datetime.now(datetime.timezone.utc)
    assert prov["device_name"] == "cpu"
    assert prov["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert provenance("NVIDIA H100")["device_name"] == "NVIDIA H100"
    assert prov["cpu"].endswith(f" x {os.cpu_count()}") and len(prov["cpu"]) > len(f" x {os.cpu_count()}")
    json.dumps(prov)  # provenance must be JSON-serialisable as it is


def test_provenance_keeps_the_settings_that_choose_kernels(monkeypatch) -> None:
    """The same command measures other code with FLASH_GLUON=0 or TRITON_INTERPRET=1: a record keeps them."""
    for name in [n for n in os.environ if n.startswith(SETTINGS_PREFIXES)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FLASH_GLUON_SIDE_BY_SIDE_3D", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HOME_FLASH_", "x")  # a prefix elsewhere in the name is not one
    assert provenance()["settings"] == {"FLASH_GLUON_SIDE_BY_SIDE_3D": "0", "TRITON_INTERPRET": "1"}


def test_provenance_commit_from_environment(monkeypatch) -> None:
    """A tree copied without its history (the GPU machines) is told its commit; its dirtiness is unknown."""
    monkeypatch.setenv("RESULTS_GIT_COMMIT", "f" * 40)
    prov = provenance()
    assert (prov["git_commit"], prov["git_dirty"]) == ("f" * 40, None)


def test_importing_records_stays_light() -> None:
    code = (
        "import sys, analysis, analysis.records as r\n"
        "r.Record(suite='e2e', backend='torch', implementation='sdpa')\n"
        "print(','.join(m for m in ('pandas', 'numpy', 'torch', 'jax', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_older_phase_names_are_read_as_the_shared_ones() -> None:
    """The DDP benchmark's records before the shared step loop called its comm phase comm_blocked."""
    stats = {"median_ms": 1.0}
    old = Record(suite="ddp", backend="torch", implementation="none",
                 phases={"forward": stats, "comm_blocked": stats}).to_dict()
    assert set(Record.from_dict(old).phases) == {"forward", "comm"}
