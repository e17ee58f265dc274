"""A node's CSI attach limits are judged as the real kube-scheduler judges them.

Before it evicts a running pod, `serve --repack` checks that the pod's re-created copy may attach
its CSI volumes where the plan sends it (`attach_limits.attach_refusal`), as kube-scheduler's
NodeVolumeLimits filter does: a driver's limit is `allocatable.count` in the node's CSINode, and
the volumes (`driver/volumeHandle`, each once) already on the node plus the arriving pod's new
ones must not exceed it. Here 10 claim shapes meet 4 nodes: limits of 1 and 2 for driver a, 1 and
0 for driver b, driver a listed without a count, and no CSINode at all. Holder pods are created
with `spec.nodeName` set (no scheduler, no kubelet: kube-scheduler counts an assigned pod's
volumes all the same) and claims are bound as the PV controller binds them, so no controller is
needed. Each probe is pinned to one node by a `metadata.name` field; kube-scheduler places it
exactly when vramsched's check passes the node.

Two volumes share a handle and one handle is used by both drivers, so a volume is told by its
driver and handle, not by its PV's name; a hostPath volume is not counted; a probe mounting one
claim twice counts it once. VolumeAttachments name w1 and w2: kube-scheduler counts them since
1.32 (as `attacher/handle` of their PV, under the attacher; vramsched counts them on every
version), 1.20 does not: those verdicts are `OLD_NO_ATTACHMENTS`.

The last two tests give probes claims of a WaitForFirstConsumer class, which name no volume until
their pod is placed and count as new volumes of the class's provisioner: as claims, and (1.36) as
generic ephemeral volumes judged from their templates. No provisioner runs, so a pass shows as
kube-scheduler's PreBind asking for the claims to be provisioned on the node
(`storage_scene.binding_verdict`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import kubernetes.client
import pytest
from controlplane import ControlPlane
from storage_scene import (
    NS,
    SCHEDULER,
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
    with_inline,
)
from verdicts import probe_alone

from extender.attach_limits import attach_refusal
from extender.volume_rules import Storage

A = "a.csi.example.com"
B = "b.csi.example.com"

NODES = ("w1", "w2", "w3", "w4")

#: node -> its CSINode's drivers: driver -> allocatable count, or None for a driver listed without
#: one (no limit); w3 has no CSINode at all
CSI_NODES: dict[str, dict[str, int | None]] = {
    "w1": {A: 1},
    "w2": {A: 2, B: 1},
    "w4": {A: None, B: 0},
}

#: volume -> (CSI driver or None for a hostPath volume, volume handle); claim `c-<volume>` is
#: bound to each
VOLUMES: dict[str, tuple[str | None, str]] = {
    "a-1": (A, "disk-1"),
    "a-1-alias": (A, "disk-1"),  # another PV of the same disk
    "a-2": (A, "disk-2"),
    "a-3": (A, "disk-3"),
    "a-4": (A, "disk-4"),
    "a-va": (A, "disk-va"),
    "a-5": (A, "disk-5"),
    "b-1": (B, "disk-5"),  # the same handle as a-5's, of another driver
    "host": (None, ""),
}

#: holder pod -> (the node it is on, the claims it mounts)
HOLDERS: dict[str, tuple[str, list[str]]] = {
    "hold-w1": ("w1", ["c-a-1"]),
    "hold-w2": ("w2", ["c-a-2", "c-host"]),  # a hostPath volume is not counted
    "hold-w4": ("w4", ["c-a-5"]),
}

#: VolumeAttachment -> (node, attacher, volume)
ATTACHMENTS: dict[str, tuple[str, str, str]] = {
    "va-w1": ("w1", A, "a-1"),  # the volume hold-w1 mounts: counted once
    "va-w1-by-b": ("w1", B, "a-3"),  # counted as `b/disk-3`, of b: w1 still lacks `a/disk-3`
    "va-w2": ("w2", A, "a-va"),  # no pod mounts it
    "va-w2-hostpath": ("w2", A, "host"),  # not a CSI volume: not counted
    "va-w2-gone": ("w2", A, "pv-gone"),  # no such volume: not counted
}

#: probe shape -> the claims it mounts
SHAPES: dict[str, list[str]] = {
    "no-claims": [],
    "host": ["c-host"],
    "held-on-w1": ["c-a-1"],
    "alias-of-held-on-w1": ["c-a-1-alias"],
    "held-on-w2": ["c-a-2"],
    "new-a": ["c-a-3"],
    "new-a-twice": ["c-a-3", "c-a-4"],
    "one-claim-twice": ["c-a-3", "c-a-3"],
    "attached-on-w2": ["c-a-va"],
    "b": ["c-b-1"],
}

#: shapes 1.20's kube-scheduler judges otherwise on one node: it does not count VolumeAttachments
#: (1.32 does, and vramsched follows it), so w2 has room for one more volume of driver a. And 1.32
#: counts the attached volume that no pod on w2 mounts twice when the arriving pod mounts it (it
#: takes only the pods' volumes off the arriving pod's, not the attached ones): `attached-on-w2`
#: does not fit on w2 there, though it is the same volume
OLD_NO_ATTACHMENTS = {
    ("held-on-w1", "w2"),
    ("alias-of-held-on-w1", "w2"),
    ("new-a", "w2"),
    ("one-claim-twice", "w2"),
    ("attached-on-w2", "w2"),
}


def _volume(name: str, driver: str | None, handle: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "capacity": {"storage": "1Gi"},
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "manual",
    }
    if driver is None:
        spec["hostPath"] = {"path": f"/tmp/{name}"}
    else:
        spec["csi"] = {"driver": driver, "volumeHandle": handle}
    return {"metadata": {"name": name}, "spec": spec}


@pytest.mark.e2e
def test_csi_attach_limits_are_judged_as_kube_scheduler_judges_them(
    cluster: ControlPlane,
) -> None:
    """Every shape on every node: kube-scheduler places it exactly when vramsched's rule passes
    it (but for `OLD_NO_ATTACHMENTS` on 1.20)."""
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    scene = Scene(
        csi_nodes={n: csi_node(n, drivers) for n, drivers in CSI_NODES.items()},
        volumes={n: _volume(n, driver, handle) for n, (driver, handle) in VOLUMES.items()},
        attachments=ATTACHMENTS,
        holders=HOLDERS,
    )
    with staged(cluster, dict.fromkeys(NODES, {}), scene) as (nodes, staying_on, storage):
        old = cluster.release.minor < (1, 32)
        disagree, placed = [], dict.fromkeys(NODES, 0)
        theirs_on: dict[tuple[str, str], bool] = {}
        for i, (shape, claims) in enumerate(SHAPES.items()):
            for node in NODES:
                theirs, stored = probe_alone(cluster, probe(f"probe-{i}-{node}", claims, node))
                ours = attach_refusal(nodes[node], staying_on[node], [stored], storage)
                differs = (ours is None) != theirs
                expected = old and (shape, node) in OLD_NO_ATTACHMENTS
                if differs != expected:
                    disagree.append(
                        f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}"
                        + (" (they should differ on this version)" if expected else "")
                    )
                placed[node] += theirs
                theirs_on[shape, node] = theirs
    assert not disagree, "\n".join(disagree)
    # the VolumeAttachment's volume is counted exactly where the version says so
    assert {theirs_on[s] for s in OLD_NO_ATTACHMENTS} == {old}, theirs_on
    # a node with limits takes some shapes and refuses others; a node with none takes all
    assert all(0 < placed[n] < len(SHAPES) for n in CSI_NODES), placed
    assert placed["w3"] == len(SHAPES), placed
    assert not theirs_on["new-a", "w1"], theirs_on


EBS = "ebs.csi.aws.com"
PD = "pd.csi.storage.gke.io"
AZURE = "disk.csi.azure.com"

#: the in-tree plugins the CSINodes list as migrated, as a kubelet with CSI migration lists them
MIGRATED = ("kubernetes.io/aws-ebs", "kubernetes.io/azure-disk", "kubernetes.io/gce-pd")

#: node -> its CSINode's counts; m3 has no CSINode (no in-tree disk is counted there)
MIGRATED_NODES: dict[str, dict[str, int | None]] = {
    "m1": {EBS: 1, PD: 1, AZURE: 0},
    "m2": {EBS: 2, PD: 2, AZURE: None},
}

#: PersistentVolume -> (its source, its labels); claim `c-<volume>` is bound to each
IN_TREE: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "ebs-held": ({"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-held"}}, {}),
    "ebs-held-csi": ({"csi": {"driver": EBS, "volumeHandle": "vol-held"}}, {}),
    "ebs-new": ({"awsElasticBlockStore": {"volumeID": "vol-new"}}, {}),
    "ebs-att": ({"awsElasticBlockStore": {"volumeID": "vol-att"}}, {}),
    "pd-held": (
        {"gcePersistentDisk": {"pdName": "pd-held"}},
        {"failure-domain.beta.kubernetes.io/zone": "us-central1-a"},
    ),
    "pd-held-csi": (
        {
            "csi": {
                "driver": PD,
                "volumeHandle": "projects/UNSPECIFIED/zones/us-central1-a/disks/pd-held",
            }
        },
        {},
    ),
    "pd-new": ({"gcePersistentDisk": {"pdName": "pd-new"}}, {}),
}

#: holder pod -> (its node, the claims it mounts)
IN_TREE_HOLDERS: dict[str, tuple[str, list[str]]] = {
    "mhold-m1": ("m1", ["c-ebs-held", "c-pd-held"]),
    "mhold-m2": ("m2", ["c-ebs-held"]),
}

#: an in-tree disk attached to m2 that no pod there mounts: kube-scheduler reads an attachment's
#: volume as CSI only, so it is not counted (m2 takes one more EBS disk, not two)
IN_TREE_ATTACHMENTS = {"va-m2-ebs": ("m2", EBS, "ebs-att")}

AZURE_URI = "/subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/disks/{}"

#: probe shape -> (claims, inline volumes)
IN_TREE_SHAPES: dict[str, tuple[list[str], list[dict[str, Any]]]] = {
    "ebs-new": (["c-ebs-new"], []),
    "ebs-held-as-csi": (["c-ebs-held-csi"], []),
    "ebs-inline-new": ([], [{"awsElasticBlockStore": {"volumeID": "vol-inline"}}]),
    "ebs-inline-held": ([], [{"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-held"}}]),
    "ebs-new-and-inline": (["c-ebs-new"], [{"awsElasticBlockStore": {"volumeID": "vol-inline"}}]),
    "pd-new": (["c-pd-new"], []),
    "pd-held-as-csi": (["c-pd-held-csi"], []),
    "pd-inline-new": ([], [{"gcePersistentDisk": {"pdName": "pd-inline"}}]),
    "azure-inline": (
        [],
        [{"azureDisk": {"diskName": "d1", "diskURI": AZURE_URI.format("d1"), "kind": "Managed"}}],
    ),
}


@pytest.mark.e2e
def test_migrated_in_tree_disks_are_counted_as_kube_scheduler_counts_them(
    cluster: ControlPlane,
) -> None:
    """In-tree disks (volumes, inline, attached) count as their CSI driver's, each disk once in
    whatever form: kube-scheduler places every shape on every node exactly when vramsched's rule
    passes it (1.20, without CSI migration on by default, counts none of them)."""
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    scene = Scene(
        csi_nodes={n: csi_node(n, drivers, MIGRATED) for n, drivers in MIGRATED_NODES.items()},
        volumes={n: in_tree_volume(n, source, on) for n, (source, on) in IN_TREE.items()},
        attachments=IN_TREE_ATTACHMENTS,
        holders=IN_TREE_HOLDERS,
    )
    nodes = (*MIGRATED_NODES, "m3")
    theirs_on: dict[tuple[str, str], bool] = {}
    ours_on: dict[tuple[str, str], bool] = {}
    with staged(cluster, dict.fromkeys(nodes, {}), scene) as (read, staying_on, storage):
        for i, (shape, (claims, inline)) in enumerate(IN_TREE_SHAPES.items()):
            for node in nodes:
                pod = with_inline(probe(f"mprobe-{i}-{node}", claims, node), inline)
                theirs, stored = probe_alone(cluster, pod)
                ours = attach_refusal(read[node], staying_on[node], [stored], storage)
                theirs_on[shape, node], ours_on[shape, node] = theirs, ours is None
    if cluster.release.minor >= (1, 32):
        disagree = [f"{k}: kube-scheduler {v}" for k, v in theirs_on.items() if ours_on[k] != v]
        assert not disagree, "\n".join(disagree)
    else:  # no in-tree disk is counted: every probe is placed
        assert all(theirs_on.values()), theirs_on
    # the in-tree disk only attached to m2 leaves room for one new EBS disk there, not two
    assert ours_on["ebs-new", "m2"] and not ours_on["ebs-new-and-inline", "m2"], ours_on
    # each node with limits refuses some shape; the node without a CSINode takes all
    assert all(not all(ours_on[s, n] for s in IN_TREE_SHAPES) for n in MIGRATED_NODES)
    assert all(ours_on[s, "m3"] for s in IN_TREE_SHAPES), ours_on


#: node -> its CSINode's counts of driver a; x3 has no CSINode. hold-x1 keeps one of x1's one slot
WAITING_NODES: dict[str, dict[str, int | None]] = {"x1": {A: 1}, "x2": {A: 2}}
WAITING_ON = (*WAITING_NODES, "x3")
WAITING_VOLUMES = {"a-hx": (A, "disk-hx"), "a-b": (A, "disk-b")}

#: probe shape -> (bound claims it mounts, how many claims of class wffc-a it brings, each naming
#: no volume until the probe is placed)
WAITING_SHAPES: dict[str, tuple[list[str], int]] = {
    "one": ([], 1),
    "two": ([], 2),
    "three": ([], 3),
    "bound-and-one": (["c-a-b"], 1),
    "bound-and-two": (["c-a-b"], 2),
}


def _waiting(name: str) -> dict[str, Any]:
    """A claim of class wffc-a that names no volume: bound where its pod is placed."""
    spec = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "wffc-a",
        "resources": {"requests": {"storage": "1Gi"}},
    }
    return {"metadata": {"name": name, "namespace": NS}, "spec": spec}


@contextmanager
def waiting_scene(
    cluster: ControlPlane,
) -> Iterator[tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]]:
    """x1 (room for no more volumes of A: a holder's disk fills it), x2 (room for two), x3 (no
    CSINode), the volumes the shapes hold, and class wffc-a: the nodes as read and the pods on
    them. Removed again after."""
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    storage_v1 = kubernetes.client.StorageV1Api(cluster.api_client())
    scene = Scene(
        csi_nodes={n: csi_node(n, drivers) for n, drivers in WAITING_NODES.items()},
        volumes={n: _volume(n, driver, handle) for n, (driver, handle) in WAITING_VOLUMES.items()},
        attachments={},
        holders={"hold-x1": ("x1", ["c-a-hx"])},
    )
    waits = {
        "metadata": {"name": "wffc-a"},
        "provisioner": A,
        "volumeBindingMode": "WaitForFirstConsumer",
    }
    storage_v1.create_storage_class(waits)
    try:
        with staged(cluster, dict.fromkeys(WAITING_ON, {}), scene) as (read, staying_on, _):
            yield read, staying_on
    finally:
        gone(storage_v1.delete_storage_class, "wffc-a")


def _check_waiting_counts(theirs_on: dict[tuple[str, str], bool]) -> None:
    # x1 is full, x3 has no limit; x2 takes two volumes of a, not three
    assert not any(theirs_on[s, "x1"] for s in WAITING_SHAPES), theirs_on
    assert all(theirs_on[s, "x3"] for s in WAITING_SHAPES), theirs_on
    assert theirs_on["two", "x2"] and not theirs_on["three", "x2"], theirs_on
    assert theirs_on["bound-and-one", "x2"] and not theirs_on["bound-and-two", "x2"], theirs_on


@pytest.mark.e2e
def test_claims_that_wait_for_their_pod_count_as_kube_scheduler_counts_them(
    cluster: ControlPlane,
) -> None:
    """A claim of a WaitForFirstConsumer class names no volume until its pod is placed: it
    counts as a new volume of its class's provisioner, beside the node's and the pod's bound
    ones. Every shape on every node: kube-scheduler passes the node (placing the probe, or
    starting to provision its claims there) exactly when vramsched's rule does."""
    core, api = cluster.core_v1(), cluster.api_client()
    storage_v1 = kubernetes.client.StorageV1Api(api)
    theirs_on: dict[tuple[str, str], bool] = {}
    disagree = []
    with waiting_scene(cluster) as (read, staying_on):
        for i, (shape, (bound, waiting)) in enumerate(WAITING_SHAPES.items()):
            for node in WAITING_ON:
                name = f"wprobe-{i}-{node}"
                names = [f"{name}-{j}" for j in range(waiting)]
                for claim in names:
                    core.create_namespaced_persistent_volume_claim(NS, _waiting(claim))
                storage = Storage.from_objects(objects(core, storage_v1, api))
                create = partial(core.create_namespaced_pod, NS, probe(name, bound + names, node))
                theirs, stored = judged(cluster, name, node, names, create)
                ours = attach_refusal(read[node], staying_on[node], [stored], storage)
                if (ours is None) != theirs:
                    disagree.append(f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}")
                theirs_on[shape, node] = theirs
    assert not disagree, "\n".join(disagree)
    _check_waiting_counts(theirs_on)


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="a pod held back until its claims exist needs scheduling gates")
def test_ephemeral_volumes_count_as_the_claims_they_make(cluster: ControlPlane) -> None:
    """The same shapes with the waiting claims as generic ephemeral volumes of class wffc-a,
    judged from their templates before their claims exist (as a moved pod's new copy is), then
    released to kube-scheduler once their claims are made (`storage_scene.release_ephemeral`)."""
    core, api = cluster.core_v1(), cluster.api_client()
    storage_v1 = kubernetes.client.StorageV1Api(api)
    theirs_on: dict[tuple[str, str], bool] = {}
    disagree = []
    template = _waiting("")["spec"]
    with waiting_scene(cluster) as (read, staying_on):
        for i, (shape, (bound, waiting)) in enumerate(WAITING_SHAPES.items()):
            for node in WAITING_ON:
                name = f"eprobe-{i}-{node}"
                names = [f"{name}-e{j}" for j in range(waiting)]
                storage = Storage.from_objects(objects(core, storage_v1, api))
                body = ephemeral(probe(name, bound, node), [template] * waiting)
                create = partial(create_ephemeral, cluster, body)
                theirs, stored = judged(cluster, name, node, names, create)
                ours = attach_refusal(read[node], staying_on[node], [stored], storage)
                if (ours is None) != theirs:
                    disagree.append(f"{shape} on {node}: kube-scheduler {theirs}, vramsched {ours}")
                theirs_on[shape, node] = theirs
    assert not disagree, "\n".join(disagree)
    _check_waiting_counts(theirs_on)
