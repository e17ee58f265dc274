"""A scheduler profile's arguments are read as the real kube-scheduler reads them.

`serve --repack --scheduler-config FILE` checks every pod a plan sends somewhere with the
profile's NodeResourcesFit ignored resources and its PodTopologySpread default constraints
(`scheduler_profile`, `spread_defaults`), and the node affinity it adds to every pod. Here
kube-scheduler runs with a profile that sets all three, and 15 pod shapes meet 6 nodes (two zones
with pods, a third, one without a zone label, one in a pool the added affinity excludes):
pods selected by Services, owned by a ReplicaSet, StatefulSet or ReplicationController (found or
not), stating their own constraints, or asking extended resources the profile ignores and one it
does not. A probe is held to one node by an extended resource only that node has. kube-scheduler
places it exactly when vramsched's checks pass the node, with the profile read from the very file
kube-scheduler loaded (v1beta1 on 1.20) and the Services and controllers read as live repacking
reads them (`spread_reads`, through vramsched's own API client).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
from typing import Any

import kubernetes
import pytest
import yaml
from controlplane import ControlPlane
from verdicts import NS, probe_alone

from extender.live.api_client import ClientApi
from extender.live.spread_reads import read_spread_defaults
from extender.object_fields import namespace
from extender.observe.sources import load_spread_defaults
from extender.scheduler_profile import SchedulerProfile, parse_scheduler_profile
from extender.spread_defaults import SpreadDefaults
from extender.target_rules import schedulable_on, target_problem

SCHEDULER = "vramsched"
HOST = "kubernetes.io/hostname"
PIN = "example.com/pin-"

#: node -> labels
NODES: dict[str, dict[str, str]] = {
    "d1": {"zone": "z1"},
    "d2": {"zone": "z1"},
    "d3": {"zone": "z2"},
    "d4": {"zone": "z3"},
    "d5": {},
    "d6": {"zone": "z2", "pool": "cpu"},
}

#: name -> (node, labels)
RUNNING: dict[str, tuple[str, dict[str, str]]] = {
    "llm-a": ("d1", {"app": "llm", "rev": "r1"}),
    "llm-b": ("d1", {"app": "llm", "rev": "r2"}),
    "llm-c": ("d3", {"app": "llm", "rev": "r1"}),
    "llm-h": ("d5", {"app": "llm", "rev": "r1"}),
    "chat-e": ("d4", {"app": "chat", "shard": "s1"}),
    "chat-f": ("d2", {"app": "chat", "shard": "s1"}),
    "chat-g": ("d4", {"app": "chat"}),
    "batch-i": ("d4", {"app": "batch", "rev": "r1"}),
}

#: the profile: default spread by zone (the ScheduleAnyway one refuses nothing), three
#: extended resources not counted, one by name and two by group
PLUGIN_CONFIG = [
    {
        "name": "PodTopologySpread",
        "args": {
            "defaultingType": "List",
            "defaultConstraints": [
                {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                {"maxSkew": 1, "topologyKey": HOST, "whenUnsatisfiable": "ScheduleAnyway"},
            ],
        },
    },
    {
        "name": "NodeAffinity",
        "args": {
            "addedAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "pool", "operator": "NotIn", "values": ["cpu"]}
                            ]
                        }
                    ]
                }
            }
        },
    },
    {
        "name": "NodeResourcesFit",
        "args": {
            "ignoredResources": ["example.com/nic"],
            "ignoredResourceGroups": ["example.org"],
        },
    },
]


def _controller(
    kind: str, name: str, selector: dict[str, Any], labels: dict[str, str], **extra: Any
) -> tuple[str, dict[str, Any]]:
    """(apiVersion, object) with no replicas, so that nothing acts on it here."""
    template = {
        "metadata": {"labels": labels},
        "spec": {"containers": [{"name": "app", "image": "busybox"}]},
    }
    body = {"replicas": 0, "selector": selector, "template": template, **extra}
    version = "v1" if kind == "ReplicationController" else "apps/v1"
    return version, {"kind": kind, "metadata": {"name": name}, "spec": body}


def _controllers() -> list[tuple[str, dict[str, Any]]]:
    rs_expr = {
        "matchLabels": {"app": "llm"},
        "matchExpressions": [{"key": "rev", "operator": "In", "values": ["r2"]}],
    }
    chat = {"app": "chat", "shard": "s1"}
    llm_r2 = {"app": "llm", "rev": "r2"}
    return [
        _controller("ReplicaSet", "rs-r1", {"matchLabels": {"rev": "r1"}}, {"rev": "r1"}),
        _controller("ReplicaSet", "rs-expr", rs_expr, llm_r2),
        _controller("StatefulSet", "ss-chat", {"matchLabels": chat}, chat, serviceName="svc-chat"),
        _controller("ReplicationController", "rc-llm", llm_r2, llm_r2),
    ]


#: Services: name -> selector (None: a Service that selects no pod)
SERVICES: dict[str, dict[str, str] | None] = {
    "svc-llm": {"app": "llm"},
    "svc-chat": {"app": "chat"},
    "svc-none": None,
}

ANYWAY = [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]

#: shape -> (labels, controller (kind, name) or None, own constraints, extended resources asked)
SHAPES: dict[
    str, tuple[dict[str, str], tuple[str, str] | None, list[dict[str, Any]], dict[str, int]]
] = {
    "service": ({"app": "llm"}, None, [], {}),
    "service-chat": ({"app": "chat"}, None, [], {}),
    "selected-by-none": ({"app": "solo"}, None, [], {}),
    "replicaset": ({"rev": "r1", "tier": "rs"}, ("ReplicaSet", "rs-r1"), [], {}),
    "replicaset-and-service": ({"app": "llm", "rev": "r1"}, ("ReplicaSet", "rs-r1"), [], {}),
    "replicaset-expressions": ({"app": "llm", "rev": "r2"}, ("ReplicaSet", "rs-expr"), [], {}),
    "replicaset-gone": ({"app": "llm"}, ("ReplicaSet", "rs-gone"), [], {}),
    "statefulset": ({"app": "chat", "shard": "s1"}, ("StatefulSet", "ss-chat"), [], {}),
    "replicationcontroller": (
        {"app": "llm", "rev": "r2"},
        ("ReplicationController", "rc-llm"),
        [],
        {},
    ),
    "job-owned": ({"app": "solo"}, ("Job", "job-1"), [], {}),
    "own-schedule-anyway": ({"app": "llm"}, None, ANYWAY, {}),
    "ignored-by-name": ({"app": "solo"}, None, [], {"example.com/nic": 1}),
    "ignored-by-group": ({"app": "solo"}, None, [], {"example.org/licence": 2}),
    "not-ignored": ({"app": "solo"}, None, [], {"example.net/fpga": 1}),
    "ignored-and-spread": ({"app": "llm"}, None, [], {"example.org/licence": 1}),
}

_API_VERSIONS = {
    "ReplicaSet": "apps/v1",
    "StatefulSet": "apps/v1",
    "ReplicationController": "v1",
    "Job": "batch/v1",
}


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": dict(labels)},
        "spec": {"schedulerName": SCHEDULER, "containers": [{"name": "app", "image": "busybox"}]},
    }


def _probe(name: str, shape: str, node: str, uids: dict[str, str]) -> dict[str, Any]:
    labels, owner, constraints, asked = SHAPES[shape]
    pod = _pod(name, labels)
    if owner is not None:
        kind, owner_name = owner
        pod["metadata"]["ownerReferences"] = [
            {
                "apiVersion": _API_VERSIONS[kind],
                "kind": kind,
                "name": owner_name,
                "uid": uids.get(owner_name, "00000000-0000-0000-0000-000000000001"),
                "controller": True,
            }
        ]
    if constraints:
        pod["spec"]["topologySpreadConstraints"] = copy.deepcopy(constraints)
    requests = {PIN + node: "1", **{k: str(v) for k, v in asked.items()}}
    pod["spec"]["containers"][0]["resources"] = {"requests": requests, "limits": dict(requests)}
    return pod


def _create_workloads(cluster: ControlPlane) -> dict[str, str]:
    """The Services and controllers in NS; their UIDs by name."""
    core = cluster.core_v1()
    api = cluster.api_client()
    uids = {}
    for name, selector in SERVICES.items():
        body: dict[str, Any] = {
            "metadata": {"name": name},
            "spec": {"clusterIP": "None", "ports": [{"port": 80}]},
        }
        if selector is not None:
            body["spec"]["selector"] = selector
        uids[name] = core.create_namespaced_service(NS, body).metadata.uid
    apps = kubernetes.client.AppsV1Api(api)
    for version, obj in _controllers():
        body = {"apiVersion": version, **obj}
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "ReplicaSet":
            made = apps.create_namespaced_replica_set(NS, body)
        elif kind == "StatefulSet":
            made = apps.create_namespaced_stateful_set(NS, body)
        else:
            made = core.create_namespaced_replication_controller(NS, body)
        uids[name] = made.metadata.uid
    return uids


def _delete_workloads(cluster: ControlPlane) -> None:
    core = cluster.core_v1()
    apps = kubernetes.client.AppsV1Api(cluster.api_client())
    for name in SERVICES:
        # 1.20 answers a Service's DELETE with a Status the client cannot read as a Service
        core.delete_namespaced_service(name, NS, _preload_content=False)
    for _, obj in _controllers():
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "ReplicaSet":
            apps.delete_namespaced_replica_set(name, NS, _preload_content=False)
        elif kind == "StatefulSet":
            apps.delete_namespaced_stateful_set(name, NS, _preload_content=False)
        else:
            core.delete_namespaced_replication_controller(name, NS, _preload_content=False)


def _read_workloads(
    cluster: ControlPlane, profile: SchedulerProfile, probes: list[dict[str, Any]]
) -> SpreadDefaults:
    """What live repacking reads for these probes (`spread_reads`), through its own API client."""
    api = ClientApi(str(cluster.kubeconfig_path))
    spread, why = asyncio.run(
        read_spread_defaults(api, asyncio.to_thread, profile.default_spread, probes)
    )
    assert why is None and spread is not None
    return spread


@pytest.mark.e2e
def test_scheduler_profile_is_read_as_kube_scheduler_reads_it(cluster: ControlPlane) -> None:
    config = yaml.safe_load(ControlPlane.scheduler_config(SCHEDULER))
    config["profiles"][0]["pluginConfig"] = PLUGIN_CONFIG
    written = cluster.start_scheduler(config)
    profile = parse_scheduler_profile(written.read_text(), SCHEDULER)
    assert [c["topologyKey"] for c in profile.default_spread] == ["zone"]

    core = cluster.core_v1()
    api = cluster.api_client()
    for name, labels in NODES.items():
        cluster.create_gpu_node(name, labels={HOST: name, **labels}, allocatable={PIN + name: 1})
    running = {}
    for name, (node, labels) in RUNNING.items():
        pod = _pod(name, labels)
        pod["spec"]["nodeName"] = node
        core.create_namespaced_pod(NS, pod)
        running[f"{NS}/{name}"] = api.sanitize_for_serialization(core.read_namespaced_pod(name, NS))
    uids = _create_workloads(cluster)
    try:
        probes = [_probe(shape, shape, "d1", uids) for shape in SHAPES]
        spread = _read_workloads(cluster, profile, probes)
        # every controller kind was listed, and the Services
        assert {k for k, _, _ in spread.controllers} == {
            "ReplicaSet",
            "StatefulSet",
            "ReplicationController",
        }
        assert {s["metadata"]["name"] for s in spread.services} >= set(SERVICES)
        # plan-defrag lists them cluster-wide: the same objects of NS
        listed = load_spread_defaults(
            argparse.Namespace(cluster=None, kubeconfig=str(cluster.kubeconfig_path)), profile
        )
        assert listed is not None
        assert {k for k in listed.controllers if k[1] == NS} == set(spread.controllers)
        assert {s["metadata"]["uid"] for s in listed.services if namespace(s) == NS} == {
            s["metadata"]["uid"] for s in spread.services
        }
        nodes = {n: api.sanitize_for_serialization(core.read_node(n)) for n in NODES}

        disagree, placed, on_cpu_pool = [], dict.fromkeys(SHAPES, 0), 0
        for i, shape in enumerate(SHAPES):
            for node in NODES:
                probe = _probe(f"profile-{i}-{node}", shape, node, uids)
                theirs, stored = probe_alone(cluster, probe)
                ours = schedulable_on(stored, nodes[node], profile=profile)
                if ours is None:
                    found = target_problem(
                        nodes,
                        running,
                        [(None, stored, node)],
                        set(),
                        profile=profile,
                        spread=spread,
                    )
                    ours = found[0] if found else None
                if (ours is None) != theirs:
                    disagree.append(f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}")
                placed[shape] += theirs
                on_cpu_pool += theirs and node == "d6"
    finally:
        _delete_workloads(cluster)
    assert not disagree, "\n".join(disagree)
    # the defaults refuse some nodes to the shapes they apply to, and which ones differs
    # the profile's added node affinity keeps every pod off the cpu pool's node
    assert on_cpu_pool == 0
    assert placed["selected-by-none"] == len(NODES) - 1
    assert placed["ignored-by-name"] == placed["ignored-by-group"] == len(NODES) - 1
    assert placed["not-ignored"] == 0
    assert len({placed[s] for s in ("service", "replicaset", "selected-by-none")}) == 3, placed
