"""Inter-pod affinity is judged as the real kube-scheduler judges it.

Before it evicts a running pod, `serve --repack` checks that the pod's re-created copy may run
where the plan sends it, among the pods that will run around it: required pod affinity and
anti-affinity (`pod_affinity.affinity_problem`), the rule LLM deployments use to keep their
replicas apart. Here 15 pod shapes meet 4 nodes, in two zones and none, that already run pods with
labels and anti-affinity of their own, in two namespaces. Each probe is pinned to one node by a
`metadata.name` field and removed before the next, so that no probe is another's neighbour.
kube-scheduler places it exactly when vramsched's check passes the node.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from controlplane import ControlPlane
from verdicts import ensure_namespace, probe_alone

from extender.pod_affinity import affinity_problem

NS = "default"
OTHER = "affinity-other"
SCHEDULER = "vramsched"
HOST = "kubernetes.io/hostname"

#: node -> labels
NODES: dict[str, dict[str, str]] = {
    "n1": {HOST: "n1", "zone": "z1"},
    "n2": {HOST: "n2", "zone": "z1"},
    "n3": {HOST: "n3", "zone": "z2"},
    "n4": {HOST: "n4"},
}


def _term(selector: dict[str, Any] | None, key: str, **extra: Any) -> dict[str, Any]:
    term: dict[str, Any] = {"topologyKey": key, **extra}
    if selector is not None:
        term["labelSelector"] = selector
    return term


def _rules(kind: str, *terms: dict[str, Any]) -> dict[str, Any]:
    return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": list(terms)}}


def _labels(**labels: str) -> dict[str, Any]:
    return {"matchLabels": labels}


BATCH_AWAY_BY_HOST = _rules("podAntiAffinity", _term(_labels(team="batch"), HOST))
BATCH_AWAY_BY_ZONE = _rules("podAntiAffinity", _term(_labels(team="batch"), "zone"))

#: name -> (namespace, node, labels, affinity) of the pods already running
RUNNING: dict[str, tuple[str, str, dict[str, str], dict[str, Any]]] = {
    "web-1": (NS, "n1", {"app": "web", "tier": "front"}, {}),
    "guard": (NS, "n2", {"app": "guard"}, BATCH_AWAY_BY_HOST),
    "db-1": (NS, "n3", {"app": "db"}, BATCH_AWAY_BY_ZONE),
    "web-other": (OTHER, "n3", {"app": "web"}, {}),
    "web-2": (NS, "n4", {"app": "web"}, {}),
}

WEB = _labels(app="web")
CACHE = _labels(app="cache")

#: probe shape -> (labels, affinity)
SHAPES: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "plain": ({}, {}),
    "batch": ({"team": "batch"}, {}),
    "anti-web-host": ({}, _rules("podAntiAffinity", _term(WEB, HOST))),
    "anti-web-zone": ({}, _rules("podAntiAffinity", _term(WEB, "zone"))),
    "with-web-zone": ({}, _rules("podAffinity", _term(WEB, "zone"))),
    "with-web-host": ({}, _rules("podAffinity", _term(WEB, HOST))),
    "first-cache-host": ({"app": "cache"}, _rules("podAffinity", _term(CACHE, HOST))),
    "first-cache-zone": ({"app": "cache"}, _rules("podAffinity", _term(CACHE, "zone"))),
    "cache-unlabelled": ({}, _rules("podAffinity", _term(CACHE, HOST))),
    "anti-web-in-other": (
        {},
        _rules("podAntiAffinity", _term(WEB, HOST, namespaces=[OTHER])),
    ),
    "anti-web-everywhere": (
        {},
        _rules("podAntiAffinity", _term(WEB, HOST, namespaceSelector={})),
    ),
    "with-web-and-front": (
        {},
        _rules("podAffinity", _term(WEB, HOST), _term(_labels(tier="front"), HOST)),
    ),
    "anti-not-web-or-db": (
        {},
        _rules(
            "podAntiAffinity",
            _term(
                {
                    "matchExpressions": [
                        {"key": "app", "operator": "NotIn", "values": ["web", "db"]}
                    ]
                },
                HOST,
            ),
        ),
    ),
    "anti-no-selector": ({}, _rules("podAntiAffinity", _term(None, HOST))),
    "batch-with-web-zone": ({"team": "batch"}, _rules("podAffinity", _term(WEB, "zone"))),
}


def _pod(
    name: str, labels: dict[str, str], affinity: dict[str, Any], *, namespace: str = NS
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER,
        "containers": [{"name": "app", "image": "busybox"}],
    }
    if affinity:
        spec["affinity"] = copy.deepcopy(affinity)
    meta = {"name": name, "namespace": namespace, "labels": dict(labels)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _pinned(pod: dict[str, Any], node: str) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["spec"].setdefault("affinity", {})["nodeAffinity"] = {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        }
    }
    return out


@pytest.mark.e2e
def test_pod_affinity_is_judged_as_kube_scheduler_judges_it(cluster: ControlPlane) -> None:
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    core = cluster.core_v1()
    api = cluster.api_client()
    ensure_namespace(core, OTHER)
    for name, labels in NODES.items():
        cluster.create_gpu_node(name, labels=labels)
    for name, (namespace, node, labels, affinity) in RUNNING.items():
        running = _pod(name, labels, affinity, namespace=namespace)
        running["spec"]["nodeName"] = node
        core.create_namespaced_pod(namespace, running)
    nodes = [api.sanitize_for_serialization(core.read_node(n)) for n in NODES]
    labels_of = {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in nodes}
    others = [
        (api.sanitize_for_serialization(core.read_namespaced_pod(name, ns)), node)
        for name, (ns, node, _, _) in RUNNING.items()
    ]

    disagree, placed = [], dict.fromkeys(NODES, 0)
    for i, (shape, (labels, affinity)) in enumerate(SHAPES.items()):
        for node in NODES:
            probe = _pinned(_pod(f"probe-{i}-{node}", labels, affinity), node)
            # judged as stored: a 1.20 API server drops `namespaceSelector`
            theirs, stored = probe_alone(cluster, probe)
            ours = affinity_problem(stored, node, others, labels_of)
            if (ours is None) != theirs:
                disagree.append(f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}")
            placed[node] += theirs
    assert not disagree, "\n".join(disagree)
    # every node takes some shapes and refuses others
    assert all(0 < n < len(SHAPES) for n in placed.values()), placed
