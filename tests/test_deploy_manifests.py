"""Every manifest under deploy/ parses as the Kubernetes type it claims (no field silently
dropped), `kubectl kustomize` renders the base and the pin-gpus overlay, and docs/deploy.md
names only files that exist.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from deploy_objects import (
    ASSIGNMENT_POLICY,
    CONFIG,
    CONFIG_KEY,
    DEPLOY,
    PIN,
    ROOT,
    base_objects,
    check_object,
    container,
    deployment,
    kustomize,
    load,
    object_files,
    one,
    serve_args,
)

from extender.demand import ASSIGNMENT, GPU_INDEX
from extender.sizing.handoff import FRACTION_ANNOTATION


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kustomize(DEPLOY)


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


def test_the_assignment_policy_guards_what_bind_writes_for_the_extenders_account() -> None:
    """deploy/assignment-policy names the ServiceAccount the base runs the extender as, and the
    annotations bind writes (their real behaviour: tests/e2e/test_assignment_policy_e2e.py)."""
    docs = kustomize(ASSIGNMENT_POLICY)
    for doc in docs:
        check_object(doc)
    policy = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    account = one(base_objects(), "ServiceAccount")["metadata"]
    assert deployment()["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]
    (rule,) = policy["spec"]["validations"]
    user = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    assert f"request.userInfo.username == '{user}'" in rule["expression"]
    (changed,) = policy["spec"]["variables"]
    written = set(re.findall(r"'(vramsched\.io/[\w.-]+)'", changed["expression"]))
    assert written == {ASSIGNMENT, GPU_INDEX, FRACTION_ANNOTATION}


def test_pinning_patch_only_adds_the_flag() -> None:
    patch = load(PIN / "extender-args.patch.yaml")[0]
    (patched,) = patch["spec"]["template"]["spec"]["containers"]
    assert set(patched) == {"name", "args"}
    base = container(deployment(), patched["name"])
    assert patched["args"] == base["args"] + ["--pin-gpus"]
    parsed = serve_args(patched["args"])
    # An explicit --replica-policy would override the --pin-gpus shorthand.
    assert parsed.pin_gpus is True and parsed.replica_policy is None


def test_deploy_docs_name_only_files_that_exist() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|config)/[\w./-]*[\w/])", text))
    assert len(paths) >= 8
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/deploy.md names files that do not exist: {missing}"
