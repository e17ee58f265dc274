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
from deploy_objects import CONFIG, container, deployment
from kubernetes.client.rest import ApiException
from test_deploy_e2e import E2E_GPU_LABELS, _start_extender, rbac_cluster  # noqa: F401 (fixture)

from extender.demand import ASSIGNMENT, GPU_INDEX
from extender.inventory import GPU_RESOURCE
from extender.sizing.handoff import FRACTION_ANNOTATION

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.k8s("1.36", reason="ValidatingAdmissionPolicy v1 exists from 1.30"),
]

POLICY = Path(__file__).resolve().parents[2] / "deploy" / "assignment-policy" / "policy.yaml"
VRAMSCHED = "system:serviceaccount:vramsched:vramsched"
BOOKED = '{"node":"gpu-a","devices":["0"],"bytesPerDevice":[21474836480]}'


def gpu_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {"vramsched.io/model-memory": "20Gi"}},
        "spec": {
            "schedulerName": "vramsched",
            "containers": [
                {"name": "main", "image": "vllm", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
    }


@pytest.fixture
def policy(cluster: ControlPlane) -> Iterator[None]:
    """The shipped policy and its binding, once the API server enforces them (a probe pod's
    assignment written by the admin is refused)."""
    docs = list(yaml.safe_load_all(POLICY.read_text()))
    with cluster.api_client() as client:
        admission = kubernetes.client.AdmissionregistrationV1Api(client)
        core = kubernetes.client.CoreV1Api(client)
        admission.create_validating_admission_policy(docs[0])
        admission.create_validating_admission_policy_binding(docs[1])
        try:
            core.create_namespaced_pod("default", gpu_pod("probe"))
            deadline = time.monotonic() + 30
            while True:
                try:
                    # added, then removed: either write refused means the policy is enforced
                    # (it may start to be between the two)
                    annotate(cluster, {ASSIGNMENT: BOOKED}, pod="probe")
                    annotate(cluster, {ASSIGNMENT: None}, pod="probe")
                except ApiException as exc:
                    if exc.status in (403, 422):
                        break
                    raise
                assert time.monotonic() < deadline, "the policy never refused the admin's write"
                time.sleep(0.5)
            core.delete_namespaced_pod("probe", "default", grace_period_seconds=0)
            yield
        finally:
            admission.delete_validating_admission_policy_binding(docs[1]["metadata"]["name"])
            admission.delete_validating_admission_policy(docs[0]["metadata"]["name"])


@pytest.fixture
def sa_may_patch_pods(cluster: ControlPlane) -> Iterator[None]:
    """cluster-admin for the ServiceAccount the policy names (impersonated below), so RBAC never
    refuses what the policy would allow."""
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
        rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        rbac.create_cluster_role_binding(role)
        try:
            yield
        finally:
            rbac.delete_cluster_role_binding(role["metadata"]["name"])


def annotate(
    cluster: ControlPlane, annotations: dict[str, Any], user: str | None = None, pod: str = "p"
) -> None:
    with cluster.api_client() as client:
        if user is not None:
            client.set_default_header("Impersonate-User", user)
        kubernetes.client.CoreV1Api(client).patch_namespaced_pod(
            pod, "default", {"metadata": {"annotations": annotations}}
        )


def refused(cluster: ControlPlane, annotations: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as caught:
        annotate(cluster, annotations)
    assert caught.value.status in (403, 422), caught.value
    return str(caught.value.body)


def test_only_vramsched_changes_the_annotations_it_books_by(
    cluster: ControlPlane, policy: None, sa_may_patch_pods: None
) -> None:
    with cluster.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod("default", gpu_pod("p"))
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


def test_the_extender_binds_under_the_policy(rbac_cluster: Any, policy: None) -> None:
    """The extender as deployed (its own ServiceAccount token, the deploy role alone) binds a pod
    while the policy is enforced; the owner's rewrite of the assignment is then refused."""
    cp = rbac_cluster
    cp.create_gpu_node("a100-ts-0", E2E_GPU_LABELS, {GPU_RESOURCE: 4})
    url = _start_extender(cp, container(deployment(), "extender")["args"])
    cp.start_scheduler(CONFIG.read_text(), extender_url=url)
    with cp.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespaced_pod("default", gpu_pod("p"))
        cp.wait_for(
            lambda: core.read_namespaced_pod("p", "default").spec.node_name,
            timeout=60,
            message=f"p bound under the policy\n{cp.extender.describe()}",
        )
        written = core.read_namespaced_pod("p", "default").metadata.annotations[ASSIGNMENT]
    assert written == BOOKED.replace("gpu-a", "a100-ts-0")  # 20 GiB on GPU 0
    lowered = written.replace("21474836480", "1073741824")
    assert "only vramsched may change vramsched.io/assignment" in refused(cp, {ASSIGNMENT: lowered})
