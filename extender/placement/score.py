"""Prioritize's scores 0..10: least stranded memory, then best fit, kept per demand shape for
every node and patched on the nodes the ledger's log says changed."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from extender.arrays import DeviceArrays, run_ranks
from extender.demand import Demand
from extender.ledger import Ledger
from extender.placement.cache import KeptScores, ShapeCache, cache_of
from extender.placement.choose import best_fit_devices, stranded
from extender.placement.fit import Fit, demand_fit, node_ok, plugin_view
from extender.placement.views import (
    candidate_rows,
    node_capacity,
    node_kinds,
    nodes_arrays,
    resource_arrays,
    row_counts,
)
from extender.quantity import MIB
from extender.stock_plugin import bounds_resource

MAX_SCORE = 10

#: The kept tables hold an order key per node beside the answer: the one node at 10 is the
#: highest key, and the answer's bands are read off the keys (`_answer`). The key of a
#: placement is `_CLEAN + band - (MiB stranded << 4)` (`choose.stranded`, rounded up to the
#: MiB): one that strands nothing above every one that does, and among those, less stranded
#: above more, then the band. Bands are best fit's, 0..9: 9..5 the pod lands on partly used
#: GPUs (tighter scores higher), 4..2 it opens an empty GPU on a node in use, 1..0 it opens an
#: idle node. The key stays positive below 64 TiB stranded by one placement (int32 tables).
#: The answer is the band of a placement that strands nothing and 0 for one that does: the
#: bands kube-scheduler sees for clean placements are the best-fit bands they always were.
_CLEAN = 1 << 30


#: a kept score table is patched when at most 1 node in this many changed since, else redone.
#: From the summaries a patch is a vector pass over the changed rows; device by device under a
#: replica policy (5,000 nodes, the resource's rows only, devices not looked up) it costs
#: ~0.13 ms + ~0.35 us per node against 0.55-1.0 ms for a redo (measured 30 Nov; it was ~3 us
#: per node against ~1.5 ms, and 1 in 12, before)
_PATCH_SHARE = 4


def score_nodes(
    ledger: Ledger, demand: Demand, names: Sequence[str], planned: str | None = None
) -> list[tuple[str, int]]:
    """Scores 0..10 for `names`; a node that cannot take the pod scores 0.

    A placement is charged for the memory nobody else can use after it (`choose.stranded`: the
    rest of an exclusive GPU or MIG slice, a time-sliced GPU's memory behind its last replica,
    the rest of an MPS client's share). Bands, so that no empty GPU is opened while a partly
    used one fits without stranding more: 9..5 the pod lands on partly used GPUs (tighter fit
    scores higher), 4..2 it opens an empty GPU on a node already in use, 1..0 it opens an idle
    node, all without stranding anything; 0 it strands memory. One node gets 10, the one
    vramsched would choose: the planner's node, else the first node with the highest order key
    (`_CLEAN`): a placement that strands nothing before any that does, the one that strands
    least among those, then the band (`_finish_scores`).
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
            keys, placed, answers = fast
            return _finish_scores(
                ledger, view, rows, keys, placed, planned, single_top, avoid, answers
            )
    static = resource_arrays(
        ledger, demand, used=False, under_policy=True
    )  # this resource's devices, or every device
    rows, _ = candidate_rows(ledger, names)
    if static is None or rid is None:
        a, at = ledger.arrays, None
    else:  # the view's rows among every device's
        a, at = static, ledger.arrays.rows_of(rid)
    keys, placed, answers = _device_scores_kept(ledger, demand, a, static is None, at)
    return _finish_scores(ledger, a, rows, keys, placed, planned, single_top, avoid, answers)


def _device_scores_kept(
    ledger: Ledger,
    demand: Demand,
    a: DeviceArrays,
    full: bool,
    at: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_device_scores` of every node of `a` and their answers, kept per demand shape
    (`_kept_scores`): a node's score reads only its own devices and, under a replica policy,
    the bound on them, which changes only when the node does. Read-only for callers. `full`:
    `a` is every device (the bound applies). `at`: `a` is the demand's resource view
    (`used=False`), these rows of every device; its used columns are read from the ledger (for
    a patch, at the changed nodes' rows only), and under a policy the bound applies to them."""
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (order keys, placed, answers) table over every node of `a`, kept per demand shape
    (`key`, in `kept`, a cache of `a`) and patched on the nodes the ledger's log says changed
    since it was last read: `some(nodes)` gives (the rows among them whose entries may change,
    their keys, placed). Redone with `every()` when the log no longer reaches back that far, or
    when more than 1 node in `_PATCH_SHARE` changed (then one pass over all of them is cheaper)."""
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
                entry.answers[rows] = _answer(entry.scores[rows])
            entry.position = now
    if entry is None:
        scores, placed = every()
        scores = scores.astype(np.int32, copy=False)
        entry = cache[key] = KeptScores(now, scores, placed, _answer(scores))
    return entry.scores, entry.placed, entry.answers


def _keys(band: np.ndarray, lost: np.ndarray) -> np.ndarray:
    """Order keys (see `_CLEAN`) from best fit's bands and the bytes stranded."""
    keys: np.ndarray = _CLEAN + band - (((lost + (MIB - 1)) >> 20) << 4)
    return keys


def _band(all_busy: np.ndarray, node_busy: np.ndarray, tight: np.ndarray) -> np.ndarray:
    """Best fit's band 0..9: 9..5 on partly used GPUs only, 4..2 an empty GPU on a node in use,
    1..0 an idle node; tighter higher within each."""
    band: np.ndarray = np.where(
        all_busy,
        5 + np.rint(4 * tight),
        np.where(node_busy, 2 + np.rint(2 * tight), np.rint(tight)),
    )  # whole numbers as float64: exact in the keys, cast once where they are kept
    return band


def _answer(keys: np.ndarray) -> np.ndarray:
    """The 0..9 answer of order keys: a clean placement's band, 0 for one that strands memory
    and where the pod does not fit."""
    out: np.ndarray = np.maximum(keys - _CLEAN, 0).astype(np.int8)  # any other key is below
    return out


def _device_scores(
    fit: Fit, k: int, rows: np.ndarray, node_busy: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(order keys, placed) per node of `fit.a`, for the nodes `rows` (0 and False elsewhere),
    device by device: the k devices `best_fit_devices` takes, the memory they strand and how
    tightly they fit. `node_busy`: per node of `fit.a`, whether any pod runs there."""
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
            band = _band(opened == 0, node_busy, 1.0 - mean_left)
            # exact: whole bytes summed as float64 stay exact below 2**53
            lost = np.rint(
                np.bincount(node, weights=stranded(fit, chosen), minlength=n_nodes)
            ).astype(np.int64)
            placed = taken >= k
            scores = np.where(placed, _keys(band, lost), 0).astype(np.int64)
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
    answers: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The answer (`_answer` of the order keys `scores`, or the kept `answers` of them) and one
    node at 10: the planner's node when the pod still fits there and it is among `rows`, else
    the first node (in the ledger's order) with the highest key among `rows`.

    Why one node: kube-scheduler picks at random among the nodes with the top total score, so a
    band shared by many nodes would spread pods over them; on the Alibaba trace filled to 1.3x
    that random pick allocated 5,032-5,211 GPUs of memory against 5,670-5,786 for this one
    choice (benchmarks/kube_scoring.py, docs/packing.md). `scores` and `answers` are kept
    tables (read-only): the answer is a new array."""
    keys = scores[rows]
    out = _answer(keys) if answers is None else answers[rows]  # a copy (rows is an index array)
    r = ledger.node_row(planned) if planned is not None else None
    top = rows == r if r is not None and placed[r] else None
    if (
        top is None or not top.any()
    ) and single_top:  # no plan, or its node no longer fits or was not asked about
        skip = [i for i in map(ledger.node_row, avoid) if i is not None] if avoid else ()
        top = _first_best(rows, keys, skip)
    if top is not None:
        out[top] = MAX_SCORE
    return node_kinds(ledger, a)[0], rows, out


def _first_best(rows: np.ndarray, keys: np.ndarray, skip: Sequence[int] = ()) -> np.ndarray | None:
    """Where in `rows` (a mask: a node asked twice is there twice) the lowest row with the
    highest of the order `keys` is, or None when the pod fits none (key 0: every placement's
    key is positive); a row of `skip` only when every row with that key is in it. `keys` is
    per entry of `rows`."""
    if not len(rows):
        return None
    top = keys.max()
    if top <= 0:
        return None
    best = keys == top
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`score_rows` from the ledger's per-node summary: (order keys, placed, answers) per node of
    `a`, valid for the asked `rows` (read-only), or None when the summary cannot stand for the
    devices.

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
        scores, placed = np.zeros(len(ok), np.int32), np.zeros(len(ok), bool)
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
    """(order key, placed) of the nodes `r` (sorted, each once, all passing `node_ok`), from the
    summary: best fit takes the devices already in use with the least free VRAM that covers the
    pod, then empty ones likewise; with one size of device per node that is all the score
    depends on, and the fractions are summed in the same order as the per-device path sums
    them. Each chosen device is one flat gather (`take` and flat indices cost half of 2-D
    fancy indexing). Nodes where some fitting device would strand memory (its sole share,
    `arrays.sole_share`, exceeds the pod's bytes) are worked out again in `_least_stranding`,
    the per-device path's order; a whole device strands nothing (it takes all of its share)."""
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
    flat_busy, flat_idle = busy.ravel(), idle.ravel()
    cap = np.maximum(capacity[r], 1)
    if k == 1:  # most pods: one device, no running sums
        on_busy = n_busy > 0
        free = np.where(
            on_busy,
            flat_busy[base + np.maximum(n_busy - 1, 0)],
            flat_idle[base + np.maximum(n_idle - 1, 0)],
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
                flat_busy[base + np.minimum(np.maximum(n_busy - 1 - j, 0), top)],
                flat_idle[base + np.minimum(np.maximum(n_idle - 1 - (j - n_busy), 0), top)],
            )
            left += np.maximum(free - need, 0) / cap
            opened += ~on_busy
        all_busy = opened == 0
    node_busy = ledger.arrays.node_used_replicas[r] > 0  # any pod, whatever resource it holds
    band = _band(all_busy, node_busy, 1.0 - left / k)
    if demand.bytes_per_gpu is None:  # a whole device takes all of its share: strands nothing
        return np.where(fits, _CLEAN + band, 0), fits
    n = demand.bytes_per_gpu
    # Every device that fits would strand as much as any other (all the node's sole shares are
    # equal, or none exceeds the pod) on most nodes: best fit's choice stands, each device
    # strands max(0, sole - n). The others are worked out device by device.
    high = summary.sole_high.take(r)
    over = high - n
    np.maximum(over, 0, out=over)
    lost = over if k == 1 else k * over
    g = np.flatnonzero(fits & (summary.sole_mixed.take(r) > n))
    if len(g):
        rg = r[g]
        left_g, opened_g, lost[g] = _least_stranding(
            busy[g],
            summary.busy_sole.take(rg, axis=0),
            idle[g],
            summary.idle_sole.take(rg, axis=0),
            n,
            cap[g],
            k,
        )
        band[g] = _band(opened_g == 0, node_busy[g], 1.0 - left_g / k)
    return np.where(fits, _keys(band, lost), 0), fits


#: up to this many rows, `_least_stranding` works row by row in Python: numpy's per-call cost
#: dominates on a few rows (most calls: the nodes where devices strand unequal amounts are few)
_FEW_ROWS = 8


def _least_stranding(
    busy: np.ndarray,
    busy_sole: np.ndarray,
    idle: np.ndarray,
    idle_sole: np.ndarray,
    need: int,
    cap: np.ndarray,
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of the summary's (rows, width) lists (each row has k devices that fit): (sum of
    the leftover fractions, devices opened, bytes stranded) of the k devices `best_fit_devices`
    takes: least stranded first, then partly used, then least free; summed in that order. Only
    nodes whose devices would strand unequal amounts get here: usually a few (row by row in
    Python), else one sort of their entries."""
    if len(busy) <= _FEW_ROWS:
        return _least_stranding_rows(busy, busy_sole, idle, idle_sole, need, cap, k)
    g, w = busy.shape
    both = np.concatenate((busy, idle), axis=1)
    at = np.flatnonzero(both >= need)
    free = both.ravel()[at]
    sole = np.concatenate((busy_sole, idle_sole), axis=1).ravel()[at]
    row, col = np.divmod(at, 2 * w)
    opens = col >= w  # the idle entries
    strand = np.maximum(sole - need, 0)
    order = np.lexsort((free, opens, strand, row))
    taken = order[run_ranks(row[order]) < k]
    row = row[taken]
    left = np.bincount(row, weights=np.maximum(free[taken] - need, 0) / cap[row], minlength=g)
    opened = np.bincount(row, weights=opens[taken], minlength=g)
    lost = np.rint(np.bincount(row, weights=strand[taken], minlength=g)).astype(np.int64)
    return left, opened, lost


def _least_stranding_rows(
    busy: np.ndarray,
    busy_sole: np.ndarray,
    idle: np.ndarray,
    idle_sole: np.ndarray,
    need: int,
    cap: np.ndarray,
    k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_least_stranding` row by row in plain Python: the same order and the same sums (whole
    bytes below 2**53: each fraction is the correctly rounded quotient either way)."""
    left, opened, lost = [], [], []
    for free_b, sole_b, free_i, sole_i, c in zip(
        busy.tolist(), busy_sole.tolist(), idle.tolist(), idle_sole.tolist(), cap.tolist()
    ):
        chosen = sorted(
            [(max(s - need, 0), 0, f) for f, s in zip(free_b, sole_b) if f >= need]
            + [(max(s - need, 0), 1, f) for f, s in zip(free_i, sole_i) if f >= need]
        )[:k]
        fraction = 0.0
        for _, _, f in chosen:
            fraction += max(f - need, 0) / c
        left.append(fraction)
        opened.append(sum(e[1] for e in chosen))
        lost.append(sum(e[0] for e in chosen))
    return np.asarray(left), np.asarray(opened), np.asarray(lost, np.int64)
