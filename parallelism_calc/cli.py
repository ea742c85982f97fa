"""What every command line of the project shares: checked numeric flags, one-line errors, one error boundary.

* ``ArgumentParser``: argparse whose errors are one line on stderr (``prog: error: ...``) and exit status 2,
  with no usage dump.
* Flag types for ``add_argument(type=...)``: ``positive_int``, ``nonnegative_int``, ``positive_float``,
  ``nonnegative_float``, ``finite_float``, ``fraction`` (in (0, 1)) and ``int_list`` (comma-separated
  positive integers); ``parse_list`` checks a comma list of names. Every number must be finite (no ``nan`` /
  ``inf``); an integer flag accepts ``1e6`` but refuses ``0.5``. A refused value is named with what is
  accepted, e.g. ``argument --batch-tokens: '0.5' is not a whole number; accepted: integers > 0``.
* ``writable_path``: a file the command may create or append to (its folder exists or can be made, and is a
  folder; the file, if it exists, is a writable file), checked before any measurement starts.
* ``error_boundary``: the decorator of every entry point's ``main(argv)``: bad input or an unusable file
  (``ValueError``, ``OSError``) ends as ``prog: error: <one line>`` on stderr and exit status 2 (``BadInput``,
  a ``SystemExit``), never a traceback. Anything else (a bug) still shows its traceback.

Standard library only, so the calculator, ``analysis`` and both backends import it (``parallelism_calc``
imports nothing of ours).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import Callable

BAD_INPUT_STATUS = 2  # the exit status of every refused input, argparse's own included


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit status 2 (``BadInput``, whose ``str()`` is
    the message)."""

    def error(self, message: str):
        print(f"{self.prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
        raise BadInput(one_line(message))


def one_line(message: object) -> str:
    """A message on one line: its lines joined with ' / ', blank ones dropped."""
    return " / ".join(line.strip() for line in str(message).splitlines() if line.strip())


def _parse_number(text: str, kind: type) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if kind is int:
        try:
            return int(text)  # exact for long integers
        except ValueError:
            if not value.is_integer():
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
            return int(value)  # e.g. 1e6
    return value


def number(kind: type = float, *, above: float | None = None, at_least: float | None = None,
           below: float | None = None) -> Callable[[str], int | float]:
    """An argparse type: a finite ``kind`` (int or float) ``> above``, ``>= at_least`` and ``< below``."""
    bounds = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else "",
              f"< {below:g}" if below is not None else ""]
    accepted = f"{'integers' if kind is int else 'finite numbers'} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text: str) -> int | float:
        try:
            value = _parse_number(text.strip(), kind)
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{err}; accepted: {accepted}") from None
        if ((above is not None and not value > above) or (at_least is not None and not value >= at_least)
                or (below is not None and not value < below)):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {' and '.join(b for b in bounds if b)}")
        return value

    parse.__name__ = accepted  # argparse names the type in its own messages
    return parse


positive_int = number(int, above=0)
nonnegative_int = number(int, at_least=0)
positive_float = number(float, above=0)
nonnegative_float = number(float, at_least=0)
finite_float = number(float)
fraction = number(float, above=0, below=1)


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. ``128,256,512`` (blanks between commas are skipped)."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: write comma-separated integers > 0, e.g. 128,256")
    try:
        return [positive_int(item) for item in items]
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {str(err).split('; ')[0]}; accepted: comma-separated integers "
                                         "> 0, e.g. 128,256") from None


def parse_list(text: str, flag: str, accepted: tuple[str, ...] | None = None) -> list[str]:
    """A comma list of names, 'a, b,a' -> ['a', 'b'] (order kept, repeats dropped); empty, or with a name outside
    ``accepted`` where given, is a ValueError naming ``flag`` (and what it accepts)."""
    items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [i for i in items if accepted is not None and i not in accepted]
    if not items or unknown:
        problem = f"unknown {unknown}" if unknown else "empty"
        raise ValueError(f"{flag} {text!r}: {problem}" + (f"; accepted (comma list): {', '.join(accepted)}"
                                                          if accepted else ""))
    return items


def check_writable(path: str | os.PathLike) -> Path:
    """``path`` if a file can be created or appended there, else an ``OSError`` naming it and why."""
    path = Path(path)
    if path.exists():
        if path.is_dir():
            raise IsADirectoryError(f"{path}: is a folder; accepted: a file to append to")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path}: not writable")
        return path
    folder = path.parent
    while not folder.exists():  # the nearest existing ancestor: the folders below it will be made
        folder = folder.parent
    if not folder.is_dir():
        raise NotADirectoryError(f"{path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{path}: cannot create it, the folder {folder} is not writable")
    return path


def writable_path(text: str) -> str:
    """An argparse type: a file path ``check_writable`` accepts (returned as given)."""
    try:
        check_writable(text)
    except OSError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


class BadInput(SystemExit):
    """Exit status 2 for refused input; ``str()`` is the one-line message (already printed on stderr)."""

    def __init__(self, message: str):
        super().__init__(BAD_INPUT_STATUS)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _prog_of(main: Callable) -> str:
    module = main.__module__
    if module == "__main__":  # run as `python -m package.module`: the module's own name
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name.removesuffix(".__main__") if spec else os.path.basename(sys.argv[0])
    return f"python -m {module}"


def error_boundary(main: Callable[..., int | None] | None = None, *, prog: str | None = None):
    """The top-level boundary of a CLI's ``main(argv)`` (a decorator, bare or with ``prog=``): a ``ValueError``
    or ``OSError`` escaping it becomes ``prog: error: <one line>`` on stderr and ``BadInput`` (a ``SystemExit``
    with status 2, like argparse's own errors), never a traceback. Anything else (a bug) keeps its traceback."""
    def wrap(function: Callable[..., int | None]) -> Callable[..., int]:
        @functools.wraps(function)
        def run(*args, **kwargs) -> int:
            try:
                return function(*args, **kwargs) or 0
            except (ValueError, OSError) as err:
                message = one_line(err)
                sys.stdout.flush()
                print(f"{prog or _prog_of(function)}: error: {message}", file=sys.stderr, flush=True)
                raise BadInput(message) from None
        return run

    return wrap(main) if main is not None else wrap
