"""deploy/repack grants live repacking exactly the rights it adds (create Evictions, read claims
and volumes, list the volumes and what CSI attach limits need, list what default spread selects
by) to the pods' ServiceAccount, the
base role does not, and its Deployment patch only adds `--repack`."""

from __future__ import annotations

from deploy_objects import (
    DEPLOY,
    SA,
    base_objects,
    check_object,
    container,
    deployment,
    kustomize,
    load,
    one,
    serve_args,
)
from test_deploy_rbac import rules_of

REPACK = DEPLOY / "repack"


def test_repack_role_only_creates_evictions_and_reads_storage() -> None:
    objs = load(REPACK / "rbac.yaml")
    assert rules_of(objs, "ClusterRole", "vramsched-extender-repack") == {
        ("", "pods/eviction", "create", None),
        ("", "persistentvolumeclaims", "get", None),
        ("", "persistentvolumes", "get", None),
        ("", "persistentvolumes", "list", None),
        ("storage.k8s.io", "csinodes", "list", None),
        ("storage.k8s.io", "volumeattachments", "list", None),
        ("storage.k8s.io", "storageclasses", "list", None),
        ("storage.k8s.io", "csidrivers", "list", None),
        ("storage.k8s.io", "csistoragecapacities", "list", None),
        ("", "services", "list", None),
        ("", "replicationcontrollers", "list", None),
        ("apps", "replicasets", "list", None),
        ("apps", "statefulsets", "list", None),
    }
    binding = one(objs, "ClusterRoleBinding", "vramsched-extender-repack")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "vramsched-extender-repack",
    }
    namespace, name = SA
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]


def test_the_base_role_cannot_evict() -> None:
    """Repacking is off by default: without the overlay the extender can evict nothing."""
    for obj in base_objects():
        if obj["kind"] in ("ClusterRole", "Role"):
            assert "pods/eviction" not in str(obj["rules"]), obj["metadata"]["name"]


def test_kustomize_renders_the_repack_rbac() -> None:
    docs = kustomize(REPACK)
    for doc in docs:
        check_object(doc)
    assert {d["kind"] for d in docs} == {"ClusterRole", "ClusterRoleBinding"}


def test_repack_patch_only_adds_repacking_and_the_scheduler_profile() -> None:
    patch = load(REPACK / "extender-args.patch.yaml")[0]
    (patched,) = patch["spec"]["template"]["spec"]["containers"]
    assert set(patched) == {"name", "args", "volumeMounts"}
    base = container(deployment(), patched["name"])
    config = "/etc/vramsched/KubeSchedulerConfiguration.yaml"
    assert patched["args"] == base["args"] + ["--repack", "--scheduler-config", config]
    parsed = serve_args(patched["args"])
    assert parsed.repack is True and parsed.kubeconfig is None  # in-cluster: live mode
    # the extender reads the very file the scheduler container mounts
    scheduler = container(deployment(), "kube-scheduler")
    (mount,) = patched["volumeMounts"]
    assert mount in scheduler["volumeMounts"] and mount["readOnly"] is True
    assert f"--config={config}" in scheduler["command"] + scheduler.get("args", [])
