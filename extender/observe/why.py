"""Why a pod waits: filter's answer for it now, node by node, and what would make it fit.

`explain` runs the same `filter_nodes` the extender answers kube-scheduler with, over every node
vramsched knows, with every refusal explained; groups the nodes by reason (the text of the
pod's FailedScheduling event); finds the closest node, the one that misses by the least VRAM;
and works out the fewest pods whose removal lets the pod fit there (on a copy of the ledger,
through `choose_devices`, so the device plugin's bound counts as it does at bind), or, for a MIG
pod, the smallest profile that would hold it. Pure: reads the ledger, never changes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from extender import mig
from extender.demand import Demand, DemandError, pod_demand, pod_ref
from extender.inventory import MigSlice, NodeInventory
from extender.ledger import Ledger, Reservation
from extender.observe.pending import reason_kind
from extender.observe.usage import PodShare, declared_memory
from extender.placement import choose_devices, filter_nodes
from extender.quantity import format_bytes

__all__ = [
    "Explanation",
    "Closest",
    "MigHint",
    "explain",
    "event_text",
    "explanation_dict",
    "describe_closest",
]

#: subsets of a node's pods tried for the fewest removals (a node holds a few dozen at most)
MAX_TRIES = 4096
#: nodes, closest first, whose removals are worked out (the first that any removal fixes wins)
CLOSEST_TRIED = 8


@dataclass(frozen=True, slots=True)
class Closest:
    """The node that misses by the least VRAM, and what would make the pod fit there."""

    node: str
    reason: str
    short_bytes: int  # VRAM missing on its best devices for the pod (0: the plugin's bound)
    remove: tuple[PodShare, ...] | None  # fewest pods to remove (None: no removal helps)
    preemptible: bool  # every one of them has a lower priority than the pod


@dataclass(frozen=True, slots=True)
class MigHint:
    """For a MIG pod: the smallest profile that holds it, and where slices of it are free."""

    profile: str
    resource: str
    memory: int
    free_slices: int
    nodes: tuple[str, ...]
    #: no node has slices of it: GPUs of these models can be repartitioned (`vramsched plan-mig`)
    reconfigure: tuple[str, ...] = ()


@dataclass(slots=True)
class Explanation:
    pod: str
    demand: str = ""
    error: str | None = None
    bound_to: str | None = None
    #: the devices the ledger holds a bound pod on (a pod whose demand cannot be read is still
    #: counted, on whole devices: this says where)
    held: list[str] = field(default_factory=list)
    #: the pod's scheduling gates: kube-scheduler does not try it until they are removed
    gates: list[str] = field(default_factory=list)
    nodes: int = 0
    feasible: list[str] = field(default_factory=list)
    #: reason -> nodes, most nodes first; `unresolvable` marks reasons no eviction can change
    groups: list[tuple[str, list[str], bool]] = field(default_factory=list)
    closest: Closest | None = None
    mig: MigHint | None = None


def explain(
    ledger: Ledger,
    pod: Mapping[str, Any],
    *,
    pods: Mapping[str, Mapping[str, Any]] | None = None,
    headroom: float = 0.0,
) -> Explanation:
    """What filter says of `pod` on every node of `ledger` now, and what would change it."""
    try:
        key = pod_ref(pod).key
    except DemandError as exc:
        return Explanation(pod="?", error=str(exc))
    out = Explanation(pod=key)
    spec = pod.get("spec") or {}
    bound = spec.get("nodeName")
    if bound:
        out.bound_to = str(bound)
        reservation = ledger.reservation(key)
        if reservation is not None:
            out.held = list(reservation.device_ids)
    gates = spec.get("schedulingGates")
    if isinstance(gates, list):
        out.gates = [str(g.get("name")) for g in gates if isinstance(g, Mapping)]
    try:
        demand = pod_demand(pod, headroom=headroom)
    except DemandError as exc:
        out.error = str(exc)
        return out
    out.demand = demand.describe()
    names = [inv.name for inv in ledger.nodes()]
    out.nodes = len(names)
    outcome = filter_nodes(ledger, demand, names, explain_all=True)
    out.feasible = list(outcome.feasible)
    by_reason: dict[tuple[str, bool], list[str]] = {}
    for node, reason in outcome.failed.items():
        by_reason.setdefault((reason, False), []).append(node)
    for node, reason in outcome.unresolvable.items():
        by_reason.setdefault((reason, True), []).append(node)
    out.groups = sorted(
        ((r, sorted(ns), u) for (r, u), ns in by_reason.items()), key=lambda g: (-len(g[1]), g[0])
    )
    if not demand.wants_gpu or out.feasible:
        return out
    out.closest = _closest(ledger, demand, outcome.failed, pods or {})
    if demand.mig_profile is not None:
        out.mig = _mig_hint(ledger, demand)
    return out


def event_text(e: Explanation) -> str:
    """vramsched's part of the pod's FailedScheduling event, worded as kube-scheduler words it
    ("0/N nodes are available: <count> <reason>, ..." sorted as strings). kube-scheduler adds its
    own plugins' reasons (taints, CPU) for the nodes it filtered out before asking vramsched."""
    if e.feasible or e.error:
        return ""
    parts = sorted(f"{len(nodes)} {reason}" for reason, nodes, _ in e.groups)
    return f"0/{e.nodes} nodes are available: {', '.join(parts)}."


# ----- the closest node -----------------------------------------------------------------------------


def _allowed(product: str, allowed: frozenset[str] | None) -> bool:
    if allowed is None:
        return True
    return product.removesuffix("-SHARED") in allowed or product in allowed


def _shortfall(ledger: Ledger, inv: NodeInventory, demand: Demand) -> int:
    """VRAM missing for the pod on the node's best `gpu_count` devices that could ever hold it (a
    device with no free replica misses all it needs)."""
    a = ledger.arrays
    shorts = []
    for d in inv.devices:
        need = d.per_pod_cap_bytes if demand.bytes_per_gpu is None else demand.bytes_per_gpu
        if d.resource != demand.resource or d.per_pod_cap_bytes < need:
            continue
        if not _allowed(d.product, demand.allowed_products):
            continue
        i = ledger.row(inv.name, d.device_id)
        if i is None:
            continue
        if int(a.used_replicas[i]) >= int(a.replicas[i]):
            shorts.append(need)
        else:
            shorts.append(max(0, need - int(a.capacity[i] - a.used[i])))
    shorts.sort()
    return sum(shorts[: demand.gpu_count]) if len(shorts) >= demand.gpu_count else -1


def _closest(
    ledger: Ledger,
    demand: Demand,
    failed: Mapping[str, str],
    pods: Mapping[str, Mapping[str, Any]],
) -> Closest | None:
    ranked = []
    for node, reason in failed.items():
        inv = ledger.node(node)
        short = _shortfall(ledger, inv, demand) if inv is not None else -1
        if short >= 0:
            ranked.append((short, reason_kind(reason) != "vram", node, reason))
    if not ranked:
        return None
    ranked.sort()
    copy = ledger.clone()
    first = None
    for short, _, node, reason in ranked[:CLOSEST_TRIED]:
        remove = _fewest_removals(copy, demand, node)
        found = Closest(
            node=node,
            reason=reason,
            short_bytes=short,
            remove=None if remove is None else tuple(_share(r, node, pods) for r in remove),
            preemptible=remove is not None and all(r.priority < demand.priority for r in remove),
        )
        if remove is not None:
            return found
        first = first or found
    return first


def _share(res: Reservation, node: str, pods: Mapping[str, Mapping[str, Any]]) -> PodShare:
    return PodShare(res.key, res.total_bytes, declared_memory(pods.get(res.key)))


def _fewest_removals(ledger: Ledger, demand: Demand, node: str) -> list[Reservation] | None:
    """The fewest pods on `node` whose removal lets the pod fit (lowest priorities, then least
    VRAM, among those); None when even all of them would not do. `ledger` is a private copy:
    each trial releases the pods and records them back."""
    held = sorted(ledger.pods_on(node), key=lambda r: (r.priority, r.total_bytes, r.key))
    tries = 0
    for size in range(1, len(held) + 1):
        winners = []
        for combo in combinations(held, size):
            tries += 1
            if tries > MAX_TRIES:
                return None
            if _fits_without(ledger, demand, node, combo):
                winners.append(combo)
        if winners:
            best = min(
                winners,
                key=lambda c: (max(r.priority for r in c), sum(r.total_bytes for r in c)),
            )
            return list(best)
    return None


def _fits_without(ledger: Ledger, demand: Demand, node: str, gone: Sequence[Reservation]) -> bool:
    for r in gone:
        ledger.release(r.key)
    try:
        return isinstance(choose_devices(ledger, demand, node), Reservation)
    finally:
        for r in gone:
            ledger.record(r)


# ----- MIG ------------------------------------------------------------------------------------------


def _mig_hint(ledger: Ledger, demand: Demand) -> MigHint | None:
    """The smallest MIG profile on any node that holds the pod's bytes (with its free slices), or
    else the smallest of the MIG models in the cluster that a GPU could be repartitioned to."""
    need = demand.bytes_per_gpu
    if need is None:
        return None
    a = ledger.arrays
    sizes: dict[str, int] = {}
    free: dict[str, list[str]] = {}
    products: set[str] = set()
    for i, d in enumerate(a.devices):
        if not isinstance(d, MigSlice):
            continue
        products.add(d.product)
        if d.memory_bytes < need:
            continue
        sizes[d.profile] = min(sizes.get(d.profile, d.memory_bytes), d.memory_bytes)
        if a.used_replicas[i] < a.replicas[i] and a.capacity[i] - a.used[i] >= need:
            free.setdefault(d.profile, []).append(d.node)
    if sizes:
        profile = min(sizes, key=lambda p: (sizes[p], p))
        nodes = free.get(profile, [])
        return MigHint(
            profile,
            mig.resource_name(profile),
            sizes[profile],
            len(nodes),
            tuple(sorted(set(nodes))),
        )
    models = []
    for product in sorted(products):
        model = mig.model_for_product(product)
        fits = [p for p in model.profiles if p.memory_bytes >= need] if model else []
        if fits and model is not None:
            p = min(fits, key=lambda p: (p.memory_bytes, p.compute_slices, p.name))
            models.append((p.memory_bytes, p.name, model.name))
    if not models:
        return None
    memory, profile, _ = min(models)
    return MigHint(
        profile,
        mig.resource_name(profile),
        memory,
        0,
        (),
        reconfigure=tuple(sorted({m for _, p, m in models if p == profile})),
    )


# ----- as data ----------------------------------------------------------------------------------------


def explanation_dict(e: Explanation) -> dict[str, Any]:
    """`why -o json|yaml`."""
    out: dict[str, Any] = {"pod": e.pod}
    if e.error:
        out["error"] = e.error
        if e.bound_to:
            out.update(boundTo=e.bound_to, heldOn=e.held)
        return out
    out.update(
        {
            "demand": e.demand,
            "boundTo": e.bound_to,
            "schedulingGates": e.gates,
            "nodes": e.nodes,
            "feasible": e.feasible,
            "reasons": [
                {"reason": r, "count": len(ns), "unresolvable": u, "nodes": ns}
                for r, ns, u in e.groups
            ],
            "event": event_text(e),
        }
    )
    if e.closest is not None:
        c = e.closest
        out["closest"] = {
            "node": c.node,
            "reason": c.reason,
            "shortBytes": c.short_bytes,
            "remove": None
            if c.remove is None
            else [
                {"pod": p.key, "bytes": p.bytes, "modelMemory": p.model_memory} for p in c.remove
            ],
            "preemptible": c.preemptible,
        }
    if e.mig is not None:
        m = e.mig
        out["mig"] = {
            "profile": m.profile,
            "resource": m.resource,
            "memoryBytes": m.memory,
            "freeSlices": m.free_slices,
            "nodes": list(m.nodes),
            "reconfigure": list(m.reconfigure),
        }
    return out


def describe_closest(c: Closest) -> str:
    """One line for people: where the pod came closest and what would do it."""
    miss = f"{format_bytes(c.short_bytes)} short" if c.short_bytes else "room on the books"
    head = f"{c.node} ({miss}: {c.reason})"
    if c.remove is None:
        return f"{head}: removing its pods would not make it fit"
    who = ", ".join(f"{p.key} ({format_bytes(p.bytes or 0)})" for p in c.remove)
    how = (
        "lower priority: kube-scheduler preempts only for GPU counts, `serve --preempt` for VRAM"
        if c.preemptible
        else "not lower priority: only deleting frees"
    )
    return f"{head}: fits once {who} {'is' if len(c.remove) == 1 else 'are'} gone ({how})"
