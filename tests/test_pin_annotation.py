"""The downward-API form of the GPU pin, and the bind event's wording.

A container that sets NVIDIA_VISIBLE_DEVICES from `metadata.annotations['vramsched.io/gpu-index']`
sees exactly the GPUs vramsched wrote there, or none when nothing was written: the pod is pinned
(accepted on pinned time-sliced GPUs) and must never land where no index is written.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from builders import cluster, gpu_node, mig_mixed_node, pod, service

from extender.bind_event import REASON, bind_event, bind_message
from extender.demand import PIN_FIELD_PATH, PodRef, pod_demand, reads_pin_annotation
from extender.inventory import ReplicaPolicy
from extender.ledger import Reservation
from extender.placement.pin_rule import annotation_pin_refusal

GIB = 1024**3
FROM_ANNOTATION = {
    "name": "NVIDIA_VISIBLE_DEVICES",
    "valueFrom": {"fieldRef": {"fieldPath": PIN_FIELD_PATH}},
}


def with_env(p: dict[str, Any], *env: dict[str, Any], container: int = 0) -> dict[str, Any]:
    p = copy.deepcopy(p)
    p["spec"]["containers"][container]["env"] = list(env)
    return p


def sidecar(
    p: dict[str, Any], *, gpu: bool = False, env: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    p = copy.deepcopy(p)
    c: dict[str, Any] = {"name": "sidecar", "image": "busybox", "env": env or []}
    if gpu:
        c["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    p["spec"]["containers"].append(c)
    return p


# ----- recognising the form ---------------------------------------------------------------------------


def test_the_downward_api_form_is_a_pinned_pod() -> None:
    p = with_env(pod("web", "12Gi"), FROM_ANNOTATION)
    assert PIN_FIELD_PATH == "metadata.annotations['vramsched.io/gpu-index']"
    assert reads_pin_annotation(p)
    d = pod_demand(p)
    assert d.pin_configmap and d.pin_annotation  # pinned mode accepts it on time-sliced GPUs


def test_the_configmap_form_is_pinned_but_not_annotation_bound() -> None:
    p = pod("web", "12Gi")
    p["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "vramsched-web"}}]
    d = pod_demand(p)
    assert d.pin_configmap and not d.pin_annotation


@pytest.mark.parametrize(
    "env",
    [
        [],
        [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}],
        # kubelet only understands single quotes in a subscripted field path
        [
            {
                "name": "NVIDIA_VISIBLE_DEVICES",
                "valueFrom": {
                    "fieldRef": {"fieldPath": 'metadata.annotations["vramsched.io/gpu-index"]'}
                },
            }
        ],
        [
            {
                "name": "NVIDIA_VISIBLE_DEVICES",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['vramsched.io/assignment']"}
                },
            }
        ],
        [{"name": "GPU_INDEX", "valueFrom": {"fieldRef": {"fieldPath": PIN_FIELD_PATH}}}],
        # the last entry of a name wins in kubelet: a later literal overrides the reference
        [FROM_ANNOTATION, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
    ],
    ids=["none", "literal", "double-quotes", "other-annotation", "other-variable", "overridden"],
)
def test_anything_else_is_not_the_downward_api_pin(env: list[dict[str, Any]]) -> None:
    p = with_env(pod("web", "12Gi"), *env)
    assert not reads_pin_annotation(p)
    assert not pod_demand(p).pin_annotation and not pod_demand(p).pin_configmap


def test_every_gpu_container_must_read_the_annotation() -> None:
    base = with_env(pod("web", "12Gi"), FROM_ANNOTATION)
    # A GPU-less sidecar without it changes nothing ...
    assert reads_pin_annotation(sidecar(base))
    # ... a second GPU container without it would run on the device plugin's choice.
    assert not reads_pin_annotation(sidecar(base, gpu=True))
    assert reads_pin_annotation(sidecar(base, gpu=True, env=[FROM_ANNOTATION]))
    # Only a sidecar reading it: the GPU container is not pinned.
    assert not reads_pin_annotation(sidecar(pod("web", "12Gi"), env=[FROM_ANNOTATION]))
    # A GPU init container counts too.
    init = copy.deepcopy(base)
    init["spec"]["initContainers"] = [
        {"name": "warm", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    ]
    assert not reads_pin_annotation(init)


# ----- where such a pod may go -----------------------------------------------------------------------


def devices(node: dict[str, Any]) -> list[Any]:
    c = cluster(node)
    return list(c.ledger.node(node["metadata"]["name"]).devices)


def test_only_pinned_whole_time_sliced_gpus_take_it() -> None:
    ts = devices(gpu_node("ts", count=2, memory_mib=23034, replicas=4))
    exclusive = devices(gpu_node("whole", count=2))
    mps = devices(gpu_node("mps", count=1, replicas=4, strategy="mps"))
    mig = devices(mig_mixed_node("mig", {"1g.10gb": (7, 9856)}))
    pinned = ReplicaPolicy.PINNED
    assert annotation_pin_refusal(ts, "nvidia.com/gpu", pinned) is None
    assert annotation_pin_refusal(ts, "nvidia.com/gpu", "pinned") is None
    for devs, resource in (
        (exclusive, "nvidia.com/gpu"),
        (mps, "nvidia.com/gpu"),
        (mig, "nvidia.com/mig-1g.10gb"),
    ):
        assert "cannot be pinned" in (annotation_pin_refusal(devs, resource, pinned) or ""), (
            resource
        )
    for policy in (None, ReplicaPolicy.DISTRIBUTED, ReplicaPolicy.PACKED):
        assert "only with --replica-policy pinned" in (
            annotation_pin_refusal(ts, "nvidia.com/gpu", policy) or ""
        )


def test_filter_and_preemption_apply_the_rule_in_every_mode() -> None:
    """The rule is placement's, not an adapter's: the embedded server (and anything else calling
    the core) keeps such a pod off nodes that cannot pin it, as live mode does."""
    from extender.placement import filter_nodes, preempt_victims
    from extender.placement.pin_rule import unpinnable
    from extender.wire import ExtenderArgs

    web = with_env(pod("web", "12Gi"), FROM_ANNOTATION)
    nodes = (gpu_node("ts", count=2, memory_mib=23034, replicas=4), gpu_node("whole", count=1))
    c = cluster(*nodes, web)
    demand = pod_demand(web)
    svc = service(c)  # embedded: EmbeddedBinder, no API server
    # no policy (a cluster file's exact books): no index is ever written, so no node will do
    out = svc.filter(ExtenderArgs(Pod=web, NodeNames=["ts", "whole"]))
    assert out.NodeNames == [] and set(out.FailedAndUnresolvableNodes) == {"ts", "whole"}
    assert all("--replica-policy pinned" in m for m in out.FailedAndUnresolvableNodes.values())
    c = cluster(*nodes, web, replica_policy=ReplicaPolicy.PINNED)  # `serve --replica-policy pinned`
    svc = service(c)
    out = svc.filter(ExtenderArgs(Pod=web, NodeNames=["ts", "whole"]))
    assert out.NodeNames == ["ts"]
    explained = filter_nodes(c.ledger, demand, ["ts", "whole"], explain_all=True)
    assert explained.feasible == ["ts"]
    assert "cannot be pinned" in explained.unresolvable["whole"]
    assert unpinnable(c.ledger, demand, ["ts", "whole"]) == {
        "whole": explained.unresolvable["whole"]
    }
    # the same pod without the env var may use the exclusive GPU (and takes no pin, so not the
    # pinned ones): the rule is the pod's form
    plain = pod_demand(pod("plain", "12Gi"))
    assert filter_nodes(c.ledger, plain, ["ts", "whole"]).feasible == ["whole"]
    assert unpinnable(c.ledger, plain, ["ts", "whole"]) == {}
    # preemption evicts no one where the pod could not be pinned
    victim = pod("victim", "70Gi", node="whole", priority=0)
    c.upsert_pod(victim)
    urgent = pod_demand(with_env(pod("urgent", "70Gi", priority=100), FROM_ANNOTATION))
    uids = {"whole": [victim["metadata"]["uid"]]}
    assert preempt_victims(c.ledger, urgent, uids) == {}
    assert preempt_victims(c.ledger, pod_demand(pod("u2", "70Gi", priority=100)), uids) == uids


# ----- the bind event ---------------------------------------------------------------------------------


def reserve(
    c: Any,
    key: str,
    node: str,
    devs: tuple[str, ...],
    sizes: tuple[int, ...],
    declared: bool = True,
) -> Reservation:
    ns, name = key.split("/")
    return c.ledger.reserve(
        Reservation(PodRef(ns, name, f"uid-{name}"), node, devs, sizes, declared=declared)
    )


def test_messages_say_what_is_reserved_and_how_full_the_device_is() -> None:
    c = cluster(
        gpu_node("ts", count=2, memory_mib=81920, replicas=4),
        gpu_node("mps", count=1, replicas=4, strategy="mps"),
        gpu_node("x", count=4),
        mig_mixed_node("mig", {"1g.10gb": (7, 9856)}),
        replica_policy="pinned",
    )
    reserve(c, "default/a", "ts", ("1",), (8 * GIB,))
    b = reserve(c, "default/b", "ts", ("1",), (16 * GIB,))
    assert (
        bind_message(c.ledger, b, pinned=True)
        == "reserved 16Gi on GPU 1 of ts (time-slicing, 2/4 replicas, pinned)"
    )
    assert bind_message(c.ledger, b, pinned=False) == (
        "reserved 16Gi on a GPU of ts (time-slicing, 2/4 replicas, counted on GPU 1; the device plugin picks the GPU)"
    )
    m = reserve(c, "default/m", "mps", ("0",), (10 * GIB,))
    assert bind_message(c.ledger, m, pinned=False) == (
        "reserved 10Gi on a GPU of mps (MPS, 1/4 clients, counted on GPU 0; the device plugin picks the GPU)"
    )
    two = reserve(c, "default/two", "x", ("0", "2"), (40 * GIB, 40 * GIB))
    assert bind_message(c.ledger, two, pinned=False) == (
        "reserved 2x40Gi on 2 GPUs of x (exclusive, counted on GPUs 0,2; the device plugin picks the GPUs)"
    )
    whole = reserve(c, "default/w", "x", ("1",), (80 * GIB,), declared=False)
    assert bind_message(c.ledger, whole, pinned=False).startswith(
        "reserved 80Gi (whole device, no model-memory declared) on a GPU of x"
    )
    slice_id = next(d.device_id for d in c.ledger.node("mig").devices)
    s = reserve(c, "default/s", "mig", (slice_id,), (8 * GIB,))
    assert (
        bind_message(c.ledger, s, pinned=False)
        == f"reserved 8Gi on MIG slice 1g.10gb of mig (isolated memory, counted on {slice_id})"
    )


def test_the_event_is_a_core_v1_event_on_the_pod() -> None:
    ref = PodRef("team-a", "web-7f9c-x2", "uid-1")
    body = bind_event(
        ref, "reserved 16Gi on GPU 1 of n", now=1_800_000_000.25, instance="vramsched-abc"
    )
    assert body["apiVersion"] == "v1" and body["kind"] == "Event"
    assert body["metadata"] == {
        "name": f"web-7f9c-x2.{int(1_800_000_000.25 * 1e9):x}",
        "namespace": "team-a",
    }
    assert body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "team-a",
        "name": "web-7f9c-x2",
        "uid": "uid-1",
    }
    assert (body["reason"], body["type"], body["count"]) == (REASON, "Normal", 1)
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2027-01-15T08:00:00Z"
    assert body["reportingInstance"] == "vramsched-abc"
    long = bind_event(PodRef("ns", "p" * 253, ""), "m" * 5000, now=1.0)
    assert len(long["metadata"]["name"]) <= 253 and len(long["message"]) == 1024
    assert "uid" not in long["involvedObject"]
