"""A pod's claims are judged as the real kube-scheduler judges them.

Before it evicts a running pod, `serve --repack` checks that the pod's re-created copy can mount
its PersistentVolumeClaims where the plan sends it (`volume_rules.volume_refusal`): a local
volume's node affinity, a zonal disk's zone labels. Here 17 claim shapes meet 4 nodes (two zones
by GA labels, one by the beta label, one with none). Claims are bound as the PV controller binds
them (`spec.volumeName` and `pv.kubernetes.io/bind-completed`), so no controller is needed. Each
probe is pinned to one node by a `metadata.name` field; kube-scheduler places it exactly when
vramsched's check passes the node.

Two shapes hold a claim not fully bound, of a class that is not WaitForFirstConsumer:
kube-scheduler refuses those pods on every node before any filter (VolumeBinding's PreFilter), so
no extender is asked about them, and vramsched's rule sets no bound for a claim naming no volume.
For those the test asserts that premise: refused on every node.

The second test stages in-tree volumes (EBS, Persistent Disk, Azure Disk, Cinder) on nodes whose
CSINodes list their plugins as migrated, or not, with and without the CSI drivers' zone labels:
kube-scheduler matches such a volume's node affinity translated to its driver.

The third gives probes claims of WaitForFirstConsumer classes, which name no volume until their
pod is placed, on nodes with free local volumes: kube-scheduler passes a node when each claim
gets a volume there or its class provisions there. No PV controller or provisioner runs, so a
pass shows as kube-scheduler's PreBind starting to bind (a volume's `claimRef`, or the claim's
selected node), and the test undoes that binding before the next probe. The fourth (1.36) gives
the same shapes as generic ephemeral volumes, judged from their templates before their claims
exist, as a moved pod's new copy is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import kubernetes.client
import pytest
from controlplane import ControlPlane
from storage_scene import (
    SELECTED_NODE,
    UNHELD,
    Scene,
    create_ephemeral,
    csi_node,
    ephemeral,
    gone,
    in_tree_volume,
    judged,
    objects,
    probe,
    staged,
)
from verdicts import probe_alone

from extender.volume_rules import Storage, volume_refusal

#: what the PV controller sets on a claim once it is bound
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"

NS = "default"
SCHEDULER = "vramsched"
HOST = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
REGION = "topology.kubernetes.io/region"
BETA_ZONE = "failure-domain.beta.kubernetes.io/zone"
FINALIZER = "vramsched.io/test-hold"

#: node -> labels
NODES: dict[str, dict[str, str]] = {
    "v1": {HOST: "v1", ZONE: "z1", REGION: "r1"},
    "v2": {HOST: "v2", ZONE: "z2", REGION: "r1"},
    "v3": {HOST: "v3", BETA_ZONE: "z1"},
    "v4": {HOST: "v4"},
}


def _affinity(*terms: list[dict[str, Any]], fields: bool = False) -> dict[str, Any]:
    key = "matchFields" if fields else "matchExpressions"
    return {"required": {"nodeSelectorTerms": [{key: t} for t in terms]}}


def _is(key: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": "In", "values": list(values)}


#: volume -> (labels, nodeAffinity or None)
VOLUMES: dict[str, tuple[dict[str, str], dict[str, Any] | None]] = {
    "pv-plain": ({}, None),
    "pv-local-v1": ({}, _affinity([_is(HOST, "v1")])),
    "pv-zone-z1": ({}, _affinity([_is(ZONE, "z1")])),
    "pv-v2-or-z1": ({}, _affinity([_is(HOST, "v2")], [_is(ZONE, "z1")])),
    "pv-by-name": ({}, _affinity([_is("metadata.name", "v1")], fields=True)),
    "pv-z2-by-name": (
        {},
        {
            "required": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [_is(ZONE, "z2")],
                        "matchFields": [_is("metadata.name", "v1")],
                    }
                ]
            }
        },
    ),
    "pv-label-z1": ({ZONE: "z1"}, None),
    "pv-label-z1-z2": ({ZONE: "z1__z2"}, None),
    "pv-label-bad": ({ZONE: "z1____z2"}, None),
    "pv-region-r2": ({REGION: "r2"}, None),
    "pv-beta-z1": ({BETA_ZONE: "z1"}, None),
}

#: claim -> (volume it names or None, bound as the PV controller binds, being deleted)
CLAIMS: dict[str, tuple[str | None, bool, bool]] = {
    **{f"c-{v[3:]}": (v, True, False) for v in VOLUMES},
    "c-unannotated": ("pv-plain", False, False),
    "c-unbound": (None, False, False),
    "c-lost": ("pv-gone", True, False),
    "c-deleting": ("pv-plain", True, True),
}

#: probe shape -> the claims it mounts
SHAPES: dict[str, list[str]] = {
    **{c: [c] for c in CLAIMS if c != "c-deleting"},
    "missing-claim": ["c-nowhere"],
    "local-and-zone": ["c-local-v1", "c-label-z1"],
}
SHAPES["deleting"] = ["c-deleting"]

#: shapes 1.20's kube-scheduler judges otherwise on one node: it matches a volume's beta zone
#: label only to the node's beta label (1.21 also tries the GA one, and vramsched follows it)
OLD_VOLUMEZONE = {("c-beta-z1", "v1")}

#: shapes kube-scheduler refuses before filtering: unbound claims of an Immediate class
PREFILTER_REFUSED = {"c-unannotated", "c-unbound"}


def _volume(name: str, labels: dict[str, str], affinity: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "capacity": {"storage": "1Gi"},
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "manual",
        "hostPath": {"path": f"/tmp/{name}"},
    }
    if affinity is not None:
        spec["nodeAffinity"] = affinity
    return {"metadata": {"name": name, "labels": labels}, "spec": spec}


def _claim(name: str, volume: str | None, bound: bool, deleting: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS}
    if bound:
        meta["annotations"] = {BIND_COMPLETED: "yes"}
    if deleting:
        meta["finalizers"] = [FINALIZER]
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "manual",
        "resources": {"requests": {"storage": "1Gi"}},
    }
    if volume is not None:
        spec["volumeName"] = volume
    return {"metadata": meta, "spec": spec}


def _probe(name: str, claims: list[str], node: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER,
        "containers": [{"name": "app", "image": "busybox"}],
        "volumes": [
            {"name": f"v{i}", "persistentVolumeClaim": {"claimName": c}}
            for i, c in enumerate(claims)
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchFields": [_is("metadata.name", node)]}]
                }
            }
        },
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


@pytest.mark.e2e
def test_bound_claims_are_judged_as_kube_scheduler_judges_them(cluster: ControlPlane) -> None:
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    core, api = cluster.core_v1(), cluster.api_client()
    for name, labels in NODES.items():
        cluster.create_gpu_node(name, labels=labels)
    for name, (labels, affinity) in VOLUMES.items():
        core.create_persistent_volume(_volume(name, labels, affinity))
    for name, (volume, bound, deleting) in CLAIMS.items():
        core.create_namespaced_persistent_volume_claim(NS, _claim(name, volume, bound, deleting))
    core.delete_namespaced_persistent_volume_claim("c-deleting", NS)
    try:
        nodes = {n: api.sanitize_for_serialization(core.read_node(n)) for n in NODES}
        objects = [
            {"kind": "PersistentVolume", **api.sanitize_for_serialization(v)}
            for v in core.list_persistent_volume().items
        ] + [
            {"kind": "PersistentVolumeClaim", **api.sanitize_for_serialization(c)}
            for c in core.list_namespaced_persistent_volume_claim(NS).items
        ]
        storage = Storage.from_objects(objects)
        assert storage.claims["default/c-deleting"]["metadata"].get("deletionTimestamp")

        old = cluster.release.minor < (1, 21)
        disagree, placed = [], dict.fromkeys(NODES, 0)
        for i, (shape, claims) in enumerate(SHAPES.items()):
            for node in NODES:
                theirs, stored = probe_alone(cluster, _probe(f"probe-{i}-{node}", claims, node))
                if shape in PREFILTER_REFUSED:
                    if theirs:
                        disagree.append(f"{shape} on {node}: placed before its claim was bound")
                    continue
                ours = volume_refusal(stored, nodes[node], storage)
                differs = (ours is None) != theirs
                if differs != (old and (shape, node) in OLD_VOLUMEZONE):
                    disagree.append(f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}")
                placed[node] += theirs
        assert not disagree, "\n".join(disagree)
        # every node takes some shapes and refuses others
        assert all(0 < n < len(SHAPES) - len(PREFILTER_REFUSED) for n in placed.values()), placed
    finally:
        for name in CLAIMS:
            core.patch_namespaced_persistent_volume_claim(
                name, NS, {"metadata": {"finalizers": None}}
            )
            if name != "c-deleting":
                core.delete_namespaced_persistent_volume_claim(name, NS)
        for name in VOLUMES:
            core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
            core.delete_persistent_volume(name)


#: each in-tree plugin migrated to CSI, with its driver's zone label
DRIVER_ZONES = {
    "kubernetes.io/aws-ebs": "topology.ebs.csi.aws.com/zone",
    "kubernetes.io/gce-pd": "topology.gke.io/zone",
    "kubernetes.io/azure-disk": "topology.disk.csi.azure.com/zone",
    "kubernetes.io/cinder": "topology.cinder.csi.openstack.org/zone",
}
BETA_REGION = "failure-domain.beta.kubernetes.io/region"


def _driver_zones(zone: str) -> dict[str, str]:
    return {key: zone for key in DRIVER_ZONES.values()}


#: node -> (labels, the plugins its CSINode lists as migrated, or None for no CSINode)
MIGRATION_NODES: dict[str, tuple[dict[str, str], tuple[str, ...] | None]] = {
    "t1": ({ZONE: "z1", REGION: "r1", **_driver_zones("z1")}, tuple(DRIVER_ZONES)),
    "t2": ({ZONE: "z1", REGION: "r1"}, tuple(DRIVER_ZONES)),  # no driver labels
    "t3": (_driver_zones("z1"), tuple(DRIVER_ZONES)),  # only the drivers' labels
    "t4": ({ZONE: "z2", REGION: "r1", **_driver_zones("z2")}, tuple(DRIVER_ZONES)),
    "t5": ({ZONE: "z2", REGION: "r1", **_driver_zones("z1")}, tuple(DRIVER_ZONES)),
    "t6": ({ZONE: "z1", REGION: "r1"}, ()),  # a CSINode that lists nothing
    "t7": ({}, None),
}

EBS = {"awsElasticBlockStore": {"volumeID": "vol-1"}}
AZURE_URI = "/subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/disks/d1"

#: volume -> (its in-tree source, labels, nodeAffinity or None); claim `c-<volume>` is bound to
#: each and a probe mounts it
IN_TREE: dict[str, tuple[dict[str, Any], dict[str, str], dict[str, Any] | None]] = {
    "ebs-z1": (EBS, {ZONE: "z1"}, None),
    "pd-z1": ({"gcePersistentDisk": {"pdName": "pd-1"}}, {ZONE: "z1"}, None),
    "azure-z1": (
        {"azureDisk": {"diskName": "d1", "diskURI": AZURE_URI, "kind": "Managed"}},
        {ZONE: "z1"},
        None,
    ),
    "cinder-z1": ({"cinder": {"volumeID": "c-1"}}, {ZONE: "z1"}, None),
    "ebs-beta-z1": (EBS, {BETA_ZONE: "z1"}, None),
    "ebs-z1-z2": (EBS, {ZONE: "z1__z2"}, None),
    "ebs-affinity-z1": (EBS, {}, _affinity([_is(ZONE, "z1")])),
    "ebs-affinity-beta": (EBS, {}, _affinity([_is(BETA_ZONE, "z1"), _is(BETA_REGION, "r1")])),
    "ebs-no-zone": (EBS, {}, None),
    "ebs-bad-id": ({"awsElasticBlockStore": {"volumeID": "aws://z1/not-a-volume"}}, {}, None),
}


#: shapes 1.20's kube-scheduler judges otherwise, read without migration: it matches a volume's
#: beta zone label only to the node's beta label (as `OLD_VOLUMEZONE`)
OLD_BETA_ZONE = {("ebs-beta-z1", n) for n in ("t1", "t2", "t6")}

#: a CSINode whose driver list is empty reads back as null, which the client refuses
OTHER_DRIVER = {"other.csi.example.com": None}


@pytest.mark.e2e
def test_migrated_in_tree_volumes_are_judged_by_their_drivers_zone(cluster: ControlPlane) -> None:
    """On a node whose CSINode lists an in-tree plugin as migrated, kube-scheduler judges that
    plugin's volumes by their node affinity translated to the CSI driver: the zone must be on the
    driver's zone label (EBS, Persistent Disk, Cinder; an Azure Disk's is not translated). Every
    volume on every node: kube-scheduler places the probe exactly when vramsched's rule passes
    the node. 1.20 turns CSI migration on for none of these types by default, so there the
    verdicts are those of the volumes read as they are (but for `OLD_BETA_ZONE`)."""
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    scene = Scene(
        csi_nodes={
            n: csi_node(n, OTHER_DRIVER, migrated)
            for n, (_, migrated) in MIGRATION_NODES.items()
            if migrated is not None
        },
        volumes={
            n: in_tree_volume(n, source, on, affinity)
            for n, (source, on, affinity) in IN_TREE.items()
        },
        attachments={},
        holders={},
    )
    nodes = {n: on for n, (on, _) in MIGRATION_NODES.items()}
    old = cluster.release.minor < (1, 21)
    disagree = []
    placed = dict.fromkeys(nodes, 0)
    theirs_on: dict[tuple[str, str], bool] = {}
    with staged(cluster, nodes, scene) as (read, _, storage):
        if old:
            storage = replace(storage, csinodes={})  # no node migrates anything
        for i, volume in enumerate(IN_TREE):
            for node in nodes:
                pod = probe(f"tprobe-{i}-{node}", [f"c-{volume}"], node)
                theirs, stored = probe_alone(cluster, pod)
                ours = volume_refusal(stored, read[node], storage)
                expected = old and (volume, node) in OLD_BETA_ZONE
                if ((ours is None) != theirs) != expected:
                    disagree.append(
                        f"{volume} on {node}: kube-scheduler {theirs}, vramsched {ours}"
                    )
                placed[node] += theirs
                theirs_on[volume, node] = theirs
    assert not disagree, "\n".join(disagree)
    # the same labels with the plugins migrated and without: only the migrated node wants the
    # driver's zone label (on 1.20 neither does)
    assert (theirs_on["ebs-z1", "t2"], theirs_on["ebs-z1", "t6"]) == (old, True), theirs_on
    # every node takes some volumes and refuses others; the one with neither a CSINode nor
    # labels takes every volume without node affinity
    assert all(0 < n < len(IN_TREE) for n in placed.values()), placed
    assert placed["t7"] == sum(affinity is None for _, _, affinity in IN_TREE.values()), placed


#: node -> labels, for the claims that wait for their pod
BINDING_NODES: dict[str, dict[str, str]] = {
    "u1": {HOST: "u1", ZONE: "z1"},
    "u2": {HOST: "u2", ZONE: "z2"},
    "u3": {HOST: "u3"},
    "u4": {HOST: "u4", ZONE: "z1"},
}
WAIT = "WaitForFirstConsumer"
DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"

#: a CSI driver that reports its capacity (as TopoLVM does for local disks), and what it reports
#: for class wffc-room: room for a 5Gi volume (of 10Gi) in z1, for 1Gi in z2
ROOM_DRIVER = "topolvm.example.com"
ROOM: dict[str, dict[str, Any]] = {
    "room-z1": {
        "capacity": "10Gi",
        "maximumVolumeSize": "5Gi",
        "nodeTopology": {"matchLabels": {ZONE: "z1"}},
    },
    "room-z2": {"capacity": "1Gi", "nodeTopology": {"matchLabels": {ZONE: "z2"}}},
}

#: StorageClass -> (provisioner, allowedTopologies), each binding when its pod is placed
BINDING_CLASSES: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "wffc-local": ("kubernetes.io/no-provisioner", []),
    "wffc-any": ("example.com/any", []),
    "wffc-room": (ROOM_DRIVER, []),
    "wffc-z1": (
        "example.com/zonal",
        [{"matchLabelExpressions": [{"key": ZONE, "values": ["z1"]}]}],
    ),
}

#: free PersistentVolume -> (class, node it is on, size, access mode, more spec, labels)
FREE_VOLUMES: dict[str, tuple[str, str, str, str, dict[str, Any], dict[str, str]]] = {
    "lv-u1-1g": ("wffc-local", "u1", "1Gi", "ReadWriteOnce", {}, {}),
    "lv-u1-10g": ("wffc-local", "u1", "10Gi", "ReadWriteOnce", {}, {}),
    "lv-u2-rwx": ("wffc-local", "u2", "10Gi", "ReadWriteMany", {}, {}),
    "lv-u3-block": ("wffc-local", "u3", "10Gi", "ReadWriteOnce", {"volumeMode": "Block"}, {}),
    "lv-u4-fast": ("wffc-local", "u4", "10Gi", "ReadWriteOnce", {}, {"tier": "fast"}),
    "zv-u2": ("wffc-z1", "u2", "10Gi", "ReadWriteOnce", {}, {}),
}

#: probe shape -> its claims: (class, size, more spec, annotations)
WAITING_SHAPES: dict[str, list[tuple[str, str, dict[str, Any], dict[str, str]]]] = {
    "local-1g": [("wffc-local", "1Gi", {}, {})],
    "local-2g": [("wffc-local", "2Gi", {}, {})],
    "local-20g": [("wffc-local", "20Gi", {}, {})],
    "local-block": [("wffc-local", "2Gi", {"volumeMode": "Block"}, {})],
    "local-fast": [("wffc-local", "2Gi", {"selector": {"matchLabels": {"tier": "fast"}}}, {})],
    "local-rwx": [("wffc-local", "2Gi", {"accessModes": ["ReadWriteMany"]}, {})],
    "local-two": [("wffc-local", "1Gi", {}, {}), ("wffc-local", "2Gi", {}, {})],
    "any": [("wffc-any", "1Gi", {}, {})],
    "z1": [("wffc-z1", "1Gi", {}, {})],
    "selected-u4": [("wffc-any", "1Gi", {}, {SELECTED_NODE: "u4"})],
    "room-2g": [("wffc-room", "2Gi", {}, {})],
    "room-8g": [("wffc-room", "8Gi", {}, {})],
}


def _free_volume(
    name: str, cls: str, node: str, size: str, mode: str, more: dict[str, Any], on: dict[str, str]
) -> dict[str, Any]:
    spec = {
        "capacity": {"storage": size},
        "accessModes": [mode],
        "storageClassName": cls,
        "local": {"path": f"/mnt/{name}"},
        "nodeAffinity": _affinity([_is(HOST, node)]),
        **more,
    }
    return {"metadata": {"name": name, "labels": on}, "spec": spec}


def _waiting_claim(
    name: str, cls: str, size: str, more: dict[str, Any], annotations: dict[str, str]
) -> dict[str, Any]:
    spec = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": cls,
        "resources": {"requests": {"storage": size}},
        **more,
    }
    meta = {"name": name, "namespace": NS, "annotations": annotations}
    return {"metadata": meta, "spec": spec}


@contextmanager
def binding_scene(
    cluster: ControlPlane, *, default_class: str | None = None
) -> Iterator[dict[str, dict[str, Any]]]:
    """kube-scheduler, BINDING_NODES, the classes (`default_class` annotated as the default), the
    capacity-reporting driver and what it reports, and FREE_VOLUMES; the nodes as read. Removed
    again after."""
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    core, api = cluster.core_v1(), cluster.api_client()
    storage_v1 = kubernetes.client.StorageV1Api(api)
    for name, on in BINDING_NODES.items():
        cluster.create_gpu_node(name, labels=on)
    try:
        for name, (provisioner, topologies) in BINDING_CLASSES.items():
            body: dict[str, Any] = {
                "metadata": {"name": name},
                "provisioner": provisioner,
                "volumeBindingMode": WAIT,
            }
            if name == default_class:
                body["metadata"]["annotations"] = {DEFAULT_CLASS: "true"}
            if topologies:
                body["allowedTopologies"] = topologies
            storage_v1.create_storage_class(body)
        driver = {"metadata": {"name": ROOM_DRIVER}, "spec": {"storageCapacity": True}}
        storage_v1.create_csi_driver(driver)
        if cluster.release.minor >= (1, 24):  # CSIStorageCapacity is in storage.k8s.io/v1
            for name, fields in ROOM.items():
                body = {"metadata": {"name": name}, "storageClassName": "wffc-room", **fields}
                storage_v1.create_namespaced_csi_storage_capacity(NS, body)
        for name, fields in FREE_VOLUMES.items():
            core.create_persistent_volume(_free_volume(name, *fields))
            core.patch_persistent_volume_status(name, {"status": {"phase": "Available"}})
        yield {n: api.sanitize_for_serialization(core.read_node(n)) for n in BINDING_NODES}
    finally:
        for name in FREE_VOLUMES:
            gone(core.patch_persistent_volume, name, UNHELD)
            gone(core.delete_persistent_volume, name)
        for name in BINDING_CLASSES:
            gone(storage_v1.delete_storage_class, name)
        gone(storage_v1.delete_csi_driver, ROOM_DRIVER)
        if cluster.release.minor >= (1, 24):
            for name in ROOM:
                gone(storage_v1.delete_namespaced_csi_storage_capacity, name, NS)


@pytest.mark.e2e
def test_claims_that_wait_for_their_pod_are_judged_as_kube_scheduler_binds_them(
    cluster: ControlPlane,
) -> None:
    """Claims of WaitForFirstConsumer classes name no volume until their pod is placed: a node
    passes when each gets a free local volume there (size, access and volume mode, selector, one
    volume per claim) or a class that provisions there (a provisioner, `allowedTopologies`, room
    its CSI driver reports; 1.20 checks no room). Every shape on every node: kube-scheduler passes
    the node exactly when vramsched's rule does."""
    core, api = cluster.core_v1(), cluster.api_client()
    storage_v1 = kubernetes.client.StorageV1Api(api)
    disagree: list[str] = []
    placed = dict.fromkeys(BINDING_NODES, 0)
    with binding_scene(cluster) as read:
        for i, (shape, claims) in enumerate(WAITING_SHAPES.items()):
            for node in BINDING_NODES:
                name = f"bprobe-{i}-{node}"
                names = [f"{name}-{j}" for j in range(len(claims))]
                for claim, fields in zip(names, claims, strict=True):
                    core.create_namespaced_persistent_volume_claim(
                        NS, _waiting_claim(claim, *fields)
                    )
                storage = Storage.from_objects(objects(core, storage_v1, api))
                create = partial(core.create_namespaced_pod, NS, probe(name, names, node))
                theirs, stored = judged(cluster, name, node, names, create)
                ours = volume_refusal(stored, read[node], storage)
                if (ours is None) != theirs:
                    disagree.append(f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}")
                placed[node] += theirs
    assert not disagree, "\n".join(disagree)
    # every node passes some shapes and refuses others
    assert all(0 < n < len(WAITING_SHAPES) for n in placed.values()), placed


#: the shapes as generic ephemeral volumes (a claim's annotations are not a template's to set),
#: and one whose template names no class: the default one, here wffc-z1
EPHEMERAL_SHAPES = {
    **{k: v for k, v in WAITING_SHAPES.items() if not any(c[3] for c in v)},
    "default-class": [("", "1Gi", {}, {})],
}


def _template(cls: str, size: str, more: dict[str, Any], _: dict[str, str]) -> dict[str, Any]:
    """A claim spec of `cls` (none: the default class), as an ephemeral volume's template."""
    spec = _waiting_claim("", cls, size, more, {})["spec"]
    if not cls:
        del spec["storageClassName"]
    return spec


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="a pod held back until its claims exist needs scheduling gates")
def test_ephemeral_volumes_are_judged_as_the_claims_they_make(cluster: ControlPlane) -> None:
    """A moved pod's generic ephemeral volume gets a new claim from its template once the new
    pod exists, so vramsched judges the template as a claim that waits for its pod. Here each
    probe is judged before its claims exist; they are then made as the ephemeral volume
    controller makes them (`<pod>-<volume>`, owned by the pod; no controller runs) and the gate
    lifted: kube-scheduler passes the node exactly when vramsched's rule does."""
    core, api = cluster.core_v1(), cluster.api_client()
    storage_v1 = kubernetes.client.StorageV1Api(api)
    disagree: list[str] = []
    placed = dict.fromkeys(EPHEMERAL_SHAPES, 0)
    with binding_scene(cluster, default_class="wffc-z1") as read:
        for i, (shape, claims) in enumerate(EPHEMERAL_SHAPES.items()):
            for node in BINDING_NODES:
                name = f"eprobe-{i}-{node}"
                names = [f"{name}-e{j}" for j in range(len(claims))]
                storage = Storage.from_objects(objects(core, storage_v1, api))
                body = ephemeral(probe(name, [], node), [_template(*c) for c in claims])
                create = partial(create_ephemeral, cluster, body)
                theirs, stored = judged(cluster, name, node, names, create)
                ours = volume_refusal(stored, read[node], storage)
                if (ours is None) != theirs:
                    disagree.append(f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}")
                placed[shape] += theirs
    assert not disagree, "\n".join(disagree)
    # a template without a class takes the default one (wffc-z1): placed where the z1 shape is
    assert 0 < placed["default-class"] == placed["z1"] < len(BINDING_NODES), placed
    assert placed["any"] == len(BINDING_NODES), placed
