"""Tests for analysis.tables and the ``python -m analysis.reports table`` CLI (old name ``python -m analysis.table``):
flattening records into a frame, number formatting in Markdown tables, failed runs staying visible, and one-line
errors for bad input."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.reports import table_main
from analysis.records import Record, append_records, timing_stats
from analysis.tables import (
    DEFAULT_COLUMNS,
    export_table,
    format_bytes,
    format_number,
    markdown_table,
    markdown_tables,
    records_frame,
    select_columns,
)

REPO = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_ok(rng: random.Random) -> Record:
    """An e2e record with random measurements and fixed provenance."""
    return Record(
        suite="e2e",
        backend="torch",
        implementation="sdpa",
        model="small",
        model_dims={"d_model": 768},
        batch_size=rng.randrange(1, 64),
        seq_len=1024,
        dtype="bf16",
        mode="train_step",
        world_size=8,
        mesh={"dp": 1, "fsdp": 4, "tp": 2},
        timing=timing_stats(rng.uniform(1, 100) for _ in range(4)),
        phases={"forward": timing_stats([rng.uniform(1, 5)]), "backward": timing_stats([rng.uniform(5, 10)])},
        tokens_per_s=rng.uniform(1e5, 1e7),
        tflops=rng.uniform(1, 900),
        mfu=rng.random(),
        peak_memory_bytes=rng.randrange(2**30, 2**36),
        metrics={"loss": rng.uniform(1, 10)},
        provenance={"git_commit": COMMIT, "device_name": "NVIDIA H100", "date": "2025-01-02T03:04:05+00:00"},
    )


def make_oom() -> Record:
    return Record(suite="e2e", backend="jax", implementation="flax", model="small", batch_size=512, seq_len=1024,
                  status="oom", error="RESOURCE_EXHAUSTED | 80 GiB\nneeded", provenance={})  # fmt: skip


@pytest.fixture
def records() -> list[Record]:
    return [make_ok(random.Random()), make_oom()]


@pytest.fixture
def jsonl(tmp_path: Path, records: list[Record]) -> Path:
    path = tmp_path / "e2e.jsonl"
    append_records(path, records)
    append_records(path, Record(suite="attention", backend="torch", implementation="triton", provenance={}))
    return path


def test_frame_flattens_nested_fields(records: list[Record]) -> None:
    ok = records[0]
    frame = records_frame(records)
    assert len(frame) == 2
    assert {"model_dims", "provenance", "schema_version", "timing", "phases", "metrics"}.isdisjoint(frame.columns)
    row = frame.iloc[0]
    for stat in ("median_ms", "mean_ms", "std_ms", "min_ms", "max_ms"):
        assert row[stat] == ok.timing[stat]
    assert row["forward_median_ms"] == ok.phases["forward"]["median_ms"]
    assert row["backward_median_ms"] == ok.phases["backward"]["median_ms"]
    assert row["metrics.loss"] == ok.metrics["loss"]
    assert row["mesh"] == "dp=1,fsdp=4,tp=2"
    assert (row["git_commit"], row["device_name"], row["date"]) == (COMMIT[:10], "NVIDIA H100", ok.provenance["date"])
    assert (row["batch_size"], row["world_size"], row["peak_memory_bytes"]) == (
        ok.batch_size, 8, ok.peak_memory_bytes)  # fmt: skip
    failed = frame.iloc[1]
    assert failed["status"] == "oom" and failed["error"] == records[1].error
    assert math.isnan(failed["median_ms"]) and pd.isna(failed["metrics.loss"]) and pd.isna(failed["git_commit"])
    assert pd.isna(failed["mesh"])
    assert frame["batch_size"].tolist() == [ok.batch_size, 512]  # stays integer beside a missing value
    assert list(frame.columns[-3:]) == ["git_commit", "device_name", "date"]


def test_frame_reads_paths_globs_and_folders(jsonl: Path, records: list[Record]) -> None:
    second = jsonl.with_name("more.jsonl")
    append_records(second, make_oom())
    by_path = records_frame(jsonl)
    assert by_path["suite"].tolist() == ["e2e", "e2e", "attention"]
    assert by_path["median_ms"].iloc[0] == records[0].timing["median_ms"]
    assert len(records_frame(str(jsonl.parent / "*.jsonl"))) == 4
    assert len(records_frame(jsonl.parent)) == 4
    assert len(records_frame([jsonl, records[0]])) == 4
    empty = records_frame([])
    assert empty.empty and set(DEFAULT_COLUMNS) <= set(empty.columns)
    with pytest.raises(FileNotFoundError, match="no such file"):
        records_frame(jsonl.with_name("missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="no files match"):
        records_frame(str(jsonl.parent / "nothing*.jsonl"))


def cells(line: str) -> list[str]:
    """The stripped cells of one Markdown table row (escaped pipes kept inside their cell)."""
    line = line.strip().strip("|").replace("\\|", "\0")
    return [cell.strip().replace("\0", "\\|") for cell in line.split("|")]


def test_format_helpers() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(40 * 2**30 + 2**29) == "40.50 GiB"
    assert format_bytes(2 * 2**40) == "2.00 TiB"
    assert format_number(3.14159) == "3.142"
    assert format_number(42) == "42"
    assert format_number(123456.7) == "123,457"
    assert format_number(0.000123456, ".2e") == "1.23e-04"


def test_markdown_table_formats_values_and_shows_failures() -> None:
    ok = make_ok(random.Random())
    ok.timing = timing_stats([12.3456, 12.3456])
    ok.tokens_per_s, ok.tflops, ok.mfu, ok.peak_memory_bytes = 1234567.8, 345.678, 0.41234, 40 * 2**30
    ok.metrics = {"loss": 2.718281}
    text = markdown_table(records_frame([ok, make_oom()]), metrics=["loss"])
    lines = text.splitlines()
    header = cells(lines[0])
    assert header == [*DEFAULT_COLUMNS, "metrics.loss", "error"]
    ok_row = dict(zip(header, cells(lines[2])))
    assert ok_row["backend"] == "torch" and ok_row["status"] == "ok" and ok_row["error"] == "—"
    assert (ok_row["median_ms"], ok_row["std_ms"]) == ("12.346", "0.000")
    assert (ok_row["tokens_per_s"], ok_row["tflops"], ok_row["mfu"]) == ("1,234,568", "345.7", "41.2%")
    assert (ok_row["peak_memory_bytes"], ok_row["metrics.loss"]) == ("40.00 GiB", "2.718")
    oom_row = dict(zip(header, cells(lines[3])))
    assert oom_row["status"] == "oom" and oom_row["batch_size"] == "512"
    assert "RESOURCE_EXHAUSTED \\| 80 GiB needed" in lines[3]  # pipe escaped, newline folded
    for column in ("median_ms", "tokens_per_s", "mfu", "peak_memory_bytes", "metrics.loss", "dtype"):
        assert oom_row[column] == "—", column
    assert len(lines) == 4


def _latex_rows(tex: str) -> list[str]:
    """The body rows of a booktabs tabular (between \\midrule and \\bottomrule)."""
    body = tex.split("\\midrule\n")[1].split("\\bottomrule")[0]
    return [line for line in body.splitlines() if line.strip()]


def _typst_cells(typ: str) -> list[str]:
    """The content blocks of a Typst table, unescaped."""
    return [re.sub(r"\\(.)", r"\1", c) for c in re.findall(r"\[((?:\\.|[^\\\]])*)\]", typ)]


def test_latex_and_typst_exports_match_the_markdown(tmp_path: Path) -> None:
    """``export_table``: the Markdown table's cells (numbers formatted alike) as a booktabs tabular and a Typst table
    with a header row; LaTeX's and Typst's special characters escaped; a pipe in a header escaped in the Markdown."""
    frame = pd.DataFrame({"implementation": ["eager_sdpa", "50% & #1 $5 a|b", "C:\\x {y} ~^ //"],
                          "median_ms": [12.3456, 1.0, None], "mfu": [0.41234, 0.5, 0.1], "n |x|": [1, 2, 3]})
    columns = list(frame.columns)
    markdown = markdown_table(frame, columns)
    [(shown, align)] = markdown_tables(markdown)
    assert list(shown.columns) == columns and align == ["left", "right", "right", "right"]
    assert shown.iloc[0].tolist() == ["eager_sdpa", "12.346", "41.2%", "1"]
    assert shown.iloc[2, 1] == "—" and shown.iloc[1, 0] == "50% & #1 $5 a|b"  # the Markdown's "a\\|b", unescaped
    tex, typ = export_table(frame, columns, out=tmp_path / "sub" / "t")
    assert (tex.name, typ.name) == ("t.tex", "t.typ")
    latex = tex.read_text()
    assert latex.startswith("\\begin{tabular}{lrrr}\n\\toprule") and latex.rstrip().endswith("\\end{tabular}")
    rows = _latex_rows(latex)
    assert len(rows) == len(frame) and all(row.count(" & ") == 3 and row.endswith("\\\\") for row in rows)
    assert rows[0].startswith("eager\\_sdpa & 12.346 & 41.2\\% & 1")
    assert "50\\% \\& \\#1 \\$5" in rows[1] and "\\{y\\}" in rows[2]
    typst = typ.read_text()
    assert typst.startswith("#table(\n  columns: 4,\n  align: (left, right, right, right,),\n  table.header(")
    blocks = _typst_cells(typst)
    assert len(blocks) == 4 * (len(frame) + 1)
    assert blocks == [*columns, *(v for row in shown.itertuples(index=False) for v in row)]
    assert "[eager\\_sdpa]" in typst and "[50% & \\#1 \\$5 a|b]" in typst and "\\/\\/" in typst


def test_markdown_table_column_choice() -> None:
    frame = records_frame([make_ok(random.Random())])
    text = markdown_table(frame, ["implementation", "mesh", "median_ms"])
    assert cells(text.splitlines()[0]) == ["implementation", "mesh", "median_ms"]
    assert "error" not in text  # every row ok: no error column forced in
    assert "status" in select_columns(frame) and "error" not in select_columns(frame)
    with pytest.raises(ValueError, match=r"unknown column\(s\) nope; accepted: suite, backend, .*median_ms"):
        markdown_table(frame, ["backend", "nope"])
    with pytest.raises(ValueError, match="unknown column.*metrics.perplexity"):
        markdown_table(frame, metrics=["perplexity"])


TABLE_CLI = ("analysis.reports", "table")  # python -m analysis.reports table
OLD_TABLE_CLI = ("analysis.table",)  # its old name, kept for one release


def run_cli(*args: str, cli: tuple[str, ...] = TABLE_CLI) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", *cli, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize("cli", [TABLE_CLI, OLD_TABLE_CLI], ids=" ".join)
def test_cli_prints_and_writes_table(jsonl: Path, tmp_path: Path, records: list[Record], cli) -> None:
    out = tmp_path / "tables" / "e2e.md"
    result = run_cli(str(jsonl), "--suite", "e2e", "--metrics", "loss", "--out", str(out), cli=cli)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == result.stdout
    lines = result.stdout.splitlines()
    assert len(lines) == 4  # header, rule, the two e2e records (the attention record filtered out)
    header = cells(lines[0])
    ok_row, oom_row = (dict(zip(header, cells(line))) for line in lines[2:])
    assert ok_row["median_ms"] == f"{records[0].timing['median_ms']:.3f}"
    assert ok_row["metrics.loss"] == f"{records[0].metrics['loss']:.4g}"
    assert oom_row["status"] == "oom" and oom_row["error"].startswith("RESOURCE_EXHAUSTED")


@pytest.mark.parametrize("cli", [TABLE_CLI, OLD_TABLE_CLI], ids=" ".join)
def test_cli_unknown_column_is_one_line_error(jsonl: Path, cli) -> None:
    result = run_cli(str(jsonl), "--columns", "backend,speed", cli=cli)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"python -m {' '.join(cli)}: error: unknown column(s) speed; accepted: suite, "
                                    "backend")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.jsonl"], "no such file: "),
        (["{dir}/*.json"], "no files match"),
        (["{file}", "--suite", "allreduce"], "no records of suite 'allreduce'; suites present: attention, e2e"),
        (["{bad}"], "bad.jsonl:2: not a valid record"),
    ],
)
def test_cli_bad_input_exits_with_message(jsonl: Path, args: list[str], message: str, capsys) -> None:
    bad = jsonl.with_name("bad.jsonl")
    bad.write_text(jsonl.read_text().splitlines()[0] + "\n{oops\n")
    argv = [a.format(dir=jsonl.parent, file=jsonl, bad=bad) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        table_main(argv)
    assert exit_info.value.code == 2 and message in str(exit_info.value)
    assert capsys.readouterr().err.startswith("python -m analysis.reports table: error: ")
