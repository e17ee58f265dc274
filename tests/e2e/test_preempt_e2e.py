"""vramsched's own preemption by VRAM (`vramsched serve --preempt`) on the real control plane.

The stack of test_repack_e2e without kube-controller-manager: kube-scheduler with the shipped
configuration, `vramsched serve --kubeconfig --preempt` as the deploy ServiceAccount with the
roles of deploy/rbac.yaml and deploy/repack/rbac.yaml (its Evictions), two time-sliced 24Gi
GPU nodes with 4 replicas each and `controller_manager.PodLifecycle` playing their kubelets.

A pod of high priority asks 16Gi where every GPU has 10Gi free and replicas left:
kube-scheduler's preemption, which dry-runs its in-tree filters only, finds no victim (on 1.36
its FailedScheduling event says `expected at least one victim pod on node ...`); vramsched evicts the pod of lowest priority
through the Eviction API and the pod is bound to the GPU it freed.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
from controller_manager import PodLifecycle
from controlplane import ControlPlane
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
from test_repack_e2e import _grant_repack_rbac, _revoke, assignment, events_of

from extender.inventory import ReplicaPolicy

GIB = 1 << 30
NODES = ("gpu-a", "gpu-b")
#: names of their own: other tests create (and keep) classes such as e2e-high
CLASSES = {"preempt-e2e-low": 10, "preempt-e2e-mid": 100, "preempt-e2e-high": 1000}


def priority_pod(name: str, memory: str, klass: str, node: str | None = None) -> dict[str, Any]:
    body = gpu_pod(name, memory)
    body["spec"]["priorityClassName"] = klass
    if node is not None:
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return body


@pytest.fixture
def preempt_stack(cluster: ControlPlane) -> Iterator[tuple[ControlPlane, Extender, PodLifecycle]]:
    kubeconfig = _grant_extender_rbac(cluster)
    _grant_lease_role(cluster)
    granted = _grant_repack_rbac(cluster)
    with cluster.api_client() as client:
        scheduling = kubernetes.client.SchedulingV1Api(client)
        for name, value in CLASSES.items():
            scheduling.create_priority_class({"metadata": {"name": name}, "value": value})
    for name in NODES:
        cluster.create_gpu_node(
            name,
            {**gpu_labels("NVIDIA-L4", 1, 24 * 1024, replicas=4), "kubernetes.io/hostname": name},
            {GPU: "4"},
        )
    ext = Extender(cluster, kubeconfig, ["--preempt"])
    ext.start()
    start_shipped_scheduler(cluster, ext.url)
    try:
        with PodLifecycle(cluster, NODES) as lifecycle:
            yield cluster, ext, lifecycle
    finally:
        ext.stop()
        _revoke(cluster, granted)
        with cluster.api_client() as client:
            scheduling = kubernetes.client.SchedulingV1Api(client)
            for name in CLASSES:
                try:
                    scheduling.delete_priority_class(name)
                except kubernetes.client.ApiException as exc:
                    if exc.status != 404:  # setup stopped before making it
                        raise


@pytest.mark.e2e
def test_a_pod_only_vram_keeps_out_preempts_the_lowest_priority_pod(
    preempt_stack: tuple[ControlPlane, Extender, PodLifecycle],
) -> None:
    cp, ext, lifecycle = preempt_stack
    api = core(cp)
    api.create_namespaced_pod(NS, priority_pod("low-a", "14Gi", "preempt-e2e-low", "gpu-a"))
    api.create_namespaced_pod(NS, priority_pod("mid-b", "14Gi", "preempt-e2e-mid", "gpu-b"))
    assert wait_bound(cp, api, ["low-a", "mid-b"]) == {"low-a": "gpu-a", "mid-b": "gpu-b"}
    mid_uid = api.read_namespaced_pod("mid-b", NS).metadata.uid
    low_uid = api.read_namespaced_pod("low-a", NS).metadata.uid

    api.create_namespaced_pod(NS, priority_pod("p", "16Gi", "preempt-e2e-high"))
    p_uid = api.read_namespaced_pod("p", NS).metadata.uid
    if cp.version.startswith("1.36"):
        # kube-scheduler's own preemption ran its in-tree dry run, which fits the pod with
        # nobody gone (replicas are left on both GPUs), and gave up
        failed = cp.wait_for(
            lambda: [
                e.message or ""
                for e in api.list_namespaced_event(
                    NS, field_selector=f"involvedObject.uid={p_uid}"
                ).items
                if e.reason == "FailedScheduling"
            ],
            timeout=60,
            message="kube-scheduler's FailedScheduling event on p",
        )
        assert "preemption: [expected at least one victim pod on node" in failed[0], failed
        for node in NODES:  # in either order: the dry run checks nodes in parallel
            assert f'expected at least one victim pod on node "{node}"' in failed[0], failed

    assert wait_bound(cp, api, ["p"], timeout=120)["p"] == "gpu-a"
    p = api.read_namespaced_pod("p", NS)
    assert assignment(p) == {"node": "gpu-a", "devices": ["0"], "bytesPerDevice": [16 * GIB]}

    # Only low-a went, evicted through the Eviction API; mid-b (priority 100) stays.
    assert set(lifecycle.terminated) == {"low-a"}, lifecycle.terminated
    assert lifecycle.terminated["low-a"].uid == low_uid
    if cp.version.startswith("1.36"):
        conditions = lifecycle.terminated["low-a"].conditions
        assert ("DisruptionTarget", "EvictionByEvictionAPI") in conditions, conditions
    assert api.read_namespaced_pod("mid-b", NS).metadata.uid == mid_uid
    cp.wait_for(
        lambda: "low-a" not in {q.metadata.name for q in api.list_namespaced_pod(NS).items},
        timeout=30,
        message="low-a gone",
    )

    (preempted,) = events_of(api, low_uid, "VramschedPreempted")
    assert "for pod default/p of priority 1000 (this pod: 10)" in preempted
    assert any(
        "preempted 1 pod(s) of lower priority (default/low-a)" in m
        for m in events_of(api, p_uid, "VramschedRepack")
    )
    state = cp.wait_for(
        lambda: (s := ext.get("/state")) and s["planner"]["repack"]["last"] and s,
        timeout=30,
        message="the preemption ended",
    )
    last = state["planner"]["repack"]["last"]
    assert last["phase"] == "done" and last["preempted"] == [f"{NS}/low-a"], last
    assert last["outcome"] == "blocked pod placed; 1 pod(s) preempted"
    assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    with urllib.request.urlopen(ext.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert "vramsched_preempted_pods_total 1.0" in metrics
