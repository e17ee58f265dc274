"""The admission webhook and the bind-time fraction against a real kube-apiserver and scheduler.

kube-apiserver calls `vramsched serve --webhook-port` over TLS (clientConfig.url on loopback with
the caBundle), registered from deploy/webhook.yaml; the scheduler binds through the extender.
On the session control planes no kubelet runs: there the bound pod from the API must carry the
annotation, the env entry and the `$(VAR)` argument. The last test runs the device-plugin
e2e's stack (tests/e2e/test_device_plugin_e2e.py: a real kubelet with containerd, 1.36.3), where
a busybox container prints what the kubelet really expanded.
"""

from __future__ import annotations

import copy
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane, free_port
from kubelet import BUSYBOX_IMAGE
from test_device_plugin_e2e import Stack, stack  # noqa: F401 (stack: the kubelet node's fixture)
from test_extender_e2e import (
    Extender,
    _grant_extender_rbac,
    add_node,
    scheduler_config,
    wait_bound,
)

from extender.sizing.engines import EngineSettings
from extender.sizing.estimate import estimate, resolve_model
from extender.sizing.handoff import (
    FRACTION_ANNOTATION,
    FRACTION_ENV,
    FRACTION_FIELD_PATH,
    pod_fraction,
)
from extender.webhook.certs import make_serving_cert

NS = "default"
GIB = 1 << 30
WEBHOOK_YAML = REPO_ROOT / "deploy" / "webhook.yaml"


def _deploy_doc(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(WEBHOOK_YAML.read_text()) if d and d["kind"] == kind]
    return doc


def _register(cp: ControlPlane, port: int, ca_pem: bytes | None) -> str:
    """deploy/webhook.yaml's MutatingWebhookConfiguration, pointed at loopback."""
    doc = copy.deepcopy(_deploy_doc("MutatingWebhookConfiguration"))
    for hook in doc["webhooks"]:
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/mutate"}
        if ca_pem is not None:
            import base64

            hook["clientConfig"]["caBundle"] = base64.b64encode(ca_pem).decode()
    with cp.api_client() as client:
        kubernetes.client.AdmissionregistrationV1Api(client).create_mutating_webhook_configuration(
            doc
        )
    return doc["metadata"]["name"]


def _grant_webhook_rbac(cp: ControlPlane) -> None:
    """deploy/webhook.yaml's Role, ClusterRole and bindings, as the extender's SA gets them."""
    cp.create_rbac(d for d in yaml.safe_load_all(WEBHOOK_YAML.read_text()) if d)


def _raw_create(
    cp: ControlPlane, pod: dict[str, Any], dry_run: bool = False
) -> tuple[int, dict[str, Any], list[str]]:
    """POST a pod as kubectl would; (status, body, Warning headers)."""
    url = f"{cp.server_url}/api/v1/namespaces/{NS}/pods" + ("?dryRun=All" if dry_run else "")
    req = urllib.request.Request(
        url,
        data=json.dumps(pod).encode(),
        headers={"Authorization": f"Bearer {cp.admin_token}", "Content-Type": "application/json"},
    )
    ctx = ssl.create_default_context(cafile=str(cp.ca_path))
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get_all("Warning") or []
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), exc.headers.get_all("Warning") or []


def vllm_pod(
    name: str, annotations: dict[str, str] | None = None, *, scheduler: str = "vramsched"
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "schedulerName": scheduler,
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.10.1",
                    "args": [
                        "--model",
                        "Qwen/Qwen2.5-7B-Instruct",
                        "--max-model-len",
                        "8192",
                        "--max-num-seqs",
                        "4",
                        f"--gpu-memory-utilization=$({FRACTION_ENV})",
                    ],
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "64Mi"},
                        "limits": {"nvidia.com/gpu": "1"},
                    },
                }
            ],
        },
    }


def _wait_webhook_active(cp: ControlPlane) -> None:
    """kube-apiserver picks a new webhook configuration up after a moment: dry-run until it
    mutates."""

    def mutated() -> bool:
        status, body, _ = _raw_create(cp, vllm_pod("probe"), dry_run=True)
        return status == 201 and "vramsched.io/model-memory" in (
            body["metadata"].get("annotations") or {}
        )

    cp.wait_for(mutated, timeout=60, message="kube-apiserver calls the webhook")


@pytest.fixture
def webhook_stack(cluster: ControlPlane) -> Iterator[tuple[ControlPlane, Extender]]:
    """Extender with the webhook on a file certificate for 127.0.0.1, registered, plus the scheduler."""
    kubeconfig = _grant_extender_rbac(cluster)
    cert = make_serving_cert(["127.0.0.1"])
    certs = Path(cluster.workdir) / "webhook-cert"
    certs.mkdir(exist_ok=True)
    (certs / "tls.crt").write_bytes(cert.cert_pem)
    (certs / "tls.key").write_bytes(cert.key_pem)
    port = free_port()
    ext = Extender(
        cluster,
        kubeconfig,
        [
            "--webhook-port",
            str(port),
            "--webhook-host",
            "127.0.0.1",
            "--webhook-cert",
            str(certs / "tls.crt"),
            "--webhook-key",
            str(certs / "tls.key"),
        ],
    )
    ext.start()
    name = _register(cluster, port, cert.ca_pem)
    cluster.start_scheduler(scheduler_config(ext.url))
    try:
        _wait_webhook_active(cluster)
        yield cluster, ext
    finally:
        with cluster.api_client() as client:
            kubernetes.client.AdmissionregistrationV1Api(
                client
            ).delete_mutating_webhook_configuration(name)
        ext.stop()


@pytest.mark.e2e
def test_bad_annotation_is_refused_at_create(webhook_stack: tuple[ControlPlane, Extender]) -> None:
    cp, _ = webhook_stack
    status, body, _ = _raw_create(cp, vllm_pod("bad", {"vramsched.io/model-memory": "16GB"}))
    assert status == 400, body
    message = body["message"]
    assert 'admission webhook "pods.vramsched.io" denied the request' in message
    assert "pod default/bad: annotation vramsched.io/model-memory='16GB' is invalid" in message
    api = kubernetes.client.CoreV1Api(cp.api_client())
    with pytest.raises(kubernetes.client.ApiException) as exc:
        api.read_namespaced_pod("bad", NS)
    assert exc.value.status == 404
    # The same pod for another scheduler is not vramsched's business (1.20 has no
    # matchConditions: the webhook's own check lets it through).
    status, _, warnings = _raw_create(
        cp, vllm_pod("other", {"vramsched.io/model-memory": "16GB"}, scheduler="default-scheduler")
    )
    assert status == 201 and warnings == []


@pytest.mark.e2e
def test_named_model_gets_its_annotation_and_a_warning_and_the_bound_fraction(
    webhook_stack: tuple[ControlPlane, Extender],
) -> None:
    cp, _ = webhook_stack
    add_node(cp, "a100", "NVIDIA-A100-SXM4-80GB", count=1, memory_mib=81920)
    status, body, warnings = _raw_create(cp, vllm_pod("qwen"))
    assert status == 201, body
    expected = estimate(
        resolve_model("Qwen/Qwen2.5-7B-Instruct"),
        EngineSettings(max_model_len=8192, max_num_seqs=4),
        list_devices=False,
    )
    annotations = body["metadata"]["annotations"]
    assert annotations["vramsched.io/model-memory"] == expected.model_memory
    assert any(f"set vramsched.io/model-memory={expected.model_memory}" in w for w in warnings), (
        warnings
    )

    api = kubernetes.client.CoreV1Api(cp.api_client())
    assert wait_bound(cp, api, ["qwen"]) == {"qwen": "a100"}
    bound = api.read_namespaced_pod("qwen", NS)
    value = (bound.metadata.annotations or {})[FRACTION_ANNOTATION]
    raw = api.api_client.sanitize_for_serialization(bound)
    assert value == pod_fraction(raw, [(expected.reservation_per_gpu, 81920 * 2**20)])
    assert 0.1 < float(value) < 0.5
    # What the kubelet resolves: the webhook's env entry reads the annotation bind wrote, and
    # the argument refers to the env var (the kubelet test below runs that expansion for real).
    (container,) = bound.spec.containers
    (entry,) = [e for e in container.env or [] if e.name == FRACTION_ENV]
    assert entry.value_from.field_ref.field_path == FRACTION_FIELD_PATH
    assert f"--gpu-memory-utilization=$({FRACTION_ENV})" in container.args


@pytest.mark.e2e
def test_declared_memory_below_the_estimate_warns_and_is_kept(
    webhook_stack: tuple[ControlPlane, Extender],
) -> None:
    cp, _ = webhook_stack
    status, body, warnings = _raw_create(
        cp, vllm_pod("tight", {"vramsched.io/model-memory": "8Gi"})
    )
    assert status == 201
    assert body["metadata"]["annotations"]["vramsched.io/model-memory"] == "8Gi"
    assert any("would run out of GPU memory" in w for w in warnings), warnings


@pytest.mark.e2e
def test_certificates_bootstrap_into_a_secret_and_the_ca_bundle(cluster: ControlPlane) -> None:
    """No certificate files: vramsched creates the Secret, writes the caBundle of the deployed
    configuration, and kube-apiserver trusts it; a second replica serves the same Secret."""
    kubeconfig = _grant_extender_rbac(cluster)
    _grant_webhook_rbac(cluster)
    port = free_port()
    name = _register(cluster, port, None)
    args = [
        "--webhook-port",
        str(port),
        "--webhook-host",
        "127.0.0.1",
        "--webhook-secret",
        "vramsched/vramsched-webhook-tls",
        "--webhook-hosts",
        "127.0.0.1",
        "--webhook-configuration",
        name,
    ]
    first = Extender(cluster, kubeconfig, args)
    second = Extender(cluster, kubeconfig, [*args[:1], str(free_port()), *args[2:]])
    api = kubernetes.client.CoreV1Api(cluster.api_client())
    try:
        first.start()
        secret = api.read_namespaced_secret("vramsched-webhook-tls", "vramsched")
        assert secret.type == "kubernetes.io/tls"
        with cluster.api_client() as client:
            config = kubernetes.client.AdmissionregistrationV1Api(
                client
            ).read_mutating_webhook_configuration(name)
        assert config.webhooks[0].client_config.ca_bundle == secret.data["ca.crt"]
        _wait_webhook_active(cluster)
        status, body, _ = _raw_create(
            cluster, vllm_pod("bad", {"vramsched.io/model-memory": "lots"})
        )
        assert status == 400 and "is invalid" in body["message"]
        second.start()
        again = api.read_namespaced_secret("vramsched-webhook-tls", "vramsched")
        assert again.metadata.resource_version == secret.metadata.resource_version
    finally:
        with cluster.api_client() as client:
            kubernetes.client.AdmissionregistrationV1Api(
                client
            ).delete_mutating_webhook_configuration(name)
        first.stop()
        second.stop()
        try:
            api.delete_namespaced_secret("vramsched-webhook-tls", "vramsched")
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise


@pytest.mark.e2e
def test_deployed_configuration_on_kubernetes_1_36_keeps_its_match_conditions(
    tmp_path: Path,
) -> None:
    """kube-apiserver 1.36 compiles the CEL matchCondition of deploy/webhook.yaml (a typo would
    be refused at create), keeps it, and calls the webhook for vramsched's pods."""
    from kubelet import ControlPlane136  # the 1.36.3 control plane only: no kubelet here

    cp = ControlPlane136(tmp_path / "cp136")
    cp.start()
    try:
        kubeconfig = _grant_extender_rbac(cp)
        cert = make_serving_cert(["127.0.0.1"])
        (tmp_path / "tls.crt").write_bytes(cert.cert_pem)
        (tmp_path / "tls.key").write_bytes(cert.key_pem)
        port = free_port()
        ext = Extender(
            cp,
            kubeconfig,
            ["--webhook-port", str(port), "--webhook-host", "127.0.0.1"]
            + [
                "--webhook-cert",
                str(tmp_path / "tls.crt"),
                "--webhook-key",
                str(tmp_path / "tls.key"),
            ],
        )
        ext.start()
        try:
            name = _register(cp, port, cert.ca_pem)
            with cp.api_client() as client:
                kept = kubernetes.client.AdmissionregistrationV1Api(
                    client
                ).read_mutating_webhook_configuration(name)
            (condition,) = kept.webhooks[0].match_conditions
            assert condition.expression == "object.spec.schedulerName == 'vramsched'"
            _wait_webhook_active(cp)
            status, body, _ = _raw_create(
                cp, vllm_pod("bad", {"vramsched.io/model-memory": "16GB"})
            )
            assert status == 400 and "is invalid" in body["message"], body
            status, _, warnings = _raw_create(
                cp,
                vllm_pod(
                    "other", {"vramsched.io/model-memory": "16GB"}, scheduler="default-scheduler"
                ),
            )
            assert status == 201 and warnings == []
        finally:
            ext.stop()
    finally:
        cp.stop()


# ----- the fraction through a real kubelet ------------------------------------------------------

#: Prints the expanded argument and the env var as the container got them; `-unset` tells an
#: undefined variable from an empty one. `${...}` is the shell's: the kubelet expands `$(...)` only.
PRINT_FRACTION = (
    "trap 'exit 0' TERM; "
    f'echo "ARG=$1"; echo "ENV=${{{FRACTION_ENV}-unset}}"; echo END; sleep 3600 & wait'
)


def _printing_pod(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    """busybox on the kubelet node, its args written as an engine's would be."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "schedulerName": "vramsched",
            "nodeSelector": {"vramsched.io/device-plugin": "true"},
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", PRINT_FRACTION, "sh"],
                    "args": [f"--gpu-memory-utilization=$({FRACTION_ENV})"],
                    "resources": {
                        "requests": {"cpu": "10m", "memory": "8Mi"},
                        "limits": {"nvidia.com/gpu": "1"},
                    },
                }
            ],
        },
    }


def _printed(stack: Stack, name: str) -> dict[str, str]:
    (p,) = stack.settle({name}).values()
    assert p.status.phase == "Running", p.status
    text = stack.output(p)
    return dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)


@pytest.mark.e2e
def test_the_kubelet_hands_the_container_its_bound_gpus_fraction(stack: Stack) -> None:
    """The webhook (a second `vramsched serve`, over TLS) adds the env entry, the extender's bind
    writes the annotation, and the real kubelet resolves the downward API and expands `$(VAR)`
    in the args: the container prints the bound GPU's fraction twice. Then, with the webhook
    down (failurePolicy: Ignore), a pod that left its sizing to the webhook starts with the
    literal `$(VAR)` in its args, as deploy/examples/sglang-sizing.yaml warns."""
    cp = stack.cp
    cert = make_serving_cert(["127.0.0.1"])
    certs = Path(cp.workdir) / "webhook-cert"
    certs.mkdir(exist_ok=True)
    (certs / "tls.crt").write_bytes(cert.cert_pem)
    (certs / "tls.key").write_bytes(cert.key_pem)
    port = free_port()
    webhook = Extender(
        cp,
        _grant_extender_rbac(cp),
        ["--webhook-port", str(port), "--webhook-host", "127.0.0.1"]
        + ["--webhook-cert", str(certs / "tls.crt"), "--webhook-key", str(certs / "tls.key")],
    )
    webhook.start()
    name = _register(cp, port, cert.ca_pem)
    try:
        _wait_webhook_active(cp)
        status, body, _ = _raw_create(
            cp, _printing_pod("wired", {"vramsched.io/model-memory": "20Gi"})
        )
        assert status == 201, body
        (container,) = body["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env") or []}  # the pod came without env
        assert env[FRACTION_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == FRACTION_FIELD_PATH
        printed = _printed(stack, "wired")
        bound = stack.core.read_namespaced_pod("wired", NS)
        value = (bound.metadata.annotations or {})[FRACTION_ANNOTATION]
        raw = stack.core.api_client.sanitize_for_serialization(bound)
        assert value == pod_fraction(raw, [(20 * GIB, 81920 * 2**20)]) == "0.25"
        assert printed["ENV"] == value
        assert printed["ARG"] == f"--gpu-memory-utilization={value}"

        webhook.stop()  # kube-apiserver cannot reach it: failurePolicy Ignore admits as is
        status, body, _ = _raw_create(
            cp, _printing_pod("unwired", {"vramsched.io/model": "Qwen/Qwen2.5-7B-Instruct"})
        )
        assert status == 201, body
        assert "vramsched.io/model-memory" not in body["metadata"]["annotations"]
        printed = _printed(stack, "unwired")
        bound = stack.core.read_namespaced_pod("unwired", NS)
        assert FRACTION_ANNOTATION not in (bound.metadata.annotations or {})  # a whole GPU
        assert printed["ENV"] == "unset"
        assert printed["ARG"] == f"--gpu-memory-utilization=$({FRACTION_ENV})"
    finally:
        with cp.api_client() as client:
            kubernetes.client.AdmissionregistrationV1Api(
                client
            ).delete_mutating_webhook_configuration(name)
        webhook.stop()
        stack.delete_all()
