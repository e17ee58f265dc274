"""The scheduler's health for `/metrics`, read at scrape time: version, readiness, how stale the
nodes/pods view may be, whether this replica leads, and the pending pods by reason class.

Everything is read from callables the server already has (`ready()` of /readyz, the service's
`PendingReasons`, a leader probe), so nothing is counted on the request path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

import extender

__all__ = ["HealthCollector", "RESOURCES"]

RESOURCES = ("nodes", "pods")


class HealthCollector(Collector):
    def __init__(
        self,
        *,
        ready: Callable[[], tuple[bool, Mapping[str, Any]]],
        pending: Callable[[], Mapping[str, int]],
        leader: Callable[[], bool | None] = lambda: True,
        version: str = extender.__version__,
    ) -> None:
        self._ready = ready
        self._pending = pending
        self._leader = leader
        self._version = version

    def collect(self) -> Iterator[GaugeMetricFamily | InfoMetricFamily]:
        yield InfoMetricFamily(
            "vramsched_build", "vramsched's version", value={"version": self._version}
        )
        ready, detail = self._ready()
        yield GaugeMetricFamily(
            "vramsched_ready",
            "1 once the ledger is built from the cluster (the /readyz answer)",
            value=1 if ready else 0,
        )
        leader = self._leader()
        if leader is not None:
            yield GaugeMetricFamily(
                "vramsched_leader",
                "1 on the replica whose kube-scheduler holds the leader Lease (the one that "
                "schedules), 0 on a standby; 1 without leader election (embedded mode, no Lease)",
                value=1 if leader else 0,
            )
        stale = GaugeMetricFamily(
            "vramsched_informer_stale_seconds",
            "Seconds the watch of a resource has been down (0 while connected): how far the "
            "ledger may lag the API server. Always 0 for a cluster file",
            labels=["resource"],
        )
        synced = GaugeMetricFamily(
            "vramsched_informer_synced",
            "1 once a resource was listed in full (always 1 for a cluster file)",
            labels=["resource"],
        )
        informers = detail.get("informers") or {}
        for resource in RESOURCES:
            info = informers.get(resource)
            stale.add_metric([resource], float(info.get("downForS", 0.0)) if info else 0.0)
            synced.add_metric([resource], (1 if info.get("synced") else 0) if info else 1)
        yield stale
        yield synced
        pending = GaugeMetricFamily(
            "vramsched_pods_pending",
            "Pending vramsched pods by why filter last refused them: fits (a node passed; waits "
            "on kube-scheduler), vram, replicas, other (no node has it free now), unschedulable "
            "(no node ever can, as labelled), invalid (unreadable demand), unfiltered",
            labels=["reason"],
        )
        for reason, count in self._pending().items():
            pending.add_metric([reason], count)
        yield pending
