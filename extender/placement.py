"""Fit, explain, score and choose: the greedy placement core shared by every adapter.

All per-node work is done on the ledger's device arrays with numpy, so one filter or
prioritize call over thousands of candidate nodes is a handful of vector operations;
Python only loops over the nodes it must explain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Iterable, Mapping, Sequence

import numpy as np

from extender.demand import Demand
from extender.inventory import MigSlice
from extender.ledger import DeviceArrays, Ledger, Reservation
from extender.quantity import format_bytes

__all__ = [
    "FilterOutcome",
    "filter_nodes",
    "score_nodes",
    "choose_devices",
    "preempt_victims",
    "MAX_SCORE",
    "device_need",
]

MAX_SCORE = 10
_BIG = np.int64(1) << np.int64(60)


@dataclass(slots=True)
class FilterOutcome:
    """Nodes that fit, nodes that fail now (`failed`: preemption may help) and nodes that never can."""

    feasible: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Fit:
    """Per-device view of one demand against the ledger (vectors over all devices)."""

    a: DeviceArrays
    matches: np.ndarray  # device has the requested resource (and allowed product)
    need: np.ndarray  # bytes the pod needs on each device
    ok: np.ndarray  # device can take the pod now

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
    return np.full(len(a.capacity), demand.bytes_per_gpu, np.int64)


def _fit(ledger: Ledger, demand: Demand) -> _Fit:
    a = ledger.arrays
    rid = a.resources.get(demand.resource, -1)
    matches = a.resource_id == rid
    if demand.allowed_products is not None:
        allowed = [pid for name, pid in a.products.items() if _product_allowed(name, demand.allowed_products)]
        matches &= np.isin(a.product_id, np.asarray(allowed, np.int32))
    need = device_need(a, demand)
    ok = matches & (a.used_replicas < a.replicas) & (a.capacity - a.used >= need) & (a.per_pod_cap >= need)
    return _Fit(a, matches, need, ok)


def _product_allowed(product: str, allowed: frozenset[str]) -> bool:
    """`NVIDIA-H100-80GB-HBM3-SHARED` is still an `NVIDIA-H100-80GB-HBM3`."""
    base = product[: -len("-SHARED")] if product.endswith("-SHARED") else product
    return base in allowed or product in allowed


def _node_rows(ledger: Ledger, names: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    rows = ledger._node_row  # noqa: SLF001 - hot path; arrays were just built by _fit
    idx = []
    unknown = []
    for n in names:
        r = rows.get(n)
        if r is None:
            unknown.append(n)
        else:
            idx.append(r)
    return np.asarray(idx, np.int64), unknown


def filter_nodes(ledger: Ledger, demand: Demand, names: Sequence[str]) -> FilterOutcome:
    """Which of `names` can take the pod now, and a short reason for every one that cannot."""
    out = FilterOutcome()
    if not demand.wants_gpu:
        out.feasible = list(names)
        return out
    fit = _fit(ledger, demand)
    a = fit.a
    n_nodes = len(a.node_names)
    rows, unknown = _node_rows(ledger, names)
    for n in unknown:
        out.unresolvable[n] = "node unknown to vramsched"
    ok_count = np.bincount(a.node_of[fit.ok], minlength=n_nodes)
    good = ok_count[rows] >= demand.gpu_count
    out.feasible = [a.node_names[r] for r in rows[good]]
    bad = rows[~good]
    if len(bad):
        _explain(ledger, fit, demand, bad, out)
    return out


def _explain(ledger: Ledger, fit: _Fit, demand: Demand, bad: np.ndarray, out: FilterOutcome) -> None:
    a = fit.a
    n_nodes = len(a.node_names)
    k = demand.gpu_count
    node_of = a.node_of
    n_match = np.bincount(node_of[fit.matches], minlength=n_nodes)
    big_enough = fit.matches & (a.per_pod_cap >= fit.need)
    n_big = np.bincount(node_of[big_enough], minlength=n_nodes)
    with_slot = big_enough & (a.used_replicas < a.replicas)
    n_slot = np.bincount(node_of[with_slot], minlength=n_nodes)
    n_ok = np.bincount(node_of[fit.ok], minlength=n_nodes)
    free = np.where(with_slot, a.capacity - a.used, -1)
    largest = _segment_max(free, a.node_start, n_nodes)
    need = demand.bytes_per_gpu
    cache: dict[tuple, str] = {}
    for r in bad.tolist():
        name = a.node_names[r]
        inv = ledger.node(name)
        if inv is not None and inv.problem:
            out.unresolvable[name] = f"not a GPU node: {inv.problem}"
            continue
        if n_match[r] == 0:
            out.unresolvable[name] = _no_resource(ledger, name, demand)
            continue
        if n_match[r] < k:
            out.unresolvable[name] = f"node has {n_match[r]} {_unit(demand)}, pod needs {k}"
            continue
        if n_big[r] < k:
            out.unresolvable[name] = _too_small(ledger, name, demand, fit)
            continue
        if n_slot[r] < k:
            key = ("slot", int(n_slot[r]), k)
            msg = cache.get(key) or cache.setdefault(key, f"all GPU replicas in use: {n_slot[r]} of {k} needed GPUs have a free replica")
            out.failed[name] = msg
            continue
        key = ("mem", need, int(largest[r]), int(n_ok[r]), k)
        msg = cache.get(key)
        if msg is None:
            want = "a whole free GPU" if need is None else f"{format_bytes(need)} free"
            if k == 1:
                msg = f"no GPU with {want}: largest free {format_bytes(int(largest[r]))}"
            else:
                msg = f"only {n_ok[r]} of {k} GPUs with {want}: largest free {format_bytes(int(largest[r]))}"
            cache[key] = msg
        out.failed[name] = msg


def _unit(demand: Demand) -> str:
    return f"{demand.mig_profile} slices" if demand.mig_profile else "GPUs"


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
    inv = ledger.node(name)
    offered = sorted({d.resource for d in inv.devices}) if inv else []
    if demand.allowed_products is not None and inv is not None and any(d.resource == demand.resource for d in inv.devices):
        return f"GPU product {inv.product} not in the pod's allowed products"
    if offered:
        return f"node offers {', '.join(offered)}, not {demand.resource}"
    return f"node has no {demand.resource}"


def _too_small(ledger: Ledger, name: str, demand: Demand, fit: _Fit) -> str:
    inv = ledger.node(name)
    need = demand.bytes_per_gpu or 0
    devices = [d for d in (inv.devices if inv else ()) if d.resource == demand.resource]
    cap = max((d.per_pod_cap_bytes for d in devices), default=0)
    if demand.mig_profile is not None and inv is not None:
        fitting = sorted(
            {(d.memory_bytes, d.profile) for d in inv.devices if isinstance(d, MigSlice) and d.memory_bytes >= need}
        )
        hint = f"; smallest profile on node that fits: {fitting[0][1]}" if fitting else "; no profile on this node fits"
        return f"model needs {format_bytes(need)} but {demand.mig_profile} has {format_bytes(cap)}{hint}"
    if devices and devices[0].sharing.value == "mps":
        return f"need {format_bytes(need)} per GPU, MPS caps each replica at {format_bytes(cap)}"
    return f"need {format_bytes(need)} per GPU, GPUs have {format_bytes(cap)}"


def score_nodes(ledger: Ledger, demand: Demand, names: Sequence[str], planned: str | None = None) -> list[tuple[str, int]]:
    """Best-fit scores 0..10 for `names`; a node that cannot take the pod scores 0.

    Bands, so that no empty GPU is opened while a partly used one fits anywhere:
    9..5 the pod lands on partly used GPUs (tighter fit scores higher), 4..2 it opens an empty
    GPU on a node already in use, 1..0 it opens an empty node. The planner's node gets 10.
    """
    if not demand.wants_gpu:
        return [(n, 0) for n in names]
    fit = _fit(ledger, demand)
    a = fit.a
    n_nodes = len(a.node_names)
    rows, _ = _node_rows(ledger, names)
    scores = np.zeros(n_nodes, np.int64)
    placed = np.zeros(n_nodes, bool)
    if len(rows):
        chosen = _choose(fit, demand.gpu_count, rows)
        if len(chosen):
            node = a.node_of[chosen]
            empty = (a.used_replicas[chosen] == 0).astype(np.int64)
            frac = np.clip(fit.leftover[chosen], 0, None) / np.maximum(a.capacity[chosen], 1)
            opened = np.bincount(node, weights=empty, minlength=n_nodes)
            taken = np.bincount(node, minlength=n_nodes)
            mean_left = np.bincount(node, weights=frac, minlength=n_nodes) / np.maximum(taken, 1)
            node_busy = np.bincount(a.node_of, weights=(a.used_replicas > 0), minlength=n_nodes) > 0
            tight = 1.0 - mean_left
            band = np.where(opened == 0, 5 + np.rint(4 * tight), np.where(node_busy, 2 + np.rint(2 * tight), np.rint(tight)))
            placed = taken >= demand.gpu_count
            scores = np.where(placed, band, 0).astype(np.int64)
    if planned is not None:
        scores = np.minimum(scores, MAX_SCORE - 1)
        r = ledger.node_row(planned)
        if r is not None and placed[r]:
            scores[r] = MAX_SCORE
    return [(a.node_names[r], int(scores[r])) for r in rows.tolist()]


def _choose(fit: _Fit, k: int, rows: np.ndarray) -> np.ndarray:
    """Device rows chosen on each node in `rows`: k best-fit devices (partly used first,
    then least leftover, then lowest index). Nodes with fewer than k fitting devices get none."""
    a = fit.a
    in_rows = np.zeros(len(a.node_names), bool)
    in_rows[rows] = True
    cand = np.flatnonzero(fit.ok & in_rows[a.node_of])
    if len(cand) == 0:
        return cand
    empty = a.used_replicas[cand] == 0
    order = np.lexsort((cand, fit.leftover[cand], empty, a.node_of[cand]))
    cand = cand[order]
    node = a.node_of[cand]
    first = np.r_[True, node[1:] != node[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(cand)), 0))
    rank = np.arange(len(cand)) - group_start
    counts = np.bincount(node, minlength=len(a.node_names))
    keep = (rank < k) & (counts[node] >= k)
    return cand[keep]


def choose_devices(ledger: Ledger, demand: Demand, node: str) -> Reservation | str:
    """The best-fit devices for the pod on `node` as a Reservation to apply, or why there are none."""
    if ledger.node(node) is None:
        return f"node {node} unknown to vramsched"
    outcome = filter_nodes(ledger, demand, [node])
    if not outcome.feasible:
        return outcome.failed.get(node) or outcome.unresolvable.get(node) or "does not fit"
    fit = _fit(ledger, demand)
    r = ledger.node_row(node)
    chosen = _choose(fit, demand.gpu_count, np.asarray([r], np.int64))
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
        ours = sorted((held[u] for u in uids if u in held), key=lambda res: (res.priority, -res.total_bytes, res.key))
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
            return list(min(winners, key=lambda c: (max(r.priority for r in c), sum(r.priority for r in c))))
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
    ok = fit.matches[lo:hi] & (used_rep < a.replicas[lo:hi]) & (a.capacity[lo:hi] - used >= need) & (a.per_pod_cap[lo:hi] >= need)
    return int(ok.sum()) >= k
