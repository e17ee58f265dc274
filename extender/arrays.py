"""The ledger's column store of devices, and the per-node summaries filter reads instead.

One row per device, the rows of a node contiguous, so that filter and prioritize over thousands
of nodes are numpy operations; a `NodeSummary` has one row per node for one resource. Both are
derived state: `extender.ledger.Ledger` builds and updates them from its reservations, and
`check_invariant` verifies them against a recomputation (`summary_of`). Also the small helpers
over runs of rows grouped by node that the ledger, placement and the planner share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from extender.inventory import Device

__all__ = [
    "DeviceArrays",
    "NodeSummary",
    "summary_of",
    "slot_free_of",
    "slot_free_bytes",
    "sole_share",
    "run_starts",
    "run_ranks",
    "first_k_per_node",
    "offsets",
]


@dataclass(slots=True)
class DeviceArrays:
    """Column store of all devices; index `i` is one device. Rebuilt when inventory changes."""

    devices: Sequence[Device] = field(default_factory=list)
    node_names: Sequence[str] = field(default_factory=list)
    node_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    node_start: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    capacity: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    per_pod_cap: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    replicas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    used: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    used_replicas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    resource_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    product_id: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    gpu_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    resources: dict[str, int] = field(default_factory=dict)
    products: dict[str, int] = field(default_factory=dict)
    #: replicas in use per node (sum over its devices): "is anything running here" in O(1)
    node_used_replicas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: `rows_of` and `per_node_sum` remember what they read from the labels here (read-only)
    resource_rows: dict[int, np.ndarray] = field(default_factory=dict)
    nonempty_nodes: np.ndarray | bool | None = None
    #: what placement derives from these rows and keeps with them (node kinds, per-resource views,
    #: per-demand-shape masks and kept scores: `extender.placement.cache.ArraysCache`), made there
    #: on first use and typed there (the ledger does not import placement). It lives and dies
    #: with the arrays: a change of inventory rebuilds them, so nothing derived from labels is
    #: ever stale; what also reads the used columns says in the cache how it follows them. A view
    #: that only swaps the used columns (`dataclasses.replace`) shares it.
    cache: object = None

    @property
    def free(self) -> np.ndarray:
        free: np.ndarray = self.capacity - self.used
        return free

    def rows_of(self, resource_id: int) -> np.ndarray:
        """The rows of the devices of one resource, ascending: labels only, so kept with the arrays
        (read-only), where filter's view of the resource and the device plugin's bound both find it."""
        by_id = self.resource_rows
        rows = by_id.get(resource_id)
        if rows is None:
            rows = by_id[resource_id] = np.flatnonzero(self.resource_id == resource_id)
            rows.flags.writeable = False
        return rows

    def per_node_sum(self, values: np.ndarray, dtype: type = np.int64) -> np.ndarray:
        """Sum of `values` (one row per device, any trailing shape) over each node's devices.

        A node's rows are contiguous, so this is one `add.reduceat` pass: `bincount` on
        `node_of` copies and is ~8x slower at 80,000 devices, `add.at` slower still."""
        starts = self.node_start[:-1]
        out_shape = (len(starts),) + values.shape[1:]
        if len(values) == 0:
            return np.zeros(out_shape, dtype)
        nonempty = self.nonempty_nodes
        if nonempty is None:
            ne = starts < self.node_start[1:]
            nonempty = self.nonempty_nodes = True if ne.all() else ne
        if nonempty is True:
            every: np.ndarray = np.add.reduceat(values, starts, axis=0, dtype=dtype)
            return every
        out: np.ndarray = np.zeros(out_shape, dtype)
        out[nonempty] = np.add.reduceat(values, starts[nonempty], axis=0, dtype=dtype)
        return out


_PAD = np.int64(-(1 << 62))  # "no such device" in NodeSummary.top: below any real free VRAM


def slot_free_bytes(capacity: np.ndarray, used: np.ndarray, has_slot: np.ndarray) -> np.ndarray:
    """Per device, its free VRAM where a replica is free and -1 where none is, so one max over
    a node's devices says both. An overcommitted device (records over its memory) counts 0 free,
    not below: a negative value would read as no free replica, and filter would word a node
    whose replicas are free but whose memory is gone as "all GPU replicas in use"."""
    free: np.ndarray = (np.maximum(capacity - used, 0) + 1) * has_slot - 1
    return free


def sole_share(
    capacity: np.ndarray,
    used: np.ndarray,
    per_pod_cap: np.ndarray,
    replicas: np.ndarray,
    used_replicas: np.ndarray,
) -> np.ndarray:
    """Per device with a free replica: the part of its free VRAM that only the next pod placed
    there can use, `min(free - (replicas left - 1) * per-pod cap, per-pod cap)`: the other free
    replicas cannot reach it (each takes at most the per-pod cap). A pod of `need` bytes placed
    there makes `max(0, sole - need)` bytes unusable (`stranded`): the rest of an exclusive GPU
    or a MIG slice, a time-sliced GPU's memory behind its last replica (on a time-sliced GPU with
    replicas to spare it is 0 or below), and on an MPS GPU the rest of the pod's own share of
    `memory / replicas`, which no other client may use."""
    left = (replicas - used_replicas).astype(np.int64)
    cap = per_pod_cap.astype(np.int64)
    sole: np.ndarray = np.minimum(capacity - used - (left - 1) * cap, cap)
    return sole


@dataclass(slots=True)
class NodeSummary:
    """One resource's devices per node row, as filter and prioritize need them.

    `top[r]`: `slot_free_bytes` of node r's devices of the resource (free VRAM where a replica is
    free, -1 where not), largest first, padded with `_PAD`; so a node has k devices with `need`
    bytes and a free replica iff `top[r, k - 1] >= need`. `slots[r]`: how many of them have a
    free replica. `largest`: `top[:, 0]`, -1 for a node without any.
    `busy[r]` / `idle[r]`: free VRAM of those with a free replica and some / no pod, largest
    first (ties: larger `sole` first), padded with `_PAD` (best fit: the smallest one that covers
    the pod). `busy_sole[r]` / `idle_sole[r]`: the `sole_share` of the same devices, entry for
    entry (`_PAD` beside padding): what a pod placed there would strand (prioritize's charge).
    `sole_high[r]`: the most `sole_share` of all of them (`_PAD` without any); `sole_mixed[r]`
    the same where their sole shares differ, else `_PAD`: prioritize works the choice out
    device by device only on the nodes where one device would strand more than another.
    """

    top: np.ndarray
    slots: np.ndarray
    largest: np.ndarray
    busy: np.ndarray
    idle: np.ndarray
    busy_sole: np.ndarray
    idle_sole: np.ndarray
    sole_high: np.ndarray
    sole_mixed: np.ndarray

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self.top,
            self.slots,
            self.largest,
            self.busy,
            self.idle,
            self.busy_sole,
            self.idle_sole,
            self.sole_high,
            self.sole_mixed,
        )

    def set_row(
        self,
        r: int,
        values: np.ndarray,
        slots: int,
        busy: np.ndarray,
        idle: np.ndarray,
        busy_sole: np.ndarray,
        idle_sole: np.ndarray,
    ) -> None:
        for arr in self._arrays():
            arr.flags.writeable = True
        self.top[r] = _PAD
        self.top[r, : len(values)] = np.sort(values)[::-1]
        for dst, dst_sole, v, sole in (
            (self.busy, self.busy_sole, busy, busy_sole),
            (self.idle, self.idle_sole, idle, idle_sole),
        ):
            order = np.lexsort((-sole, -v))  # largest free first, then largest sole
            dst[r] = dst_sole[r] = _PAD
            dst[r, : len(v)] = v[order]
            dst_sole[r, : len(v)] = sole[order]
        self.slots[r] = slots
        self.largest[r] = values.max() if len(values) else -1
        sole = np.concatenate((busy_sole, idle_sole))
        high = sole.max() if len(sole) else _PAD
        self.sole_high[r] = high
        self.sole_mixed[r] = high if len(sole) and sole.min() != high else _PAD
        for arr in self._arrays():
            arr.flags.writeable = False

    def same_as(self, other: NodeSummary) -> np.ndarray:
        """Node rows where the two differ."""
        return np.flatnonzero(
            (self.top != other.top).any(axis=1)
            | (self.busy != other.busy).any(axis=1)
            | (self.idle != other.idle).any(axis=1)
            | (self.busy_sole != other.busy_sole).any(axis=1)
            | (self.idle_sole != other.idle_sole).any(axis=1)
            | (self.slots != other.slots)
            | (self.largest != other.largest)
            | (self.sole_high != other.sole_high)
            | (self.sole_mixed != other.sole_mixed)
        )


def summary_of(a: DeviceArrays, resource_id: int) -> NodeSummary:
    """`Ledger.summary` computed from scratch over every device (the reference it must equal)."""
    n = len(a.node_names)
    rows = np.flatnonzero(a.resource_id == resource_id)
    nodes = a.node_of[rows].astype(np.int64)
    width = int(np.bincount(nodes).max()) if len(rows) else 0
    slots = np.zeros(n, np.int64)
    has_slot = a.used_replicas[rows] < a.replicas[rows]
    idle = a.used_replicas[rows] == 0
    free = slot_free_bytes(a.capacity[rows], a.used[rows], has_slot)
    sole = sole_share(
        a.capacity[rows],
        a.used[rows],
        a.per_pod_cap[rows],
        a.replicas[rows],
        a.used_replicas[rows],
    )
    np.add.at(slots, nodes, has_slot)
    top = _sorted_per_node(n, width, nodes, free)[0]
    busy, busy_sole = _sorted_per_node(
        n, width, nodes[has_slot & ~idle], free[has_slot & ~idle], sole[has_slot & ~idle]
    )
    idle_, idle_sole = _sorted_per_node(
        n, width, nodes[has_slot & idle], free[has_slot & idle], sole[has_slot & idle]
    )
    largest = top[:, 0].copy() if width else np.full(n, -1, np.int64)
    largest[largest == _PAD] = -1
    low, high = np.full(n, -_PAD, np.int64), np.full(n, _PAD, np.int64)
    np.minimum.at(low, nodes[has_slot], sole[has_slot])
    np.maximum.at(high, nodes[has_slot], sole[has_slot])
    mixed = np.where(low < high, high, _PAD)
    out = NodeSummary(top, slots, largest, busy, idle_, busy_sole, idle_sole, high, mixed)
    for arr in out._arrays():
        arr.flags.writeable = False
    return out


def run_starts(values: np.ndarray) -> np.ndarray:
    """Mask of the entries of `values` that start a run of equal ones (the first always does).
    `np.r_[True, ...]` costs ~18 us a call in Python-level index parsing; this, ~2 us."""
    return np.concatenate((_TRUE, values[1:] != values[:-1]))


def run_ranks(values: np.ndarray) -> np.ndarray:
    """Each entry's position in its run of equal `values` (0 where a run starts)."""
    pos = np.arange(len(values))
    return pos - np.maximum.accumulate(np.where(run_starts(values)[: len(values)], pos, 0))


def first_k_per_node(node: np.ndarray, k: int, n_nodes: int) -> np.ndarray:
    """Mask of the first `k` entries of each node's run (`node` grouped), on nodes with at least `k`."""
    first: np.ndarray = (run_ranks(node) < k) & (np.bincount(node, minlength=n_nodes)[node] >= k)
    return first


def offsets(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive blocks of `lengths` starts, and the end: `[0, cumsum...]`."""
    return np.concatenate((_ZERO, np.cumsum(lengths))).astype(np.int64)


_TRUE = np.ones(1, bool)
_ZERO = np.zeros(1, np.int64)


def _sorted_per_node(
    n: int, width: int, nodes: np.ndarray, values: np.ndarray, beside: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(n, width) arrays: row r holds the `values` of node r, largest first (ties: largest
    `beside` first), padded with `_PAD`; and `beside` in the same places (`_PAD` too)."""
    out = np.full((n, width), _PAD, np.int64)
    out_beside = np.full((n, width), _PAD, np.int64)
    if len(nodes):
        tie = np.zeros(len(nodes), np.int64) if beside is None else -beside
        order = np.lexsort((tie, -values, nodes))  # by node, largest first
        nodes, values = nodes[order], values[order]
        ranks = run_ranks(nodes)
        out[nodes, ranks] = values
        if beside is not None:
            out_beside[nodes, ranks] = beside[order]
    return out, out_beside


def slot_free_of(a: DeviceArrays, resource_id: int) -> np.ndarray:
    """`Ledger.slot_free` computed from scratch over every device."""
    return summary_of(a, resource_id).largest
