"""The Kubernetes Event vramsched records on a pod it bound: what it reserved, where. Pure: no I/O.

kube-scheduler's own `Scheduled` event names the node only; this one says how much VRAM the pod
holds on which device and how full that device now is, so `kubectl describe pod` answers "why
here" without reading annotations. The wording never claims more than vramsched controls: without
the pinning hand-off the device plugin picks the physical GPU, so the device is named as what the
ledger *counts* the pod on, not as the GPU the container gets.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from extender.demand import PodRef
from extender.inventory import Gpu, MigSlice, Sharing
from extender.ledger import Ledger, Reservation
from extender.quantity import format_bytes

__all__ = ["REASON", "COMPONENT", "MAX_MESSAGE", "bind_message", "bind_event"]

REASON = "VramschedAssigned"
#: `source.component` / `reportingComponent`: kube-scheduler's `Scheduled` events carry the
#: scheduler name (`vramsched`); these come from the extender sidecar.
COMPONENT = "vramsched-extender"
#: events.k8s.io caps a note at 1 KiB; core/v1 does not, but nobody reads more.
MAX_MESSAGE = 1024
_NAME_ROOM = 253 - 17  # event name = <pod name>.<16 hex digits>, a DNS subdomain


def _amount(res: Reservation) -> str:
    sizes = res.bytes_per_device
    if len(set(sizes)) == 1:
        each = format_bytes(sizes[0])
        text = each if len(sizes) == 1 else f"{len(sizes)}x{each}"
    else:
        text = "+".join(format_bytes(b) for b in sizes)
    return text if res.declared else f"{text} (whole device, no model-memory declared)"


def _indices(devices: list[Any]) -> str:
    return ",".join(str(i) for i in sorted({d.gpu_index for d in devices}))


def bind_message(ledger: Ledger, res: Reservation, pinned: bool) -> str:
    """One line for the pod's event, from the ledger as it stands with `res` in it.

    `pinned`: the pod really runs on the GPU indices of `res` (pinning hand-off, time-sliced GPU).
    """
    inv = ledger.node(res.node)
    devices = {d.device_id: d for d in inv.devices} if inv is not None else {}
    held = [devices[d] for d in res.device_ids if d in devices]
    amount = _amount(res)
    if len(held) != len(res.device_ids) or not held:
        return f"reserved {amount} on {', '.join(res.device_ids)} of {res.node}"[:MAX_MESSAGE]
    a = ledger.arrays
    use = []
    for d in held:
        row = ledger.row(res.node, d.device_id)
        used = int(a.used_replicas[row]) if row is not None else 0
        use.append(f"{used}/{d.replicas}")
    n = len(held)
    first = held[0]
    if isinstance(first, MigSlice):
        what = f"MIG slice {first.profile}" if n == 1 else f"{n} MIG slices {first.profile}"
        sharing = "time-slicing, " if first.replicas > 1 else ""
        counted = ", ".join(d.device_id for d in held)
        detail = f"{sharing}{_replicas(use) if first.replicas > 1 else 'isolated memory'}, counted on {counted}"
        return f"reserved {amount} on {what} of {res.node} ({detail})"[:MAX_MESSAGE]
    assert isinstance(first, Gpu)
    plural = "GPUs" if n > 1 else "GPU"
    kind = {
        Sharing.TIME_SLICING: "time-slicing",
        Sharing.MPS: "MPS",
        Sharing.EXCLUSIVE: "exclusive",
    }[first.sharing]
    shared = first.replicas > 1
    if pinned:
        detail = f"{kind}, {_replicas(use)}, pinned" if shared else f"{kind}, pinned"
        return f"reserved {amount} on {plural} {_indices(held)} of {res.node} ({detail})"[
            :MAX_MESSAGE
        ]
    parts = [kind]
    if shared:
        parts.append(_replicas(use, "clients" if first.sharing is Sharing.MPS else "replicas"))
    parts.append(f"counted on {plural} {_indices(held)}; the device plugin picks the {plural}")
    where = "a GPU" if n == 1 else f"{n} GPUs"
    return f"reserved {amount} on {where} of {res.node} ({', '.join(parts)})"[:MAX_MESSAGE]


def _replicas(use: list[str], word: str = "replicas") -> str:
    return f"{use[0]} {word}" if len(use) == 1 else f"{word} {', '.join(use)}"


def _timestamp(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def bind_event(pod: PodRef, message: str, now: float, instance: str = "") -> dict[str, Any]:
    """A core/v1 Event (works on every API server vramsched supports, 1.20 included).

    No `eventTime`: with it the API server applies the events.k8s.io rules (reportingController,
    action, series), without it the legacy ones, which `kubectl describe` and every client read.
    The name follows client-go's recorder (`<pod>.<nanoseconds in hex>`).
    """
    ts = _timestamp(now)
    meta: dict[str, Any] = {
        "name": f"{pod.name[:_NAME_ROOM]}.{int(now * 1e9):x}",
        "namespace": pod.namespace,
    }
    involved: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": pod.namespace,
        "name": pod.name,
    }
    if pod.uid:
        involved["uid"] = pod.uid
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": meta,
        "involvedObject": involved,
        "reason": REASON,
        "message": message[:MAX_MESSAGE],
        "type": "Normal",
        "source": {"component": COMPONENT},
        "firstTimestamp": ts,
        "lastTimestamp": ts,
        "count": 1,
        "reportingComponent": COMPONENT,
    }
    if instance:
        body["reportingInstance"] = instance[:128]
    return body
