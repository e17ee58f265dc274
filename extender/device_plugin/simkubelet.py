"""A stand-in for the kubelet's device manager, for tests and benchmarks on nodes without one.

It speaks the same gRPC as the kubelet: serves `Registration` on `<dir>/kubelet.sock` and the
PodResources `List` on its own socket, dials a registering plugin, follows its `ListAndWatch`,
and admits pods the way pkg/kubelet/cm/devicemanager does: one pod at a time, init containers then
app containers, each container's devices chosen from the healthy unallocated ones after asking
`GetPreferredAllocation`, then one `Allocate` per container. The pod being admitted is listed by
`List` (with the devices of the containers allocated so far) while its Allocate waits, as the
kubelet's pod manager holds it before admission. A refused Allocate fails the pod and frees what
it got. What it does not do: NUMA alignment, checkpoints, device reuse between init and app
containers (each container gets devices of its own here), restarts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from extender.device_plugin.api import deviceplugin_v1beta1_pb2 as dp
from extender.device_plugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from extender.device_plugin.api import podresources_v1_pb2 as pr
from extender.device_plugin.api import podresources_v1_pb2_grpc as pr_grpc
from extender.device_plugin.kubelet import KUBELET_SOCKET
from extender.device_plugin.matcher import gpu_limit

__all__ = ["SimKubelet", "Admission", "AdmissionError"]


class AdmissionError(Exception):
    """The plugin refused (the kubelet's UnexpectedAdmissionError); `.reason` is its message."""

    def __init__(self, pod: str, reason: str) -> None:
        super().__init__(f"{pod}: {reason}")
        self.reason = reason


@dataclass
class Admission:
    """What a pod's containers received: per container, its device IDs and the plugin's answer,
    and the time each Allocate took and each GetPreferredAllocation before it (the kubelet waits
    on both while it admits the pod)."""

    pod: str
    devices: dict[str, list[str]] = field(default_factory=dict)
    responses: dict[str, dp.ContainerAllocateResponse] = field(default_factory=dict)
    allocate_seconds: list[float] = field(default_factory=list)
    preferred_seconds: list[float] = field(default_factory=list)


class SimKubelet(dp_grpc.RegistrationServicer, pr_grpc.PodResourcesListerServicer):
    def __init__(self, plugin_dir: Path, pod_resources_socket: Path, resource: str) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.pod_resources_socket = Path(pod_resources_socket)
        self.resource = resource
        self.devices: dict[str, bool] = {}  # ID -> healthy
        self.allocated: dict[str, dict[str, list[str]]] = {}  # pod -> container -> IDs
        self.active: dict[str, list[str]] = {}  # pod -> containers (spec order)
        self.registrations = 0
        self._lock = threading.Lock()
        self._listed = threading.Condition(self._lock)
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self._plugin: dp_grpc.DevicePluginStub | None = None
        self._listing: pr.ListPodResourcesResponse | None = None  # List's answer, until a change

    # ----- lifecycle -----------------------------------------------------------------------------
    def start(self) -> SimKubelet:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.plugin_dir / KUBELET_SOCKET, self.pod_resources_socket):
            path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        dp_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix:{self.plugin_dir / KUBELET_SOCKET}")
        pr_server = server  # one server, two sockets
        pr_grpc.add_PodResourcesListerServicer_to_server(self, pr_server)
        server.add_insecure_port(f"unix:{self.pod_resources_socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2)
            self._server = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # ----- Registration ----------------------------------------------------------------------------
    def Register(self, request: Any, context: Any) -> dp.Empty:
        if request.resource_name != self.resource:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not {self.resource}")
        if self._channel is not None:
            self._channel.close()
        self._channel = grpc.insecure_channel(f"unix:{self.plugin_dir / request.endpoint}")
        self._plugin = dp_grpc.DevicePluginStub(self._channel)
        self._plugin.GetDevicePluginOptions(dp.Empty(), timeout=5, wait_for_ready=True)
        threading.Thread(target=self._follow, args=(self._plugin,), daemon=True).start()
        self.registrations += 1
        return dp.Empty()

    def _follow(self, plugin: dp_grpc.DevicePluginStub) -> None:
        try:
            for answer in plugin.ListAndWatch(dp.Empty()):
                with self._listed:
                    self.devices = {d.ID: d.health == "Healthy" for d in answer.devices}
                    self._listed.notify_all()
        except grpc.RpcError:
            with self._listed:  # the plugin went away: nothing is allocatable
                self.devices = {}

    def wait_devices(self, count: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self._listed:
            while sum(self.devices.values()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{count} healthy devices not advertised")
                self._listed.wait(left)

    # ----- PodResources ----------------------------------------------------------------------------
    def List(self, request: Any, context: Any) -> pr.ListPodResourcesResponse:
        with self._lock:
            if self._listing is not None:  # nothing changed since the last answer
                return self._listing
            pods = []
            for key, containers in self.active.items():
                namespace, _, name = key.partition("/")
                got = self.allocated.get(key, {})
                pods.append(
                    pr.PodResources(
                        name=name,
                        namespace=namespace,
                        containers=[
                            pr.ContainerResources(
                                name=c,
                                devices=[
                                    pr.ContainerDevices(
                                        resource_name=self.resource, device_ids=got[c]
                                    )
                                ]
                                if got.get(c)
                                else [],
                            )
                            for c in containers
                        ],
                    )
                )
            self._listing = pr.ListPodResourcesResponse(pod_resources=pods)
            return self._listing

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not simulated")

    def Get(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not simulated")

    # ----- admission -------------------------------------------------------------------------------
    def admit(self, pod: Mapping[str, Any]) -> Admission:
        """Allocate the pod's containers as the kubelet would; raise AdmissionError on refusal."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"
        spec = pod.get("spec") or {}
        order = [c for c in spec.get("initContainers") or []] + list(spec.get("containers") or [])
        out = Admission(key)
        with self._lock:
            self.active[key] = [
                c["name"]
                for c in [
                    *(
                        c
                        for c in spec.get("initContainers") or []
                        if c.get("restartPolicy") == "Always"
                    ),
                    *(spec.get("containers") or []),
                ]
            ]
            self.allocated[key] = {}
            self._listing = None
        assert self._plugin is not None, "no plugin registered"
        for container in order:
            needed = gpu_limit(container, self.resource)
            if needed <= 0:
                continue
            with self._lock:
                used = {d for got in self.allocated.values() for ids in got.values() for d in ids}
                available = sorted(d for d, ok in self.devices.items() if ok and d not in used)
            if len(available) < needed:
                self._fail(key)
                raise AdmissionError(key, f"requested {needed}, available {len(available)}")
            started = time.perf_counter()
            preferred = self._plugin.GetPreferredAllocation(
                dp.PreferredAllocationRequest(
                    container_requests=[
                        dp.ContainerPreferredAllocationRequest(
                            available_deviceIDs=available, allocation_size=needed
                        )
                    ]
                ),
                timeout=10,
            ).container_responses[0]
            out.preferred_seconds.append(time.perf_counter() - started)
            chosen = [d for d in preferred.deviceIDs if d in set(available)][:needed]
            chosen += [d for d in available if d not in chosen][: needed - len(chosen)]
            started = time.perf_counter()
            try:
                answer = self._plugin.Allocate(
                    dp.AllocateRequest(
                        container_requests=[dp.ContainerAllocateRequest(devices_ids=chosen)]
                    ),
                    timeout=10,
                )
            except grpc.RpcError as exc:
                self._fail(key)
                raise AdmissionError(key, exc.details() or str(exc.code())) from None
            out.allocate_seconds.append(time.perf_counter() - started)
            with self._lock:
                self.allocated[key][container["name"]] = chosen
                self._listing = None
            out.devices[container["name"]] = chosen
            out.responses[container["name"]] = answer.container_responses[0]
        return out

    def _fail(self, key: str) -> None:
        with self._lock:
            self.active.pop(key, None)
            self.allocated.pop(key, None)
            self._listing = None

    def remove(self, key: str) -> None:
        """The pod ended: its devices are free again."""
        self._fail(key)
