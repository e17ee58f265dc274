"""Preempt: the fewest lowest-priority victims whose removal lets a pod fit on each node.

Two callers: kube-scheduler's `preempt` verb (`preempt_victims`: it proposes victims per node,
found by its in-tree filters, and vramsched narrows them by VRAM) and vramsched's own preemption
(`plan_preemption`, `serve --preempt`): kube-scheduler's dry run never asks the extender, so a
pod that only VRAM keeps out (a time-sliced GPU with replicas left) finds no victims there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import combinations

from extender.demand import Demand
from extender.ledger import Ledger, Reservation
from extender.placement.choose import choose_devices
from extender.placement.fit import Fit, demand_fit, plugin_view
from extender.placement.pin_rule import unpinnable
from extender.stock_plugin import allowed_without

_MAX_COMBINATIONS = 4096
#: added to each priority before summing, as kube-scheduler does (math.MaxInt32 + 1): every term
#: is then positive, so a node with a few pods of negative priority is not preferred to one with
#: fewer pods of the same priority
_SHIFT = 1 << 31


@dataclass(frozen=True, slots=True)
class HostRoom:
    """The CPU (millicores) and memory (bytes) each node has free and each pod holds: with it,
    a preemption's victims must free the pod's cores and memory too, not its VRAM alone (a
    node short of both would otherwise be passed over, or the pod refused there)."""

    free: Mapping[str, tuple[int, int]]
    held: Callable[[Reservation], tuple[int, int]]

    def fits(self, node: str, demand: Demand, victims: Sequence[Reservation]) -> bool:
        """Whether `node` takes the pod's CPU and memory once `victims` are gone."""
        cpu, memory = self.free.get(node, (0, 0))
        for res in victims:
            c, m = self.held(res)
            cpu, memory = cpu + c, memory + m
        return demand.cpu_milli <= cpu and demand.memory_bytes <= memory


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    """Evict `victims` (all on `node`, each of lower priority than the pod); the pod then takes
    `placement`, devices the victims free, chosen as bind would choose them."""

    node: str
    victims: tuple[Reservation, ...]
    placement: Reservation


def preempt_victims(
    ledger: Ledger, demand: Demand, candidates: Mapping[str, Iterable[str]]
) -> dict[str, list[str]]:
    """For each node, the fewest lowest-priority victims (by UID) whose removal lets the pod fit.

    `candidates` maps node -> UIDs kube-scheduler proposes. Victims we hold no GPUs for are kept
    (the scheduler needed them for other resources); ours are cut to the smallest set that frees
    enough VRAM and replicas. A node proposed with no victims is a placeholder (kube-scheduler
    with kubernetes PR 135486: its in-tree dry run fits the pod with nobody gone, so only an
    extender can tell who must go): its victims are picked among the lower-priority pods of
    ours there. Nodes where even all victims would not make room are dropped, and
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
        placeholder = not uids
        if placeholder:
            # kube-scheduler's in-tree dry run fits the pod with nobody gone: the victims, if
            # any, are for vramsched to pick among the lower-priority pods it holds there
            uids = [
                u
                for u, res in held.items()
                if res.device_ids and not res.assumed and res.priority < demand.priority
            ]
        ours = sorted((held[u] for u in uids if u in held), key=_victim_order)
        others = [u for u in uids if u not in held]
        if any(res.priority >= demand.priority for res in ours):
            ours = [res for res in ours if res.priority < demand.priority]
        if _fits_without(ledger, fit, lo, hi, demand.gpu_count, ()):
            result[node] = [] if placeholder else uids  # a placeholder passes through
            continue
        best = _fewest_victims(ledger, fit, lo, hi, demand.gpu_count, ours)
        if best is None:
            continue
        result[node] = others + [res.pod.uid for res in best]
    return result


def _anything(victims: Sequence[Reservation]) -> bool:
    """No check beyond VRAM (the preempt verb, and `plan_preemption` without a `HostRoom`)."""
    return True


def _victim_order(res: Reservation) -> tuple[int, int, str]:
    """Victims are tried lowest priority first, larger holders first among equals."""
    return (res.priority, -res.total_bytes, res.key)


def _fewest_victims(
    ledger: Ledger,
    fit: Fit,
    lo: int,
    hi: int,
    k: int,
    ours: list[Reservation],
    room: Callable[[Sequence[Reservation]], bool] = _anything,
) -> list[Reservation] | None:
    """The fewest of `ours` (sorted, lowest priority first) whose removal lets the pod fit on the
    node of rows lo..hi (its VRAM, and whatever else `room` checks), the lowest priorities among
    equally few, then the least VRAM (no more evicted than needed); None when even all would
    not. Past _MAX_COMBINATIONS sets of one size, the first ones of `ours` that do."""

    def frees(victims: Sequence[Reservation]) -> bool:  # the cheap check first
        return room(victims) and _fits_without(ledger, fit, lo, hi, k, victims)

    if not ours or not frees(ours):
        return None  # not even with all of them gone, so with no fewer

    on_device = _by_device(ledger, lo, hi, ours)
    pools = [ours]
    if k == 1 and fit.shared is None and room(()):
        # The pod takes one device, booked exactly, and the cores are free already: a fewest set
        # is on one device (any pod elsewhere could stay), so sets are drawn per device. On a
        # node of 8 GPUs shared by 100 pods, that is thousands of sets fewer for each size.
        pools = [[res for res, _ in on_device[i]] for i in sorted(on_device)]
    for size in range(max(1, _at_least(fit, lo, hi, on_device, len(ours))), len(ours) + 1):
        tried = 0
        winners: list[tuple[Reservation, ...]] = []
        for combo in (c for pool in pools for c in combinations(pool, size)):
            tried += 1
            if tried > _MAX_COMBINATIONS:
                break
            if frees(combo):
                winners.append(combo)
        if winners:
            return list(
                min(
                    winners,
                    key=lambda c: (
                        max(r.priority for r in c),
                        sum(r.priority for r in c),
                        sum(r.total_bytes for r in c),
                    ),
                )
            )
        if tried > _MAX_COMBINATIONS:
            for extra in range(size, len(ours) + 1):
                if frees(ours[:extra]):
                    return list(ours[:extra])
            return None
    return None


def _by_device(
    ledger: Ledger, lo: int, hi: int, ours: Sequence[Reservation]
) -> dict[int, list[tuple[Reservation, int]]]:
    """`ours` by the device row in lo..hi each holds, with its bytes there (in their order; a pod
    of several GPUs is under each of its devices)."""
    out: dict[int, list[tuple[Reservation, int]]] = {}
    for res in ours:
        for dev_id, nbytes in zip(res.device_ids, res.bytes_per_device, strict=True):
            i = ledger.row(res.node, dev_id)
            if i is not None and lo <= i < hi:
                out.setdefault(i, []).append((res, nbytes))
    return out


def _at_least(
    fit: Fit, lo: int, hi: int, on_device: Mapping[int, list[tuple[Reservation, int]]], most: int
) -> int:
    """A lower bound on the victims any set needs (`most` + 1: none makes room): the pod needs
    at least one device of the node with its memory and a replica free, and on each device that
    takes the fewest pods holding it, the largest first. Sizes below it need not be tried (on a
    GPU shared by many small pods, every set of two is thousands of sets, all of which fail)."""
    a = fit.a
    best = most + 1
    for i in range(lo, hi):
        need = int(fit.need[i])
        if not fit.matches[i] or a.per_pod_cap[i] < need:
            continue
        freed = sorted((nbytes for _, nbytes in on_device.get(i, ())), reverse=True)
        short = need - int(a.capacity[i] - a.used[i])
        count = 0
        while short > 0 and count < len(freed):
            short -= freed[count]
            count += 1
        replicas = int(a.used_replicas[i] - a.replicas[i]) + 1  # to free for the pod's
        if short > 0 or replicas > len(freed):
            continue  # not even with every pod of ours on it gone
        best = min(best, max(count, replicas))
    return best


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


def plan_preemption(
    ledger: Ledger,
    demand: Demand,
    *,
    nodes: Sequence[str] | None = None,
    eligible: Callable[[Reservation], bool] = lambda res: True,
    host: HostRoom | None = None,
) -> PreemptionPlan | None:
    """Where to preempt for a pod that fits nowhere by VRAM: None when it fits some node of
    `nodes` (default: every node) already, or no set of victims makes room anywhere.

    Victims are reservations on one node that `eligible` accepts (the caller's: running pods
    of the API, not holds) with a priority below the pod's; per node the fewest, the lowest
    priorities among equally few (`_fewest_victims`, as the preempt verb). Nodes are ranked as
    kube-scheduler's `pickOneNodeForPreemption` ranks its candidates (PodDisruptionBudgets
    aside: the caller asks the API): the lowest highest victim priority, the lowest sum of
    priorities (each shifted by 2^31, as there), the fewest victims; then the least VRAM
    evicted and the node order.

    With `host`, the victims must also free the pod's CPU and memory on their node, and "fits
    already" means by VRAM, CPU and memory: a node with VRAM free but not cores is one more
    node to preempt on.
    """
    if not demand.wants_gpu:
        return None
    names = list(nodes) if nodes is not None else list(ledger.arrays.node_names)
    fit = demand_fit(ledger, demand)
    refused = unpinnable(ledger, demand, names)
    ranked: list[tuple[tuple[int, int, int, int, int], str, list[Reservation]]] = []
    for order, node in enumerate(names):
        r = ledger.node_row(node)
        if r is None or node in refused:
            continue
        lo, hi = int(fit.a.node_start[r]), int(fit.a.node_start[r + 1])
        room: Callable[[Sequence[Reservation]], bool] = (
            _anything if host is None else partial(host.fits, node, demand)
        )
        if _fits_without(ledger, fit, lo, hi, demand.gpu_count, ()) and room(()):
            return None  # room now: kube-scheduler's next try places it
        ours = sorted(
            (
                res
                for res in ledger.pods_on(node)
                if res.priority < demand.priority and res.device_ids and eligible(res)
            ),
            key=_victim_order,
        )
        victims = _fewest_victims(ledger, fit, lo, hi, demand.gpu_count, ours, room)
        if not victims:
            continue
        rank = (
            max(v.priority for v in victims),
            sum(v.priority + _SHIFT for v in victims),
            len(victims),
            sum(v.total_bytes for v in victims),
            order,
        )
        ranked.append((rank, node, victims))
    for _, node, victims in sorted(ranked, key=lambda c: c[0]):
        after = ledger.clone()
        for v in victims:
            after.release(v.key)
        placement = choose_devices(after, demand, node)
        if isinstance(placement, Reservation):
            return PreemptionPlan(node, tuple(victims), placement)
    return None
