"""The assignment annotations that vramsched writes on a pod when it binds it.

They make the ledger a pure function of the API: after a restart, the reservations
are read back from the pods, so nothing is lost and nothing is counted twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import orjson

from extender.demand import ASSIGNMENT, GPU_INDEX, MAX_MODEL_MEMORY, PodRef
from extender.ledger import Reservation

__all__ = ["encode_assignment", "decode_assignment", "AssignmentError", "DEVICE_ID"]

#: a device ID as the inventory writes one: a GPU's index (`3`), or a MIG slice's
#: `<gpu index>:<profile>:<slot>` (`3:1g.10gb:0`); ASCII digits, no sign or leading zero.
#: Why so strict: the ledger counts a pod only on IDs it knows, while the device plugin reads
#: a GPU index with int(), which also takes `03`, `+3` and `٣`; read loosely, one such ID would
#: be a GPU the pod runs on and the ledger counts as free.
DEVICE_ID = re.compile(r"(?:0|[1-9][0-9]{0,8})(?::[0-9a-z.+]+:(?:0|[1-9][0-9]{0,8}))?", re.ASCII)


class AssignmentError(ValueError):
    """An assignment annotation that cannot be read back (hand-edited or from another tool)."""


def encode_assignment(res: Reservation) -> dict[str, str]:
    """Annotations recording `res`: JSON for tools, plain GPU indices for people and envFrom."""
    body = {
        "node": res.node,
        "devices": list(res.device_ids),
        "bytesPerDevice": list(res.bytes_per_device),
    }
    indices = sorted({int(d.split(":", 1)[0]) for d in res.device_ids})
    return {ASSIGNMENT: orjson.dumps(body).decode(), GPU_INDEX: ",".join(map(str, indices))}


def decode_assignment(
    pod_ref: PodRef, annotations: Mapping[str, Any], priority: int = 0
) -> Reservation | None:
    """The reservation the annotation records, None without one. Read strictly, since the ledger
    and the device plugin act on it: a hand edit that only looks like one (devices as a string,
    a device twice, sizes that are not whole bytes) is an `AssignmentError`, and the pod is then
    counted as a pod without one is, never on devices read out of a malformed value."""
    raw = annotations.get(ASSIGNMENT)
    if raw is None:
        return None
    try:
        body = orjson.loads(raw)
        node, devices, sizes = body["node"], body["devices"], body["bytesPerDevice"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise AssignmentError(
            f"pod {pod_ref}: annotation {ASSIGNMENT} is unreadable ({exc})"
        ) from None
    if _whole_bytes(sizes) and isinstance(devices, list):
        sizes = [sizes] * len(devices)
    if problem := _problem(node, devices, sizes):
        raise AssignmentError(f"pod {pod_ref}: annotation {ASSIGNMENT} is inconsistent: {problem}")
    return Reservation(
        pod=pod_ref,
        node=node,
        device_ids=tuple(devices),
        bytes_per_device=tuple(sizes),
        priority=priority,
    )


def _problem(node: Any, devices: Any, sizes: Any) -> str | None:
    """What makes a decoded body unusable, or None."""
    if not isinstance(node, str):
        return f"node {_short(node)} is not a name"
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        return f"devices {_short(devices)} is not a list of device IDs"
    odd = [d for d in devices if not DEVICE_ID.fullmatch(d)]
    if odd:
        return f"device {_short(odd[0])} is not a GPU index or a MIG slice's ID"
    if len(set(devices)) != len(devices):
        return f"devices {_short(devices)} names a device twice"
    if not isinstance(sizes, list) or len(sizes) != len(devices):
        return f"bytesPerDevice {_short(sizes)} does not give one size per device"
    bad = [s for s in sizes if not _whole_bytes(s)]
    if bad:
        return f"bytesPerDevice {_short(bad[0])} is not a whole number of bytes from 0 to 64Ti"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole_bytes(value: Any) -> bool:
    """A byte count as vramsched writes one: a whole number from 0 to the largest model memory."""
    return type(value) is int and 0 <= value <= MAX_MODEL_MEMORY
