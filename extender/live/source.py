"""Live mode's source of truth: nodes and pods from the API server, into `ClusterState`.

One informer per resource (nodes, then pods in all namespaces); every change is applied on the
event loop. The ledger is derived from what the API returns (bound pods and their
`vramsched.io/` annotations), so a restart, a second replica or a relist rebuilds it identically.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prometheus_client.registry import Collector

from extender.cluster import ClusterState
from extender.demand import DemandError, pod_ref
from extender.inventory import ReplicaPolicy
from extender.live.api_client import ApiError, ClientApi, KubeApi
from extender.live.binder import KubeBinder
from extender.live.events import EventCollector
from extender.live.informer import Deliver, Informer, slim

__all__ = ["LiveSource", "WatchedPods"]

log = logging.getLogger(__name__)


class LiveSource:
    """Feeds `ClusterState` from the API and binds through it. Owned by one event loop.

    It hands the service its `binder` and its `pod_feed` (`WatchedPods`), and the sync gate its
    `synced` (`extender.live.gate.live_service` composes the three).
    """

    def __init__(
        self,
        cluster: ClusterState,
        *,
        kubeconfig: str | None = None,
        api: KubeApi | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        self.cluster = cluster
        policy = cluster.ledger.replica_policy
        if policy is None:  # the stock device plugin always picks time-sliced GPUs somehow
            raise ValueError("live mode needs a cluster built with a replica policy")
        self.policy = policy
        self.api: KubeApi = api if api is not None else ClientApi(kubeconfig)
        self.binder = KubeBinder(self.api, pinned=policy is ReplicaPolicy.PINNED, cluster=cluster)
        self.pod_feed = WatchedPods(cluster, read_pod=self._read_pod)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nodes_applied = threading.Event()
        self.nodes = Informer(
            "nodes",
            self.api,
            self._deliver("nodes"),
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
        )
        self.pods = Informer(
            "pods",
            self.api,
            self._deliver("pods"),
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            may_start=self._nodes_applied,
        )
        self._synced = {"nodes": False, "pods": False}
        #: pods seen bound to a node we did not know yet, by node: counted when it arrives
        self._orphans: dict[str, set[str]] = {}

    # ----- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start both informers and return at once; `ready()` says when the first sync is done."""
        self._loop = asyncio.get_running_loop()
        self.nodes.start()
        self.pods.start()

    async def stop(self) -> None:
        self.nodes.stop()
        self.pods.stop()
        self.api.abort_watches()
        self.binder.close()

    @property
    def synced(self) -> bool:
        return self._synced["nodes"] and self._synced["pods"]

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready once synced, and still ready when the API server goes away: filter and prioritize
        answer from the last consistent view meanwhile (binds fail and are retried). The detail
        says so: `apiServer` is "unreachable" and `staleForS` counts the outage."""
        stats = (self.nodes.stats, self.pods.stats)
        down = [s.down_since for s in stats if s.down_since is not None]
        return self.synced, {
            "source": "kubernetes",
            "apiServer": "connected"
            if all(s.connected for s in stats)
            else ("unreachable" if down else "connecting"),
            "staleForS": round(time.monotonic() - min(down), 1) if down else 0.0,
            "replicaPolicy": self.policy.value,
            "nodes": len(self.cluster.nodes),
            "pods": len(self.cluster.pods),
            "informers": {"nodes": self.nodes.stats.as_dict(), "pods": self.pods.stats.as_dict()},
            "events": self.binder.events.stats(),
        }

    def metric_collectors(self) -> list[Collector]:
        """Live mode's extra /metrics: the bind events' outcomes."""
        return [EventCollector(self.binder.events)]

    async def _read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.binder.call(self.api.read_pod, namespace, name)
        return result

    # ----- events ------------------------------------------------------------------------------------
    def _deliver(self, kind: str) -> Deliver:
        def deliver(op: str, payload: Any) -> None:
            loop = self._loop
            if loop is None or loop.is_closed():
                return
            loop.call_soon_threadsafe(self.apply, kind, op, payload)

        return deliver

    def apply(self, kind: str, op: str, payload: Any) -> None:
        """Apply one informer delivery to the cluster; runs on the event loop only."""
        try:
            if kind == "nodes":
                self._apply_node(op, payload)
            else:
                self._apply_pod(op, payload)
        except Exception:  # one odd object must not stop the stream
            log.exception("cannot apply %s %s", kind, op)

    def _apply_node(self, op: str, payload: Any) -> None:
        c = self.cluster
        if op == "replace":
            names = {str((n.get("metadata") or {}).get("name") or "") for n in payload}
            for name in [n for n in c.nodes if n not in names]:
                c.delete_node(name)
            for node in payload:
                self._upsert_node(node)
            self._synced["nodes"] = True
            self._nodes_applied.set()
            log.info("nodes synced", extra={"fields": {"nodes": len(c.nodes)}})
        elif op in ("ADDED", "MODIFIED"):
            self._upsert_node(payload)
        elif op == "DELETED":
            c.delete_node(str((payload.get("metadata") or {}).get("name") or ""))

    def _upsert_node(self, node: Mapping[str, Any]) -> None:
        name = str((node.get("metadata") or {}).get("name") or "")
        self.cluster.upsert_node(node)
        # Pods seen bound to it before the node itself arrived (two watches, no common order)
        # could not be counted then.
        for key in self._orphans.pop(name, ()):
            pod = self.cluster.pods.get(key)
            if pod is not None and (pod.get("spec") or {}).get("nodeName") == name:
                self.cluster.upsert_pod(pod)

    def _upsert_pod(self, pod: Mapping[str, Any]) -> None:
        self.cluster.upsert_pod(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        if node and node not in self.cluster.nodes:
            key = _key(pod)
            if key:
                self._orphans.setdefault(node, set()).add(key)

    def _apply_pod(self, op: str, payload: Any) -> None:
        c = self.cluster
        if op == "replace":
            keys = {k for k in (_key(p) for p in payload) if k}
            for key in [k for k in c.pods if k not in keys]:
                c.delete_pod(key)
            for pod in payload:
                self._upsert_pod(pod)
            # A full list is the cluster's pods as millions of objects that live until their next
            # update: leave them out of every later collection (as `serve --cluster` does after
            # loading), or the collector rescans them all in the middle of requests.
            gc.freeze()
            self._synced["pods"] = True
            log.info(
                "pods synced",
                extra={
                    "fields": {
                        "pods": len(c.pods),
                        "reservations": sum(1 for _ in c.ledger.reservations()),
                    }
                },
            )
        elif op in ("ADDED", "MODIFIED"):
            self._upsert_pod(payload)
        elif op == "DELETED":
            key = _key(payload)
            known = c.pods.get(key) if key else None
            uid = (payload.get("metadata") or {}).get("uid")
            if (
                known is not None
                and uid
                and (known.get("metadata") or {}).get("uid") not in (None, "", uid)
            ):
                return  # the deletion of an older pod with the same name
            if key:
                c.delete_pod(key)


def _key(pod: Mapping[str, Any]) -> str:
    try:
        return pod_ref(pod).key
    except DemandError:
        return ""


class WatchedPods:
    """Live mode's `PodFeed` (`extender.service`): pods come from the API server's watch.

    Nothing is learned from filter bodies (the watch has every pod, and a body must not write
    the cluster) and nothing is deleted here (the API server deletes; the watch follows). A pod
    kube-scheduler binds before the watch delivered it is read from the API with `read_pod`.
    """

    def __init__(
        self,
        cluster: ClusterState,
        read_pod: Callable[[str, str], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.read_pod = read_pod

    def learn(self, pod: Mapping[str, Any]) -> None:
        """The watch delivers every pod: a filter body adds nothing."""

    async def fetch(self, namespace: str, name: str) -> str | None:
        """kube-scheduler can be faster than the pod watch: read the pod rather than fail the bind."""
        if self.read_pod is None:
            return None
        key = f"{namespace}/{name}"
        try:
            pod = await self.read_pod(namespace, name)
        except ApiError as exc:
            return f"pod {key} is unknown to vramsched and unreadable ({exc.status} {exc.reason})"
        if self.cluster.pod(key) is None:
            self.cluster.upsert_pod(slim(pod))
        return None

    def delete(self, namespace: str, name: str) -> tuple[str, str] | None:
        return (
            "live",
            f"pods are deleted through the Kubernetes API (kubectl delete pod -n {namespace} {name}); vramsched follows the watch",
        )
