"""The Deployment's pods: non-root and locked down under the restricted Pod Security level, two
replicas behind a disruption budget, and probes and metrics on the listeners meant for them
(the extender's verbs stay on loopback).
"""

from __future__ import annotations

from typing import Any

import pytest
from deploy_objects import (
    base_objects,
    container,
    deployment,
    one,
    serve_args,
)

from extender.cluster import ClusterState
from extender.embedded import EmbeddedBinder
from extender.server import create_app, create_probe_app, route_paths
from extender.service import ExtenderService


def test_pod_runs_non_root_with_runtime_default_seccomp() -> None:
    spec = deployment()["spec"]["template"]["spec"]
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0 and sc["runAsGroup"] > 0
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(host, False)
    assert not any("hostPath" in v for v in spec["volumes"])


@pytest.mark.parametrize("name", ["kube-scheduler", "extender"])
def test_container_is_locked_down(name: str) -> None:
    c = container(deployment(), name)
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert not sc.get("privileged", False)
    assert sc.get("runAsUser", 1) != 0
    assert {"livenessProbe", "readinessProbe"} <= set(c)
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert "memory" in c["resources"]["limits"]
    image = c["image"]
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), (
        f"unpinned image {image}"
    )


def test_namespace_enforces_restricted_pod_security() -> None:
    labels = one(base_objects(), "Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


def test_two_replicas_behind_a_disruption_budget() -> None:
    objs = base_objects()
    dep = one(objs, "Deployment", "vramsched")
    assert dep["spec"]["replicas"] == 2
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_scheduler_pod_is_not_scheduled_by_itself() -> None:
    spec = deployment()["spec"]["template"]["spec"]
    assert spec.get("schedulerName", "default-scheduler") == "default-scheduler"


def container_ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def probe_app_paths() -> set[tuple[str, str]]:
    """(method, path) of every route of the extender's GET-only probe listener (--metrics-port)."""
    main = create_app(ExtenderService(ClusterState(), EmbeddedBinder(ClusterState())))
    return {(r.method, r.resource.canonical) for r in create_probe_app(main).router.routes()}


def test_metrics_service_selects_the_pods_and_named_ports() -> None:
    dep = deployment()
    svc = one(base_objects(), "Service", "vramsched-metrics")
    assert "ServiceMonitor" not in {o["kind"] for o in base_objects()}
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    ports = {
        p["name"]: p["containerPort"]
        for c in dep["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    for port in svc["spec"]["ports"]:
        assert port["targetPort"] in ports, port
        assert port["port"] == ports[port["targetPort"]]
    # The prometheus.io annotations point at the extender's plain-HTTP probe listener ...
    ann = svc["metadata"]["annotations"]
    extender = container(dep, "extender")
    args = serve_args(extender["args"])
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/scheme"] == "http"
    assert (
        int(ann["prometheus.io/port"])
        == container_ports(extender)["http-metrics"]
        == args.metrics_port
    )
    assert ("GET", ann["prometheus.io/path"]) in probe_app_paths()
    # ... and kube-scheduler's secure port stays scrapeable as the second port (HTTPS + token).
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == {"http-metrics", "https"}
    assert container_ports(container(dep, "kube-scheduler"))["https"] == 10259


def test_extender_probes_use_its_get_only_listener_and_the_verbs_stay_on_loopback() -> None:
    c = container(deployment(), "extender")
    args = serve_args(c["args"])
    # kubelet probes the pod IP: the probe listener must listen there, the verbs must not.
    assert args.metrics_port and args.metrics_host == "0.0.0.0" and args.host == "127.0.0.1"
    # The one other listener is the admission webhook's (HTTPS, POST /mutate only).
    assert container_ports(c) == {
        "http-metrics": args.metrics_port,
        "https-webhook": args.webhook_port,
    }
    served = probe_app_paths()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert "exec" not in c[probe]
        get = c[probe]["httpGet"]
        assert get["port"] == "http-metrics" and get.get("scheme", "HTTP") == "HTTP"
        assert get["path"] in route_paths() and ("GET", get["path"]) in served
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe")} == {"/healthz"}
    # Nothing but GET (and aiohttp's implied HEAD) on the probe listener: no verb, no /state.
    assert {m for m, _ in served} <= {"GET", "HEAD"}
    assert {p for _, p in served} == {"/healthz", "/readyz", "/metrics"}


async def test_the_probe_listener_answers_the_probes_and_refuses_the_verbs() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    c = ClusterState()
    main = create_app(ExtenderService(c, EmbeddedBinder(c)))
    async with TestClient(TestServer(create_probe_app(main))) as client:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await client.get(path)).status == 200, path
        for verb in ("filter", "prioritize", "bind", "preempt"):
            assert (await client.post(f"/{verb}", json={})).status in (404, 405), verb
        assert (await client.get("/state")).status == 404


def test_kube_scheduler_probes_use_its_secure_port() -> None:
    c = container(deployment(), "kube-scheduler")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["scheme"] == "HTTPS" and ports[get["port"]] == 10259
