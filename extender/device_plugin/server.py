"""The device plugin's gRPC service (`v1beta1.DevicePlugin`) and its life beside the kubelet.

`DevicePluginService` answers the kubelet: it advertises `replicas` device IDs per healthy GPU
(NVIDIA's `<uuid>::<replica>`, so pod specs do not change), and for each Allocate identifies the
pod from the kubelet's PodResources (extender.device_plugin.matcher) and hands its container the
GPUs of its vramsched assignment. An admission lists PodResources once: the list
GetPreferredAllocation read serves the Allocate right after it. `PluginRunner` serves the socket,
registers, watches for kubelet restarts (re-serving and re-registering), watches GPU health and
publishes the plugin's state on its node (extender.plugin_state), which the extender reads before
booking GPUs there.

Threads: gRPC's worker pool, the pod informer, the health watcher and the runner's loop share
`DevicePluginService` under one lock, held only for in-memory work.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extender.device_plugin.api import deviceplugin_v1beta1_pb2 as dp
from extender.device_plugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from extender.device_plugin.gpus import GpuInfo, GpuSource
from extender.device_plugin.kubelet import KubeletWatch, PodResources, register
from extender.device_plugin.matcher import (
    KubeletPod,
    Match,
    Refusal,
    SlotCache,
    admitted,
    container_slots,
    ended,
    gpu_of,
    identify,
    preferred_devices,
    replica_id,
)
from extender.device_plugin.specs import container_spec
from extender.object_fields import uid_of
from extender.plugin_state import PluginState

__all__ = ["DevicePluginService", "PluginRunner", "PodLookup", "Metrics"]

log = logging.getLogger(__name__)

HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
#: kubelet pods (namespace/name) -> their API objects (`NodePods.snapshot`)
PodLookup = Callable[[list[str]], dict[str, dict[str, Any]]]

#: How old (seconds) the PodResources list read by GetPreferredAllocation may be for the next
#: Allocate to use it instead of calling `List` again. The kubelet calls the two back to back for
#: one container (pkg/kubelet/cm/devicemanager/manager.go: `devicesToAllocate` asks
#: GetPreferredAllocation, then `allocateContainerResources` calls Allocate) while it admits one
#: pod at a time, so in between no pod can join the list and the gap is milliseconds. An older
#: list means something else happened in between (an Allocate that never came, a kubelet
#: restart): it is dropped, never trusted. So is a list whose Allocate names other devices than
#: the ones preferred: the kubelet allocates the preferred ones when it asked, so that Allocate
#: is for another container, or came without a GetPreferredAllocation of its own.
LIST_REUSE_SECONDS = 2.0


@dataclass(frozen=True)
class _Listing:
    """The kubelet pods one GetPreferredAllocation read, for the Allocate that follows it."""

    size: int  # the request's allocation_size
    at: float  # time.monotonic() when List was called
    pods: list[KubeletPod]
    preferred: frozenset[str] = frozenset()  # the device IDs it answered


class Metrics:
    """Prometheus series of one plugin (its own registry: tests run several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.allocations = Counter(
            "vramsched_device_plugin_allocations",
            "Allocate calls by outcome (served, refused; ambiguous is a refusal for lack of a unique pod)",
            ["outcome"],
            registry=self.registry,
        )
        self.allocate_seconds = Histogram(
            "vramsched_device_plugin_allocate_seconds",
            "Time to answer Allocate (PodResources List included, unless its "
            "GetPreferredAllocation's list was reused)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
            registry=self.registry,
        )
        self.registered = Gauge(
            "vramsched_device_plugin_registered",
            "1 while registered with the kubelet",
            registry=self.registry,
        )
        self.unhealthy = Gauge(
            "vramsched_device_plugin_unhealthy_gpus",
            "GPUs marked unhealthy",
            registry=self.registry,
        )
        self.preferred_seconds = Histogram(
            "vramsched_device_plugin_preferred_allocation_seconds",
            "Time to answer GetPreferredAllocation (PodResources List included)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
            registry=self.registry,
        )
        # where an identification's time goes (Allocate and GetPreferredAllocation)
        self.pod_resources_seconds = Histogram(
            "vramsched_device_plugin_podresources_list_seconds",
            "Time the kubelet's PodResources List took to answer (real calls only)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
            registry=self.registry,
        )
        self.list_reused = Counter(
            "vramsched_device_plugin_podresources_list_reused",
            "Allocate calls that used the PodResources list their GetPreferredAllocation read "
            "instead of calling List",
            registry=self.registry,
        )
        self.lookup_seconds = Histogram(
            "vramsched_device_plugin_pod_lookup_seconds",
            "Time to find the listed pods' API objects (the pod watch's cache, or an API read "
            "for a pod the watch has not delivered yet)",
            buckets=(0.0001, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
            registry=self.registry,
        )
        self.api_reads = Counter(
            "vramsched_device_plugin_pods_read_from_api",
            "Pods read from the API: the kubelet listed them before the plugin's pod watch "
            "delivered them, or the kubelet's list contradicts the object the watch delivered",
            registry=self.registry,
        )


class DevicePluginService(dp_grpc.DevicePluginServicer):
    """The gRPC servicer: state is the GPUs, their health and the init containers served."""

    def __init__(
        self,
        *,
        node: str,
        gpus: Sequence[GpuInfo],
        replicas: int,
        strategies: Sequence[str],
        kubelet_pods: Callable[[], list[KubeletPod]],
        lookup: PodLookup,
        resource: str = "nvidia.com/gpu",
        metrics: Metrics | None = None,
        reread: PodLookup | None = None,
    ) -> None:
        self.node = node
        self.gpus = {g.index: g for g in gpus}
        self.by_uuid = {g.uuid: g for g in gpus}
        self.replicas = replicas
        self.strategies = tuple(strategies)
        self.kubelet_pods = kubelet_pods
        self.lookup = lookup
        #: the API's pods now, bypassing `lookup`'s cache (`NodePods.read`); None: `lookup` is
        #: never stale (tests)
        self.reread = reread
        self.resource = resource
        self.metrics = metrics or Metrics()
        self.unhealthy: dict[int, str] = {}
        self._slots = SlotCache()
        self._known = frozenset(i for i, _ in self._device_ids())
        #: pod UID -> non-restartable init containers served (PodResources does not list them)
        self.served_init: dict[str, frozenset[str]] = {}
        self._served_pod: dict[str, str] = {}  # pod UID -> namespace/name, to prune by
        #: the list the last GetPreferredAllocation read, for the next Allocate only
        self._listing: _Listing | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._version = 0
        self.stopping = threading.Event()
        self.on_health_change: Callable[[], None] = lambda: None

    # ----- devices and health ------------------------------------------------------------------
    def device_ids(self) -> list[tuple[str, bool]]:
        with self._lock:
            return self._device_ids()

    def _device_ids(self) -> list[tuple[str, bool]]:
        return [
            (replica_id(g.uuid, r, self.replicas), g.index not in self.unhealthy)
            for g in sorted(self.gpus.values(), key=lambda g: g.index)
            for r in range(self.replicas)
        ]

    def mark_unhealthy(self, index: int, why: str) -> None:
        with self._changed:
            if index in self.unhealthy or index not in self.gpus:
                return
            self.unhealthy[index] = why
            self._version += 1
            self._changed.notify_all()
        log.warning("GPU %d (%s) marked unhealthy: %s", index, self.gpus[index].uuid, why)
        self.metrics.unhealthy.set(len(self.unhealthy))
        self.on_health_change()

    # ----- gRPC --------------------------------------------------------------------------------
    def GetDevicePluginOptions(self, request: Any, context: Any) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[dp.ListAndWatchResponse]:
        seen = -1
        while not self.stopping.is_set() and context.is_active():
            with self._changed:
                if seen == self._version:
                    self._changed.wait(timeout=1.0)
                if seen == self._version:
                    continue
                seen = self._version
                devices = self._device_ids()
            yield dp.ListAndWatchResponse(
                devices=[dp.Device(ID=i, health=HEALTHY if ok else UNHEALTHY) for i, ok in devices]
            )

    def stop_streams(self) -> None:
        self.stopping.set()
        with self._changed:
            self._changed.notify_all()

    def GetPreferredAllocation(self, request: Any, context: Any) -> dp.PreferredAllocationResponse:
        """Prefer replicas of the pod's assigned GPUs. The kubelet list read here is kept for the
        Allocate that follows (one container per call, as the kubelet asks), so an admission
        costs the kubelet one PodResources List, not two."""
        started = time.perf_counter()
        out = dp.PreferredAllocationResponse()
        requests = list(request.container_requests)
        listing: _Listing | None = None
        decision: Match | Refusal
        for req in requests:
            size = int(req.allocation_size)
            at = time.monotonic()
            listed = self._list_pods()
            if isinstance(listed, Refusal):
                decision = listed
            else:
                decision = self._identify(size, {}, listed)
            gpus = (
                [self.gpus[i].uuid for i in decision.slot.gpus if i in self.gpus]
                if isinstance(decision, Match)
                else None
            )
            chosen = preferred_devices(
                list(req.available_deviceIDs), list(req.must_include_deviceIDs), size, gpus
            )
            if len(requests) == 1 and not isinstance(listed, Refusal):
                listing = _Listing(size, at, listed, frozenset(chosen))
            out.container_responses.append(
                dp.ContainerPreferredAllocationResponse(deviceIDs=chosen)
            )
        with self._lock:
            self._listing = listing  # replaces an unused one: only the latest is for the next
        self.metrics.preferred_seconds.observe(time.perf_counter() - started)
        return out

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> dp.AllocateResponse:
        started = time.perf_counter()
        out = dp.AllocateResponse()
        taken: dict[str, set[str]] = {}  # earlier containers of this very request
        requests = list(request.container_requests)
        # the list GetPreferredAllocation read for this container, if any: for the first only
        reuse = self._take_listing(list(requests[0].devices_ids) if requests else [])
        for req in requests:
            ids = list(req.devices_ids)
            answer = self._allocate_one(ids, taken, reuse)
            reuse = None
            if isinstance(answer, Refusal):
                self.metrics.allocations.labels(
                    "ambiguous" if answer.ambiguous else "refused"
                ).inc()
                log.warning(
                    "allocation refused",
                    extra={"fields": {"devices": ids, "reason": answer.reason}},
                )
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, answer.reason)
            out.container_responses.append(answer)
            self.metrics.allocations.labels("served").inc()
        self.metrics.allocate_seconds.observe(time.perf_counter() - started)
        return out

    def PreStartContainer(self, request: Any, context: Any) -> dp.PreStartContainerResponse:
        return dp.PreStartContainerResponse()

    # ----- the decision ---------------------------------------------------------------------------
    def _list_pods(self) -> list[KubeletPod] | Refusal:
        """The kubelet's PodResources List (the one place it is called while serving)."""
        started = time.perf_counter()
        try:
            kubelet_pods = self.kubelet_pods()
        except grpc.RpcError as exc:
            return Refusal(f"cannot read the kubelet's PodResources API ({_code(exc)})")
        self.metrics.pod_resources_seconds.observe(time.perf_counter() - started)
        return kubelet_pods

    def _take_listing(self, ids: Sequence[str]) -> list[KubeletPod] | None:
        """The list the last GetPreferredAllocation read, if it asked for as many devices as
        `ids`, preferred exactly those and is younger than LIST_REUSE_SECONDS; taken once (any
        Allocate clears it)."""
        with self._lock:
            listing, self._listing = self._listing, None
        if (
            listing is None
            or listing.size != len(ids)
            or listing.preferred != frozenset(ids)
            or time.monotonic() - listing.at > LIST_REUSE_SECONDS
        ):
            return None
        self.metrics.list_reused.inc()
        return listing.pods

    def _identify(
        self,
        count: int,
        taken: dict[str, set[str]],
        listed: list[KubeletPod] | None = None,
    ) -> Match | Refusal:
        """Which pod and container `count` devices are for. `listed`: a kubelet list already
        read for this very request (else List is called); all the rest is computed afresh."""
        if listed is None:
            fresh = self._list_pods()
            if isinstance(fresh, Refusal):
                return fresh
            listed = fresh
        kubelet_pods = listed
        looking = time.perf_counter()
        if taken:
            kubelet_pods = [_with_taken(kp, taken.get(kp.key)) for kp in kubelet_pods]
        pods = self.lookup([kp.key for kp in kubelet_pods])
        if self.reread is not None and (stale := self._contradicted(kubelet_pods, pods)):
            now = self.reread(stale)
            pods = {k: p for k, p in pods.items() if k not in stale} | now
        self.metrics.lookup_seconds.observe(time.perf_counter() - looking)
        with self._lock:
            self._prune_served(kubelet_pods, pods)
            served = dict(self.served_init)
        return identify(count, kubelet_pods, pods, served, self.resource, self.node, self._slots)

    def _contradicted(
        self, kubelet_pods: Iterable[KubeletPod], pods: Mapping[str, Mapping[str, Any]]
    ) -> list[str]:
        """Pods whose API object, as looked up, the kubelet's list contradicts: the object says
        the pod was admitted (container statuses, a phase past Pending) or is being deleted, yet
        the kubelet holds no devices for one of its GPU containers (sidecars and app containers:
        the ones PodResources lists). A kubelet allocates every container when it admits a pod
        and never admits one being deleted, so the pod it holds under that name is another one:
        deleted and created again while the plugin's watch lags. Its old assignment would hand
        the new pod the old one's GPUs. Pods that ended are left alone: they are never
        candidates, and kubelets before 1.34 list them on without devices."""
        out = []
        for kp in kubelet_pods:
            pod = pods.get(kp.key)
            if pod is None or ended(pod):  # older kubelets list ended pods without devices
                continue
            meta = pod.get("metadata") or {}
            if not (meta.get("deletionTimestamp") or admitted(pod)):
                continue
            slots = self._slots(pod, self.resource, self.node)
            if isinstance(slots, list) and any(
                not s.init and not kp.devices.get(s.container) for s in slots
            ):
                out.append(kp.key)
        return out

    def _allocate_one(
        self,
        ids: list[str],
        taken: dict[str, set[str]],
        listed: list[KubeletPod] | None = None,
    ) -> dp.ContainerAllocateResponse | Refusal:
        unknown = [i for i in ids if i not in self._known]
        if unknown or not ids:
            return Refusal(
                f"unknown device IDs {unknown or ids} for {self.resource} on {self.node}"
            )
        decision = self._identify(len(ids), taken, listed)
        if isinstance(decision, Refusal):
            return decision
        slot = decision.slot
        with self._lock:
            bad = [i for i in slot.gpus if i not in self.gpus or i in self.unhealthy]
            if bad:
                why = "; ".join(
                    f"GPU {i}: {self.unhealthy.get(i, 'not on this node')}" for i in bad
                )
                return Refusal(
                    f"pod {decision.pod} is assigned GPU {','.join(map(str, bad))}, which this "
                    f"node cannot serve ({why})"
                )
            for m in (decision, *decision.tied):
                if m.slot.init:
                    self.served_init[m.uid] = self.served_init.get(m.uid, frozenset()) | {
                        m.slot.container
                    }
                    self._served_pod[m.uid] = m.pod
        for m in (decision, *decision.tied):
            taken.setdefault(m.pod, set()).add(m.slot.container)
        uuids = [self.gpus[i].uuid for i in slot.gpus]
        spec = container_spec(self.strategies, uuids, slot.gpus, str(uuid.uuid4()))
        log.info(
            "allocated",
            extra={
                "fields": {
                    "pod": decision.pod,
                    "container": slot.container,
                    "gpus": list(slot.gpus),
                    "uuids": uuids,
                    "kubeletDevices": ids,
                    "sameGpuAsKubelet": sorted({gpu_of(i) for i in ids}) == sorted(uuids),
                }
            },
        )
        return dp.ContainerAllocateResponse(
            envs=spec.envs,
            mounts=[
                dp.Mount(container_path=c, host_path=h, read_only=True) for c, h in spec.mounts
            ],
            annotations=spec.annotations,
            cdi_devices=[dp.CDIDevice(name=n) for n in spec.cdi_devices],
        )

    def _prune_served(
        self, kubelet_pods: Iterable[KubeletPod], pods: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """Forget the init containers of pods the kubelet no longer lists (it lists every pod it
        holds, the one being admitted included), or whose name now belongs to another pod (a
        new UID). The kubelet's list decides, not the API: an API outage forgets nothing.
        Call under the lock."""
        if not self.served_init:
            return
        listed = {kp.key for kp in kubelet_pods}
        for uid, key in list(self._served_pod.items()):
            pod = pods.get(key)
            if key not in listed or (pod is not None and uid_of(pod) != uid):
                self.served_init.pop(uid, None)
                del self._served_pod[uid]

    def rebuild(self) -> int:
        """After a (re)start or re-registration, which init containers were served: PodResources
        does not list plain init containers, so a pod the kubelet lists has had its init
        containers allocated when its other containers hold devices, or when the API shows the
        kubelet admitted it (a pod whose only GPU container is an init container holds no
        listed device). What this process served itself (a re-registration after a kubelet
        restart) it knows exactly, and keeps for the pods still listed: a pod admitted whose
        status the kubelet has not written yet would otherwise look as if it still waited.
        Returns how many listed pods were admitted with our devices."""
        try:
            kubelet_pods = self.kubelet_pods()
        except grpc.RpcError as exc:
            log.warning("cannot read PodResources to rebuild the record: %s", _code(exc))
            return 0
        pods = self.lookup([kp.key for kp in kubelet_pods])
        with self._lock:
            known = dict(self.served_init)
        served: dict[str, frozenset[str]] = {}
        served_pod: dict[str, str] = {}
        held = 0
        for kp in kubelet_pods:
            pod = pods.get(kp.key)
            if pod is None or ended(pod):
                continue
            slots = container_slots(pod, self.resource, self.node)
            if not slots or isinstance(slots, Refusal):
                continue
            uid = uid_of(pod)
            was_admitted = any(kp.devices.values()) or admitted(pod)
            held += was_admitted
            if uid in known:
                served[uid], served_pod[uid] = known[uid], kp.key
                continue
            if not was_admitted:
                continue  # not admitted yet: its Allocate calls are still to come
            inits = frozenset(s.container for s in slots if s.init)
            if inits:
                served[uid] = inits
                served_pod[uid] = kp.key
        with self._lock:
            self.served_init = served
            self._served_pod = served_pod
            self._listing = None  # read from a kubelet that may since have restarted
        return held

    def state(self, registered: bool) -> PluginState:
        with self._lock:
            return PluginState(
                registered=registered,
                gpus=len(self.gpus),
                replicas=self.replicas,
                unhealthy=tuple(sorted(self.unhealthy)),
                resource=self.resource,
                strategy=self.strategies,
            )


def _with_taken(kp: KubeletPod, containers: set[str] | None) -> KubeletPod:
    if not containers:
        return kp
    devices = dict(kp.devices)
    for c in containers:
        devices[c] = devices.get(c) or ("(this request)",)
    return KubeletPod(kp.namespace, kp.name, devices)


def _code(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else ""
    return f"{code.name if code else 'error'}: {details}".strip(": ")


class PluginRunner:
    """Serve, register, and keep both true across kubelet restarts, until `stop`."""

    def __init__(
        self,
        service: DevicePluginService,
        *,
        plugin_dir: Path,
        socket_name: str,
        source: GpuSource,
        publish: Callable[[PluginState], None],
        pod_resources: PodResources | None = None,
        poll: float = 1.0,
    ) -> None:
        self.service = service
        self.plugin_dir = Path(plugin_dir)
        self.socket = self.plugin_dir / socket_name
        self.source = source
        self._publish = publish
        self.pod_resources = pod_resources
        self.poll = poll
        self.watch = KubeletWatch(self.plugin_dir, self.socket)
        self.registered = False
        self.registrations = 0
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._published: PluginState | None = None
        self._publish_lock = threading.Lock()
        service.on_health_change = lambda: self.publish()

    def publish(self) -> None:
        """Write our state on the node when it changed; a failure is retried on the next tick."""
        state = self.service.state(self.registered)
        with self._publish_lock:
            if state == self._published:
                return
            try:
                self._publish(state)
            except Exception as exc:  # the API may be away; the loop retries
                log.warning("cannot publish the plugin state on the node: %s", exc)
                return
            self._published = state

    def _serve(self) -> None:
        self._close_server()
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.socket.unlink()
        except FileNotFoundError:
            pass
        self.service.stopping.clear()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dp"))
        dp_grpc.add_DevicePluginServicer_to_server(self.service, server)
        server.add_insecure_port(f"unix:{self.socket}")
        server.start()
        self._server = server

    def _close_server(self) -> None:
        if self._server is not None:
            self.service.stop_streams()
            self._server.stop(grace=1.0).wait(2.0)
            self._server = None

    def _register(self) -> bool:
        # the record first: once registered, the kubelet may call Allocate at once, and an init
        # container served before the restart would look like one still waiting
        held = self.service.rebuild()
        try:
            register(self.plugin_dir, self.socket.name, self.service.resource)
        except grpc.RpcError as exc:
            log.warning("registration with the kubelet failed: %s", _code(exc))
            return False
        self.watch.mark()
        self.registered = True
        self.registrations += 1
        self.service.metrics.registered.set(1)
        log.info(
            "registered with the kubelet",
            extra={
                "fields": {
                    "resource": self.service.resource,
                    "socket": str(self.socket),
                    "devices": len(self.service.device_ids()),
                    "podsHoldingDevices": held,
                    "registrations": self.registrations,
                }
            },
        )
        return True

    def run(self) -> None:
        """Block until `stop()`: (re)serve and (re)register whenever the kubelet asks for it."""
        health = threading.Thread(target=self._watch_health, name="gpu-health", daemon=True)
        health.start()
        try:
            while not self._stop.is_set():
                if not self.registered or self.watch.must_reregister():
                    if self.registered:
                        log.info("the kubelet restarted or removed our socket: registering again")
                    self.registered = False
                    self.service.metrics.registered.set(0)
                    if self.watch.kubelet_ready():
                        self._serve()
                        self._register()
                self.publish()
                self._stop.wait(self.poll)
        finally:
            self.registered = False
            self.service.metrics.registered.set(0)
            self._close_server()
            try:
                self.socket.unlink()
            except FileNotFoundError:
                pass
            self.publish()

    def _watch_health(self) -> None:
        try:
            self.source.watch_health(self.service.mark_unhealthy, self._stop)
        except Exception:  # as NVIDIA's plugin: keep serving without health checks
            log.exception("GPU health checks stopped")

    def stop(self) -> None:
        self._stop.set()
