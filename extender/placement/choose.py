"""Choose: the devices on a node that strand the least memory, then best fit (partly used first,
then least leftover), for bind and for prioritize's scores."""

from __future__ import annotations

from math import ceil, log2

import numpy as np

from extender.arrays import first_k_per_node, run_starts, sole_share
from extender.demand import Demand
from extender.ledger import Ledger, Reservation
from extender.placement.cache import cache_of
from extender.placement.filter import filter_rows
from extender.placement.fit import Fit, fit_on_node, product_allowed
from extender.placement.outcome import FilterOutcome


def stranded(fit: Fit, rows: np.ndarray) -> np.ndarray:
    """Bytes a pod placed on each of the device rows `rows` makes unusable for any other pod:
    `max(0, sole share - need)` (`sole_share`): the rest of an exclusive GPU or MIG slice, of a
    time-sliced GPU whose last replica it takes, of its own share of an MPS GPU."""
    a = fit.a
    sole = sole_share(
        a.capacity[rows], a.used[rows], a.per_pod_cap[rows], a.replicas[rows], a.used_replicas[rows]
    )
    out: np.ndarray = np.maximum(sole - fit.need[rows], 0)
    return out


def best_fit_devices(fit: Fit, k: int, rows: np.ndarray) -> np.ndarray:
    """Device rows chosen on each node in `rows`: the k devices that strand the least memory
    (`stranded`), then best fit (partly used first, then least leftover), then lowest index.
    Nodes with fewer than k fitting devices get none. Where the device plugin spreads replicas
    (`fit.shared.distributed`) the order is the plugin's, least used first: the books must show
    the GPU it will pick."""
    a = fit.a
    if len(rows) == 1:  # one node: its rows are a slice, no mask over every device
        lo, hi = int(a.node_start[rows[0]]), int(a.node_start[rows[0] + 1])
        cand = lo + np.flatnonzero(fit.ok[lo:hi])
    else:
        in_rows = np.zeros(len(a.node_names), bool)
        in_rows[rows] = True
        cache = cache_of(a)
        sizes = cache.sizes
        if sizes is None:
            sizes = cache.sizes = np.diff(a.node_start)
        cand = np.flatnonzero(fit.ok & np.repeat(in_rows, sizes))
    if len(cand) == 0:
        return cand
    chosen: np.ndarray
    empty = (a.used_replicas[cand] == 0).astype(np.int64)
    leftover = a.capacity[cand] - a.used[cand] - fit.need[cand]
    strand = stranded(fit, cand)
    if fit.shared is not None:
        # The plugin spreads these replicas: book each on a least-used GPU, as it will count it
        # (it picks the GPU, so what is stranded there is not vramsched's choice).
        spread = fit.shared.distributed[cand]
        empty = np.where(spread, a.used_replicas[cand], empty)
        strand = np.where(spread, 0, strand)
    node = a.node_of[cand]
    if strand.any():
        if k != 1:
            order = np.lexsort((np.arange(len(cand)), leftover, empty, strand, node))
            cand = cand[order]
            chosen = cand[first_k_per_node(a.node_of[cand], k, len(a.node_names))]
            return chosen
        # one device: only those that strand the least on their node compete on best fit
        starts = np.flatnonzero(run_starts(node))
        least = np.minimum.reduceat(strand, starts)
        keep = strand == np.repeat(least, np.diff(np.append(starts, len(cand))))
        cand, empty, leftover, node = cand[keep], empty[keep], leftover[keep], node[keep]
    if k == 1:
        best = _first_best_per_node(node, empty, leftover)
        if best is not None:
            chosen = cand[best]
            return chosen
    cand = cand[_best_fit_order(node, empty, leftover)]
    chosen = cand[first_k_per_node(a.node_of[cand], k, len(a.node_names))]
    return chosen


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
    first: np.ndarray = hit[run_starts(node[hit])]
    return first


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


def choose_devices(ledger: Ledger, demand: Demand, node: str) -> Reservation | str:
    """The best-fit devices for the pod on `node` as a Reservation to apply, or why there are none.

    Works on that node's rows only (the device plugin's node-level bound too), so a bind costs
    the same in a 10-node and a 10,000-node cluster.
    """
    r = ledger.node_row(node)
    if r is None:
        return f"node {node} unknown to vramsched"
    if ledger.replica_policy is None and demand.wants_gpu:
        quick = _choose_on_node(ledger, demand, node, r)
        if quick is not None:
            return quick
    fit, rows = fit_on_node(ledger, demand, r), np.zeros(1, np.int64)
    outcome = FilterOutcome()
    if not demand.wants_gpu:
        outcome.feasible = [node]
    else:
        filter_rows(ledger, fit, demand, rows, outcome)
    if not outcome.feasible:
        return outcome.failed.get(node) or outcome.unresolvable.get(node) or "does not fit"
    chosen = best_fit_devices(fit, demand.gpu_count, rows)
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
    per-call cost dominates on 8 rows): the same fit test (`static_fit`, `demand_fit`) and the same
    order (`best_fit_devices`: least stranded, then partly used first, then least leftover, then
    device order). None when the pod does not fit there: the vector path then words the reason."""
    a = ledger.arrays
    lo, hi = int(a.node_start[r]), int(a.node_start[r + 1])
    rid = a.resources.get(demand.resource, -1)
    allowed = None
    if demand.allowed_products is not None:
        allowed = {
            pid
            for name, pid in a.products.items()
            if product_allowed(name, demand.allowed_products)
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
        sole = min(cap - used - (reps - used_reps - 1) * per_pod, per_pod)  # `sole_share`
        cand.append((max(sole - need, 0), int(used_reps == 0), cap - used - need, j, need))
    if len(cand) < demand.gpu_count:
        return None
    chosen = sorted(cand)[: demand.gpu_count]
    chosen.sort(key=lambda c: c[3])
    return Reservation(
        pod=demand.pod,
        node=node,
        device_ids=tuple(a.devices[lo + c[3]].device_id for c in chosen),
        bytes_per_device=tuple(c[4] for c in chosen),
        priority=demand.priority,
        declared=declared is not None,
    )


def books_demand(ledger: Ledger, demand: Demand, res: Reservation) -> bool:
    """Whether `res`, chosen earlier (a plan, a hold, the inline rule's pick at prioritize), is
    what bind books for `demand` now: the same pod (UID), as many distinct devices of the pod's
    resource and GPU models, each with the bytes the pod takes there. A choice made for an
    earlier version of the pod, whose `model-memory` was edited since or which was re-created
    under its name, is not: booked as it is, it would hold less VRAM than the pod uses."""
    if res.pod != demand.pod or len(set(res.device_ids)) != demand.gpu_count:
        return False
    if len(res.bytes_per_device) != len(res.device_ids):
        return False
    r = ledger.node_row(res.node)
    if r is None or not demand.wants_gpu:
        return False
    fit = fit_on_node(ledger, demand, r)
    lo, hi = int(ledger.arrays.node_start[r]), int(ledger.arrays.node_start[r + 1])
    for dev, nbytes in zip(res.device_ids, res.bytes_per_device):
        i = ledger.row(res.node, dev)
        if i is None or not lo <= i < hi:
            return False
        if not fit.matches[i - lo] or int(fit.need[i - lo]) != nbytes:
            return False
    return True


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
    shared = fit_on_node(ledger, demand, r).shared
    if shared is None:
        return True
    lo, hi = int(ledger.arrays.node_start[r]), int(ledger.arrays.node_start[r + 1])
    rows = [ledger.row(res.node, dev) for dev in res.device_ids]
    return all(i is not None and lo <= i < hi and bool(shared.allowed[i - lo]) for i in rows)
