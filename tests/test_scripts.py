"""The GPU scripts of record (``scripts/*.sh``) parse, name modules that exist, and pass only flags those
modules accept: device time is scarce, so a typo must fail here, on CPU, not on the device machine.

Each ``python3 -m MODULE`` (or ``torchrun ... -m MODULE``) in a script is resolved to the module's
``--help`` text (printed by its own argparse parser, in-process), each ``python3 scripts/NAME.py`` to its
``--help`` run in a subprocess; every ``--flag`` written in the script
must appear in the help of at least one module the script runs or of torchrun's own parser (flags of nvidia-smi,
ncu, tar and pytest aside). Weak in one way (a flag valid for one module but given to another passes) and exact in
the other.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))
OTHER_TOOLS_FLAGS = {"--query-gpu", "--format", "--no-bench",
                     "--clock-control", "--set", "--import-source", "--page", "--csv", "--print-source",  # ncu's
                     "--null",  # tar's
                     "--collect-only"}  # pytest's
NOT_OURS = ("pytest",)


def _help(module: str) -> str:
    main = importlib.import_module(module).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code in (0, None), module
    return out.getvalue()


def _script_help(path: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, path, "--help"], cwd=ROOT, env=env, check=True, capture_output=True,
                          text=True).stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_uses_known_flags(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = re.sub(r"XLA_FLAGS=\S+", "", re.sub(r"#.*", "", script.read_text()))  # comments and XLA's flags out
    modules = sorted(set(re.findall(r"-m ([a-z_]+(?:\.[a-z_0-9]+)+)", text)) - set(NOT_OURS))
    helps = {m: _help(m) for m in modules}
    helps |= {p: _script_help(p) for p in set(re.findall(r"python3 (scripts/[a-z_]+\.py)", text))}
    if "torchrun" in text:
        from torch.distributed.run import get_args_parser

        helps["torchrun"] = get_args_parser().format_help()
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", text)) - OTHER_TOOLS_FLAGS
    unknown = sorted(f for f in flags if not any(re.search(rf"{re.escape(f)}\b", h) for h in helps.values()))
    assert not unknown, f"{script.name}: flags no module of {modules} accepts: {unknown}"
