"""deploy/assignment-policy against a real kube-apiserver: only the extender's ServiceAccount may
change the annotations bind writes on a pod (docs/security.md). Kubernetes 1.36 only:
ValidatingAdmissionPolicy v1 exists from 1.30.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from controlplane import ControlPlane
from kubernetes.client.rest import ApiException

from extender.demand import ASSIGNMENT, GPU_INDEX
from extender.sizing.handoff import FRACTION_ANNOTATION

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.k8s("1.36", reason="ValidatingAdmissionPolicy v1 exists from 1.30"),
]

POLICY = Path(__file__).resolve().parents[2] / "deploy" / "assignment-policy" / "policy.yaml"
VRAMSCHED = "system:serviceaccount:vramsched:vramsched"
BOOKED = '{"node":"gpu-a","devices":["0"],"bytesPerDevice":[21474836480]}'


@pytest.fixture
def policy(cluster: ControlPlane) -> Iterator[None]:
    """The shipped policy and its binding, and cluster-admin for the ServiceAccount it names
    (impersonated below, so RBAC never refuses what the policy would allow)."""
    docs = list(yaml.safe_load_all(POLICY.read_text()))
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "vramsched-policy-test"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "cluster-admin",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "vramsched", "namespace": "vramsched"}],
    }
    with cluster.api_client() as client:
        admission = kubernetes.client.AdmissionregistrationV1Api(client)
        rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        admission.create_validating_admission_policy(docs[0])
        admission.create_validating_admission_policy_binding(docs[1])
        rbac.create_cluster_role_binding(role)
        try:
            yield
        finally:
            admission.delete_validating_admission_policy_binding(docs[1]["metadata"]["name"])
            admission.delete_validating_admission_policy(docs[0]["metadata"]["name"])
            rbac.delete_cluster_role_binding(role["metadata"]["name"])


def annotate(cluster: ControlPlane, annotations: dict[str, Any], user: str | None = None) -> None:
    with cluster.api_client() as client:
        if user is not None:
            client.set_default_header("Impersonate-User", user)
        kubernetes.client.CoreV1Api(client).patch_namespaced_pod(
            "p", "default", {"metadata": {"annotations": annotations}}
        )


def refused(cluster: ControlPlane, annotations: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as caught:
        annotate(cluster, annotations)
    assert caught.value.status in (403, 422), caught.value
    return str(caught.value.body)


def test_only_vramsched_changes_the_annotations_it_books_by(
    cluster: ControlPlane, policy: None
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "annotations": {"vramsched.io/model-memory": "20Gi"}},
        "spec": {
            "schedulerName": "vramsched",
            "containers": [
                {"name": "main", "image": "vllm", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
    }
    with cluster.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod("default", pod)
    # The policy takes effect once the API server has loaded it: wait for its first refusal.
    deadline = time.monotonic() + 30
    while True:
        try:
            annotate(cluster, {ASSIGNMENT: BOOKED})
        except ApiException as exc:
            if exc.status in (403, 422):
                break
            raise
        annotate(cluster, {ASSIGNMENT: None})
        assert time.monotonic() < deadline, "the policy never refused the admin's write"
        time.sleep(0.5)
    assert "only vramsched may change vramsched.io/assignment" in refused(
        cluster, {ASSIGNMENT: BOOKED}
    )
    annotate(cluster, {ASSIGNMENT: BOOKED, GPU_INDEX: "0", FRACTION_ANNOTATION: "0.25"}, VRAMSCHED)
    # the owner (here the admin) may not rewrite, remove or add any of the three
    changed = refused(cluster, {ASSIGNMENT: BOOKED.replace("21474836480", "1")})
    assert "vramsched.io/assignment" in changed
    assert "vramsched.io/gpu-index" in refused(cluster, {GPU_INDEX: None})
    assert "vramsched.io/gpu-memory-fraction" in refused(cluster, {FRACTION_ANNOTATION: "0.9"})
    # any other change of the pod goes through, and vramsched may clear what it wrote
    annotate(cluster, {"team": "search", ASSIGNMENT: BOOKED})
    annotate(cluster, {ASSIGNMENT: None, GPU_INDEX: None, FRACTION_ANNOTATION: None}, VRAMSCHED)
    with cluster.api_client() as client:
        stored = kubernetes.client.CoreV1Api(client).read_namespaced_pod("p", "default")
    assert stored.metadata.annotations == {"vramsched.io/model-memory": "20Gi", "team": "search"}
