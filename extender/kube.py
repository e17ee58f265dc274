"""Live mode: the Kubernetes API server is vramsched's only source of truth.

Two adapters, nothing else:

- `LiveSource`: one informer per resource (nodes, then pods in all namespaces). Each informer
  lists, then watches from the list's resourceVersion, resumes from the last version it saw
  when a watch ends or breaks, relists on 410 Gone, and backs off on errors. The blocking
  client calls run in one daemon thread per informer; every change is applied to
  `ClusterState` on the event loop (`call_soon_threadsafe`), so the ledger keeps a single
  owner and no lock exists at all. Readiness flips after the first full sync of both.
- `KubeBinder`: writes the assignment annotations on the pod, optionally the pinning
  ConfigMap, then creates the Binding (`pods/binding`). The API calls run in a thread pool;
  the reservation was already taken synchronously by the service before the first await.
  After a bind it hands one `VramschedAssigned` Event to `EventRecorder`, which posts it later
  from a bounded queue: an event never delays or fails a bind.

The ledger is derived from what the API returns (bound pods and their `vramsched.io/`
annotations), so a restart, a second replica or a relist rebuilds it identically.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extender.assignment import encode_assignment
from extender.bind_event import bind_event, bind_message
from extender.cluster import ClusterState
from extender.demand import (
    ASSIGNMENT,
    GPU_INDEX,
    PIN_ENV,
    DemandError,
    pod_ref,
    reads_pin_annotation,
)
from extender.inventory import ReplicaPolicy
from extender.ledger import Reservation
from extender.pinning import (
    pin_configmap_name,
    pin_environment,
    references_pin_configmap,
)
from extender.quantity import format_bytes
from extender.service import BindError, ExtenderService
from extender.sizing.handoff import FRACTION_ANNOTATION, bind_fraction
from extender.stock_plugin import is_time_sliced
from extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    HostPriority,
)

__all__ = [
    "needs_legacy_failed_nodes",
    "ApiError",
    "KubeApi",
    "ClientApi",
    "Informer",
    "LiveSource",
    "KubeBinder",
    "EventRecorder",
    "BindUncertain",
    "LiveService",
    "NOT_SYNCED",
]

log = logging.getLogger(__name__)

NOT_SYNCED = "vramsched is still syncing nodes and pods from the API server"
# Server-side watch timeouts are randomised like client-go's (5-10 min there), so that the
# informers of many replicas do not all reconnect at the same moment.
WATCH_TIMEOUT_RANGE = (240, 300)
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


class KubeApi(Protocol):
    """The few API calls vramsched makes; `ClientApi` talks to a server, tests use a fake."""

    def list(self, kind: str) -> tuple[list[dict[str, Any]], str]: ...

    def watch(
        self, kind: str, resource_version: str, timeout_s: int
    ) -> Iterator[dict[str, Any]]: ...

    def abort_watches(self) -> None: ...

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]: ...

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    def create_binding(self, namespace: str, name: str, body: Mapping[str, Any]) -> None: ...

    def create_configmap(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def read_configmap(self, namespace: str, name: str) -> dict[str, Any]: ...

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> None: ...

    def server_version(self) -> dict[str, Any]: ...


_PATHS = {"nodes": "/api/v1/nodes", "pods": "/api/v1/pods"}


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
        import kubernetes.client
        import kubernetes.config

        if kubeconfig:
            self.client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        else:
            config = kubernetes.client.Configuration()
            kubernetes.config.load_incluster_config(client_configuration=config)
            self.client = kubernetes.client.ApiClient(config)
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
    def list(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        """A consistent list in pages; 410 on an expired continue token is the caller's relist."""
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while True:
            page = self._json(
                "GET", _PATHS[kind], query={"limit": LIST_PAGE, "continue": cont}, timeout=60
            )
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            cont = meta.get("continue") or None
            if not cont:
                return items, str(meta.get("resourceVersion") or "")

    def watch(self, kind: str, resource_version: str, timeout_s: int) -> Iterator[dict[str, Any]]:
        """Opens the watch now (so the caller knows the API answered), then streams its events."""
        resp = self._request(
            "GET",
            _PATHS[kind],
            query={
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
        import socket

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
    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._json(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body=dict(patch),
            content_type="application/merge-patch+json",
            timeout=self.write_timeout,
        )

    def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self._json(
            "GET", f"/api/v1/namespaces/{namespace}/pods/{name}", timeout=self.write_timeout
        )

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

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> None:
        # core/v1, not events.k8s.io: the same call works from 1.20 to today.
        self._json(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            body=dict(body),
            timeout=self.write_timeout,
        )


# ===== informers ===================================================================================


@dataclass
class InformerStats:
    """What /readyz reports per resource."""

    synced: bool = False
    resource_version: str = ""
    lists: int = 0
    relists_gone: int = 0
    watch_resumes: int = 0
    errors: int = 0
    last_error: str = ""
    events: int = 0
    #: a list or watch is answering now; False from the first error until one answers again
    connected: bool = False
    down_since: float | None = None  # time.monotonic() of the first error of the current outage

    def as_dict(self) -> dict[str, Any]:
        return {
            "synced": self.synced,
            "resourceVersion": self.resource_version,
            "lists": self.lists,
            "relistsGone": self.relists_gone,
            "watchResumes": self.watch_resumes,
            "errors": self.errors,
            "lastError": self.last_error,
            "events": self.events,
            "connected": self.connected,
            "downForS": round(time.monotonic() - self.down_since, 1)
            if self.down_since is not None
            else 0.0,
        }

    def up(self) -> None:
        self.connected, self.down_since = True, None

    def down(self) -> None:
        self.connected = False
        if self.down_since is None:
            self.down_since = time.monotonic()


Deliver = Callable[[str, Any], None]


class Informer:
    """List + watch of one resource in a thread; hands `("replace", items)` and
    `(event_type, object)` to `deliver`, which must hand them to the event loop.

    The loop: list (paged) -> deliver replace -> watch from its resourceVersion; when a watch
    ends (server timeout) or breaks (connection), watch again from the last version seen;
    on 410 Gone (version compacted) list again; on any other error back off exponentially
    (with jitter, capped) and retry the same step.
    """

    def __init__(
        self,
        kind: str,
        api: KubeApi,
        deliver: Deliver,
        *,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        watch_timeout: tuple[int, int] = WATCH_TIMEOUT_RANGE,
        may_start: threading.Event | None = None,
    ) -> None:
        self.kind = kind
        self.api = api
        self.deliver = deliver
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.watch_timeout = watch_timeout
        self.may_start = may_start
        self.stats = InformerStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._delay = 0.0
        self._fresh = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"informer-{self.kind}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        if self.may_start is not None:
            while not self.may_start.wait(0.2):
                if self._stop.is_set():
                    return
        self.stats.resource_version = ""
        while not self._stop.is_set():
            # The version to resume from is the last one delivered, even when a watch broke mid-way.
            rv = self.stats.resource_version
            try:
                if not rv:
                    rv = self._list()
                self._watch(rv)
            except ApiError as exc:
                if exc.status == 410:
                    self.stats.relists_gone += 1
                    log.info(
                        "watch expired, relisting",
                        extra={"fields": {"kind": self.kind, "resourceVersion": rv}},
                    )
                    self.stats.resource_version = ""
                    continue
                self._failed(exc)
            except Exception as exc:  # an informer thread must never die
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if self._stop.is_set():
            return  # shutting down: the aborted watch is not an error
        self.stats.errors += 1
        self.stats.last_error = str(exc)[:300]
        self.stats.down()
        self._delay = min(self.backoff_max, max(self.backoff_initial, self._delay * 2))
        delay = self._delay * random.uniform(0.8, 1.2)
        log.warning(
            "informer error, retrying",
            extra={
                "fields": {
                    "kind": self.kind,
                    "error": self.stats.last_error,
                    "retryInS": round(delay, 2),
                }
            },
        )
        self._stop.wait(delay)

    def _list(self) -> str:
        items, rv = self.api.list(self.kind)
        self.stats.up()
        for item in items:
            _slim(item)
        self.stats.lists += 1
        self.deliver("replace", items)
        self.stats.resource_version = rv
        self.stats.synced = True
        self._delay = 0.0
        self._fresh = True
        return rv

    def _watch(self, rv: str) -> str:
        if not self._fresh:
            self.stats.watch_resumes += 1  # from the last version seen, not from a new list
        self._fresh = False
        timeout = random.randint(*self.watch_timeout)
        events = self.api.watch(self.kind, rv, timeout)
        self.stats.up()
        self._delay = 0.0  # the API answers again: the next outage starts its backoff afresh
        for event in events:
            if self._stop.is_set():
                break
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                code = int(obj.get("code") or 0)
                raise ApiError(
                    code or 500, str(obj.get("reason") or ""), str(obj.get("message") or "")
                )
            new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            if kind != "BOOKMARK":
                self.stats.events += 1
                self.deliver(str(kind), _slim(obj))
            if new_rv:
                rv = new_rv
                self.stats.resource_version = rv
            self._delay = 0.0
        return rv


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    """Drop managedFields: often the largest part of an object, and nothing vramsched reads."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


class LiveSource:
    """Feeds `ClusterState` from the API and binds through it. Owned by one event loop."""

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


# ===== binder =======================================================================================


class EventRecorder:
    """Posts Events from a bounded queue, one at a time, off the bind path.

    `emit` never blocks and never raises: it queues the event (the first call starts the sender
    task on the running loop) or, when the queue is full because the API server is slow or
    away, drops it. Each post runs in a thread of its own with the client's write timeout, so a
    stuck events call never takes a bind worker. `sent`, `failed` and `dropped` count outcomes
    (exported as `vramsched_bind_events_total{outcome}` and in /readyz).
    """

    def __init__(self, api: KubeApi, *, capacity: int = 256) -> None:
        self.api = api
        self.capacity = capacity
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def queued(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    def emit(self, namespace: str, body: dict[str, Any]) -> None:
        """Queue one event; call from the event loop."""
        if self._closed:
            self.dropped += 1
            return
        if self._queue is None:
            self._queue = asyncio.Queue(self.capacity)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="vramsched-events"
            )
        try:
            self._queue.put_nowait((namespace, body))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning(
                    "event queue full, event dropped",
                    extra={"fields": {"dropped": self.dropped, "capacity": self.capacity}},
                )

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            namespace, body = await self._queue.get()
            try:
                await loop.run_in_executor(self._pool, self.api.create_event, namespace, body)
                self.sent += 1
            except Exception as exc:  # an event is never worth more than a log line
                self.failed += 1
                log.warning(
                    "cannot create event",
                    extra={
                        "fields": {
                            "pod": f"{namespace}/{(body.get('involvedObject') or {}).get('name')}",
                            "error": str(exc)[:300],
                        }
                    },
                )
            finally:
                self._queue.task_done()

    async def drain(self) -> None:
        """Wait until every queued event was posted or failed (tests, orderly shutdown)."""
        if self._queue is not None:
            await self._queue.join()

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, int]:
        return {
            "sent": self.sent,
            "failed": self.failed,
            "dropped": self.dropped,
            "queued": self.queued,
        }


class _EventCollector(Collector):
    """The recorder's counters for /metrics, read at scrape time."""

    def __init__(self, recorder: EventRecorder) -> None:
        self._recorder = recorder

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        r = self._recorder
        counter = CounterMetricFamily(
            "vramsched_bind_events", "VramschedAssigned events by outcome", labels=["outcome"]
        )
        for outcome, value in (("sent", r.sent), ("failed", r.failed), ("dropped", r.dropped)):
            counter.add_metric([outcome], value)
        yield counter
        yield GaugeMetricFamily(
            "vramsched_bind_events_queued", "Events waiting to be posted", value=r.queued
        )


class BindUncertain(BindError):
    """The Binding may or may not have landed (timeout, 5xx): keep the reservation as assumed;
    its TTL or the watch settles it, and kube-scheduler's retry finds the pod already bound."""

    keep_reservation = True


class KubeBinder:
    """Annotations first, then (optionally) the pinning ConfigMap, then the Binding.

    Annotations first, so that whoever sees the pod bound also sees which devices it holds:
    a restart rebuilds the ledger from them. Idempotent: kube-scheduler calls bind again when
    its 5 s timeout expired although the Binding landed; a 409 on the Binding is success
    when the pod is bound to the same node. No lock is held: the reservation was made by the
    service before this is awaited, and every API call runs in the thread pool.
    """

    def __init__(
        self,
        api: KubeApi,
        *,
        pinned: bool = False,
        workers: int = 8,
        cluster: ClusterState | None = None,
        events: EventRecorder | None = None,
    ) -> None:
        self.api = api
        self.cluster = cluster
        self.pinned = pinned
        self.events = events if events is not None else EventRecorder(api)
        self.instance = socket.gethostname()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bind")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.events.close()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a blocking client call in the binder's pool, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def annotations(
        self, pod: Mapping[str, Any], reservation: Reservation
    ) -> dict[str, str | None]:
        """The assignment always; `gpu-index` only when the GPU choice is really enforced (pinned).

        Without pinning the device plugin, not vramsched, picks the physical GPU: the devices in
        the assignment are the ledger's accounting slots, and a GPU index would be a false claim.
        """
        out: dict[str, str | None] = dict(encode_assignment(reservation))
        if not self._pins(pod, reservation):
            out[GPU_INDEX] = None
        inv = self.cluster.ledger.node(reservation.node) if self.cluster is not None else None
        out[FRACTION_ANNOTATION] = bind_fraction(
            pod, reservation.device_ids, inv.devices if inv else ()
        )
        return out

    def _pins(self, pod: Mapping[str, Any], reservation: Reservation) -> bool:
        """The pod takes a pin (either form) and this reservation gets a real one, or vramsched's
        device plugin serves the node (the index is then the GPU the container gets)."""
        if self._plugin_served(reservation):
            return True
        env = pin_environment(reservation, self.pinned, self._time_sliced(reservation))
        return PIN_ENV in env and (references_pin_configmap(pod) or reads_pin_annotation(pod))

    def _plugin_served(self, reservation: Reservation) -> bool:
        inv = self.cluster.ledger.node(reservation.node) if self.cluster is not None else None
        ids = set(reservation.device_ids)
        held = [d for d in inv.devices if d.device_id in ids] if inv is not None else []
        return bool(held) and all(getattr(d, "plugin_served", False) for d in held)

    def _time_sliced(self, reservation: Reservation) -> bool:
        inv = self.cluster.ledger.node(reservation.node) if self.cluster is not None else None
        if inv is None:
            return False
        ids = set(reservation.device_ids)
        return any(is_time_sliced(d) for d in inv.devices if d.device_id in ids)

    async def bind(
        self, pod: Mapping[str, Any], node: str, reservation: Reservation | None
    ) -> None:
        ref = pod_ref(pod)
        started = time.monotonic()
        if (
            reservation is not None
            and reads_pin_annotation(pod)
            and not self._pins(pod, reservation)
        ):
            # Its containers would start with NVIDIA_VISIBLE_DEVICES="" (no GPU at all). Filter
            # keeps such pods off unpinnable nodes; this guards any other way in. Nothing written.
            raise BindError(
                f"pod {ref.key} reads {PIN_ENV} from annotation {GPU_INDEX}, "
                f"but its GPUs on {node} cannot be pinned; it would start without a GPU"
            )
        if reservation is not None:
            patch = {
                "metadata": {
                    "uid": ref.uid or None,
                    "annotations": self.annotations(pod, reservation),
                }
            }
            if not ref.uid:
                del patch["metadata"]["uid"]
            try:
                await self.call(self.api.patch_pod, ref.namespace, ref.name, patch)
            except ApiError as exc:
                raise _definite(exc, f"cannot annotate pod {ref.key}") from None
            if references_pin_configmap(pod):
                await self._configmap(pod, reservation)
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {
                "name": ref.name,
                "namespace": ref.namespace,
                **({"uid": ref.uid} if ref.uid else {}),
            },
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        try:
            await self.call(self.api.create_binding, ref.namespace, ref.name, binding)
        except ApiError as exc:
            if exc.status == 409:
                await self._already_bound(ref, node, exc)
            elif exc.transient:
                log.warning(
                    "bind outcome unknown",
                    extra={"fields": {"pod": ref.key, "node": node, "error": str(exc)}},
                )
                raise BindUncertain(
                    f"Binding to {node} may not have landed ({exc.status or exc.reason}); will retry"
                ) from None
            else:
                if reservation is not None:
                    await self._unannotate(ref)
                raise _definite(exc, f"Binding to {node} rejected") from None
        if reservation is not None:
            # The API accepted the Binding: the hold is now the truth, not a guess that may lapse.
            # It stays `assumed` until the watch shows the pod, but no TTL can free it meanwhile:
            # a watch lagging or reconnecting for longer than the TTL must not double-book.
            # (A relist drops it if the pod was deleted in the meantime.)
            reservation.expires_at = None
            self._record_event(pod, reservation)
        log.info(
            "bound",
            extra={
                "fields": {
                    "pod": ref.key,
                    "node": node,
                    "devices": list(reservation.device_ids) if reservation else [],
                    "bytes": reservation.total_bytes if reservation else 0,
                    "ms": round((time.monotonic() - started) * 1000, 1),
                }
            },
        )

    def _record_event(self, pod: Mapping[str, Any], reservation: Reservation) -> None:
        """One `VramschedAssigned` Event per bind, queued: never delays or fails the bind."""
        try:
            if self.cluster is not None:
                message = bind_message(
                    self.cluster.ledger, reservation, self._pins(pod, reservation)
                )
            else:
                message = f"reserved {format_bytes(reservation.total_bytes)} on {reservation.node}"
            ref = pod_ref(pod)
            self.events.emit(ref.namespace, bind_event(ref, message, time.time(), self.instance))
        except Exception:  # the bind succeeded; an event must not turn it into a failure
            log.exception("cannot build the bind event")
            self.events.failed += 1

    async def _already_bound(self, ref: Any, node: str, exc: ApiError) -> None:
        try:
            current = await self.call(self.api.read_pod, ref.namespace, ref.name)
        except ApiError as read_exc:
            raise BindUncertain(
                f"Binding conflict and pod unreadable ({read_exc.status})"
            ) from None
        meta = current.get("metadata") or {}
        if ref.uid and meta.get("uid") and meta.get("uid") != ref.uid:
            raise BindError(f"pod {ref.key} was re-created (UID {meta.get('uid')})")
        bound = (current.get("spec") or {}).get("nodeName")
        if bound == node:
            return  # a retried bind whose first Binding landed: success
        if bound:
            raise BindError(f"pod {ref.key} is already bound to {bound}")
        raise BindUncertain(
            f"Binding conflict ({exc.message or exc.reason}) but pod is not bound yet"
        )

    async def _configmap(self, pod: Mapping[str, Any], reservation: Reservation) -> None:
        ref = pod_ref(pod)
        name = pin_configmap_name(ref.name)
        data = pin_environment(reservation, self.pinned, self._time_sliced(reservation))
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": ref.namespace,
                "labels": {"app.kubernetes.io/managed-by": "vramsched"},
                # No blockOwnerDeletion: that would need update on pods/finalizers.
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Pod", "name": ref.name, "uid": ref.uid}
                ],
            },
            "data": data,
        }
        try:
            await self.call(self.api.create_configmap, ref.namespace, body)
            return
        except ApiError as exc:
            if exc.status != 409:
                raise _definite(exc, f"cannot create ConfigMap {name}") from None
        try:
            existing = await self.call(self.api.read_configmap, ref.namespace, name)
        except ApiError as exc:
            raise _definite(exc, f"ConfigMap {name} exists but is unreadable") from None
        owners = [
            o.get("uid") for o in (existing.get("metadata") or {}).get("ownerReferences") or []
        ]
        if ref.uid not in owners:
            raise BindError(
                f"ConfigMap {name} exists and belongs to another pod (garbage collection pending?)"
            )
        if (existing.get("data") or {}) != data:
            raise BindError(
                f"ConfigMap {name} pins other GPUs ({(existing.get('data') or {}).get('NVIDIA_VISIBLE_DEVICES')})"
            )

    async def _unannotate(self, ref: Any) -> None:
        """Best effort after a definite failure: a pending pod should not carry a stale assignment."""
        try:
            await self.call(
                self.api.patch_pod,
                ref.namespace,
                ref.name,
                {
                    "metadata": {
                        "annotations": {
                            ASSIGNMENT: None,
                            GPU_INDEX: None,
                            FRACTION_ANNOTATION: None,
                        }
                    }
                },
            )
        except ApiError:
            pass


def _definite(exc: ApiError, what: str) -> BindError:
    detail = exc.message or exc.reason or "no answer"
    if exc.status == 404:
        return BindError(f"{what}: pod no longer exists")
    if exc.status == 403:
        return BindError(f"{what}: forbidden by RBAC ({detail})")
    if exc.status == 0:
        return BindError(f"{what}: API server unreachable ({detail})")
    return BindError(f"{what}: {exc.status} {detail}")


# ===== the service, gated on the first sync ====================================================


class LiveService(ExtenderService):
    """Until the informers have listed everything, the ledger does not know what is already
    bound: refuse to place anything rather than double-book (kube-scheduler retries)."""

    def __init__(self, cluster: ClusterState, source: LiveSource, **kwargs: Any) -> None:
        super().__init__(cluster, source.binder, live=True, **kwargs)
        self.source = source

    def metric_collectors(self) -> list[Collector]:
        """Extra /metrics of live mode (registered by `extender.server.create_app`)."""
        return [_EventCollector(self.source.binder.events)]

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        if not self.source.synced:
            return ExtenderFilterResult(Error=NOT_SYNCED)
        return super().filter(args)

    def prioritize(self, args: ExtenderArgs) -> list[HostPriority]:
        if not self.source.synced:
            names = args.NodeNames or [
                str((n.get("metadata") or {}).get("name", ""))
                for n in (args.Nodes.items if args.Nodes else [])
            ]
            return [HostPriority(Host=n, Score=0) for n in names]
        return super().prioritize(args)

    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        if not self.source.synced:
            return ExtenderBindingResult(Error=NOT_SYNCED)
        key = f"{args.PodNamespace}/{args.PodName}"
        if self.cluster.pod(key) is None:
            # kube-scheduler can be faster than our pod watch: read the pod rather than fail the bind.
            try:
                pod = await self.source.binder.call(
                    self.source.api.read_pod, args.PodNamespace, args.PodName
                )
            except ApiError as exc:
                return ExtenderBindingResult(
                    Error=f"pod {key} is unknown to vramsched and unreadable ({exc.status} {exc.reason})"
                )
            if self.cluster.pod(key) is None:
                self.cluster.upsert_pod(_slim(pod))
        return await super().bind(args)

    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        if not self.source.synced:
            return ExtenderPreemptionResult(NodeNameToMetaVictims={})
        return super().preempt(args)


def needs_legacy_failed_nodes(version: Mapping[str, Any] | None) -> bool:
    """Whether a control plane of this `/version` needs unresolvable nodes in FailedNodes too:
    kube-scheduler < 1.21 reads no other map. kube-scheduler runs the control plane's version
    (within one minor); an unreadable version keeps them (harmless, only larger answers)."""
    try:
        major = int(re.sub(r"\D.*", "", str((version or {}).get("major", ""))))
        minor = int(re.sub(r"\D.*", "", str((version or {}).get("minor", ""))))
    except ValueError:
        return True
    return (major, minor) < (1, 21)
