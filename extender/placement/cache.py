"""What placement derives from the ledger's device arrays and keeps with them: one `ArraysCache`
per `DeviceArrays`, made on first use (`cache_of`).

Invalidation is by ownership, not by checks: a change of inventory (a node added, removed or
relabelled) makes the ledger build new arrays, and the old ones take their cache with them. So
what depends on labels only is computed once per inventory and never checked again. The few
entries that also read the used columns say how they follow them (the ledger's generation, or
its log of touched nodes). A view that only swaps the used columns (`dataclasses.replace`)
shares its source's cache: its rows and labels are the same.

Caches per demand shape are `ShapeCache`s, emptied when full, so odd demands cannot grow them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeVar

import numpy as np

from extender.arrays import DeviceArrays
from extender.placement.outcome import SharedReasons
from extender.stock_plugin import BoundView, SharedFit

__all__ = [
    "ArraysCache",
    "ShapeCache",
    "NodeKinds",
    "KeptScores",
    "cache_of",
    "SHAPES_KEPT",
    "SCORE_SHAPES_KEPT",
]

K = TypeVar("K")
V = TypeVar("V")

#: demand shapes kept per `ShapeCache` (labels-only masks and counts)
SHAPES_KEPT = 256
#: demand shapes whose scores are kept (30 KB each at 5,000 nodes: keys, fits, answers): the load
#: test's pod mix has ~480, and emptying the cache every 256 new shapes threw away the frequent
#: ones too
SCORE_SHAPES_KEPT = 1024
#: candidate lists remembered with their rows (`views.candidate_rows`)
CANDIDATE_LISTS_KEPT = 8
#: label-only reasons kept per (candidate list, demand shape) (`reasons.explain`)
FIXED_REASONS_KEPT = 256


class ShapeCache(dict[K, V]):
    """Entries per demand shape. `room()` is called before each lookup and empties a full cache
    (`limit` entries), so a stream of distinct shapes cannot grow it."""

    __slots__ = ("limit",)

    def __init__(self, limit: int = SHAPES_KEPT) -> None:
        super().__init__()
        self.limit = limit

    def room(self) -> ShapeCache[K, V]:
        """This cache, emptied first if it is full."""
        if len(self) >= self.limit:
            self.clear()
        return self


class NodeKinds(NamedTuple):
    """Per node of the arrays: its name (an object array, for fast fancy indexing), its kind (nodes
    of a kind have the same devices, product and problem, so label-only reasons are worded once
    per kind) and whether it has a problem (not a GPU node)."""

    names: np.ndarray
    kind: np.ndarray
    problem: np.ndarray


#: a demand shape's (static) fit: devices of the resource and products, bytes needed on each,
#: those big enough for the pod
StaticFit = tuple[np.ndarray, np.ndarray, np.ndarray]
#: a per-resource view: (its rows among every device's, the view's static arrays), or
#: (None, None) when the resource has every device (no view needed)
ResourceView = tuple[np.ndarray, DeviceArrays] | tuple[None, None]
#: a remembered candidate list: (the names, their rows, the unknown names)
Candidates = tuple[list[str], np.ndarray, list[str]]


@dataclass(slots=True)
class KeptScores:
    """A demand shape's order keys (int32), fits and answers (int8, 0..9) for every node of the
    arrays, as of the ledger's log position `position` (`score._kept_scores` patches them on
    the nodes touched since)."""

    position: int
    scores: np.ndarray
    placed: np.ndarray
    answers: np.ndarray


@dataclass(slots=True, eq=False)
class ArraysCache:
    """Placement's derived state for one `DeviceArrays` (see the module docstring for when it
    goes). Every array handed out from here is shared: callers read it and never write it."""

    # ----- labels only: valid as long as the arrays ------------------------------------------
    #: node names as an object array, one per arrays (encoders cache per-node fragments by its
    #: identity); the same object as `kinds.names` once the kinds exist
    names: np.ndarray | None = None
    #: node kinds (`views.node_kinds`); a resource view shares its source's
    kinds: NodeKinds | None = None
    #: one node row per kind, to count label-only figures once per kind (`reasons._static_counts`)
    kind_reps: np.ndarray | None = None
    #: devices per node (`choose.best_fit_devices`)
    sizes: np.ndarray | None = None
    #: per node, the per-pod cap and product id all its devices share, or False when some node
    #: mixes them (`views.uniform_labels`)
    uniform: tuple[np.ndarray, np.ndarray] | Literal[False] | None = None
    #: per node, the memory all its devices have, or False when some node mixes sizes
    #: (`views.node_capacity`)
    capacity: np.ndarray | Literal[False] | None = None
    #: per resource id, the devices of that resource only (`views.resource_arrays`)
    by_resource: dict[int, ResourceView] = field(default_factory=dict)
    #: per demand shape: bytes needed on each device (`fit.shape_need`; the same object for the
    #: same shape, as `kept_bound` compares it by identity), the static fit (`fit.static_fit`),
    #: per node whether it is big enough and of an allowed product (`fit.node_ok`), per node
    #: devices of the resource and big enough (`reasons._static_counts`), per node devices that
    #: need no pin the pod cannot take (`reasons._pinnable`)
    need: ShapeCache[int | None, np.ndarray] = field(default_factory=ShapeCache)
    static_fit: ShapeCache[tuple[object, ...], StaticFit] = field(default_factory=ShapeCache)
    node_ok: ShapeCache[tuple[object, ...], tuple[np.ndarray, np.ndarray]] = field(
        default_factory=ShapeCache
    )
    static_counts: ShapeCache[tuple[object, ...], StaticFit] = field(default_factory=ShapeCache)
    pinnable: ShapeCache[tuple[object, ...], np.ndarray] = field(default_factory=ShapeCache)
    #: label-only reasons per (node kind, demand shape), worded once (`reasons.explain`)
    kind_reasons: dict[tuple[int, tuple[object, ...]], str] = field(default_factory=dict)
    #: per (candidate list, demand shape): the rows whose reasons are label-only, and those
    #: reasons, handed out as is to the next answer for the same list and shape (`reasons.explain`)
    fixed: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray, SharedReasons]] = field(
        default_factory=dict
    )
    #: the last candidate lists and their rows, most recently used first (`views.candidate_rows`);
    #: rows are labels only (a node added or removed rebuilds the arrays)
    candidates: list[Candidates] = field(default_factory=list)

    # ----- what also reads the used columns ----------------------------------------------------
    #: a resource view's arrays with the used columns of the ledger generation they were
    #: gathered at (`views.resource_arrays`): the same object until the ledger changes
    current: tuple[int, DeviceArrays] | None = None
    #: the device plugin's bound over every device (or one resource's), kept for the ledger
    #: generation and demand shape in the key (`fit.kept_bound`): prioritize follows filter
    bound: tuple[tuple[object, ...], SharedFit | None, np.ndarray] | None = None
    #: the device plugin's view of the ledger (`fit.plugin_view`), brought up to date from the
    #: ledger's log of touched nodes on each use
    plugin: BoundView | None = None
    #: prioritize's scores per demand shape, from the per-node summaries and device by device,
    #: patched on the nodes touched since (`score._kept_scores`)
    scores: ShapeCache[tuple[object, ...], KeptScores] = field(
        default_factory=lambda: ShapeCache(SCORE_SHAPES_KEPT)
    )
    device_scores: ShapeCache[tuple[object, ...], KeptScores] = field(
        default_factory=lambda: ShapeCache(SCORE_SHAPES_KEPT)
    )


def cache_of(a: DeviceArrays) -> ArraysCache:
    """The cache of `a`, made on first use."""
    c = a.cache
    if type(c) is not ArraysCache:
        c = a.cache = ArraysCache()
    return c
