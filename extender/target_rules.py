"""kube-scheduler's filters that a placement plan does not model, asked of the pods a plan sends to
nodes. Pure (no I/O).

A plan (live repacking's, `plan-defrag`'s) books GPUs in the ledger and CPU and memory in its
capacity. Before a pod is evicted for it, each pod it sends somewhere must also pass the rest of
what kube-scheduler checks, or the evicted pod's new copy waits for a node it may not use:

- `schedulable_on`: the node's labels (`nodeSelector`, required node affinity), taints, cordon,
  and, given the claims and volumes read (`volume_rules.Storage`), where the pod's volumes reach;
- `room_problem`: the node's pod count, host ports and every resource beside CPU, memory and GPUs;
- `target_problem`: both of the last for every node (with the storage read, its CSI attach
  limits too: `attach_limits`), then required pod affinity and anti-affinity
  (`pod_affinity`) and `DoNotSchedule` topology spread (`topology_spread`), on the cluster as it
  will be once the moved pods are gone;
- `node_masks`: `schedulable_on` for every node at once, for a model to offer only those.

Each matches a real kube-scheduler (1.20 and 1.36) case by case in the e2e tests
(`test_repack_targets_e2e.py`, `test_pod_affinity_e2e.py`, `test_topology_spread_e2e.py`,
`test_volume_rules_e2e.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

import numpy as np
import orjson

from extender.attach_limits import attach_refusal, needs_counting
from extender.demand import TERMINAL_PHASES, DemandError, pod_requests
from extender.inventory import is_gpu_resource
from extender.node_rules import node_affinity_refusal, node_labels, node_name, untolerated_taint
from extender.object_fields import field, items, mapping, spec
from extender.pod_affinity import affinity_problem, has_pod_affinity
from extender.quantity import QuantityError, parse_quantity
from extender.scheduler_profile import SchedulerProfile
from extender.spread_defaults import SpreadDefaults
from extender.topology_spread import has_hard_spread, spread_problem
from extender.volume_rules import Storage, claim_keys, volume_refusal

__all__ = [
    "HostPort",
    "host_ports",
    "node_masks",
    "room_problem",
    "schedulable_on",
    "target_problem",
]


def schedulable_on(
    pod: Mapping[str, Any],
    node: Mapping[str, Any],
    storage: Storage | None = None,
    profile: SchedulerProfile | None = None,
) -> str | None:
    """Why kube-scheduler would keep a pod with this spec off `node`, or None. The rules a plan
    cannot see, checked for a move's target: nodeSelector, required node affinity (and the
    scheduler `profile`'s added one), taints that repel new pods (NoSchedule, NoExecute),
    cordoned nodes and, with `storage`, the node affinity and zones of the volumes its claims are
    bound to (`volume_rules`; without it they are not checked). A move that fails them would
    leave its re-created pod waiting for a node it may not use."""
    refusal = profile.added_affinity_refusal(node) if profile is not None else None
    if refusal is None:
        refusal = node_affinity_refusal(pod, node)
    if refusal is not None:
        return refusal
    name = node_name(node)
    if spec(node).get("unschedulable"):
        return f"node {name} is cordoned"
    taint = untolerated_taint(pod, node)
    if taint is not None:
        return f"node {name} has taint {taint.get('key')} the pod does not tolerate"
    if storage is not None:
        return volume_refusal(pod, node, storage)
    return None


def _whole(value: object) -> int:
    """A quantity as kube-scheduler compares it (rounded up to a whole unit); 0 if absent or
    unreadable."""
    try:
        return math.ceil(parse_quantity(value)) if value is not None else 0
    except QuantityError:
        return 0


def _unbooked_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """The pod's requests that a plan does not book itself (CPU and memory are in its capacity,
    GPUs in the ledger), each rounded up; {} for a pod whose requests do not parse."""
    try:
        total = pod_requests(spec(pod), mapping(pod.get("status")))
    except (DemandError, QuantityError):
        return {}
    return {
        str(k): math.ceil(q)
        for k, q in total.items()
        if k not in ("cpu", "memory") and not is_gpu_resource(str(k)) and q > 0
    }


#: a host port as kube-scheduler's NodePorts keys it: (host IP, protocol, port)
HostPort = tuple[str, str, int]


def host_ports(pod: Mapping[str, Any]) -> list[HostPort]:
    """The host ports the pod binds: its containers' and its sidecars' (init containers with
    `restartPolicy: Always`, which run beside them), the IP defaulting to every address and the
    protocol to TCP."""
    containers = [
        c
        for c in items(spec(pod).get("initContainers"))
        if isinstance(c, Mapping) and c.get("restartPolicy") == "Always"
    ] + [c for c in items(spec(pod).get("containers")) if isinstance(c, Mapping)]
    out = []
    for c in containers:
        for p in items(c.get("ports")):
            port = mapping(p).get("hostPort")
            if isinstance(port, int) and not isinstance(port, bool) and port > 0:
                ip = str(mapping(p).get("hostIP") or "0.0.0.0")
                out.append((ip, str(mapping(p).get("protocol") or "TCP"), port))
    return out


def _port_taken(used: Iterable[HostPort], wanted: HostPort) -> bool:
    """NodePorts' conflict rule: the same protocol and port, on the same IP or where either side
    binds every address."""
    ip, protocol, port = wanted
    return any(
        p == protocol and n == port and (ip == "0.0.0.0" or i in ("0.0.0.0", ip))
        for i, p, n in used
    )


def room_problem(
    node: Mapping[str, Any],
    staying: Sequence[Mapping[str, Any]],
    arriving: Sequence[Mapping[str, Any]],
    profile: SchedulerProfile | None = None,
) -> str | None:
    """Why kube-scheduler's NodeResourcesFit or NodePorts would keep one of `arriving` off `node`
    once the plan's moved pods have left it (`staying`: the pods still there), or None.

    A plan books CPU, memory and GPUs itself; this checks the rest: the node's pod count, the host
    ports the pods bind, and every other resource the arriving pods ask (ephemeral storage,
    hugepages, extended resources). A resource the node's allocatable does not list counts as
    none, as kube-scheduler counts it; a node that lists no allocatable at all (a hand-written
    cluster file) is checked for host ports only. The extended resources the scheduler `profile`
    tells NodeResourcesFit to ignore are not checked."""
    if not arriving:
        return None
    name = node_name(node)
    used = [hp for pod in staying for hp in host_ports(pod)]
    for pod in arriving:
        ports = host_ports(pod)
        for wanted in ports:
            if _port_taken(used, wanted):
                ip, protocol, port = wanted
                return f"node {name} has host port {protocol} {ip}:{port} taken"
        used += ports
    alloc = mapping(field(node, "status", "allocatable"))
    if not alloc:
        return None
    allowed, count = _whole(alloc.get("pods")), len(staying) + len(arriving)
    if count > allowed:
        return f"node {name} takes {allowed} pods and would hold {count}"
    asked: dict[str, int] = {}
    for pod in arriving:
        for k, q in _unbooked_requests(pod).items():
            if profile is None or not profile.ignores(k):
                asked[k] = asked.get(k, 0) + q
    if not asked:
        return None
    held = dict.fromkeys(asked, 0)
    for pod in staying:
        for k, q in _unbooked_requests(pod).items():
            if k in held:
                held[k] += q
    for k in sorted(asked):
        free = max(0, _whole(alloc.get(k)) - held[k])
        if asked[k] > free:
            return f"node {name} has {free} of {k} free and the pods sent there ask {asked[k]}"
    return None


def target_problem(
    nodes: Mapping[str, Mapping[str, Any]],
    pods: Mapping[str, Mapping[str, Any]],
    sent: Sequence[tuple[str | None, Mapping[str, Any], str]],
    leaving: Set[str],
    storage: Storage | None = None,
    *,
    profile: SchedulerProfile | None = None,
    spread: SpreadDefaults | None = None,
) -> tuple[str, str | None] | None:
    """What kube-scheduler would say to pods sent to nodes, on the rules a plan does not model:
    `room_problem` for every node they go to and, with `storage`, its CSI attach limits
    (`attach_limits`), then required inter-pod (anti-)affinity (`pod_affinity`) and topology
    spread (`topology_spread`) for each, among the cluster's pods (`pods`, by key) less those
    `leaving`. `sent`: (a key to blame or None, the pod, its node). `profile` and `spread`: the
    scheduler profile's ignored resources and default spread constraints (none without). None, or
    (why, the key to blame: the pod that breaks a rule, or the last one sent to a node without
    room)."""
    staying: list[tuple[Mapping[str, Any], str]] = []
    for key, running in pods.items():
        where = spec(running).get("nodeName")
        if (
            isinstance(where, str)
            and where
            and key not in leaving
            and str(field(running, "status", "phase")) not in TERMINAL_PHASES
        ):
            staying.append((running, where))
    for name in dict.fromkeys(node for _, _, node in sent):
        node = nodes.get(name)
        there = [p for _, p, n in sent if n == name]
        why, to_blame = None, [(k, p) for k, p, n in reversed(sent) if n == name]
        if node is not None:
            kept = [p for p, n in staying if n == name]
            why = room_problem(node, kept, there, profile)
            if why is None and storage is not None:
                why = attach_refusal(node, kept, there, storage)
                # the pods without volumes to count are not what fills the node's limit
                to_blame = [(k, p) for k, p in to_blame if needs_counting([p], storage)]
        if why is not None:
            # leave out the last pod moved there, so that the next plan may send it elsewhere
            return why, next((k for k, _ in to_blame if k is not None), None)
    labels_of = {name: node_labels(node) for name, node in nodes.items()}
    final = staying + [(p, n) for _, p, n in sent]
    # a pod stating no pod affinity meets only the terms of pods that state some
    ruled = [j for j, (p, _) in enumerate(final) if has_pod_affinity(p)]
    for i, (who, arriving, target) in enumerate(sent):
        me = len(staying) + i
        if has_pod_affinity(arriving):
            others = final[:me] + final[me + 1 :]
        else:
            others = [final[j] for j in ruled if j != me]
        why = affinity_problem(arriving, target, others, labels_of)
        if why is None and has_hard_spread(arriving, spread):
            why = spread_problem(arriving, target, final[:me] + final[me + 1 :], nodes, spread)
        if why is not None:
            return why, who
    return None


def node_masks(
    nodes: Mapping[str, Mapping[str, Any]],
    pods: Mapping[str, Mapping[str, Any]],
    node_names: Sequence[str],
    storage: Storage | None = None,
    profile: SchedulerProfile | None = None,
) -> Callable[[str], np.ndarray | None]:
    """Per pod key, the nodes (in ledger row order) whose labels, taints, cordon and (with
    `storage`) volumes let its new copy on (`schedulable_on`, with the scheduler `profile`'s added
    node affinity), worked out once per distinct set of the pod's node rules and claims."""
    cache: dict[bytes, np.ndarray] = {}

    def mask(key: str) -> np.ndarray | None:
        pod = pods.get(key)
        if pod is None:
            return None
        rules = {
            "nodeSelector": field(pod, "spec", "nodeSelector"),
            "nodeAffinity": field(pod, "spec", "affinity", "nodeAffinity"),
            "tolerations": field(pod, "spec", "tolerations"),
            "claims": claim_keys(pod) if storage is not None else None,
        }
        # schedulable_on reads no other field of the pod
        sig = orjson.dumps(rules, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
        if sig not in cache:
            cache[sig] = np.fromiter(
                (
                    n in nodes and schedulable_on(pod, nodes[n], storage, profile) is None
                    for n in node_names
                ),
                bool,
                len(node_names),
            )
        return cache[sig]

    return mask
