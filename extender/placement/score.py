"""Prioritize's best-fit scores 0..10, kept per demand shape for every node and patched on the
nodes the ledger's log says changed."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from extender.arrays import DeviceArrays
from extender.demand import Demand
from extender.ledger import Ledger
from extender.placement.cache import KeptScores, ShapeCache, cache_of
from extender.placement.choose import best_fit_devices
from extender.placement.fit import Fit, demand_fit, node_ok, plugin_view
from extender.placement.views import (
    candidate_rows,
    node_capacity,
    node_kinds,
    nodes_arrays,
    resource_arrays,
    row_counts,
)
from extender.stock_plugin import bounds_resource

MAX_SCORE = 10


#: a kept score table is patched when at most 1 node in this many changed since, else redone.
#: From the summaries a patch is a vector pass over the changed rows; device by device under a
#: replica policy (5,000 nodes, the resource's rows only, devices not looked up) it costs
#: ~0.13 ms + ~0.35 us per node against 0.55-1.0 ms for a redo (measured 30 Nov; it was ~3 us
#: per node against ~1.5 ms, and 1 in 12, before)
_PATCH_SHARE = 4


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
    exact = ledger.replica_policy is None or (
        rid is not None and not bounds_resource(plugin_view(ledger), rid)
    )
    view = resource_arrays(ledger, demand, used=False, under_policy=True) if exact else None
    if view is not None:
        rows, _ = candidate_rows(ledger, names)
        fast = _score_summary(ledger, demand, rows, view)
        if fast is not None:
            return _finish_scores(ledger, view, rows, *fast, planned, single_top, avoid)
    static = resource_arrays(
        ledger, demand, used=False, under_policy=True
    )  # this resource's devices, or every device
    rows, _ = candidate_rows(ledger, names)
    if static is None or rid is None:
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
    )
    bounded = at is not None and ledger.replica_policy is not None

    def every() -> tuple[np.ndarray, np.ndarray]:
        node_busy = ledger.arrays.node_used_replicas > 0  # any pod, whatever resource it holds
        current = (
            None
            if full
            else a
            if at is None
            else resource_arrays(ledger, demand, under_policy=True)
        )
        fit = demand_fit(ledger, demand, current, bounded=bounded)
        return _device_scores(fit, demand.gpu_count, np.arange(len(a.node_names)), node_busy)

    def some(nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sub, ix = nodes_arrays(a, nodes)
        if at is not None:
            ix = at[ix]
            sub.used, sub.used_replicas = ledger.arrays.used[ix], ledger.arrays.used_replicas[ix]
        fit = demand_fit(ledger, demand, sub, node_rows=ix if full or bounded else None)
        return nodes, *_device_scores(
            fit,
            demand.gpu_count,
            np.arange(len(nodes)),
            ledger.arrays.node_used_replicas[nodes] > 0,
        )

    return _kept_scores(ledger, a, cache_of(a).device_scores, key, every, some)


def _kept_scores(
    ledger: Ledger,
    a: DeviceArrays,
    kept: ShapeCache[tuple[object, ...], KeptScores],
    key: tuple[object, ...],
    every: Callable[[], tuple[np.ndarray, np.ndarray]],
    some: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """A (scores, placed) table over every node of `a`, kept per demand shape (`key`, in `kept`,
    a cache of `a`) and patched on the nodes the ledger's log says changed since it was last read:
    `some(nodes)` gives (the rows among them whose entries may change, their scores, placed).
    Redone with `every()` when the log no longer reaches back that far, or when more than 1
    node in `_PATCH_SHARE` changed (then one pass over all of them is cheaper)."""
    cache = kept.room()
    entry = cache.get(key)
    now = ledger.position
    if entry is not None:
        # rows of these very arrays (a rebuild drops the cache)
        nodes = ledger.touched_rows_since(entry.position)
        if nodes is None or len(nodes) * _PATCH_SHARE > len(a.node_names):
            entry = None
        else:
            if len(nodes):
                rows, entry.scores[rows], entry.placed[rows] = some(nodes)
            entry.position = now
    if entry is None:
        scores, placed = every()
        entry = cache[key] = KeptScores(now, scores.astype(np.int8), placed)
    return entry.scores, entry.placed


def _device_scores(
    fit: Fit, k: int, rows: np.ndarray, node_busy: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, placed) per node of `fit.a`, for the nodes `rows` (0 and False elsewhere), device
    by device: the k best-fit devices (`best_fit_devices`) and how tightly they fit. `node_busy`: per
    node of `fit.a`, whether any pod runs there."""
    a = fit.a
    n_nodes = len(a.node_names)
    scores = np.zeros(n_nodes, np.int64)
    placed = np.zeros(n_nodes, bool)
    if len(rows):
        chosen = best_fit_devices(fit, k, rows)
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
    return node_kinds(ledger, a)[0], rows, out


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
    top_rows: np.ndarray = rows == rows[best].min()
    return top_rows


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
    hit = node_ok(a, demand)
    capacity = node_capacity(a)
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
    return _kept_scores(ledger, a, cache_of(a).scores, key, every, some)


def _summary_scores(
    ledger: Ledger,
    demand: Demand,
    a: DeviceArrays,
    node_need: np.ndarray,
    capacity: np.ndarray,
    r: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(score, placed) of the nodes `r` (sorted, each once, all passing `node_ok`), from the
    summary: best fit takes the devices already in use with the least free VRAM that covers the
    pod, then empty ones likewise; with one size of device per node that is all the score
    depends on, and the fractions are summed in the same order as the per-device path sums
    them. Each chosen device is one flat gather (`take` and flat indices cost half of 2-D
    fancy indexing)."""
    k = demand.gpu_count
    summary = ledger.summary(int(a.resource_id[0]))
    need: np.ndarray | int
    covers: np.ndarray | int
    if demand.bytes_per_gpu is None:  # a whole device: its cap
        caps = node_need[r]
        need, covers = caps, caps[:, None]
    else:
        need = covers = demand.bytes_per_gpu
    busy, idle = (
        summary.busy.take(r, axis=0),
        summary.idle.take(r, axis=0),
    )  # sorted largest first: the fitting ones lead
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
