"""A scripted stand-in for the Kubernetes API, for the informer and binder unit tests.

It implements `extender.live.api_client.KubeApi`: `list`/`watch` replay scripted answers (a watch script is
a list of events or an exception to raise), and the write calls keep the pods in a dict the way
the API server would (merge-patch of annotations, Binding sets nodeName, 409 when bound; events
are kept in `events`).
Every call is recorded in `calls`, so tests can assert order and arguments.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from extender.live.api_client import ApiError


class FakeApi:
    def __init__(self) -> None:
        self.lists: dict[str, list[Any]] = {"nodes": [], "pods": []}
        self.watches: dict[str, list[Any]] = {"nodes": [], "pods": []}
        self.calls: list[tuple[Any, ...]] = []
        self.pods: dict[str, dict[str, Any]] = {}
        self.configmaps: dict[str, dict[str, Any]] = {}
        #: PersistentVolumeClaims by namespace/name, PersistentVolumes by name
        self.claims: dict[str, dict[str, Any]] = {}
        self.volumes: dict[str, dict[str, Any]] = {}
        #: what `list_in` answers, by kind: the objects of every namespace, or an error to raise
        self.namespaced: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.on_exhausted: Callable[[str], None] | None = None
        #: per write call: an ApiError to raise (once), or a callable run before answering
        self.fail: dict[str, list[Any]] = {}
        self.lock = threading.Lock()

    # ----- informer side ----------------------------------------------------------------------------
    def list(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        self.calls.append(("list", kind))
        if kind not in self.lists:  # a kind no test scripted: as if the RBAC did not allow it
            raise ApiError(403, "Forbidden", f"{kind} is forbidden")
        if not self.lists[kind]:
            self._exhausted(kind)
            raise ApiError(0, "Exhausted", "no more scripted lists")
        answer = self.lists[kind].pop(0)
        if isinstance(answer, BaseException):
            raise answer
        items, rv = answer
        return copy.deepcopy(items), rv

    def list_in(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        """The objects of `namespaced[kind]` in `namespace`; a kind not there answers 403, an
        ApiError put there is raised."""
        self.calls.append(("list_in", kind, namespace))
        if kind not in self.namespaced:
            raise ApiError(403, "Forbidden", f"{kind} is forbidden")
        found = self.namespaced[kind]
        if isinstance(found, BaseException):
            raise found
        return [
            copy.deepcopy(o)
            for o in found
            if (o.get("metadata") or {}).get("namespace", "default") == namespace
        ]

    def watch(self, kind: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        self.calls.append(("watch", kind, resource_version))
        if not self.watches[kind]:
            self._exhausted(kind)
            return iter(())
        script = self.watches[kind].pop(0)
        if isinstance(script, BaseException):
            raise script
        return self._replay(script)

    @staticmethod
    def _replay(script: list[Any]) -> Iterator[dict[str, Any]]:
        for item in script:
            if isinstance(item, BaseException):
                raise item
            yield copy.deepcopy(item)

    def abort_watches(self) -> None:
        self.calls.append(("abort",))

    def _exhausted(self, kind: str) -> None:
        if self.on_exhausted is not None:
            self.on_exhausted(kind)

    # ----- binder side ------------------------------------------------------------------------------
    def _maybe_fail(self, what: str) -> None:
        queue = self.fail.get(what)
        if queue:
            item = queue.pop(0)
            if isinstance(item, BaseException):
                raise item
            item()

    def add_pod(self, pod: Mapping[str, Any]) -> None:
        meta = pod["metadata"]
        self.pods[f"{meta.get('namespace', 'default')}/{meta['name']}"] = copy.deepcopy(dict(pod))

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("patch_pod", namespace, name, copy.deepcopy(dict(patch))))
        self._maybe_fail("patch_pod")
        pod = self.pods.get(f"{namespace}/{name}")
        if pod is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        meta = pod["metadata"]
        want_uid = (patch.get("metadata") or {}).get("uid")
        if want_uid and want_uid != meta.get("uid"):
            raise ApiError(422, "Invalid", "metadata.uid: field is immutable")
        _check_version(pod, patch)
        ann = dict(meta.get("annotations") or {})
        for k, v in ((patch.get("metadata") or {}).get("annotations") or {}).items():
            if v is None:
                ann.pop(k, None)
            else:
                ann[k] = v
        meta["annotations"] = ann
        _bump_version(pod)
        return copy.deepcopy(pod)

    def edit_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Someone else's update of a pod's annotations (a user's `kubectl annotate`)."""
        pod = self.pods[f"{namespace}/{name}"]
        pod["metadata"]["annotations"] = {
            **(pod["metadata"].get("annotations") or {}),
            **annotations,
        }
        _bump_version(pod)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append(("read_pod", namespace, name))
        pod = self.pods.get(f"{namespace}/{name}")
        if pod is None:
            raise ApiError(404, "NotFound", "")
        return copy.deepcopy(pod)

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append(("read_claim", namespace, name))
        self._maybe_fail("read_claim")
        claim = self.claims.get(f"{namespace}/{name}")
        if claim is None:
            raise ApiError(404, "NotFound", "")
        return copy.deepcopy(claim)

    def read_volume(self, name: str) -> dict[str, Any]:
        self.calls.append(("read_volume", name))
        volume = self.volumes.get(name)
        if volume is None:
            raise ApiError(404, "NotFound", "")
        return copy.deepcopy(volume)

    def create_binding(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        self.calls.append(("create_binding", namespace, name, copy.deepcopy(dict(body))))
        self._maybe_fail("create_binding")
        with self.lock:
            pod = self.pods.get(f"{namespace}/{name}")
            if pod is None:
                raise ApiError(404, "NotFound", "")
            uid = (body.get("metadata") or {}).get("uid")
            if uid and uid != pod["metadata"].get("uid"):
                raise ApiError(409, "Conflict", "Precondition failed: UID")
            _check_version(pod, body)
            if pod["spec"].get("nodeName"):
                raise ApiError(
                    409,
                    "Conflict",
                    f"pod {name} is already assigned to node {pod['spec']['nodeName']}",
                )
            pod["spec"]["nodeName"] = body["target"]["name"]
            _bump_version(pod)

    def create_configmap(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("create_configmap", namespace, copy.deepcopy(dict(body))))
        self._maybe_fail("create_configmap")
        key = f"{namespace}/{body['metadata']['name']}"
        if key in self.configmaps:
            raise ApiError(409, "AlreadyExists", "")
        stored = copy.deepcopy(dict(body))
        stored["metadata"].update(uid=f"cm-{len(self.calls)}", resourceVersion="1")
        self.configmaps[key] = stored
        return copy.deepcopy(stored)

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls.append(("read_configmap", namespace, name))
        cm = self.configmaps.get(f"{namespace}/{name}")
        if cm is None:
            raise ApiError(404, "NotFound", "")
        return copy.deepcopy(cm)

    def patch_configmap(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A merge patch of `data`, with the API's preconditions: `metadata.uid` and
        `metadata.resourceVersion` in the patch must be the stored ones (409 otherwise)."""
        self.calls.append(("patch_configmap", namespace, name, copy.deepcopy(dict(patch))))
        self._maybe_fail("patch_configmap")
        cm = self.configmaps.get(f"{namespace}/{name}")
        if cm is None:
            raise ApiError(404, "NotFound", "")
        meta, want = cm.setdefault("metadata", {}), patch.get("metadata") or {}
        if "uid" in want and want["uid"] != meta.get("uid"):
            raise ApiError(409, "Conflict", "precondition failed: uid")
        _check_version(cm, patch)
        data = dict(cm.get("data") or {})
        for key, value in (patch.get("data") or {}).items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        cm["data"] = data
        meta["resourceVersion"] = str(int(meta.get("resourceVersion") or "0") + 1)
        return copy.deepcopy(cm)

    def server_version(self) -> dict[str, Any]:
        self.calls.append(("server_version",))
        return {"major": "1", "minor": "34"}

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> None:
        self.calls.append(("create_event", namespace, copy.deepcopy(dict(body))))
        self._maybe_fail("create_event")
        if (body.get("involvedObject") or {}).get("namespace") != namespace:
            raise ApiError(
                422, "Invalid", "involvedObject.namespace: does not match event.namespace"
            )
        self.events.append(copy.deepcopy(dict(body)))

    def writes(self) -> list[str]:
        return [
            c[0]
            for c in self.calls
            if c[0] in ("patch_pod", "create_binding", "create_configmap", "patch_configmap")
        ]


def _check_version(stored: Mapping[str, Any], request: Mapping[str, Any]) -> None:
    """A write naming a resourceVersion applies only to that version (409 otherwise), as the
    API server's optimistic concurrency does for a merge patch and for a Binding."""
    want = (request.get("metadata") or {}).get("resourceVersion")
    have = (stored.get("metadata") or {}).get("resourceVersion")
    if want and want != have:
        raise ApiError(
            409,
            "Conflict",
            "the object has been modified; please apply your changes to the latest version",
        )


def _bump_version(stored: dict[str, Any]) -> None:
    """A new resourceVersion after a write, for objects that carry one."""
    meta = stored["metadata"]
    if meta.get("resourceVersion"):
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
