"""Tables from records: flatten ``Record``s into a pandas DataFrame and render it as a Markdown table.

``records_frame`` gives one row per record; nested fields become flat columns (timing statistics, mesh as
``dp=1,fsdp=4,tp=2``, ``metrics.<name>``, ``<phase>_median_ms``, and the provenance fields worth a column).
``markdown_table`` formats numbers by column name (times to 3 decimals, tokens/s with thousands separators,
MFU as a percentage, bytes in KiB/MiB/GiB) and renders with ``DataFrame.to_markdown`` (tabulate). Failed
runs stay visible: whenever a row's status is not 'ok', the status and error columns are shown.
``records_table`` is both in one call, for the records of one suite (``python -m analysis.reports table``).

Exports for a paper: ``markdown_tables`` reads the pipe tables back out of Markdown text (cells as the Markdown
shows them, so numbers are formatted alike), ``latex_table`` renders one as a booktabs ``tabular``
(``DataFrame.to_latex``) and ``typst_table`` as a Typst ``#table``, both with their special characters escaped;
``export_markdown_file`` writes every table of ``foo.md`` as ``foo_tables/table<N>.tex`` and ``.typ`` (N from 1, in
the Markdown's order), and ``export_table`` one frame's table, as ``markdown_table`` would show it.

Caveat: uses pandas, so benchmarks must not import this module (they import ``analysis.records`` only).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import pandas as pd

from analysis.records import Record, read_records

RecordSource = Union[Record, str, os.PathLike]

MISSING = "—"  # how None/NaN cells render
TIMING_COLUMNS = ("median_ms", "mean_ms", "std_ms", "min_ms", "max_ms")
PROVENANCE_COLUMNS = ("git_commit", "device_name", "date")
DEFAULT_COLUMNS = (
    "backend", "implementation", "model", "batch_size", "seq_len", "dtype", "mode", "status",
    "median_ms", "std_ms", "tokens_per_s", "tflops", "mfu", "peak_memory_bytes",
)  # fmt: skip
_NESTED_FIELDS = ("timing", "mesh", "phases", "metrics", "model_dims", "provenance", "schema_version")
_INT_COLUMNS = ("batch_size", "seq_len", "world_size", "warmup_steps", "timed_steps", "peak_memory_bytes")
_GLOB_CHARS = frozenset("*?[")
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


# ----------------------------------------------------------------------------- loading and flattening


def _base_columns() -> list[str]:
    """Record's top-level fields in schema order, with ``timing`` expanded and other nested fields dropped."""
    columns: list[str] = []
    for f in dataclasses.fields(Record):
        if f.name == "timing":
            columns.extend(TIMING_COLUMNS)
        elif f.name == "mesh" or f.name not in _NESTED_FIELDS:
            columns.append(f.name)
    return columns


BASE_COLUMNS = tuple(_base_columns())


def expand_paths(pattern: str | os.PathLike) -> list[Path]:
    """The ``.jsonl`` files a path names: the file itself, a glob's matches, or a folder's ``*.jsonl``."""
    text = os.fspath(pattern)
    if _GLOB_CHARS & set(text):
        paths = [Path(p) for p in sorted(glob.glob(text, recursive=True))]
        if not paths:
            raise FileNotFoundError(f"no files match {text!r}")
        return paths
    path = Path(text)
    if path.is_dir():
        return sorted(path.glob("*.jsonl"))
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {text}")
    return [path]


def load_records(sources: RecordSource | Iterable[RecordSource]) -> list[Record]:
    """Records given directly, or read from paths / globs / folders of JSON Lines files, in order."""
    if isinstance(sources, (Record, str, os.PathLike)):
        sources = [sources]
    records: list[Record] = []
    for source in sources:
        if isinstance(source, Record):
            records.append(source)
        else:
            for path in expand_paths(source):
                records.extend(read_records(path))
    return records


def format_mesh(mesh: dict[str, int] | None) -> str | None:
    """A mesh as a compact string, e.g. ``dp=1,fsdp=4,tp=2``; None stays None."""
    return ",".join(f"{axis}={size}" for axis, size in mesh.items()) if mesh else None


def flatten_record(record: Record) -> dict[str, Any]:
    """One record as a flat row: top-level fields plus timing, mesh, phases, metrics and provenance columns."""
    data = record.to_dict()
    row: dict[str, Any] = {name: data.get(name) for name in BASE_COLUMNS}
    row.update(record.timing or {})
    row["mesh"] = format_mesh(record.mesh)
    for phase, stats in (record.phases or {}).items():
        row[f"{phase}_median_ms"] = (stats or {}).get("median_ms")
    row.update({f"metrics.{name}": value for name, value in record.metrics.items()})
    prov = record.provenance or {}
    commit = prov.get("git_commit")
    row.update(git_commit=commit[:10] if commit else None, device_name=prov.get("device_name"), date=prov.get("date"))
    return row


def _column_order(rows: list[dict[str, Any]]) -> list[str]:
    """Schema columns first, then phase (and other extra) columns, then metrics, then provenance."""
    fixed = set(BASE_COLUMNS) | set(PROVENANCE_COLUMNS)
    extra = [c for c in dict.fromkeys(c for row in rows for c in row) if c not in fixed]
    metrics = [c for c in extra if c.startswith("metrics.")]
    others = [c for c in extra if not c.startswith("metrics.")]
    return [*BASE_COLUMNS, *others, *metrics, *PROVENANCE_COLUMNS]


def _as_nullable_ints(frame: pd.DataFrame) -> pd.DataFrame:
    """Integer fields as pandas' nullable Int64, so a missing value does not turn 8 into 8.0."""
    for column in _INT_COLUMNS:
        try:
            frame[column] = frame[column].astype("Int64")
        except (TypeError, ValueError):
            pass  # a non-integer value in the data: leave the column as it is
    return frame


def records_frame(records_or_paths: RecordSource | Iterable[RecordSource]) -> pd.DataFrame:
    """One row per record, from ``Record``s or from paths / globs / folders of ``.jsonl`` files."""
    rows = [flatten_record(record) for record in load_records(records_or_paths)]
    return _as_nullable_ints(pd.DataFrame(rows, columns=_column_order(rows)))


def filter_suite(frame: pd.DataFrame, suite: str | None) -> pd.DataFrame:
    """Rows of one suite (all rows for None); no matching row is a ValueError naming the suites present."""
    if suite is None or "suite" not in frame:
        return frame
    rows = frame[frame["suite"] == suite]
    if rows.empty:
        present = ", ".join(sorted(frame["suite"].dropna().unique())) or "none"
        raise ValueError(f"no records of suite {suite!r}; suites present: {present}")
    return rows.reset_index(drop=True)


# ----------------------------------------------------------------------------- formatting


def format_bytes(n: float) -> str:
    """A byte count in binary units: ``512 B``, ``1.50 KiB``, ``40.00 GiB``."""
    value = float(n)
    for unit in _BYTE_UNITS:
        if unit == "B" and abs(value) < 1024:
            return f"{int(value)} B"
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_number(value: float, floatfmt: str = ".4g") -> str:
    """A generic number: values of 10,000 and more as integers with thousands separators, others by
    ``floatfmt`` (integers as they are)."""
    if abs(value) >= 10_000:
        return f"{value:,.0f}"
    return str(value) if isinstance(value, numbers.Integral) else format(value, floatfmt)


def _is_missing(value: Any) -> bool:
    return value is None or (pd.api.types.is_scalar(value) and bool(pd.isna(value)))


def _text(value: Any, max_chars: int | None) -> str:
    """A cell as one line of Markdown-safe text (pipes escaped, whitespace collapsed, long text cut)."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    if max_chars is not None and len(text) > max_chars:
        text = text[: max_chars - 1] + "…"
    return text


def _number_format(column: str, floatfmt: str) -> Callable[[Any], str]:
    """How numbers of a column are written, chosen by its name (``metrics.`` prefix ignored)."""
    name = column.removeprefix("metrics.")
    if name.endswith("_bytes"):
        return format_bytes
    if name.endswith("_ms"):
        return lambda v: f"{v:.3f}"
    if name == "mfu" or name.endswith("_mfu"):
        return lambda v: f"{v:.1%}"
    if name.endswith("tokens_per_s"):
        return lambda v: f"{v:,.0f}"
    if name == "tflops":
        return lambda v: f"{v:.4g}"  # 345.7 on a GPU, 0.03125 on a CPU
    if name.startswith("flops"):
        return lambda v: f"{v:.3e}"
    return lambda v: format_number(v, floatfmt)


def format_column(frame: pd.DataFrame, column: str, floatfmt: str = ".4g", max_chars: int | None = 120) -> pd.Series:
    """A column's cells as strings: numbers formatted by column name, missing as ``—``, text one-lined."""
    number = _number_format(column, floatfmt)

    def cell(value: Any) -> str:
        if _is_missing(value):
            return MISSING
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return number(value)
        return _text(value, max_chars)

    return frame[column].map(cell)


# ----------------------------------------------------------------------------- tables


def select_columns(frame: pd.DataFrame, columns: Sequence[str] | None = None, metrics: Sequence[str] = ()) -> list[str]:
    """The columns to show: ``columns`` (default: DEFAULT_COLUMNS that have a value) plus ``metrics.<m>`` for
    each of ``metrics``; status and error are added whenever a row failed. Unknown names raise ValueError."""
    if columns is None:
        chosen = [c for c in DEFAULT_COLUMNS if c in frame and (frame.empty or frame[c].notna().any())]
    else:
        chosen = list(columns)
    chosen += [m if m.startswith("metrics.") else f"metrics.{m}" for m in metrics]
    unknown = [c for c in chosen if c not in frame.columns]
    if unknown:
        raise ValueError(f"unknown column(s) {', '.join(unknown)}; accepted: {', '.join(map(str, frame.columns))}")
    if not chosen:
        raise ValueError("no columns to show")
    if "status" in frame and (frame["status"] != "ok").any():
        chosen += ["status", "error"]
    return list(dict.fromkeys(chosen))


def _alignment(series: pd.Series) -> str:
    numeric = pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)
    return "right" if numeric else "left"


def markdown_table(
    frame: pd.DataFrame,
    columns: Sequence[str] | None = None,
    *,
    metrics: Sequence[str] = (),
    floatfmt: str = ".4g",
    max_chars: int | None = 120,
) -> str:
    """A Markdown (pipe) table of ``frame``'s chosen columns (see ``select_columns``), numbers formatted by
    column name, generic floats by ``floatfmt``, text cut to ``max_chars``; missing cells render as ``—``; pipes
    escaped, in headers too (``median |error|``)."""
    chosen = select_columns(frame, columns, metrics)
    cells = pd.DataFrame({c: format_column(frame, c, floatfmt, max_chars) for c in chosen}, columns=chosen)
    return cells.to_markdown(index=False, disable_numparse=True, colalign=[_alignment(frame[c]) for c in chosen],
                             headers=[_text(c, None) for c in chosen])


def records_table(sources: RecordSource | Iterable[RecordSource], suite: str | None = None,
                  columns: Sequence[str] | None = None, metrics: Sequence[str] = ()) -> str:  # fmt: skip
    """The Markdown table of the records in ``sources`` (paths, globs, folders or ``Record``s), of one suite if
    given (``filter_suite``), with ``markdown_table``'s columns."""
    return markdown_table(filter_suite(records_frame(sources), suite), columns, metrics=metrics)


# ----------------------------------------------------------------------------- LaTeX and Typst exports

# A pipe table's separator row, e.g. ``|:----|-----:|`` (colons give the alignment).
_SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")  # a cell boundary: a pipe that ``_text`` did not escape
_TYPST_SPECIAL = re.compile(r"([\\#$*_`<>@\[\]{}~=+\-/])")  # markup characters, escaped by a backslash
_LATEX_ALIGN = {"left": "l", "right": "r", "center": "c"}


def _row(line: str) -> list[str]:
    return [cell.strip().replace("\\|", "|") for cell in _CELL_SPLIT.split(line.strip()[1:-1])]


def _align(separator: str) -> str:
    cell = separator.strip()
    return "center" if cell[:1] == cell[-1:] == ":" else "right" if cell.endswith(":") else "left"


def markdown_tables(text: str) -> list[tuple[pd.DataFrame, list[str]]]:
    """Every pipe table in Markdown ``text`` (``markdown_table``'s or hand-written), in order: its cells as
    text, exactly as the Markdown shows them, and each column's alignment ("left", "right" or "center")."""
    lines, tables, i = text.splitlines(), [], 0
    while i + 1 < len(lines):
        if lines[i].lstrip().startswith("|") and _SEPARATOR.match(lines[i + 1].strip()):
            header, align = _row(lines[i]), [_align(c) for c in _row(lines[i + 1])]
            i += 2
            body = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                body.append(_row(lines[i]))
                i += 1
            tables.append((pd.DataFrame(body, columns=header, dtype=object), align))
        else:
            i += 1
    return tables


def latex_table(cells: pd.DataFrame, align: Sequence[str]) -> str:
    """A booktabs ``tabular`` (``\\toprule``/``\\midrule``/``\\bottomrule``: ``\\usepackage{booktabs}``) by
    ``DataFrame.to_latex`` with LaTeX's special characters escaped (``& % $ # _ { } ~ ^ \\``); ``cells`` are
    text already formatted (``markdown_tables``).
    https://pandas.pydata.org/docs/reference/api/pandas.DataFrame.to_latex.html"""
    return cells.to_latex(index=False, escape=True, column_format="".join(_LATEX_ALIGN[a] for a in align))


def typst_table(cells: pd.DataFrame, align: Sequence[str]) -> str:
    """A Typst ``#table`` with a ``table.header`` row, one content block per cell, markup characters escaped
    by a backslash. https://typst.app/docs/reference/model/table/"""

    def block(text: Any) -> str:
        return "[" + _TYPST_SPECIAL.sub(r"\\\1", str(text)) + "]"

    lines = ["#table(", f"  columns: {len(cells.columns)},", f"  align: ({', '.join(align)},),",
             f"  table.header({', '.join(block(c) for c in cells.columns)}),"]
    lines += [f"  {', '.join(block(v) for v in row)}," for row in cells.itertuples(index=False)]
    return "\n".join(lines + [")"]) + "\n"


def write_table(cells: pd.DataFrame, align: Sequence[str], stem: str | os.PathLike) -> list[Path]:
    """One table as ``<stem>.tex`` (``latex_table``) and ``<stem>.typ`` (``typst_table``); the two files."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, render in ((".tex", latex_table), (".typ", typst_table)):
        path = stem.with_name(stem.name + suffix)
        path.write_text(render(cells, align), encoding="utf-8")
        written.append(path)
    return written


def exports_folder(markdown_file: str | os.PathLike) -> Path:
    """Where the exports of a Markdown report's tables go: ``foo.md`` -> ``foo_tables/``."""
    path = Path(markdown_file)
    return path.with_name(f"{path.stem}_tables")


def export_markdown_file(markdown_file: str | os.PathLike) -> list[Path]:
    """Each pipe table of a Markdown report as ``foo_tables/table<N>.tex`` and ``.typ`` beside ``foo.md``
    (N = 1, 2, ... in the Markdown's order; ``exports_folder``); the files written (none without a table)."""
    tables = markdown_tables(Path(markdown_file).read_text(encoding="utf-8"))
    folder = exports_folder(markdown_file)
    return [path for n, table in enumerate(tables, start=1) for path in write_table(*table, folder / f"table{n}")]


def export_table(frame: pd.DataFrame, columns: Sequence[str] | None = None, *, out: str | os.PathLike,
                 **options: Any) -> list[Path]:
    """``markdown_table(frame, columns, **options)`` as ``<out>.tex`` and ``<out>.typ``: the Markdown's columns
    and cells, formatted alike (for a notebook or a paper; the reports export theirs with ``export_markdown_file``)."""
    [(cells, align)] = markdown_tables(markdown_table(frame, columns, **options))
    return write_table(cells, align, out)
