"""Which workload profile a replay's fragmentation measure weighs free capacity by.

FGD's protocol gives every policy the whole replay's pod mix up front (`whole`). A live
cluster cannot know it: `serve` plans with the pods of its scheduler the cluster holds, pending
or running (`ClusterState.demand_mix`). `live` replays that: the pods that arrived and have not
left, a pod that fit nowhere included (in a cluster it stays pending). Pods bound before the
replay starts are not counted: a replay cannot tell which scheduler placed them.
"""

from __future__ import annotations

from collections import Counter

from extender.demand import Demand
from extender.planner.capacity import Kind, Workload, demand_kind

__all__ = ["PROFILES", "PROFILE_DRIFT", "LiveProfile"]

#: `whole`: the replay's whole mix (FGD's protocol); `live`: what `serve` knows (`LiveProfile`)
PROFILES = ("whole", "live")
#: `LiveProfile` rebuilds the measure once pods arrived or left since the last build number this
#: share of the pods counted then (rebuilding per arrival costs 15 ms x 10,000 arrivals per list;
#: early on, when the mix changes fastest, this is every arrival or two)
PROFILE_DRIFT = 0.05


class LiveProfile:
    """The pods a live cluster would count in its demand mix, and when the measure built from
    them has drifted enough to rebuild."""

    def __init__(self, drift: float = PROFILE_DRIFT) -> None:
        self.drift = drift
        self.counts: Counter[Kind] = Counter()
        #: a demand of each kind counted (what `plan-ahead` plans for)
        self.examples: dict[Kind, Demand] = {}
        self._kind: dict[str, Kind] = {}
        self._changes = 0
        self._built_from = 0

    def arrive(self, key: str, demand: Demand) -> None:
        self.leave(key)
        kind = demand_kind(demand)
        self._kind[key] = kind
        self.counts[kind] += 1
        self.examples.setdefault(kind, demand)
        self._changes += 1

    def leave(self, key: str) -> None:
        kind = self._kind.pop(key, None)
        if kind is None:
            return
        self.counts[kind] -= 1
        if self.counts[kind] <= 0:
            del self.counts[kind]
            del self.examples[kind]
        self._changes += 1

    def common(self, types: int) -> list[Demand]:
        """A demand of each of the `types` most common GPU pod kinds counted (as
        `ahead.PlanAhead.examples` picks them from the cluster)."""
        from extender.planner.ahead import most_common_gpu_kinds  # imports OR-Tools

        return most_common_gpu_kinds(self.counts, self.examples, types)

    def stale(self) -> bool:
        """Whether the measure should be rebuilt from `workload()`."""
        return self._changes > 0 and self._changes >= self.drift * self._built_from

    def workload(self) -> Workload:
        """The profile now (and the point later drift is measured from)."""
        self._changes = 0
        self._built_from = len(self._kind)
        return Workload.from_counts(self.counts)
