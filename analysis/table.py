"""Command line: print (and optionally write) a Markdown table of measured records.

    python -m analysis.table results/e2e.jsonl [more files, globs or folders] [--suite e2e]
        [--columns backend,implementation,median_ms] [--metrics loss,bus_gbps] [--out results/e2e.md]

Without ``--columns`` the default e2e-like column set is shown (columns with no value at all are left out).
Bad input (a missing file, a malformed record, an unknown column or suite) exits with a one-line message.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import pandas as pd

from analysis.tables import markdown_table, records_frame
from parallelism_calc.cli import ArgumentParser, error_boundary


def _names(text: str) -> list[str]:
    """A comma-separated list of names, blanks dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m analysis.table", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="record files (.jsonl), globs or folders")
    parser.add_argument("--suite", help="only records of this suite, e.g. e2e")
    parser.add_argument("--columns", type=_names, help="comma-separated columns (default: the e2e set)")
    parser.add_argument("--metrics", type=_names, default=[], help="comma-separated metrics.<name> columns to add")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    return parser


def filter_suite(frame: pd.DataFrame, suite: str | None) -> pd.DataFrame:
    """Rows of one suite (all rows for None); no matching row is an error naming the suites present."""
    if suite is None:
        return frame
    rows = frame[frame["suite"] == suite]
    if rows.empty:
        present = ", ".join(sorted(frame["suite"].dropna().unique())) or "none"
        raise ValueError(f"no records of suite {suite!r}; suites present: {present}")
    return rows.reset_index(drop=True)


def render(paths: Sequence[str], suite: str | None = None, columns: Sequence[str] | None = None,
           metrics: Sequence[str] = ()) -> str:  # fmt: skip
    """The Markdown table of the records in ``paths``."""
    frame = filter_suite(records_frame(list(paths)), suite)
    return markdown_table(frame, columns, metrics=metrics)


@error_boundary(prog="python -m analysis.table")
def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    table = render(args.paths, args.suite, args.columns, args.metrics)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n", encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
