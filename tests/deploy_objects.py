"""What the deploy tests read (deploy/ and config/ as objects) and the helpers they share.

`kubectl kustomize` must render the base with whatever kubectl the machine has (CI installs
Debian's kubernetes-client, 1.20 with kustomize v2.0.3; `KUBECTL=/path` overrides).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import ApiClient

from extender.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
EXAMPLES = DEPLOY / "examples"
PIN = DEPLOY / "pin-gpus"
ASSIGNMENT_POLICY = DEPLOY / "assignment-policy"
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
    (
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicy",
    ): "V1ValidatingAdmissionPolicy",
    (
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicyBinding",
    ): "V1ValidatingAdmissionPolicyBinding",
}
_API = ApiClient()


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


SA = ("vramsched", "vramsched")  # namespace, name
