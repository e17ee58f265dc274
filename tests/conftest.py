"""One real control plane per pytest session, shared by the end-to-end suite (tests/e2e) and
the deploy tests that bind with nothing but the shipped RBAC (tests/test_deploy.py).

The Go build (minutes when cold, instant when cached) runs once, before the first test, in
``pytest_collection_finish`` so it is not charged to any test's timeout; the ``control_plane``
fixture runs build.sh again (a no-op by then) so it also works when used on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

from controlplane import ControlPlane, build_binaries


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
