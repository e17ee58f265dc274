"""The assignment annotations that vramsched writes on a pod when it binds it.

They make the ledger a pure function of the API: after a restart, the reservations
are read back from the pods, so nothing is lost and nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from extender.demand import ASSIGNMENT, GPU_INDEX, PodRef
from extender.ledger import Reservation

__all__ = ["encode_assignment", "decode_assignment", "AssignmentError"]


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
    raw = annotations.get(ASSIGNMENT)
    if raw is None:
        return None
    try:
        body = orjson.loads(raw)
        node = body["node"]
        devices = tuple(str(d) for d in body["devices"])
        sizes = body["bytesPerDevice"]
        if isinstance(sizes, int):
            sizes = [sizes] * len(devices)
        sizes = tuple(int(s) for s in sizes)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise AssignmentError(
            f"pod {pod_ref}: annotation {ASSIGNMENT} is unreadable ({exc})"
        ) from None
    if not isinstance(node, str) or len(sizes) != len(devices) or any(s < 0 for s in sizes):
        raise AssignmentError(f"pod {pod_ref}: annotation {ASSIGNMENT} is inconsistent")
    return Reservation(
        pod=pod_ref, node=node, device_ids=devices, bytes_per_device=sizes, priority=priority
    )
