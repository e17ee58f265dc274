"""The kubelet's side of the conversation: registration, its PodResources API, and its restarts.

- `register`: `Registration.Register` on `<dir>/kubelet.sock` with our socket's name; the kubelet
  then dials our socket and calls `GetDevicePluginOptions` and `ListAndWatch`.
- `PodResources`: `List` on `/var/lib/kubelet/pod-resources/kubelet.sock`: the kubelet's active
  pods and, per container, the device IDs it allocated (the authoritative record: after a plugin
  restart nothing else is needed to know what was handed out).
- `KubeletWatch`: a kubelet restart removes every socket in the device-plugin folder
  (`CleanupPluginDirectory`) and creates a new `kubelet.sock`; the plugin must serve a new socket
  and register again (NVIDIA's plugin watches the folder with fsnotify; polling once a second
  does the same here without an inotify dependency).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from extender.device_plugin.api import (
    deviceplugin_v1beta1_pb2 as dp,
)
from extender.device_plugin.api import (
    deviceplugin_v1beta1_pb2_grpc as dp_grpc,
)
from extender.device_plugin.api import (
    podresources_v1_pb2 as pr,
)
from extender.device_plugin.api import (
    podresources_v1_pb2_grpc as pr_grpc,
)
from extender.device_plugin.matcher import KubeletPod

__all__ = [
    "API_VERSION",
    "KUBELET_SOCKET",
    "DEVICE_PLUGIN_DIR",
    "POD_RESOURCES_SOCKET",
    "register",
    "PodResources",
    "KubeletWatch",
]

API_VERSION = "v1beta1"
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


def _channel(path: str | Path) -> grpc.Channel:
    # grpc's unix: target; no proxy, and no DNS on every call
    return grpc.insecure_channel(f"unix:{path}", options=[("grpc.enable_http_proxy", 0)])


def register(plugin_dir: str | Path, endpoint: str, resource: str, *, timeout: float = 5.0) -> None:
    """Register our socket `endpoint` (a name in `plugin_dir`) for `resource`; raises
    grpc.RpcError when the kubelet refuses or does not answer."""
    with _channel(Path(plugin_dir) / KUBELET_SOCKET) as channel:
        dp_grpc.RegistrationStub(channel).Register(
            dp.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint,
                resource_name=resource,
                options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
            ),
            timeout=timeout,
            wait_for_ready=True,
        )


class PodResources:
    """A client of the kubelet's PodResources `List`, on one channel (re-dialled on failure)."""

    def __init__(self, socket_path: str | Path, resource: str, timeout: float = 2.0) -> None:
        self.socket_path = Path(socket_path)
        self.resource = resource
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None

    def list(self) -> list[KubeletPod]:
        """Every pod the kubelet holds as active, with its devices of our resource per container;
        raises grpc.RpcError when the kubelet does not answer."""
        if self._stub is None:
            self._channel = _channel(self.socket_path)
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        try:
            answer = self._stub.List(pr.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError:
            self.close()  # the kubelet may have restarted: dial again next time
            raise
        out = []
        for p in answer.pod_resources:
            devices = {
                c.name: tuple(
                    i for d in c.devices if d.resource_name == self.resource for i in d.device_ids
                )
                for c in p.containers
            }
            out.append(KubeletPod(p.namespace, p.name, devices))
        return out

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


@dataclass
class KubeletWatch:
    """Says when the kubelet restarted (a new `kubelet.sock`) or our socket was removed."""

    plugin_dir: Path
    our_socket: Path
    _seen: tuple[int, int] | None = None

    def _kubelet_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.plugin_dir / KUBELET_SOCKET)
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def mark(self) -> None:
        """Remember the current kubelet socket (call right after registering)."""
        self._seen = self._kubelet_id()

    def kubelet_ready(self) -> bool:
        return self._kubelet_id() is not None

    def must_reregister(self) -> bool:
        """The kubelet socket is new, or ours is gone (the kubelet removed it)."""
        now = self._kubelet_id()
        return now is not None and (now != self._seen or not self.our_socket.exists())
