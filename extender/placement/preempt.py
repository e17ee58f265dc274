"""Preempt: the fewest lowest-priority victims whose removal lets a pod fit on each node."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations

from extender.demand import Demand
from extender.ledger import Ledger, Reservation
from extender.placement.fit import Fit, demand_fit, plugin_view
from extender.placement.pin_rule import unpinnable
from extender.stock_plugin import allowed_without

_MAX_COMBINATIONS = 4096


def preempt_victims(
    ledger: Ledger, demand: Demand, candidates: Mapping[str, Iterable[str]]
) -> dict[str, list[str]]:
    """For each node, the fewest lowest-priority victims (by UID) whose removal lets the pod fit.

    `candidates` maps node -> UIDs kube-scheduler proposes. Victims we hold no GPUs for are kept
    (the scheduler needed them for other resources); ours are cut to the smallest set that frees
    enough VRAM and replicas. Nodes where even all victims would not make room are dropped, and
    so are the nodes the pin rule refuses (`extender.placement.pin_rule`): evicting anyone there
    would free nothing the pod can use.
    """
    result: dict[str, list[str]] = {}
    fit = demand_fit(ledger, demand)
    a = fit.a
    refused = unpinnable(ledger, demand, list(candidates))
    for node, uids in candidates.items():
        uids = list(dict.fromkeys(uids))
        r = ledger.node_row(node)
        if r is None or not demand.wants_gpu or node in refused:
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
        if _fits_without(ledger, fit, lo, hi, demand.gpu_count, ()):
            result[node] = uids
            continue
        best = _fewest_victims(ledger, fit, lo, hi, demand.gpu_count, ours)
        if best is None:
            continue
        result[node] = others + [res.pod.uid for res in best]
    return result


def _fewest_victims(
    ledger: Ledger, fit: Fit, lo: int, hi: int, k: int, ours: list[Reservation]
) -> list[Reservation] | None:
    """The fewest of `ours` (sorted, lowest priority first) whose removal lets the pod fit on the
    node of rows lo..hi, the lowest priorities among equally few; None when even all would not.
    Past _MAX_COMBINATIONS sets of one size, the first ones of `ours` that do."""
    for size in range(1, len(ours) + 1):
        tried = 0
        winners: list[tuple[Reservation, ...]] = []
        for combo in combinations(ours, size):
            tried += 1
            if tried > _MAX_COMBINATIONS:
                break
            if _fits_without(ledger, fit, lo, hi, k, combo):
                winners.append(combo)
        if winners:
            return list(
                min(winners, key=lambda c: (max(r.priority for r in c), sum(r.priority for r in c)))
            )
        if tried > _MAX_COMBINATIONS:
            for extra in range(size, len(ours) + 1):
                if _fits_without(ledger, fit, lo, hi, k, ours[:extra]):
                    return list(ours[:extra])
            return None
    return None


def _fits_without(
    ledger: Ledger, fit: Fit, lo: int, hi: int, k: int, victims: Sequence[Reservation]
) -> bool:
    """Whether `k` devices of the node of rows lo..hi take the pod once `victims` are gone."""
    a = fit.a
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
            & allowed_without(ledger, plugin_view(ledger), lo, hi, victims, fit.need, k)
        )
    return int(ok.sum()) >= k
