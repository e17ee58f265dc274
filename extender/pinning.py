"""The GPU pin hand-off: how a container learns the GPU vramsched picked for it. Pure.

kubelet asks the device plugin which GPU a container gets; with the stock plugin vramsched can
only name one (`--replica-policy pinned`, `extender.inventory.ReplicaPolicy`) through
the container's environment (`NVIDIA_VISIBLE_DEVICES`): from a per-pod ConfigMap the binder writes
(`envFrom`), or from the `vramsched.io/gpu-index` annotation through the downward API (see
`extender.demand.reads_pin_annotation`). These names and helpers are shared by the demand parser,
the pin rule (`extender.placement.pin_rule`) and the live binder, so they live in
this leaf module, which imports no other part of vramsched: nothing here can close an import cycle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "PIN_PREFIX",
    "pin_configmap_name",
    "references_pin_configmap",
    "pin_environment",
]

PIN_PREFIX = "vramsched-"


class HoldsDevices(Protocol):
    """What `pin_environment` reads of a reservation (`extender.ledger.Reservation`)."""

    @property
    def device_ids(self) -> Sequence[str]: ...


def pin_configmap_name(pod_name: str) -> str:
    """The ConfigMap a pod references with `envFrom` to receive its GPU pin."""
    return PIN_PREFIX + pod_name


def references_pin_configmap(pod: Mapping[str, Any]) -> bool:
    """Whether any container of the pod takes its environment from its pin ConfigMap."""
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    spec = pod.get("spec") if isinstance(pod, Mapping) else None
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return False
    name = meta.get("name")
    if not isinstance(name, str):
        return False
    want = pin_configmap_name(name)
    for group in ("containers", "initContainers"):
        for c in spec.get(group) or []:
            if not isinstance(c, Mapping):
                continue
            for src in c.get("envFrom") or []:
                ref = src.get("configMapRef") if isinstance(src, Mapping) else None
                if isinstance(ref, Mapping) and ref.get("name") == want:
                    return True
    return False


def pin_environment(
    reservation: HoldsDevices, pinned: bool, time_sliced: bool = True
) -> dict[str, str]:
    """The ConfigMap data for a pod: `NVIDIA_VISIBLE_DEVICES` only when the pin is real.

    Real = pinned mode, whole GPUs (MIG devices are addressed by UUID, not index), time-sliced
    (an exclusive GPU's identity does not matter to VRAM accounting, and pinning only some pods
    of an exclusive node would let the plugin hand a pinned GPU to another pod). Otherwise the
    ConfigMap still exists, so a pod that references it starts, with the plugin's choice.
    """
    whole = all(":" not in d for d in reservation.device_ids) and bool(reservation.device_ids)
    if pinned and whole and time_sliced:
        indices = sorted({int(d) for d in reservation.device_ids})
        return {"NVIDIA_VISIBLE_DEVICES": ",".join(map(str, indices)), "VRAMSCHED_PINNED": "true"}
    return {"VRAMSCHED_PINNED": "false"}
