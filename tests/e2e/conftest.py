"""The end-to-end suite's per-test fixture; the session control plane is in tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes.client
import pytest
from controlplane import ControlPlane


@pytest.fixture
def cluster(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The session control plane, left clean for the next test.

    Teardown: restart the apiserver if the test stopped it, stop the scheduler and the controller
    manager, delete every pod in non-system namespaces (grace 0: no kubelet will confirm) and
    every node.
    """
    yield control_plane
    control_plane.start_apiserver()
    control_plane.stop_scheduler()
    control_plane.stop_controller_manager()
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        for pod in core.list_pod_for_all_namespaces().items:
            if pod.metadata.namespace.startswith("kube-"):
                continue
            core.delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
            )
        for node in core.list_node().items:
            core.delete_node(node.metadata.name)
        control_plane.wait_for(
            lambda: (
                not core.list_node().items
                and all(
                    p.metadata.namespace.startswith("kube-")
                    for p in core.list_pod_for_all_namespaces().items
                )
            ),
            timeout=30,
            message="pods and nodes deleted after the test",
        )
