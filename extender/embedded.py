"""Embedded mode: the cluster lives in memory, loaded from a file, with no API server behind it.

`ExtenderService` is composed with these two by default: `EmbeddedBinder` makes a bind real by
updating the cluster as the API server would, and `LearnedPods` learns pending pods from the
bodies kube-scheduler sends to filter (there is no API to list them) and deletes on request.
Live mode's counterparts are in `extender.live`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from extender.assignment import encode_assignment
from extender.cluster import TERMINAL_PHASES, ClusterState
from extender.demand import DemandError, pod_ref
from extender.ledger import Reservation
from extender.sizing.handoff import FRACTION_ANNOTATION, bind_fraction

__all__ = ["EmbeddedBinder", "LearnedPods", "MAX_LEARNED_PENDING"]

#: pending pods learned from filter bodies that embedded mode keeps (kube-scheduler binds a pod
#: right after filtering it, so only unschedulable ones ever reach this many).
MAX_LEARNED_PENDING = 4096


class EmbeddedBinder:
    """Binds by updating the in-memory cluster, as the API server would after a Binding.

    It writes the annotations live mode's binder writes that derive from the reservation: the
    assignment and the engine's `gpu-memory-fraction` (docs/sizing.md). Nothing runs the pod
    here, but `GET /state`, the demo and the simulator then show what a live bind would hand
    the engine. `gpu-index` is left out: it is a pin only the live binder can enforce."""

    def __init__(self, cluster: ClusterState) -> None:
        self.cluster = cluster

    async def bind(
        self, pod: Mapping[str, Any], node: str, reservation: Reservation | None
    ) -> None:
        meta = dict(pod.get("metadata") or {})
        annotations = dict(meta.get("annotations") or {})
        annotations.pop(FRACTION_ANNOTATION, None)
        if reservation is not None:
            annotations.update(encode_assignment(reservation))
            inv = self.cluster.ledger.node(reservation.node)
            share = bind_fraction(pod, reservation.device_ids, inv.devices if inv else ())
            if share is not None:
                annotations[FRACTION_ANNOTATION] = share
        meta["annotations"] = annotations
        spec = dict(pod.get("spec") or {})
        spec["nodeName"] = node
        status = dict(pod.get("status") or {})
        status["phase"] = status.get("phase") or "Pending"
        self.cluster.upsert_pod({**pod, "metadata": meta, "spec": spec, "status": status})


class LearnedPods:
    """Embedded mode's `PodFeed` (`extender.service`): pending pods learned from filter bodies, deleted on request.

    Only pending pods are learned: kube-scheduler never filters a bound or finished one, and
    taking a `nodeName` (or a terminal phase) from a request body would let any caller write the
    ledger. At most MAX_LEARNED_PENDING of them are kept (see `_forget`).
    """

    def __init__(
        self,
        cluster: ClusterState,
        notify_pending: Callable[[str], None] | None = None,
        binding: Callable[[str], bool] = lambda key: False,
    ) -> None:
        self.cluster = cluster
        #: tells the background planner of a pod learned pending (`PlanSource.notify_pending`)
        self.notify_pending = notify_pending
        #: whether a bind of the pod (by key) is waiting on the binder: such a pod stays
        self.binding = binding
        #: the pending pods learned, oldest first
        self._learned: dict[str, None] = {}

    def learn(self, pod: Mapping[str, Any]) -> None:
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        if not isinstance(status, Mapping) or spec.get("nodeName"):
            return
        phase = status.get("phase")
        if phase is not None and (not isinstance(phase, str) or phase in TERMINAL_PHASES):
            return
        try:
            key = pod_ref(pod).key
        except DemandError:
            return
        known = self.cluster.pod(key)
        if known is None or not (known.get("spec") or {}).get("nodeName"):
            self.cluster.upsert_pod(pod)
            if self.notify_pending is not None:
                self.notify_pending(key)
            self._learned.pop(key, None)
            self._learned[key] = None
            while len(self._learned) > MAX_LEARNED_PENDING:
                self._forget(next(iter(self._learned)))

    def _forget(self, key: str) -> None:
        """Nothing ever deletes a pod in embedded mode: without a bound, a long-running server would
        keep every unschedulable pod it was ever asked about. The oldest still-pending one goes;
        if kube-scheduler binds it after all, bind says it is unknown and the pod is retried."""
        del self._learned[key]
        pod = self.cluster.pod(key)
        if pod is None or (pod.get("spec") or {}).get("nodeName"):
            return  # bound since (or gone): the cluster keeps it as it should
        if self.binding(key) or self.cluster.ledger.reservation(key) is not None:
            return
        self.cluster.delete_pod(key)

    async def fetch(self, namespace: str, name: str) -> str | None:
        """Nothing to read a pod from: bind answers that it is unknown."""
        return None

    def delete(self, namespace: str, name: str) -> tuple[str, str] | None:
        """Embedded mode's `kubectl delete pod`: the pod leaves the cluster and what it held is
        free again. A cluster file has no API server to delete through, yet the demo and the soak
        need churn (without it every bind is for good and a cluster only fills up)."""
        key = f"{namespace}/{name}"
        if self.cluster.pod(key) is None:
            return "unknown", f"pod {key} is unknown to vramsched"
        if self.binding(key):
            return "binding", f"pod {key} is being bound; delete it once the bind has answered"
        self.cluster.delete_pod(key)
        self._learned.pop(key, None)
        return None
