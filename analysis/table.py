"""Old name of ``python -m analysis.reports table`` (kept for one release; use that):

    python -m analysis.table results/e2e.jsonl --suite e2e --metrics loss_last --out results/e2e.md
"""

from __future__ import annotations

import functools

from analysis.reports import table_main, table_parser
from analysis.tables import filter_suite, records_table as render  # noqa: F401 (old names)

PROG = "python -m analysis.table"
build_parser = functools.partial(table_parser, PROG)
main = functools.partial(table_main, prog=PROG)

if __name__ == "__main__":
    main()
