"""The few Kubernetes API calls live mode makes, and the client that makes them.

`KubeApi` is the seam: `ClientApi` talks to a server through the official `kubernetes` client on
raw JSON; the tests hand the informers and the binder a scripted fake instead.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import orjson

__all__ = [
    "ApiError",
    "KubeApi",
    "ClientApi",
    "KubeconfigError",
    "LIST_PAGE",
    "load_client",
    "annotation_patch",
]

LIST_PAGE = 500


class ApiError(Exception):
    """An API answer that is not 2xx, or no answer at all (`status` 0: connection, timeout)."""

    def __init__(self, status: int, reason: str = "", message: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}".strip(": "))
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying as is: no answer, throttled, or a server-side failure."""
        return self.status == 0 or self.status == 429 or self.status >= 500


def annotation_patch(
    uid: str, annotations: Mapping[str, str | None], resource_version: str = ""
) -> dict[str, Any]:
    """A merge patch of a pod's annotations (None removes one), with its UID as precondition
    when known: the API refuses it for a pod created again under the name meanwhile. With a
    `resource_version`, also for a pod changed since that version (409 Conflict)."""
    meta: dict[str, Any] = {"annotations": dict(annotations)}
    if uid:
        meta["uid"] = uid
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {"metadata": meta}


class KubeconfigError(Exception):
    """The client configuration could not be loaded; the message is one line naming where from
    and why."""


def load_client(kubeconfig: str | None) -> Any:
    """A `kubernetes.client.ApiClient` from this kubeconfig, else from the in-cluster
    ServiceAccount. Why one place: the client raises many kinds for a bad configuration
    (ConfigException, a YAML error over several lines, OSError, TypeError), and every command
    reports them alike, as one `KubeconfigError` line."""
    import kubernetes.client
    import kubernetes.config

    try:
        if kubeconfig:
            return kubernetes.config.new_client_from_config(config_file=kubeconfig)
        config = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=config)
        return kubernetes.client.ApiClient(config)
    except Exception as exc:  # many kinds: see the docstring
        where = kubeconfig or "the in-cluster ServiceAccount"
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise KubeconfigError(
            f"cannot load the Kubernetes client configuration from {where}: {why}"
        ) from None


class KubeApi(Protocol):
    """The few API calls vramsched makes; `ClientApi` talks to a server, tests use a fake."""

    def list(self, kind: str) -> tuple[list[dict[str, Any]], str]: ...

    def list_in(self, kind: str, namespace: str) -> Sequence[dict[str, Any]]: ...

    def watch(
        self, kind: str, resource_version: str, timeout_s: int
    ) -> Iterator[dict[str, Any]]: ...

    def abort_watches(self) -> None: ...

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    def read_volume(self, name: str) -> dict[str, Any]: ...

    def create_binding(self, namespace: str, name: str, body: Mapping[str, Any]) -> None: ...

    def create_configmap(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any]: ...

    def patch_configmap(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]: ...

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> None: ...

    def server_version(self) -> dict[str, Any]: ...


_PATHS = {
    "nodes": "/api/v1/nodes",
    "pods": "/api/v1/pods",
    "persistentvolumeclaims": "/api/v1/persistentvolumeclaims",
    "persistentvolumes": "/api/v1/persistentvolumes",
    "csinodes": "/apis/storage.k8s.io/v1/csinodes",
    "volumeattachments": "/apis/storage.k8s.io/v1/volumeattachments",
    "storageclasses": "/apis/storage.k8s.io/v1/storageclasses",
    "csidrivers": "/apis/storage.k8s.io/v1/csidrivers",
    "csistoragecapacities": "/apis/storage.k8s.io/v1/csistoragecapacities",
    "services": "/api/v1/services",
    "replicationcontrollers": "/api/v1/replicationcontrollers",
    "replicasets": "/apis/apps/v1/replicasets",
    "statefulsets": "/apis/apps/v1/statefulsets",
}

#: kinds read one namespace at a time (`list_in`): what default topology spread selects by
_NAMESPACED = {
    "services": "/api/v1/namespaces/{}/services",
    "replicationcontrollers": "/api/v1/namespaces/{}/replicationcontrollers",
    "replicasets": "/apis/apps/v1/namespaces/{}/replicasets",
    "statefulsets": "/apis/apps/v1/namespaces/{}/statefulsets",
}


class ClientApi:
    """`KubeApi` over the official `kubernetes` client, on raw JSON (no model objects).

    The generated models cost more to build than everything vramsched does with a pod, and
    `ClusterState` wants plain dicts with the API's own keys, so responses are parsed with
    orjson and requests go through the client's serializer, auth and TLS only.
    """

    def __init__(
        self,
        kubeconfig: str | None = None,
        *,
        request_timeout: float = 10.0,
        write_timeout: tuple[float, float] = (2.0, 2.5),
    ) -> None:
        self.client = load_client(kubeconfig)
        # A watch and a few binds run at the same time: one pooled connection each.
        self.client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 16
        self.request_timeout = request_timeout
        # Bind is two or three writes inside kube-scheduler's 5 s: give up on each well before.
        self.write_timeout = write_timeout
        self._watch_lock = threading.Lock()
        self._watches: set[Any] = set()

    # ----- plumbing ------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: Any = None,
    ) -> Any:
        import urllib3

        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = [(k, v) for k, v in (query or {}).items() if v is not None]
        try:
            req = self.client.param_serialize(
                method=method,
                resource_path=path,
                query_params=params,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.client.call_api(*req, _request_timeout=timeout or self.request_timeout)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc)[:300]) from None
        except Exception as exc:  # kubernetes.client.ApiException and friends
            status = getattr(exc, "status", None)
            if status:
                raise ApiError(
                    int(status),
                    str(getattr(exc, "reason", "")),
                    str(getattr(exc, "body", ""))[:300],
                ) from None
            raise
        return resp.response

    @staticmethod
    def _error(resp: Any) -> ApiError:
        raw = resp.data
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            body = {}
        return ApiError(
            int(resp.status),
            str(body.get("reason") or resp.reason or ""),
            str(body.get("message") or "")[:300],
        )

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        import urllib3

        resp = self._request(method, path, **kw)
        try:
            data = resp.data
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc)[:300]) from None
        if not 200 <= resp.status < 300:
            raise self._error(resp)
        return orjson.loads(data) if data else {}

    # ----- informers -----------------------------------------------------------------------------
    def list_paged(
        self, path: str, query: Mapping[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """Every item of the collection at `path` (extra `query`, e.g. a fieldSelector), read in
        pages of LIST_PAGE, and the list's resourceVersion to watch from."""
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while True:
            page = self._json(
                "GET",
                path,
                query={**(query or {}), "limit": LIST_PAGE, "continue": cont},
                timeout=60,
            )
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            cont = meta.get("continue") or None
            if not cont:
                return items, str(meta.get("resourceVersion") or "")

    def watch_stream(
        self,
        path: str,
        resource_version: str,
        timeout_s: int,
        query: Mapping[str, Any] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Watch the collection at `path` from `resource_version` (extra `query`, e.g. a
        fieldSelector): opens the watch now, raising ApiError when the API refuses it, then
        yields its events; `abort_watches` ends it."""
        resp = self._request(
            "GET",
            path,
            query={
                **(query or {}),
                "watch": "true",
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": timeout_s,
            },
            timeout=(10, timeout_s + 30),
        )
        if not 200 <= resp.status < 300:
            raise self._error(resp)
        return self._stream(resp)

    def list(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        """A consistent list in pages; 410 on an expired continue token is the caller's relist."""
        return self.list_paged(_PATHS[kind])

    def list_in(self, kind: str, namespace: str) -> Sequence[dict[str, Any]]:
        """Every object of `kind` (a key of `_NAMESPACED`) in `namespace`."""
        return self.list_paged(_NAMESPACED[kind].format(namespace))[0]

    def watch(self, kind: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        """Opens the watch now (so the caller knows the API answered), then streams its events."""
        return self.watch_stream(_PATHS[kind], resource_version, timeout_s)

    def _stream(self, resp: Any) -> Iterator[dict[str, Any]]:
        import urllib3
        from kubernetes.watch.watch import iter_resp_lines

        with self._watch_lock:
            self._watches.add(resp)
        try:
            for line in iter_resp_lines(resp):
                if line:
                    yield orjson.loads(line)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc)[:300]) from None
        finally:
            with self._watch_lock:
                self._watches.discard(resp)
            resp.release_conn()

    def abort_watches(self) -> None:
        """Unblock the informer threads' reads (used at shutdown)."""
        with self._watch_lock:
            watches = list(self._watches)
        for resp in watches:
            sock = getattr(getattr(resp, "connection", None), "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    # ----- binder ----------------------------------------------------------------------------------
    def _merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (metadata.uid and resourceVersion in it act as preconditions)."""
        return self._json(
            "PATCH",
            path,
            body=dict(patch),
            content_type="application/merge-patch+json",
            timeout=self.write_timeout,
        )

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._merge_patch(f"/api/v1/namespaces/{namespace}/pods/{name}", patch)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self._json(
            "GET", f"/api/v1/namespaces/{namespace}/pods/{name}", timeout=self.write_timeout
        )

    def read_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A PersistentVolumeClaim (live repacking: where a movable pod's volumes reach)."""
        return self._json(
            "GET",
            f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}",
            timeout=self.write_timeout,
        )

    def read_volume(self, name: str) -> dict[str, Any]:
        return self._json("GET", f"/api/v1/persistentvolumes/{name}", timeout=self.write_timeout)

    def server_version(self) -> dict[str, Any]:
        """GET /version (readable by anyone: the system:public-info-viewer role)."""
        return self._json("GET", "/version", timeout=self.write_timeout)

    def create_binding(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        self._json(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods/{name}/binding",
            body=dict(body),
            timeout=self.write_timeout,
        )

    def create_configmap(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(
            "POST",
            f"/api/v1/namespaces/{namespace}/configmaps",
            body=dict(body),
            timeout=self.write_timeout,
        )

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any]:
        return self._json("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}")

    def patch_configmap(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return self._merge_patch(f"/api/v1/namespaces/{namespace}/configmaps/{name}", patch)

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> None:
        # core/v1, not events.k8s.io: the same call works from 1.20 to today.
        self._json(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            body=dict(body),
            timeout=self.write_timeout,
        )
