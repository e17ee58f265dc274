"""Fixtures for the end-to-end suite: one real control plane per pytest session.

The Go build (minutes when cold, instant when cached) runs once, before the first test, in
``pytest_collection_finish`` so it is not charged to any test's timeout; the ``control_plane``
fixture runs build.sh again (a no-op by then) so it also works when used on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from controlplane import ControlPlane, build_binaries  # noqa: E402


def _wants_e2e(session: pytest.Session) -> bool:
    return any(item.get_closest_marker("e2e") for item in session.items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries up front when e2e tests were selected (cold build: a few minutes)."""
    if session.config.option.collectonly or not _wants_e2e(session):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("e2e: scripts/control-plane/build.sh (cached after the first run) ...")
    build_binaries()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver 1.20 on loopback for the whole session; everything killed after."""
    bin_dir = build_binaries()
    cp = ControlPlane(tmp_path_factory.mktemp("control-plane"), bin_dir=bin_dir)
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def cluster(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The session control plane, left clean for the next test.

    Teardown: restart the apiserver if the test stopped it, stop the scheduler, delete every
    pod in non-system namespaces (grace 0: no kubelet will confirm) and every node.
    """
    yield control_plane
    control_plane.start_apiserver()
    control_plane.stop_scheduler()
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
            lambda: not core.list_node().items
            and all(p.metadata.namespace.startswith("kube-")
                    for p in core.list_pod_for_all_namespaces().items),
            timeout=30,
            message="pods and nodes deleted after the test",
        )
