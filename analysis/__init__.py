"""Analysis of measured results: the record schema, tables, plots and predicted-vs-measured reports, one
module per suite's report, and the benchmark harness both backends share (``analysis.harness``).

Import submodules explicitly (``from analysis.records import Record``, ``from analysis.tables import
records_frame``). This package module imports nothing, so ``import analysis.records`` stays stdlib-only and
benchmarks can write records without pulling in pandas or matplotlib.
"""
