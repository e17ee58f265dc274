"""Which workload profile a replay's fragmentation measure weighs free capacity by.

FGD's protocol gives every policy the whole replay's pod mix up front (`whole`). A live
cluster cannot know it: `serve` plans with the pods of its scheduler the cluster holds, pending
or running (`ClusterState.demand_mix`). `live` replays that: the pods that arrived and have not
left, a pod that fit nowhere included (in a cluster it stays pending). Pods bound before the
replay starts are not counted: a replay cannot tell which scheduler placed them.
"""

from __future__ import annotations

from extender.demand import Demand
from extender.planner.capacity import Workload
from extender.planner.mix import DemandMix

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
        self.mix = DemandMix()
        self._changes = 0
        self._built_from = 0

    def arrive(self, key: str, demand: Demand) -> None:
        self._changes += self.mix.set(key, demand)

    def leave(self, key: str) -> None:
        self._changes += self.mix.set(key, None)

    def stale(self) -> bool:
        """Whether the measure should be rebuilt from `workload()`."""
        return self._changes > 0 and self._changes >= self.drift * self._built_from

    def workload(self) -> Workload:
        """The profile now (and the point later drift is measured from)."""
        self._changes = 0
        self._built_from = len(self.mix)
        return Workload.from_counts(self.mix.counts)
