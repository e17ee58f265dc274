"""deploy/'s RBAC grants exactly what the extender, the pinning hand-off, leader election and the
webhook's certificate use, and only to the pods' ServiceAccount.
"""

from __future__ import annotations

from typing import Any

from deploy_objects import (
    PIN,
    SA,
    base_objects,
    deployment,
    load,
    one,
    scheduler_config,
)


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


def test_pinning_role_only_creates_reads_back_and_repins_configmaps() -> None:
    # get: only after a 409 on create (a retried bind), to check the existing ConfigMap is this
    # pod's; patch: only when it is, but pins the GPUs of an earlier bind that did not land.
    assert rules_of(load(PIN / "rbac.yaml"), "ClusterRole", "vramsched-extender-pinning") == {
        ("", "configmaps", "create", None),
        ("", "configmaps", "get", None),
        ("", "configmaps", "patch", None),
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
