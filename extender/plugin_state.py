"""Nodes served by vramsched's own device plugin: the node label that says so, and the state the
plugin publishes on its node. Pure: no I/O; read by the inventory (extender side) and written by
`vramsched device-plugin` (node side), so both agree on one spelling.

On such a node the plugin hands each container exactly the GPUs in its `vramsched.io/assignment`,
so the ledger books those GPUs exactly (no device-plugin worst case). That is only true while the
plugin runs and sees the GPUs: the state annotation says whether it is registered with the
kubelet and which GPUs it found unhealthy, and the inventory refuses the node (or the GPU) when
it is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = [
    "SERVED_LABEL",
    "STATE_ANNOTATION",
    "ASSIGNMENT_ENV",
    "PluginState",
    "is_plugin_served",
    "encode_state",
    "decode_state",
    "StateError",
]

#: Node label an operator sets on the nodes where vramsched's plugin replaces NVIDIA's.
SERVED_LABEL = "vramsched.io/device-plugin"
#: Node annotation the plugin writes: JSON `PluginState`.
STATE_ANNOTATION = "vramsched.io/device-plugin-state"
#: Extra variable in each container the plugin serves: the GPU indices vramsched assigned (the
#: NVML indices of the UUIDs in NVIDIA_VISIBLE_DEVICES), for people and logs.
ASSIGNMENT_ENV = "VRAMSCHED_GPU_INDEX"


class StateError(ValueError):
    """A state annotation that cannot be read (hand-edited or from another version)."""


@dataclass(frozen=True, slots=True)
class PluginState:
    """What the plugin on a node reports: registered with the kubelet, how many GPUs it serves
    with how many replicas each, and which GPU indices are unhealthy (never handed out)."""

    registered: bool
    gpus: int
    replicas: int
    unhealthy: tuple[int, ...] = ()
    resource: str = "nvidia.com/gpu"
    strategy: tuple[str, ...] = field(default=("envvar",))


def is_plugin_served(labels: Mapping[str, Any]) -> bool:
    """Whether the operator put this node under vramsched's device plugin."""
    return str(labels.get(SERVED_LABEL, "")).lower() == "true"


def encode_state(state: PluginState) -> str:
    return orjson.dumps(
        {
            "registered": state.registered,
            "gpus": state.gpus,
            "replicas": state.replicas,
            "unhealthy": sorted(state.unhealthy),
            "resource": state.resource,
            "strategy": list(state.strategy),
        }
    ).decode()


def decode_state(raw: Any) -> PluginState:
    """The state in a node annotation; raises StateError naming what is wrong."""
    try:
        body = orjson.loads(raw)
        state = PluginState(
            registered=bool(body["registered"]),
            gpus=int(body["gpus"]),
            replicas=int(body["replicas"]),
            unhealthy=tuple(sorted({int(i) for i in body.get("unhealthy") or ()})),
            resource=str(body.get("resource") or "nvidia.com/gpu"),
            strategy=tuple(str(s) for s in body.get("strategy") or ("envvar",)),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise StateError(f"annotation {STATE_ANNOTATION} is unreadable ({exc})") from None
    if state.gpus < 0 or state.replicas < 1 or any(i < 0 for i in state.unhealthy):
        raise StateError(f"annotation {STATE_ANNOTATION} is inconsistent")
    return state
