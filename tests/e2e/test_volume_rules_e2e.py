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
"""

from __future__ import annotations

from typing import Any

import pytest
from controlplane import ControlPlane
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
