"""Planning ahead: the planner's placements kept ready for the next pods of each common type.

kube-scheduler places most pods within milliseconds of seeing them, before any plan can cover
them, so those pods get the hot path's choice, not the planner's (`background.min_age`). Its
one-pod rule (`model.SEQUENTIAL_RULE`: FGD's measure over the cluster's pod mix, with the
open-GPU charge) costs 1 to 80 ms per pod from 100 to 5,000 nodes, against well under 1 ms for
the hot path. `PlanAhead` runs it in the planner's worker thread instead: for each of the most
common GPU pod types the cluster holds (`ClusterState.demand_mix`), where the next `depth` pods
of that type would go, each placed after the ones before it (a Deployment's replicas arrive
together, and kube-scheduler places them faster than another round). A pending pod of such a
type takes its type's next entry while the entry's node holds exactly what it held at the round
plus the pods that took this round's entries, and the GPUs still fit (the background loop reruns
the round after every change). Any other pod (a type not planned for, or not seen at the round,
or whose entry no longer holds) gets the same rule run inline by `InlineRule`, over the round's
mix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from extender.cluster import ClusterState
from extender.demand import Demand, DemandError, PodRef, pod_demand
from extender.ledger import Reservation
from extender.planner.capacity import Capacity, FragIndex, Kind, Workload, demand_kind
from extender.planner.greedy import Choice, choose, place_one
from extender.planner.model import SEQUENTIAL_RULE

__all__ = [
    "PlanAhead",
    "AheadEntry",
    "InlineRule",
    "plan_ahead",
    "plan_ahead_round",
    "same_shape",
    "DEPTH",
]


log = logging.getLogger(__name__)

#: entries per pod type: how many pods of one type arriving together (a Deployment's replicas)
#: get the planner's choice before the next round
DEPTH = 4

#: inline choices kept for their bind before the ones of pods no longer pending are dropped
INLINE_KEPT = 1024

#: the namespace of the stand-in pods (no real pod has an empty namespace)
_GHOST_NAMESPACE = ""


@dataclass(frozen=True, slots=True)
class AheadEntry:
    """Where one of the next pods of a type goes: node and GPUs."""

    node: str
    reservation: Reservation
    #: the stand-in the choice was made for (a pod must match it to use the entry)
    demand: Demand

    def for_pod(self, demand: Demand) -> Reservation:
        """The entry's GPUs held for the pod of `demand` (with its priority)."""
        r = self.reservation
        return Reservation(
            demand.pod,
            r.node,
            r.device_ids,
            r.bytes_per_device,
            demand.priority,
            declared=r.declared,
        )


def same_shape(a: Demand, b: Demand) -> bool:
    """Whether a choice made for `a` is the one the rule would make for `b`: everything the rule
    and the device checks read, but the pod's name and priority."""
    return replace(a, pod=b.pod, priority=b.priority, model_memory=b.model_memory) == b


def plan_ahead(
    cap: Capacity, examples: Sequence[Demand], frag: FragIndex, depth: int = 1
) -> dict[Kind, list[AheadEntry]]:
    """For each of `examples`, the one-pod rule's choices for the next `depth` pods like it on
    `cap`, each after the ones before it; `cap` and `frag` are left as they were."""
    names = cap.arrays.node_names
    out: dict[Kind, list[AheadEntry]] = {}
    for i, example in enumerate(examples):
        queue: list[AheadEntry] = []
        placed: list[tuple[Demand, int]] = []
        for j in range(depth):
            ghost = replace(example, pod=PodRef(_GHOST_NAMESPACE, f"plan-ahead-{i}-{j}"))
            choice = choose(SEQUENTIAL_RULE, cap, ghost, frag)
            if choice is None or choice[0] is None:
                break  # fits nowhere now, or needs no GPU (prioritize scores it 0 everywhere)
            queue.append(AheadEntry(names[choice[1]], choice[0], ghost))
            if j + 1 < depth:
                place_one(cap, ghost, choice, frag)
                placed.append((ghost, choice[1]))
        for ghost, row in placed:
            cap.remove(ghost, row)
            frag.refresh([row])
        if queue:
            out[demand_kind(example)] = queue
    return out


def plan_ahead_round(
    cap: Capacity,
    examples: Sequence[Demand],
    workload: Workload,
    depth: int,
    open_cost: float = 0.0,
) -> dict[Kind, list[AheadEntry]]:
    """`plan_ahead` on a private snapshot, FGD's measure built there first (the planner's:
    `count_foreign=False`). Worker thread."""
    cap.dedupe = False  # a few pods on a fresh snapshot (see Capacity.dedupe)
    frag = FragIndex(cap, workload, count_foreign=False, open_cost=open_cost)
    return plan_ahead(cap, examples, frag, depth)


class InlineRule:
    """The one-pod rule for a pod no entry covers, run on the event loop over the live ledger.

    FGD's measure weighs by the mix of the last round (`use`), so a pod gets what the round would
    have planned for it. The measure is built on first use after the mix changed and otherwise
    refreshed for the nodes the ledger touched since (`Ledger.touched_rows_since`); the choice
    reads the ledger and reserves nothing (costs: `benchmarks/plan_ahead.py`).
    """

    def __init__(self, cluster: ClusterState, open_cost: float = 0.0, memo: bool = True) -> None:
        self.cluster = cluster
        self.open_cost = open_cost
        #: whether the measure keeps its scores between pods (`FragIndex.memo`; off: every
        #: fitting device scored for every pod, the benchmark's baseline)
        self.memo = memo
        #: the pod mix to weigh by (None: no choices, the hot path answers)
        self.mix: dict[Kind, int] | None = None
        self._frag: FragIndex | None = None
        #: the mix the measure was built with, the ledger position and the nodes' free CPU and
        #: memory it is current to
        self._built_mix: dict[Kind, int] | None = None
        self._position = 0
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        self.builds = 0

    def use(self, mix: Mapping[Kind, int] | None) -> None:
        """Weigh by a round's `mix` (None: no choices); the measure is rebuilt only when the mix
        differs from the one it was built with."""
        self.mix = None if mix is None else dict(mix)

    def choose(self, demand: Demand, nodes: Sequence[str] | None = None) -> Choice | None:
        """The rule's choice for `demand` now, among `nodes` (None: every node); None before the
        first round, or if it fits nowhere."""
        if self.mix is None:
            return None
        ledger = self.cluster.ledger
        cap = Capacity.from_ledger(ledger, self.cluster.cpu_used, self.cluster.memory_used)
        cap.dedupe = False  # nothing keeps its signatures current (see Capacity.dedupe)
        before, self._host = self._host, (cap.cpu_free.copy(), cap.mem_free.copy())
        if nodes is not None:  # the others get no CPU: no candidate there (`Capacity.fits_host`)
            keep = np.zeros(len(cap.cpu_free), bool)
            keep[[r for r in map(ledger.node_row, nodes) if r is not None]] = True
            cap.cpu_free[~keep] = -1
        frag = self._frag
        rows = None
        if frag is not None and frag.a is cap.arrays and self._built_mix == self.mix:
            rows = ledger.touched_rows_since(self._position)
        if frag is None or rows is None or before is None or len(before[0]) != len(cap.cpu_free):
            workload = Workload.from_counts(self.mix)  # what `BackgroundPlanner.workload` builds
            frag = FragIndex(cap, workload, count_foreign=False, open_cost=self.open_cost)
            frag.memo = {} if self.memo else None
            self._frag, self._built_mix = frag, self.mix
            self.builds += 1
        else:
            # the nodes whose GPUs changed, and those whose CPU or memory did (pods without GPUs,
            # or with GPUs of other schedulers): their scores in the memo go
            cpu, mem = self._host
            moved = np.flatnonzero((cpu != before[0]) | (mem != before[1]))
            frag.cap = cap
            frag.refresh(np.union1d(rows, moved).tolist())
        self._position = ledger.position
        return choose(SEQUENTIAL_RULE, cap, demand, frag)


class PlanAhead:
    """The entries of the last round, handed out in order to the pending pods of each type."""

    def __init__(
        self, cluster: ClusterState, types: int, depth: int = DEPTH, open_cost: float = 0.0
    ) -> None:
        self.cluster = cluster
        #: how many of the most common GPU pod types get entries, and how many pods each
        self.types = types
        self.depth = depth
        self.entries: dict[Kind, list[AheadEntry]] = {}
        #: per node, the pods holding its GPUs at the round; per type, entries taken since; per
        #: node, the pods that took them
        self._holders: Mapping[str, frozenset[str]] = {}
        self._next: dict[Kind, int] = {}
        self._taken: dict[str, set[str]] = {}
        #: ledger generation of the last round (None: none yet)
        self.planned_at: int | None = None
        self.rounds = 0
        self.hits = 0
        #: the rule for the pods no entry covers, and its choices kept for their bind
        self.rule = InlineRule(cluster, open_cost)
        self._inline: dict[str, Reservation] = {}
        self.inline_choices = 0

    def examples(self) -> list[Demand]:
        """A pod of each of the `types` most common GPU pod types of ours the cluster holds."""
        return self.cluster.mix.common(self.types)

    def stale(self) -> bool:
        """Whether the cluster changed since the last round."""
        return self.planned_at != self.cluster.ledger.generation

    def install(
        self,
        entries: dict[Kind, list[AheadEntry]],
        generation: int,
        holders: Mapping[str, frozenset[str]],
        mix: Mapping[Kind, int] | None = None,
    ) -> None:
        """A round's entries, made on the cluster at ledger `generation`, whose nodes' GPUs
        `holders` held then (`Ledger.holders`), weighing by the pod `mix` of the moment, which
        the inline rule then weighs by too (None: a round with no pod type to plan for)."""
        self.rule.use(mix)
        self.entries = entries
        self.planned_at = generation
        self._holders = holders
        self._next = {}
        self._taken = {}
        self.rounds += 1

    def lookup(self, pod_key: str) -> tuple[AheadEntry, Demand] | None:
        """The entry a pending pod may use, with the pod's demand: its type's next one, made for a
        pod of the same shape, on a node changed since the round only by pods that took entries,
        where the GPUs still fit."""
        demand = self._pending_demand(pod_key)
        e = self._entry(demand) if demand is not None else None
        return (e, demand) if e is not None and demand is not None else None

    def planned_node(
        self, pod_key: str, nodes: Sequence[str] | None = None, demand: Demand | None = None
    ) -> str | None:
        """A pending pod's node: its entry's (`lookup`), else the inline rule's (`_inline_node`);
        the pod's demand parsed once (prioritize asks for every pod). A pod the cluster does not
        hold yet (kube-scheduler asked before the pod watch delivered it) is taken as the
        request carries it (`demand`); a pod the cluster holds bound gets nothing."""
        pending = self._pending_demand(pod_key)
        if pending is None and demand is not None and demand.pod.key == pod_key:
            pending = demand if self.cluster.pod(pod_key) is None else None
        if pending is None:
            return None
        e = self._entry(pending)
        return e.node if e is not None else self._inline_node(pod_key, pending, nodes)

    def _entry(self, demand: Demand) -> AheadEntry | None:
        """`lookup` for a parsed demand."""
        kind = demand_kind(demand)
        queue = self.entries.get(kind)
        i = self._next.get(kind, 0)
        if queue is None or i >= len(queue) or not same_shape(queue[i].demand, demand):
            return None
        e = queue[i]
        ledger = self.cluster.ledger
        expected = self._holders.get(e.node, frozenset()) | self._taken.get(e.node, set())
        if ledger.keys_on(e.node) != expected or ledger.fits(e.reservation) is not None:
            return None
        return e

    def reservation(self, pod_key: str, node: str) -> Reservation | None:
        """The entry's GPUs for this pod when `node` is the entry's (bind); the type's next pod
        gets the entry after it."""
        found = self.lookup(pod_key)
        if found is None or found[0].node != node:
            return None
        e, demand = found
        kind = demand_kind(demand)
        self._next[kind] = self._next.get(kind, 0) + 1
        self._taken.setdefault(node, set()).add(pod_key)
        self.hits += 1
        return e.for_pod(demand)

    def _inline_node(self, pod_key: str, demand: Demand, nodes: Sequence[str] | None) -> str | None:
        """For a pending GPU pod no entry covers, the inline rule's node among `nodes` (those
        kube-scheduler found feasible: its selectors, taints and affinity are not the rule's to
        know); its GPUs are kept for the pod's bind (`inline_reservation`)."""
        if not demand.wants_gpu:
            return None
        try:
            choice = self.rule.choose(demand, nodes)
        except Exception:  # an optimisation: the hot path still answers
            log.exception("the inline one-pod rule failed for %s", pod_key)
            return None
        if choice is None or choice[0] is None:
            self._inline.pop(pod_key, None)
            return None
        if len(self._inline) >= INLINE_KEPT:  # pods prioritized, never bound: drop the gone
            pending = self.cluster.pending
            self._inline = {k: r for k, r in self._inline.items() if k in pending}
        self._inline[pod_key] = choice[0]
        self.inline_choices += 1
        return choice[0].node

    def inline_reservation(self, pod_key: str, node: str) -> Reservation | None:
        """The GPUs the inline rule chose for this pod when `node` is its node (bind)."""
        r = self._inline.pop(pod_key, None)
        return r if r is not None and r.node == node else None

    def _pending_demand(self, pod_key: str) -> Demand | None:
        """The demand of a pending pod the cluster holds; None for any other pod, or one whose
        demand does not parse (filter has refused it)."""
        if pod_key not in self.cluster.pending:
            return None
        pod = self.cluster.pod(pod_key)
        if pod is None:
            return None
        try:
            return pod_demand(pod, headroom=self.cluster.headroom)
        except DemandError:
            return None
