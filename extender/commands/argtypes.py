"""argparse types for the commands' numeric flags and output files.

Why: a range check after parsing lets NaN through (every comparison with it is False), and
`inf` or a negative count then fails deep inside a solver or a loop, with a traceback or a
hang. These types reject the value while parsing, so the command stops before it reads a file
or opens a port, with argparse's usual line: `vramsched simulate: error: argument
--move-budget: must be a finite number >= 0, got 'inf'` (exit status 2)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["number", "whole", "PORT", "output_file"]


def _figure(bound: float) -> str:
    """A bound as written: a whole one in full (`2147483647`, not `2.14748e+09`)."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _bounds(at_least: float | None, above: float | None, at_most: float | None) -> str:
    parts = []
    if at_least is not None:
        parts.append(f">= {_figure(at_least)}")
    if above is not None:
        parts.append(f"> {_figure(above)}")
    if at_most is not None:
        parts.append(f"<= {_figure(at_most)}")
    return " and ".join(parts)


def number(
    *, at_least: float | None = None, above: float | None = None, at_most: float | None = None
) -> Callable[[str], float]:
    """A finite float within the bounds given."""
    want = " ".join(("a finite number", _bounds(at_least, above, at_most))).strip()

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if (
            not math.isfinite(value)
            or (at_least is not None and value < at_least)
            or (above is not None and value <= above)
            or (at_most is not None and value > at_most)
        ):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def whole(
    *,
    at_least: int = 0,
    at_most: int | None = None,
    read: Callable[[str], int] = int,
    spelled: str = "",
) -> Callable[[str], int]:
    """A whole number within the bounds given, read by `read` (`spelled`: its forms, for the
    message)."""
    want = " ".join(("a whole number", _bounds(at_least, None, at_most)))
    if spelled:
        want += f" ({spelled})"

    def parse(text: str) -> int:
        try:
            value = read(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if value < at_least or (at_most is not None and value > at_most):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = "whole"
    return parse


#: a TCP port; 0 where the flag's help says it turns the listener off
PORT = whole(at_least=0, at_most=65535)


def output_file(text: str) -> Path:
    """A file the command will write: its folder must exist and be writable, so that a replay
    or a solve of minutes is not lost to a typo in the path at its end."""
    path = Path(text)
    folder = path.parent
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return path
