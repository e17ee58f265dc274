"""Planning ahead: the planner's placement kept ready for the next pod of each common type.

kube-scheduler places most pods within milliseconds of seeing them, before any plan can cover
them, so those pods get the hot path's choice, not the planner's (`background.min_age`). Its
one-pod rule (`model.SEQUENTIAL_RULE`: FGD's measure over the cluster's pod mix, with the
open-GPU charge) costs 10 to 40 ms per pod at 5,000 nodes, too much for prioritize. `PlanAhead`
runs it in the planner's worker thread instead, for a stand-in pod of each of the most common
GPU pod types the cluster holds (`ClusterState.demand_mix`), and keeps each choice while its node
is unchanged. A pending pod of such a type then gets that node and those GPUs, exactly as if it
had been planned alone at that moment; any change on the node drops the entry until the next
round (the background loop reruns it after every change, at most every `interval` seconds).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from extender.cluster import ClusterState
from extender.demand import Demand, DemandError, PodRef, pod_demand
from extender.ledger import Reservation
from extender.planner.capacity import Capacity, FragIndex, Kind, Workload, demand_kind
from extender.planner.greedy import choose
from extender.planner.model import SEQUENTIAL_RULE

__all__ = [
    "PlanAhead",
    "AheadEntry",
    "plan_ahead",
    "plan_ahead_round",
    "same_shape",
    "most_common_gpu_kinds",
]


#: the namespace of the stand-in pods (no real pod has an empty namespace)
_GHOST_NAMESPACE = ""


@dataclass(frozen=True, slots=True)
class AheadEntry:
    """Where the next pod of one type goes: node, GPUs, and the node's generation then."""

    node: str
    reservation: Reservation
    generation: int
    #: the stand-in the choice was made for (a pod must match it to use the entry)
    demand: Demand


def same_shape(a: Demand, b: Demand) -> bool:
    """Whether a choice made for `a` is the one the rule would make for `b`: everything the rule
    and the device checks read, but the pod's name and priority."""
    return replace(a, pod=b.pod, priority=b.priority, model_memory=b.model_memory) == b


def most_common_gpu_kinds(
    counts: Counter[Kind], examples: Mapping[Kind, Demand], types: int
) -> list[Demand]:
    """An example demand of each of the `types` most common kinds in `counts` that ask GPUs."""
    kinds = [k for k, _ in counts.most_common() if k[0] > 0][:types]
    return [examples[k] for k in kinds]


def plan_ahead(
    cap: Capacity,
    examples: Sequence[Demand],
    frag: FragIndex,
    generations: Mapping[str, int],
) -> dict[Kind, AheadEntry]:
    """The one-pod rule's choice for each of `examples` on `cap`, each alone (nothing is
    reserved): what the first pod of that type to come would get."""
    names = cap.arrays.node_names
    out: dict[Kind, AheadEntry] = {}
    for i, example in enumerate(examples):
        ghost = replace(example, pod=PodRef(_GHOST_NAMESPACE, f"plan-ahead-{i}"))
        choice = choose(SEQUENTIAL_RULE, cap, ghost, frag)
        if choice is None:
            continue  # fits nowhere now
        res, row, _ = choice
        if res is None:
            continue  # needs no GPU: prioritize scores it 0 everywhere
        node = names[row]
        out[demand_kind(example)] = AheadEntry(node, res, generations.get(node, 0), ghost)
    return out


def plan_ahead_round(
    cap: Capacity,
    examples: Sequence[Demand],
    workload: Workload,
    generations: Mapping[str, int],
    open_cost: float = 0.0,
) -> dict[Kind, AheadEntry]:
    """`plan_ahead` on a private snapshot, FGD's measure built there first (the planner's:
    `count_foreign=False`). Worker thread."""
    cap.dedupe = False  # a few pods on a fresh snapshot (see Capacity.dedupe)
    frag = FragIndex(cap, workload, count_foreign=False, open_cost=open_cost)
    return plan_ahead(cap, examples, frag, generations)


class PlanAhead:
    """The entries of the last `plan_ahead` round, looked up by the pending pods that use them."""

    def __init__(self, cluster: ClusterState, types: int) -> None:
        self.cluster = cluster
        #: how many of the most common GPU pod types get an entry
        self.types = types
        self.entries: dict[Kind, AheadEntry] = {}
        #: ledger generation of the last round (None: none yet)
        self.planned_at: int | None = None
        self.rounds = 0
        self.hits = 0

    def examples(self) -> list[Demand]:
        """A pod of each of the `types` most common GPU pod types of ours the cluster holds."""
        return most_common_gpu_kinds(self.cluster.demand_mix, self.cluster.kind_example, self.types)

    def stale(self) -> bool:
        """Whether the cluster changed since the last round."""
        return self.planned_at != self.cluster.ledger.generation

    def install(self, entries: dict[Kind, AheadEntry], generation: int) -> None:
        self.entries = entries
        self.planned_at = generation
        self.rounds += 1

    def lookup(self, pod_key: str) -> tuple[AheadEntry, Demand] | None:
        """The entry a pending pod may use, with the pod's demand: one for its type, made for a
        pod of the same shape, on a node unchanged since."""
        if not self.entries or pod_key not in self.cluster.pending:
            return None
        pod = self.cluster.pod(pod_key)
        if pod is None:
            return None
        try:
            demand = pod_demand(pod, headroom=self.cluster.headroom)
        except DemandError:
            return None
        e = self.entries.get(demand_kind(demand))
        if e is None or not same_shape(e.demand, demand):
            return None
        ledger = self.cluster.ledger
        if ledger.node(e.node) is None or ledger.node_generation.get(e.node, 0) != e.generation:
            return None
        return e, demand

    def reservation(self, pod_key: str, node: str) -> Reservation | None:
        """The entry's GPUs for this pod when `node` is the entry's (bind)."""
        found = self.lookup(pod_key)
        if found is None or found[0].node != node:
            return None
        e, demand = found
        r = e.reservation
        self.hits += 1
        return Reservation(
            demand.pod,
            r.node,
            r.device_ids,
            r.bytes_per_device,
            demand.priority,
            declared=r.declared,
        )
