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
    """The state in a node annotation; raises StateError naming what is wrong. Strict, as the
    plugin writes it: `"registered": "false"` is not true, nor a GPU count of 1.5 one GPU."""
    try:
        body = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise StateError(f"annotation {STATE_ANNOTATION} is unreadable ({exc})") from None
    if not isinstance(body, dict):
        raise StateError(f"annotation {STATE_ANNOTATION} is not a JSON object")
    unhealthy = body.get("unhealthy") or []
    strategy = body.get("strategy") or ["envvar"]
    resource = body.get("resource") or "nvidia.com/gpu"
    checks = (
        ("registered", isinstance(body.get("registered"), bool), "true or false"),
        ("gpus", _whole(body.get("gpus"), 0), "a whole number >= 0"),
        ("replicas", _whole(body.get("replicas"), 1), "a whole number >= 1"),
        (
            "unhealthy",
            isinstance(unhealthy, list) and all(_whole(i, 0) for i in unhealthy),
            "a list of GPU indices",
        ),
        ("resource", isinstance(resource, str), "a resource name"),
        (
            "strategy",
            isinstance(strategy, list) and all(isinstance(x, str) for x in strategy),
            "a list of names",
        ),
    )
    for key, ok, want in checks:
        if not ok:
            got = repr(body.get(key))
            got = got if len(got) <= 40 else got[:37] + "..."
            raise StateError(f"annotation {STATE_ANNOTATION}: {key} {got} is not {want}")
    return PluginState(
        registered=body["registered"],
        gpus=body["gpus"],
        replicas=body["replicas"],
        unhealthy=tuple(sorted(set(unhealthy))),
        resource=resource,
        strategy=tuple(strategy),
    )


def _whole(value: Any, least: int) -> bool:
    return type(value) is int and value >= least
