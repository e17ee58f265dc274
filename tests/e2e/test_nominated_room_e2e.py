"""The VRAM preemption frees is kept for the pod it was freed for, against a real kube-scheduler.

kube-scheduler preempts for a pod, sets its `status.nominatedNodeName` and, until it is bound,
counts it on that node against pods of lower priority, but only in its own filters: the
extender is not told. A lower-priority pod that comes while the preemptor's bind is in flight
passes kube-scheduler's replica count and reaches vramsched's filter; without the room kept for
the nominated pod (`placement.held_for_nominated`) it took the freed VRAM, and the preemptor's
bind then found none. The race is made certain, not left to timing: a recording proxy between
kube-scheduler and vramsched holds the preemptor's bind until the other pod's filter answered.
"""

from __future__ import annotations

import threading
from typing import Any

import kubernetes.client
import pytest
from controlplane import ControlPlane
from fake_extender import FakeExtender
from test_extender_e2e import (  # noqa: F401 - fixtures are used by name
    NS,
    Extender,
    add_node,
    assert_sound,
    core,
    extender_args,
    gpu_pod,
    proxied_vramsched,
    wait_bound,
)

from extender.inventory import ReplicaPolicy

NODE = "two-a100"
HIGH = "e2e-nominated-high"


def _pod(name: str, memory: str, *, gpus: int = 1, high: bool = False) -> dict[str, Any]:
    pod = gpu_pod(name, memory, gpus=gpus, pin=True)
    if high:
        pod["spec"]["priorityClassName"] = HIGH
    return pod


@pytest.mark.e2e
@pytest.mark.k8s("1.36", reason="1.20 never calls the preempt verb (kubernetes issue 102971)")
@pytest.mark.parametrize("extender_args", [["--replica-policy", "pinned"]])  # exact per-GPU books
def test_the_vram_preemption_freed_is_kept_for_the_preemptor(
    proxied_vramsched: tuple[ControlPlane, Extender, FakeExtender], extender_args: list[str]
) -> None:
    cp, _, proxy = proxied_vramsched
    api = core(cp)
    try:
        kubernetes.client.SchedulingV1Api(api.api_client).create_priority_class(
            {"metadata": {"name": HIGH}, "value": 1000}
        )
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
    # two 80 GiB GPUs, two replicas each: every replica taken, one GPU full and one at 40 GiB
    add_node(cp, NODE, "NVIDIA-A100-SXM4-80GB", count=2, memory_mib=81920, replicas=2)
    for name, memory, gpus, high in (
        ("nr-victim", "40Gi", 2, False),  # 20 GiB on each GPU
        ("nr-big", "60Gi", 1, True),  # fills one GPU
        ("nr-small", "20Gi", 1, True),  # the other GPU's last replica: 40 of its 80 GiB used
    ):
        api.create_namespaced_pod(NS, _pod(name, memory, gpus=gpus, high=high))
        wait_bound(cp, api, [name])

    # the preemptor's bind waits at the proxy until the lower-priority pod's filter has answered
    released = threading.Event()

    def bind(body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("PodName") == "nr-preemptor":
            released.wait(timeout=4)  # within the shipped httpTimeout (5 s)
        return proxy.forward("bind", body)

    proxy.handlers["bind"] = bind
    # 50 GiB fits only on the GPU at 40 GiB once the victim's 20 GiB there is gone
    api.create_namespaced_pod(NS, _pod("nr-preemptor", "50Gi", high=True))
    cp.wait_for(
        lambda: api.read_namespaced_pod("nr-victim", NS).metadata.deletion_timestamp,
        timeout=60,
        message="kube-scheduler evicts the victim",
    )
    assert api.read_namespaced_pod("nr-preemptor", NS).status.nominated_node_name == NODE
    api.delete_namespaced_pod("nr-victim", NS, grace_period_seconds=0)  # what kubelet would confirm
    cp.wait_for(
        lambda: proxy.calls_for("nr-preemptor", "bind"),
        timeout=60,
        message="the preemptor's bind reaches the proxy",
    )
    # Now the preemptor is assumed on the node by kube-scheduler but not yet bound: a 30 GiB pod
    # of lower priority passes kube-scheduler's replica count (one replica is left) and is asked
    # of vramsched. The freed GPU has 60 GiB free, 50 of them the preemptor's.
    api.create_namespaced_pod(NS, _pod("nr-light", "30Gi"))
    (answer,) = cp.wait_for(
        lambda: [c.answer for c in proxy.calls_for("nr-light", "filter") if c.status],
        timeout=30,
        message="vramsched's filter answers for the lower-priority pod",
    )[:1]
    released.set()
    assert answer["NodeNames"] == [] and NODE in answer["FailedNodes"], answer
    assert wait_bound(cp, api, ["nr-preemptor"], timeout=30) == {"nr-preemptor": NODE}
    (bind,) = proxy.calls_for("nr-preemptor", "bind")
    assert bind.answer == {"Error": ""}
    assert api.read_namespaced_pod("nr-light", NS).spec.node_name is None
    assert_sound(api, ReplicaPolicy.PINNED)
