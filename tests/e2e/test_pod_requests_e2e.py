"""vramsched counts a running pod's CPU, memory and GPUs as the real kube-scheduler does.

The ledger, the planner and repacking judge a node's free GPUs, CPU and memory from
`demand.pod_demand`; where it counts a running pod lower than kube-scheduler, they plan pods there
that kube-scheduler refuses. Each case binds one pod to a node of its own, writes the status a
kubelet would (an in-place resize of a container or of the whole pod, an infeasible one, a
RuntimeClass overhead, a sidecar, a finished pod, one being deleted), reads the pod back and sums
it as vramsched's informer would, and asks the real kube-scheduler:
a pod asking for exactly the rest of the node must be placed there, and one asking a unit more
must not. 1.36 only: 1.20 has neither in-place resize nor pod-level resources.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import kubernetes.client
import pytest
from controlplane import ControlPlane

from extender.cluster import ClusterState
from extender.demand import pod_demand

NS = "default"
SCHEDULER = "vramsched"
GPU = "nvidia.com/gpu"
#: each case's node: 8 cores, 8 GiB and 8 GPUs, so a probe asking the rest is a small number
ALLOCATABLE = {"cpu": 8000, "memory": 8 << 30, GPU: 8}
OVERHEAD = "half-core-overhead"


def _container(
    name: str = "app", cpu: str = "1", memory: str = "1Gi", gpus: int = 0
) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory}}
    if gpus:
        resources["limits"] = {GPU: str(gpus)}  # an extended resource's request defaults to it
    return {"name": name, "image": "busybox", "resources": resources}


def _sidecar(gpus: int) -> dict[str, Any]:
    return {**_container("proxy", cpu="100m", gpus=gpus), "restartPolicy": "Always"}


def _running(name: str = "app", *, allocated: str | None, running: str | None) -> dict[str, Any]:
    """A container status as the kubelet writes it, with CPU as allocated and as running."""
    status: dict[str, Any] = {
        "name": name,
        "image": "busybox",
        "imageID": "",
        "ready": True,
        "restartCount": 0,
        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
    }
    if allocated is not None:
        status["allocatedResources"] = {"cpu": allocated, "memory": "1Gi"}
    if running is not None:
        status["resources"] = {"requests": {"cpu": running, "memory": "1Gi"}}
    return status


INFEASIBLE = [{"type": "PodResizePending", "status": "True", "reason": "Infeasible"}]
POD_LEVEL = {"resources": {"requests": {"cpu": "2", "memory": "2Gi"}}}
STEADY = [_running(allocated="1", running="1")]


def _pod_resize(
    running: dict[str, Any] | None, allocated: dict[str, str], *, infeasible: bool = False
) -> dict[str, Any]:
    """A pod-level resize's status: the pod's running `resources` (None: not reported yet) and
    `allocatedResources`, its one container steady at 1 core."""
    status: dict[str, Any] = {"allocatedResources": allocated, "containerStatuses": STEADY}
    if running is not None:
        status["resources"] = running
    if infeasible:
        status["conditions"] = INFEASIBLE
    return status


#: (case, resource probed, spec fields beside one 1-core container, status written)
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any] | None]] = [
    ("plain", "cpu", {}, None),
    (
        "container-shrinking",
        "cpu",
        {},
        {"containerStatuses": [_running(allocated="3", running="3")]},
    ),
    (
        "container-allocated-not-running",
        "cpu",
        {},
        {"containerStatuses": [_running(allocated="4", running="2")]},
    ),
    (
        "container-infeasible",
        "cpu",
        {"containers": [_container(cpu="6")]},
        {"containerStatuses": [_running(allocated="3", running="2")], "conditions": INFEASIBLE},
    ),
    (
        "sidecar-shrinking",
        "cpu",
        {"initContainers": [{**_container("proxy", cpu="500m"), "restartPolicy": "Always"}]},
        {
            "containerStatuses": STEADY,
            "initContainerStatuses": [_running("proxy", allocated="2", running="2")],
        },
    ),
    (
        "overhead-shrinking",
        "cpu",
        {"runtimeClassName": OVERHEAD},
        {"containerStatuses": [_running(allocated="3", running="3")]},
    ),
    ("pod-level", "cpu", POD_LEVEL, None),
    (
        "pod-level-shrinking",
        "cpu",
        POD_LEVEL,
        _pod_resize({"requests": {"cpu": "5"}}, {"cpu": "4"}),
    ),
    (
        "pod-level-allocated-not-running",
        "cpu",
        POD_LEVEL,
        _pod_resize({"requests": {"cpu": "2500m"}}, {"cpu": "4"}),
    ),
    # no running size reported yet: the spec
    ("pod-level-allocated-only", "cpu", POD_LEVEL, _pod_resize(None, {"cpu": "4"})),
    (
        "pod-level-running-limits-only",
        "cpu",
        POD_LEVEL,
        _pod_resize({"limits": {"cpu": "7"}}, {"cpu": "4"}),
    ),
    (
        "pod-level-infeasible",
        "cpu",
        POD_LEVEL,
        _pod_resize({"requests": {"cpu": "1500m"}}, {"cpu": "1200m"}, infeasible=True),
    ),
    (
        "pod-level-overhead-shrinking",
        "cpu",
        {**POD_LEVEL, "runtimeClassName": OVERHEAD},
        _pod_resize({"requests": {"cpu": "3"}}, {"cpu": "3"}),
    ),
    (
        "pod-level-memory-only-cpu-in-status",  # the status sizes only what the spec sets
        "cpu",
        {"resources": {"requests": {"memory": "2Gi"}}},
        _pod_resize({"requests": {"cpu": "4"}}, {"cpu": "4"}),
    ),
    # a pod that finished holds nothing; one being deleted holds all until the kubelet stops it
    ("succeeded", "cpu", {}, {"phase": "Succeeded"}),
    ("terminating", "cpu", {"terminationGracePeriodSeconds": 3600}, None),
    # GPUs: never resized; containers, sidecars and init containers combine as for CPU
    ("gpu", GPU, {"containers": [_container(gpus=2)]}, None),
    (
        "gpu-sidecar",  # the kubelet keeps a sidecar's GPU while the app runs
        GPU,
        {"containers": [_container(gpus=1)], "initContainers": [_sidecar(1)]},
        None,
    ),
    (
        "gpu-init-then-app",  # a plain init container's GPUs go back before the app starts
        GPU,
        {"containers": [_container(gpus=1)], "initContainers": [_container("warmup", gpus=3)]},
        None,
    ),
    (
        "gpu-init-beside-sidecar",  # started after the sidecar, so it runs beside it
        GPU,
        {
            "containers": [_container(gpus=1)],
            "initContainers": [_sidecar(2), _container("warmup", gpus=4)],
        },
        None,
    ),
    (
        "pod-level-memory-shrinking",
        "memory",
        POD_LEVEL,
        _pod_resize({"requests": {"cpu": "2", "memory": "5Gi"}}, {"cpu": "2", "memory": "5Gi"}),
    ),
]


@pytest.fixture
def scheduler(cluster: ControlPlane) -> Iterator[ControlPlane]:
    """kube-scheduler with its in-tree plugins only, and the RuntimeClass the cases use."""
    cluster.start_scheduler(ControlPlane.scheduler_config(SCHEDULER))
    with cluster.api_client() as client:
        nodes = kubernetes.client.NodeV1Api(client)
        nodes.create_runtime_class(
            {
                "apiVersion": "node.k8s.io/v1",
                "kind": "RuntimeClass",
                "metadata": {"name": OVERHEAD},
                "handler": "runc",
                "overhead": {"podFixed": {"cpu": "500m", "memory": "0"}},
            }
        )
        try:
            yield cluster
        finally:
            nodes.delete_runtime_class(OVERHEAD)


def _probe_fits(cp: ControlPlane, node: str, name: str, resource: str, amount: int) -> bool:
    """Whether kube-scheduler places a pod asking `amount` of `resource` on `node` (and nothing
    of the other resource); the probe is deleted after."""
    core = cp.core_v1()
    quantity = f"{amount}m" if resource == "cpu" else str(amount)
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    core.create_namespaced_pod(
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "schedulerName": SCHEDULER,
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [term]
                        }
                    }
                },
                "containers": [
                    {
                        "name": "probe",
                        "image": "busybox",
                        "resources": {
                            "requests": {resource: quantity},
                            "limits": {resource: quantity},
                        }
                        if resource == GPU
                        else {"requests": {resource: quantity}},
                    }
                ],
            },
        },
    )

    def decided() -> bool | None:
        pod = core.read_namespaced_pod(name, NS)
        if pod.spec.node_name:
            return True
        for cond in pod.status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False":
                return False
        return None

    try:
        verdict = cp.wait_for(
            lambda: (v,) if (v := decided()) is not None else None,
            timeout=30,
            message=f"kube-scheduler's verdict on probe {name}",
        )
        return bool(verdict[0])
    finally:
        core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        cp.wait_for(
            lambda: name not in {p.metadata.name for p in core.list_namespaced_pod(NS).items},
            message=f"probe {name} deleted",
        )


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="in-place resize and pod-level resources came after 1.20")
def test_running_pods_count_as_kube_scheduler_counts_them(scheduler: ControlPlane) -> None:
    cp = scheduler
    core = cp.core_v1()
    api = cp.api_client()
    kept_status = 0
    for i, (case, resource, spec_extra, status) in enumerate(CASES):
        node = f"requests-{i}"
        cp.create_gpu_node(
            node, allocatable={k: str(v) for k, v in ALLOCATABLE.items()} | {"cpu": "8"}
        )
        spec = {"nodeName": node, "containers": [_container()], **spec_extra}
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"held-{i}"}, "spec": spec}
        core.create_namespaced_pod(NS, body)
        if status is not None:
            core.patch_namespaced_pod_status(f"held-{i}", NS, {"status": status})
        if case == "terminating":  # no kubelet confirms it: it stays terminating
            core.delete_namespaced_pod(f"held-{i}", NS, grace_period_seconds=3600)
        pod = api.sanitize_for_serialization(core.read_namespaced_pod(f"held-{i}", NS))
        got = pod.get("status") or {}
        if status is not None and all(k in got for k in status if k != "conditions"):
            kept_status += 1
        # CPU and memory as the informer's ClusterState sums them per node; GPUs as it books them
        state = ClusterState()
        state.upsert_node(api.sanitize_for_serialization(core.read_node(node)))
        state.upsert_pod(pod)
        ours = {
            "cpu": state.cpu_used.get(node, 0),
            "memory": state.memory_used.get(node, 0),
            GPU: pod_demand(pod).gpu_count,
        }[resource]
        rest = ALLOCATABLE[resource] - ours
        assert rest > 0, case
        unit = 1 << 20 if resource == "memory" else 1
        # kube-scheduler's informer sees the status a moment after the write
        time.sleep(0.5)
        assert _probe_fits(cp, node, f"fits-{i}", resource, rest), (
            f"{case}: vramsched counts {ours} {resource}, kube-scheduler more"
        )
        assert not _probe_fits(cp, node, f"over-{i}", resource, rest + unit), (
            f"{case}: vramsched counts {ours} {resource}, kube-scheduler less"
        )
    # the API server kept every status written, so each case tested what it names
    assert kept_status == sum(1 for c in CASES if c[3] is not None)
