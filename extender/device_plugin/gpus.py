"""The node's GPUs and their health: from NVML (`nvidia-ml-py`), or made up for tests.

Indices are NVML's (what `nvidia-smi` shows, PCI bus order), the same numbering GPU Feature
Discovery counts and vramsched's assignments use: GPU `i` of an assignment is NVML device `i`.

Health follows NVIDIA's k8s-device-plugin (internal/rm/health.go): a GPU whose handle or event
registration fails is unhealthy; an XID critical-error event marks its GPU unhealthy unless the
XID is an application error (13, 31, 43, 45, 68, 109); a failing event wait marks every GPU
unhealthy. As there, nothing turns a GPU healthy again but a restart of the plugin. The NVML path
runs against a fake NVML module in the tests; it has not run on a real GPU.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "GpuInfo",
    "GpuSource",
    "FakeGpus",
    "NvmlGpus",
    "APPLICATION_XIDS",
    "GpuSourceError",
]

log = logging.getLogger(__name__)

#: XIDs NVIDIA's plugin ignores: errors of the application, not of the GPU.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
_EVENT_WAIT_MS = 5000


class GpuSourceError(RuntimeError):
    """NVML is missing or failing, or a GPU cannot be served (MIG enabled)."""


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    memory_bytes: int
    name: str = ""


class GpuSource(Protocol):
    """Where the plugin learns its GPUs and their health."""

    def gpus(self) -> list[GpuInfo]: ...

    def watch_health(self, unhealthy: Callable[[int, str], None], stop: threading.Event) -> None:
        """Block until `stop`, calling `unhealthy(index, why)` for each GPU that fails."""
        ...


class FakeGpus:
    """`count` GPUs of `memory_mib` with UUIDs derived from the node name: stable across plugin
    restarts and distinct between nodes, as real UUIDs are. `fail` marks GPUs unhealthy at once
    (tests of the health path); none fails otherwise."""

    def __init__(self, node: str, count: int, memory_mib: int, fail: Iterable[int] = ()) -> None:
        if count < 1 or memory_mib < 1:
            raise GpuSourceError("--fake-gpus and --fake-memory-mib must be at least 1")
        self._gpus = [
            GpuInfo(i, fake_uuid(node, i), memory_mib * 1024 * 1024, "Fake GPU")
            for i in range(count)
        ]
        self._fail = sorted(set(fail))
        if stray := [i for i in self._fail if not 0 <= i < count]:
            raise GpuSourceError(
                f"--fake-unhealthy {','.join(map(str, stray))}: not a GPU index (0 to {count - 1})"
            )

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def watch_health(self, unhealthy: Callable[[int, str], None], stop: threading.Event) -> None:
        for i in self._fail:
            unhealthy(i, "marked unhealthy (fake)")
        stop.wait()


def fake_uuid(node: str, index: int) -> str:
    """`GPU-<uuid5>`: NVML's UUID spelling, from the node name and index."""
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{index}.{node}.fake-gpu.vramsched.io"))


class NvmlGpus:
    """GPUs from NVML. `nvml` is the `pynvml` module of nvidia-ml-py (or a test double with the
    same functions); imported on first use so that fake mode needs no NVIDIA library."""

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml

                nvml = pynvml
            except ImportError as exc:  # nvidia-ml-py is a dependency; this is a broken install
                raise GpuSourceError(f"nvidia-ml-py is not importable: {exc}") from None
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise GpuSourceError(
                f"NVML did not initialise ({exc}): is the NVIDIA driver loaded, and does the "
                "plugin's container see libnvidia-ml.so.1 (NVIDIA runtime class)?"
            ) from None

    def gpus(self) -> list[GpuInfo]:
        nvml = self.nvml
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if _mig_enabled(nvml, handle):
                raise GpuSourceError(
                    f"GPU {i} has MIG enabled: vramsched's device plugin serves whole GPUs only; "
                    "keep NVIDIA's plugin on MIG nodes"
                )
            out.append(
                GpuInfo(
                    i,
                    _text(nvml.nvmlDeviceGetUUID(handle)),
                    int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                    _text(nvml.nvmlDeviceGetName(handle)),
                )
            )
        return out

    def watch_health(self, unhealthy: Callable[[int, str], None], stop: threading.Event) -> None:
        nvml = self.nvml
        gpus = self.gpus()
        by_uuid = {g.uuid: g.index for g in gpus}
        events = nvml.nvmlEventSetCreate()
        try:
            mask = (
                nvml.nvmlEventTypeXidCriticalError
                | nvml.nvmlEventTypeDoubleBitEccError
                | nvml.nvmlEventTypeSingleBitEccError
            )
            for g in gpus:
                try:
                    handle = nvml.nvmlDeviceGetHandleByUUID(g.uuid)
                    supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                    nvml.nvmlDeviceRegisterEvents(handle, mask & supported, events)
                except nvml.NVMLError as exc:
                    if _is(nvml, exc, "NVML_ERROR_NOT_SUPPORTED"):
                        log.warning("GPU %d is too old for health events; not checked", g.index)
                        continue
                    unhealthy(g.index, f"cannot watch its events ({exc})")
            while not stop.is_set():
                try:
                    event = nvml.nvmlEventSetWait(events, _EVENT_WAIT_MS)
                except nvml.NVMLError as exc:
                    if _is(nvml, exc, "NVML_ERROR_TIMEOUT"):
                        continue
                    for g in gpus:
                        unhealthy(g.index, f"NVML event wait failed ({exc})")
                    stop.wait(_EVENT_WAIT_MS / 1000)
                    continue
                if event.eventType != nvml.nvmlEventTypeXidCriticalError:
                    continue
                xid = int(event.eventData)
                if xid in APPLICATION_XIDS:
                    log.info("ignoring application XID %d", xid)
                    continue
                try:
                    where = _text(nvml.nvmlDeviceGetUUID(event.device))
                except nvml.NVMLError as exc:
                    for g in gpus:
                        unhealthy(g.index, f"XID {xid} on a GPU NVML cannot name ({exc})")
                    continue
                index = by_uuid.get(where)
                if index is not None:
                    unhealthy(index, f"XID {xid} (critical error)")
        finally:
            try:
                nvml.nvmlEventSetFree(events)
            except nvml.NVMLError:
                pass


def _mig_enabled(nvml: Any, handle: Any) -> bool:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # not MIG-capable
        return False
    return bool(current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))


def _is(nvml: Any, exc: Exception, name: str) -> bool:
    code = getattr(nvml, name, None)
    return code is not None and getattr(exc, "value", None) == code


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
