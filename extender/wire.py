"""The kube-scheduler extender wire types (k8s.io/kube-scheduler/extender/v1), keys exact.

The Go structs have no json tags, so the JSON keys are the Go field names in PascalCase.
Embedded Kubernetes objects (Pod, Node) stay plain dicts: the core reads the few fields it
needs, and validating a whole PodSpec on every call would cost more than the decision.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Annotated, Any, overload

import numpy as np
import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, RootModel

__all__ = [
    "VERBS",
    "MIN_PRIORITY",
    "MAX_PRIORITY",
    "NodeList",
    "ExtenderArgs",
    "ExtenderFilterResult",
    "HostPriority",
    "HostPriorityList",
    "ScoredHosts",
    "HostTables",
    "ExtenderBindingArgs",
    "ExtenderBindingResult",
    "MetaPod",
    "MetaVictims",
    "Victims",
    "ExtenderPreemptionArgs",
    "ExtenderPreemptionResult",
]

VERBS = ("filter", "prioritize", "bind", "preempt")
MIN_PRIORITY = 0
MAX_PRIORITY = 10

_IN = ConfigDict(extra="ignore", strict=True)
_OUT = ConfigDict(extra="forbid")
Name = Annotated[str, Field(max_length=253)]


class NodeList(BaseModel):
    """v1.NodeList; only `items` matters to us, the rest is passed through untouched."""

    model_config = ConfigDict(extra="allow", strict=True)
    items: list[dict[str, Any]] = Field(default_factory=list)


class ExtenderArgs(BaseModel):
    """Body of filter and prioritize. `Nodes` when nodeCacheCapable=false, else `NodeNames`."""

    model_config = _IN
    Pod: dict[str, Any]
    Nodes: NodeList | None = None
    NodeNames: list[Name] | None = None


class ExtenderFilterResult(BaseModel):
    model_config = _OUT
    Nodes: NodeList | None = None
    NodeNames: list[str] | None = None
    FailedNodes: dict[str, str] = Field(default_factory=dict)
    FailedAndUnresolvableNodes: dict[str, str] = Field(default_factory=dict)
    Error: str = ""


class HostPriority(BaseModel):
    model_config = _OUT
    Host: str
    Score: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]


class HostPriorityList(RootModel[list[HostPriority]]):
    """Prioritize answers with a bare JSON array, not an object."""


class ScoredHosts(Sequence[HostPriority]):
    """A prioritize answer kept as arrays: hosts `names[rows]` (in request order) with `scores`.

    Reads like a list of HostPriority; `to_json` writes the bare array from a per-node table of
    fixed-width entries cached with `names`, without a Python object per host: 5,000
    HostPriority models cost milliseconds on every call, the table a gather.
    """

    __slots__ = ("_names", "_rows", "_scores")

    def __init__(self, names: np.ndarray, rows: np.ndarray, scores: np.ndarray) -> None:
        if len(rows) != len(scores):
            raise ValueError("one score per host")
        if len(scores) and (int(scores.min()) < MIN_PRIORITY or int(scores.max()) > MAX_PRIORITY):
            raise ValueError(f"extender scores must be within {MIN_PRIORITY}..{MAX_PRIORITY}")
        self._names, self._rows, self._scores = names, rows, scores

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> HostPriority: ...
    @overload
    def __getitem__(self, i: slice) -> list[HostPriority]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return HostPriority(Host=self._names[self._rows[i]], Score=int(self._scores[i]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-sequence semantics, like list

    def __repr__(self) -> str:
        return f"ScoredHosts({len(self)} hosts)"

    def to_json(self, tables: HostTables | None = None) -> bytes:
        """The bare JSON array; `tables` keeps the per-node table between answers (the server
        has one), else it is built for this answer alone."""
        if not len(self._rows):
            return b"[]"
        table = tables.table(self._names) if tables is not None else _entry_table(self._names)
        out = table.take(self._rows, axis=0)  # one fixed-width row per host, score not yet written
        out[:, -4:-2] = _SCORE_DIGITS[self._scores]
        out[-1, -1] = ord("]")  # the last entry's comma closes the array instead
        return b"[" + out.tobytes()


# `{"Host":"n",<pad>"Score":SS},` per node, all of one width, as a uint8 table; SS is two
# characters (" 7" or "10"). JSON allows whitespace between tokens, so every entry can have the
# same width: the answer is then one gather of rows and one column write, with no Python object
# per host (a join of 5,000 separate fragments costs several times more, mostly in cache misses).
_SCORE_DIGITS = np.frombuffer(
    b"".join(b"%2d" % s for s in range(MAX_PRIORITY + 1)), np.uint8
).reshape(-1, 2)


def _entry_table(names: np.ndarray) -> np.ndarray:
    heads = [b'{"Host":' + orjson.dumps(n) + b"," for n in names.tolist()]
    width = max(map(len, heads), default=0)
    rows = b"".join(h.ljust(width) + b'"Score":00},' for h in heads)
    if not heads:
        return np.empty((0, 0), np.uint8)
    return np.frombuffer(rows, np.uint8).reshape(len(heads), -1)


class HostTables:
    """The entry table of each node-name array prioritize answers with (`ScoredHosts.to_json`),
    kept while that array lives. Placement hands out one names array per inventory (a new one when
    nodes change), so a server keeps one of these and reuses each table from answer to answer."""

    __slots__ = ("_tables",)

    def __init__(self) -> None:
        #: id of a names array -> (weak reference to it, its table)
        self._tables: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}

    def table(self, names: np.ndarray) -> np.ndarray:
        entry = self._tables.get(id(names))
        if entry is None or entry[0]() is not names:
            for key in [k for k, (ref, _) in self._tables.items() if ref() is None]:
                del self._tables[key]
            entry = self._tables[id(names)] = (weakref.ref(names), _entry_table(names))
        return entry[1]


class ExtenderBindingArgs(BaseModel):
    model_config = _IN
    PodName: Name
    PodNamespace: Name
    PodUID: Annotated[str, Field(max_length=128)] = ""
    Node: Name


class ExtenderBindingResult(BaseModel):
    model_config = _OUT
    Error: str = ""


class MetaPod(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    UID: str


def _none_as_empty(value: Any) -> Any:
    """Go marshals a nil slice as null: a node kube-scheduler proposes with no victims yet (a
    placeholder, kubernetes PR 135486) comes as `"Pods": null`."""
    return [] if value is None else value


class MetaVictims(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    Pods: Annotated[list[MetaPod], BeforeValidator(_none_as_empty)] = Field(default_factory=list)
    NumPDBViolations: int = 0


class Victims(BaseModel):
    """Full-pod victims, sent when nodeCacheCapable=false."""

    model_config = ConfigDict(extra="ignore", strict=True)
    Pods: Annotated[list[dict[str, Any]], BeforeValidator(_none_as_empty)] = Field(
        default_factory=list
    )
    NumPDBViolations: int = 0


class ExtenderPreemptionArgs(BaseModel):
    model_config = _IN
    Pod: dict[str, Any]
    NodeNameToVictims: dict[str, Victims] | None = None
    NodeNameToMetaVictims: dict[str, MetaVictims] | None = None


class ExtenderPreemptionResult(BaseModel):
    """Always the Meta form, whatever nodeCacheCapable is."""

    model_config = _OUT
    NodeNameToMetaVictims: dict[str, MetaVictims] = Field(default_factory=dict)
