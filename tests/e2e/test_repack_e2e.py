"""Live repacking (`vramsched serve --repack`) on the real control plane, with
kube-controller-manager re-creating evicted pods.

The deployed stack of test_extender_e2e (kube-scheduler with the shipped configuration and
leader election, `vramsched serve --kubeconfig` as the deploy ServiceAccount with the roles of
deploy/rbac.yaml, its leader-election Role, and deploy/repack/rbac.yaml: nothing more), plus
kube-controller-manager with Deployments, ReplicaSets, StatefulSets, the garbage collector and
the disruption controller (controller_manager.py). The nodes are API objects without a kubelet:
`controller_manager.PodLifecycle` marks their pods Running and Ready and finishes graceful
deletions after a second, as a kubelet would once the containers stopped. An eviction of a pod
on such a node is a graceful deletion like any other: the pod keeps its GPU in vramsched's
ledger while it is Terminating, and the blocked pod gets it only once the pod is gone.

1.36 only: build.sh builds no kube-controller-manager for 1.20 (and policy/v1 Evictions need
1.22; vramsched sends policy/v1beta1 to older servers).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes.client
import pytest
import yaml
from controller_manager import PodLifecycle, start_controllers
from controlplane import REPO_ROOT, ControlPlane
from test_extender_e2e import (
    GPU,
    NS,
    Extender,
    _grant_extender_rbac,
    assert_sound,
    core,
    gpu_labels,
    gpu_pod,
    start_shipped_scheduler,
    wait_bound,
)
from test_observe_e2e import _grant_lease_role

from extender.inventory import ReplicaPolicy

GIB = 1 << 30
NODES = ("gpu-a", "gpu-b")
APP = {"app": "web"}
REPACK_RBAC = REPO_ROOT / "deploy" / "repack" / "rbac.yaml"


def _grant_repack_rbac(cp: ControlPlane) -> list[tuple[str, str]]:
    """deploy/repack/rbac.yaml as shipped; returns what to delete after the test."""
    docs = [d for d in yaml.safe_load_all(REPACK_RBAC.read_text()) if d]
    cp.create_rbac(docs)
    return [(d["kind"], d["metadata"]["name"]) for d in docs]


def _revoke(cp: ControlPlane, objects: list[tuple[str, str]]) -> None:
    with cp.api_client() as client:
        rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        for kind, name in objects:
            delete = (
                rbac.delete_cluster_role
                if kind == "ClusterRole"
                else rbac.delete_cluster_role_binding
            )
            try:
                delete(name)
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise


def web_deployment(
    replicas: int, *, one_per_node: bool = False, claim: str | None = None
) -> dict[str, Any]:
    """4Gi per pod, movable: vramsched may evict them, their ReplicaSet re-creates them.
    `one_per_node`: the replicas keep apart by required pod anti-affinity on the hostname.
    `claim`: they mount that PersistentVolumeClaim."""
    template = gpu_pod("unused", "4Gi")
    if claim is not None:
        template["spec"]["volumes"] = [
            {"name": "cache", "persistentVolumeClaim": {"claimName": claim}}
        ]
    template["metadata"] = {
        "labels": dict(APP),
        "annotations": {"vramsched.io/model-memory": "4Gi", "vramsched.io/movable": "true"},
    }
    if one_per_node:
        term = {
            "labelSelector": {"matchLabels": dict(APP)},
            "topologyKey": "kubernetes.io/hostname",
        }
        template["spec"]["affinity"] = {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(APP)},
            "template": {"metadata": template["metadata"], "spec": template["spec"]},
        },
    }


def cordon(api: kubernetes.client.CoreV1Api, node: str, on: bool) -> None:
    api.patch_node(node, {"spec": {"unschedulable": on}})


def web_pods(api: kubernetes.client.CoreV1Api) -> list[Any]:
    return api.list_namespaced_pod(NS, label_selector="app=web").items


def assignment(pod: Any) -> dict[str, Any]:
    return json.loads((pod.metadata.annotations or {})["vramsched.io/assignment"])


def events_of(api: kubernetes.client.CoreV1Api, uid: str, reason: str) -> list[str]:
    items = api.list_namespaced_event(NS, field_selector=f"involvedObject.uid={uid}").items
    return [e.message or "" for e in items if e.reason == reason]


def blocked_and_refused(
    cp: ControlPlane, api: kubernetes.client.CoreV1Api, what: str
) -> tuple[str, list[str]]:
    """Create pod p (16Gi), which fits on neither fragmented GPU, and wait for vramsched's
    `no repack now` Events on it: (its UID, their messages)."""
    api.create_namespaced_pod(NS, gpu_pod("p", "16Gi"))
    uid = api.read_namespaced_pod("p", NS).metadata.uid
    refused = cp.wait_for(
        lambda: [m for m in events_of(api, uid, "VramschedRepack") if "no repack now" in m],
        timeout=90,
        message=f"vramsched says {what}",
    )
    return uid, refused


@pytest.fixture
def repack_stack(cluster: ControlPlane) -> Iterator[tuple[ControlPlane, Extender, PodLifecycle]]:
    """Extender with --repack (leader election as deployed), kube-scheduler, the controllers,
    the fake nodes and their pods' lifecycle. Teardown deletes the Deployment and its
    ReplicaSets through the garbage collector while it still runs, and the repack role."""
    kubeconfig = _grant_extender_rbac(cluster)
    _grant_lease_role(cluster)
    granted = _grant_repack_rbac(cluster)
    start_controllers(cluster)
    for name in NODES:
        cluster.create_gpu_node(
            name,
            {**gpu_labels("NVIDIA-L4", 1, 24 * 1024, replicas=4), "kubernetes.io/hostname": name},
            {GPU: "4"},
        )
    ext = Extender(cluster, kubeconfig, ["--repack"])
    ext.start()
    start_shipped_scheduler(cluster, ext.url)
    try:
        with PodLifecycle(cluster, NODES) as lifecycle:
            yield cluster, ext, lifecycle
            with cluster.api_client() as client:
                apps = kubernetes.client.AppsV1Api(client)
                policy = kubernetes.client.PolicyV1Api(client)
                api = kubernetes.client.CoreV1Api(client)
                try:
                    apps.delete_namespaced_deployment("web", NS, propagation_policy="Foreground")
                except kubernetes.client.ApiException as exc:
                    if exc.status != 404:  # the test ended before it made one
                        raise
                for pdb in policy.list_namespaced_pod_disruption_budget(NS).items:
                    policy.delete_namespaced_pod_disruption_budget(pdb.metadata.name, NS)
                cluster.wait_for(
                    lambda: (
                        not apps.list_namespaced_replica_set(NS).items
                        and not apps.list_namespaced_deployment(NS).items
                        and not web_pods(api)
                    ),
                    timeout=60,
                    message="the web Deployment, its ReplicaSets and pods deleted",
                )
    finally:
        ext.stop()
        _revoke(cluster, granted)


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="build.sh builds no kube-controller-manager for 1.20")
def test_repack_evicts_through_the_api_and_places_everyone_where_the_plan_said(
    repack_stack: tuple[ControlPlane, Extender, PodLifecycle],
) -> None:
    cp, ext, lifecycle = repack_stack
    api = core(cp)
    with cp.api_client() as client:
        apps = kubernetes.client.AppsV1Api(client)
        policy = kubernetes.client.PolicyV1Api(client)

        # Fragment the two 24Gi time-sliced GPUs, one node cordoned at a time:
        # gpu-a: f1 12Gi + a web pod 4Gi (8 free); gpu-b: f2 6Gi + a web pod 4Gi (14 free).
        cordon(api, "gpu-b", True)
        api.create_namespaced_pod(NS, gpu_pod("f1", "12Gi"))
        apps.create_namespaced_deployment(NS, web_deployment(1))
        wait_bound(cp, api, ["f1"])
        cp.wait_for(
            lambda: [p for p in web_pods(api) if p.spec.node_name == "gpu-a"],
            timeout=60,
            message="the first web pod bound to gpu-a",
        )
        cordon(api, "gpu-b", False)
        cordon(api, "gpu-a", True)
        api.create_namespaced_pod(NS, gpu_pod("f2", "6Gi"))
        apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 2}})
        wait_bound(cp, api, ["f2"])
        cp.wait_for(
            lambda: [p for p in web_pods(api) if p.spec.node_name == "gpu-b"],
            timeout=60,
            message="the second web pod bound to gpu-b",
        )
        cordon(api, "gpu-a", False)
        before = {p.metadata.name: p for p in web_pods(api)}
        (on_a,) = [p for p in before.values() if p.spec.node_name == "gpu-a"]
        (on_b,) = [p for p in before.values() if p.spec.node_name == "gpu-b"]
        assert {api.read_namespaced_pod(n, NS).spec.node_name for n in ("f1", "f2")} == set(NODES)

        # A budget that allows no disruption: both web pods must stay available.
        policy.create_namespaced_pod_disruption_budget(
            NS,
            {
                "metadata": {"name": "web"},
                "spec": {"minAvailable": 2, "selector": {"matchLabels": dict(APP)}},
            },
        )
        cp.wait_for(
            lambda: (
                (s := policy.read_namespaced_pod_disruption_budget("web", NS).status) is not None
                and s.current_healthy == 2
                and s.disruptions_allowed == 0
            ),
            timeout=60,
            message="the PodDisruptionBudget counts both web pods healthy",
        )

        # 16Gi fits on neither GPU; moving gpu-b's web pod to gpu-a makes 18Gi free on gpu-b.
        p_uid, refused = blocked_and_refused(cp, api, "the budget refuses the move")
        assert "PodDisruptionBudget allows no disruption now" in refused[0], refused
        assert on_b.metadata.name in refused[0]
        # the dry run changed nothing: both web pods are the same, none is terminating
        assert {p.metadata.uid for p in web_pods(api)} == {p.metadata.uid for p in before.values()}
        assert lifecycle.terminated == {}
        assert api.read_namespaced_pod("p", NS).spec.node_name is None

        # The budget now allows one disruption: the next attempt moves gpu-b's web pod.
        policy.patch_namespaced_pod_disruption_budget("web", NS, {"spec": {"minAvailable": 1}})
        assert wait_bound(cp, api, ["p"], timeout=120)["p"] == "gpu-b"

        def replaced() -> list[Any]:
            pods = [p for p in web_pods(api) if p.metadata.name not in before]
            return [p for p in pods if p.spec.node_name and not p.metadata.deletion_timestamp]

        (new,) = cp.wait_for(replaced, timeout=60, message="the re-created web pod bound")

    # Evicted through the Eviction API (DisruptionTarget), only gpu-b's web pod, gone since.
    assert set(lifecycle.terminated) == {on_b.metadata.name}, lifecycle.terminated
    gone = lifecycle.terminated[on_b.metadata.name]
    assert ("DisruptionTarget", "EvictionByEvictionAPI") in gone.conditions, gone
    assert on_b.metadata.name not in {p.metadata.name for p in web_pods(api)}
    assert api.read_namespaced_pod(on_a.metadata.name, NS).metadata.uid == on_a.metadata.uid

    # Placed where the plan said: the plan, as vramsched logged and keeps it in /state.
    state = cp.wait_for(
        lambda: (s := ext.get("/state")) and s["planner"]["repack"]["last"] and s,
        timeout=30,
        message="the repack plan ended",
    )
    repack = state["planner"]["repack"]
    last = repack["last"]
    assert last["phase"] == "done", last
    assert last["outcome"] == "blocked pod placed; 1 of 1 re-created pods placed as planned"
    (move,) = last["moves"]
    assert move["pod"] == f"{NS}/{on_b.metadata.name}" and move["from"] == "gpu-b/0"
    assert move["to"] == "gpu-a/0" and move["replacement"] == f"{NS}/{new.metadata.name}"
    assert last["placement"] == "gpu-b/0"
    assert repack["moves"] == 1 and repack["done"] == 1 and repack["refused"] >= 1
    p = api.read_namespaced_pod("p", NS)
    assert assignment(p) == {"node": "gpu-b", "devices": ["0"], "bytesPerDevice": [16 * GIB]}
    assert assignment(new) == {"node": "gpu-a", "devices": ["0"], "bytesPerDevice": [4 * GIB]}
    assert new.metadata.owner_references[0].kind == "ReplicaSet"

    # Events: on the evicted pod (naming the pod it made room for) and on the blocked pod.
    (evicted,) = events_of(api, on_b.metadata.uid, "VramschedRepack")
    assert "to make room for pod default/p" in evicted
    assert "holds device 0 of gpu-a for the new one" in evicted
    assert any(
        "holds device 0 of gpu-b for it" in m for m in events_of(api, p_uid, "VramschedRepack")
    )

    # The ledger: no hold left over, every GPU within its memory, equal to the API's pods.
    held = {h["pod"] for n in state["nodes"] for g in n["gpus"] for h in g["holders"]}
    bound = {
        f"{NS}/{q.metadata.name}" for q in api.list_namespaced_pod(NS).items if q.spec.node_name
    }
    assert held == bound
    for node in state["nodes"]:
        for gpu in node["gpus"]:
            assert gpu["usedBytes"] == sum(h["bytes"] for h in gpu["holders"])
            assert gpu["usedBytes"] <= gpu["memoryBytes"], gpu
            assert gpu["usedReplicas"] <= gpu["replicas"], gpu
    assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    with urllib.request.urlopen(ext.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "vramsched_repack_moves_total 1.0" in metrics
    assert 'vramsched_repack_plans_total{outcome="done"} 1.0' in metrics


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="build.sh builds no kube-controller-manager for 1.20")
def test_repack_moves_no_replica_beside_one_its_anti_affinity_keeps_away(
    repack_stack: tuple[ControlPlane, Extender, PodLifecycle],
) -> None:
    """The fragmented GPUs of the test above, the two web replicas kept one per node: the only
    plan moves gpu-b's replica beside gpu-a's, where kube-scheduler would never place its new
    copy. vramsched refuses the plan and says why; nothing is evicted."""
    cp, ext, lifecycle = repack_stack
    api = core(cp)
    with cp.api_client() as client:
        apps = kubernetes.client.AppsV1Api(client)
        # gpu-a: f1 12Gi, gpu-b: f2 6Gi (one node cordoned at a time); then a replica on each:
        # gpu-a 16Gi used (8 free), gpu-b 10Gi (14 free)
        for pod, node in (("f1", "gpu-a"), ("f2", "gpu-b")):
            (other,) = [n for n in NODES if n != node]
            cordon(api, other, True)
            api.create_namespaced_pod(NS, gpu_pod(pod, "12Gi" if pod == "f1" else "6Gi"))
            assert wait_bound(cp, api, [pod])[pod] == node
            cordon(api, other, False)
        apps.create_namespaced_deployment(NS, web_deployment(2, one_per_node=True))
        cp.wait_for(
            lambda: sorted(p.spec.node_name or "" for p in web_pods(api)) == sorted(NODES),
            timeout=60,
            message="one web replica bound to each node",
        )
    before = {p.metadata.uid for p in web_pods(api)}
    _, refused = blocked_and_refused(cp, api, "why it moves nothing")
    assert "anti-affinity" in refused[0] and "node gpu-a" in refused[0], refused
    assert {p.metadata.uid for p in web_pods(api)} == before
    assert lifecycle.terminated == {}
    assert api.read_namespaced_pod("p", NS).spec.node_name is None
    repack = ext.get("/state")["planner"]["repack"]
    assert repack["moves"] == 0 and repack["refused"] >= 1


#: the CSI driver of the attach-limit test's disks (no such driver runs: the disks are API
#: objects, counted by kube-scheduler and vramsched alike)
DISK = "disk.csi.example.com"


def bound_claim(
    api: kubernetes.client.CoreV1Api, name: str, nodes: list[str], *, disk: bool = False
) -> None:
    """Claim `name` in NS, bound (as the PV controller binds) to a local volume on `nodes`, or
    (`disk`) to a CSI disk of driver DISK that any node may attach."""
    term = {
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]
    }
    source: dict[str, Any] = (
        {"csi": {"driver": DISK, "volumeHandle": name}}
        if disk
        else {
            "local": {"path": f"/mnt/{name}"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [term]}},
        }
    )
    api.create_persistent_volume(
        {
            "metadata": {"name": f"pv-{name}"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "local",
                **source,
                "claimRef": {"namespace": NS, "name": name},
            },
        }
    )
    api.create_namespaced_persistent_volume_claim(
        NS,
        {
            "metadata": {
                "name": name,
                "annotations": {"pv.kubernetes.io/bind-completed": "yes"},
            },
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "local",
                "resources": {"requests": {"storage": "1Gi"}},
                "volumeName": f"pv-{name}",
            },
        },
    )


def drop_claim(api: kubernetes.client.CoreV1Api, name: str) -> None:
    """Delete the claim and its volume (no controller here removes their protection)."""
    for patch, delete, args in (
        (
            api.patch_namespaced_persistent_volume_claim,
            api.delete_namespaced_persistent_volume_claim,
            (name, NS),
        ),
        (api.patch_persistent_volume, api.delete_persistent_volume, (f"pv-{name}",)),
    ):
        patch(*args, {"metadata": {"finalizers": None}})
        delete(*args)


def fill_around(
    cp: ControlPlane,
    api: kubernetes.client.CoreV1Api,
    make_replica: Callable[[], None],
    f1_claim: str | None = None,
) -> None:
    """gpu-a: bare pods f1 12Gi + f3 4Gi (8 free); gpu-b: f2 6Gi + the 4Gi replica
    `make_replica` creates (14 free), each node cordoned while the other fills. The replica's
    binding is the caller's to wait for; gpu-a is uncordoned by the caller once it is bound.
    `f1_claim`: f1 mounts that claim."""
    cordon(api, "gpu-b", True)
    f1 = gpu_pod("f1", "12Gi")
    if f1_claim is not None:
        f1["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": f1_claim}}]
    api.create_namespaced_pod(NS, f1)
    api.create_namespaced_pod(NS, gpu_pod("f3", "4Gi"))
    assert set(wait_bound(cp, api, ["f1", "f3"]).values()) == {"gpu-a"}
    cordon(api, "gpu-b", False)
    cordon(api, "gpu-a", True)
    api.create_namespaced_pod(NS, gpu_pod("f2", "6Gi"))
    make_replica()
    assert wait_bound(cp, api, ["f2"])["f2"] == "gpu-b"


def placed_by_a_move(cp: ControlPlane, api: kubernetes.client.CoreV1Api, moved: str) -> Any:
    """Create pod p (16Gi), which fits only once the web replica `moved` leaves gpu-b, and wait
    for p bound there and the replica's new copy bound on gpu-a: that copy."""
    api.create_namespaced_pod(NS, gpu_pod("p", "16Gi"))
    assert wait_bound(cp, api, ["p"], timeout=120)["p"] == "gpu-b"
    (new,) = cp.wait_for(
        lambda: [
            p
            for p in web_pods(api)
            if p.metadata.name != moved and p.spec.node_name and not p.metadata.deletion_timestamp
        ],
        timeout=60,
        message="the re-created web pod bound",
    )
    assert new.spec.node_name == "gpu-a"
    return new


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="build.sh builds no kube-controller-manager for 1.20")
@pytest.mark.parametrize("reach", ["both nodes", "its node"])
def test_repack_moves_a_pod_with_a_claim_only_where_its_volume_reaches(
    repack_stack: tuple[ControlPlane, Extender, PodLifecycle], reach: str
) -> None:
    """The fragmented GPUs of the first test, with the web replica on gpu-b mounting a claim
    bound to a local volume (gpu-a's second pod is a bare one). The only plan moves the replica
    to gpu-a. With the volume on both nodes (read with the shipped role), it moves and its new
    copy is bound on gpu-a; with the volume on gpu-b alone, nothing is evicted."""
    cp, ext, lifecycle = repack_stack
    api = core(cp)
    bound_claim(api, "web-cache", list(NODES) if reach == "both nodes" else ["gpu-b"])
    try:
        with cp.api_client() as client:
            apps = kubernetes.client.AppsV1Api(client)
            fill_around(
                cp,
                api,
                lambda: apps.create_namespaced_deployment(NS, web_deployment(1, claim="web-cache")),
            )
            (before,) = cp.wait_for(
                lambda: [p for p in web_pods(api) if p.spec.node_name == "gpu-b"],
                timeout=60,
                message="the web replica bound to gpu-b",
            )
            cordon(api, "gpu-a", False)
        if reach == "its node":
            _, refused = blocked_and_refused(cp, api, "that no plan is left")
            # read with the shipped role (a refused read would name the pod as left out)
            assert refused[0].endswith(
                "1 movable pod(s) may go to no other node by their node rules or volumes: "
                f"{NS}/{before.metadata.name}"
            ), refused
            assert [p.metadata.uid for p in web_pods(api)] == [before.metadata.uid]
            assert lifecycle.terminated == {}
            assert api.read_namespaced_pod("p", NS).spec.node_name is None
            repack = ext.get("/state")["planner"]["repack"]
            assert repack["moves"] == 0 and repack["none"] >= 1
            return
        new = placed_by_a_move(cp, api, before.metadata.name)
        assert new.spec.volumes[0].persistent_volume_claim.claim_name == "web-cache"
        assert set(lifecycle.terminated) == {before.metadata.name}
        assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    finally:
        drop_claim(api, "web-cache")


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="build.sh builds no kube-controller-manager for 1.20")
@pytest.mark.parametrize("limit", [2, 1])
def test_repack_keeps_a_moved_disk_within_the_targets_attach_limit(
    repack_stack: tuple[ControlPlane, Extender, PodLifecycle], limit: int
) -> None:
    """The claim test's scene with CSI disks: the web replica's on gpu-b, f1's on gpu-a, and
    gpu-a's CSINode takes `limit` disks of their driver (listed with the shipped role). Where it
    takes two, the replica moves and kube-scheduler binds its new copy on gpu-a; where it takes
    one, nothing is evicted and the waiting pod is told why."""
    cp, ext, lifecycle = repack_stack
    api = core(cp)
    bound_claim(api, "web-disk", [], disk=True)
    bound_claim(api, "f1-disk", [], disk=True)
    driver = {"name": DISK, "nodeID": "gpu-a", "allocatable": {"count": limit}}
    try:
        with cp.api_client() as client:
            storage = kubernetes.client.StorageV1Api(client)
            storage.create_csi_node({"metadata": {"name": "gpu-a"}, "spec": {"drivers": [driver]}})
            apps = kubernetes.client.AppsV1Api(client)
            fill_around(
                cp,
                api,
                lambda: apps.create_namespaced_deployment(NS, web_deployment(1, claim="web-disk")),
                f1_claim="f1-disk",
            )
            (before,) = cp.wait_for(
                lambda: [p for p in web_pods(api) if p.spec.node_name == "gpu-b"],
                timeout=60,
                message="the web replica bound to gpu-b",
            )
            cordon(api, "gpu-a", False)
            if limit == 1:
                _, refused = blocked_and_refused(cp, api, "that the disk may not move")
                name = f"{NS}/{before.metadata.name}"
                assert refused[0].endswith(
                    f"(left out: {name}: pod {name} may not move there: node gpu-a attaches at "
                    f"most 1 volume(s) of {DISK} and would hold 2)"
                ), refused
                assert [p.metadata.uid for p in web_pods(api)] == [before.metadata.uid]
                assert lifecycle.terminated == {}
                return
            placed_by_a_move(cp, api, before.metadata.name)
            assert set(lifecycle.terminated) == {before.metadata.name}
    finally:
        with cp.api_client() as client:
            kubernetes.client.StorageV1Api(client).delete_csi_node("gpu-a")
        drop_claim(api, "web-disk")
        drop_claim(api, "f1-disk")


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="build.sh builds no kube-controller-manager for 1.20")
def test_repack_moves_a_statefulset_pod_with_its_claim(
    repack_stack: tuple[ControlPlane, Extender, PodLifecycle],
) -> None:
    """The scene of the claim test with a StatefulSet's pod web-0 in the replica's place, its
    claim cache-web-0 (from the set's volumeClaimTemplates, made beforehand and bound to a local
    volume on both nodes). The StatefulSet re-creates web-0 under its own name once the evicted
    one is gone; vramsched holds gpu-a for it by that name, and it mounts the same claim there."""
    cp, ext, lifecycle = repack_stack
    api = core(cp)
    bound_claim(api, "cache-web-0", list(NODES))
    template = web_deployment(1, claim="unused")["spec"]["template"]
    template["spec"].pop("volumes")
    template["spec"]["containers"][0]["volumeMounts"] = [{"name": "cache", "mountPath": "/c"}]
    claim_template = {
        "metadata": {"name": "cache"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "local",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    with cp.api_client() as client:
        apps = kubernetes.client.AppsV1Api(client)
        try:
            web = {
                "metadata": {"name": "web"},
                "spec": {
                    "replicas": 1,
                    "serviceName": "web",
                    "selector": {"matchLabels": dict(APP)},
                    "template": template,
                    "volumeClaimTemplates": [claim_template],
                },
            }
            fill_around(cp, api, lambda: apps.create_namespaced_stateful_set(NS, web))
            assert wait_bound(cp, api, ["web-0"]) == {"web-0": "gpu-b"}
            before = api.read_namespaced_pod("web-0", NS)
            cordon(api, "gpu-a", False)

            api.create_namespaced_pod(NS, gpu_pod("p", "16Gi"))
            assert wait_bound(cp, api, ["p"], timeout=120)["p"] == "gpu-b"
            again = cp.wait_for(
                lambda: (
                    (q := api.read_namespaced_pod("web-0", NS)).metadata.uid != before.metadata.uid
                    and q.spec.node_name
                    and q
                ),
                timeout=60,
                message="web-0 re-created and bound",
            )
            assert again.spec.node_name == "gpu-a"
            assert assignment(again) == {
                "node": "gpu-a",
                "devices": ["0"],
                "bytesPerDevice": [4 * GIB],
            }
            (volume,) = [v for v in again.spec.volumes if v.persistent_volume_claim]
            assert volume.persistent_volume_claim.claim_name == "cache-web-0"
            assert set(lifecycle.terminated) == {"web-0"}
            state = cp.wait_for(
                lambda: (s := ext.get("/state")) and s["planner"]["repack"]["last"] and s,
                timeout=30,
                message="the repack plan ended",
            )
            last = state["planner"]["repack"]["last"]
            assert last["phase"] == "done", last
            assert last["moves"][0]["replacement"] == f"{NS}/web-0", last
            assert_sound(api, ReplicaPolicy.DISTRIBUTED)
        finally:
            apps.delete_namespaced_stateful_set("web", NS, propagation_policy="Foreground")
            cp.wait_for(
                lambda: not apps.list_namespaced_stateful_set(NS).items and not web_pods(api),
                timeout=60,
                message="the web StatefulSet and its pod deleted",
            )
            drop_claim(api, "cache-web-0")
