"""The deployment is what users copy and paste, so it is checked like code.

Every manifest must parse as the Kubernetes type it claims (no field silently dropped), carry
the security settings and RBAC the deployment promises, and agree with the extender it runs:
its routes, its command-line flags, the resources and annotations it understands.
`kubectl kustomize` must render the base with whatever kubectl the machine has (CI installs
Debian's kubernetes-client, 1.20 with kustomize v2.0.3; `KUBECTL=/path` overrides).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from builders import apply_json_patch
from kubernetes.client import ApiClient

from extender import mig
from extender.cli import build_parser
from extender.cluster import ClusterState
from extender.demand import MODEL_MEMORY, pod_demand
from extender.embedded import EmbeddedBinder
from extender.inventory import GPU_RESOURCE, SHARED_GPU_RESOURCE, is_gpu_resource, node_inventory
from extender.quantity import MIB, parse_bytes
from extender.server import create_app, create_probe_app, route_paths
from extender.service import ExtenderService
from extender.sizing.engines import FLAGS, outside
from extender.sizing.handoff import FRACTION_ENV, FRACTION_FIELD_PATH, pod_engine, pod_fraction
from extender.webhook.admission import decide
from extender.webhook.launch import check_arguments
from extender.webhook.server import MUTATE_PATH

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
EXAMPLES = DEPLOY / "examples"
PIN = DEPLOY / "pin-gpus"
PLUGIN = DEPLOY / "device-plugin"
CONFIG = ROOT / "config" / "KubeSchedulerConfiguration.yaml"
CONFIG_KEY = "KubeSchedulerConfiguration.yaml"
# Files under deploy/ that are not Kubernetes objects.
NOT_OBJECTS = {"kustomization.yaml", CONFIG_KEY, "extender-args.patch.yaml"}

MODEL_OF = {
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Service"): "V1Service",
    ("v1", "Pod"): "V1Pod",
    ("v1", "Node"): "V1Node",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    (
        "admissionregistration.k8s.io/v1",
        "MutatingWebhookConfiguration",
    ): "V1MutatingWebhookConfiguration",
}
_API = ApiClient()


# ---------------------------------------------------------------------------------------------
# helpers


def load(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


#: not Kubernetes objects: Prometheus rule files (tests/test_prometheus.py checks them)
NOT_OBJECT_DIRS = {"prometheus"}


def object_files() -> list[Path]:
    return sorted(
        p
        for p in DEPLOY.rglob("*.yaml")
        if p.name not in NOT_OBJECTS and not NOT_OBJECT_DIRS & set(p.relative_to(DEPLOY).parts)
    )


def base_objects() -> list[dict[str, Any]]:
    """The objects of the kustomize base, read from the files its kustomization lists."""
    kust = load(DEPLOY / "kustomization.yaml")[0]
    return [d for name in kust["resources"] for d in load(DEPLOY / name)]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def scheduler_config() -> dict[str, Any]:
    return load(CONFIG)[0]


def the_extender() -> dict[str, Any]:
    extenders = scheduler_config()["extenders"]
    assert len(extenders) == 1
    return extenders[0]


def deployment() -> dict[str, Any]:
    return one(base_objects(), "Deployment", "vramsched")


def container(dep: dict[str, Any], name: str) -> dict[str, Any]:
    return one(
        [
            {"kind": "c", "metadata": {"name": c["name"]}, **c}
            for c in dep["spec"]["template"]["spec"]["containers"]
        ],
        "c",
        name,
    )


def serve_args(argv: list[str]) -> Any:
    """Parse `vramsched serve <argv>` with the real CLI parser (exits on an unknown flag)."""
    return build_parser().parse_args(["serve", *argv])


def dropped_fields(original: Any, kept: Any, path: str = "") -> list[str]:
    """Paths present in `original` but lost by the Kubernetes model round trip (= unknown or misspelt)."""
    if isinstance(original, dict):
        if not isinstance(kept, dict):
            return [path or "/"]
        out: list[str] = []
        for key, value in original.items():
            if key not in kept:
                out.append(f"{path}/{key}")
            else:
                out.extend(dropped_fields(value, kept[key], f"{path}/{key}"))
        return out
    if isinstance(original, list):
        if not isinstance(kept, list) or len(kept) != len(original):
            return [path]
        return [
            p
            for i, (a, b) in enumerate(zip(original, kept))
            for p in dropped_fields(a, b, f"{path}[{i}]")
        ]
    return (
        []
        if str(original).lower() == str(kept).lower()
        else [f"{path} ({original!r} became {kept!r})"]
    )


def check_object(doc: dict[str, Any]) -> None:
    """Deserialize into the kubernetes client model (required fields, enums) and back; nothing may be lost."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in MODEL_OF, f"no model for {key}: add it to MODEL_OF or fix apiVersion/kind"
    model = _API._ApiClient__deserialize(doc, MODEL_OF[key])  # type: ignore[attr-defined]
    lost = dropped_fields(doc, _API.sanitize_for_serialization(model))
    assert not lost, (
        f"{key[1]} {doc['metadata'].get('name')}: fields unknown to {MODEL_OF[key]}: {lost}"
    )


def go_duration_seconds(text: str) -> float:
    """metav1.Duration as Go's time.ParseDuration reads it (the units a config would use)."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def kubectl() -> str:
    exe = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if exe is None:
        pytest.fail(
            "kubectl not found, so `kubectl kustomize deploy/` cannot be checked. "
            "Install it (Debian: apt-get install -y kubernetes-client, or `make deps`) "
            "or set KUBECTL=/path/to/kubectl."
        )
    return exe


def kustomize(directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kustomize(DEPLOY)


def pod_specs(doc: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(metadata, spec) of the pods a workload object creates."""
    if doc["kind"] == "Pod":
        yield doc["metadata"], doc["spec"]
    elif doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        tpl = doc["spec"]["template"]
        yield tpl.get("metadata", {}), tpl["spec"]


def requested_resources(spec: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        res = c.get("resources", {})
        names |= set(res.get("requests", {})) | set(res.get("limits", {}))
    return names


def example_workloads() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (p, d)
        for p in sorted(EXAMPLES.glob("*.yaml"))
        for d in load(p)
        if d["kind"] in ("Pod", "Deployment")
    ]


def flag_value(args: list[str], flag: str) -> str:
    i = args.index(flag)
    return args[i + 1]


# ---------------------------------------------------------------------------------------------
# KubeSchedulerConfiguration

# Field names per level: kubernetes/kubernetes staging/src/k8s.io/kube-scheduler/config/v1/types.go
# and, for leaderElection, staging/src/k8s.io/component-base/config/v1alpha1/types.go
# (LeaderElectionConfiguration).
_SCHEMA: dict[str, set[str]] = {
    "": {
        "apiVersion",
        "kind",
        "parallelism",
        "leaderElection",
        "clientConnection",
        "percentageOfNodesToScore",
        "podInitialBackoffSeconds",
        "podMaxBackoffSeconds",
        "profiles",
        "extenders",
        "delayCacheUntilActive",
    },
    "leaderElection": {
        "leaderElect",
        "leaseDuration",
        "renewDeadline",
        "retryPeriod",
        "resourceLock",
        "resourceName",
        "resourceNamespace",
    },
    "profiles": {"schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig"},
    "extenders": {
        "urlPrefix",
        "filterVerb",
        "preemptVerb",
        "prioritizeVerb",
        "weight",
        "bindVerb",
        "enableHTTPS",
        "tlsConfig",
        "httpTimeout",
        "nodeCacheCapable",
        "managedResources",
        "ignorable",
    },
    "managedResources": {"name", "ignoredByScheduler"},
}
# Default score-plugin weights of kube-scheduler v1 (pkg/scheduler/apis/config/v1/default_plugins.go).
_USER_INTENT_SCORERS = {
    "TaintToleration": 3,
    "NodeAffinity": 2,
    "PodTopologySpread": 2,
    "InterPodAffinity": 2,
}
_VRAM_BLIND_SCORERS = {
    "NodeResourcesFit": 1,
    "NodeResourcesBalancedAllocation": 1,
    "ImageLocality": 1,
}
_MAX_NODE_SCORE, _MAX_EXTENDER_PRIORITY = 100, 10
# Upstream SLO for one mutating API call (p99); bind makes up to 3 with --pin-gpus.
_API_WRITE_SLO_S, _BIND_WRITES_WITH_PINNING = 1.0, 3
# A Kubernetes qualified name with a prefix, and not in the kubernetes.io namespace: an extended resource.
_EXTENDED_RESOURCE = re.compile(
    r"^(?!(?:[^/]*\.)?kubernetes\.io/)[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def test_deploy_copy_of_scheduler_config_is_identical() -> None:
    assert (DEPLOY / CONFIG_KEY).read_bytes() == CONFIG.read_bytes(), (
        "deploy/KubeSchedulerConfiguration.yaml drifted: cp config/KubeSchedulerConfiguration.yaml deploy/"
    )


def test_scheduler_config_uses_only_known_fields() -> None:
    cfg = scheduler_config()
    assert (cfg["apiVersion"], cfg["kind"]) == (
        "kubescheduler.config.k8s.io/v1",
        "KubeSchedulerConfiguration",
    )
    unknown = set(cfg) - _SCHEMA[""]
    unknown |= {
        f"leaderElection.{k}" for k in set(cfg["leaderElection"]) - _SCHEMA["leaderElection"]
    }
    for p in cfg["profiles"]:
        unknown |= {f"profiles[].{k}" for k in set(p) - _SCHEMA["profiles"]}
    for e in cfg["extenders"]:
        unknown |= {f"extenders[].{k}" for k in set(e) - _SCHEMA["extenders"]}
        for m in e.get("managedResources", []):
            unknown |= {f"managedResources[].{k}" for k in set(m) - _SCHEMA["managedResources"]}
    assert not unknown, (
        f"kube-scheduler rejects unknown fields (strict decoding): {sorted(unknown)}"
    )


def test_scheduler_config_passes_kube_scheduler_validation_rules() -> None:
    cfg = scheduler_config()
    le = cfg["leaderElection"]
    assert le["leaderElect"] is True and le["resourceLock"] == "leases"
    names = [p["schedulerName"] for p in cfg["profiles"]]
    assert all(names) and len(set(names)) == len(names)
    for p in cfg["profiles"]:
        assert 0 <= p.get("percentageOfNodesToScore", 0) <= 100
    assert sum(1 for e in cfg["extenders"] if e.get("bindVerb")) <= 1, (
        "only one extender can implement bind"
    )
    seen: set[str] = set()
    for e in cfg["extenders"]:
        if e.get("prioritizeVerb"):
            assert isinstance(e.get("weight"), int) and e["weight"] > 0, (
                "prioritizeVerb needs a positive weight"
            )
        for m in e.get("managedResources", []):
            assert _EXTENDED_RESOURCE.match(m["name"]), (
                f"not an extended resource name: {m['name']}"
            )
            assert m["name"] not in seen, f"duplicate managed resource {m['name']}"
            seen.add(m["name"])
            assert isinstance(m.get("ignoredByScheduler", False), bool)
        assert go_duration_seconds(e["httpTimeout"]) > 0


def test_leader_election_uses_its_own_lease_in_our_namespace() -> None:
    le = scheduler_config()["leaderElection"]
    assert le["resourceName"] == "vramsched"
    assert le["resourceName"] != "kube-scheduler", (
        "would compete with the default scheduler for its lease"
    )
    namespace = one(base_objects(), "Namespace")["metadata"]["name"]
    assert le["resourceNamespace"] == namespace


def test_one_profile_named_vramsched_scores_every_node() -> None:
    (profile,) = scheduler_config()["profiles"]
    assert profile["schedulerName"] == "vramsched"
    assert profile["percentageOfNodesToScore"] == 100


def test_every_configured_verb_is_a_route_of_the_extender() -> None:
    ext = the_extender()
    routes = route_paths()
    prefix = urlparse(ext["urlPrefix"]).path.rstrip("/")
    verbs = {k: ext.get(k) for k in ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb")}
    # The extender implements all four verbs, so all four are configured.
    assert all(verbs.values()), f"a verb is not configured: {verbs}"
    for key, verb in verbs.items():
        # kube-scheduler POSTs to strings.TrimRight(urlPrefix, "/") + "/" + verb
        assert f"{prefix}/{verb}" in routes, (
            f"{key}={verb!r} -> {prefix}/{verb} is not served (routes: {sorted(routes)})"
        )


def test_url_prefix_points_at_the_sidecar_as_started() -> None:
    ext = the_extender()
    url = urlparse(ext["urlPrefix"])
    args = serve_args(container(deployment(), "extender")["args"])
    assert url.scheme == "http" and ext.get("enableHTTPS", False) is False and args.tls_cert is None
    assert url.hostname == args.host == "127.0.0.1", (
        "extender must listen on loopback only, where the scheduler calls it"
    )
    assert url.port == args.port


def test_extender_serves_the_profile_scheduler_name() -> None:
    args = serve_args(container(deployment(), "extender")["args"])
    assert args.scheduler_name == scheduler_config()["profiles"][0]["schedulerName"]
    assert args.pin_gpus is False, "pinning is opt-in (deploy/pin-gpus)"


def test_extender_settings_keep_the_vram_ledger_authoritative() -> None:
    ext = the_extender()
    assert ext["nodeCacheCapable"] is True
    assert ext["ignorable"] is False, (
        "an ignorable extender lets GPU pods through without a reservation"
    )
    assert all(m.get("ignoredByScheduler") is False for m in ext["managedResources"])


def test_managed_resources_cover_every_resource_the_extender_places() -> None:
    managed = {m["name"] for m in the_extender()["managedResources"]}
    known = {GPU_RESOURCE, SHARED_GPU_RESOURCE} | {
        mig.resource_name(p.name) for model in mig.MODELS.values() for p in model.profiles
    }
    assert not known - managed, (
        f"pods requesting these would bypass the extender: {sorted(known - managed)}"
    )
    assert all(is_gpu_resource(n) for n in managed), (
        "a managed resource the extender does not understand"
    )


def test_weight_lets_vram_fit_outweigh_vram_blind_scorers_but_not_user_intent() -> None:
    weight = the_extender()["weight"]
    extender_span = _MAX_EXTENDER_PRIORITY * weight * (_MAX_NODE_SCORE // _MAX_EXTENDER_PRIORITY)
    blind_span = _MAX_NODE_SCORE * sum(_VRAM_BLIND_SCORERS.values())
    intent_span = _MAX_NODE_SCORE * sum(_USER_INTENT_SCORERS.values())
    assert blind_span < extender_span < intent_span, (blind_span, extender_span, intent_span)


def test_http_timeout_leaves_room_for_a_pinning_bind() -> None:
    timeout = go_duration_seconds(the_extender()["httpTimeout"])
    assert timeout >= _BIND_WRITES_WITH_PINNING * _API_WRITE_SLO_S


# ---------------------------------------------------------------------------------------------
# Every manifest parses as its Kubernetes type


@pytest.mark.parametrize("path", object_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_parses_as_its_kubernetes_type(path: Path) -> None:
    docs = load(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        check_object(doc)


def test_kustomize_renders_the_base(rendered: list[dict[str, Any]]) -> None:
    for doc in rendered:
        check_object(doc)
    expected = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in base_objects()
    }
    got = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        for o in rendered
        if o["kind"] != "ConfigMap"
    }
    assert got == expected
    cm = one(rendered, "ConfigMap")
    assert cm["metadata"]["namespace"] == "vramsched"
    assert re.fullmatch(r"vramsched-scheduler-config-[a-z0-9]{10}", cm["metadata"]["name"]), (
        "hash suffix rolls the pods"
    )
    assert cm["data"][CONFIG_KEY] == CONFIG.read_text()
    dep = one(rendered, "Deployment", "vramsched")
    pod = dep["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    mount = one(
        [
            {"kind": "m", "metadata": {"name": m["name"]}, **m}
            for m in container(dep, "kube-scheduler")["volumeMounts"]
        ],
        "m",
        volume["name"],
    )
    assert (
        f"--config={mount['mountPath']}/{CONFIG_KEY}" in container(dep, "kube-scheduler")["command"]
    )


def test_kustomize_renders_the_pinning_rbac() -> None:
    docs = kustomize(PIN)
    for doc in docs:
        check_object(doc)
    assert {d["kind"] for d in docs} == {"ClusterRole", "ClusterRoleBinding"}


def test_pinning_patch_only_adds_the_flag() -> None:
    patch = load(PIN / "extender-args.patch.yaml")[0]
    (patched,) = patch["spec"]["template"]["spec"]["containers"]
    assert set(patched) == {"name", "args"}
    base = container(deployment(), patched["name"])
    assert patched["args"] == base["args"] + ["--pin-gpus"]
    parsed = serve_args(patched["args"])
    # An explicit --replica-policy would override the --pin-gpus shorthand.
    assert parsed.pin_gpus is True and parsed.replica_policy is None


# ---------------------------------------------------------------------------------------------
# vramsched's device plugin (deploy/device-plugin)


def plugin_daemonset() -> dict[str, Any]:
    return one(load(PLUGIN / "daemonset.yaml"), "DaemonSet", "vramsched-device-plugin")


def test_kustomize_renders_the_device_plugin() -> None:
    docs = kustomize(PLUGIN)
    for doc in docs:
        check_object(doc)
    got = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}
    ns = "vramsched-device-plugin"
    assert got == {
        ("Namespace", None, ns),
        ("ServiceAccount", ns, ns),
        ("ClusterRole", None, ns),
        ("ClusterRoleBinding", None, ns),
        ("DaemonSet", ns, ns),
    }


def test_device_plugin_runs_where_labelled_with_the_kubelets_sockets() -> None:
    spec = plugin_daemonset()["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"vramsched.io/device-plugin": "true"}
    assert spec["serviceAccountName"] == "vramsched-device-plugin"
    (c,) = spec["containers"]
    assert c["command"] == ["vramsched", "device-plugin"]
    args = build_parser().parse_args(["device-plugin", *c["args"]])
    defaults = build_parser().parse_args(["device-plugin"])
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    hostpaths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    # the plugin's defaults are where the DaemonSet mounts the kubelet's folders
    assert mounts["device-plugins"] == hostpaths["device-plugins"] == defaults.device_plugin_dir
    assert (
        f"{mounts['pod-resources']}/kubelet.sock"
        == f"{hostpaths['pod-resources']}/kubelet.sock"
        == defaults.pod_resources_socket
    )
    (port,) = c["ports"]
    assert port["containerPort"] == args.probe_port
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
    assert not sc.get("privileged", False) and sc["readOnlyRootFilesystem"] is True


def test_device_plugin_role_reads_pods_and_patches_only_nodes() -> None:
    role = one(load(PLUGIN / "rbac.yaml"), "ClusterRole")
    assert sorted((tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]) == [
        (("nodes",), ("get", "patch")),
        (("pods",), ("get", "list", "watch")),
    ]
    binding = one(load(PLUGIN / "rbac.yaml"), "ClusterRoleBinding")
    assert [(s["namespace"], s["name"]) for s in binding["subjects"]] == [
        ("vramsched-device-plugin", "vramsched-device-plugin")
    ]


# ---------------------------------------------------------------------------------------------
# Pod security and availability


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


def test_upstream_scheduler_image_is_the_newest_version_the_e2e_suite_runs() -> None:
    """deploy/ ships the kube-scheduler the suite proves: bumping one without the other fails."""
    from releases import K8S_VERSIONS, NEWEST_K8S_VERSION  # tests/e2e, on sys.path (conftest)

    image = container(deployment(), "kube-scheduler")["image"]
    m = re.fullmatch(r"registry\.k8s\.io/kube-scheduler:v(\d+\.\d+\.\d+)", image)
    assert m, image
    assert (
        m[1] == NEWEST_K8S_VERSION == max(K8S_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    )
    assert tuple(map(int, m[1].split(".")))[:2] >= (1, 27), (
        "profile-level percentageOfNodesToScore needs kube-scheduler >= 1.27"
    )


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


# ---------------------------------------------------------------------------------------------
# RBAC

SA = ("vramsched", "vramsched")  # namespace, name


def rules_of(
    objs: list[dict[str, Any]], kind: str, name: str
) -> set[tuple[str, str, str, str | None]]:
    """(apiGroup, resource, verb, resourceName) for every combination a role grants."""
    out: set[tuple[str, str, str, str | None]] = set()
    for r in one(objs, kind, name)["rules"]:
        assert "nonResourceURLs" not in r
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    for n in r.get("resourceNames") or [None]:
                        out.add((g, res, v, n))
    return out


def test_extender_role_grants_exactly_what_the_extender_uses() -> None:
    assert rules_of(base_objects(), "ClusterRole", "vramsched-extender") == {
        ("", "pods", "get", None),
        ("", "pods", "list", None),
        ("", "pods", "watch", None),
        ("", "pods", "patch", None),
        ("", "pods/binding", "create", None),
        ("", "nodes", "get", None),
        ("", "nodes", "list", None),
        ("", "nodes", "watch", None),
        ("", "events", "create", None),
    }


def test_pinning_role_only_creates_and_reads_back_configmaps() -> None:
    # get: only after a 409 on create (a retried bind), to check the existing ConfigMap is this pod's.
    assert rules_of(load(PIN / "rbac.yaml"), "ClusterRole", "vramsched-extender-pinning") == {
        ("", "configmaps", "create", None),
        ("", "configmaps", "get", None),
    }
    assert not any(
        o["kind"] == "ClusterRole" and "configmaps" in str(o["rules"]) for o in base_objects()
    )


def test_leader_election_role_is_limited_to_our_lease() -> None:
    le = scheduler_config()["leaderElection"]
    role = one(base_objects(), "Role", "vramsched-leader-election")
    assert role["metadata"]["namespace"] == le["resourceNamespace"]
    assert rules_of(base_objects(), "Role", "vramsched-leader-election") == {
        ("coordination.k8s.io", "leases", "create", None),
        ("coordination.k8s.io", "leases", "get", le["resourceName"]),
        ("coordination.k8s.io", "leases", "update", le["resourceName"]),
    }


def test_scheduler_is_bound_to_the_upstream_scheduler_roles() -> None:
    bound = {
        (o["kind"], o["metadata"].get("namespace"), o["roleRef"]["kind"], o["roleRef"]["name"])
        for o in base_objects() + load(PIN / "rbac.yaml")
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
    }
    assert bound == {
        ("ClusterRoleBinding", None, "ClusterRole", "system:kube-scheduler"),
        ("ClusterRoleBinding", None, "ClusterRole", "system:volume-scheduler"),
        ("RoleBinding", "kube-system", "Role", "extension-apiserver-authentication-reader"),
        ("RoleBinding", "vramsched", "Role", "vramsched-leader-election"),
        ("ClusterRoleBinding", None, "ClusterRole", "vramsched-extender"),
        ("ClusterRoleBinding", None, "ClusterRole", "vramsched-extender-pinning"),
        ("RoleBinding", "vramsched", "Role", "vramsched-webhook-certificate"),
        ("ClusterRoleBinding", None, "ClusterRole", "vramsched-webhook-ca-bundle"),
    }


def test_every_binding_is_for_the_pods_service_account_only() -> None:
    objs = base_objects() + load(PIN / "rbac.yaml")
    sa = one(objs, "ServiceAccount")
    assert (sa["metadata"]["namespace"], sa["metadata"]["name"]) == SA
    assert deployment()["spec"]["template"]["spec"]["serviceAccountName"] == SA[1]
    for o in objs:
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding"):
            assert [(s["kind"], s["namespace"], s["name"]) for s in o["subjects"]] == [
                ("ServiceAccount", *SA)
            ], o["metadata"]["name"]


def test_no_role_uses_wildcards_or_touches_secrets_but_the_webhook_certificate() -> None:
    for o in base_objects() + load(PIN / "rbac.yaml"):
        if o["kind"] in ("ClusterRole", "Role"):
            for r in o["rules"]:
                assert "*" not in r["verbs"] + r["resources"] + r["apiGroups"], o["metadata"][
                    "name"
                ]
                if o["metadata"]["name"] != "vramsched-webhook-certificate":
                    assert "secrets" not in r["resources"]
    # The one Secret the webhook keeps its certificate in, in vramsched's own namespace
    # (create cannot be limited to a name).
    role = one(base_objects(), "Role", "vramsched-webhook-certificate")
    assert role["metadata"]["namespace"] == "vramsched"
    assert rules_of(base_objects(), "Role", "vramsched-webhook-certificate") == {
        ("", "secrets", "create", None),
        ("", "secrets", "get", "vramsched-webhook-tls"),
        ("", "secrets", "update", "vramsched-webhook-tls"),
    }
    assert rules_of(base_objects(), "ClusterRole", "vramsched-webhook-ca-bundle") == {
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "get", "vramsched"),
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch", "vramsched"),
    }


# ---------------------------------------------------------------------------------------------
# Examples


def test_examples_request_only_managed_resources_through_vramsched() -> None:
    managed = {m["name"] for m in the_extender()["managedResources"]}
    profile = scheduler_config()["profiles"][0]["schedulerName"]
    workloads = example_workloads()
    assert len(workloads) >= 3
    for path, doc in workloads:
        for meta, spec in pod_specs(doc):
            gpu = {r for r in requested_resources(spec) if is_gpu_resource(r)}
            assert gpu and gpu <= managed, f"{path.name}: {gpu}"
            assert spec["schedulerName"] == profile, path.name
            pod = admitted(meta, spec)
            demand = pod_demand(pod)
            annotations = pod["metadata"]["annotations"]
            assert demand.model_memory == parse_bytes(annotations[MODEL_MEMORY]) > 0


def admitted(meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """A workload's pod as the admission webhook lets it in (memory filled, env var added)."""
    pod = {"metadata": {"name": "x", "namespace": "default", **meta}, "spec": spec}
    decision = decide(pod)
    assert decision.allowed, decision.message
    return apply_json_patch(pod, decision.patch)


def _device_memory_bytes(spec: dict[str, Any]) -> int:
    """Memory of the device the pod lands on: from its nodeSelector (whole GPU) or the MIG node labels."""
    (resource,) = {r for r in requested_resources(spec) if is_gpu_resource(r)}
    if resource == GPU_RESOURCE:
        return int(spec["nodeSelector"]["nvidia.com/gpu.memory"]) * MIB
    labels = load(EXAMPLES / "mig-mixed-node.yaml")[0]["metadata"]["labels"]
    profile = mig.profile_from_resource(resource)
    return int(labels[f"nvidia.com/mig-{profile}.memory"]) * MIB


def test_vllm_memory_fraction_matches_the_reservation() -> None:
    checked = 0
    for path, doc in example_workloads():
        for meta, spec in pod_specs(doc):
            (vllm,) = spec["containers"]
            if "--gpu-memory-utilization" not in vllm["args"]:
                continue  # set at bind time: test_sizing_examples_*
            fraction = Fraction(flag_value(vllm["args"], "--gpu-memory-utilization"))
            reserved = parse_bytes(meta["annotations"][MODEL_MEMORY])
            budget = fraction * _device_memory_bytes(spec)
            # vLLM must stay inside its reservation, without wasting more than 10% of it.
            assert Fraction(9, 10) * reserved <= budget <= reserved, (
                f"{path.name}: {float(budget) / 2**30:.2f} GiB"
            )
            checked += 1
    assert checked >= 3


SIZING_EXAMPLES = ("vllm-sizing.yaml", "tgi-sizing.yaml", "sglang-sizing.yaml")


@pytest.mark.parametrize("name", SIZING_EXAMPLES)
def test_sizing_examples_hand_the_bind_time_fraction_to_their_engine(name: str) -> None:
    (doc,) = [d for d in load(EXAMPLES / name) if d["kind"] == "Deployment"]
    ((meta, spec),) = list(pod_specs(doc))
    decision = decide({"metadata": {"name": "x", "namespace": "default", **meta}, "spec": spec})
    assert not any("run out" in w or "cannot size" in w for w in decision.warnings), (
        decision.warnings
    )
    pod = admitted(meta, spec)
    (engine_container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in engine_container["env"]}
    assert env[FRACTION_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == FRACTION_FIELD_PATH
    invocation = pod_engine(pod)
    assert invocation is not None
    flag = FLAGS[invocation.engine]
    assert f"{flag}=$({FRACTION_ENV})" in engine_container["args"]
    # At bind, on any device the reservation fits: the engine's flag plus what it takes outside
    # the flag stays inside the reservation, and rounding wastes at most 1% of the device.
    per_gpu = pod_demand(pod).bytes_per_gpu
    assert per_gpu is not None
    checked = 0
    for device in (24 * 2**30, 40 * 2**30, 48 * 2**30, 80 * 2**30, 141 * 2**30):
        if per_gpu > device:
            continue
        share = Fraction(pod_fraction(pod, [(per_gpu, device)]))
        used = share * device * (Fraction(90, 100) if invocation.engine == "tgi" else 1)
        used += outside(invocation.settings, device)
        assert used <= per_gpu, (name, device)
        assert per_gpu - used <= device / 100 + (
            device * share / 10 if invocation.engine == "tgi" else 0
        )
        checked += 1
    assert checked >= 2


def webhook_configuration() -> dict[str, Any]:
    return one(base_objects(), "MutatingWebhookConfiguration", "vramsched")


def test_webhook_is_scoped_to_vramsched_pods_and_never_blocks_creation() -> None:
    (hook,) = webhook_configuration()["webhooks"]
    profile = scheduler_config()["profiles"][0]["schedulerName"]
    assert (hook["failurePolicy"], hook["sideEffects"]) == ("Ignore", "None")
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    (condition,) = hook["matchConditions"]
    assert condition["expression"] == f"object.spec.schedulerName == '{profile}'"
    assert hook["timeoutSeconds"] <= 10


def test_webhook_service_reaches_the_extenders_webhook_listener() -> None:
    (hook,) = webhook_configuration()["webhooks"]
    ref = hook["clientConfig"]["service"]
    assert ref["path"] == MUTATE_PATH
    assert "caBundle" not in hook["clientConfig"]  # written by vramsched at start-up
    svc = one(base_objects(), "Service", ref["name"])
    assert svc["metadata"]["namespace"] == ref["namespace"]
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]]
    dep = deployment()
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    ext = container(dep, "extender")
    ports = {p["name"]: p["containerPort"] for p in ext["ports"]}
    args = serve_args(ext["args"])
    check_arguments(args)  # SystemExit if the flags could not work together
    assert ports[port["targetPort"]] == args.webhook_port
    assert args.webhook_host == "0.0.0.0"
    assert args.webhook_service == f"{ref['name']}.{ref['namespace']}"
    assert args.webhook_configuration == webhook_configuration()["metadata"]["name"]
    role = one(base_objects(), "Role", "vramsched-webhook-certificate")
    namespace, secret = args.webhook_secret.split("/")
    assert namespace == role["metadata"]["namespace"]
    assert [secret] == [r for rule in role["rules"] for r in rule.get("resourceNames", [])][:1]


def test_time_slicing_example_shares_a_managed_resource() -> None:
    managed = {m["name"] for m in the_extender()["managedResources"]}
    cm = load(EXAMPLES / "time-slicing-config.yaml")[0]
    for key, text in cm["data"].items():
        cfg = yaml.safe_load(text)
        assert cfg["version"] == "v1", key
        ts = cfg["sharing"]["timeSlicing"]
        assert ts["failRequestsGreaterThanOne"] is True
        for r in ts["resources"]:
            assert r["replicas"] >= 2
            advertised = r["name"] + ".shared" if ts.get("renameByDefault") else r["name"]
            assert advertised in managed
    # the vLLM example selects the nodes this config produces
    node_labels = {"nvidia.com/gpu.sharing-strategy": "time-slicing"}
    dep = load(EXAMPLES / "vllm-inference.yaml")[0]
    assert node_labels.items() <= dep["spec"]["template"]["spec"]["nodeSelector"].items()


def test_mig_example_layouts_are_valid_and_match_the_example_node() -> None:
    cfg = yaml.safe_load(load(EXAMPLES / "mig-mixed-config.yaml")[0]["data"]["config.yaml"])
    node = load(EXAMPLES / "mig-mixed-node.yaml")[0]
    labels = node["metadata"]["labels"]
    layout_name = labels["nvidia.com/mig.config"]
    model = mig.model_for_product(labels["nvidia.com/gpu.product"])
    assert model is not None
    totals: Counter[str] = Counter()
    gpus = 0
    for entry in cfg["mig-configs"][layout_name]:
        assert entry["mig-enabled"] is True, "whole GPUs on a MIG node are not placed by vramsched"
        assert mig.is_valid_geometry(model, entry["mig-devices"]), entry
        for profile, count in entry["mig-devices"].items():
            totals[mig.resource_name(profile)] += count * len(entry["devices"])
        gpus += len(entry["devices"])
    alloc = {
        k: int(v)
        for k, v in node["status"]["allocatable"].items()
        if k.startswith("nvidia.com/mig-")
    }
    assert alloc == dict(totals)
    assert int(labels["nvidia.com/gpu.count"]) == gpus
    inv = node_inventory(node)
    assert inv.problem is None and inv.gpu_count == gpus
    assert Counter(d.resource for d in inv.devices) == totals
    for d in inv.devices:
        assert d.memory_bytes == int(labels[f"nvidia.com/mig-{d.profile}.memory"]) * MIB


def test_pinned_example_reads_the_configmap_named_after_the_pod() -> None:
    pod = load(EXAMPLES / "pinned-inference.yaml")[0]
    assert pod["kind"] == "Pod", "the ConfigMap name needs the pod name, known only for bare Pods"
    (vllm,) = pod["spec"]["containers"]
    refs = [e["configMapRef"] for e in vllm["envFrom"]]
    assert refs == [{"name": f"vramsched-{pod['metadata']['name']}", "optional": False}]


def test_pinned_deployment_example_reads_the_gpu_index_annotation() -> None:
    dep = load(EXAMPLES / "pinned-deployment.yaml")[0]
    assert dep["kind"] == "Deployment", (
        "the downward-API form is the one that works without per-pod names"
    )
    ((meta, spec),) = pod_specs(dep)
    pod = {"metadata": {"name": "any-random-name", "namespace": "default", **meta}, "spec": spec}
    demand = pod_demand(pod)
    assert demand.pin_annotation and demand.pin_configmap  # pinned pod, no ConfigMap needed
    assert not any("envFrom" in c for c in spec["containers"])
    assert "vramsched.io/gpu-index" not in meta.get("annotations", {}), (
        "vramsched writes it at bind time"
    )
    # Pinning happens only on time-sliced GPUs: the example must select them.
    assert spec["nodeSelector"]["nvidia.com/gpu.sharing-strategy"] == "time-slicing"


# ---------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile() -> list[str]:
    """Instructions, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_base_is_a_pinned_slim_python() -> None:
    lines = dockerfile()
    (arg,) = [line for line in lines if line.startswith("ARG PYTHON_IMAGE=")]
    base = arg.split("=", 1)[1]
    m = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base)
    assert m, f"base image not pinned to a patch release of a slim image: {base}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={m[1]}.{m[2]}"
    assert all(line.split()[1] == "${PYTHON_IMAGE}" for line in lines if line.startswith("FROM"))


def test_dockerfile_runs_as_the_deployments_non_root_user() -> None:
    users = [line.split()[1] for line in dockerfile() if line.startswith("USER")]
    uid, gid = users[-1].split(":")
    sc = deployment()["spec"]["template"]["spec"]["securityContext"]
    assert (int(uid), int(gid)) == (sc["runAsUser"], sc["runAsGroup"]) and int(uid) != 0


def test_dockerfile_entrypoint_is_what_the_deployment_runs() -> None:
    (entry,) = [line for line in dockerfile() if line.startswith("ENTRYPOINT")]
    assert yaml.safe_load(entry.split(None, 1)[1]) == ["vramsched", "serve"]
    assert container(deployment(), "extender")["command"] == ["vramsched", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vramsched"] == "extender.cli:main"


def test_docker_build_context_has_what_pip_install_needs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {
        inc.rstrip("*") for inc in project["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied: set[str] = set()
    for line in dockerfile():
        if line.startswith("COPY") and "--from=" not in line:
            copied |= {s.rstrip("/").removeprefix("./") for s in line.split()[1:-1]}
    assert needed <= copied, f"not copied into the build stage: {needed - copied}"
    ignored = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    assert not needed & set(ignored), f".dockerignore drops {needed & set(ignored)}"
    assert {".git", ".venv"} <= set(ignored)


def test_deploy_docs_name_only_files_that_exist() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|config)/[\w./-]*[\w/])", text))
    assert len(paths) >= 8
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/deploy.md names files that do not exist: {missing}"


# ---------------------------------------------------------------------------------------------
# End to end: the extender, started with the Deployment's arguments and holding nothing but the
# deploy RBAC, binds pods for the shipped scheduler config on a real kube-apiserver and
# kube-scheduler, on every version the e2e suite runs (tests/conftest.py).

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
