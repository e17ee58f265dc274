"""What filter answers: the nodes that fit, and why each of the others does not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn


@dataclass(slots=True)
class FilterOutcome:
    """Nodes that fit, nodes that fail now (`failed`: preemption may help) and nodes that never can.

    `feasible` is shared with the candidate-list cache (prioritize is about to send this very
    list back, and is matched to it by identity): callers read it and never mutate it.
    `unresolvable` may be a `SharedReasons` (read-only) when it holds only label-only reasons.
    """

    feasible: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    #: asked of `filter_nodes`: False leaves the refused nodes unexplained whenever some node
    #: passes (and skips working their reasons out), True explains every refused node
    explain_all: bool = True


class SharedReasons(dict[str, str]):
    """Reasons that several answers share (filter's label-only reasons, kept per candidate list
    and demand shape). Read-only: changing them would change every answer that holds them, so
    the mutating methods raise. `encoded` is for an adapter to keep their wire form in, written
    once instead of on every answer."""

    __slots__ = ("encoded",)

    def __init__(self, *args: Any, **kw: str) -> None:
        super().__init__(*args, **kw)
        self.encoded: bytes | None = None

    def _read_only(self, *args: Any, **kw: Any) -> NoReturn:
        raise TypeError("SharedReasons are shared between answers: copy them to change them")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _read_only


def add_shared_reasons(out: FilterOutcome, base: SharedReasons) -> None:
    """Add the label-only reasons `base` to `out`: as the very object when `out` has no other
    (no copy, and its wire form is written once; `mutable_unresolvable` copies it if more are added later),
    else copied in."""
    if not out.unresolvable:
        out.unresolvable = base
    else:
        mutable_unresolvable(out).update(base)


def mutable_unresolvable(out: FilterOutcome) -> dict[str, str]:
    """`out.unresolvable`, made a dict of its own first if it is shared (copy on write)."""
    if type(out.unresolvable) is SharedReasons:
        out.unresolvable = dict(out.unresolvable)
    return out.unresolvable
