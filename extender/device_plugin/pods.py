"""The API server's side: the pods bound to this node (their specs and vramsched assignments),
the node itself (its GPU labels), and the state annotation the plugin publishes there.

`NodePods` is the extender's `Informer` (list, then watch from the list's version; resume, relist
on 410, back off on errors) over `/api/v1/pods?fieldSelector=spec.nodeName=<node>`, kept in a dict
under a lock because gRPC calls read it from their own threads. Allocate reads the cache; a pod
the kubelet lists before our watch delivered it is read from the API once (`get`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from extender.live.api_client import ApiError, ClientApi
from extender.live.informer import Informer
from extender.object_fields import uid_of
from extender.plugin_state import STATE_ANNOTATION, PluginState, encode_state

__all__ = ["NodeApi", "NodePods"]

log = logging.getLogger(__name__)


class NodeApi:
    """The few calls the plugin makes: the pods of one node (`ClientApi.list_paged` and
    `watch_stream` with a field selector), that node, and a merge patch of one annotation on it
    (`ClientApi`'s raw-JSON requests: it has no public node calls)."""

    def __init__(self, client: ClientApi, node: str) -> None:
        self.client = client
        self.node = node
        self._selector = f"spec.nodeName={node}"

    # the Informer's KubeApi subset, scoped to this node's pods
    def list(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        return self.client.list_paged("/api/v1/pods", {"fieldSelector": self._selector})

    def watch(self, kind: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        return self.client.watch_stream(
            "/api/v1/pods", resource_version, timeout_s, {"fieldSelector": self._selector}
        )

    def abort_watches(self) -> None:
        self.client.abort_watches()

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.client.read_pod(namespace, name)

    def read_node(self) -> dict[str, Any]:
        return self.client._json("GET", f"/api/v1/nodes/{self.node}")

    def publish(self, state: PluginState) -> None:
        """Write the state annotation on our node (merge patch: nothing else changes)."""
        self.client._json(
            "PATCH",
            f"/api/v1/nodes/{self.node}",
            body={"metadata": {"annotations": {STATE_ANNOTATION: encode_state(state)}}},
            content_type="application/merge-patch+json",
            timeout=self.client.write_timeout,
        )


class NodePods:
    """This node's pods by namespace/name, fed by an `Informer` thread."""

    def __init__(self, api: NodeApi, *, backoff_max: float = 10.0) -> None:
        self.api = api
        self._pods: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self.informer = Informer("pods", api, self._deliver, backoff_max=backoff_max)  # type: ignore[arg-type]
        #: called once per pod read from the API because the watch had not delivered it yet
        self.on_api_read: Callable[[], None] = lambda: None

    def start(self) -> None:
        self.informer.start()

    def stop(self) -> None:
        self.informer.stop()
        self.api.abort_watches()

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def _deliver(self, op: str, payload: Any) -> None:
        with self._lock:
            if op == "replace":
                self._pods = {k: p for p in payload if (k := _key(p))}
                self._synced.set()
            elif op in ("ADDED", "MODIFIED"):
                if key := _key(payload):
                    self._pods[key] = payload
            elif op == "DELETED":
                key = _key(payload)
                known = self._pods.get(key)
                if known is not None and uid_of(known) == uid_of(payload):
                    del self._pods[key]

    def snapshot(self, keys: Mapping[str, Any] | list[str]) -> dict[str, dict[str, Any]]:
        """The pods named by `keys` (namespace/name); ones the cache lacks are read from the API
        (the kubelet's watch can be ahead of ours). A pod the API no longer has is left out."""
        with self._lock:
            out = {k: self._pods[k] for k in keys if k in self._pods}
        for key in keys:
            if key not in out and (pod := self._read(key)) is not None:
                out[key] = pod
                with self._lock:
                    self._pods.setdefault(key, pod)
        return out

    def read(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The pods named by `keys` as the API has them now, whatever the cache holds: for
        cached objects the kubelet's list contradicts (a pod deleted and created again under its
        name while our watch lags). Left out: pods the API no longer has, or cannot tell. The
        cache is left to the watch."""
        return {key: pod for key in keys if (pod := self._read(key)) is not None}

    def _read(self, key: str) -> dict[str, Any] | None:
        namespace, _, name = key.partition("/")
        self.on_api_read()
        try:
            pod = self.api.read_pod(namespace, name)
        except ApiError as exc:
            if exc.status != 404:
                log.warning("cannot read pod %s: %s", key, exc)
            return None
        return pod if (pod.get("spec") or {}).get("nodeName") == self.api.node else None


def _key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    name = meta.get("name")
    return f"{meta.get('namespace') or 'default'}/{name}" if name else ""
