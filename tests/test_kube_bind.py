"""KubeBinder and the live bind path against a scripted API: order of writes, idempotent retries,
rollback, assumed holds and their expiry, the pinning ConfigMap and its downward-API form, the
bind events (queued, never delaying or failing a bind), and no lock across API calls."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import orjson
from builders import assigned, gpu_node, pod
from kube_fakes import FakeApi

from extender.cluster import ClusterState
from extender.demand import ASSIGNMENT, GPU_INDEX, MODEL_MEMORY, PIN_FIELD_PATH
from extender.inventory import ReplicaPolicy
from extender.ledger import check_invariant
from extender.live.api_client import ApiError
from extender.live.events import EventRecorder
from extender.live.gate import SyncGate, live_service
from extender.live.source import LiveSource
from extender.placement.pin_rule import PIN_MISSING
from extender.server import METRICS_KEY, create_app
from extender.wire import ExtenderArgs, ExtenderBindingArgs, ExtenderPreemptionArgs

GIB = 1024**3


def pinned_pod(name: str, memory: str) -> dict[str, Any]:
    p = pod(name, memory)
    p["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": f"vramsched-{name}"}}]
    return p


def downward_pod(name: str, memory: str, **kw: Any) -> dict[str, Any]:
    """The Deployment-friendly pin: NVIDIA_VISIBLE_DEVICES from the gpu-index annotation."""
    p = pod(name, memory, **kw)
    p["spec"]["containers"][0]["env"] = [
        {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {"fieldPath": PIN_FIELD_PATH}}}
    ]
    return p


def live(
    nodes: list[dict[str, Any]], pods: list[dict[str, Any]], **kw: Any
) -> tuple[SyncGate, FakeApi, ClusterState]:
    """A synced live service whose API is the fake; the pods exist in both."""
    api = FakeApi()
    c = ClusterState(replica_policy=kw.pop("replica_policy", ReplicaPolicy.DISTRIBUTED))
    src = LiveSource(c, api=api, **kw)
    src.apply("nodes", "replace", nodes)
    src.apply("pods", "replace", pods)
    for p in pods:
        api.add_pod(p)
    return live_service(c, src, assume_ttl=kw.pop("assume_ttl", 60.0)), api, c


def bind_args(p: dict[str, Any], node: str) -> ExtenderBindingArgs:
    return ExtenderBindingArgs(
        PodName=p["metadata"]["name"],
        PodNamespace="default",
        PodUID=p["metadata"]["uid"],
        Node=node,
    )


def filter_args(p: dict[str, Any], nodes: list[str]) -> ExtenderArgs:
    return ExtenderArgs.model_validate({"Pod": p, "NodeNames": nodes})


async def test_annotations_are_written_before_the_binding() -> None:
    p = pod("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    result = await service.bind(bind_args(p, "n1"))
    assert result.Error == ""
    assert api.writes() == ["patch_pod", "create_binding"]
    patch = api.calls[0][3]
    assert (
        patch["metadata"]["uid"] == p["metadata"]["uid"]
    )  # precondition: never annotate a re-created pod
    assignment = orjson.loads(patch["metadata"]["annotations"][ASSIGNMENT])
    assert assignment["node"] == "n1" and assignment["bytesPerDevice"] == [30 * GIB]
    # The device plugin picks the physical GPU: no index is claimed (and a stale one is removed).
    assert patch["metadata"]["annotations"][GPU_INDEX] is None
    binding = api.calls[1][3]
    assert binding["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    assert binding["metadata"]["uid"] == p["metadata"]["uid"]
    assert api.pods["default/p"]["spec"]["nodeName"] == "n1"
    held = c.ledger.reservation("default/p")
    assert held is not None and held.assumed  # until the watch shows the binding


async def test_a_retried_bind_whose_binding_landed_succeeds_once() -> None:
    """kube-scheduler timed out and calls bind again: the 409 from the API is a success."""
    p = pod("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    assert (await service.bind(bind_args(p, "n1"))).Error == ""
    again = await service.bind(bind_args(p, "n1"))  # the watch has not shown the binding yet
    assert again.Error == ""
    assert [w for w in api.writes() if w == "create_binding"] == [
        "create_binding",
        "create_binding",
    ]
    assert ("read_pod", "default", "p") in api.calls
    assert len(list(c.ledger.reservations())) == 1
    assert check_invariant(c.ledger) == []


async def test_a_binding_conflict_with_another_node_is_an_error() -> None:
    p = pod("p", "30Gi")
    service, api, c = live([gpu_node("n1"), gpu_node("n2")], [p])
    api.pods["default/p"]["spec"]["nodeName"] = "n2"  # someone else bound it meanwhile
    result = await service.bind(bind_args(p, "n1"))
    assert "already bound to n2" in result.Error
    assert c.ledger.reservation("default/p") is None  # our hold on n1 is rolled back


async def test_an_uncertain_binding_keeps_the_assumed_hold_and_the_retry_confirms_it() -> None:
    p, other = pod("p", "60Gi"), pod("other", "60Gi")
    service, api, c = live([gpu_node("n1", count=1)], [p, other])

    def lands_then_times_out() -> None:  # the Binding is written but the answer never comes
        api.pods["default/p"]["spec"]["nodeName"] = "n1"
        raise ApiError(0, "ReadTimeoutError", "read timed out")

    api.fail["create_binding"] = [lands_then_times_out]
    first = await service.bind(bind_args(p, "n1"))
    assert "may not have landed" in first.Error
    held = c.ledger.reservation("default/p")
    assert held is not None and held.assumed
    # Meanwhile the next pod's filter already sees the GPU as taken: no double booking.
    refused = service.filter(filter_args(other, ["n1"]))
    assert refused.NodeNames == [] and "n1" in refused.FailedNodes
    retry = await service.bind(bind_args(p, "n1"))
    assert retry.Error == ""
    assert len(list(c.ledger.reservations())) == 1


async def test_a_definite_failure_rolls_back_and_removes_the_annotation() -> None:
    p = pod("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    api.fail["create_binding"] = [
        ApiError(403, "Forbidden", 'cannot create resource "pods/binding"')
    ]
    result = await service.bind(bind_args(p, "n1"))
    assert "forbidden by RBAC" in result.Error
    assert c.ledger.reservation("default/p") is None
    assert ASSIGNMENT not in api.pods["default/p"]["metadata"]["annotations"]
    assert api.writes() == ["patch_pod", "create_binding", "patch_pod"]


async def test_a_rollback_never_touches_a_pod_created_again_under_the_name() -> None:
    """The Binding fails for good after the pod was deleted and created again under its name
    (a StatefulSet's next pod), whose own bind wrote its assignment: the rollback, a patch by
    name, once removed that assignment, and the device plugin then refused the new pod."""
    p = pod("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    again = pod("p", "10Gi", uid="again")
    theirs = orjson.dumps({"node": "n1", "devices": ["2"], "bytesPerDevice": 10 * GIB}).decode()
    again["metadata"]["annotations"][ASSIGNMENT] = theirs

    def created_again_then_refused() -> None:
        api.pods["default/p"] = again
        raise ApiError(403, "Forbidden", 'cannot create resource "pods/binding"')

    api.fail["create_binding"] = [created_again_then_refused]
    result = await service.bind(bind_args(p, "n1"))
    assert "forbidden by RBAC" in result.Error
    assert api.pods["default/p"]["metadata"]["annotations"][ASSIGNMENT] == theirs
    assert c.ledger.reservation("default/p") is None


def versioned(name: str, memory: str) -> dict[str, Any]:
    """A pod as the API server and the watch hand it out: with a resourceVersion."""
    p = pod(name, memory)
    p["metadata"]["resourceVersion"] = "7"
    return p


async def test_a_pod_edited_after_bind_read_it_is_refused_before_anything_is_written() -> None:
    """The edit (30Gi to 70Gi) reaches the API after the watch copy bind books: the annotation
    patch names the version booked, the API refuses it, and bind reads the pod again."""
    p = versioned("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    api.edit_pod("default", "p", {MODEL_MEMORY: "70Gi"})
    result = await service.bind(bind_args(p, "n1"))
    assert "changed while being bound" in result.Error
    assert "(30Gi each), it now asks 1x nvidia.com/gpu (70Gi each)" in result.Error
    assert api.calls[0][3]["metadata"]["resourceVersion"] == "7"
    assert api.writes() == ["patch_pod"]  # refused: no assignment, no Binding
    assert ASSIGNMENT not in api.pods["default/p"]["metadata"]["annotations"]
    assert "nodeName" not in api.pods["default/p"]["spec"]
    assert c.ledger.reservation("default/p") is None and check_invariant(c.ledger) == []


async def test_a_pod_edited_between_its_annotation_and_its_binding_is_not_bound() -> None:
    p = versioned("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    api.fail["create_binding"] = [lambda: api.edit_pod("default", "p", {MODEL_MEMORY: "70Gi"})]
    result = await service.bind(bind_args(p, "n1"))
    assert "changed while being bound" in result.Error
    binding = api.calls[1][3]
    assert binding["metadata"]["resourceVersion"] == "8"  # the annotated version
    assert api.writes() == ["patch_pod", "create_binding", "patch_pod"]
    stored = api.pods["default/p"]
    assert "nodeName" not in stored["spec"]
    assert ASSIGNMENT not in stored["metadata"]["annotations"]  # the stale assignment removed
    assert stored["metadata"]["annotations"][MODEL_MEMORY] == "70Gi"
    assert c.ledger.reservation("default/p") is None and check_invariant(c.ledger) == []


async def test_an_update_that_leaves_the_gpu_ask_alone_is_written_again_and_bound() -> None:
    """A label or status update between bind's read and each write: same ask, so bind reads the
    new version and writes again, to it."""
    p = versioned("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    api.edit_pod("default", "p", {"team": "search"})
    api.fail["create_binding"] = [lambda: api.edit_pod("default", "p", {"owner": "x"})]
    result = await service.bind(bind_args(p, "n1"))
    assert result.Error == ""
    assert api.writes() == ["patch_pod", "patch_pod", "create_binding", "create_binding"]
    assert [
        call[3]["metadata"]["resourceVersion"] for call in api.calls if call[0] != "read_pod"
    ] == [
        "7",
        "8",
        "9",
        "10",
    ]
    stored = api.pods["default/p"]
    assert stored["spec"]["nodeName"] == "n1"
    assert orjson.loads(stored["metadata"]["annotations"][ASSIGNMENT])["bytesPerDevice"] == [
        30 * GIB
    ]
    held = c.ledger.reservation("default/p")
    assert held is not None and held.total_bytes == 30 * GIB


async def test_a_pod_that_keeps_changing_is_refused_after_a_few_writes() -> None:
    p = versioned("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    api.fail["patch_pod"] = [lambda: api.edit_pod("default", "p", {"n": str(i)}) for i in range(3)]
    result = await service.bind(bind_args(p, "n1"))
    assert "kept changing while being bound" in result.Error
    assert api.writes() == ["patch_pod"] * 3
    assert ASSIGNMENT not in api.pods["default/p"]["metadata"]["annotations"]
    assert c.ledger.reservation("default/p") is None


async def test_a_retried_bind_from_a_stale_copy_finds_its_binding_landed() -> None:
    """kube-scheduler retries a bind whose Binding landed before the watch shows it: the copy
    bind reads is the version before its own writes, and the pod bound with these devices is
    the success it reports, without writing again."""
    p = versioned("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    assert (await service.bind(bind_args(p, "n1"))).Error == ""
    again = await service.bind(bind_args(p, "n1"))
    assert again.Error == ""
    assert api.writes() == ["patch_pod", "create_binding", "patch_pod"]  # the second refused
    assert len(list(c.ledger.reservations())) == 1 and check_invariant(c.ledger) == []


async def test_a_deleted_pod_fails_the_bind_cleanly() -> None:
    p = pod("p", "30Gi")
    service, api, c = live([gpu_node("n1")], [p])
    del api.pods["default/p"]
    result = await service.bind(bind_args(p, "n1"))
    assert "no longer exists" in result.Error
    assert c.ledger.reservation("default/p") is None and api.writes() == ["patch_pod"]


async def test_only_holds_of_unsettled_binds_expire_after_their_ttl() -> None:
    """A bind whose outcome is unknown holds its GPU for the TTL; one the API accepted holds it
    until the watch shows the pod (or a relist shows it gone), however late that is."""
    a, b, u = pod("a", "60Gi"), pod("b", "60Gi"), pod("u", "60Gi")
    service, api, c = live(
        [gpu_node("n1", count=1), gpu_node("n2", count=1), gpu_node("n3", count=1)], [a, b, u]
    )
    assert (await service.bind(bind_args(a, "n1"))).Error == ""
    assert (await service.bind(bind_args(b, "n2"))).Error == ""
    api.fail["create_binding"] = [ApiError(504, "Timeout", "etcd request timed out")]
    assert "may not have landed" in (await service.bind(bind_args(u, "n3"))).Error
    c.upsert_pod(api.pods["default/b"])  # the watch shows b bound; a and u not yet
    assert c.ledger.reservation("default/a").assumed and c.ledger.reservation("default/u").assumed
    assert c.ledger.expire(now=time.monotonic() + 30) == []  # within the TTL (60 s)
    expired = c.ledger.expire(now=time.monotonic() + 61)
    assert [r.key for r in expired] == ["default/u"]
    assert {r.key for r in c.ledger.reservations()} == {"default/a", "default/b"}
    assert not c.ledger.reservation("default/b").assumed
    # A relist without a (deleted meanwhile) releases its hold.
    service.source.apply("pods", "replace", [api.pods["default/b"]])
    assert {r.key for r in c.ledger.reservations()} == {"default/b"}


async def test_binds_do_not_hold_a_lock_across_api_calls() -> None:
    """A Binding stuck in the API does not stop another pod's bind (or filter) from finishing."""
    slow, fast = pod("slow", "10Gi"), pod("fast", "10Gi")
    service, api, c = live([gpu_node("n1"), gpu_node("n2")], [slow, fast])
    release = threading.Event()
    api.fail["create_binding"] = [lambda: release.wait(10)]
    stuck = asyncio.create_task(service.bind(bind_args(slow, "n1")))
    await asyncio.sleep(0.05)
    done = await asyncio.wait_for(service.bind(bind_args(fast, "n2")), timeout=5)
    assert done.Error == "" and not stuck.done()
    assert service.filter(filter_args(pod("x", "10Gi"), ["n1", "n2"])).NodeNames == ["n1", "n2"]
    release.set()
    assert (await stuck).Error == ""


async def test_pinned_policy_writes_a_configmap_owned_by_the_pod() -> None:
    p = pinned_pod("p", "12Gi")
    node = gpu_node("ts", count=2, memory_mib=23034, replicas=4)
    service, api, c = live([node], [p], replica_policy="pinned")
    assert (await service.bind(bind_args(p, "ts"))).Error == ""
    assert api.writes() == ["patch_pod", "create_configmap", "create_binding"]
    cm = api.configmaps["default/vramsched-p"]
    index = api.pods["default/p"]["metadata"]["annotations"][GPU_INDEX]
    assert cm["data"] == {"NVIDIA_VISIBLE_DEVICES": index, "VRAMSCHED_PINNED": "true"}
    assert cm["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": p["metadata"]["uid"]}
    ]
    # A retry finds its own ConfigMap: fine. Someone else's: refused.
    assert (await service.bind(bind_args(p, "ts"))).Error == ""
    q = pinned_pod("q", "4Gi")
    api.add_pod(q)
    c.upsert_pod(q)
    api.configmaps["default/vramsched-q"] = {
        "metadata": {"name": "vramsched-q", "ownerReferences": [{"uid": "older-q"}]},
        "data": {},
    }
    result = await service.bind(bind_args(q, "ts"))
    assert "belongs to another pod" in result.Error and c.ledger.reservation("default/q") is None


async def test_a_bind_after_one_that_did_not_land_repins_the_pods_own_configmap() -> None:
    """A Binding refused for good leaves the pod's ConfigMap naming that bind's GPU (the pod
    owns it; nothing deletes it). The next bind, to another GPU, points it at that GPU: refused
    instead, the pod could never bind anywhere but the first GPU. A ConfigMap changed meanwhile
    (another resourceVersion) is not overwritten."""
    p = pinned_pod("p", "12Gi")
    node = gpu_node("ts", count=2, memory_mib=23034, replicas=4)
    service, api, c = live([node], [p], replica_policy="pinned")
    api.fail["create_binding"] = [ApiError(422, "Invalid", "denied by a policy webhook")]
    assert "rejected: 422" in (await service.bind(bind_args(p, "ts"))).Error
    first = api.configmaps["default/vramsched-p"]["data"]["NVIDIA_VISIBLE_DEVICES"]
    other = pod("o", "15Gi", node="ts", uid="o", annotations=assigned("ts", first, 15))
    api.add_pod(other)
    service.source.apply("pods", "ADDED", other)  # that GPU is no longer the best fit
    api.fail["patch_configmap"] = [ApiError(409, "Conflict", "the object has been modified")]
    refused = await service.bind(bind_args(p, "ts"))
    assert "cannot update ConfigMap vramsched-p" in refused.Error
    assert c.ledger.reservation("default/p") is None
    assert ASSIGNMENT not in api.pods["default/p"]["metadata"]["annotations"]  # nor left behind
    assert (await service.bind(bind_args(p, "ts"))).Error == ""
    index = api.pods["default/p"]["metadata"]["annotations"][GPU_INDEX]
    assert index != first
    assert api.configmaps["default/vramsched-p"]["data"] == {
        "NVIDIA_VISIBLE_DEVICES": index,
        "VRAMSCHED_PINNED": "true",
    }
    assert api.pods["default/p"]["spec"]["nodeName"] == "ts"


async def test_without_pinning_a_referenced_configmap_still_exists_but_pins_nothing() -> None:
    p = pinned_pod("p", "12Gi")
    node = gpu_node("ts", count=2, memory_mib=23034, replicas=4)
    service, api, c = live([node], [p])  # default: the device plugin (distributed) picks
    assert (await service.bind(bind_args(p, "ts"))).Error == ""
    assert api.configmaps["default/vramsched-p"]["data"] == {"VRAMSCHED_PINNED": "false"}
    assert GPU_INDEX not in api.pods["default/p"]["metadata"]["annotations"]


async def test_pinned_policy_refuses_time_sliced_nodes_to_pods_that_cannot_be_pinned() -> None:
    plain = pod("plain", "4Gi")
    service, api, c = live(
        [gpu_node("ts", count=2, memory_mib=23034, replicas=4), gpu_node("whole", count=1)],
        [plain],
        replica_policy="pinned",
    )
    result = service.filter(filter_args(plain, ["ts", "whole"]))
    assert result.NodeNames == ["whole"]  # an exclusive GPU's identity does not matter
    assert (
        result.FailedNodes == result.FailedAndUnresolvableNodes == {}
    )  # a node passes: no reasons by default
    service.service.explain_all = True
    result = service.filter(filter_args(plain, ["ts", "whole"]))
    assert result.NodeNames == ["whole"]
    assert result.FailedAndUnresolvableNodes == {"ts": PIN_MISSING}
    assert (
        "envFrom ConfigMap vramsched-<pod-name>" in PIN_MISSING
        and "vramsched.io/gpu-index" in PIN_MISSING
    )


async def test_when_the_pin_rule_leaves_no_node_every_refused_node_is_explained() -> None:
    """The core found a node (so, by default, worked out no reasons), the downward-API pin rule
    then took it: no node is left, so kube-scheduler reads the reasons, and each refused node
    needs one."""
    p = downward_pod("web-1", "12Gi")
    nodes = [gpu_node("whole", count=1), gpu_node("small", count=2, memory_mib=8192, replicas=4)]
    service, api, c = live(nodes, [p], replica_policy="pinned")
    result = service.filter(filter_args(p, ["whole", "small"]))
    assert result.NodeNames == []
    assert "cannot be pinned" in result.FailedAndUnresolvableNodes["whole"]
    assert "need 12Gi per GPU" in result.FailedAndUnresolvableNodes["small"]
    assert (
        result.FailedNodes == result.FailedAndUnresolvableNodes
    )  # kube-scheduler < 1.21 reads this one


async def test_a_pod_the_watch_has_not_delivered_yet_is_read_from_the_api() -> None:
    p = pod("fresh", "30Gi")
    service, api, c = live([gpu_node("n1")], [])
    api.add_pod(p)  # created and scheduled before our pod watch delivered it
    assert (await service.bind(bind_args(p, "n1"))).Error == ""
    assert api.calls[0] == ("read_pod", "default", "fresh")
    assert api.pods["default/fresh"]["spec"]["nodeName"] == "n1"
    assert c.ledger.reservation("default/fresh") is not None
    gone = pod("gone", "1Gi")
    assert (
        "unknown to vramsched and unreadable (404"
        in (await service.bind(bind_args(gone, "n1"))).Error
    )


# ----- the downward-API pin: NVIDIA_VISIBLE_DEVICES from the gpu-index annotation -------------------


async def test_pinned_policy_takes_a_downward_api_pod_on_time_sliced_gpus_and_annotates_before_binding() -> (
    None
):
    p = downward_pod("web-7f9c-x2", "12Gi")
    node = gpu_node("ts", count=2, memory_mib=23034, replicas=4)
    service, api, c = live([node], [p], replica_policy="pinned")
    assert service.filter(filter_args(p, ["ts"])).NodeNames == ["ts"]
    assert (await service.bind(bind_args(p, "ts"))).Error == ""
    # No ConfigMap: the annotation is the hand-off, written by the patch that precedes the Binding.
    assert api.writes() == ["patch_pod", "create_binding"] and api.configmaps == {}
    index = api.calls[0][3]["metadata"]["annotations"][GPU_INDEX]
    assignment = orjson.loads(api.calls[0][3]["metadata"]["annotations"][ASSIGNMENT])
    assert index == ",".join(assignment["devices"]) and index in {"0", "1"}
    assert api.pods["default/web-7f9c-x2"]["metadata"]["annotations"][GPU_INDEX] == index
    # Pinned books are exact: the L4 example of docs/live.md takes four pods (12+8 | 12+8).
    for name, memory in (("b", "8Gi"), ("c", "12Gi"), ("d", "8Gi")):
        q = downward_pod(name, memory)
        api.add_pod(q)
        c.upsert_pod(q)
        assert service.filter(filter_args(q, ["ts"])).NodeNames == ["ts"], name
        assert (await service.bind(bind_args(q, "ts"))).Error == ""
    per_gpu: dict[str, int] = {}
    for _key, stored in api.pods.items():
        ann = stored["metadata"]["annotations"]
        per_gpu[ann[GPU_INDEX]] = (
            per_gpu.get(ann[GPU_INDEX], 0) + orjson.loads(ann[ASSIGNMENT])["bytesPerDevice"][0]
        )
    assert sorted(per_gpu.values()) == [20 * GIB, 20 * GIB]
    assert check_invariant(c.ledger) == []


async def test_a_downward_api_pod_is_kept_where_no_index_would_be_written() -> None:
    """Without an index its container would start with NVIDIA_VISIBLE_DEVICES="" (no GPU at all)."""
    p = downward_pod("web-1", "12Gi")
    nodes = [gpu_node("ts", count=2, memory_mib=23034, replicas=4), gpu_node("whole", count=1)]
    service, api, c = live(nodes, [p], replica_policy="pinned")
    result = service.filter(filter_args(p, ["ts", "whole"]))
    assert result.NodeNames == ["ts"]
    assert result.FailedNodes == result.FailedAndUnresolvableNodes == {}
    service.service.explain_all = True
    result = service.filter(filter_args(p, ["ts", "whole"]))
    assert result.NodeNames == ["ts"]
    assert "cannot be pinned" in result.FailedAndUnresolvableNodes["whole"]
    assert (
        result.FailedNodes["whole"] == result.FailedAndUnresolvableNodes["whole"]
    )  # kube-scheduler < 1.21
    # The same pod without the env var may use the exclusive GPU: the check is the pod's form.
    plain = pod("plain", "12Gi")
    assert service.filter(filter_args(plain, ["whole"])).NodeNames == ["whole"]
    # The binder refuses before writing anything, whatever the caller.
    refused = await service.bind(bind_args(p, "whole"))
    assert "would start without a GPU" in refused.Error
    assert api.writes() == [] and c.ledger.reservation("default/web-1") is None


async def test_a_downward_api_pod_is_refused_everywhere_unless_gpus_are_pinned() -> None:
    p = downward_pod("web-1", "12Gi")
    nodes = [gpu_node("ts", count=2, memory_mib=23034, replicas=4), gpu_node("whole", count=1)]
    service, api, c = live(nodes, [p])  # default policy: the device plugin picks
    result = service.filter(filter_args(p, ["ts", "whole"]))
    assert result.NodeNames == []
    assert set(result.FailedAndUnresolvableNodes) == {"ts", "whole"}
    assert all(
        "only with --replica-policy pinned" in m for m in result.FailedAndUnresolvableNodes.values()
    )
    assert "would start without a GPU" in (await service.bind(bind_args(p, "ts"))).Error
    assert api.writes() == []


async def test_preemption_never_evicts_for_a_downward_api_pod_on_a_node_that_cannot_pin_it() -> (
    None
):
    victim = pod("victim", "70Gi", node="whole", priority=0)
    nodes = [gpu_node("whole", count=1)]
    service, api, c = live(nodes, [victim], replica_policy="pinned")
    victims = {"whole": {"Pods": [{"UID": victim["metadata"]["uid"]}], "NumPDBViolations": 0}}
    plain = pod("plain", "70Gi", priority=100)
    chosen = service.preempt(
        ExtenderPreemptionArgs.model_validate({"Pod": plain, "NodeNameToMetaVictims": victims})
    )
    assert set(chosen.NodeNameToMetaVictims) == {"whole"}  # a plain pod would evict it
    downward = downward_pod("web-1", "70Gi", priority=100)
    chosen = service.preempt(
        ExtenderPreemptionArgs.model_validate({"Pod": downward, "NodeNameToMetaVictims": victims})
    )
    assert chosen.NodeNameToMetaVictims == {}


# ----- bind events ----------------------------------------------------------------------------------


async def test_each_bind_records_one_assigned_event_on_the_pod() -> None:
    p = pinned_pod("p", "12Gi")
    node = gpu_node("ts", count=2, memory_mib=23034, replicas=4)
    service, api, c = live([node], [p], replica_policy="pinned")
    assert (await service.bind(bind_args(p, "ts"))).Error == ""
    await service.source.binder.events.drain()
    (event,) = api.events
    index = api.pods["default/p"]["metadata"]["annotations"][GPU_INDEX]
    assert event["reason"] == "VramschedAssigned" and event["type"] == "Normal"
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "default",
        "name": "p",
        "uid": p["metadata"]["uid"],
    }
    assert event["metadata"]["namespace"] == "default" and event["metadata"]["name"].startswith(
        "p."
    )
    assert (
        event["message"]
        == f"reserved 12Gi on GPU {index} of ts (time-slicing, 1/4 replicas, pinned)"
    )
    assert event["firstTimestamp"] == event["lastTimestamp"] and event["count"] == 1
    assert "eventTime" not in event  # core/v1 legacy rules: valid on 1.20 as on today's servers
    # The event comes after the Binding, never before.
    order = [call[0] for call in api.calls if call[0] in ("create_binding", "create_event")]
    assert order == ["create_binding", "create_event"]


async def test_unpinned_events_name_the_device_counted_not_a_gpu_claimed() -> None:
    p = pod("p", "30Gi")
    service, api, c = live([gpu_node("n1", count=2)], [p])
    assert (await service.bind(bind_args(p, "n1"))).Error == ""
    await service.source.binder.events.drain()
    (event,) = api.events
    assert (
        event["message"]
        == "reserved 30Gi on a GPU of n1 (exclusive, counted on GPU 0; the device plugin picks the GPU)"
    )


async def test_a_failing_event_call_does_not_fail_the_bind() -> None:
    p, q = pod("p", "30Gi"), pod("q", "30Gi")
    service, api, c = live([gpu_node("n1")], [p, q])
    api.fail["create_event"] = [ApiError(403, "Forbidden", 'cannot create resource "events"')]
    assert (await service.bind(bind_args(p, "n1"))).Error == ""
    assert api.pods["default/p"]["spec"]["nodeName"] == "n1"
    assert (await service.bind(bind_args(q, "n1"))).Error == ""
    events = service.source.binder.events
    await events.drain()
    assert (events.failed, events.sent, events.dropped) == (1, 1, 0)
    assert [e["involvedObject"]["name"] for e in api.events] == ["q"]
    ready, detail = service.source.ready()
    assert detail["events"] == {"sent": 1, "failed": 1, "dropped": 0, "queued": 0}


async def test_a_stuck_events_api_delays_no_bind_and_the_queue_drops_beyond_its_bound() -> None:
    pods = [pod(f"p{i}", "10Gi") for i in range(5)]
    service, api, c = live([gpu_node("n1"), gpu_node("n2")], pods)
    recorder = service.source.binder.events = EventRecorder(api, capacity=2)
    release = threading.Event()
    api.fail["create_event"] = [lambda: release.wait(10)]
    try:
        for i, p in enumerate(pods):
            result = await asyncio.wait_for(
                service.bind(bind_args(p, "n1" if i % 2 else "n2")), timeout=5
            )
            assert result.Error == ""
        # One event is stuck in the API, two wait in the queue, two were dropped.
        assert (recorder.queued, recorder.dropped, recorder.sent) == (2, 2, 0)
        text = create_app(service)[METRICS_KEY].render().decode()  # the counters are on /metrics
        assert 'vramsched_bind_events_total{outcome="dropped"} 2.0' in text
        assert "vramsched_bind_events_queued 2.0" in text
    finally:
        release.set()
    await recorder.drain()
    assert (recorder.sent, recorder.failed, recorder.dropped) == (3, 0, 2)
    assert all(api.pods[f"default/{p['metadata']['name']}"]["spec"]["nodeName"] for p in pods)
    recorder.close()
