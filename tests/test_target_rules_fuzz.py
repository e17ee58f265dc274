"""kube-scheduler's rules as live repacking and plan-defrag read them never crash on malformed
objects: a cluster file is not validated as the API server validates objects. Well-formed pods and
nodes stating every field those rules read (pod affinity and anti-affinity, spread constraints,
node affinity, tolerations, taints, requests, allocatable) get one to four fields replaced by a
value of another type; each answer must be None or a reason.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extender.attach_limits import attach_refusal, needs_counting
from extender.pod_affinity import affinity_problem
from extender.spread_defaults import SpreadDefaults
from extender.target_rules import room_problem, schedulable_on, target_problem
from extender.topology_spread import spread_problem
from extender.volume_rules import Storage, volume_refusal

#: what the PV controller sets on a claim once it is bound
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"

HOST = "kubernetes.io/hostname"
SELECTOR = {
    "matchLabels": {"app": "web"},
    "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["batch"]}],
}
TERM = {
    "labelSelector": SELECTOR,
    "topologyKey": "zone",
    "namespaces": ["default"],
    "namespaceSelector": {"matchLabels": {"team": "ml"}},
}
POD = {
    "metadata": {"name": "p", "namespace": "default", "labels": {"app": "web", "tier": "front"}},
    "spec": {
        "nodeName": "a",
        "nodeSelector": {"zone": "z1"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["1"]}],
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["a"]}
                            ],
                        }
                    ]
                }
            },
            "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [TERM]},
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{**TERM, "topologyKey": HOST}]
            },
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "zone",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": SELECTOR,
                "minDomains": 2,
                "matchLabelKeys": ["tier"],
                "nodeAffinityPolicy": "Honor",
                "nodeTaintsPolicy": "Honor",
            }
        ],
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [
            {
                "name": "c",
                "resources": {
                    "requests": {"ephemeral-storage": "1Gi", "example.com/nic": "1"},
                    "limits": {"example.com/nic": "1"},
                },
                "ports": [{"containerPort": 80, "hostPort": 8000, "hostIP": "10.0.0.1"}],
            }
        ],
        "initContainers": [
            {"name": "s", "restartPolicy": "Always", "ports": [{"hostPort": 53, "protocol": "UDP"}]}
        ],
    },
    "status": {"phase": "Running"},
}
NODE = {
    "metadata": {"name": "a", "labels": {"zone": "z1", HOST: "a", "gen": "2"}},
    "spec": {
        "taints": [{"key": "gpu", "value": "x", "effect": "NoSchedule"}],
        "unschedulable": False,
    },
    "status": {"allocatable": {"pods": "110", "ephemeral-storage": "10Gi", "example.com/nic": "2"}},
}
CONTROLLER_KINDS = ("ReplicaSet", "StatefulSet", "ReplicationController")
GARBAGE = [None, 0, -1, "", "x", True, 2.5, [], {}, ["x"], {"x": 1}, [{"x": 1}]]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*path, i))
    return out


def _mutated(template: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    paths = _paths(template)

    def build(changes: list[tuple[int, int]]) -> dict[str, Any]:
        out = copy.deepcopy(template)
        for which, garbage in changes:
            *head, last = paths[which]
            parent: Any = out
            for step in head:
                try:
                    parent = parent[step]
                except (KeyError, IndexError, TypeError):
                    break
            else:
                if isinstance(parent, dict | list):
                    try:
                        parent[last] = copy.deepcopy(GARBAGE[garbage])
                    except (IndexError, TypeError):
                        pass  # an earlier change replaced this field's parent
        return out

    change = st.tuples(st.integers(0, len(paths) - 1), st.integers(0, len(GARBAGE) - 1))
    return st.lists(change, min_size=1, max_size=4).map(build)


@settings(max_examples=1500, deadline=None)
@given(pod=_mutated(POD), a=_mutated(POD), b=_mutated(POD), node_a=_mutated(NODE))
def test_malformed_objects_are_judged_never_crash(pod: Any, a: Any, b: Any, node_a: Any) -> None:
    node_b = {**copy.deepcopy(NODE), "metadata": {"name": "b", "labels": {"zone": "z2", HOST: "b"}}}
    nodes = {"a": node_a, "b": node_b}
    others = [(a, "a"), (b, "b")]
    for answer in (
        schedulable_on(pod, node_a),
        room_problem(node_a, [a, b], [pod]),
        affinity_problem(pod, "a", others, {"a": {"zone": "z1", HOST: "a"}, "b": {"zone": "z1"}}),
        spread_problem(pod, "a", others, nodes),
        spread_problem(pod, "b", others, nodes),
    ):
        assert answer is None or isinstance(answer, str)
    found = target_problem(
        nodes, {"d/a": a, "d/b": b}, [(None, pod, "a"), ("d/b", b, "a")], {"d/b"}
    )
    assert found is None or (isinstance(found[0], str) and found[1] in (None, "d/b"))


OWNED = {
    "metadata": {
        "name": "p",
        "namespace": "default",
        "labels": {"app": "web", "tier": "front"},
        "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "controller": True},
            {"apiVersion": "v1", "kind": "ReplicationController", "name": "rc"},
        ],
    },
    "spec": {"containers": [{"name": "c"}]},
}
SERVICE = {"metadata": {"name": "s", "namespace": "default"}, "spec": {"selector": {"app": "web"}}}
OWNERS = {"metadata": {"name": "rs", "namespace": "default"}, "spec": {"selector": SELECTOR}}
DEFAULT_SPREAD = ({"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},)


@settings(max_examples=1500, deadline=None)
@given(
    pod=_mutated(OWNED),
    service=_mutated(SERVICE),
    owner=_mutated(OWNERS),
    a=_mutated(POD),
    node_a=_mutated(NODE),
)
def test_malformed_default_spread_selectors_are_judged_never_crash(
    pod: Any, service: Any, owner: Any, a: Any, node_a: Any
) -> None:
    """A pod without constraints of its own, the Service and controllers its default spread
    selects by, and its neighbours, malformed."""
    node_b = {**copy.deepcopy(NODE), "metadata": {"name": "b", "labels": {"zone": "z2", HOST: "b"}}}
    nodes = {"a": node_a, "b": node_b}
    spread = SpreadDefaults(
        DEFAULT_SPREAD,
        [service, copy.deepcopy(SERVICE)],
        {(kind, "default", name): owner for kind in CONTROLLER_KINDS for name in ("rs", "rc")},
    )
    for node in nodes:
        answer = spread_problem(pod, node, [(a, "a"), (pod, "b")], nodes, spread)
        assert answer is None or isinstance(answer, str)
    found = target_problem(nodes, {"d/a": a}, [(None, pod, "a")], set(), spread=spread)
    assert found is None or isinstance(found[0], str)


CLAIMED = {
    "metadata": {"name": "v", "namespace": "default"},
    "spec": {
        "volumes": [
            {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "e", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
        ]
    },
}
CLAIM = {
    "kind": "PersistentVolumeClaim",
    "metadata": {"name": "data", "namespace": "default", "annotations": {BIND_COMPLETED: "yes"}},
    "spec": {"volumeName": "pv"},
}
VOLUME = {
    "kind": "PersistentVolume",
    "metadata": {"name": "pv", "labels": {"topology.kubernetes.io/zone": "z1__z2"}},
    "spec": {
        "nodeAffinity": {
            "required": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}],
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": ["b"]}
                        ],
                    }
                ]
            }
        }
    },
}


@settings(max_examples=1500, deadline=None)
@given(pod=_mutated(CLAIMED), claim=_mutated(CLAIM), volume=_mutated(VOLUME), node=_mutated(NODE))
def test_malformed_claims_and_volumes_are_judged_never_crash(
    pod: Any, claim: Any, volume: Any, node: Any
) -> None:
    storage = Storage.from_objects([claim, volume])
    for answer in (volume_refusal(pod, node, storage), schedulable_on(pod, node, storage)):
        assert answer is None or isinstance(answer, str)


DISK = "disk.csi.example.com"
CSI_VOLUME = {
    "kind": "PersistentVolume",
    "metadata": {"name": "pv"},
    "spec": {"csi": {"driver": DISK, "volumeHandle": "h1"}},
}
CSI_NODE = {
    "kind": "CSINode",
    "metadata": {"name": "a"},
    "spec": {"drivers": [{"name": DISK, "nodeID": "a", "allocatable": {"count": 1}}]},
}
ATTACHMENT = {
    "kind": "VolumeAttachment",
    "metadata": {"name": "va"},
    "spec": {
        "attacher": DISK,
        "nodeName": "a",
        "source": {
            "persistentVolumeName": "pv",
            "inlineVolumeSpec": {"csi": {"volumeHandle": "x"}},
        },
    },
}
CLASS = {
    "kind": "StorageClass",
    "metadata": {
        "name": "fast",
        "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
    },
    "provisioner": DISK,
}


@settings(max_examples=1500, deadline=None)
@given(
    pod=_mutated(CLAIMED),
    there=_mutated(CLAIMED),
    objects=st.tuples(*(_mutated(o) for o in (CLAIM, CSI_VOLUME, CSI_NODE, ATTACHMENT, CLASS))),
)
def test_malformed_attach_limit_objects_are_judged_never_crash(
    pod: Any, there: Any, objects: Any
) -> None:
    """`attach_limits` reads CSINodes, VolumeAttachments and StorageClasses besides claims and
    volumes; any of them malformed gives an answer, not an exception."""
    storage = Storage.from_objects(objects)
    node = {"metadata": {"name": "a"}}
    answer = attach_refusal(node, [there], [pod], storage)
    assert answer is None or isinstance(answer, str)
    if isinstance(there.get("spec"), dict):
        there["spec"]["nodeName"] = "a"  # a pod on the target, its volumes counted there
    found = target_problem({"a": node}, {"d/t": there}, [("d/p", pod, "a")], set(), storage)
    assert found is None or (isinstance(found[0], str) and found[1] in (None, "d/p"))


EBS = "ebs.csi.aws.com"
BETA_ZONE = "failure-domain.beta.kubernetes.io/zone"
BETA_REGION = "failure-domain.beta.kubernetes.io/region"
IN_TREE_POD = {
    "metadata": {"name": "v", "namespace": "default"},
    "spec": {
        "volumes": [
            {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
            {"name": "i", "awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-1"}},
            {"name": "g", "gcePersistentDisk": {"pdName": "pd-1"}},
        ]
    },
}
IN_TREE_VOLUME = {
    "kind": "PersistentVolume",
    "metadata": {"name": "pv", "labels": {"topology.kubernetes.io/zone": "us-east1-a__us-east1-b"}},
    "spec": {
        "gcePersistentDisk": {"pdName": "pd-2"},
        "awsElasticBlockStore": {"volumeID": "v"},
        "nodeAffinity": {
            "required": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": BETA_ZONE, "operator": "In", "values": ["us-east1-a"]},
                            {"key": BETA_REGION, "operator": "In", "values": ["us-east1"]},
                        ]
                    }
                ]
            }
        },
    },
}
IN_TREE_NODE = {
    "kind": "CSINode",
    "metadata": {
        "name": "a",
        "annotations": {
            "storage.alpha.kubernetes.io/migrated-plugins": (
                "kubernetes.io/aws-ebs,kubernetes.io/gce-pd"
            )
        },
    },
    "spec": {"drivers": [{"name": EBS, "nodeID": "a", "allocatable": {"count": 1}}]},
}
ZONED_NODE = {
    "metadata": {
        "name": "a",
        "labels": {"topology.ebs.csi.aws.com/zone": "us-east1-a", BETA_ZONE: "us-east1-a"},
    }
}
IN_TREE_CLASS = {
    "kind": "StorageClass",
    "metadata": {"name": "gp2"},
    "provisioner": "kubernetes.io/aws-ebs",
}


@settings(max_examples=1500, deadline=None)
@given(
    pod=_mutated(IN_TREE_POD),
    there=_mutated(IN_TREE_POD),
    objects=st.tuples(
        *(_mutated(o) for o in (CLAIM, IN_TREE_VOLUME, IN_TREE_NODE, ATTACHMENT, IN_TREE_CLASS))
    ),
    node=_mutated(ZONED_NODE),
)
def test_malformed_in_tree_disks_are_judged_never_crash(
    pod: Any, there: Any, objects: Any, node: Any
) -> None:
    """In-tree disks (volumes and inline) are translated to their CSI driver, and a migrated
    volume's topology to the driver's zone label; malformed ones give an answer, not an
    exception, and so does `needs_counting`."""
    storage = Storage.from_objects(objects)
    for answer in (
        attach_refusal(node, [there], [pod], storage),
        volume_refusal(pod, node, storage),
    ):
        assert answer is None or isinstance(answer, str)
    assert isinstance(needs_counting([pod, there], storage), bool)


WAITING_CLAIM = {
    "kind": "PersistentVolumeClaim",
    "metadata": {
        "name": "data",
        "namespace": "default",
        "uid": "u1",
        "annotations": {"volume.beta.kubernetes.io/storage-class": "local"},
    },
    "spec": {
        "storageClassName": "local",
        "accessModes": ["ReadWriteOnce"],
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": "1Gi"}},
        "selector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]},
    },
}
FREE_VOLUME = {
    "kind": "PersistentVolume",
    "metadata": {"name": "pv", "labels": {"tier": "a"}},
    "spec": {
        "storageClassName": "local",
        "capacity": {"storage": "5Gi"},
        "accessModes": ["ReadWriteOnce"],
        "claimRef": {"name": "data", "namespace": "default", "uid": "u1"},
        "nodeAffinity": {
            "required": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": HOST, "operator": "In", "values": ["a"]}]}
                ]
            }
        },
    },
    "status": {"phase": "Available"},
}
WAITING_CLASS = {
    "kind": "StorageClass",
    "metadata": {"name": "local"},
    "provisioner": "example.com/local",
    "volumeBindingMode": "WaitForFirstConsumer",
    "allowedTopologies": [{"matchLabelExpressions": [{"key": "zone", "values": ["z1"]}]}],
}


TRACKED_DRIVER = {
    "kind": "CSIDriver",
    "metadata": {"name": "example.com/local"},
    "spec": {"storageCapacity": True},
}
ROOM = {
    "kind": "CSIStorageCapacity",
    "metadata": {"name": "room", "namespace": "default"},
    "storageClassName": "local",
    "capacity": "10Gi",
    "maximumVolumeSize": "5Gi",
    "nodeTopology": {"matchLabels": {"zone": "z1"}},
}


@settings(max_examples=1500, deadline=None)
@given(
    pod=_mutated(CLAIMED),
    objects=st.tuples(
        *(_mutated(o) for o in (WAITING_CLAIM, FREE_VOLUME, WAITING_CLASS, TRACKED_DRIVER, ROOM))
    ),
    node=_mutated(NODE),
)
def test_malformed_waiting_claims_are_judged_never_crash(pod: Any, objects: Any, node: Any) -> None:
    """A claim that waits for its pod is matched to volumes, its class's topology and its
    provisioner's reported room; malformed claims, volumes, classes, drivers, capacities and
    nodes give an answer, not an exception."""
    storage = Storage.from_objects(objects)
    answer = volume_refusal(pod, node, storage)
    assert answer is None or isinstance(answer, str)
