"""Storage scenes for the e2e tests that put vramsched's volume rules beside a real
kube-scheduler's: CSINodes, PersistentVolumes each with a bound claim, VolumeAttachments and
holder pods on labelled nodes, made and removed again around a test (`staged`), and probe pods
pinned to one node each (`probe`, judged with `verdicts.probe_alone`).

Claims are bound as the PV controller binds them and holders are created with `spec.nodeName`
set, so neither a controller nor a kubelet is needed. A probe's generic ephemeral volumes
(`ephemeral`) get their claims as the ephemeral volume controller makes them, while a scheduling
gate holds the probe back (`release_ephemeral`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import kubernetes.client
from controlplane import ControlPlane

from extender.volume_rules import Storage

__all__ = [
    "SELECTED_NODE",
    "UNHELD",
    "Scene",
    "binding_verdict",
    "attachment",
    "create_ephemeral",
    "ephemeral",
    "judged",
    "release_ephemeral",
    "claim",
    "csi_node",
    "holder",
    "in_tree_volume",
    "is_in",
    "objects",
    "probe",
    "staged",
    "unbind",
    "with_inline",
]

#: what the PV controller sets on a claim once it is bound
BIND_COMPLETED = "pv.kubernetes.io/bind-completed"
#: what a kubelet with CSI migration on writes on its CSINode
MIGRATED_PLUGINS = "storage.alpha.kubernetes.io/migrated-plugins"

#: what kube-scheduler sets on a claim it asks to be provisioned for a node
SELECTED_NODE = "volume.kubernetes.io/selected-node"
#: a patch that drops the finalizers (with no controller running, nothing else removes them)
UNHELD = {"metadata": {"finalizers": None}}

NS = "default"
SCHEDULER = "vramsched"


def is_in(key: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": "In", "values": list(values)}


def csi_node(
    name: str, drivers: Mapping[str, int | None], migrated: Sequence[str] = ()
) -> dict[str, Any]:
    """A CSINode: each driver with its attach limit (None: listed without one), and the in-tree
    plugins a kubelet with CSI migration lists as migrated."""
    entries = []
    for driver, count in drivers.items():
        entry: dict[str, Any] = {"name": driver, "nodeID": f"{name}-id", "topologyKeys": None}
        if count is not None:
            entry["allocatable"] = {"count": count}
        entries.append(entry)
    meta: dict[str, Any] = {"name": name}
    if migrated:
        meta["annotations"] = {MIGRATED_PLUGINS: ",".join(migrated)}
    return {"metadata": meta, "spec": {"drivers": entries}}


def claim(name: str, volume: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS, "annotations": {BIND_COMPLETED: "yes"}},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "manual",
            "resources": {"requests": {"storage": "1Gi"}},
            "volumeName": volume,
        },
    }


def attachment(name: str, node: str, attacher: str, volume: str) -> dict[str, Any]:
    source = {"persistentVolumeName": volume}
    return {
        "metadata": {"name": name},
        "spec": {"attacher": attacher, "nodeName": node, "source": source},
    }


def pod(name: str, claims: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    spec = {
        "containers": [{"name": "app", "image": "busybox"}],
        "volumes": [
            {"name": f"v{i}", "persistentVolumeClaim": {"claimName": c}}
            for i, c in enumerate(claims)
        ],
        **spec,
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def holder(name: str, node: str, claims: list[str]) -> dict[str, Any]:
    """A pod already on `node`: created with `spec.nodeName`, so no scheduler places it (and,
    with no kubelet, it stays Pending there)."""
    return pod(name, claims, {"nodeName": node, "schedulerName": "nobody"})


def probe(name: str, claims: list[str], node: str) -> dict[str, Any]:
    """A pod for SCHEDULER that only `node` may take."""
    terms = [{"matchFields": [is_in("metadata.name", node)]}]
    affinity = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
    return pod(name, claims, {"schedulerName": SCHEDULER, "affinity": {"nodeAffinity": affinity}})


def objects(
    core: kubernetes.client.CoreV1Api,
    storage_v1: kubernetes.client.StorageV1Api,
    api: kubernetes.client.ApiClient,
) -> list[dict[str, Any]]:
    """Every object of the kinds the rule reads, as listed, each with its "kind"."""
    lists: dict[str, list[Any]] = {
        "PersistentVolume": core.list_persistent_volume().items,
        "PersistentVolumeClaim": core.list_namespaced_persistent_volume_claim(NS).items,
        "CSINode": storage_v1.list_csi_node().items,
        "VolumeAttachment": storage_v1.list_volume_attachment().items,
        "StorageClass": storage_v1.list_storage_class().items,
        "CSIDriver": storage_v1.list_csi_driver().items,
    }
    try:
        found = storage_v1.list_csi_storage_capacity_for_all_namespaces().items
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise
        found = []  # storage.k8s.io/v1 has none before 1.24, and kube-scheduler reads none
    lists["CSIStorageCapacity"] = found
    return [
        {"kind": kind, **api.sanitize_for_serialization(o)}
        for kind, items in lists.items()
        for o in items
    ]


def gone(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Delete (or unblock) something the test made; one it never made is no error."""
    try:
        call(*args, **kwargs)
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise


@dataclass
class Scene:
    """What a test puts on its nodes: CSINodes (name -> body), PersistentVolumes (name -> body;
    claim `c-<name>` is bound to each), VolumeAttachments (name -> node, attacher, volume) and
    holder pods (name -> node, claims)."""

    csi_nodes: dict[str, dict[str, Any]]
    volumes: dict[str, dict[str, Any]]
    attachments: dict[str, tuple[str, str, str]]
    holders: dict[str, tuple[str, list[str]]]


@contextmanager
def staged(
    cluster: ControlPlane, nodes: Mapping[str, Mapping[str, str]], scene: Scene
) -> Iterator[tuple[dict[str, Any], dict[str, list[dict[str, Any]]], Storage]]:
    """Create the nodes (name -> labels) and the scene; yield each node as read, the holders on
    each node, and the storage objects as vramsched reads them; delete the scene again."""
    core, api = cluster.core_v1(), cluster.api_client()
    storage_v1 = kubernetes.client.StorageV1Api(api)
    for name, labels in nodes.items():
        cluster.create_gpu_node(name, labels=labels)
    try:
        for body in scene.csi_nodes.values():
            storage_v1.create_csi_node(body)
        for name, body in scene.volumes.items():
            core.create_persistent_volume(body)
            core.create_namespaced_persistent_volume_claim(NS, claim(f"c-{name}", name))
        for name, (node, attacher, volume) in scene.attachments.items():
            storage_v1.create_volume_attachment(attachment(name, node, attacher, volume))
        for name, (node, claims) in scene.holders.items():
            core.create_namespaced_pod(NS, holder(name, node, claims))
        read = {n: api.sanitize_for_serialization(core.read_node(n)) for n in nodes}
        staying_on: dict[str, list[dict[str, Any]]] = {n: [] for n in nodes}
        for name, (node, _) in scene.holders.items():
            held = api.sanitize_for_serialization(core.read_namespaced_pod(name, NS))
            staying_on[node].append(held)
        yield read, staying_on, Storage.from_objects(objects(core, storage_v1, api))
    finally:
        for name in scene.holders:
            gone(core.delete_namespaced_pod, name, NS, grace_period_seconds=0)
        for name in scene.attachments:
            gone(storage_v1.delete_volume_attachment, name)
        for name in scene.csi_nodes:
            gone(storage_v1.delete_csi_node, name)
        for name in scene.volumes:
            gone(core.patch_namespaced_persistent_volume_claim, f"c-{name}", NS, UNHELD)
            gone(core.delete_namespaced_persistent_volume_claim, f"c-{name}", NS)
            gone(core.patch_persistent_volume, name, UNHELD)
            gone(core.delete_persistent_volume, name)


def in_tree_volume(
    name: str,
    source: Mapping[str, Any],
    labels: Mapping[str, str],
    affinity: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A PersistentVolume of `source` (an in-tree disk, `{"awsElasticBlockStore": ...}`), with
    labels and, if given, `spec.nodeAffinity`."""
    spec: dict[str, Any] = {
        "capacity": {"storage": "1Gi"},
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "manual",
        **source,
    }
    if affinity is not None:
        spec["nodeAffinity"] = affinity
    return {"metadata": {"name": name, "labels": dict(labels)}, "spec": spec}


def with_inline(pod: dict[str, Any], inline: list[dict[str, Any]]) -> dict[str, Any]:
    """`pod` with inline volumes of the sources `inline` added."""
    first = len(pod["spec"]["volumes"])
    pod["spec"]["volumes"] += [{"name": f"d{first + i}", **s} for i, s in enumerate(inline)]
    return pod


def binding_verdict(cluster: ControlPlane, name: str, claims: list[str], node: str) -> bool:
    """kube-scheduler's verdict on probe `name`, pinned to `node`: placed, or past its filters,
    which shows as its PreBind binding a claim (a free volume's `claimRef` names it) or asking
    for one to be provisioned on `node` (the claim's `volume.kubernetes.io/selected-node`). No PV
    controller or provisioner runs, so the binding itself never completes."""
    core = cluster.core_v1()

    def verdict() -> tuple[bool] | None:
        pod = core.read_namespaced_pod(name, NS)
        if pod.spec.node_name:
            return (True,)
        for claim in claims:
            found = core.read_namespaced_persistent_volume_claim(claim, NS)
            if (found.metadata.annotations or {}).get(SELECTED_NODE) == node:
                return (True,)
        for pv in core.list_persistent_volume().items:
            if pv.spec.claim_ref is not None and pv.spec.claim_ref.name in claims:
                return (True,)
        conditions = pod.status.conditions or []
        # a gated pod is marked unscheduled too, before kube-scheduler has judged it
        if any(
            c.type == "PodScheduled" and c.status == "False" and c.reason != "SchedulingGated"
            for c in conditions
        ):
            return (False,)
        return None

    return cluster.wait_for(verdict, timeout=60, message=f"a verdict on {name}")[0]


def unbind(cluster: ControlPlane, name: str, claims: list[str]) -> None:
    """Delete the probe and its claims, and free the volumes kube-scheduler bound them to."""
    core = cluster.core_v1()
    gone(core.delete_namespaced_pod, name, NS, grace_period_seconds=0)
    for claim in claims:
        gone(core.patch_namespaced_persistent_volume_claim, claim, NS, UNHELD)
        gone(core.delete_namespaced_persistent_volume_claim, claim, NS)
    for pv in core.list_persistent_volume().items:
        if pv.spec.claim_ref is not None and pv.spec.claim_ref.name in claims:
            core.patch_persistent_volume(pv.metadata.name, {"spec": {"claimRef": None}})
    cluster.wait_for(
        lambda: all(p.metadata.name != name for p in core.list_namespaced_pod(NS).items),
        timeout=30,
        message=f"{name} gone",
    )


#: the scheduling gate that holds a probe with ephemeral volumes back until their claims exist
GATE = "vramsched.io/test"


def ephemeral(body: dict[str, Any], templates: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`body` (a probe) with a generic ephemeral volume per claim spec of `templates` (`e0`,
    `e1`, ...), held back from kube-scheduler by a scheduling gate (1.26+) until
    `release_ephemeral` makes their claims."""
    body["spec"]["volumes"] = list(body["spec"].get("volumes") or []) + [
        {"name": f"e{j}", "ephemeral": {"volumeClaimTemplate": {"spec": dict(t)}}}
        for j, t in enumerate(templates)
    ]
    body["spec"]["schedulingGates"] = [{"name": GATE}]
    return body


def judged(
    cluster: ControlPlane, name: str, node: str, claims: list[str], create: Callable[[], Any]
) -> tuple[bool, dict[str, Any]]:
    """Create probe `name` (`create` returns it as created), take kube-scheduler's verdict on
    `node` by its `claims` (`binding_verdict`) and undo it (`unbind`): (the verdict, the probe as
    the API server stored it)."""
    try:
        made = create()
        theirs = binding_verdict(cluster, name, claims, node)
    finally:
        unbind(cluster, name, claims)
    return theirs, cluster.api_client().sanitize_for_serialization(made)


def create_ephemeral(cluster: ControlPlane, body: Mapping[str, Any]) -> Any:
    """Create probe `body` (made with `ephemeral`) and `release_ephemeral` it; the pod created."""
    made = cluster.core_v1().create_namespaced_pod(NS, body)
    release_ephemeral(cluster, made)
    return made


def release_ephemeral(cluster: ControlPlane, made: Any) -> list[str]:
    """The claims of the created probe `made`'s ephemeral volumes, made as the ephemeral volume
    controller makes them (`<pod>-<volume>`, owned by the pod, the template's spec), then its
    gate lifted so that kube-scheduler judges it; their names."""
    core, api = cluster.core_v1(), cluster.api_client()
    name = made.metadata.name
    owner = {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": name,
        "uid": made.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    names = []
    for volume in made.spec.volumes:
        if volume.ephemeral is None:
            continue
        claim_name = f"{name}-{volume.name}"
        spec = api.sanitize_for_serialization(volume.ephemeral.volume_claim_template.spec)
        body = {"metadata": {"name": claim_name, "ownerReferences": [owner]}, "spec": spec}
        core.create_namespaced_persistent_volume_claim(NS, body)
        names.append(claim_name)
    core.patch_namespaced_pod(name, NS, [{"op": "remove", "path": "/spec/schedulingGates"}])
    return names
