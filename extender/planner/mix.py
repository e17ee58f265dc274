"""Pods counted by demand type: the mix a plan keeps free capacity useful for."""

from __future__ import annotations

from collections import Counter

from extender.demand import Demand
from extender.planner.capacity import Kind, demand_kind

__all__ = ["DemandMix"]


class DemandMix:
    """How many pods have each `demand_kind`, with a demand of each kind, kept per pod key as
    pods come and go (`ClusterState`'s live mix, the simulator's `LiveProfile`)."""

    def __init__(self) -> None:
        self.counts: Counter[Kind] = Counter()
        self.examples: dict[Kind, Demand] = {}
        self._kind: dict[str, Kind] = {}

    def __len__(self) -> int:
        """Pods counted."""
        return len(self._kind)

    def set(self, key: str, demand: Demand | None) -> int:
        """Count `key` as `demand` (None: not at all); how many counts changed (0 to 2)."""
        kind = None if demand is None else demand_kind(demand)
        old = self._kind.get(key)
        if old == kind:
            return 0
        changed = 0
        if old is not None:
            del self._kind[key]
            self.counts[old] -= 1
            if self.counts[old] <= 0:
                del self.counts[old]
                del self.examples[old]
            changed += 1
        if demand is not None and kind is not None:
            self._kind[key] = kind
            self.counts[kind] += 1
            self.examples.setdefault(kind, demand)
            changed += 1
        return changed

    def common(self, types: int) -> list[Demand]:
        """A demand of each of the `types` most common kinds that ask GPUs."""
        kinds = [k for k, _ in self.counts.most_common() if k[0] > 0][:types]
        return [self.examples[k] for k in kinds]
