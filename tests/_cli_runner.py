"""Run many command lines of one entry point in one interpreter, as ``python -m MODULE ARGS`` would run each.

``python tests/_cli_runner.py CASES.json RESULTS.json``: CASES is a list of ``{"module", "args", "env"}``; each
runs with ``runpy.run_module(module, run_name="__main__")`` (so the module's ``if __name__ == "__main__"`` block
runs, as under ``python -m``), with ``sys.argv`` and the environment set for it and file descriptors 1 and 2
captured (C-level output too). The exit status is the interpreter's: 0 on return, ``SystemExit``'s code (a
message: printed, status 1), and an uncaught exception prints its traceback with status 1. RESULTS gets
``{"code", "stdout", "stderr"}`` per case. One interpreter per entry point keeps a suite of bad inputs fast:
torch and jax are imported once, not once per case.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings

# runpy's note when the module was imported earlier in this interpreter (by another case): `python -m` never sees it
warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)


def _run(module: str, args: list[str]) -> int:
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what the interpreter would print
        traceback.print_exc()
        return 1
    return 0


def run_case(case: dict) -> dict:
    saved_env = dict(os.environ)
    os.environ.update(case.get("env", {}))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = _run(case["module"], case["args"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            os.environ.clear()
            os.environ.update(saved_env)
        out.seek(0)
        err.seek(0)
        return {"code": code, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


if __name__ == "__main__":
    cases_path, results_path = sys.argv[1:3]
    with open(cases_path) as f:
        cases = json.load(f)
    results = [run_case(case) for case in cases]
    with open(results_path, "w") as f:
        json.dump(results, f)
