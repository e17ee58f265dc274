"""Views of the ledger's device arrays that filter and prioritize read instead of every device:
the rows of a candidate list, node kinds, one resource's devices, one or several nodes' rows,
and per-node facts that depend on labels only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar, overload

import numpy as np

from extender.arrays import DeviceArrays, offsets
from extender.demand import Demand, PodRef
from extender.inventory import Device
from extender.ledger import Ledger
from extender.placement.cache import CANDIDATE_LISTS_KEPT, NodeKinds, ResourceView, cache_of

T = TypeVar("T")


def candidate_rows(ledger: Ledger, names: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """Rows of the known `names` (in order) and the unknown names.

    kube-scheduler sends the same candidate list to filter pod after pod, and to prioritize the
    very list filter answered: comparing a list with a recent one is several times cheaper than
    looking 5,000 names up, so the last few lists are remembered (with the arrays they index).
    """
    recent = cache_of(ledger.arrays).candidates
    n = len(names)
    for i, (known, rows, unknown) in enumerate(recent):
        if known is names or (
            len(known) == n and (n == 0 or known[0] == names[0]) and known == names
        ):
            if i:
                recent.insert(0, recent.pop(i))  # least recently used goes first
            return rows, unknown
    idx = ledger.node_rows(names)
    if -1 not in idx:
        rows, unknown = np.fromiter(idx, np.int64, len(idx)), []
    else:
        unknown = [name for name, r in zip(names, idx) if r < 0]
        rows = np.fromiter((r for r in idx if r >= 0), np.int64)
    remember_candidates(ledger, list(names), rows, unknown)
    return rows, unknown


def remember_candidates(
    ledger: Ledger, names: list[str], rows: np.ndarray, unknown: list[str]
) -> None:
    """Remember `names` as a candidate list with its `rows` (shared by later calls: read-only)."""
    rows.flags.writeable = False
    recent = cache_of(ledger.arrays).candidates
    recent.insert(0, (names, rows, unknown))
    del recent[CANDIDATE_LISTS_KEPT:]


def node_kinds(ledger: Ledger, a: DeviceArrays) -> NodeKinds:
    """Per node of `a`: name (object array, for fast fancy indexing), kind, has a problem.

    Nodes of one *kind* have the same devices, product and problem, so every reason that does
    not depend on what is in use (no such resource, too few or too small devices) is the same
    for all of them: it is worded once per kind instead of once per node. Cached with `a`.
    """
    cache = cache_of(a)
    info = cache.kinds
    if info is None:
        kinds: dict[tuple[object, ...], int] = {}
        kind = np.zeros(len(a.node_names), np.int32)
        problem = np.zeros(len(a.node_names), bool)
        for r, name in enumerate(a.node_names):
            inv = ledger.node(name)
            if inv is None:
                sig: tuple[object, ...] = (name,)
            else:
                problem[r] = bool(inv.problem)
                sig = (
                    inv.problem,
                    inv.product,
                    tuple(
                        (
                            type(d).__name__,
                            d.resource,
                            d.product,
                            d.memory_bytes,
                            d.per_pod_cap_bytes,
                            d.replicas,
                            d.sharing,
                            d.profile,
                        )
                        for d in inv.devices
                    ),
                )
            kind[r] = kinds.setdefault(sig, len(kinds))
        info = cache.kinds = NodeKinds(name_array(a), kind, problem)
    return info


def name_array(a: DeviceArrays) -> np.ndarray:
    """The node names of `a` as an object array (fast fancy indexing), one per arrays: encoders
    cache per-node fragments by this array's identity. Cheaper than `node_kinds` (no kinds)."""
    cache = cache_of(a)
    names = cache.names
    if names is None:
        info = cache.kinds
        names = cache.names = (
            info.names if info is not None else np.array(a.node_names, dtype=object)
        )
    return names


def per_node(a: DeviceArrays, mask: np.ndarray) -> np.ndarray:
    """How many devices of each node have `mask` set."""
    return a.per_node_sum(mask, np.int64)


def _take_rows(
    a: DeviceArrays,
    ix: slice | np.ndarray,
    *,
    devices: Sequence[Device],
    node_names: Sequence[str],
    node_of: np.ndarray,
    node_start: np.ndarray,
) -> DeviceArrays:
    """The device rows `ix` of `a` as arrays of their own (numpy views for a slice, copies for
    an index array), over the nodes the caller describes."""
    return DeviceArrays(
        devices=devices,
        node_names=node_names,
        node_of=node_of,
        node_start=node_start,
        capacity=a.capacity[ix],
        per_pod_cap=a.per_pod_cap[ix],
        replicas=a.replicas[ix],
        used=a.used[ix],
        used_replicas=a.used_replicas[ix],
        resource_id=a.resource_id[ix],
        product_id=a.product_id[ix],
        gpu_index=a.gpu_index[ix],
        resources=a.resources,
        products=a.products,
    )


def node_arrays(a: DeviceArrays, r: int) -> DeviceArrays:
    """The rows of node `r` as arrays of their own (views), so one node costs the same in any cluster."""
    lo, hi = int(a.node_start[r]), int(a.node_start[r + 1])
    return _take_rows(
        a,
        slice(lo, hi),
        devices=a.devices[lo:hi],
        node_names=[a.node_names[r]],
        node_of=np.zeros(hi - lo, np.int32),
        node_start=np.asarray([0, hi - lo], np.int64),
    )


class _Picked(Sequence[T]):
    """`items` at `rows`, looked up when read: the kept scores' patches (`nodes_arrays`) build
    arrays over thousands of device rows and read none of their `Device` objects."""

    __slots__ = ("items", "rows")

    def __init__(self, items: Sequence[T], rows: np.ndarray) -> None:
        self.items, self.rows = items, rows

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self.items[r] for r in self.rows[i].tolist()]
        return self.items[int(self.rows[i])]


def nodes_arrays(a: DeviceArrays, nodes: np.ndarray) -> tuple[DeviceArrays, np.ndarray]:
    """The rows of the nodes `nodes` (sorted node rows) as arrays of their own (copies; the
    devices looked up when read), and those rows' positions in `a`: `node_arrays` for several
    nodes at once."""
    starts = a.node_start[nodes]
    lengths = a.node_start[nodes + 1] - starts
    bounds = offsets(lengths)
    ix = np.repeat(starts - bounds[:-1], lengths) + np.arange(int(bounds[-1]))
    sub = _take_rows(
        a,
        ix,
        devices=_Picked[Device](a.devices, ix),
        node_names=_Picked[str](a.node_names, nodes),
        node_of=np.repeat(np.arange(len(nodes), dtype=np.int32), lengths),
        node_start=bounds,
    )
    return sub, ix


def resource_arrays(
    ledger: Ledger, demand: Demand, used: bool = True, under_policy: bool = False
) -> DeviceArrays | None:
    """Only the devices of the demand's resource (all nodes kept, in order), or None for all.

    A pod asking for `nvidia.com/gpu` never looks at MIG slices: on a mixed fleet this makes
    every vector op of filter/prioritize several times shorter. The static columns are cut once
    per inventory; the two that change (used bytes and replicas) are gathered per call.
    `used=False` skips that gather: the view's used columns are then stale and must not be read.
    Not used when the device plugin's node-level bound applies, unless the caller applies that
    bound at the view's rows itself (`under_policy`: `_filter_plugin`, and prioritize through
    `bound_at_resource`).
    """
    a = ledger.arrays
    rid = a.resources.get(demand.resource)
    if rid is None or (ledger.replica_policy is not None and not under_policy):
        return None
    views = cache_of(a).by_resource
    view = views.get(rid)
    if view is None:
        view = views[rid] = _cut_resource(ledger, a, rid)
    idx, static = view
    if idx is None or static is None:
        return None
    if not used:
        return static
    cache = cache_of(static)  # shared by the view below (`replace` keeps it)
    current = cache.current  # unchanged ledger since the last call: same view
    if current is None or current[0] != ledger.generation:
        current = cache.current = (
            ledger.generation,
            replace(static, used=a.used[idx], used_replicas=a.used_replicas[idx]),
        )
    return current[1]


def _cut_resource(ledger: Ledger, a: DeviceArrays, rid: int) -> ResourceView:
    """The static columns of resource `rid`'s devices, and their rows in `a`; (None, None) when
    every device is of that resource (the arrays themselves will do)."""
    idx = a.rows_of(rid)
    if len(idx) == len(a.devices):
        return None, None
    counts = np.bincount(a.node_of[idx], minlength=len(a.node_names))
    static = _take_rows(
        a,
        idx,
        devices=[a.devices[i] for i in idx.tolist()],
        node_names=a.node_names,
        node_of=a.node_of[idx],
        node_start=offsets(counts),
    )
    cache_of(static).kinds = node_kinds(ledger, a)  # the same nodes
    return idx, static


def uniform_labels(a: DeviceArrays) -> tuple[np.ndarray, np.ndarray] | None:
    """Per node of the resource view `a`: the per-pod cap and product id its devices all share
    (-1 for a node without any), or None when some node mixes caps or products (then the
    per-node summaries cannot stand for its devices). Labels only: cached with `a`."""
    cache = cache_of(a)
    uniform = cache.uniform
    if uniform is None:
        n = len(a.node_names)
        cap, prod = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        s = a.node_start[:-1]
        ne = a.node_start[1:] > s
        same = True
        if ne.any():
            for col, dst in ((a.per_pod_cap, cap), (a.product_id.astype(np.int64), prod)):
                hi, lo = np.maximum.reduceat(col, s[ne]), np.minimum.reduceat(col, s[ne])
                same = same and bool((hi == lo).all())
                dst[ne] = hi
        uniform = cache.uniform = (cap, prod) if same and len(a.resource_id) else False
    return uniform or None


def node_capacity(a: DeviceArrays) -> np.ndarray | None:
    """Per node of `a`: the memory its devices all have, or None when a node mixes sizes."""
    cache = cache_of(a)
    cap = cache.capacity
    if cap is None:
        n = len(a.node_names)
        cap = np.full(n, -1, np.int64)
        s = a.node_start[:-1]
        ne = a.node_start[1:] > s
        if ne.any():
            hi, lo = np.maximum.reduceat(a.capacity, s[ne]), np.minimum.reduceat(a.capacity, s[ne])
            cap[ne] = hi
            if (hi != lo).any():
                cap = False
        cache.capacity = cap
    return None if cap is False else cap


_BYTE_SUM = np.uint64(0x0101010101010101)


def row_counts(mask: np.ndarray) -> np.ndarray:
    """True values per row of a 2-D bool array, as int64.

    `mask.sum(axis=1)` over 8 columns costs about 25 times the comparison that made the mask;
    read as one uint64 word per 8 columns, a multiplication by 0x0101... sums a word's bytes
    (each 0 or 1, so no carry) into its top byte, in about the time of the comparison.
    """
    n, w = mask.shape
    if w and w % 8 == 0 and mask.flags.c_contiguous:
        per_word = (mask.view(np.uint64) * _BYTE_SUM) >> np.uint64(56)
        counts: np.ndarray = (per_word[:, 0] if w == 8 else per_word.sum(axis=1)).astype(np.int64)
        return counts
    summed: np.ndarray = mask.sum(axis=1, dtype=np.int64)
    return summed


def segment_max(values: np.ndarray, starts: np.ndarray, n_nodes: int) -> np.ndarray:
    """Max of `values` per node (rows of a node are contiguous); -1 for nodes without devices."""
    out = np.full(n_nodes, -1, np.int64)
    if len(values) == 0:
        return out
    s = starts[:-1]
    nonempty = starts[1:] > s
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(values, s[nonempty])
    return out


def warm(ledger: Ledger) -> None:
    """Build the per-inventory caches (node kinds, per-resource views) now, at start-up,
    rather than in the first filter calls kube-scheduler makes."""
    a = ledger.arrays
    node_kinds(ledger, a)
    for resource, rid in list(a.resources.items()):
        shape = Demand(pod=PodRef("", ""), gpu_count=1, bytes_per_gpu=None, resource=resource)
        view = resource_arrays(ledger, shape)
        if view is not None:
            uniform_labels(view), node_capacity(view), ledger.summary(rid)
