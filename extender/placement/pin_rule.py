"""The pin rule: where a pod that takes its GPU pin may go. Pure: no I/O.

A pod that reads `NVIDIA_VISIBLE_DEVICES` from the `vramsched.io/gpu-index` annotation sees exactly
the GPUs written there, and none when nothing is (kubelet then sets the variable to "", which the
NVIDIA runtime reads as no GPU). An index is written only where the pin is real: pinned mode, whole
time-sliced GPUs. So such a pod must never be placed anywhere else, whichever server places it
(live, embedded, the simulator): `filter_nodes` refuses those nodes as
unresolvable, and `preempt_victims` evicts no one there. The other half of the rule, that pinned
mode refuses its time-sliced GPUs to a pod taking no pin at all (`PIN_MISSING`), is applied by the
stock device plugin's model with the node-level bound (`extender.stock_plugin.shared_fit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from extender.demand import GPU_INDEX, PIN_ENV, Demand
from extender.inventory import Gpu, ReplicaPolicy
from extender.ledger import Ledger
from extender.pinning import PIN_PREFIX
from extender.stock_plugin import is_time_sliced

__all__ = ["PIN_MISSING", "annotation_pin_refusal", "unpinnable"]

#: Why pinned mode refuses a time-sliced node to a pod that takes no pin (either form).
PIN_MISSING = (
    f"GPUs here are pinned: pod takes no pin (envFrom ConfigMap {PIN_PREFIX}<pod-name>"
    f" or {PIN_ENV} from annotation {GPU_INDEX})"
)
_FROM_ANNOTATION = f"pod reads {PIN_ENV} from annotation {GPU_INDEX}"


def annotation_pin_refusal(
    devices: Iterable[Any], resource: str, policy: ReplicaPolicy | str | None
) -> str | None:
    """Why a node cannot take a pod that reads its GPUs from the gpu-index annotation, or None.

    Such a container sees exactly the GPUs named there, and none when the annotation is absent
    (kubelet then sets the variable to "", which the NVIDIA runtime reads as no GPU). The binder
    writes an index only where the pin is real: pinned mode, whole time-sliced GPUs. Elsewhere the
    pod would start without a GPU, so it must not go there at all.
    """
    devices = list(devices)
    matching = [d for d in devices if d.resource == resource]
    if matching and all(getattr(d, "plugin_served", False) for d in matching):
        return None  # vramsched's device plugin: the index written is the GPU the pod gets
    if policy is None or ReplicaPolicy(policy) is not ReplicaPolicy.PINNED:
        return f"{_FROM_ANNOTATION}: GPUs are pinned only with --replica-policy pinned"
    if matching and not all(isinstance(d, Gpu) and is_time_sliced(d) for d in matching):
        return f"{_FROM_ANNOTATION}: GPUs here cannot be pinned (only whole time-sliced GPUs are)"
    return None


def unpinnable(ledger: Ledger, demand: Demand, names: Sequence[str]) -> dict[str, str]:
    """Of `names`, the nodes where a pod reading its GPUs from the gpu-index annotation would get
    no index, hence no GPU, each with the reason (`annotation_pin_refusal`). Empty for any other
    pod (`Demand.pin_annotation`). Labels and the replica policy only: no eviction changes it."""
    if not demand.pin_annotation:
        return {}
    policy = ledger.replica_policy
    out: dict[str, str] = {}
    for name in names:
        inv = ledger.node(name)
        why = annotation_pin_refusal(
            inv.devices if inv is not None else (), demand.resource, policy
        )
        if why is not None:
            out[name] = why
    return out
