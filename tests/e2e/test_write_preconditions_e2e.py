"""The preconditions of vramsched's pod writes against a real kube-apiserver. Bind's
(extender.live.binder): the annotation patch and the Binding name the pod version bind booked. The API refuses the patch for a pod changed
since (409) on every version, and the Binding from 1.23 on, as the fake API in
tests/kube_fakes.py assumes; the binder then refuses a pod whose `model-memory` was edited and
binds one whose update left its GPU ask alone. Live repacking's Eviction names the version whose
consent it read (extender.live.repack)."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes.client
import orjson
import pytest
from controlplane import ControlPlane

from extender.demand import ASSIGNMENT, MODEL_MEMORY, pod_ref
from extender.ledger import Reservation
from extender.live.api_client import ApiError, ClientApi, annotation_patch
from extender.live.binder import KubeBinder
from extender.live.evictions import KubeEvictions, eviction_version
from extender.object_fields import version_of
from extender.repack_policy import eviction_body
from extender.service import BindError

pytestmark = pytest.mark.e2e

GIB = 1024**3
NODE = "gpu-bind"


def gpu_pod(name: str, memory: str) -> dict[str, Any]:
    """A pod for a scheduler that is not running: nothing but the test binds it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {MODEL_MEMORY: memory}},
        "spec": {
            "schedulerName": "vramsched",
            "containers": [
                {
                    "name": "main",
                    "image": "vllm",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def create(cluster: ControlPlane, api: ClientApi, body: dict[str, Any]) -> dict[str, Any]:
    """Create the pod and read it back as JSON, as the watch would hand it to bind."""
    with cluster.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod("default", body)
    return api.read_pod("default", body["metadata"]["name"])


def held(pod: dict[str, Any], gib: int) -> Reservation:
    return Reservation(
        pod=pod_ref(pod), node=NODE, device_ids=("0",), bytes_per_device=(gib * GIB,)
    )


def test_binding_and_patch_refuse_a_stale_version(cluster: ControlPlane) -> None:
    cluster.create_gpu_node(NODE, {}, {"nvidia.com/gpu": 1})
    api = ClientApi(str(cluster.kubeconfig_path))
    made = create(cluster, api, gpu_pod("raw", "30Gi"))
    old = made["metadata"]["resourceVersion"]
    relabelled = api.patch_pod("default", "raw", {"metadata": {"labels": {"team": "search"}}})
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "raw", "namespace": "default", "resourceVersion": old},
        "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
    }
    with pytest.raises(ApiError) as refused:
        api.patch_pod("default", "raw", annotation_patch("", {"x": "1"}, old))
    assert refused.value.status == 409, refused.value
    if not cluster.release.binding_honors_preconditions:
        # Before 1.23 the Binding binds the stored pod whatever version it names: the one
        # round trip between bind's annotation and its Binding is unguarded there (docs/live.md).
        api.create_binding("default", "raw", binding)
        assert api.read_pod("default", "raw")["spec"]["nodeName"] == NODE
        return
    with pytest.raises(ApiError) as refused:
        api.create_binding("default", "raw", binding)
    assert refused.value.status == 409, refused.value
    assert not (api.read_pod("default", "raw")["spec"].get("nodeName"))
    binding["metadata"]["resourceVersion"] = relabelled["metadata"]["resourceVersion"]
    api.create_binding("default", "raw", binding)
    assert api.read_pod("default", "raw")["spec"]["nodeName"] == NODE


def test_the_binder_refuses_an_edited_pod_and_binds_a_relabelled_one(
    cluster: ControlPlane,
) -> None:
    cluster.create_gpu_node(NODE, {}, {"nvidia.com/gpu": 1})
    api = ClientApi(str(cluster.kubeconfig_path))
    binder = KubeBinder(api)
    try:
        read = create(cluster, api, gpu_pod("edited", "30Gi"))  # the copy bind books
        api.patch_pod("default", "edited", {"metadata": {"annotations": {MODEL_MEMORY: "70Gi"}}})
        with pytest.raises(BindError, match="changed while being bound"):
            asyncio.run(binder.bind(read, NODE, held(read, 30)))
        now = api.read_pod("default", "edited")
        assert not now["spec"].get("nodeName")
        assert ASSIGNMENT not in now["metadata"]["annotations"]

        api.patch_pod("default", "edited", {"metadata": {"labels": {"team": "search"}}})
        asyncio.run(binder.bind(now, NODE, held(now, 70)))  # `now` is a version behind
        bound = api.read_pod("default", "edited")
        assert bound["spec"]["nodeName"] == NODE
        booked = orjson.loads(bound["metadata"]["annotations"][ASSIGNMENT])
        assert booked["bytesPerDevice"] == [70 * GIB]
    finally:
        binder.close()


class EditBeforeBinding:
    """The real API, with a user's edit landing just before bind's Binding reaches it."""

    def __init__(self, api: ClientApi, edit: dict[str, Any]) -> None:
        self.api, self.edit = api, edit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)

    def create_binding(self, namespace: str, name: str, body: Any) -> None:
        self.api.patch_pod(namespace, name, self.edit)
        self.api.create_binding(namespace, name, body)


def test_an_edit_between_annotation_and_binding_fails_the_bind(cluster: ControlPlane) -> None:
    cluster.create_gpu_node(NODE, {}, {"nvidia.com/gpu": 1})
    api = ClientApi(str(cluster.kubeconfig_path))
    edit = {"metadata": {"annotations": {MODEL_MEMORY: "70Gi"}}}
    binder = KubeBinder(EditBeforeBinding(api, edit))  # type: ignore[arg-type]
    try:
        read = create(cluster, api, gpu_pod("late", "30Gi"))
        if not cluster.release.binding_honors_preconditions:
            asyncio.run(binder.bind(read, NODE, held(read, 30)))  # the unguarded round trip
            assert api.read_pod("default", "late")["spec"]["nodeName"] == NODE
            return
        with pytest.raises(BindError, match=r"\(30Gi each\), it now asks .*\(70Gi each\)"):
            asyncio.run(binder.bind(read, NODE, held(read, 30)))
        now = api.read_pod("default", "late")
        assert not now["spec"].get("nodeName")
        assert ASSIGNMENT not in now["metadata"]["annotations"]  # the stale assignment removed
        assert now["metadata"]["annotations"][MODEL_MEMORY] == "70Gi"
    finally:
        binder.close()


def test_an_eviction_naming_a_stale_version_is_refused(cluster: ControlPlane) -> None:
    """Live repacking's Eviction names the pod version whose consent it read: a pod changed
    since (its `movable` annotation removed, say) is refused, and the current version evicted."""
    api = ClientApi(str(cluster.kubeconfig_path))
    evict = KubeEvictions(api)
    made = create(cluster, api, gpu_pod("moved", "30Gi"))
    version = eviction_version(api)
    api.patch_pod("default", "moved", {"metadata": {"labels": {"team": "search"}}})
    stale = eviction_body(pod_ref(made), version, made["metadata"]["resourceVersion"])
    with pytest.raises(ApiError) as refused:
        evict("default", "moved", stale, False)
    assert refused.value.status == 409, refused.value
    assert api.read_pod("default", "moved")["metadata"]["uid"] == made["metadata"]["uid"]
    now = api.read_pod("default", "moved")
    evict("default", "moved", eviction_body(pod_ref(now), version, version_of(now)), False)
    with pytest.raises(ApiError) as gone:
        api.read_pod("default", "moved")
    assert gone.value.status == 404
