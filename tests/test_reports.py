"""``python -m analysis.reports``: every suite of every record file gets its report, from the records alone."""

import re
import shutil
from pathlib import Path

import pytest

from analysis import reports
from analysis.records import Record, append_records

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_reports_from_committed_records(tmp_path):
    """The committed records (attention, all-reduce, precision, e2e-style) all render."""
    for name in ("attention_leaderboard_h100.jsonl", "allreduce_gloo_cpu.jsonl", "precision_cpu.jsonl",
                 "foundation_h100.jsonl"):
        shutil.copy(RESULTS / name, tmp_path / name)
    assert reports.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    index = (out / "index.md").read_text()
    # the leaderboard's shapes span several (batch, heads) groups: one plot per group
    for name in ("attention_leaderboard_h100.md", "attention_leaderboard_h100_latency_bf16_batch-size1_heads16.png",
                 "allreduce_gloo_cpu_busbw.png", "precision_cpu.md", "foundation_h100.md"):
        assert (out / name).stat().st_size > 0 and name in index
    assert "| fp16 | fp16 | 9.953125 |" in (out / "precision_cpu.md").read_text()
    assert "jit naive" in (out / "foundation_h100.md").read_text()


def test_generic_suite_shows_scalar_metrics_and_failures(tmp_path):
    append_records(tmp_path / "mixed.jsonl", [
        Record(suite="e2e", backend="torch", implementation="eager sdpa", metrics={"loss_last": 1.5, "losses": [2, 1]}),
        Record(suite="e2e", backend="jax", implementation="jit naive", status="oom", error="RESOURCE_EXHAUSTED"),
    ])
    assert reports.main([str(tmp_path)]) == 0
    text = (tmp_path / "reports" / "mixed.md").read_text()
    assert "metrics.loss_last" in text and "metrics.losses" not in text
    assert "RESOURCE_EXHAUSTED" in text


def test_empty_folder_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reports.main([str(tmp_path)])
    assert exit_info.value.code == 2 and "no *.jsonl record files" in capsys.readouterr().err


def test_every_record_file_in_results_reads():
    """``python -m analysis.reports`` reads every ``results/*.jsonl``: probe outputs that are not records belong in
    ``results/profiles/``."""
    from analysis.records import read_records

    for path in sorted(RESULTS.glob("*.jsonl")):
        assert read_records(path), path


def fixture_results(folder: Path) -> None:
    """Small records of several suites: PyTorch and JAX steps of one configuration (special characters in a name),
    the attention leaderboard, data-parallel runs, a training matrix with its epochs, an accumulation study and a
    suite of no section."""
    from analysis.records import TRAIN_PHASES, timing_stats

    cpu = {"provenance": {"device_name": "cpu"}}
    step = dict(model="tiny", batch_size=2, seq_len=16, dtype="fp32", mode="train_step", **cpu)
    append_records(folder / "e2e_cpu.jsonl", [
        Record(suite="e2e", backend="torch", implementation="eager_sdpa 50% & #1 $", timing=timing_stats([2.0, 2.2]),
               tokens_per_s=16.0, mfu=0.1, **step),
        Record(suite="e2e", backend="jax", implementation="jit naive", timing=timing_stats([3.0]), tokens_per_s=11.0,
               **step)])
    append_records(folder / "attention_cpu.jsonl", [
        Record(suite="attention", backend="torch", implementation=provider, batch_size=1, seq_len=seq, dtype="fp32",
               mode="forward", timing=timing_stats([seq * factor]), tflops=1.0 / factor,
               metrics={"heads": 2, "head_dim": 16, "causal": True}, **cpu)
        for provider, factor in (("flash_triton", 1.0), ("naive", 3.0)) for seq in (16, 32)])
    append_records(folder / "ddp_cpu.jsonl", [
        Record(suite="ddp", backend="torch", implementation=impl, world_size=ranks, timing=timing_stats([ms]),
               tokens_per_s=32.0 * ranks / ms, **step) for impl, ranks, ms in (("none", 1, 2.0), ("flat", 2, 2.5))])

    def epoch(n, loss):
        return Record(suite="train", backend="torch", implementation="none", metrics={
            "attention": "sdpa", "dist": "none", "run": "cell", "epoch": n, "epoch_s": 1.0, "train_loss": loss,
            "val_loss": loss})

    append_records(folder / "matrix_cpu.jsonl", [
        Record(suite="train_matrix", backend="torch", implementation="none",
               metrics={"attention": "sdpa", "dist": "none", "run": "cell", "samples_per_epoch": 4}),
        epoch(1, 5.0), epoch(2, 4.0)])
    append_records(folder / "accum_cpu.jsonl", [
        Record(suite="accum_study", backend="torch", implementation="ddp", batch_size=batch, world_size=2,
               tokens_per_s=100.0 * batch, metrics={"grad_accum": 4 // batch, "step_ms": 5.0,
                                                     "phase_ms": dict.fromkeys(TRAIN_PHASES, 1.0)})
        for batch in (1, 2, 4)])
    append_records(folder / "misc_cpu.jsonl", [Record(suite="misc", backend="jax", implementation="x",
                                                      metrics={"value": 1.5})])


def _links(markdown: str) -> list[str]:
    return re.findall(r"\]\(([^)]+)\)", markdown)


def test_report_index_groups_charts_and_exports(tmp_path):
    """One command, from records alone: ``index.md`` by section, linking every file written and nothing else; a
    PDF beside every PNG; each Markdown table as LaTeX and Typst with its rows and columns, names escaped."""
    from analysis.tables import markdown_tables

    fixture_results(tmp_path)
    out = tmp_path / "reports"
    written = reports.write_reports(tmp_path, out)
    index = (out / "index.md").read_text()
    assert re.findall(r"^## (.+)$", index, re.M) == [
        "PyTorch vs JAX, side by side", "Attention leaderboard", "Data-parallel family",
        "Training matrix and accumulation study", "Other suites"]
    sections = dict(zip(re.findall(r"^## (.+)$", index, re.M), re.split(r"^## .+$", index, flags=re.M)[1:]))
    assert "side_by_side/side_by_side.md" in sections["PyTorch vs JAX, side by side"]
    assert "matrix_cpu_train_matrix/train_matrix.md" in sections["Training matrix and accumulation study"]
    assert "accum_cpu/accum_study.md" in sections["Training matrix and accumulation study"]
    assert "[misc_cpu.md](misc_cpu.md): misc: misc_cpu.jsonl" in sections["Other suites"]
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert set(_links(index)) == files - {"index.md"} and set(written) == {out / f for f in files}
    charts = [p for p in out.rglob("*.png")]
    assert len(charts) >= 10 and all(p.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-" for p in charts)
    for name in ("time_per_epoch", "loss_convergence"):  # the training matrix's charts, in its own folder
        assert f"matrix_cpu_train_matrix/{name}.pdf" in index
    for markdown in (p for p in out.rglob("*.md") if p.name != "index.md"):
        tables = markdown_tables(markdown.read_text())
        folder = markdown.with_name(f"{markdown.stem}_tables")
        assert tables and sorted(p.name for p in folder.iterdir()) == sorted(
            f"table{n}{suffix}" for n in range(1, len(tables) + 1) for suffix in (".tex", ".typ")), markdown
        for n, (cells, _) in enumerate(tables, start=1):
            latex = (folder / f"table{n}.tex").read_text()
            assert latex.startswith("\\begin{tabular}") and latex.rstrip().endswith("\\end{tabular}")
            body = latex.split("\\midrule\n")[1].split("\\bottomrule")[0]
            assert len(body.splitlines()) == len(cells), (markdown, n)
            typst = (folder / f"table{n}.typ").read_text()
            assert f"columns: {len(cells.columns)}," in typst
            assert len(re.findall(r"\[((?:\\.|[^\\\]])*)\]", typst)) == cells.size + len(cells.columns)
    e2e = (out / "e2e_cpu_tables" / "table1.tex").read_text()
    assert "eager\\_sdpa 50\\% \\& \\#1 \\$" in e2e
    assert "[eager\\_sdpa 50% & \\#1 \\$]" in (out / "e2e_cpu_tables" / "table1.typ").read_text()


def test_a_refused_record_leaves_the_reports_as_they_were(tmp_path):
    """All or nothing: a record that does not fit its report (after others were staged) moves nothing into place,
    neither Markdown nor charts nor exports."""
    fixture_results(tmp_path)
    append_records(tmp_path / "zz_misfiled.jsonl", [Record(suite="attention", backend="torch", implementation="x")])
    out = tmp_path / "reports"
    out.mkdir()
    (out / "old.md").write_text("kept\n")
    with pytest.raises(ValueError, match="zz_misfiled.jsonl: a 'attention' record"):
        reports.write_reports(tmp_path, out)
    assert [p.name for p in out.rglob("*")] == ["old.md"]


def test_named_sections_tables_have_charts(tmp_path):
    """Each table of the PyTorch-vs-JAX (with scaling), training, fidelity and data-parallel sections comes with a
    chart from its records, as PNG and PDF, shown in its page and linked from the index."""
    from analysis.records import timing_stats

    fixture_results(tmp_path)
    gpu = {"device_name": "NVIDIA H100", "git_commit": "abc"}
    step = dict(model="tiny", seq_len=16, dtype="bf16", mode="train_step", provenance=gpu)
    append_records(tmp_path / "jax_vs_torch_gpu.jsonl", [
        Record(suite="jax_vs_torch", backend=backend, implementation=impl, batch_size=batch, world_size=n,
               timing=timing_stats([ms]), tokens_per_s=batch * 16 / ms * 1e3, mfu=0.3, peak_memory_bytes=2**30,
               **step)
        for backend, impl, batch, n, ms in (("torch", "eager", 2, 1, 2.0), ("jax", "jit", 2, 1, 1.8),
                                            ("torch", "ddp", 4, 2, 2.2), ("jax", "jit dp", 4, 2, 2.0))])
    append_records(tmp_path / "train_gpu.jsonl", [
        Record(suite="train", backend="torch", implementation="none", batch_size=2, tokens_per_s=100.0 + n,
               metrics={"run": run, "epoch": n, "epoch_s": 1.0, "train_loss": 5.0 - n, "val_loss": 5.5 - n})
        for run in ("first", "second") for n in (1, 2)])
    append_records(tmp_path / "ceilings_gpu.jsonl", [
        Record(suite="ceilings", backend="torch", implementation="matmul 64x64x64", dtype="bf16", tflops=500.0,
               timing=timing_stats([1.0]), provenance=gpu),
        Record(suite="ceilings", backend="torch", implementation="copy 1 MiB", dtype="fp32", timing=timing_stats([1.0]),
               metrics={"bytes": 2**20, "bytes_per_s": 2e12}, provenance=gpu)])
    size = {"bytes": 2**20, "size": "1MB", "algbw_gbps": 100.0}
    append_records(tmp_path / "collectives_gpu.jsonl", [
        Record(suite="collectives", backend="jax", implementation=op, world_size=2, timing=timing_stats([0.1]),
               metrics={"op": op, "axis": "fsdp", "busbw_gbps": 80.0, "raw_busbw_gbps": 90.0, **size}, provenance=gpu)
        for op in ("all_reduce", "all_gather")])
    append_records(tmp_path / "allreduce_nccl_gpu.jsonl", [
        Record(suite="allreduce", backend="torch", implementation="nccl all_reduce", world_size=2,
               timing=timing_stats([0.1]), provenance=gpu,
               metrics={"comm_backend": "nccl", "busbw_gbps": 100.0, "raw_busbw_gbps": 120.0, "raw_loop_ms": 0.1,
                        "raw_algbw_gbps": 120.0, "busbw_over_raw": 0.8, **size})])
    out = tmp_path / "reports"
    reports.write_reports(tmp_path, out)
    index = (out / "index.md").read_text()
    sections = dict(zip(re.findall(r"^## (.+)$", index, re.M), re.split(r"^## .+$", index, flags=re.M)[1:]))
    expected = {
        "PyTorch vs JAX, side by side": {
            "jax_vs_torch_gpu.md": [f"jax_vs_torch_gpu_{n}"
                                    for n in ("throughput", "time", "mfu", "memory", "scaling")],
            "side_by_side/side_by_side.md": [f"side_by_side_{n}" for n in ("throughput", "time", "scaling")]},
        "Training matrix and accumulation study": {
            "train_gpu.md": ["train_gpu_throughput", "train_gpu_loss"],
            "matrix_cpu_train.md": ["matrix_cpu_train_loss"]},
        "Predicted against measured (fidelity)": {"ceilings_gpu.md": ["ceilings_gpu_ceilings"]},
        "Data-parallel family": {"collectives_vs_nccl.md": ["collectives_vs_nccl"]},
    }
    for title, pages in expected.items():
        for page, charts in pages.items():
            text = (out / page).read_text()
            for chart in charts:
                png = (out / page).with_name(f"{chart}.png")
                assert png.stat().st_size > 0 and png.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-", png
                assert f"]({png.name})" in text, (page, chart)
                for suffix in (".png", ".pdf"):
                    link = png.with_suffix(suffix).relative_to(out).as_posix()
                    assert f"]({link})" in sections[title], (title, chart)
    assert re.search(r"\|\s+0\.8 \|.*\|\s+0\.75 \|", (out / "collectives_vs_nccl.md").read_text())  # 80/100, 90/120
    # The index's sections: every report with a table there has a chart.
    for title in expected:
        for entry in re.split(r"^- ", sections[title], flags=re.M)[1:]:
            assert "charts:" in entry or "tables:" not in entry, entry


def test_other_step_suites_get_each_implementations_time_chart(tmp_path):
    """A step suite outside the named sections (e2e: stock and ours) gets a chart of every implementation's step time
    per configuration, a failed run's status written where its bar would be; a suite of other records gets none."""
    from analysis.records import timing_stats
    from analysis.side_by_side import plot_implementations, side_by_side_frame

    step = dict(model="tiny", batch_size=2, seq_len=16, dtype="bf16", mode="train_step",
                provenance={"device_name": "NVIDIA H100"})
    records = [Record(suite="e2e", backend="torch", implementation=impl, timing=timing_stats([ms]), **step)
               for impl, ms in (("stock compiled", 3.0), ("compiled, cuda graph per block", 2.5))]
    records.append(Record(suite="e2e", backend="torch", implementation="eager", status="oom", error="CUDA OOM",
                          **step))
    append_records(tmp_path / "e2e_gpu.jsonl", records)
    append_records(tmp_path / "misc_cpu.jsonl", [Record(suite="misc", backend="jax", implementation="x",
                                                        metrics={"value": 1.5})])
    out = tmp_path / "reports"
    reports.write_reports(tmp_path, out)
    index = (out / "index.md").read_text()
    assert "](e2e_gpu_time.png)" in (out / "e2e_gpu.md").read_text()
    assert "e2e_gpu_time.png" in index and "e2e_gpu_time.pdf" in index
    assert not list(out.glob("misc_cpu*.png"))
    frame = side_by_side_frame(records)
    assert sorted(frame["implementation"]) == ["compiled, cuda graph per block", "eager", "stock compiled"]
    assert plot_implementations(frame[frame["status"] != "ok"], tmp_path / "failed", "e2e") == []  # no time: no chart


def _index_entries(index: str) -> dict[str, str]:
    """Each page's entry in ``index.md``: its link -> its lines (title, tables, charts)."""
    entries = re.split(r"^(?=- \[|## )", index, flags=re.M)
    return {re.match(r"- \[[^\]]+\]\(([^)]+)\)", e).group(1): e for e in entries if e.startswith("- [")}


def test_every_page_lists_its_charts_and_the_chartless_tables_get_one(tmp_path):
    """Each page's index entry lists, as PNG and PDF, every chart the page shows (the answer pages, several reports
    in one, included); the precision, attention-parts and several-hosts tables get a chart of their own."""
    from tests.test_answers import _write_sweep
    from tests.test_multihost_report import _e2e

    fixture_results(tmp_path)
    configs = [(model, seq) for model in ("small", "large") for seq in (128, 256)]
    _write_sweep(tmp_path, {(dtype, compiled): {c: 100.0 + 10 * i for i, c in enumerate(configs)}
                            for dtype in ("fp32", "bf16") for compiled in (False, True)})
    cpu = {"provenance": {"device_name": "cpu"}}
    append_records(tmp_path / "precision_cpu.jsonl", [
        *(Record(suite="precision", backend="torch", implementation="accumulation", dtype=acc, **cpu,
                 metrics={"accumulator": acc, "addend": add, "result": 10 + err, "abs_error": err})
          for acc, add, err in (("fp32", "fp32", 1e-4), ("fp16", "fp16", 5e-2), ("fp32", "bf16", 1e-2))),
        Record(suite="precision", backend="torch", implementation="autocast", dtype="bf16", **cpu,
               metrics={"logits": "torch.bfloat16", "loss": "torch.float32"})])
    append_records(tmp_path / "attention_parts_cpu.jsonl", [
        Record(suite="attention_parts", backend="torch", implementation="naive attention, one layer", model="tiny",
               batch_size=2, seq_len=16, dtype="fp32", mode=mode, **cpu,
               metrics={"matmul_ms": 0.2 * k, "reduction-softmax_ms": 0.1 * k, "elementwise_ms": 0.1 * k,
                        "other_ms": 0.05 * k, "heads": 2, "head_dim": 8})
        for mode, k in (("forward", 1), ("forward_backward", 3))])
    append_records(tmp_path / "processes_gpu.jsonl", [_e2e(1, [5.0, 4.0], 100.0), _e2e(2, [5.0, 4.0], 110.0)])
    out = tmp_path / "reports"
    reports.write_reports(tmp_path, out)
    entries = _index_entries((out / "index.md").read_text())
    pages = [p for p in out.rglob("*.md") if p.name != "index.md"]
    assert {"answers/benchmarking.md", "answers/mixed_precision.md"} <= set(entries)
    for page in pages:
        entry = entries[page.relative_to(out).as_posix()]
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            png = (page.parent / image).relative_to(out).as_posix()
            assert f"[PNG]({png})" in entry and f"[PDF]({png[:-4]}.pdf)" in entry, (page, image)
    for page, chart in (("precision_cpu.md", "precision_cpu_error"), ("multihost.md", "multihost"),
                        ("attention_parts_cpu.md", "attention_parts_cpu_parts"),
                        ("answers/benchmarking.md", "answers/benchmarking_step")):
        png = out / f"{chart}.png"
        assert png.stat().st_size > 0 and png.with_suffix(".pdf").read_bytes()[:5] == b"%PDF-", chart
        assert f"]({png.name})" in (out / page).read_text(), page
        assert f"[PNG]({chart}.png)" in entries[page] and "  - charts: " in entries[page], page
    assert "No chart of this table: its cells are dtype names" in (out / "precision_cpu.md").read_text()


def test_attention_parts_without_part_times_get_no_chart(tmp_path):
    """An attention_parts record without any kernel category's time (``metrics.<category>_ms``) gets its table and
    no chart, not an error that would end the whole report."""
    from analysis.reports import _attention_parts_chart

    record = Record(suite="attention_parts", backend="torch", implementation="naive", model="tiny", batch_size=1,
                    seq_len=16, dtype="bf16", mode="forward", metrics={"total_ms": 1.0})
    assert _attention_parts_chart([record], tmp_path / "attention_parts") == []
