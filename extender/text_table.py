"""Plain text tables for the commands that print results (`simulate`, `plan-defrag`): columns
padded to their widest cell, two spaces apart, no colour, so the output reads the same in a
terminal, a log and a pipe."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["print_table"]


def print_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print `head`, then every row, each cell left-aligned to its column's width."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
