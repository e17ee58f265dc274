"""End to end: the extender, started with the Deployment's arguments and holding nothing but the
deploy RBAC, binds pods for the shipped scheduler config on a real kube-apiserver and
kube-scheduler, on every version the e2e suite runs (tests/conftest.py).
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_objects import (
    CONFIG,
    DEPLOY,
    EXAMPLES,
    PIN,
    SA,
    container,
    deployment,
    load,
    one,
)

from extender.demand import MODEL_MEMORY
from extender.inventory import GPU_RESOURCE
from extender.quantity import parse_bytes

E2E_GPU_LABELS = {  # a time-sliced A100-80GB as GFD labels it (deploy/examples/time-slicing-config.yaml)
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-SHARED",
    "nvidia.com/gpu.memory": "81920",
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.replicas": "4",
    "nvidia.com/gpu.sharing-strategy": "time-slicing",
}


@pytest.fixture
def rbac_cluster(control_plane: Any, tmp_path: Path) -> Iterator[Any]:
    """The session's control plane (tests/conftest.py) with the extender's ServiceAccount and its
    base role; cleaned afterwards."""
    import kubernetes.client
    import kubernetes.utils

    cp = control_plane
    cp.sa_kubeconfig = cp.service_account_kubeconfig(*SA)
    rbac = load(DEPLOY / "rbac.yaml")
    with cp.api_client() as client:
        for doc in (
            one(rbac, "ClusterRole", "vramsched-extender"),
            one(rbac, "ClusterRoleBinding", "vramsched-extender"),
        ):
            _create_or_keep(lambda d=doc: kubernetes.utils.create_from_dict(client, d))
        # The webhook's RBAC and configuration as deployed (the extender writes its caBundle);
        # no Service behind it here, so kube-apiserver's calls fail and are ignored.
        for doc in load(DEPLOY / "webhook.yaml"):
            if doc["kind"] != "Service":
                _create_or_keep(lambda d=doc: kubernetes.utils.create_from_dict(client, d))
    cp.extender = None
    cp.extender_log = tmp_path / "extender.log"
    yield cp
    cp.stop_scheduler()
    if cp.extender is not None:
        cp.extender.stop()
    with cp.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        rbac_api = kubernetes.client.RbacAuthorizationV1Api(client)
        for pod in core.list_namespaced_pod("default").items:
            core.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)
        for node in core.list_node().items:
            core.delete_node(node.metadata.name)
        for name in ("vramsched-extender-pinning",):
            for delete in (rbac_api.delete_cluster_role_binding, rbac_api.delete_cluster_role):
                _create_or_keep(lambda: delete(name), ok=(404,))
        admission = kubernetes.client.AdmissionregistrationV1Api(client)
        _create_or_keep(
            lambda: admission.delete_mutating_webhook_configuration("vramsched"), ok=(404,)
        )
        _create_or_keep(
            lambda: core.delete_namespaced_secret("vramsched-webhook-tls", "vramsched"), ok=(404,)
        )
        cp.wait_for(
            lambda: not core.list_namespaced_pod("default").items and not core.list_node().items,
            timeout=30,
            message="pods and nodes deleted",
        )


def _create_or_keep(call: Any, ok: tuple[int, ...] = (409,)) -> None:
    import kubernetes.client
    from kubernetes.utils import FailToCreateError

    try:
        call()
    except kubernetes.client.ApiException as exc:
        if exc.status not in ok:
            raise
    except FailToCreateError as exc:
        if any(e.status not in ok for e in exc.api_exceptions):
            raise


def _start_extender(cp: Any, args: list[str]) -> str:
    """`vramsched serve` with the given Deployment arguments, on free ports, as the ServiceAccount.

    Ready when the probe listener (--metrics-port, where kubelet's readinessProbe goes) says so."""
    from controlplane import Component, free_port

    port, probe_port = free_port(), free_port()
    argv = list(args)
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--metrics-port") + 1] = str(probe_port)
    argv[argv.index("--webhook-port") + 1] = str(free_port())
    argv += ["--webhook-host", "127.0.0.1"]
    cp.extender = Component(
        "vramsched",
        [sys.executable, "-m", "extender", "serve", *argv, "--kubeconfig", str(cp.sa_kubeconfig)],
        cp.extender_log,
    )
    cp.extender.start()
    url = f"http://127.0.0.1:{port}"
    readiness = container(deployment(), "extender")["readinessProbe"]["httpGet"]["path"]

    def ready() -> bool:
        if not cp.extender.running():
            raise AssertionError(cp.extender.describe())
        with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}{readiness}", timeout=2) as resp:
            return resp.status == 200

    cp.wait_for(
        ready,
        timeout=60,
        ignore=(OSError,),
        message="extender ready (synced as the ServiceAccount)",
    )
    return url


def _example_pod(path: Path, name: str) -> dict[str, Any]:
    doc = load(path)[0]
    if doc["kind"] == "Pod":
        return doc
    meta = doc["spec"]["template"]["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", **meta},
        "spec": doc["spec"]["template"]["spec"],
    }


def _bound_node(core: Any, name: str) -> str | None:
    return core.read_namespaced_pod(name, "default").spec.node_name


@pytest.mark.e2e
def test_extender_binds_with_nothing_but_its_deploy_role(rbac_cluster: Any) -> None:
    import kubernetes.client

    cp = rbac_cluster
    cp.create_gpu_node("a100-ts-0", E2E_GPU_LABELS, {GPU_RESOURCE: 4})
    url = _start_extender(cp, container(deployment(), "extender")["args"])
    cp.start_scheduler(CONFIG.read_text(), extender_url=url)
    pod = _example_pod(EXAMPLES / "vllm-inference.yaml", "vllm-0")
    with cp.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod("default", pod)
        node = cp.wait_for(
            lambda: _bound_node(core, "vllm-0"),
            timeout=60,
            message=f"vllm-0 bound\n{cp.extender.describe()}",
        )
        annotations = core.read_namespaced_pod("vllm-0", "default").metadata.annotations
    assert node == "a100-ts-0"
    assignment = yaml.safe_load(annotations["vramsched.io/assignment"])
    assert assignment["node"] == node
    assert sum(assignment["bytesPerDevice"]) == parse_bytes(annotations[MODEL_MEMORY])


@pytest.mark.e2e
def test_pinning_hand_off_needs_exactly_the_pin_gpus_role(rbac_cluster: Any) -> None:
    import kubernetes.client
    import kubernetes.utils

    cp = rbac_cluster
    cp.create_gpu_node("a100-ts-1", E2E_GPU_LABELS, {GPU_RESOURCE: 4})
    patch = load(PIN / "extender-args.patch.yaml")[0]["spec"]["template"]["spec"]["containers"][0]
    url = _start_extender(cp, patch["args"])
    cp.start_scheduler(CONFIG.read_text(), extender_url=url)
    pod = _example_pod(EXAMPLES / "pinned-inference.yaml", "pinned-inference")
    name = pod["metadata"]["name"]
    with cp.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod("default", pod)

        def refused() -> bool:
            events = core.list_namespaced_event(
                "default", field_selector=f"involvedObject.name={name}"
            ).items
            return any(
                "forbidden" in (e.message or "").lower()
                and "configmap" in (e.message or "").lower()
                for e in events
            )

        cp.wait_for(
            refused,
            timeout=60,
            message=f"bind refused for lack of configmaps rights\n{cp.extender.describe()}",
        )
        assert _bound_node(core, name) is None
        for doc in load(PIN / "rbac.yaml"):
            _create_or_keep(lambda d=doc: kubernetes.utils.create_from_dict(client, d))
        # A node change sends the unschedulable pod back to the scheduling queue at once.
        core.patch_node("a100-ts-1", {"metadata": {"labels": {"e2e/rbac-granted": "true"}}})
        node = cp.wait_for(
            lambda: _bound_node(core, name),
            timeout=90,
            message=f"{name} bound once the pin-gpus role exists\n{cp.extender.describe()}",
        )
        cm = core.read_namespaced_config_map(f"vramsched-{name}", "default")
        live = core.read_namespaced_pod(name, "default")
    assert node == "a100-ts-1"
    assert cm.data["NVIDIA_VISIBLE_DEVICES"] == live.metadata.annotations["vramsched.io/gpu-index"]
    assert [(o.kind, o.name, o.uid) for o in cm.metadata.owner_references] == [
        ("Pod", name, live.metadata.uid)
    ]
