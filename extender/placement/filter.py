"""Filter: which candidate nodes can take the pod now, from the ledger's per-node summaries
where they stand for the devices, device by device where they do not."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from extender.arrays import DeviceArrays, NodeSummary, slot_free_bytes
from extender.demand import Demand
from extender.ledger import Ledger
from extender.placement.fit import (
    Fit,
    bound_at_resource,
    demand_fit,
    node_fit,
    one_largest,
    plugin_view,
    shape_need,
    static_fit,
)
from extender.placement.outcome import FilterOutcome, mutable_unresolvable
from extender.placement.pin_rule import unpinnable
from extender.placement.reasons import explain, explain_blocked
from extender.placement.views import (
    candidate_rows,
    name_array,
    per_node,
    remember_candidates,
    resource_arrays,
    row_counts,
    segment_max,
)
from extender.stock_plugin import bounds_resource, refused_per_node


def filter_nodes(
    ledger: Ledger, demand: Demand, names: Sequence[str], explain_all: bool = True
) -> FilterOutcome:
    """Which of `names` can take the pod now, and a short reason for every one that cannot.

    `explain_all=False`: reasons only when no node passes. kube-scheduler reads an extender's
    reasons only then (for the pod's FitError event and for preemption); when some node passes
    it drops them unread, so working them out, sending and decoding them is wasted on the
    scheduling path. The answer is then all-or-nothing: every refused node explained, or none.

    The pin rule (`extender.placement.pin_rule`) applies last, to a pod reading its GPUs from the
    gpu-index annotation only: see `_refuse_unpinnable`."""
    out = _filter_nodes(ledger, demand, names, explain_all)
    if demand.pin_annotation:
        out = _refuse_unpinnable(ledger, demand, names, out)
    return out


def _refuse_unpinnable(
    ledger: Ledger, demand: Demand, names: Sequence[str], out: FilterOutcome
) -> FilterOutcome:
    """Of the nodes that passed, those where the pod would get no GPU index (hence no GPU) become
    unresolvable: no eviction makes a node pinnable. When none is left, every refused node owes
    its reason, as whenever no node passes."""
    refused = unpinnable(ledger, demand, out.feasible)
    if not refused:
        return out
    keep = [n for n in out.feasible if n not in refused]
    if not keep and not out.explain_all:
        out = _filter_nodes(ledger, demand, names, explain_all=True)
    out.feasible = keep  # a new list: the one handed out is shared (FilterOutcome)
    if keep and not out.explain_all:
        return out
    out.unresolvable = {**out.unresolvable, **refused}
    return out


def _filter_nodes(
    ledger: Ledger, demand: Demand, names: Sequence[str], explain_all: bool
) -> FilterOutcome:
    """`filter_nodes` before the pin rule."""
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
    view = resource_arrays(ledger, demand, used=False)
    one = view is not None and demand.gpu_count == 1 and demand.bytes_per_gpu is not None
    largest = one_largest(ledger, view, demand) if one and view is not None else None
    by_node = node_fit(ledger, view, demand) if view is not None and not one else None
    if view is not None and largest is None and by_node is None:
        view = resource_arrays(ledger, demand)  # the per-device path reads the used columns
    fit = demand_fit(ledger, demand, view, with_ok=not one and by_node is None)
    rows, unknown = candidate_rows(ledger, names)
    if unknown:
        mutable_unresolvable(out).update(dict.fromkeys(unknown, "node unknown to vramsched"))
    if one:
        _filter_one(ledger, fit, demand, rows, out, largest)
    elif by_node is not None:
        _filter_summary(ledger, fit, demand, rows, out, *by_node)
    else:
        filter_rows(ledger, fit, demand, rows, out)


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
    static = resource_arrays(ledger, demand, used=False, under_policy=True)
    if static is None or rid is None:
        return False
    k = demand.gpu_count
    one = k == 1 and demand.bytes_per_gpu is not None
    largest: np.ndarray | None = None
    if one:
        largest = one_largest(ledger, static, demand)
        if largest is None:
            return False
        room_at = largest >= demand.bytes_per_gpu
    else:
        hit = node_fit(ledger, static, demand)
        if hit is None:
            return False
        ok, need_at, summary = hit
        top = summary.top
        room_at = ok & (top[:, k - 1] >= need_at) if k <= top.shape[1] else np.zeros(len(ok), bool)
    # Per node, its devices of the resource the bound refuses (none applies: a MIG profile no
    # node time-slices, whose books alone decide), worked out once per group; the rows' values
    # (`bound_at_resource`) only when there are reasons to give.
    n = len(static.node_names)
    shared = None
    view = plugin_view(ledger)
    if bounds_resource(view, rid):
        refused = refused_per_node(view, shape_need(full, demand), k, demand.pin_configmap, rid)
        if refused is None:  # the bound is not one value per group: from the rows
            shared = bound_at_resource(ledger, demand)
            assert shared is not None  # the bound applies to the resource
            refused = np.bincount(static.node_of[np.flatnonzero(~shared.allowed)], minlength=n)
        if ((refused > 0) & (refused < np.diff(static.node_start))).any():
            return False  # a node whose devices of the resource differ under the bound: per device
        every = (refused == 0).astype(np.int64)  # 1 where the bound admits the node
    else:
        every = np.ones(n, np.int64)
    rows, unknown = candidate_rows(ledger, names)
    if unknown:
        mutable_unresolvable(out).update(dict.fromkeys(unknown, "node unknown to vramsched"))
    room = room_at[rows]  # by the per-device books
    good = room & (every[rows] > 0)
    if not len(split_feasible(ledger, static, rows, good, out)):
        return True  # nothing to explain (or, `explain_all` off, no reason asked for)
    if shared is None:
        shared = bound_at_resource(ledger, demand)
    # `static`'s used columns are stale: nothing below reads them (`books_short`)
    matches, need, _ = static_fit(static, demand)
    fit = Fit(static, matches, need, np.zeros(0, bool), shared)
    blocked = rows[room & ~good]  # room on the books, refused by the bound: worded here, per node
    if len(blocked):
        assert shared is not None  # the bound refused them
        explain_blocked(static, shared, blocked, name_array(static), out)
    short = rows[~room]
    if not len(short):
        return True
    n_ok = np.zeros(n, np.int64)
    by_largest: tuple[np.ndarray | None, np.ndarray] | None = None
    by_summary: tuple[np.ndarray, np.ndarray] | None = None
    if one:
        assert largest is not None  # set above when `one`
        by_largest = (None, largest)
    else:  # as `_filter_summary` explains
        open_ = short[ok[short]]
        n_ok[open_] = (
            row_counts(top[open_] >= need_at[open_, None]) * every[open_]
        )  # devices the bound admits
        by_summary = (np.where(ok, summary.slots, 0), np.where(ok, summary.largest, -1))
    explain(ledger, fit, demand, short, out, n_ok, rows, by_largest, by_summary, books_short=True)
    return True


def _filter_one(
    ledger: Ledger,
    fit: Fit,
    demand: Demand,
    rows: np.ndarray,
    out: FilterOutcome,
    largest: np.ndarray | None = None,
) -> None:
    """`filter_rows` for the commonest pod, one device with declared bytes (no device-plugin
    bound): a node fits iff the most free VRAM on a big-enough device with a free replica covers
    the pod. Same answers as counting fitting devices, in half the passes over the devices.
    `largest` (per node, from `one_largest`) skips the pass over the devices altogether."""
    a = fit.a
    with_slot = None
    if largest is None:
        with_slot = static_fit(a, demand)[2] & (a.used_replicas < a.replicas)
        largest = segment_max(
            slot_free_bytes(a.capacity, a.used, with_slot), a.node_start, len(a.node_names)
        )
    good = largest[rows] >= demand.bytes_per_gpu
    bad = split_feasible(ledger, a, rows, good, out)
    if len(bad):
        # a failing node has no fitting device: n_ok is 0 there; a free replica iff largest >= 0
        explain(
            ledger,
            fit,
            demand,
            bad,
            out,
            np.zeros(len(a.node_names), np.int64),
            rows,
            (with_slot, largest),
        )


def _filter_summary(
    ledger: Ledger,
    fit: Fit,
    demand: Demand,
    rows: np.ndarray,
    out: FilterOutcome,
    ok: np.ndarray,
    need: np.ndarray,
    summary: NodeSummary,
) -> None:
    """`filter_rows` from the ledger's per-node summary (any GPU count, declared or whole
    devices): a node has k fitting devices iff its k-th largest free VRAM with a free replica
    covers the pod. Same answers and reasons, one pass over the nodes instead of the devices."""
    a = fit.a
    k = demand.gpu_count
    top = summary.top
    if k <= top.shape[1]:
        good = ok[rows] & (top[rows, k - 1] >= need[rows])
    else:
        good = np.zeros(len(rows), bool)
    bad = split_feasible(ledger, a, rows, good, out)
    if len(bad):
        n_ok = np.zeros(len(a.node_names), np.int64)
        open_ = bad[ok[bad]]  # the others fail on labels (categories 0..3), which never read n_ok
        n_ok[open_] = row_counts(top[open_] >= need[open_, None])
        n_slot = np.where(ok, summary.slots, 0)
        largest = np.where(ok, summary.largest, -1)
        explain(ledger, fit, demand, bad, out, n_ok, rows, None, (n_slot, largest))


def split_feasible(
    ledger: Ledger, a: DeviceArrays, rows: np.ndarray, good: np.ndarray, out: FilterOutcome
) -> np.ndarray:
    """Put the names of the `good` rows in `out.feasible` (remembered: prioritize will send this
    list) and return the failing rows, which the caller explains: none when some node passes and
    `out.explain_all` is off."""
    feasible_rows = rows[good]
    out.feasible = name_array(a)[feasible_rows].tolist()
    if len(out.feasible) > 1 and a.node_names is ledger.arrays.node_names:
        remember_candidates(
            ledger, out.feasible, feasible_rows, []
        )  # shared, not copied: see FilterOutcome
    failing: np.ndarray = rows[:0] if out.feasible and not out.explain_all else rows[~good]
    return failing


def filter_rows(
    ledger: Ledger, fit: Fit, demand: Demand, rows: np.ndarray, out: FilterOutcome
) -> None:
    a = fit.a
    ok_count = per_node(a, fit.ok)
    good = ok_count[rows] >= demand.gpu_count
    bad = split_feasible(ledger, a, rows, good, out)
    if len(bad):
        explain(ledger, fit, demand, bad, out, ok_count, rows)
