"""``python -m analysis.reports [results] [--out results/reports]``: every table and figure, from the records.

Reads each ``*.jsonl`` record file in a folder and, per suite, writes its report into ``--out``, from the suite's
own module: the attention suites their latency / TFLOP/s tables, speed-ups and plots (``analysis.attention``), the
all-reduce suite its bus-bandwidth plot and table (``analysis.allreduce``; the JAX collectives suite likewise,
``analysis.collectives``), the data-parallel suite its table with scaling efficiency and a throughput plot
(``analysis.data_parallel``), the single-GPU suites "memory", "kernels" and "checkpointing" their tables and plots
(``analysis.single_gpu``), and every other suite (e2e, foundation, ddp, precision, ...) a table of its records (the
precision suite its two), with charts for some (``SUITE_CHARTS``: a step benchmark's time, throughput, MFU, memory
and scaling, the trainer's throughput and losses per run, the measured ceilings, the precision suite's accumulation
error, the attention parts' time per part); where some configuration was measured
in both backends, the PyTorch-vs-JAX report (``analysis.side_by_side``) into ``side_by_side/``; where the device's
measured ceilings are among the records, every GPU step against its predicted floor and memory
(``analysis.fidelity``) into ``fidelity.md``; where both backends trained from the same saved weights, their losses
step by step (``analysis.loss_parity``) into ``loss_parity.md``; where a run was launched as several nodes or
processes, or restarted, beside the same run on one host, the two side by side (``analysis.multihost``) into
``multihost.md``; where JAX collectives and NCCL all-reduce were measured at one commit, their bus bandwidths' ratio
(``analysis.collectives``) into ``collectives_vs_nccl.md``; the training matrix and the accumulation study
(``analysis.training``) into a folder per record file; the single-GPU studies' answer pages (``analysis.answers``,
one page per study, each answer computed from its records, beside the reference sheet's figures) into ``answers/``.
For a paper: every Markdown table also as LaTeX (booktabs, ``DataFrame.to_latex``) and Typst (``#table``), in
``<report>_tables/table<N>.tex`` and ``.typ`` beside ``<report>.md`` (N counts the report's tables in order;
``analysis.tables.export_markdown_file``), and every chart as PNG with a PDF beside it (``analysis.plots.save_figure``).
``index.md`` lists the reports by section (``SECTIONS``: PyTorch vs JAX, the attention leaderboard, the
data-parallel family, several hosts, the training matrix and accumulation study, fidelity, loss parity, then the
other suites),
linking each one's Markdown, exports and charts: under each page the charts it shows (its ``![...](file.png)``
links), then the report's charts that no page shows. Nothing is typed by hand: rerun it after adding records.

``python -m analysis.reports table FILES... [--suite S] [--columns a,b] [--metrics m] [--out FILE.md]`` prints one
Markdown table of the records in some files, globs or folders instead (``table_main``; formerly
``python -m analysis.table``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from analysis.answers import write_answers
from analysis.allreduce import ALLREDUCE_SUITE, REPORT_METRICS as ALLREDUCE_METRICS, write_allreduce_report
from analysis.attention import REPORT_METRICS as ATTENTION_METRICS, write_attention_report
from analysis.collectives import (COLLECTIVES_SUITE, REPORT_METRICS as COLLECTIVES_METRICS, comparison_frame,
                                  write_collectives_report, write_nccl_comparison)
from analysis.data_parallel import SUITE as DDP_SUITE, write_ddp_report
from analysis.kernels import CATEGORIES
from analysis.fidelity import CEILINGS_SUITE, is_step, profile_records, report as fidelity_report
from analysis.records import Record, read_records
from analysis.loss_parity import loss_parity, write_loss_parity
from analysis.multihost import multihost_table, write_multihost
from analysis.plots import bar_plot, save_figure
from analysis.side_by_side import (head_to_head, plot_implementations, plot_side_by_side, side_by_side_frame,
                                   write_side_by_side)
from analysis.single_gpu import REPORTS as SINGLE_GPU_REPORTS, plot_shares
from analysis.tables import (export_markdown_file, exports_folder, load_records, markdown_table, records_frame,
                             records_table)
from analysis.training import (ACCUM_SUITE, MATRIX_SUITE, TRAIN_SUITE, plot_train_runs, write_accum_report,
                               write_matrix_report)
from parallelism_calc.cli import ArgumentParser, error_boundary

PROG = "python -m analysis.reports"
ATTENTION_SUITES = ("attention", "naive_attention")
# What each suite's report reads from the metrics of its successful records (check_suite).
REPORT_METRICS = {
    **dict.fromkeys(ATTENTION_SUITES, ATTENTION_METRICS),
    ALLREDUCE_SUITE: ALLREDUCE_METRICS,
    COLLECTIVES_SUITE: COLLECTIVES_METRICS,
}
# The index's sections, in order, and the reports each lists: a suite's (by suite name) or one across suites
# ("side_by_side", "fidelity", "loss_parity", "multihost": ``CROSS_REPORTS``). Every other suite goes under
# OTHER_SECTION.
SECTIONS = {
    "PyTorch vs JAX, side by side": ("side_by_side", "jax_vs_torch"),
    "Attention leaderboard": ATTENTION_SUITES,
    "Data-parallel family": (DDP_SUITE, ALLREDUCE_SUITE, COLLECTIVES_SUITE, "collectives_vs_nccl"),
    "Several hosts against one": ("multihost", "processes"),
    "Training matrix and accumulation study": (MATRIX_SUITE, ACCUM_SUITE, TRAIN_SUITE),
    "Predicted against measured (fidelity)": ("fidelity", CEILINGS_SUITE),
    "Loss parity": ("loss_parity", "jax_parity"),
    "Single-GPU studies: the answer pages": ("answers",),
}
OTHER_SECTION = "Other suites"


def precision_markdown(records: list[Record]) -> str:
    """The accumulation table and the autocast dtype table of ``torch_impl.bench.precision`` records."""
    accumulation = [r.metrics for r in records if r.implementation == "accumulation"]
    lines = ["## Accumulating 0.01 one thousand times (exact: 10)", "",
             "| accumulator | addend | result | abs. error |", "|:--|:--|--:|--:|"]
    lines += [f"| {m['accumulator']} | {m['addend']} | {m['result']:.6f} | {m['abs_error']:.2e} |"
              for m in accumulation]
    autocast = [r for r in records if r.implementation == "autocast"]
    if autocast:
        header = [f"autocast {r.dtype} ({r.provenance.get('device_name')})" for r in autocast]
        lines += ["", "## ToyModel dtypes under torch.autocast", "", "| tensor | " + " | ".join(header) + " |",
                  "|:--|" + "--|" * len(autocast)]
        lines += [f"| {key} | " + " | ".join(str(r.metrics.get(key)) for r in autocast) + " |"
                  for key in autocast[0].metrics]
        lines += ["", "No chart of this table: its cells are dtype names, not quantities."]
    return "\n".join(lines)


def suite_report(path: Path, suite: str, records: list[Record], out_dir: Path) -> list[Path]:
    """Write the report of one suite of one record file; the files written."""
    stem = path.stem if len({r.suite for r in read_records(path)}) == 1 else f"{path.stem}_{suite}"
    if suite in ATTENTION_SUITES:
        written, _ = write_attention_report(path, suite=suite, out_dir=out_dir)
        return written
    if suite == ALLREDUCE_SUITE:
        plot, table = write_allreduce_report(path, out_dir / f"{stem}_busbw.png")
        markdown = out_dir / f"{stem}.md"
        markdown.write_text(f"# All-reduce bus bandwidth\n\n![bus bandwidth]({plot.name})\n\n{table}\n")
        return [markdown, plot]
    if suite == COLLECTIVES_SUITE:
        plot, table = write_collectives_report(path, out_dir / f"{stem}_busbw.png")
        markdown = out_dir / f"{stem}.md"
        markdown.write_text(f"# JAX collectives: bus bandwidth\n\n![bus bandwidth]({plot.name})\n\n{table}\n")
        return [markdown, plot]
    if suite in SINGLE_GPU_REPORTS:
        return SINGLE_GPU_REPORTS[suite](records, out_dir, stem)
    if suite == DDP_SUITE:
        return write_ddp_report(path, out_dir)
    if suite in (MATRIX_SUITE, ACCUM_SUITE):  # fixed file names (train_matrix.md, ...): a folder per record file
        (write_matrix_report if suite == MATRIX_SUITE else write_accum_report)(path, out_dir / stem)
        return sorted((out_dir / stem).iterdir())
    if suite == "precision":
        text = precision_markdown(records)
    else:
        text = markdown_table(records_frame(records), metrics=_scalar_metrics(records))
    charts = SUITE_CHARTS.get(suite, _implementation_charts)(records, out_dir / stem)
    images = "".join(f"![{p.stem}]({p.name})\n\n" for p in charts)
    markdown = out_dir / f"{stem}.md"
    markdown.write_text(f"# {suite}: {path.name}\n\nGenerated by `python -m analysis.reports`.\n\n{images}{text}\n")
    return [markdown, *charts]


def _step_charts(records: list[Record], prefix: Path) -> list[Path]:
    """A step-benchmark file's charts: each backend's fastest run per configuration and the scaling
    (``analysis.side_by_side.plot_side_by_side``)."""
    frame = side_by_side_frame(records)
    return plot_side_by_side(frame, prefix, both_only=False) if not frame.empty else []


def _implementation_charts(records: list[Record], prefix: Path) -> list[Path]:
    """A step-benchmark file's chart where its suite has none of its own: every implementation's step time per
    configuration (``analysis.side_by_side.plot_implementations``); none for other records."""
    return plot_implementations(side_by_side_frame(records), prefix, f"{records[0].suite}: {prefix.name}")


def _ceilings_chart(records: list[Record], prefix: Path) -> list[Path]:
    """The device's measured ceilings (matmul TFLOP/s, copy GB/s), a panel each, at ``<prefix>_ceilings.png``."""
    import pandas as pd

    rows = [{"measured": r.implementation, "dtype": r.dtype, **(
        {"quantity": "TFLOP/s", "value": r.tflops} if r.tflops else
        {"quantity": "GB/s", "value": r.metrics.get("bytes_per_s", float("nan")) / 1e9})}
        for r in records if r.status == "ok" and (r.tflops or r.metrics.get("bytes_per_s"))]
    if not rows:
        return []
    out = prefix.with_name(f"{prefix.name}_ceilings.png")
    bar_plot(pd.DataFrame(rows), "measured", "value", hue="dtype", col="quantity", xlabel="", ylabel="measured",
             title=f"measured ceilings: {records[0].provenance.get('device_name')}", out=out)
    return [out]


def _precision_chart(records: list[Record], prefix: Path) -> list[Path]:
    """The accumulation's absolute error by accumulator and addend, on a log axis, at ``<prefix>_error.png``
    (an exact sum, error 0, has no bar there; the table shows it)."""
    import pandas as pd

    rows = pd.DataFrame([r.metrics for r in records if r.implementation == "accumulation"
                         and (r.metrics.get("abs_error") or 0) > 0])
    if rows.empty:
        return []
    out = prefix.with_name(f"{prefix.name}_error.png")
    fig = bar_plot(rows, "addend", "abs_error", hue="accumulator", x_order=list(dict.fromkeys(rows["addend"])),
                   hue_order=list(dict.fromkeys(rows["accumulator"])), xlabel="addend", ylabel="absolute error",
                   title=f"accumulating 0.01 one thousand times: {records[0].provenance.get('device_name')}")
    for ax in fig.axes:
        ax.set_yscale("log")
    fig.tight_layout()
    save_figure(fig, out)
    return [out]


def _attention_parts_chart(records: list[Record], prefix: Path) -> list[Path]:
    """Each pass's time in each part of the attention (matmul, softmax, elementwise, other: ``analysis.kernels``)
    by shape, at ``<prefix>_parts.png`` (``analysis.single_gpu.plot_shares``)."""
    frame = records_frame([r for r in records if r.status == "ok"])
    if frame.empty or not any(f"metrics.{c}_ms" in frame for c in CATEGORIES):
        return []
    shape = frame["model"] + " " + frame["batch_size"].astype(str) + " x " + frame["seq_len"].astype(str)
    out = prefix.with_name(f"{prefix.name}_parts.png")
    plot_shares(frame.assign(model=shape), "metrics.{}_ms", out, ylabel="ms per call",
                title=f"{records[0].suite}: time of each part, by shape, dtype and pass")
    return [out]


# Charts beside the table of a suite without a report of its own: (its records, out_dir / stem) -> the PNGs written;
# a suite not named here gets ``_implementation_charts``.
SUITE_CHARTS: dict[str, Callable[[list[Record], Path], list[Path]]] = {
    "jax_vs_torch": _step_charts, "side_by_side": _step_charts, TRAIN_SUITE: plot_train_runs,
    CEILINGS_SUITE: _ceilings_chart, "precision": _precision_chart, "attention_parts": _attention_parts_chart}


def _scalar_metrics(records: list[Record]) -> list[str]:
    """Metric names whose values are numbers in every record that has them, None counting as not having it
    (lists and dicts left out)."""
    names: dict[str, bool] = {}
    for r in records:
        for name, value in r.metrics.items():
            if value is None:
                continue
            scalar = isinstance(value, (int, float)) and not isinstance(value, bool)
            names[name] = names.get(name, True) and scalar
    return [name for name, scalar in names.items() if scalar]


def _side_by_side(records: list[Record], out_dir: Path) -> None:
    """The PyTorch-vs-JAX report (``analysis.side_by_side``) into ``out_dir/side_by_side`` when some
    configuration was measured in both backends."""
    frame = side_by_side_frame(records, "train_step")
    if not frame.empty and not head_to_head(frame).empty:
        write_side_by_side(records, out_dir / "side_by_side")


def _fidelity(records: list[Record], out_dir: Path, profiles: Sequence[Record] = ()) -> None:
    """Predicted against measured (``analysis.fidelity``) into ``out_dir/fidelity.md`` (and its chart) when the
    records hold measured ceilings and GPU train steps; ``profiles``: profiled runs as evidence
    (``analysis.fidelity.profile_records``)."""
    if any(r.suite == CEILINGS_SUITE for r in records) and any(is_step(r) for r in records):
        fidelity_report(records, out_dir / "fidelity.md", list(profiles))


def _loss_parity(records: list[Record], out_dir: Path) -> None:
    """PyTorch and JAX losses from the same weights (``analysis.loss_parity``) into ``out_dir/loss_parity.md``
    (and its chart) when the records hold such a pair."""
    if not loss_parity(records)[0].empty:
        write_loss_parity(records, out_dir / "loss_parity.md")


def _collectives_vs_nccl(records: list[Record], out_dir: Path) -> None:
    """The JAX collectives over NCCL all-reduce of the same size, devices and commit (``analysis.collectives``) into
    ``out_dir/collectives_vs_nccl.md`` (and its chart) when the records hold such pairs."""
    if not comparison_frame(records).empty:
        write_nccl_comparison(records, out_dir / "collectives_vs_nccl.md")


def _multihost(records: list[Record], out_dir: Path) -> None:
    """Runs launched as several nodes or processes, or restarted, beside one host's (``analysis.multihost``) into
    ``out_dir/multihost.md`` when the records hold such a pair."""
    if not multihost_table(records).empty:
        write_multihost(records, out_dir / "multihost.md")


# The reports across suites, each from every record: (records, out_dir) -> None, writing only where it applies.
CROSS_REPORTS = {"side_by_side": _side_by_side, "fidelity": _fidelity, "loss_parity": _loss_parity,
                 "multihost": _multihost, "collectives_vs_nccl": _collectives_vs_nccl}


def check_suite(path: Path, suite: str, records: list[Record]) -> None:
    """Refuse records that do not carry what their suite's report reads (``REPORT_METRICS``): a record filed
    under the wrong suite is a ValueError naming the file, the suite and what is missing, not a table of blanks."""
    needed = REPORT_METRICS.get(suite, ())
    for r in records:
        missing = [name for name in needed if name not in r.metrics]
        if r.status == "ok" and missing:
            raise ValueError(f"{path}: a {suite!r} record ({r.backend} {r.implementation}) lacks the metrics "
                             f"{', '.join(missing)} that the {suite} report reads: is it filed under the right suite?")


def _staged(staging: Path, report: Callable[..., object], *args: object) -> list[Path]:
    """Run one report into ``staging``: the files it added there (whatever it returns: a chart's PDF too), then
    the LaTeX and Typst exports of the tables in its Markdown (``analysis.tables.export_markdown_file``)."""
    before = set(staging.rglob("*"))
    report(*args)
    added = sorted(p for p in staging.rglob("*") if p.is_file() and p not in before)
    return added + [export for p in added if p.suffix == ".md" for export in export_markdown_file(p)]


def write_reports(results: Path, out_dir: Path) -> list[Path]:
    """Every suite's report for every record file in ``results``, the reports across suites (``CROSS_REPORTS``)
    and ``index.md`` (``index_markdown``); the files written.

    Each Markdown table gets its LaTeX and Typst exports (``foo.md`` -> ``foo_tables/table<N>.tex`` and ``.typ``)
    and each chart is a PNG with a PDF beside it (``analysis.plots.save_figure``).
    All or nothing: the reports are written into a staging folder inside ``out_dir`` and moved into place only
    when every suite's report and the index are done, so a record that does not fit its report (a ValueError
    naming the file and suite) leaves ``out_dir`` as it was."""
    files = sorted(results.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no *.jsonl record files in {results}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".staging-", dir=out_dir) as tmp:
        staging = Path(tmp)
        entries: list[tuple[str, list[Path]]] = []  # (suite or cross report, the files its report wrote)
        for path in files:
            records = read_records(path)
            for suite in dict.fromkeys(r.suite for r in records):
                mine = [r for r in records if r.suite == suite]
                check_suite(path, suite, mine)
                try:
                    entries.append((suite, _staged(staging, suite_report, path, suite, mine, staging)))
                except (KeyError, TypeError, AttributeError) as err:  # a field the report reads is missing
                    raise ValueError(f"{path}: its {suite!r} records do not fit the {suite} report "
                                     f"({type(err).__name__}: {err}): are they filed under the right suite?") from None
        every = load_records(files)  # the reports across suites read every file once
        cross = {**CROSS_REPORTS, "fidelity": partial(_fidelity, profiles=profile_records([results]))}
        entries += [(name, _staged(staging, report, every, staging)) for name, report in cross.items()]
        entries.append(("answers", _staged(staging, write_answers, results, staging / "answers")))
        entries = [(key, written) for key, written in entries if written]
        index = staging / "index.md"
        index.write_text(index_markdown(entries, staging, results))
        final = []
        for staged in [*(p for _, written in entries for p in written), index]:
            target = out_dir / staged.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged, target)
            final.append(target)
    return final


def index_markdown(entries: Sequence[tuple[str, Sequence[Path]]], root: Path, results: Path) -> str:
    """``index.md``: the reports by section (``SECTIONS``, then ``OTHER_SECTION``; empty sections left out), each
    linking its Markdown, its charts (PNG and PDF) and its tables' LaTeX and Typst exports. ``entries``: (suite or
    cross report, the files its report wrote); only those files are linked, relative to ``root``."""
    sections: dict[str, list[Sequence[Path]]] = {title: [] for title in [*SECTIONS, OTHER_SECTION]}
    for key, written in entries:
        sections[next((t for t, keys in SECTIONS.items() if key in keys), OTHER_SECTION)].append(written)
    lines = ["# Reports", "",
             f"Generated from `{results}/*.jsonl` by `python -m analysis.reports`; do not edit by hand. Each report: "
             "its Markdown, its charts as PNG and PDF, and each of its tables as LaTeX (a booktabs `tabular`: "
             "`\\usepackage{booktabs}`) and Typst (`#table`), in `<report>_tables/table<N>.tex` and `.typ`, N "
             "counting the report's tables in order.", ""]
    for title, reports in sections.items():
        if reports:
            lines += [f"## {title}", ""]
            for written in reports:
                lines += _index_entry(written, root)
            lines.append("")
    return "\n".join(lines)


def _shown(markdown: Path) -> set[Path]:
    """The images a Markdown page shows (``![...](file)``), as paths beside it."""
    return {markdown.parent / link for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown.read_text())}


def _index_entry(written: Sequence[Path], root: Path) -> list[str]:
    """One report in the index: a line per Markdown file with its title, its tables and the charts it shows, then the
    report's charts that no page shows."""
    files = set(written)

    def link(path: Path, text: str | None = None) -> str:
        relative = path.relative_to(root).as_posix()
        return f"[{text or relative}]({relative})"

    def formats(path: Path, kinds: dict[str, str]) -> str:
        return ", ".join(link(path.with_suffix(suffix), name) for suffix, name in kinds.items()
                         if path.with_suffix(suffix) in files)

    def chart_line(charts: list[Path], head: str) -> list[str]:
        return [head + "; ".join(f"{p.stem} ({formats(p, {'.png': 'PNG', '.pdf': 'PDF'})})" for p in charts)] \
            if charts else []

    lines = []
    markdowns = [p for p in written if p.suffix == ".md"]
    charts = [p for p in written if p.suffix == ".png"]
    shown = {markdown: _shown(markdown) for markdown in markdowns}
    unshown = [p for p in charts if not any(p in pictures for pictures in shown.values())]
    for markdown in markdowns:
        heading = next((line[2:] for line in markdown.read_text().splitlines() if line.startswith("# ")), None)
        lines.append(f"- {link(markdown)}" + (f": {heading}" if heading else ""))
        tables = sorted((p for p in written if p.suffix == ".tex" and p.parent == exports_folder(markdown)),
                        key=lambda p: int(p.stem.removeprefix("table")))
        if tables:
            lines.append("  - tables: " + "; ".join(
                f"{p.stem} ({formats(p, {'.tex': 'LaTeX', '.typ': 'Typst'})})" for p in tables))
        lines += chart_line([p for p in charts if p in shown[markdown]], "  - charts: ")
    if markdowns:
        return lines + chart_line(unshown, "  - the report's other charts: ")  # shown in no page of it
    return chart_line(charts, "- charts: ")


def _names(text: str) -> list[str]:
    """A comma-separated list of names, blanks dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


def table_parser(prog: str = f"{PROG} table") -> argparse.ArgumentParser:
    """The flags of ``python -m analysis.reports table``."""
    description = "Print (and optionally write) a Markdown table of records; without --columns, the e2e-like set."
    if prog != f"{PROG} table":
        description += f" {prog} is the old name of {PROG} table, kept for one release."
    parser = ArgumentParser(prog=prog, description=description)
    parser.add_argument("paths", nargs="+", help="record files (.jsonl), globs or folders")
    parser.add_argument("--suite", help="only records of this suite, e.g. e2e")
    parser.add_argument("--columns", type=_names, help="comma-separated columns (default: the e2e set)")
    parser.add_argument("--metrics", type=_names, default=[], help="comma-separated metrics.<name> columns to add")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    return parser


def table_main(argv: Sequence[str] | None = None, prog: str = f"{PROG} table") -> int:
    """``python -m analysis.reports table FILES...``: print the Markdown table of some records (``--out``: also
    write it). Bad input (a missing file, a malformed record, an unknown column or suite) is a one-line error."""
    return error_boundary(_table, prog=prog)(argv, prog)


def _table(argv: Sequence[str] | None, prog: str) -> int:
    args = table_parser(prog).parse_args(argv)
    table = records_table(args.paths, args.suite, args.columns, args.metrics)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n", encoding="utf-8")
    print(table)
    return 0


@error_boundary(prog=PROG)
def _write_all(argv: Sequence[str]) -> int:
    table_usage = table_parser().format_usage().removeprefix("usage: ").strip()
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                            epilog=f"Or one table, printed: {table_usage} (see {PROG} table --help).")
    parser.add_argument("results", nargs="?", default="results", type=Path, help="folder of *.jsonl (default results)")
    parser.add_argument("--out", type=Path, help="where the reports go (default RESULTS/reports)")
    args = parser.parse_args(argv)
    written = write_reports(args.results, args.out or args.results / "reports")
    print("\n".join(f"wrote {p}" for p in written))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Every report (``write_reports``), or with ``table`` first, one table (``table_main``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return table_main(argv[1:]) if argv[:1] == ["table"] else _write_all(argv)


if __name__ == "__main__":
    sys.exit(main())
