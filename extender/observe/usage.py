"""Where the VRAM went: per node and per GPU / MIG slice, who holds how much, and what is stranded.

Built from the ledger itself (`usage_from_ledger`), so `vramsched top`, `/state` and the per-GPU
metrics show the scheduler's own books, or read back from a running extender's `/state`
(`usage_from_state`). Pure: no I/O, nothing here changes the ledger.

*Stranded* VRAM is free memory on a device whose replicas are all taken: no further pod can be
placed there, however small, so it is lost until a pod leaves. It is the waste `top` sorts by.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from extender.demand import MODEL_MEMORY
from extender.inventory import MigSlice
from extender.ledger import Ledger
from extender.quantity import QuantityError, parse_bytes

__all__ = [
    "MIG",
    "PodShare",
    "DeviceUsage",
    "NodeUsage",
    "Summary",
    "SORT_KEYS",
    "usage_from_ledger",
    "usage_from_state",
    "state_nodes",
    "select",
    "sort_nodes",
    "summarize",
    "report_dict",
    "declared_memory",
]

#: the `sharing` of a MIG slice (its own memory, whatever its replicas)
MIG = "mig"


@dataclass(frozen=True, slots=True)
class PodShare:
    """One pod's hold on one device."""

    key: str  # namespace/name
    bytes: int | None  # held on this device (None: a /state without holders)
    #: the pod's declared vramsched.io/model-memory (over all its GPUs); None: undeclared
    model_memory: int | None = None

    @property
    def namespace(self) -> str:
        return self.key.partition("/")[0]


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """A whole GPU or one MIG slice, as the ledger counts it."""

    node: str
    gpu: int
    device_id: str  # "0", or "0:3g.40gb:1" for a MIG slice (the ledger's id, the metrics' `gpu`)
    product: str
    sharing: str  # exclusive | time-slicing | mps | mig
    resource: str | None
    memory: int
    used: int
    replicas: int
    used_replicas: int
    pods: tuple[PodShare, ...] = ()
    profile: str | None = None
    slot: int | None = None

    @property
    def free(self) -> int:
        return self.memory - self.used

    @property
    def full(self) -> bool:
        """No replica left: nothing more can be placed here."""
        return self.used_replicas >= self.replicas

    @property
    def stranded(self) -> int:
        return max(0, self.free) if self.full else 0


@dataclass(frozen=True, slots=True)
class NodeUsage:
    name: str
    devices: tuple[DeviceUsage, ...] = ()
    problem: str | None = None

    @property
    def memory(self) -> int:
        return sum(d.memory for d in self.devices)

    @property
    def used(self) -> int:
        return sum(d.used for d in self.devices)

    @property
    def stranded(self) -> int:
        return sum(d.stranded for d in self.devices)

    @property
    def gpus(self) -> dict[int, list[DeviceUsage]]:
        """Devices by physical GPU index (a MIG GPU has several)."""
        out: dict[int, list[DeviceUsage]] = {}
        for d in self.devices:
            out.setdefault(d.gpu, []).append(d)
        return out


@dataclass(frozen=True, slots=True)
class Summary:
    nodes: int = 0
    gpus: int = 0
    gpus_in_use: int = 0  # physical GPUs with at least one pod on them (or on one of their slices)
    gpus_free: int = 0  # physical GPUs with no pod at all
    memory: int = 0
    used: int = 0
    stranded: int = 0
    pods: int = 0

    @property
    def used_fraction(self) -> float:
        return self.used / self.memory if self.memory else 0.0


def declared_memory(pod: Mapping[str, Any] | None) -> int | None:
    """The pod's vramsched.io/model-memory in bytes, None when absent or unreadable."""
    meta = (pod or {}).get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(MODEL_MEMORY) if isinstance(meta, Mapping) else None
    if raw is None:
        return None
    try:
        return parse_bytes(raw)
    except QuantityError:
        return None


def usage_from_ledger(
    ledger: Ledger, pods: Mapping[str, Mapping[str, Any]] | None = None
) -> list[NodeUsage]:
    """Every node of the ledger in its order, each device with the pods holding it. `pods` (by
    key, as `ClusterState.pods`) adds each pod's declared model memory."""
    pods = pods or {}
    a = ledger.arrays
    holders: dict[tuple[str, str], list[PodShare]] = {}
    declared: dict[str, int | None] = {}
    for res in ledger.reservations():
        if res.key not in declared:
            declared[res.key] = declared_memory(pods.get(res.key))
        for dev, nbytes in zip(res.device_ids, res.bytes_per_device):
            holders.setdefault((res.node, dev), []).append(
                PodShare(res.key, int(nbytes), declared[res.key])
            )
    out = []
    for inv in ledger.nodes():
        devices = []
        for d in inv.devices:
            i = ledger.row(inv.name, d.device_id)
            mig = isinstance(d, MigSlice)
            devices.append(
                DeviceUsage(
                    node=inv.name,
                    gpu=d.gpu_index,
                    device_id=d.device_id,
                    product=d.product,
                    sharing=MIG if mig else d.sharing.value,
                    resource=d.resource,
                    memory=d.memory_bytes,
                    used=int(a.used[i]) if i is not None else 0,
                    replicas=d.replicas,
                    used_replicas=int(a.used_replicas[i]) if i is not None else 0,
                    pods=tuple(sorted(holders.get((inv.name, d.device_id), ()), key=_pod_key)),
                    profile=d.profile if mig else None,
                    slot=d.slot if isinstance(d, MigSlice) else None,
                )
            )
        out.append(NodeUsage(inv.name, tuple(devices), inv.problem))
    return out


def _pod_key(p: PodShare) -> str:
    return p.key


# ----- /state, both ways -------------------------------------------------------------------------


def _holders(d: DeviceUsage) -> list[dict[str, Any]]:
    return [{"pod": p.key, "bytes": p.bytes, "modelMemory": p.model_memory} for p in d.pods]


def state_nodes(nodes: Iterable[NodeUsage]) -> list[dict[str, Any]]:
    """The `nodes` of `/state`: per node, per GPU (a MIG GPU's slices under it), who holds what;
    `holders` gives each pod's bytes and declared model memory beside the older `pods` keys."""
    out = []
    for n in nodes:
        gpus = []
        for index, devices in sorted(n.gpus.items()):
            if devices[0].profile is None:
                (d,) = devices[:1]
                gpus.append(
                    {
                        "index": index,
                        "product": d.product,
                        "memoryBytes": d.memory,
                        "usedBytes": d.used,
                        "replicas": d.replicas,
                        "usedReplicas": d.used_replicas,
                        "sharing": d.sharing,
                        "resource": d.resource,
                        "pods": [p.key for p in d.pods],
                        "holders": _holders(d),
                    }
                )
                continue
            gpus.append(
                {
                    "index": index,
                    "product": devices[0].product,
                    "memoryBytes": sum(d.memory for d in devices),
                    "usedBytes": sum(d.used for d in devices),
                    "replicas": sum(d.replicas for d in devices),
                    "usedReplicas": sum(d.used_replicas for d in devices),
                    "sharing": MIG,
                    "resource": None,
                    "pods": sorted({p.key for d in devices for p in d.pods}),
                    "slices": [
                        {
                            "profile": d.profile,
                            "slot": d.slot,
                            "resource": d.resource,
                            "memoryBytes": d.memory,
                            "usedBytes": d.used,
                            "replicas": d.replicas,
                            "usedReplicas": d.used_replicas,
                            "pods": [p.key for p in d.pods],
                            "holders": _holders(d),
                        }
                        for d in devices
                    ],
                }
            )
        entry: dict[str, Any] = {"name": n.name, "gpus": gpus}
        if n.problem:
            entry["problem"] = n.problem
        out.append(entry)
    return out


class StateError(ValueError):
    """A `/state` document that does not have the shape vramsched serves."""


def usage_from_state(doc: Any) -> list[NodeUsage]:
    """`usage_from_ledger`'s answer read back from a running extender's `/state` document."""
    try:
        return [_node_from_state(n) for n in doc["nodes"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise StateError(f"not a vramsched /state document ({type(exc).__name__}: {exc})") from None


#: what an extender writes for a count or a size: a JSON integer in int64's range
_INT64 = 1 << 63


def _count(entry: Mapping[str, Any], key: str) -> int:
    """A byte count, replica count or index as vramsched writes it: a whole number from 0 to
    int64's largest. A float, a flag or a negative one is another program's document, and read
    as one it would draw a bar of 10**18 characters or fail to print as JSON."""
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _INT64:
        raise ValueError(f"{key}={value!r} is not a whole number from 0 to 2**63 - 1")
    return value


def _optional_count(entry: Mapping[str, Any], key: str) -> int | None:
    return None if entry.get(key) is None else _count(entry, key)


def _text(entry: Mapping[str, Any], key: str, *, optional: bool = False) -> Any:
    value = entry.get(key) if optional else entry[key]
    if not isinstance(value, str) and not (optional and value is None):
        raise ValueError(f"{key}={value!r} is not a string")
    return value


def _pods_from_state(entry: Mapping[str, Any]) -> tuple[PodShare, ...]:
    holders = entry.get("holders")
    if holders is None:  # an extender from before `holders`: keys only
        return tuple(PodShare(str(k), None) for k in entry.get("pods") or ())
    return tuple(
        PodShare(
            _text(h, "pod"),
            _optional_count(h, "bytes"),
            _optional_count(h, "modelMemory"),
        )
        for h in holders
    )


def _node_from_state(n: Mapping[str, Any]) -> NodeUsage:
    name = _text(n, "name")
    devices = []
    for g in n["gpus"]:
        index = _count(g, "index")
        product = _text(g, "product")
        for s in g.get("slices") or ():
            profile, slot = _text(s, "profile"), _count(s, "slot")
            devices.append(
                DeviceUsage(
                    node=name,
                    gpu=index,
                    device_id=f"{index}:{profile}:{slot}",
                    product=product,
                    sharing=MIG,
                    resource=_text(s, "resource", optional=True),
                    memory=_count(s, "memoryBytes"),
                    used=_count(s, "usedBytes"),
                    replicas=_count(s, "replicas"),
                    used_replicas=_count(s, "usedReplicas"),
                    pods=_pods_from_state(s),
                    profile=profile,
                    slot=slot,
                )
            )
        if "slices" in g:
            continue
        devices.append(
            DeviceUsage(
                node=name,
                gpu=index,
                device_id=str(index),
                product=product,
                sharing=_text(g, "sharing"),
                resource=_text(g, "resource", optional=True),
                memory=_count(g, "memoryBytes"),
                used=_count(g, "usedBytes"),
                replicas=_count(g, "replicas"),
                used_replicas=_count(g, "usedReplicas"),
                pods=_pods_from_state(g),
            )
        )
    return NodeUsage(name, tuple(devices), _text(n, "problem", optional=True))


# ----- filters, order, summary --------------------------------------------------------------------


def select(
    nodes: Iterable[NodeUsage],
    *,
    node: str | None = None,
    product: str | None = None,
    namespace: str | None = None,
) -> list[NodeUsage]:
    """The nodes and devices an operator asked for. `node`: a name or shell glob; `product`: part
    of the GPU product, any case (`a100`); `namespace`: only devices holding a pod of it, listing
    only its pods (used/total stay the device's own)."""
    out = []
    for n in nodes:
        if node is not None and not fnmatch.fnmatchcase(n.name, node):
            continue
        devices = n.devices
        if product is not None:
            devices = tuple(d for d in devices if product.lower() in d.product.lower())
            if not devices:
                continue
        if namespace is not None:
            devices = tuple(
                replace(d, pods=tuple(p for p in d.pods if p.namespace == namespace))
                for d in devices
                if any(p.namespace == namespace for p in d.pods)
            )
            if not devices:
                continue
        out.append(replace(n, devices=devices) if devices is not n.devices else n)
    return out


#: `--sort`: most stranded VRAM first (the default), by name, by VRAM allocated, by VRAM free
SORT_KEYS = ("waste", "name", "used", "free")


def sort_nodes(nodes: Sequence[NodeUsage], by: str = "waste") -> list[NodeUsage]:
    if by == "name":
        return sorted(nodes, key=lambda n: n.name)
    if by == "used":
        return sorted(nodes, key=lambda n: (-_fraction(n.used, n.memory), n.name))
    if by == "free":
        return sorted(nodes, key=lambda n: (-(n.memory - n.used), n.name))
    if by == "waste":
        # stranded first; then the most fragmented: least used share of partly used nodes
        return sorted(
            nodes,
            key=lambda n: (
                -n.stranded,
                not 0 < n.used < n.memory,
                _fraction(n.used, n.memory),
                n.name,
            ),
        )
    raise ValueError(f"unknown sort {by!r}: expected one of {', '.join(SORT_KEYS)}")


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def summarize(nodes: Iterable[NodeUsage]) -> Summary:
    nodes = list(nodes)
    gpus = in_use = 0
    pods: set[str] = set()
    for n in nodes:
        for devices in n.gpus.values():
            gpus += 1
            in_use += any(d.used_replicas for d in devices)
            pods.update(p.key for d in devices for p in d.pods)
    return Summary(
        nodes=sum(1 for n in nodes if n.devices),
        gpus=gpus,
        gpus_in_use=in_use,
        gpus_free=gpus - in_use,
        memory=sum(n.memory for n in nodes),
        used=sum(n.used for n in nodes),
        stranded=sum(n.stranded for n in nodes),
        pods=len(pods),
    )


def report_dict(nodes: Sequence[NodeUsage], summary: Summary) -> dict[str, Any]:
    """`top -o json|yaml`: every shown device with its pods, and the summary (bytes throughout)."""
    return {
        "nodes": [
            {
                "name": n.name,
                **({"problem": n.problem} if n.problem else {}),
                "memoryBytes": n.memory,
                "usedBytes": n.used,
                "strandedBytes": n.stranded,
                "devices": [
                    {
                        "gpu": d.gpu,
                        "id": d.device_id,
                        **({"profile": d.profile} if d.profile else {}),
                        "product": d.product,
                        "sharing": d.sharing,
                        "resource": d.resource,
                        "memoryBytes": d.memory,
                        "usedBytes": d.used,
                        "freeBytes": d.free,
                        "strandedBytes": d.stranded,
                        "replicas": d.replicas,
                        "usedReplicas": d.used_replicas,
                        "pods": _holders(d),
                    }
                    for d in n.devices
                ],
            }
            for n in nodes
        ],
        "summary": {
            "nodes": summary.nodes,
            "gpus": summary.gpus,
            "gpusInUse": summary.gpus_in_use,
            "gpusFree": summary.gpus_free,
            "memoryBytes": summary.memory,
            "usedBytes": summary.used,
            "usedPercent": round(100 * summary.used_fraction, 1),
            "strandedBytes": summary.stranded,
            "pods": summary.pods,
        },
    }
