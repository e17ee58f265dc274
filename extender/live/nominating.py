"""The service's plan source with live repacking in it, by composition (`--repack`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from extender.demand import Demand
from extender.ledger import Reservation
from extender.live.repack import Repacker
from extender.service import PlanSource

__all__ = ["NominatingPlanSource"]

#: the planner's counters when no background planner runs (the metrics read these keys)
_NO_PLANNER = {
    "plans": 0,
    "entries": 0,
    "lastStatus": "",
    "lastGap": None,
    "lastBatch": 0,
    "lastPlaced": 0,
    "lastSeconds": 0.0,
    "hits": 0,
    "stale": 0,
    "errors": 0,
    "profile": [],
    "aheadTypes": 0,
    "aheadRounds": 0,
    "aheadHits": 0,
}


class NominatingPlanSource:
    """The service's `PlanSource` (and `Nominations`) with a repack in it, by composition: a pod
    a running plan nominated gets its held node and devices; every other pod gets the
    background planner's (`inner`, None when it is off)."""

    def __init__(self, repacker: Repacker, inner: PlanSource | None = None) -> None:
        self.repacker = repacker
        self.inner = inner

    def nominated(self, pod_key: str) -> Reservation | None:
        return self.repacker.nominated(pod_key)

    def planned_node(
        self, pod_key: str, nodes: Sequence[str] | None = None, demand: Demand | None = None
    ) -> str | None:
        res = self.repacker.nominated(pod_key)
        if res is not None:
            return res.node
        if self.inner is None:
            return None
        return self.inner.planned_node(pod_key, nodes, demand)

    def planned_reservation(self, pod_key: str, node: str) -> Reservation | None:
        if self.repacker.nominated(pod_key) is not None:
            return self.repacker.planned_reservation(pod_key, node)
        return self.inner.planned_reservation(pod_key, node) if self.inner is not None else None

    def notify_pending(self, pod_key: str) -> None:
        if self.inner is not None:
            self.inner.notify_pending(pod_key)

    def notify_filtered(self, pod_key: str, fits: bool) -> None:
        run = self.repacker.run
        if run is None or run.nominated(pod_key, self.repacker.clock()) is None:
            self.repacker.notify_filtered(pod_key, fits)
        if self.inner is not None:
            self.inner.notify_filtered(pod_key, fits)

    def state(self) -> dict[str, Any]:
        base = self.inner.state() if self.inner is not None else dict(_NO_PLANNER)
        return {**base, "repack": self.repacker.state()}
