"""The pin ConfigMap's re-pin against a real kube-apiserver: the merge patch bind sends when the
pod's own ConfigMap names the GPUs of an earlier bind that did not land (extender.live.binder).
Its preconditions must hold as the fake API in tests/kube_fakes.py assumes: the patch lands with
the current UID and resourceVersion, fails with a stale resourceVersion or another UID, and a
null removes a key."""

from __future__ import annotations

import kubernetes.client
import pytest
from controlplane import ControlPlane

from extender.live.api_client import ApiError, ClientApi

pytestmark = pytest.mark.e2e

NAME = "vramsched-repinned"


def test_the_repin_patch_lands_only_on_the_configmap_it_read(cluster: ControlPlane) -> None:
    api = ClientApi(str(cluster.kubeconfig_path))
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NAME, "namespace": "default"},
        "data": {"NVIDIA_VISIBLE_DEVICES": "0", "VRAMSCHED_PINNED": "true"},
    }
    made = api.create_configmap("default", body)
    try:
        uid, version = made["metadata"]["uid"], made["metadata"]["resourceVersion"]
        patched = api.patch_configmap(
            "default",
            NAME,
            {
                "metadata": {"uid": uid, "resourceVersion": version},
                "data": {"NVIDIA_VISIBLE_DEVICES": "1"},
            },
        )
        assert patched["data"] == {"NVIDIA_VISIBLE_DEVICES": "1", "VRAMSCHED_PINNED": "true"}
        for stale in ({"resourceVersion": version}, {"uid": "0f0f0f0f-not-its-uid"}):
            with pytest.raises(ApiError) as refused:
                api.patch_configmap(
                    "default", NAME, {"metadata": stale, "data": {"NVIDIA_VISIBLE_DEVICES": "2"}}
                )
            assert refused.value.status in (409, 422), refused.value
        assert api.read_configmap("default", NAME)["data"]["NVIDIA_VISIBLE_DEVICES"] == "1"
        unpinned = api.patch_configmap(
            "default",
            NAME,
            {"data": {"NVIDIA_VISIBLE_DEVICES": None, "VRAMSCHED_PINNED": "false"}},
        )
        assert unpinned["data"] == {"VRAMSCHED_PINNED": "false"}
    finally:
        with cluster.api_client() as client:
            kubernetes.client.CoreV1Api(client).delete_namespaced_config_map(NAME, "default")
