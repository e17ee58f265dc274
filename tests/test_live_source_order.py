"""Live mode's ledger is a function of the API's objects, whatever order the two watches deliver
their changes in.

The node and pod watches are two streams with no common order: a pod can arrive bound to a node
the extender has not seen, a node can be relabelled or deleted under bound pods, a relist can come
at any point of either stream. Here random histories of nodes and pods (added, relabelled,
deleted; pods created, bound, ended, deleted, re-created under the same name) are delivered with
each stream in its own order but the two interleaved at random, with relists, and the ledger at
the end must be the one a fresh extender builds from the final objects.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import orjson
import pytest
from builders import gpu_node, pod
from kube_fakes import FakeApi

from extender.cluster import ClusterState
from extender.demand import ASSIGNMENT
from extender.inventory import ReplicaPolicy
from extender.live.source import LiveSource

GIB = 1 << 30
NODE_NAMES = ("n0", "n1", "n2", "n3")
POD_NAMES = tuple(f"p{i}" for i in range(8))

Event = tuple[str, Any]  # (op, object or list of objects)


def _node(rng: random.Random, name: str) -> dict[str, Any]:
    return gpu_node(
        name,
        count=rng.choice([1, 2]),
        memory_mib=rng.choice([40, 80]) * 1024,
        replicas=rng.choice([1, 2, 4]),
    )


def _bound(p: dict[str, Any], rng: random.Random, node: str) -> dict[str, Any]:
    """`p` bound to `node` with an assignment of 1 or 2 devices (which the node may not have)."""
    devices = rng.choice([["0"], ["1"], ["0", "1"]])
    body = {
        "node": node,
        "devices": devices,
        "bytesPerDevice": [rng.choice([10, 30, 50]) * GIB] * len(devices),
    }
    out = copy.deepcopy(p)
    out["spec"]["nodeName"] = node
    out["metadata"]["annotations"][ASSIGNMENT] = orjson.dumps(body).decode()
    out["status"] = {"phase": "Running"}
    return out


def history(seed: int) -> tuple[list[Event], list[Event], dict[str, Any], dict[str, Any]]:
    """(the node stream, the pod stream, the final nodes, the final pods) of a random history."""
    rng = random.Random(seed)
    nodes: dict[str, dict[str, Any]] = {}
    pods: dict[str, dict[str, Any]] = {}
    node_events: list[Event] = [("replace", [])]
    pod_events: list[Event] = [("replace", [])]
    uid = 0
    for _ in range(rng.randint(20, 60)):
        roll = rng.random()
        if roll < 0.15:
            name = rng.choice(NODE_NAMES)
            op = "MODIFIED" if name in nodes else "ADDED"
            nodes[name] = _node(rng, name)  # added, or relabelled
            node_events.append((op, copy.deepcopy(nodes[name])))
        elif roll < 0.2 and nodes:
            name = rng.choice(sorted(nodes))
            node_events.append(("DELETED", nodes.pop(name)))
        elif roll < 0.45:
            name = rng.choice(POD_NAMES)
            key = f"default/{name}"
            if key in pods:
                continue
            uid += 1
            pods[key] = pod(name, "10Gi", uid=f"u{uid}")
            pod_events.append(("ADDED", copy.deepcopy(pods[key])))
        elif roll < 0.7:
            pending = [k for k, p in pods.items() if not p["spec"].get("nodeName")]
            if not pending:
                continue
            key = rng.choice(sorted(pending))
            pods[key] = _bound(pods[key], rng, rng.choice(NODE_NAMES))  # a node or not (yet)
            pod_events.append(("MODIFIED", copy.deepcopy(pods[key])))
        elif roll < 0.8 and pods:
            key = rng.choice(sorted(pods))
            pods[key] = {**pods[key], "status": {"phase": rng.choice(["Succeeded", "Failed"])}}
            pod_events.append(("MODIFIED", copy.deepcopy(pods[key])))
        elif roll < 0.9 and pods:
            key = rng.choice(sorted(pods))
            pod_events.append(("DELETED", pods.pop(key)))
        elif roll < 0.95:
            node_events.append(("replace", copy.deepcopy(list(nodes.values()))))
        else:
            pod_events.append(("replace", copy.deepcopy(list(pods.values()))))
    return node_events, pod_events, nodes, pods


def deliver(src: LiveSource, rng: random.Random, nodes: list[Event], pods: list[Event]) -> None:
    """Both streams, each in order, interleaved at random; the first node list comes before any
    pod event (the pod informer waits for it)."""
    src.apply("nodes", *nodes[0])
    i, j = 1, 0
    while i < len(nodes) or j < len(pods):
        if j >= len(pods) or (i < len(nodes) and rng.random() < 0.5):
            src.apply("nodes", *nodes[i])
            i += 1
        else:
            src.apply("pods", *pods[j])
            j += 1


def ledger_view(c: ClusterState) -> dict[str, Any]:
    a = c.ledger.arrays
    return {
        "nodes": sorted(c.nodes),
        "reservations": sorted(
            (r.key, r.node, r.device_ids, r.bytes_per_device) for r in c.ledger.reservations()
        ),
        "used": sorted(
            (d.node, d.device_id, int(a.used[i]), int(a.used_replicas[i]))
            for i, d in enumerate(a.devices)
        ),
    }


@pytest.mark.parametrize("seed", range(150))
def test_any_interleaving_of_the_two_watches_ends_at_the_ledger_of_the_final_objects(
    seed: int,
) -> None:
    node_events, pod_events, nodes, pods = history(seed)
    src = LiveSource(ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED), api=FakeApi())
    deliver(src, random.Random(seed + 10_000), node_events, pod_events)
    fresh = ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED)
    fresh.load(
        [
            *({**n, "kind": "Node"} for n in nodes.values()),
            *({**p, "kind": "Pod"} for p in pods.values()),
        ]
    )
    assert ledger_view(src.cluster) == ledger_view(fresh)


def test_the_histories_exercise_the_hard_orders() -> None:
    """Pods arrive bound to nodes not seen yet, nodes are relabelled and deleted under bound
    pods, and relists come in both streams."""
    early = relabelled = relists = 0
    for seed in range(150):
        node_events, pod_events, _, _ = history(seed)
        relists += sum(1 for op, _ in node_events[1:] + pod_events[1:] if op == "replace")
        relabelled += sum(1 for op, _ in node_events if op in ("MODIFIED", "DELETED"))
        added = {o["metadata"]["name"] for op, o in node_events if op == "ADDED"}
        early += sum(
            1 for op, o in pod_events if op == "MODIFIED" and o["spec"].get("nodeName") not in added
        )
    assert early >= 20 and relabelled >= 100 and relists >= 50
