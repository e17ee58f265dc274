"""Live repacking judges a move's target node as the real kube-scheduler does.

Before it evicts a running pod, `serve --repack` checks that the pod its controller re-creates may
go to the node the plan moves it to (`target_rules.schedulable_on`: nodeSelector, required node
affinity, taints, cordon). A target it wrongly passes evicts a serving pod whose replacement then
waits for a node it may not use. Here every pod shape meets every node shape on a real control
plane: the pod, pinned to one node by a `metadata.name` field that every one of its affinity terms
also requires, is placed by kube-scheduler exactly when vramsched's check passes the node. The
one difference is by design: vramsched never moves a pod to a cordoned node, even one whose pods
tolerate the cordon's taint.

The second test does the same for a target's room in what a plan does not book itself
(`target_rules.room_problem`): the node's pod count, host ports (a sidecar's too), ephemeral
storage, hugepages and extended resources other than GPUs, with pods already bound there.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from controlplane import ControlPlane
from verdicts import verdicts

from extender.target_rules import room_problem, schedulable_on

NS = "default"
SCHEDULER = "vramsched"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"

#: node name -> (labels, taints, cordoned)
NODES: dict[str, tuple[dict[str, str], list[dict[str, str]], bool]] = {
    "a100": ({"gpu": "a100", "zone": "z1", "mem": "80"}, [], False),
    "h100": ({"gpu": "h100", "mem": "40"}, [], False),
    "plain": ({"mem": "eighty"}, [], False),
    "dedicated": (
        {"gpu": "a100"},
        [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}],
        False,
    ),
    "evicting": ({}, [{"key": "dedicated", "value": "gpu", "effect": "NoExecute"}], False),
    "preferred": ({}, [{"key": "dedicated", "value": "gpu", "effect": "PreferNoSchedule"}], False),
    "keyonly": ({}, [{"key": "gpu-only", "effect": "NoSchedule"}], False),
    "cordoned": ({"gpu": "a100"}, [], True),
}


def _affinity(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]
                }
            }
        }
    }


def _expr(key: str, op: str, *values: str) -> dict[str, Any]:
    e: dict[str, Any] = {"key": key, "operator": op}
    if values:
        e["values"] = list(values)
    return e


#: pod shape -> the spec fields it adds
PODS: dict[str, dict[str, Any]] = {
    "anywhere": {},
    "selector-a100": {"nodeSelector": {"gpu": "a100"}},
    "in-a100-h100": _affinity([_expr("gpu", "In", "a100", "h100")]),
    "notin-a100": _affinity([_expr("gpu", "NotIn", "a100")]),
    "zone-exists": _affinity([_expr("zone", "Exists")]),
    "zone-absent": _affinity([_expr("zone", "DoesNotExist")]),
    "mem-gt-50": _affinity([_expr("mem", "Gt", "50")]),
    "mem-lt-50": _affinity([_expr("mem", "Lt", "50")]),
    "h100-or-zone": _affinity([_expr("gpu", "In", "h100")], [_expr("zone", "Exists")]),
    "two-in-one-term": _affinity([_expr("gpu", "In", "a100"), _expr("zone", "Exists")]),
    "tolerates-everything": {"tolerations": [{"operator": "Exists"}]},
    "tolerates-dedicated-gpu": {
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
        ]
    },
    "tolerates-dedicated-any": {"tolerations": [{"key": "dedicated", "operator": "Exists"}]},
    "tolerates-dedicated-other-value": {
        "tolerations": [{"key": "dedicated", "value": "cpu", "effect": "NoSchedule"}]
    },
    "tolerates-noexecute-for-a-while": {
        "tolerations": [
            {
                "key": "dedicated",
                "operator": "Equal",
                "value": "gpu",
                "effect": "NoExecute",
                "tolerationSeconds": 30,
            }
        ]
    },
    "tolerates-keyonly": {"tolerations": [{"key": "gpu-only", "effect": "NoSchedule"}]},
    "tolerates-cordon": {
        "tolerations": [{"key": UNSCHEDULABLE, "operator": "Exists", "effect": "NoSchedule"}]
    },
    "selector-and-toleration": {
        "nodeSelector": {"gpu": "a100"},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
    },
}


def _pod(name: str, shape: dict[str, Any]) -> dict[str, Any]:
    spec = {
        "schedulerName": SCHEDULER,
        "containers": [{"name": "app", "image": "busybox"}],
        **copy.deepcopy(shape),
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _pinned(pod: dict[str, Any], node: str) -> dict[str, Any]:
    """The pod with every required affinity term (or a new one) also requiring `node` by name."""
    out = copy.deepcopy(pod)
    pin = [{"key": "metadata.name", "operator": "In", "values": [node]}]
    required = (
        out["spec"]
        .setdefault("affinity", {})
        .setdefault("nodeAffinity", {})
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {"nodeSelectorTerms": [{}]})
    )
    for term in required["nodeSelectorTerms"]:
        term["matchFields"] = pin
    return out


@pytest.mark.e2e
def test_move_targets_are_judged_as_kube_scheduler_judges_them(cluster: ControlPlane) -> None:
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    core = cluster.core_v1()
    api = cluster.api_client()
    nodes: dict[str, dict[str, Any]] = {}
    for name, (labels, taints, cordoned) in NODES.items():
        cluster.create_gpu_node(name, labels=labels, taints=taints)
        if cordoned:
            core.patch_node(name, {"spec": {"unschedulable": True}})
        nodes[name] = api.sanitize_for_serialization(core.read_node(name))
    probes: dict[str, tuple[str, str]] = {}
    for i, shape in enumerate(PODS):
        for j, node in enumerate(NODES):
            probe = f"target-{i}-{j}"
            probes[probe] = (shape, node)
            core.create_namespaced_pod(NS, _pinned(_pod(probe, PODS[shape]), node))

    theirs = cluster.wait_for(
        lambda: verdicts(core, probes), timeout=120, message="a verdict on every probe"
    )
    disagree = []
    for probe, (shape, node) in probes.items():
        ours = schedulable_on(_pod(probe, PODS[shape]), nodes[node])
        if node == "cordoned" and shape in ("tolerates-everything", "tolerates-cordon"):
            # by design stricter than kube-scheduler: never a move onto a cordoned node
            assert theirs[probe] and ours is not None, (shape, node, ours)
            continue
        if (ours is None) != theirs[probe]:
            disagree.append(f"{shape} on {node}: kube-scheduler {theirs[probe]}, vramsched {ours}")
    assert not disagree, "\n".join(disagree)
    # the shapes cover both answers on every node, and every node refuses some shape
    assert all(any(theirs[p] for p, (_, n) in probes.items() if n == node) for node in NODES)
    assert all(not all(theirs[p] for p, (_, n) in probes.items() if n == node) for node in NODES)


def _ports(port: int, **extra: Any) -> dict[str, Any]:
    """What a container or sidecar asks besides requests: host ports."""
    return {"ports": [{"containerPort": port, "hostPort": port, **extra}]}


#: a container's requests (and limits) and its other fields (host ports, or a sidecar's)
Ask = tuple[dict[str, str], dict[str, Any]]

#: node shape -> (allocatable over the defaults, what each pod already bound there asks)
ROOMY: dict[str, tuple[dict[str, str], list[Ask]]] = {
    "slot-left": ({"pods": "3"}, [({}, {}), ({}, {})]),
    "no-slot": ({"pods": "2"}, [({}, {}), ({}, {})]),
    "disk": ({"ephemeral-storage": "10Gi"}, [({"ephemeral-storage": "6Gi"}, {})]),
    "nic": ({"example.com/nic": "2"}, [({"example.com/nic": "1"}, {})]),
    "pages": ({"hugepages-2Mi": "1Gi"}, [({"hugepages-2Mi": "256Mi", "memory": "64Mi"}, {})]),
    "lists-none": ({}, []),
    "port-8000": ({}, [({}, _ports(8000))]),
    "port-8000-one-ip": ({}, [({}, _ports(8000, hostIP="10.0.0.1"))]),
    "port-8000-udp-sidecar": ({}, [({}, {"sidecar": _ports(8000, protocol="UDP")})]),
}

#: pod shape -> what its container asks
ASKS: dict[str, Ask] = {
    "nothing-else": ({}, {}),
    "disk-4Gi": ({"ephemeral-storage": "4Gi"}, {}),
    "disk-5Gi": ({"ephemeral-storage": "5Gi"}, {}),
    "nic-1": ({"example.com/nic": "1"}, {}),
    "nic-2": ({"example.com/nic": "2"}, {}),
    "pages-768Mi": ({"hugepages-2Mi": "768Mi", "memory": "64Mi"}, {}),
    "pages-1Gi": ({"hugepages-2Mi": "1Gi", "memory": "64Mi"}, {}),
    "port-8000": ({}, _ports(8000)),
    "port-8000-udp": ({}, _ports(8000, protocol="UDP")),
    "port-8000-other-ip": ({}, _ports(8000, hostIP="10.0.0.2")),
    "port-8001": ({}, _ports(8001)),
}


def _asking(name: str, ask: Ask, node: str | None = None) -> dict[str, Any]:
    requests, other = ask
    container: dict[str, Any] = {"name": "app", "image": "busybox"}
    if requests:
        container["resources"] = {"requests": dict(requests), "limits": dict(requests)}
    spec: dict[str, Any] = {"schedulerName": SCHEDULER, "containers": [container]}
    if "sidecar" in other:
        sidecar = {"name": "side", "image": "busybox", "restartPolicy": "Always"}
        spec["initContainers"] = [{**sidecar, **other["sidecar"]}]
    elif other:
        container.update(copy.deepcopy(other))
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.mark.e2e
def test_move_targets_room_is_judged_as_kube_scheduler_judges_it(cluster: ControlPlane) -> None:
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    core = cluster.core_v1()
    api = cluster.api_client()
    probes: dict[str, tuple[str, str]] = {}
    for i, shape in enumerate(ASKS):
        for j, (alloc, residents) in enumerate(ROOMY.values()):
            # a node per probe: a probe kube-scheduler places takes room the next one would see
            node = f"room-{i}-{j}"
            cluster.create_gpu_node(node, allocatable=alloc)
            for k, ask in enumerate(residents):
                core.create_namespaced_pod(NS, _asking(f"resident-{i}-{j}-{k}", ask, node))
            probe = f"room-probe-{i}-{j}"
            probes[probe] = (shape, node)
            core.create_namespaced_pod(NS, _pinned(_asking(probe, ASKS[shape]), node))

    theirs = cluster.wait_for(
        lambda: verdicts(core, probes), timeout=120, message="a verdict on every probe"
    )
    pods = [api.sanitize_for_serialization(p) for p in core.list_namespaced_pod(NS).items]
    disagree = []
    for probe, (shape, node) in probes.items():
        staying = [
            p for p in pods if p["metadata"]["name"].startswith("resident-" + node[5:] + "-")
        ]
        ours = room_problem(
            api.sanitize_for_serialization(core.read_node(node)),
            staying,
            [_asking(probe, ASKS[shape])],
        )
        if (ours is None) != theirs[probe]:
            disagree.append(f"{shape} on {node}: kube-scheduler {theirs[probe]}, vramsched {ours}")
    assert not disagree, "\n".join(disagree)
    # every node shape refuses some shapes, and all but the one without a slot take some
    by_kind = {
        kind: [theirs[f"room-probe-{i}-{j}"] for i in range(len(ASKS))]
        for j, kind in enumerate(ROOMY)
    }
    assert not any(by_kind["no-slot"]) and all(any(v) for k, v in by_kind.items() if k != "no-slot")
    # (1.20 has no sidecars: its API server keeps the container as a plain init container)
    assert all(not all(v) for k, v in by_kind.items() if k != "port-8000-udp-sidecar")
