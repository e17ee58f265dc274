"""Fit, explain, score and choose: the greedy placement core shared by every adapter.

All per-node work is done on the ledger's device arrays with numpy, so one filter or
prioritize call over thousands of candidate nodes is a handful of vector operations;
Python only loops over the nodes it must explain.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations
from math import ceil, log2
from typing import Any, NoReturn

import numpy as np

from extender.demand import Demand
from extender.deviceplugin import (
    PIN_MISSING,
    SharedFit,
    allowed_without,
    bounds_resource,
    refused_per_node,
    shared_fit,
)
from extender.inventory import MigSlice
from extender.ledger import (
    DeviceArrays,
    Ledger,
    NodeSummary,
    Reservation,
    first_k_per_node,
    offsets,
    run_starts,
)
from extender.quantity import format_bytes

__all__ = [
    "FilterOutcome",
    "filter_nodes",
    "score_nodes",
    "choose_devices",
    "plugin_allows",
    "preempt_victims",
    "MAX_SCORE",
    "device_need",
    "score_rows",
    "warm",
]

MAX_SCORE = 10
_BIG = np.int64(1) << np.int64(60)


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

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _read_only  # type: ignore[assignment]


@dataclass(slots=True)
class _Fit:
    """Per-device view of one demand against the ledger (vectors over all devices)."""

    a: DeviceArrays
    matches: np.ndarray  # device has the requested resource (and allowed product)
    need: np.ndarray  # bytes the pod needs on each device
    ok: np.ndarray  # device can take the pod now
    #: node-level bound for time-sliced GPUs whose physical GPU the device plugin picks
    shared: SharedFit | None = None

    @property
    def leftover(self) -> np.ndarray:
        return self.a.capacity - self.a.used - self.need


def device_need(a: DeviceArrays, demand: Demand) -> np.ndarray:
    """Bytes the pod takes on each device: what it declared, or the whole device when undeclared.

    A whole device is its per-pod cap: the full memory of an exclusive or time-sliced GPU
    (so it only fits an empty one), a 1/replicas share of an MPS GPU, a whole MIG slice.
    """
    if demand.bytes_per_gpu is None:
        return a.per_pod_cap
    # one value for every device, read-only: kept per demand shape (`_static_fit`), a full
    # column per shape was 640 KB at 80,000 devices, 160 MB of RSS for the 256 shapes kept
    return np.broadcast_to(np.int64(demand.bytes_per_gpu), (len(a.capacity),))


def _fit(
    ledger: Ledger,
    demand: Demand,
    local: DeviceArrays | None = None,
    with_ok: bool = True,
    node_rows: slice | np.ndarray | None = None,
    bounded: bool = False,
) -> _Fit:
    """The demand against every device, or against `local` (one node's rows, see `_node_arrays`,
    or one resource's, see `_resource_arrays`). `with_ok=False` leaves `ok` empty for callers
    that do not read it (`_filter_one`). `node_rows`: `local` is these device rows (one node's
    slice, or several nodes' rows, see `_nodes_arrays`), and the device plugin's bound applies
    to them (bind, kept scores, under a replica policy). `bounded`: `local` is the resource's
    view and the bound applies to it."""
    a = ledger.arrays if local is None else local
    matches, need, big_enough = _static_fit(a, demand)
    if not with_ok:
        return _Fit(a, matches, need, np.zeros(0, bool), None)
    ok = big_enough & (a.used_replicas < a.replicas) & (a.capacity - a.used >= need)
    shared = None
    if demand.wants_gpu and node_rows is not None:
        shared = shared_fit(ledger, need, demand.gpu_count, demand.pin_configmap, node_rows)
    elif demand.wants_gpu and bounded:
        shared = _shared_at_resource(ledger, demand)
    elif demand.wants_gpu and local is None:
        shared = _shared(ledger, demand, a, need)
    if shared is not None:
        ok &= shared.allowed
    return _Fit(a, matches, need, ok, shared)


def _shared(
    ledger: Ledger, demand: Demand, a: DeviceArrays, need: np.ndarray, resource: int | None = None
) -> SharedFit | None:
    """`shared_fit` over every device of `a` (every device of the ledger), or at the rows of
    `resource` only, kept for the ledger state and demand shape: the same pod's prioritize
    follows its filter, usually with nothing changed in between."""
    key = (
        ledger.generation,
        ledger.replica_policy,
        demand.bytes_per_gpu,
        demand.gpu_count,
        demand.pin_configmap,
        resource,
    )
    hit = a.derived.get("shared")
    if hit is None or hit[0] != key or hit[2] is not need:
        fit = shared_fit(ledger, need, demand.gpu_count, demand.pin_configmap, resource=resource)
        hit = a.derived["shared"] = (key, fit, need)
    return hit[1]


def _shared_at_resource(ledger: Ledger, demand: Demand) -> SharedFit | None:
    """The bound at the rows of the demand's resource, as `_resource_arrays` has them (None when it
    applies to none of them)."""
    full = ledger.arrays
    rid = full.resources.get(demand.resource)
    if rid is None or not bounds_resource(ledger, rid):
        return None
    return _shared(ledger, demand, full, _need(full, demand), rid)


def _need(a: DeviceArrays, demand: Demand) -> np.ndarray:
    """`device_need` kept per demand shape (the same object for the same shape, as `_shared`'s
    cache compares it by identity): `_static_fit` takes it from here, and the bound reads it
    without `_static_fit`'s two other columns, which over every device of the cluster, on a shape
    asked for the first time, cost more than the bound itself."""
    cache = _bounded_cache(a, "need")
    hit = cache.get(demand.bytes_per_gpu)
    if hit is None:
        hit = cache[demand.bytes_per_gpu] = device_need(a, demand)
    return hit


def _bounded_cache(a: DeviceArrays, name: str, limit: int | None = None) -> dict:
    """A per-demand-shape cache kept with the arrays (dropped with them on a rebuild), emptied on
    the access after it reaches `limit` (_STATIC_COUNTS_CACHED) entries, so odd demands cannot
    grow it."""
    cache = a.derived.setdefault(name, {})
    if len(cache) >= (limit or _STATIC_COUNTS_CACHED):
        cache.clear()
    return cache


def _static_fit(a: DeviceArrays, demand: Demand) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(devices of the resource and products, bytes needed on each, those big enough for it):
    labels and demand only, so kept with `a` per demand shape. Callers never write them."""
    cache = _bounded_cache(a, "static_fit")
    key = (demand.resource, demand.bytes_per_gpu, demand.allowed_products)
    hit = cache.get(key)
    if hit is None:
        matches = a.resource_id == a.resources.get(demand.resource, -1)
        if demand.allowed_products is not None:
            allowed = [
                pid
                for name, pid in a.products.items()
                if _product_allowed(name, demand.allowed_products)
            ]
            matches &= np.isin(a.product_id, np.asarray(allowed, np.int32))
        need = _need(a, demand)
        hit = cache[key] = (matches, need, matches & (a.per_pod_cap >= need))
    return hit


def _product_allowed(product: str, allowed: frozenset[str]) -> bool:
    """`NVIDIA-H100-80GB-HBM3-SHARED` is still an `NVIDIA-H100-80GB-HBM3`."""
    base = product[: -len("-SHARED")] if product.endswith("-SHARED") else product
    return base in allowed or product in allowed


_ROWS_CACHED = 8


def _node_rows(ledger: Ledger, names: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """Rows of the known `names` (in order) and the unknown names.

    kube-scheduler sends the same candidate list to filter pod after pod, and to prioritize the
    very list filter answered: comparing a list with a recent one is several times cheaper than
    looking 5,000 names up, so the last few lists are remembered (with the arrays they index).
    """
    recent = ledger.arrays.derived.setdefault("rows", [])
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
    _remember_rows(ledger, list(names), rows, unknown)
    return rows, unknown


def _remember_rows(ledger: Ledger, names: list[str], rows: np.ndarray, unknown: list[str]) -> None:
    rows.flags.writeable = False  # shared by later calls
    recent = ledger.arrays.derived.setdefault("rows", [])
    recent.insert(0, (names, rows, unknown))
    del recent[_ROWS_CACHED:]


def _node_info(ledger: Ledger, a: DeviceArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node of `a`: name (object array, for fast fancy indexing), kind, has a problem.

    Nodes of one *kind* have the same devices, product and problem, so every reason that does
    not depend on what is in use (no such resource, too few or too small devices) is the same
    for all of them: it is worded once per kind instead of once per node. Cached with `a`.
    """
    info = a.derived.get("nodes")
    if info is None:
        kinds: dict[tuple, int] = {}
        kind = np.zeros(len(a.node_names), np.int32)
        problem = np.zeros(len(a.node_names), bool)
        for r, name in enumerate(a.node_names):
            inv = ledger.node(name)
            if inv is None:
                sig: tuple = (name,)
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
        info = a.derived["nodes"] = (_node_names(a), kind, problem)
    return info


def _per_node(a: DeviceArrays, mask: np.ndarray) -> np.ndarray:
    """How many devices of each node have `mask` set."""
    return a.per_node_sum(mask, np.int64)


def warm(ledger: Ledger) -> None:
    """Build the per-inventory caches (node kinds, per-resource views) now, at start-up,
    rather than in the first filter calls kube-scheduler makes."""
    a = ledger.arrays
    _node_info(ledger, a)
    for resource, rid in list(a.resources.items()):
        view = _resource_arrays(
            ledger, Demand(pod=None, gpu_count=1, bytes_per_gpu=None, resource=resource)
        )  # type: ignore[arg-type]
        if view is not None:
            _uniform(view), _node_capacity(view), ledger.summary(rid)


def _node_names(a: DeviceArrays) -> np.ndarray:
    """The node names of `a` as an object array (fast fancy indexing), one per arrays: encoders
    cache per-node fragments by this array's identity. Cheaper than `_node_info` (no kinds)."""
    names = a.derived.get("names")
    if names is None:
        info = a.derived.get("nodes")
        names = a.derived["names"] = (
            info[0] if info is not None else np.array(a.node_names, dtype=object)
        )
    return names


def _node_arrays(a: DeviceArrays, r: int) -> DeviceArrays:
    """The rows of node `r` as arrays of their own (views), so one node costs the same in any cluster."""
    lo, hi = int(a.node_start[r]), int(a.node_start[r + 1])
    return DeviceArrays(
        devices=a.devices[lo:hi],
        node_names=[a.node_names[r]],
        node_of=np.zeros(hi - lo, np.int32),
        node_start=np.asarray([0, hi - lo], np.int64),
        capacity=a.capacity[lo:hi],
        per_pod_cap=a.per_pod_cap[lo:hi],
        replicas=a.replicas[lo:hi],
        used=a.used[lo:hi],
        used_replicas=a.used_replicas[lo:hi],
        resource_id=a.resource_id[lo:hi],
        product_id=a.product_id[lo:hi],
        gpu_index=a.gpu_index[lo:hi],
        resources=a.resources,
        products=a.products,
    )


class _Picked(Sequence):
    """`items` at `rows`, looked up when read: the kept scores' patches (`_nodes_arrays`) build
    arrays over thousands of device rows and read none of their `Device` objects."""

    __slots__ = ("items", "rows")

    def __init__(self, items: Sequence, rows: np.ndarray) -> None:
        self.items, self.rows = items, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self.items[r] for r in self.rows[i].tolist()]
        return self.items[int(self.rows[i])]


def _nodes_arrays(a: DeviceArrays, nodes: np.ndarray) -> tuple[DeviceArrays, np.ndarray]:
    """The rows of the nodes `nodes` (sorted node rows) as arrays of their own (copies; the
    devices looked up when read), and those rows' positions in `a`: `_node_arrays` for several
    nodes at once."""
    starts = a.node_start[nodes]
    lengths = a.node_start[nodes + 1] - starts
    bounds = offsets(lengths)
    ix = np.repeat(starts - bounds[:-1], lengths) + np.arange(int(bounds[-1]))
    sub = DeviceArrays(
        devices=_Picked(a.devices, ix),
        node_names=_Picked(a.node_names, nodes),  # type: ignore[arg-type]
        node_of=np.repeat(np.arange(len(nodes), dtype=np.int32), lengths),
        node_start=bounds,
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
    return sub, ix


def filter_nodes(
    ledger: Ledger, demand: Demand, names: Sequence[str], explain_all: bool = True
) -> FilterOutcome:
    """Which of `names` can take the pod now, and a short reason for every one that cannot.

    `explain_all=False`: reasons only when no node passes. kube-scheduler reads an extender's
    reasons only then (for the pod's FitError event and for preemption); when some node passes
    it drops them unread, so working them out, sending and decoding them is wasted on the
    scheduling path. The answer is then all-or-nothing: every refused node explained, or none."""
    out = FilterOutcome(explain_all=explain_all)
    if not demand.wants_gpu:
        out.feasible = list(names)
        return out
    _filter_into(ledger, demand, names, out)
    if not explain_all and out.feasible and (out.failed or out.unresolvable):
        out.failed, out.unresolvable = {}, {}  # e.g. unknown nodes, named before the split
    return out


def _filter_into(ledger: Ledger, demand: Demand, names: Sequence[str], out: FilterOutcome) -> None:
    if ledger.replica_policy is not None and _filter_plugin(ledger, demand, names, out):
        return
    view = _resource_arrays(ledger, demand, used=False)
    one = view is not None and demand.gpu_count == 1 and demand.bytes_per_gpu is not None
    largest = _one_largest(ledger, view, demand) if one else None
    by_node = _node_fit(ledger, view, demand) if view is not None and not one else None
    if view is not None and largest is None and by_node is None:
        view = _resource_arrays(ledger, demand)  # the per-device path reads the used columns
    fit = _fit(ledger, demand, view, with_ok=not one and by_node is None)
    rows, unknown = _node_rows(ledger, names)
    if unknown:
        _mutable(out).update(dict.fromkeys(unknown, "node unknown to vramsched"))
    if one:
        _filter_one(ledger, fit, demand, rows, out, largest)
    elif by_node is not None:
        _filter_summary(ledger, fit, demand, rows, out, *by_node)
    else:
        _filter_rows(ledger, fit, demand, rows, out)


def _filter_plugin(
    ledger: Ledger, demand: Demand, names: Sequence[str], out: FilterOutcome
) -> bool:
    """`_filter_one` / `_filter_summary` under a replica policy (live mode): the per-node summary,
    and the device plugin's bound per node. The bound is the same for every device of a resource
    on a node (one group: a node's devices of a resource share their sharing mode), so a node
    fits iff it has room for the pod on the books and the bound admits it there. False when that
    does not hold or the summary cannot stand for the devices (then the per-device path answers);
    same answers and reasons as that path."""
    full = ledger.arrays
    rid = full.resources.get(demand.resource)
    static = _resource_arrays(ledger, demand, used=False, under_policy=True)
    if static is None or rid is None:
        return False
    k = demand.gpu_count
    one = k == 1 and demand.bytes_per_gpu is not None
    if one:
        largest = _one_largest(ledger, static, demand)
        if largest is None:
            return False
        room_at = largest >= demand.bytes_per_gpu
    else:
        hit = _node_fit(ledger, static, demand)
        if hit is None:
            return False
        ok, need_at, summary = hit
        top = summary.top
        room_at = ok & (top[:, k - 1] >= need_at) if k <= top.shape[1] else np.zeros(len(ok), bool)
    # Per node, its devices of the resource the bound refuses (none applies: a MIG profile no
    # node time-slices, whose books alone decide), worked out once per group; the rows' values
    # (`_shared_at_resource`) only when there are reasons to give.
    n = len(static.node_names)
    shared = None
    if bounds_resource(ledger, rid):
        refused = refused_per_node(ledger, _need(full, demand), k, demand.pin_configmap, rid)
        if refused is None:  # the bound is not one value per group: from the rows
            shared = _shared_at_resource(ledger, demand)
            refused = np.bincount(static.node_of[np.flatnonzero(~shared.allowed)], minlength=n)
        if ((refused > 0) & (refused < np.diff(static.node_start))).any():
            return False  # a node whose devices of the resource differ under the bound: per device
        every = (refused == 0).astype(np.int64)  # 1 where the bound admits the node
    else:
        every = np.ones(n, np.int64)
    rows, unknown = _node_rows(ledger, names)
    if unknown:
        _mutable(out).update(dict.fromkeys(unknown, "node unknown to vramsched"))
    room = room_at[rows]  # by the per-device books
    good = room & (every[rows] > 0)
    if not len(_split_feasible(ledger, static, rows, good, out)):
        return True  # nothing to explain (or, `explain_all` off, no reason asked for)
    if shared is None:
        shared = _shared_at_resource(ledger, demand)
    # `static`'s used columns are stale: nothing below reads them (`books_short`)
    matches, need, _ = _static_fit(static, demand)
    fit = _Fit(static, matches, need, np.zeros(0, bool), shared)
    blocked = rows[room & ~good]  # room on the books, refused by the bound: worded here, per node
    if len(blocked):
        _explain_blocked(static, fit.shared, blocked, _node_names(static), out)
    short = rows[~room]
    if not len(short):
        return True
    if one:
        _explain(
            ledger,
            fit,
            demand,
            short,
            out,
            np.zeros(n, np.int64),
            rows,
            (None, largest),
            books_short=True,
        )
    else:  # as `_filter_summary` explains
        n_ok = np.zeros(n, np.int64)
        open_ = short[ok[short]]
        n_ok[open_] = (
            row_counts(top[open_] >= need_at[open_, None]) * every[open_]
        )  # devices the bound admits
        _explain(
            ledger,
            fit,
            demand,
            short,
            out,
            n_ok,
            rows,
            None,
            (np.where(ok, summary.slots, 0), np.where(ok, summary.largest, -1)),
            books_short=True,
        )
    return True


def _explain_blocked(
    a: DeviceArrays, s: SharedFit, rows: np.ndarray, names: np.ndarray, out: FilterOutcome
) -> None:
    """What `_explain_shared` says of nodes with room on the books that the bound refuses, when
    the bound is the same for all their devices (`_filter_plugin`): read at each node's first
    device. A pod that cannot take a pin is refused for good; else the worst case is named."""
    first = a.node_start[rows]
    pin = s.needs_pin[first]
    if pin.any():
        _mutable(out).update(dict.fromkeys(names[rows[pin]].tolist(), PIN_MISSING))
    first, rows = first[~pin], rows[~pin]
    if not len(rows):
        return
    out.failed.update(
        zip(names[rows].tolist(), _stack_reasons(s.policy, s.worst[first], a.capacity[first]))
    )


def _stack_reasons(policy: str, worst: np.ndarray, cap: np.ndarray) -> list[str]:
    """The reason for each (worst case, GPU size) pair, the plugin may put that much on one GPU,
    each distinct pair worded once."""
    order = np.lexsort((cap, worst))
    new = run_starts(worst[order]) | run_starts(cap[order])
    which = np.empty(len(worst), np.int64)
    which[order] = np.cumsum(new) - 1
    words = np.array(
        [
            _reason(
                ("stack", policy, w, c),
                lambda w=w, c=c: (
                    f"device plugin ({policy}) may stack {format_bytes(w)} on a {format_bytes(c)} GPU"
                ),
            )
            for w, c in zip(worst[order][new].tolist(), cap[order][new].tolist())
        ],
        dtype=object,
    )
    return words[which].tolist()


def _filter_one(
    ledger: Ledger,
    fit: _Fit,
    demand: Demand,
    rows: np.ndarray,
    out: FilterOutcome,
    largest: np.ndarray | None = None,
) -> None:
    """`_filter_rows` for the commonest pod, one device with declared bytes (no device-plugin
    bound): a node fits iff the most free VRAM on a big-enough device with a free replica covers
    the pod. Same answers as counting fitting devices, in half the passes over the devices.
    `largest` (per node, from `_one_largest`) skips the pass over the devices altogether."""
    a = fit.a
    with_slot = None
    if largest is None:
        with_slot = _static_fit(a, demand)[2] & (a.used_replicas < a.replicas)
        largest = _segment_max(
            (a.capacity - a.used + 1) * with_slot - 1, a.node_start, len(a.node_names)
        )
    good = largest[rows] >= demand.bytes_per_gpu
    bad = _split_feasible(ledger, a, rows, good, out)
    if len(bad):
        # a failing node has no fitting device: n_ok is 0 there; a free replica iff largest >= 0
        _explain(
            ledger,
            fit,
            demand,
            bad,
            out,
            np.zeros(len(a.node_names), np.int64),
            rows,
            (with_slot, largest),
        )


def _resource_arrays(
    ledger: Ledger, demand: Demand, used: bool = True, under_policy: bool = False
) -> DeviceArrays | None:
    """Only the devices of the demand's resource (all nodes kept, in order), or None for all.

    A pod asking for `nvidia.com/gpu` never looks at MIG slices: on a mixed fleet this makes
    every vector op of filter/prioritize several times shorter. The static columns are cut once
    per inventory; the two that change (used bytes and replicas) are gathered per call.
    `used=False` skips that gather: the view's used columns are then stale and must not be read.
    Not used when the device plugin's node-level bound applies, unless the caller applies that
    bound at the view's rows itself (`under_policy`: `_filter_plugin`, and prioritize through
    `_shared_at_resource`).
    """
    a = ledger.arrays
    rid = a.resources.get(demand.resource)
    if rid is None or (ledger.replica_policy is not None and not under_policy):
        return None
    views = a.derived.setdefault("by_resource", {})
    view = views.get(rid)
    if view is None:
        idx = a.rows_of(rid)
        if len(idx) == len(a.devices):
            view = views[rid] = (None, None)
        else:
            counts = np.bincount(a.node_of[idx], minlength=len(a.node_names))
            static = DeviceArrays(
                devices=[a.devices[i] for i in idx.tolist()],
                node_names=a.node_names,
                node_of=a.node_of[idx],
                node_start=offsets(counts),
                capacity=a.capacity[idx],
                per_pod_cap=a.per_pod_cap[idx],
                replicas=a.replicas[idx],
                used=a.used[idx],
                used_replicas=a.used_replicas[idx],
                resource_id=a.resource_id[idx],
                product_id=a.product_id[idx],
                gpu_index=a.gpu_index[idx],
                resources=a.resources,
                products=a.products,
            )
            static.derived["nodes"] = _node_info(ledger, a)
            view = views[rid] = (idx, static)
    idx, static = view
    if idx is None:
        return None
    if not used:
        return static
    current = static.derived.get("current")  # unchanged ledger since the last call: same view
    if current is None or current[0] != ledger.generation:
        current = static.derived["current"] = (
            ledger.generation,
            replace(static, used=a.used[idx], used_replicas=a.used_replicas[idx]),
        )
    return current[1]


def _uniform(a: DeviceArrays) -> tuple[np.ndarray, np.ndarray] | None:
    """Per node of the resource view `a`: the per-pod cap and product id its devices all share
    (-1 for a node without any), or None when some node mixes caps or products (then the
    per-node summaries cannot stand for its devices). Labels only: cached with `a`."""
    uniform = a.derived.get("uniform")
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
        uniform = a.derived["uniform"] = (cap, prod) if same and len(a.resource_id) else False
    return uniform or None


def _node_ok(a: DeviceArrays, demand: Demand) -> tuple[np.ndarray, np.ndarray] | None:
    """Per node of `a`: its devices are big enough and of an allowed product (all or none of
    them, see `_uniform`), and the bytes the pod needs on each. Labels only: cached per demand."""
    uniform = _uniform(a)
    if uniform is None:
        return None
    cache = _bounded_cache(a, "node_ok")
    key = (demand.bytes_per_gpu, demand.allowed_products)
    hit = cache.get(key)
    if hit is None:
        cap, prod = uniform
        if demand.bytes_per_gpu is None:  # a whole device: its per-pod cap, which it always has
            need, ok = cap, cap >= 0
        else:
            need = np.full(len(cap), demand.bytes_per_gpu, np.int64)
            ok = cap >= demand.bytes_per_gpu
        if demand.allowed_products is not None:
            allowed = [
                pid
                for name, pid in a.products.items()
                if _product_allowed(name, demand.allowed_products)
            ]
            ok &= np.isin(prod, np.asarray(allowed, np.int64))
        hit = cache[key] = (ok, need)
    return hit


def _one_largest(ledger: Ledger, a: DeviceArrays, demand: Demand) -> np.ndarray | None:
    """What `_filter_one` computes per device, from the ledger's per-node summary instead: per
    node of the resource view `a`, the most free VRAM on a big-enough allowed device with a free
    replica (-1 when none). None when the summary cannot stand for the devices (`_uniform`)."""
    hit = _node_ok(a, demand)
    if hit is None:
        return None
    return np.where(hit[0], ledger.slot_free(int(a.resource_id[0])), -1)


def _node_fit(ledger: Ledger, a: DeviceArrays, demand: Demand) -> tuple | None:
    """(node ok, bytes needed per node, the ledger's summary) for `_filter_summary`, or None."""
    hit = _node_ok(a, demand)
    if hit is None:
        return None
    return hit[0], hit[1], ledger.summary(int(a.resource_id[0]))


def _filter_summary(
    ledger: Ledger,
    fit: _Fit,
    demand: Demand,
    rows: np.ndarray,
    out: FilterOutcome,
    ok: np.ndarray,
    need: np.ndarray,
    summary: NodeSummary,
) -> None:
    """`_filter_rows` from the ledger's per-node summary (any GPU count, declared or whole
    devices): a node has k fitting devices iff its k-th largest free VRAM with a free replica
    covers the pod. Same answers and reasons, one pass over the nodes instead of the devices."""
    a = fit.a
    k = demand.gpu_count
    top = summary.top
    if k <= top.shape[1]:
        good = ok[rows] & (top[rows, k - 1] >= need[rows])
    else:
        good = np.zeros(len(rows), bool)
    bad = _split_feasible(ledger, a, rows, good, out)
    if len(bad):
        n_ok = np.zeros(len(a.node_names), np.int64)
        open_ = bad[ok[bad]]  # the others fail on labels (categories 0..3), which never read n_ok
        n_ok[open_] = row_counts(top[open_] >= need[open_, None])
        n_slot = np.where(ok, summary.slots, 0)
        largest = np.where(ok, summary.largest, -1)
        _explain(ledger, fit, demand, bad, out, n_ok, rows, None, (n_slot, largest))


def _split_feasible(
    ledger: Ledger, a: DeviceArrays, rows: np.ndarray, good: np.ndarray, out: FilterOutcome
) -> np.ndarray:
    """Put the names of the `good` rows in `out.feasible` (remembered: prioritize will send this
    list) and return the failing rows, which the caller explains: none when some node passes and
    `out.explain_all` is off."""
    feasible_rows = rows[good]
    out.feasible = _node_names(a)[feasible_rows].tolist()
    if len(out.feasible) > 1 and a.node_names is ledger.arrays.node_names:
        _remember_rows(
            ledger, out.feasible, feasible_rows, []
        )  # shared, not copied: see FilterOutcome
    if out.feasible and not out.explain_all:
        return rows[:0]
    return rows[~good]


def _filter_rows(
    ledger: Ledger, fit: _Fit, demand: Demand, rows: np.ndarray, out: FilterOutcome
) -> None:
    a = fit.a
    ok_count = _per_node(a, fit.ok)
    good = ok_count[rows] >= demand.gpu_count
    bad = _split_feasible(ledger, a, rows, good, out)
    if len(bad):
        _explain(ledger, fit, demand, bad, out, ok_count, rows)


# Reasons that depend on what is in use, worded once per distinct figure (bounded, see _reason).
_REASONS: dict[tuple, str] = {}
_MAX_REASONS = 1 << 16
_UNRESOLVABLE_CATEGORIES = 4  # categories 0..3 below never change until the node's labels do
_FIXED_CACHED = 256


def _explain(
    ledger: Ledger,
    fit: _Fit,
    demand: Demand,
    bad: np.ndarray,
    out: FilterOutcome,
    n_ok: np.ndarray,
    asked: np.ndarray | None = None,
    one: tuple[np.ndarray, np.ndarray] | None = None,
    summary: tuple[np.ndarray, np.ndarray] | None = None,
    books_short: bool = False,
) -> None:
    """A reason for every node in `bad`, in vector form: nodes are sorted into categories
    (0 not a GPU node, 1 no such resource, 2 too few devices, 3 devices too small: unresolvable;
    4 no free replica, 5 not enough free VRAM: failed), then each distinct reason is worded once.
    `books_short`: no node in `bad` has room for the pod on the books (`_filter_plugin`), so the
    device plugin's bound refuses none of them (see `_explain_shared`).

    Categories 0..2 depend on labels and the demand's resource, products and GPU count only:
    for a candidate list seen before (`asked`, the rows of the request, from the _node_rows
    cache) and such a demand, their reasons are the same dict as last time and only the other
    nodes are looked at.
    """
    a = fit.a
    names, kind, problem = _node_info(ledger, a)
    n_nodes = len(a.node_names)
    k = demand.gpu_count
    dkey = (demand.resource, demand.bytes_per_gpu, demand.allowed_products, k)
    fixed_cache = a.derived.setdefault("fixed", {})
    ckey = (id(asked), demand.resource, demand.allowed_products, k)  # categories 0..2 only
    known = fixed_cache.get(ckey) if asked is not None else None
    base = None
    if known is not None and known[0] is asked:
        base = known[2]
        bad = bad[~known[1][bad]]
        if not len(bad):
            _add_reasons(out, base)
            return
    n_match, n_big, big_enough = _static_counts(a, fit, demand, kind)
    if (
        one is not None
    ):  # from _filter_one (k == 1): a free replica on a big-enough device iff largest >= 0
        with_slot, largest = one
        n_slot = (largest >= 0).astype(np.int64)
    elif (
        summary is not None
    ):  # from _filter_summary: per node, devices with a free replica and largest free
        n_slot, largest = summary
    else:
        with_slot = big_enough & (a.used_replicas < a.replicas)
        n_slot = _per_node(a, with_slot)
    # np.select's first matching condition, as masked assignments from the last to the first (cheaper)
    cat = np.full(len(bad), 5, np.int64)
    cat[n_slot[bad] < k] = 4
    cat[n_big[bad] < k] = 3
    matching = n_match[bad]
    cat[matching < k] = 2
    cat[matching == 0] = 1
    cat[problem[bad]] = 0
    fixed = cat < _UNRESOLVABLE_CATEGORIES
    if base is not None:
        _add_reasons(out, base)
    if fixed.any():
        rows = bad[fixed]
        cache = a.derived.setdefault("reasons", {})
        row_kinds = kind[rows]
        present = np.flatnonzero(np.bincount(row_kinds)).tolist()  # a handful of kinds
        by_kind = np.empty(present[-1] + 1, dtype=object)
        for kd in present:
            msg = cache.get((kd, dkey))
            if msg is None:
                i = int(np.argmax(row_kinds == kd))
                r = int(rows[i])
                msg = cache[(kd, dkey)] = _fixed_reason(
                    ledger, fit, demand, int(cat[fixed][i]), r, int(n_match[r])
                )
            by_kind[kd] = msg
        _mutable(out).update(zip(names[rows].tolist(), by_kind[row_kinds].tolist()))
    if asked is not None and known is None:
        if len(fixed_cache) >= _FIXED_CACHED:
            fixed_cache.clear()
        label_only = cat < 3  # not category 3: "too small" depends on the pod's bytes
        is_fixed = np.zeros(n_nodes, bool)
        is_fixed[bad[label_only]] = True
        fixed_cache[ckey] = (
            asked,
            is_fixed,
            SharedReasons({n: out.unresolvable[n] for n in names[bad[label_only]].tolist()}),
        )
    slot = cat == 4
    if slot.any():
        rows = bad[slot]
        out.failed.update(
            _worded(
                names[rows].tolist(),
                n_slot[rows],
                lambda c: _reason(
                    ("slot", c, k),
                    lambda: f"all GPU replicas in use: {c} of {k} needed GPUs have a free replica",
                ),
            )
        )
    mem = cat == 5
    if not mem.any():
        return
    rows = bad[mem]
    need = demand.bytes_per_gpu
    if fit.shared is not None:
        rows = _explain_shared(
            fit, demand, rows, names, n_match, out, books_short
        )  # what is left fails on memory
        if not len(rows):
            return
    out.failed.update(_worded(names[rows].tolist(), n_ok[rows], lambda c: _mem_reason(need, c, k)))


def _add_reasons(out: FilterOutcome, base: SharedReasons) -> None:
    """Add the label-only reasons `base` to `out`: as the very object when `out` has no other
    (no copy, and its wire form is written once; `_mutable` copies it if more are added later),
    else copied in."""
    if not out.unresolvable:
        out.unresolvable = base
    else:
        _mutable(out).update(base)


def _mutable(out: FilterOutcome) -> dict[str, str]:
    """`out.unresolvable`, made a dict of its own first if it is shared (copy on write)."""
    if type(out.unresolvable) is SharedReasons:
        out.unresolvable = dict(out.unresolvable)
    return out.unresolvable


def _worded(names: list[str], counts: np.ndarray, word: Callable[[int], str]) -> dict[str, str]:
    """{name: word(count)} for nodes whose reason differs only by a small count (0..k-1 devices):
    each distinct count is worded once."""
    present = np.flatnonzero(np.bincount(counts)).tolist()
    if len(present) == 1:
        return dict.fromkeys(names, word(present[0]))
    msgs = np.empty(present[-1] + 1, dtype=object)
    for c in present:
        msgs[c] = word(c)
    return dict(zip(names, msgs[counts].tolist()))


_STATIC_COUNTS_CACHED = 256
#: demand shapes whose scores are kept (10 KB each at 5,000 nodes): the load test's pod mix has
#: ~480, and emptying the cache every 256 new shapes threw away the frequent ones too
_SCORES_CACHED = 1024
#: a kept score table is patched when at most 1 node in this many changed since, else redone.
#: From the summaries a patch is a vector pass over the changed rows; device by device under a
#: replica policy (5,000 nodes, the resource's rows only, devices not looked up) it costs
#: ~0.13 ms + ~0.35 us per node against 0.55-1.0 ms for a redo (measured 30 Nov; it was ~3 us
#: per node against ~1.5 ms, and 1 in 12, before)
_PATCH_SHARE = 4


def _static_counts(
    a: DeviceArrays, fit: _Fit, demand: Demand, kind: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node: devices of the resource (and product), and those big enough for the pod; plus
    the big-enough mask. They depend on labels and the demand only, so they are kept per demand,
    and counted on one node per kind (nodes of a kind have the same devices) instead of all."""
    cache = _bounded_cache(a, "static_counts")
    key = (demand.resource, demand.bytes_per_gpu, demand.allowed_products)
    hit = cache.get(key)
    if hit is None:
        reps = a.derived.get("kind_reps")
        if reps is None:
            reps = a.derived["kind_reps"] = (
                np.unique(kind, return_index=True)[1] if len(kind) else np.zeros(0, np.int64)
            )
        bounds = list(zip(a.node_start[reps].tolist(), a.node_start[reps + 1].tolist()))
        big_enough = _static_fit(a, demand)[2]
        per_kind = np.zeros((2, int(kind.max()) + 1 if len(kind) else 0), np.int64)
        for j, (lo, hi) in enumerate(bounds):
            per_kind[0, kind[reps[j]]] = np.count_nonzero(fit.matches[lo:hi])
            per_kind[1, kind[reps[j]]] = np.count_nonzero(big_enough[lo:hi])
        hit = cache[key] = (per_kind[0][kind], per_kind[1][kind], big_enough)
    return hit


def _reason(key: tuple, word) -> str:
    msg = _REASONS.get(key)
    if msg is None:
        if len(_REASONS) >= _MAX_REASONS:
            _REASONS.clear()
        msg = _REASONS[key] = word()
    return msg


def _mem_reason(need: int | None, n_ok: int, k: int) -> str:
    """No per-node figure in the wording: kube-scheduler's event counts nodes per distinct reason
    ("0/5000 nodes are available: 1200 no GPU with 20Gi free, ..."), and a figure per node would
    split that into hundreds of one-node entries. /state shows each GPU's free VRAM."""

    def word() -> str:
        want = "a whole free GPU" if need is None else f"{format_bytes(need)} free"
        if k == 1:
            return f"no GPU with {want}"
        return f"only {n_ok} of {k} GPUs with {want}"

    return _reason(("mem", need, n_ok, k), word)


def _fixed_reason(
    ledger: Ledger, fit: _Fit, demand: Demand, category: int, r: int, n_match: int
) -> str:
    name = fit.a.node_names[r]
    if category == 0:
        inv = ledger.node(name)
        return f"not a GPU node: {inv.problem if inv is not None else 'unknown'}"
    if category == 1:
        return _no_resource(ledger, name, demand)
    if category == 2:
        return f"node has {n_match} {_unit(demand)}, pod needs {demand.gpu_count}"
    return _too_small(ledger, name, demand, fit)


def _explain_shared(
    fit: _Fit,
    demand: Demand,
    rows: np.ndarray,
    names: np.ndarray,
    n_match: np.ndarray,
    out: FilterOutcome,
    books_short: bool = False,
) -> np.ndarray:
    """Reasons owed to the device plugin's choice of GPU (extender.deviceplugin) for the failing
    nodes `rows`, in vector form; returns the rows it gave none (they fail on memory).

    A node whose matching devices the pod can only use with a pin it does not take is
    unresolvable; a node where enough devices have the memory but the plugin's node-level bound
    refuses some is named with the lowest worst case among those (the first such device).
    `books_short`: none of `rows` has enough such devices, so only the first case can hold, and
    it depends on labels alone: the used columns are not read (they may be stale in `fit.a`)."""
    a, s = fit.a, fit.shared
    k = demand.gpu_count
    pin_missing = (n_match[rows] > 0) & (_pinnable(fit, demand)[rows] < k)
    if books_short:
        stacked = np.zeros(len(rows), bool)
    else:
        local = (
            fit.matches
            & (a.used_replicas < a.replicas)
            & (a.capacity - a.used >= fit.need)
            & (a.per_pod_cap >= fit.need)
        )
        blocked = local & ~s.allowed
        stacked = (
            ~pin_missing & (_per_node(a, local)[rows] >= k) & (_per_node(a, blocked)[rows] > 0)
        )
    if pin_missing.any():
        _mutable(out).update(dict.fromkeys(names[rows[pin_missing]].tolist(), PIN_MISSING))
    if stacked.any():
        keep = np.zeros(len(a.node_names), bool)
        keep[rows[stacked]] = True
        dev = np.flatnonzero(blocked)
        dev = dev[keep[a.node_of[dev]]]
        dev = dev[
            np.lexsort((dev, s.worst[dev], a.node_of[dev]))
        ]  # per node: lowest worst case, then row
        first = dev[run_starts(a.node_of[dev])]
        out.failed.update(
            zip(
                names[a.node_of[first]].tolist(),
                _stack_reasons(s.policy, s.worst[first], a.capacity[first]),
            )
        )
    return rows[~pin_missing & ~stacked]


def _pinnable(fit: _Fit, demand: Demand) -> np.ndarray:
    """Per node of `fit.a`, its devices of the demand's resource and products that do not need a
    pin the pod cannot take: labels, policy and the pod's pin ability only, so kept with the
    arrays per demand shape (per node counts over every node, read at the asked rows: cheaper
    than masking the rest)."""
    cache = _bounded_cache(fit.a, "pinnable")
    key = (demand.resource, demand.allowed_products, demand.pin_configmap, fit.shared.policy)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _per_node(fit.a, fit.matches & ~fit.shared.needs_pin)
    return hit


def _unit(demand: Demand) -> str:
    return f"{demand.mig_profile} slices" if demand.mig_profile else "GPUs"


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
        return (per_word[:, 0] if w == 8 else per_word.sum(axis=1)).astype(np.int64)
    return mask.sum(axis=1, dtype=np.int64)


def _segment_max(values: np.ndarray, starts: np.ndarray, n_nodes: int) -> np.ndarray:
    """Max of `values` per node (rows of a node are contiguous); -1 for nodes without devices."""
    out = np.full(n_nodes, -1, np.int64)
    if len(values) == 0:
        return out
    s = starts[:-1]
    nonempty = starts[1:] > s
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(values, s[nonempty])
    return out


def _no_resource(ledger: Ledger, name: str, demand: Demand) -> str:
    """One text per resource, not naming what the node offers instead: kube-scheduler counts
    identical reasons (\"0/5000 nodes are available: 2856 node has no nvidia.com/gpu, ...\"), and
    a list of the node's own resources split that count into one group per kind of node (it
    was also two thirds of the bytes of a 5,000-node filter answer)."""
    inv = ledger.node(name)
    if (
        demand.allowed_products is not None
        and inv is not None
        and any(d.resource == demand.resource for d in inv.devices)
    ):
        return f"GPU product {inv.product} not in the pod's allowed products"
    return f"node has no {demand.resource}"


def _too_small(ledger: Ledger, name: str, demand: Demand, fit: _Fit) -> str:
    inv = ledger.node(name)
    need = demand.bytes_per_gpu or 0
    devices = [d for d in (inv.devices if inv else ()) if d.resource == demand.resource]
    cap = max((d.per_pod_cap_bytes for d in devices), default=0)
    if demand.mig_profile is not None and inv is not None:
        fitting = sorted(
            {
                (d.memory_bytes, d.profile)
                for d in inv.devices
                if isinstance(d, MigSlice) and d.memory_bytes >= need
            }
        )
        hint = (
            f"; smallest profile on node that fits: {fitting[0][1]}"
            if fitting
            else "; no profile on this node fits"
        )
        return f"model needs {format_bytes(need)} but {demand.mig_profile} has {format_bytes(cap)}{hint}"
    if devices and devices[0].sharing.value == "mps":
        return f"need {format_bytes(need)} per GPU, MPS caps each replica at {format_bytes(cap)}"
    return f"need {format_bytes(need)} per GPU, GPUs have {format_bytes(cap)}"


def score_nodes(
    ledger: Ledger, demand: Demand, names: Sequence[str], planned: str | None = None
) -> list[tuple[str, int]]:
    """Best-fit scores 0..10 for `names`; a node that cannot take the pod scores 0.

    Bands, so that no empty GPU is opened while a partly used one fits anywhere:
    9..5 the pod lands on partly used GPUs (tighter fit scores higher), 4..2 it opens an empty
    GPU on a node already in use, 1..0 it opens an empty node. One node gets 10, the one vramsched
    would choose: the planner's node, else the best band's first node (`_finish_scores`).
    """
    if not demand.wants_gpu:
        return [(n, 0) for n in names]
    node_names, rows, scores = score_rows(ledger, demand, names, planned)
    return list(zip(node_names[rows].tolist(), scores.tolist()))


def score_rows(
    ledger: Ledger,
    demand: Demand,
    names: Sequence[str],
    planned: str | None = None,
    single_top: bool = True,
    avoid: Collection[str] = (),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`score_nodes` as arrays (node names, rows of the known `names` in order, their scores),
    for an encoder that writes the answer without a Python object per node. Needs a GPU demand.
    `single_top=False` leaves the best band as it is when there is no plan (the answer before
    one node was made to stand out: benchmarks/kube_scoring.py compares the two). `avoid`: nodes
    just chosen for other pods whose bind has not come yet; the single top is another node of the
    best band when there is one.
    Under a replica policy the per-node summary still answers for a resource the device plugin's
    bound never applies to (a MIG profile no node time-slices): its books are exact."""
    rid = ledger.arrays.resources.get(demand.resource)
    exact = ledger.replica_policy is None or (rid is not None and not bounds_resource(ledger, rid))
    view = _resource_arrays(ledger, demand, used=False, under_policy=True) if exact else None
    if view is not None:
        rows, _ = _node_rows(ledger, names)
        fast = _score_summary(ledger, demand, rows, view)
        if fast is not None:
            return _finish_scores(ledger, view, rows, *fast, planned, single_top, avoid)
    static = _resource_arrays(
        ledger, demand, used=False, under_policy=True
    )  # this resource's devices, or every device
    rows, _ = _node_rows(ledger, names)
    if static is None:
        a, at = ledger.arrays, None
    else:  # the view's rows among every device's
        a, at = static, ledger.arrays.rows_of(rid)
    return _finish_scores(
        ledger,
        a,
        rows,
        *_device_scores_kept(ledger, demand, a, static is None, at),
        planned,
        single_top,
        avoid,
    )


def _device_scores_kept(
    ledger: Ledger,
    demand: Demand,
    a: DeviceArrays,
    full: bool,
    at: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`_device_scores` of every node of `a`, kept per demand shape (`_kept_scores`): a node's
    score reads only its own devices and, under a replica policy, the bound on them, which
    changes only when the node does. Read-only for callers. `full`: `a` is every device (the
    bound applies). `at`: `a` is the demand's resource view (`used=False`), these rows of every
    device; its used columns are read from the ledger (for a patch, at the changed nodes' rows
    only), and under a policy the bound applies to them."""
    key = (
        demand.resource,
        demand.bytes_per_gpu,
        demand.allowed_products,
        demand.gpu_count,
        demand.pin_configmap,
        ledger.replica_policy,
    )
    bounded = at is not None and ledger.replica_policy is not None

    def every() -> tuple[np.ndarray, np.ndarray]:
        node_busy = ledger.arrays.node_used_replicas > 0  # any pod, whatever resource it holds
        current = (
            None
            if full
            else a
            if at is None
            else _resource_arrays(ledger, demand, under_policy=True)
        )
        fit = _fit(ledger, demand, current, bounded=bounded)
        return _device_scores(fit, demand.gpu_count, np.arange(len(a.node_names)), node_busy)

    def some(nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sub, ix = _nodes_arrays(a, nodes)
        if at is not None:
            ix = at[ix]
            sub.used, sub.used_replicas = ledger.arrays.used[ix], ledger.arrays.used_replicas[ix]
        fit = _fit(ledger, demand, sub, node_rows=ix if full or bounded else None)
        return nodes, *_device_scores(
            fit,
            demand.gpu_count,
            np.arange(len(nodes)),
            ledger.arrays.node_used_replicas[nodes] > 0,
        )

    return _kept_scores(ledger, a, "device_scores", key, every, some)


def _kept_scores(
    ledger: Ledger,
    a: DeviceArrays,
    name: str,
    key: tuple,
    every: Callable[[], tuple[np.ndarray, np.ndarray]],
    some: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """A (scores, placed) table over every node of `a`, kept per demand shape (`key`, in the cache
    `name`) and patched on the nodes the ledger's log says changed since it was last read:
    `some(nodes)` gives (the rows among them whose entries may change, their scores, placed).
    Redone with `every()` when the log no longer reaches back that far, or when more than 1
    node in `_PATCH_SHARE` changed (then one pass over all of them is cheaper)."""
    cache = _bounded_cache(a, name, _SCORES_CACHED)
    entry = cache.get(key)
    now = ledger.position
    if entry is not None:
        nodes = ledger.touched_rows_since(
            entry[0]
        )  # rows of these very arrays (a rebuild drops the cache)
        if nodes is None or len(nodes) * _PATCH_SHARE > len(a.node_names):
            entry = None
        else:
            if len(nodes):
                rows, entry[1][rows], entry[2][rows] = some(nodes)
            entry[0] = now
    if entry is None:
        scores, placed = every()
        entry = cache[key] = [now, scores.astype(np.int8), placed]
    return entry[1], entry[2]


def _device_scores(
    fit: _Fit, k: int, rows: np.ndarray, node_busy: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, placed) per node of `fit.a`, for the nodes `rows` (0 and False elsewhere), device
    by device: the k best-fit devices (`_choose`) and how tightly they fit. `node_busy`: per
    node of `fit.a`, whether any pod runs there."""
    a = fit.a
    n_nodes = len(a.node_names)
    scores = np.zeros(n_nodes, np.int64)
    placed = np.zeros(n_nodes, bool)
    if len(rows):
        chosen = _choose(fit, k, rows)
        if len(chosen):
            node = a.node_of[chosen]
            empty = (a.used_replicas[chosen] == 0).astype(np.int64)
            leftover = a.capacity[chosen] - a.used[chosen] - fit.need[chosen]
            frac = np.maximum(leftover, 0) / np.maximum(a.capacity[chosen], 1)
            opened = np.bincount(node, weights=empty, minlength=n_nodes)
            taken = np.bincount(node, minlength=n_nodes)
            mean_left = np.bincount(node, weights=frac, minlength=n_nodes) / np.maximum(taken, 1)
            tight = 1.0 - mean_left
            band = np.where(
                opened == 0,
                5 + np.rint(4 * tight),
                np.where(node_busy, 2 + np.rint(2 * tight), np.rint(tight)),
            )
            placed = taken >= k
            scores = np.where(placed, band, 0).astype(np.int64)
    return scores, placed


def _finish_scores(
    ledger: Ledger,
    a: DeviceArrays,
    rows: np.ndarray,
    scores: np.ndarray,
    placed: np.ndarray,
    planned: str | None,
    single_top: bool = True,
    avoid: Collection[str] = (),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bands capped at 9 and one node at 10: the planner's node when the pod still fits there and it
    is among `rows`, else the first node (in the ledger's order) of the best band among `rows`.

    Why one node: kube-scheduler picks at random among the nodes with the top total score, so a
    band shared by many nodes would spread pods over them; on the Alibaba trace filled to 1.3x
    that random pick allocated 5,032-5,211 GPUs of memory against 5,670-5,786 for this one
    choice (benchmarks/kube_scoring.py, docs/packing.md). `scores` is a kept table (read-only):
    the answer is a new array."""
    out = scores[rows]  # a copy (rows is an index array); bands are 0..9
    r = ledger.node_row(planned) if planned is not None else None
    top = rows == r if r is not None and placed[r] else None
    if (
        top is None or not top.any()
    ) and single_top:  # no plan, or its node no longer fits or was not asked about
        skip = [i for i in map(ledger.node_row, avoid) if i is not None] if avoid else ()
        top = _first_best(rows, out, placed[rows], skip)
    if top is not None:
        out[top] = MAX_SCORE
    return _node_info(ledger, a)[0], rows, out


def _first_best(
    rows: np.ndarray, scores: np.ndarray, fits: np.ndarray, skip: Sequence[int] = ()
) -> np.ndarray | None:
    """Where in `rows` (a mask: a node asked twice is there twice) the lowest row that takes the
    pod (`fits`) with the highest of `scores` is, or None; a row of `skip` only when every row
    with that score is in it. `scores` and `fits` are per entry of `rows`."""
    if not len(rows):
        return None
    masked = np.where(fits, scores, -1)
    top = masked.max()
    if top < 0:
        return None
    best = masked == top
    if len(skip):
        free = best & ~np.isin(rows, skip)
        if free.any():
            best = free
    return rows == rows[best].min()


def _node_capacity(a: DeviceArrays) -> np.ndarray | None:
    """Per node of `a`: the memory its devices all have, or None when a node mixes sizes."""
    cap = a.derived.get("capacity")
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
        a.derived["capacity"] = cap
    return None if cap is False else cap


def _score_summary(
    ledger: Ledger,
    demand: Demand,
    rows: np.ndarray,
    a: DeviceArrays,
) -> tuple[np.ndarray, np.ndarray] | None:
    """`score_rows` from the ledger's per-node summary: (scores, placed) per node of `a`, valid
    for the asked `rows` (read-only), or None when the summary cannot stand for the devices.

    Scores depend on the demand's shape and on what is in use on each node, so they are kept
    per shape for every node and patched where nodes changed (`_kept_scores`): a shape asked
    again after a few dozen binds costs those nodes, not all 5,000.
    """
    hit = _node_ok(a, demand)
    capacity = _node_capacity(a)
    if hit is None or capacity is None:
        return None
    ok, node_need = hit

    def every() -> tuple[np.ndarray, np.ndarray]:
        scores, placed = np.zeros(len(ok), np.int8), np.zeros(len(ok), bool)
        r = np.flatnonzero(ok)
        if len(r):
            scores[r], placed[r] = _summary_scores(ledger, demand, a, node_need, capacity, r)
        return scores, placed

    def some(nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = nodes[ok[nodes]]  # the others never fit: their 0 stands
        return r, *_summary_scores(ledger, demand, a, node_need, capacity, r)

    key = (demand.bytes_per_gpu, demand.allowed_products, demand.gpu_count)
    return _kept_scores(ledger, a, "scores", key, every, some)


def _summary_scores(
    ledger: Ledger,
    demand: Demand,
    a: DeviceArrays,
    node_need: np.ndarray,
    capacity: np.ndarray,
    r: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(score, placed) of the nodes `r` (sorted, each once, all passing `_node_ok`), from the
    summary: best fit takes the devices already in use with the least free VRAM that covers the
    pod, then empty ones likewise; with one size of device per node that is all the score
    depends on, and the fractions are summed in the same order as the per-device path sums
    them. Each chosen device is one flat gather (`take` and flat indices cost half of 2-D
    fancy indexing)."""
    k = demand.gpu_count
    summary = ledger.summary(int(a.resource_id[0]))
    whole = demand.bytes_per_gpu is None
    need = node_need[r] if whole else demand.bytes_per_gpu  # whole device: its cap
    busy, idle = (
        summary.busy.take(r, axis=0),
        summary.idle.take(r, axis=0),
    )  # sorted largest first: the fitting ones lead
    covers = need[:, None] if whole else need
    n_busy = row_counts(busy >= covers)
    n_idle = row_counts(idle >= covers)
    fits = n_busy + n_idle >= k  # the others are worked out too (clipped indices) and scored 0
    width = busy.shape[1]
    base = np.arange(0, len(r) * width, width)
    busy, idle = busy.ravel(), idle.ravel()
    cap = np.maximum(capacity[r], 1)
    if k == 1:  # most pods: one device, no running sums
        on_busy = n_busy > 0
        free = np.where(
            on_busy, busy[base + np.maximum(n_busy - 1, 0)], idle[base + np.maximum(n_idle - 1, 0)]
        )
        left = np.maximum(free - need, 0) / cap
        all_busy = on_busy
    else:
        left = np.zeros(len(r))
        opened = np.zeros(len(r))
        top = width - 1  # np.clip costs several times two ufuncs on small int arrays (its checks)
        for j in range(
            k
        ):  # the j-th device chosen: the busy ones smallest first, then the idle ones
            on_busy = j < n_busy
            free = np.where(
                on_busy,
                busy[base + np.minimum(np.maximum(n_busy - 1 - j, 0), top)],
                idle[base + np.minimum(np.maximum(n_idle - 1 - (j - n_busy), 0), top)],
            )
            left += np.maximum(free - need, 0) / cap
            opened += ~on_busy
        all_busy = opened == 0
    tight = 1.0 - left / k
    node_busy = ledger.arrays.node_used_replicas[r] > 0  # any pod, whatever resource it holds
    band = np.where(
        all_busy,
        5 + np.rint(4 * tight),
        np.where(node_busy, 2 + np.rint(2 * tight), np.rint(tight)),
    )
    return np.where(fits, band, 0), fits


def _choose(fit: _Fit, k: int, rows: np.ndarray) -> np.ndarray:
    """Device rows chosen on each node in `rows`: k best-fit devices (partly used first,
    then least leftover, then lowest index). Nodes with fewer than k fitting devices get none."""
    a = fit.a
    if len(rows) == 1:  # one node: its rows are a slice, no mask over every device
        lo, hi = int(a.node_start[rows[0]]), int(a.node_start[rows[0] + 1])
        cand = lo + np.flatnonzero(fit.ok[lo:hi])
    else:
        in_rows = np.zeros(len(a.node_names), bool)
        in_rows[rows] = True
        sizes = a.derived.get("sizes")
        if sizes is None:
            sizes = a.derived["sizes"] = np.diff(a.node_start)
        cand = np.flatnonzero(fit.ok & np.repeat(in_rows, sizes))
    if len(cand) == 0:
        return cand
    empty = (a.used_replicas[cand] == 0).astype(np.int64)
    if fit.shared is not None:
        # The plugin spreads these replicas: book each on a least-used GPU, as it will count it.
        empty = np.where(fit.shared.distributed[cand], a.used_replicas[cand], empty)
    leftover = a.capacity[cand] - a.used[cand] - fit.need[cand]
    if k == 1:
        best = _first_best_per_node(a.node_of[cand], empty, leftover)
        if best is not None:
            return cand[best]
    cand = cand[_best_fit_order(a.node_of[cand], empty, leftover)]
    return cand[first_k_per_node(a.node_of[cand], k, len(a.node_names))]


def _first_best_per_node(
    node: np.ndarray, empty: np.ndarray, leftover: np.ndarray
) -> np.ndarray | None:
    """For one device per node: the position of the first smallest (empty, leftover) in each
    node's run of candidates, without sorting (None when the packed key would not fit)."""
    n = len(node)
    if n == 0 or int(leftover.min()) < 0 or int(empty.min()) < 0:
        return None
    l_bits = max(1, ceil(log2(int(leftover.max()) + 2)))
    if l_bits + max(1, ceil(log2(int(empty.max()) + 2))) > 62:
        return None
    key = (empty.astype(np.int64) << l_bits) | leftover
    starts = np.flatnonzero(run_starts(node))
    lowest = np.minimum.reduceat(key, starts)
    hit = np.flatnonzero(key == np.repeat(lowest, np.diff(np.append(starts, n))))
    return hit[run_starts(node[hit])]


def _best_fit_order(node: np.ndarray, empty: np.ndarray, leftover: np.ndarray) -> np.ndarray:
    """Stable order by (node, empty, leftover) of candidate rows already grouped by node.

    One argsort of a packed int64 key when the three fit in 63 bits (always, for real GPUs);
    np.lexsort is several times slower on the tens of thousands of rows of a big cluster.
    """
    n = len(node)
    if n == 0 or int(leftover.min()) < 0 or int(empty.min()) < 0:
        return np.lexsort((np.arange(n), leftover, empty, node))
    first = run_starts(node)
    group = np.cumsum(first) - 1
    e_max, l_max = int(empty.max()), int(leftover.max())
    bits = [
        max(1, ceil(log2(int(group[-1]) + 2))),
        max(1, ceil(log2(e_max + 2))),
        max(1, ceil(log2(l_max + 2))),
    ]
    if sum(bits) > 62:
        return np.lexsort((np.arange(n), leftover, empty, node))
    key = (
        (group.astype(np.int64) << (bits[1] + bits[2]))
        | (empty.astype(np.int64) << bits[2])
        | leftover
    )
    return np.argsort(key, kind="stable")


def plugin_allows(ledger: Ledger, demand: Demand, res: Reservation) -> bool:
    """Whether the device plugin's node-level bound (and its pin requirement) allows the devices
    of `res`, chosen elsewhere: a background plan, made on per-device books alone. This is what
    `choose_devices` checks beside `Ledger.fits` when a replica policy is set; with none (exact
    per-device books: embedded cluster, simulator) it always allows. Reads the node's rows only."""
    if ledger.replica_policy is None or not demand.wants_gpu:
        return True
    r = ledger.node_row(res.node)
    if r is None:
        return False
    shared = _fit_on_node(ledger, demand, r).shared
    if shared is None:
        return True
    lo, hi = int(ledger.arrays.node_start[r]), int(ledger.arrays.node_start[r + 1])
    rows = [ledger.row(res.node, dev) for dev in res.device_ids]
    return all(i is not None and lo <= i < hi and bool(shared.allowed[i - lo]) for i in rows)


def _fit_on_node(ledger: Ledger, demand: Demand, r: int) -> _Fit:
    """The demand against node row `r`'s devices only, with the device plugin's bound on them
    when a replica policy is set: bind's cost does not grow with the cluster."""
    a = ledger.arrays
    rows = slice(int(a.node_start[r]), int(a.node_start[r + 1]))
    return _fit(
        ledger,
        demand,
        _node_arrays(a, r),
        node_rows=rows if ledger.replica_policy else None,
    )


def choose_devices(ledger: Ledger, demand: Demand, node: str) -> Reservation | str:
    """The best-fit devices for the pod on `node` as a Reservation to apply, or why there are none.

    Works on that node's rows only (the device plugin's node-level bound too), so a bind costs
    the same in a 10-node and a 10,000-node cluster.
    """
    if ledger.node(node) is None:
        return f"node {node} unknown to vramsched"
    r = ledger.node_row(node)
    if ledger.replica_policy is None and demand.wants_gpu:
        quick = _choose_on_node(ledger, demand, node, r)
        if quick is not None:
            return quick
    fit, rows = _fit_on_node(ledger, demand, r), np.zeros(1, np.int64)
    outcome = FilterOutcome()
    if not demand.wants_gpu:
        outcome.feasible = [node]
    else:
        _filter_rows(ledger, fit, demand, rows, outcome)
    if not outcome.feasible:
        return outcome.failed.get(node) or outcome.unresolvable.get(node) or "does not fit"
    chosen = _choose(fit, demand.gpu_count, rows)
    chosen = np.sort(chosen)
    a = fit.a
    return Reservation(
        pod=demand.pod,
        node=node,
        device_ids=tuple(a.devices[i].device_id for i in chosen.tolist()),
        bytes_per_device=tuple(int(fit.need[i]) for i in chosen.tolist()),
        priority=demand.priority,
        declared=demand.bytes_per_gpu is not None,
    )


def _choose_on_node(ledger: Ledger, demand: Demand, node: str, r: int) -> Reservation | None:
    """`choose_devices` for one node's few devices in plain Python (bind's common case: numpy's
    per-call cost dominates on 8 rows): the same fit test (`_static_fit`, `_fit`) and the same
    best-fit order (`_choose`: partly used first, then least leftover, then device order).
    None when the pod does not fit there: the vector path then words the reason."""
    a = ledger.arrays
    lo, hi = int(a.node_start[r]), int(a.node_start[r + 1])
    rid = a.resources.get(demand.resource, -1)
    allowed = None
    if demand.allowed_products is not None:
        allowed = {
            pid
            for name, pid in a.products.items()
            if _product_allowed(name, demand.allowed_products)
        }
    declared = demand.bytes_per_gpu
    cand = []
    for j, (res, prod, cap, per_pod, used, reps, used_reps) in enumerate(
        zip(
            a.resource_id[lo:hi].tolist(),
            a.product_id[lo:hi].tolist(),
            a.capacity[lo:hi].tolist(),
            a.per_pod_cap[lo:hi].tolist(),
            a.used[lo:hi].tolist(),
            a.replicas[lo:hi].tolist(),
            a.used_replicas[lo:hi].tolist(),
        )
    ):
        need = per_pod if declared is None else declared
        if res != rid or (allowed is not None and prod not in allowed):
            continue
        if per_pod < need or used_reps >= reps or cap - used < need:
            continue
        cand.append((int(used_reps == 0), cap - used - need, j, need))
    if len(cand) < demand.gpu_count:
        return None
    chosen = sorted(cand)[: demand.gpu_count]
    chosen.sort(key=lambda c: c[2])
    return Reservation(
        pod=demand.pod,
        node=node,
        device_ids=tuple(a.devices[lo + c[2]].device_id for c in chosen),
        bytes_per_device=tuple(c[3] for c in chosen),
        priority=demand.priority,
        declared=declared is not None,
    )


_MAX_COMBINATIONS = 4096


def preempt_victims(
    ledger: Ledger, demand: Demand, candidates: Mapping[str, Iterable[str]]
) -> dict[str, list[str]]:
    """For each node, the fewest lowest-priority victims (by UID) whose removal lets the pod fit.

    `candidates` maps node -> UIDs kube-scheduler proposes. Victims we hold no GPUs for are kept
    (the scheduler needed them for other resources); ours are cut to the smallest set that frees
    enough VRAM and replicas. Nodes where even all victims would not make room are dropped.
    """
    result: dict[str, list[str]] = {}
    fit = _fit(ledger, demand)
    a = fit.a
    for node, uids in candidates.items():
        uids = list(dict.fromkeys(uids))
        r = ledger.node_row(node)
        if r is None or not demand.wants_gpu:
            continue
        lo, hi = int(a.node_start[r]), int(a.node_start[r + 1])
        held = {res.pod.uid: res for res in ledger.pods_on(node) if res.pod.uid}
        ours = sorted(
            (held[u] for u in uids if u in held),
            key=lambda res: (res.priority, -res.total_bytes, res.key),
        )
        others = [u for u in uids if u not in held]
        if any(res.priority >= demand.priority for res in ours):
            ours = [res for res in ours if res.priority < demand.priority]
        if _fits_without(a, fit, lo, hi, demand.gpu_count, []):
            result[node] = uids
            continue
        best = _fewest_victims(a, fit, lo, hi, demand.gpu_count, ours, ledger)
        if best is None:
            continue
        result[node] = others + [res.pod.uid for res in best]
    return result


def _fewest_victims(a, fit, lo, hi, k, ours, ledger) -> list[Reservation] | None:
    for size in range(1, len(ours) + 1):
        tried = 0
        winners = []
        for combo in combinations(ours, size):
            tried += 1
            if tried > _MAX_COMBINATIONS:
                break
            if _fits_without(a, fit, lo, hi, k, combo, ledger):
                winners.append(combo)
        if winners:
            return list(
                min(winners, key=lambda c: (max(r.priority for r in c), sum(r.priority for r in c)))
            )
        if tried > _MAX_COMBINATIONS:
            for extra in range(size, len(ours) + 1):
                if _fits_without(a, fit, lo, hi, k, ours[:extra], ledger):
                    return list(ours[:extra])
            return None
    return None


def _fits_without(a, fit, lo, hi, k, victims, ledger=None) -> bool:
    used = a.used[lo:hi].copy()
    used_rep = a.used_replicas[lo:hi].copy()
    for res in victims:
        for dev_id, nbytes in zip(res.device_ids, res.bytes_per_device):
            i = ledger.row(res.node, dev_id)
            if i is not None and lo <= i < hi:
                used[i - lo] -= nbytes
                used_rep[i - lo] -= 1
    need = fit.need[lo:hi]
    ok = (
        fit.matches[lo:hi]
        & (used_rep < a.replicas[lo:hi])
        & (a.capacity[lo:hi] - used >= need)
        & (a.per_pod_cap[lo:hi] >= need)
    )
    if fit.shared is not None:  # the device plugin's node-level bound, with the victims gone
        ok &= (
            fit.shared.allowed[lo:hi]
            if not victims
            else ~fit.shared.needs_pin[lo:hi]
            & allowed_without(ledger, lo, hi, victims, fit.need, k)
        )
    return int(ok.sum()) >= k
