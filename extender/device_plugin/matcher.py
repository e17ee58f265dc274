"""Which pod an Allocate is for, and which GPUs it gets. Pure: no I/O, no clock.

The kubelet's `Allocate` names devices, never the pod. But the kubelet admits one pod at a time
and allocates its GPU containers one after the other (init containers first, then the app
containers, each in spec order; pkg/kubelet/cm/devicemanager/manager.go `Allocate`), and its
PodResources `List` answers, while that Allocate is waiting, with the pods it holds as active and
the devices each container already has. The pod being admitted is among them, with no devices yet
for the container being allocated; every pod admitted before it has its devices. So:

  candidates = pods the kubelet lists whose next GPU container (first one without devices)
               requests exactly the number of devices in the Allocate.

One candidate (or several carrying the same GPUs) is the answer: exactly the GPUs its
`vramsched.io/assignment` names. Anything else is refused with a message that reaches the pod's
events (`UnexpectedAdmissionError`): no candidate, candidates with different GPUs, a pod vramsched
did not place, an assignment for another node, a GPU that is unhealthy or unknown. Never a guess.

Kubelets before 1.34 (or with the KubeletPodResourcesListUseActivePods gate off) also list pods
that ended, Failed ones among them, with no devices: a pod whose API phase is Failed or Succeeded
waits for nothing and is never a candidate (`ENDED`).

Non-restartable init containers are not in PodResources `List`; the plugin remembers the ones it
served (`served_init`), and takes one as allocated also when a container after it holds devices
or the API shows the pod admitted (a kubelet restart lists pods admitted before).

Sidecars (init containers with `restartPolicy: Always`) and app containers take consecutive
slices of the assignment in spec order. A plain init container runs beside the sidecars started
before it, so it takes the GPUs after theirs; the kubelet hands its devices on to the app
containers, which take the same GPUs next. The assignment holds as many GPUs as kube-scheduler
counts for the pod (component-helpers `PodRequests`, extender.demand).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from extender.assignment import AssignmentError, decode_assignment
from extender.demand import ASSIGNMENT, DemandError, pod_ref, pod_requests
from extender.quantity import QuantityError, parse_quantity

__all__ = [
    "Slot",
    "KubeletPod",
    "Match",
    "Refusal",
    "container_slots",
    "identify",
    "SlotCache",
    "preferred_devices",
    "replica_id",
    "gpu_of",
    "gpu_limit",
    "ended",
    "admitted",
]

#: API phases of pods the kubelet will never allocate devices for again
ENDED = frozenset({"Failed", "Succeeded"})


@dataclass(frozen=True, slots=True)
class Slot:
    """One container of a pod that requests the resource, in the kubelet's allocation order."""

    container: str
    count: int
    gpus: tuple[int, ...]  # GPU indices it is handed
    init: bool = False  # a non-restartable init container: not listed by PodResources


@dataclass(frozen=True, slots=True)
class KubeletPod:
    """A pod as PodResources `List` shows it: per container, its device IDs of our resource."""

    namespace: str
    name: str
    devices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Match:
    """The Allocate is for `slot` of `pod` (namespace/name), UID `uid`.

    `tied`: other pods that look as if they wait for a slot of the same GPUs. The kubelet admits
    one pod at a time, so all but one of them were admitted before, and look waiting only
    because a restart lost the record of their plain init containers: the caller marks each
    one's init slot as served too, so that the pod really admitted keeps its own record."""

    pod: str
    uid: str
    slot: Slot
    tied: tuple[Match, ...] = ()


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the plugin does not answer; the kubelet shows it on the pod."""

    reason: str
    ambiguous: bool = False


def ended(pod: Mapping[str, Any]) -> bool:
    """The pod's API phase says it ended (older kubelets still list such pods)."""
    return (pod.get("status") or {}).get("phase") in ENDED


def admitted(pod: Mapping[str, Any]) -> bool:
    """The API shows the kubelet admitted the pod, and so allocated all its devices: it wrote
    container statuses, or a phase past Pending. The kubelet writes a pod's first status only
    after admission (a refused pod gets Failed)."""
    status = pod.get("status") or {}
    return bool(
        status.get("initContainerStatuses")
        or status.get("containerStatuses")
        or status.get("phase") in ("Running", *ENDED)
    )


def gpu_limit(container: Mapping[str, Any], resource: str) -> int:
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {} if isinstance(resources, Mapping) else {}
    raw = limits.get(resource) if isinstance(limits, Mapping) else None
    if raw is None:
        return 0
    try:
        value = parse_quantity(raw)
    except QuantityError:
        return 0
    return int(value) if value == int(value) and value > 0 else 0


def container_slots(pod: Mapping[str, Any], resource: str, node: str) -> list[Slot] | Refusal:
    """The pod's GPU containers with the GPUs each is handed, or why the pod cannot be served.

    The kubelet allocates by `limits` (extended resources have requests == limits)."""
    spec = pod.get("spec") or {}
    # (name, count, plain init container): init containers in spec order (sidecars, with
    # restartPolicy Always, keep their devices like app containers), then the app containers
    wanted = [
        (c.get("name", ""), gpu_limit(c, resource), c.get("restartPolicy") != "Always")
        for c in spec.get("initContainers") or []
        if isinstance(c, Mapping)
    ]
    wanted += [
        (c.get("name", ""), gpu_limit(c, resource), False)
        for c in spec.get("containers") or []
        if isinstance(c, Mapping)
    ]
    wanted = [w for w in wanted if w[1] > 0]
    if not wanted:
        return []
    try:
        ref = pod_ref(pod)
        res = decode_assignment(ref, (pod.get("metadata") or {}).get("annotations") or {})
    except (DemandError, AssignmentError) as exc:
        return Refusal(str(exc))
    if res is None:
        return Refusal(
            f"pod {ref} has no vramsched.io/assignment: on nodes served by vramsched's device "
            "plugin, GPU pods must be scheduled by vramsched (schedulerName: vramsched)"
        )
    if res.node != node:
        return Refusal(f"pod {ref} is assigned GPUs on {res.node}, not on this node ({node})")
    try:
        gpus = tuple(int(d) for d in res.device_ids)
    except ValueError:
        return Refusal(
            f"pod {ref} is assigned {', '.join(res.device_ids)}: vramsched's device plugin "
            "serves whole GPUs, not MIG slices"
        )
    out: list[Slot] = []
    at = 0  # the sidecars' and app containers' GPUs are consecutive, in spec order
    for name, count, init in wanted:
        # a plain init container runs beside the sidecars before it, so it takes the GPUs
        # after theirs; the kubelet hands them on to the app containers, which follow
        chosen = gpus[at : at + count]
        if not init:
            at += count
        if len(chosen) != count:
            return Refusal(
                f"pod {ref} requests more {resource} than its assignment holds ({len(gpus)})"
                f"{_needed(pod, resource)}"
            )
        out.append(Slot(name, count, chosen, init))
    return out


def _needed(pod: Mapping[str, Any], resource: str) -> str:
    """`: N at once`, the GPUs the pod holds at once as the extender books them
    (`demand.pod_requests`, kube-scheduler's count); empty if its requests do not parse."""
    try:
        count = pod_requests(pod.get("spec") or {}).get(resource, 0)
    except (DemandError, QuantityError):
        return ""
    return f": {int(count)} at once"


class SlotCache:
    """`container_slots` per pod, kept while the pod's UID and assignment stay the same (its
    containers' limits cannot change after creation): Allocate then parses only new pods."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._slots: dict[tuple[str, str], list[Slot] | Refusal] = {}

    def __call__(self, pod: Mapping[str, Any], resource: str, node: str) -> list[Slot] | Refusal:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        raw = str((meta.get("annotations") or {}).get(ASSIGNMENT, ""))
        if not uid:
            return container_slots(pod, resource, node)
        key = (uid, raw)
        hit = self._slots.get(key)
        if hit is None:
            if len(self._slots) >= self.size:
                self._slots.clear()
            hit = self._slots[key] = container_slots(pod, resource, node)
        return hit


def identify(
    count: int,
    kubelet_pods: Iterable[KubeletPod],
    pods: Mapping[str, Mapping[str, Any]],
    served_init: Mapping[str, frozenset[str]],
    resource: str,
    node: str,
    slots_of: Any = container_slots,
) -> Match | Refusal:
    """The pod and container an Allocate of `count` devices is for (module docstring).

    `kubelet_pods` name pods by namespace/name only (PodResources v1 carries no UID); `pods`:
    the API's pods by namespace/name (every pod the kubelet lists must be there; the caller
    reads missing ones first), which give the UID; `served_init`: per pod UID, the init
    containers already allocated. Pods whose API phase is Failed or Succeeded are skipped."""
    candidates: list[Match] = []
    refusals: list[str] = []
    waiting: list[str] = []
    for kp in kubelet_pods:
        pod = pods.get(kp.key)
        if pod is None or ended(pod):
            continue
        slots = slots_of(pod, resource, node)
        if not slots:
            continue
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if isinstance(slots, Refusal):
            # a GPU pod we cannot serve: only a candidate if nothing of it is allocated yet
            if not any(kp.devices.values()):
                refusals.append(slots.reason)
            continue
        plain_init = any(s.init for s in slots)  # admitted() only matters for those
        nxt = _next_slot(slots, kp, served_init.get(uid, frozenset()), plain_init and admitted(pod))
        if nxt is None:
            continue
        if nxt.count != count:
            waiting.append(f"{kp.key} ({nxt.count})")
            continue
        candidates.append(Match(kp.key, uid, nxt))
    if refusals and not candidates:
        return Refusal(refusals[0] if len(refusals) == 1 else "; ".join(sorted(refusals)))
    if refusals:
        return Refusal(
            f"cannot tell whether this allocation of {count} {resource} is for "
            f"{', '.join(m.pod for m in candidates)} or for a pod vramsched cannot serve "
            f"({'; '.join(sorted(refusals))}); refusing rather than guessing",
            ambiguous=True,
        )
    if not candidates:
        detail = f" (waiting: {', '.join(sorted(waiting))})" if waiting else ""
        return Refusal(f"no pod on {node} is waiting for {count} {resource}{detail}")
    if len({m.slot.gpus for m in candidates}) > 1:
        names = ", ".join(f"{m.pod} (GPU {_indices(m.slot.gpus)})" for m in candidates)
        return Refusal(
            f"cannot tell which pod this allocation of {count} {resource} is for: {names} "
            "wait with different GPUs; refusing rather than guessing",
            ambiguous=True,
        )
    first, *rest = candidates
    return Match(first.pod, first.uid, first.slot, tuple(rest)) if rest else first


def _next_slot(
    slots: Sequence[Slot], kp: KubeletPod, served: frozenset[str], was_admitted: bool
) -> Slot | None:
    """The first slot still without devices. A plain init container (never listed) counts as
    allocated when the plugin served it, when a slot after it holds devices (the kubelet
    allocates in order), or when the API shows the pod admitted: after a kubelet restart the
    kubelet lists pods it admitted before, whose init containers this plugin may never have
    seen (it restarted too, or registered before the kubelet listed them)."""
    for i, s in enumerate(slots):
        if not s.init:
            if not kp.devices.get(s.container):
                return s
            continue
        if s.container in served or was_admitted:
            continue
        if any(not t.init and kp.devices.get(t.container) for t in slots[i + 1 :]):
            continue
        return s
    return None


def _indices(gpus: Sequence[int]) -> str:
    return ",".join(map(str, gpus))


def replica_id(uuid: str, replica: int, replicas: int) -> str:
    """NVIDIA's device ID: the UUID, with `::<replica>` when GPUs are shared (rm/devices.go)."""
    return f"{uuid}::{replica}" if replicas > 1 else uuid


def gpu_of(device_id: str) -> str:
    """The GPU UUID of a device ID (replica or whole)."""
    return device_id.split("::", 1)[0]


def preferred_devices(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpus: Sequence[str] | None,
) -> list[str]:
    """The kubelet's `GetPreferredAllocation`: replicas of the GPUs (UUIDs) the pod is assigned,
    so that the kubelet's own record (PodResources, and tools that read it, e.g. DCGM exporter)
    names the GPUs the container really gets; `gpus` None (pod unknown): any, lowest IDs first.
    Always `size` IDs when `available` has them, `must_include` first."""
    chosen = list(dict.fromkeys(must_include))[:size]
    taken = set(chosen)
    free = sorted((d for d in available if d not in taken), key=_replica_order)
    for uuid in gpus or ():
        if len(chosen) >= size:
            break
        if any(gpu_of(d) == uuid for d in chosen):
            continue
        pick = next((d for d in free if gpu_of(d) == uuid and d not in taken), None)
        if pick is not None:
            chosen.append(pick)
            taken.add(pick)
    for d in free:
        if len(chosen) >= size:
            break
        if d not in taken:
            chosen.append(d)
            taken.add(d)
    return chosen


def _replica_order(device_id: str) -> tuple[str, int]:
    uuid, _, replica = device_id.partition("::")
    return uuid, int(replica) if replica.isdecimal() else 0
