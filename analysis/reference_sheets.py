"""The reference answer sheets' figures, read from their text: ``python -m analysis.reference_sheets SHEET --out JSON``.

The CS336 answer sheets in ``../shared/reference/`` (their GPU is not named) print their measurements as text
tables. This reads the tables the single-GPU answer pages (``analysis.answers``) set ours beside, so that no figure
of theirs is typed by hand:

* ``benchmark``: rows ``<model>_seq<N> [BF16|FP32] <params> <forward s>±<std> [<backward s>±<std>]`` with the section
  (``# heading``) they stand under; the first table of ``# benchmarking_script`` is their fp32 timing;
* ``attention``: rows ``[uncompiled|compiled] <d> <seq> <forward ms> ± <std> <backward ms> ± <std> <MB before
  backward> <peak MB> <status>`` of the naive attention benchmark (``# pytorch_attention``) and its compiled
  comparison (``# torch_compile``); rows without a version are eager.

The JSON names the sheet it came from; ``python -m analysis.reports`` reads it from ``results/`` where committed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Sequence

from parallelism_calc.cli import ArgumentParser, error_boundary

_NUMBER = r"([0-9.]+)\s*±\s*([0-9.]+)"
_BENCHMARK = re.compile(rf"^(\S+)_seq(\d+)\s+(?:(BF16|FP32|FP16)\s+)?([0-9,]+)\s+{_NUMBER}(?:\s+{_NUMBER})?\s*$")
_ATTENTION = re.compile(rf"^(?:(uncompiled|compiled)\s+)?(\d+)\s+(\d+)\s+{_NUMBER}\s+{_NUMBER}\s+([0-9.]+)\s+"
                        r"([0-9.]+)\s+(\S+)\s*$")


def parse(text: str) -> dict[str, list[dict]]:
    """The sheet's benchmark and attention rows (module docstring), each with the section it stands under."""
    section, found = None, {"benchmark": [], "attention": []}
    for line in text.splitlines():
        if line.startswith("# "):
            section = line[2:].strip()
        elif match := _BENCHMARK.match(line):
            model, seq, precision, params, fwd, fwd_std, bwd, bwd_std = match.groups()
            found["benchmark"].append({
                "section": section, "model": model, "seq_len": int(seq), "precision": (precision or "").lower() or None,
                "params": int(params.replace(",", "")), "first_s": float(fwd), "first_std_s": float(fwd_std),
                "backward_s": float(bwd) if bwd else None, "backward_std_s": float(bwd_std) if bwd_std else None})
        elif match := _ATTENTION.match(line):
            version, d, seq, fwd, fwd_std, bwd, bwd_std, before, peak, status = match.groups()
            found["attention"].append({
                "section": section, "compiled": version == "compiled", "head_dim": int(d), "seq_len": int(seq),
                "forward_ms": float(fwd), "forward_std_ms": float(fwd_std), "backward_ms": float(bwd),
                "backward_std_ms": float(bwd_std), "mb_before_backward": float(before), "peak_mb": float(peak),
                "ok": status == "✓"})
    return found


@error_boundary(prog="python -m analysis.reference_sheets")
def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m analysis.reference_sheets", description=__doc__.splitlines()[0])
    parser.add_argument("sheet", type=Path, help="an answer sheet, e.g. ../shared/reference/004_722047cb0ca82bb9.txt")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write, e.g. results/reference_004.json")
    args = parser.parse_args(argv)
    if not args.sheet.is_file():
        raise ValueError(f"{args.sheet}: no such file")
    found = parse(args.sheet.read_text(encoding="utf-8"))
    if not found["benchmark"]:
        raise ValueError(f"{args.sheet}: no benchmark table rows (<model>_seq<N> ... <s>±<std>) in it")
    args.out.write_text(json.dumps({"sheet": args.sheet.name, **found}, indent=1) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(found['benchmark'])} benchmark rows, {len(found['attention'])} attention rows "
          f"from {args.sheet.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
