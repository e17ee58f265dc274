"""Live mode's sync gate: the service's verbs wait for the informers' first full sync.

Until both informers have listed everything, the ledger does not know what is already bound, so
nothing is placed rather than something double-booked; kube-scheduler retries. The gate is the
only thing that differs in live mode's verbs: what they do once synced is the service's
(`extender.service.ExtenderService`), composed with the live binder and the watched pods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client.registry import Collector

from extender.cluster import ClusterState
from extender.ledger import Ledger
from extender.live.source import LiveSource
from extender.observe.pending import PendingReasons
from extender.service import ExtenderService
from extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    HostPriority,
)

__all__ = ["NOT_SYNCED", "SyncGate", "live_service"]

NOT_SYNCED = "vramsched is still syncing nodes and pods from the API server"


class SyncGate:
    """`ExtenderService`'s verbs behind the first sync (an `extender.service.Extender`).

    Before it: filter and bind answer NOT_SYNCED, prioritize scores every node 0 and preempt
    proposes no victims. After it, and always for everything else, the service answers.
    """

    def __init__(self, service: ExtenderService, source: LiveSource) -> None:
        self.service = service
        self.source = source

    @property
    def ledger(self) -> Ledger:
        return self.service.ledger

    @property
    def pending_reasons(self) -> PendingReasons:
        return self.service.pending_reasons

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        if not self.source.synced:
            return ExtenderFilterResult(Error=NOT_SYNCED)
        return self.service.filter(args)

    def prioritize(self, args: ExtenderArgs) -> Sequence[HostPriority]:
        if not self.source.synced:
            names = args.NodeNames or [
                str((n.get("metadata") or {}).get("name", ""))
                for n in (args.Nodes.items if args.Nodes else [])
            ]
            return [HostPriority(Host=n, Score=0) for n in names]
        return self.service.prioritize(args)

    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        if not self.source.synced:
            return ExtenderBindingResult(Error=NOT_SYNCED)
        return await self.service.bind(args)

    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        if not self.source.synced:
            return ExtenderPreemptionResult(NodeNameToMetaVictims={})
        return self.service.preempt(args)

    def delete_pod(self, namespace: str, name: str) -> tuple[str, str] | None:
        return self.service.delete_pod(namespace, name)

    def state(self) -> dict[str, Any]:
        return self.service.state()

    def planner_state(self) -> dict[str, Any] | None:
        return self.service.planner_state()

    def metric_collectors(self) -> list[Collector]:
        return [*self.service.metric_collectors(), *self.source.metric_collectors()]


def live_service(cluster: ClusterState, source: LiveSource, **options: Any) -> SyncGate:
    """Live mode's extender: the service binding through `source.binder`, hearing of pods from
    the watch (`source.pod_feed`), behind the sync gate. `options` are `ExtenderService`'s."""
    return SyncGate(
        ExtenderService(cluster, source.binder, pods=source.pod_feed, **options), source
    )
