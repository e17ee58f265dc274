"""One real control plane per Kubernetes version per pytest session, shared by the end-to-end
suite (tests/e2e) and the deploy tests that bind with nothing but the shipped RBAC
(tests/test_deploy_e2e.py).

Every test that uses the ``control_plane`` fixture (directly or through ``cluster``) runs once per
version in ``K8S_VERSIONS`` (ids ``k8s-1.20``, ``k8s-1.36``). Tests are grouped by version
(pytest orders session-parametrised tests so), so only one control plane runs at a time: the one
for 1.20 is stopped before 1.36's starts. A test that only makes sense on some versions says so
with ``@pytest.mark.k8s("1.36", reason=...)``: its runs for the other versions are deselected
(not collected as tests at all) and the terminal summary lists them with that reason.

The binaries (1.20: a Go build, minutes when cold; 1.36: unpacked, seconds) are prepared once,
before the first test, in ``pytest_collection_finish`` so that is not charged to any test's
timeout; the fixture runs the scripts again (a no-op by then) so it also works on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

from controlplane import ControlPlane, build_binaries
from releases import K8S_VERSIONS


def version_id(version: str) -> str:
    """``1.36.3`` -> ``k8s-1.36`` (the test id suffix)."""
    return "k8s-" + ".".join(version.split(".")[:2])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "k8s(*minors, reason): run only on these Kubernetes minors (e.g. '1.36'); "
        "the reason says why the runs for the others are deselected",
    )


def _versions_wanted(session: pytest.Session) -> list[str]:
    wanted = []
    for item in session.items:
        if item.get_closest_marker("e2e") is None:
            continue
        callspec = getattr(item, "callspec", None)
        version = callspec.params.get("control_plane") if callspec else None
        for v in [version] if version else K8S_VERSIONS:
            if v not in wanted:
                wanted.append(v)
    return wanted


def pytest_collection_finish(session: pytest.Session) -> None:
    """Prepare the binaries up front for the versions selected (cold 1.20 build: minutes)."""
    if session.config.option.collectonly:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for version in _versions_wanted(session):
        if reporter is not None:
            reporter.write_line(f"e2e: Kubernetes {version} binaries (cached after the first run)")
        build_binaries(version)


@pytest.fixture(scope="session", params=K8S_VERSIONS, ids=version_id)
def control_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver of one version on loopback for the session; everything killed after."""
    version = request.param
    bin_dir = build_binaries(version)
    cp = ControlPlane(
        tmp_path_factory.mktemp(f"control-plane-{version}"), version=version, bin_dir=bin_dir
    )
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def _not_for_its_version(item: pytest.Item) -> str | None:
    """Why this run of a ``@pytest.mark.k8s(...)`` test is for a version it does not name, else
    None."""
    marker = item.get_closest_marker("k8s")
    callspec = getattr(item, "callspec", None)
    if marker is None or callspec is None or "control_plane" not in callspec.params:
        return None
    minor = ".".join(callspec.params["control_plane"].split(".")[:2])
    if minor in marker.args:
        return None
    return f"Kubernetes {minor}: {marker.kwargs.get('reason', 'not for this version')}"


_NOT_FOR_VERSION: list[tuple[str, str]] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the runs of version-marked tests on the versions they do not name: they are not
    tests of those versions, so they are neither run nor reported as skipped."""
    keep, drop = [], []
    for item in items:
        reason = _not_for_its_version(item)
        if reason is None:
            keep.append(item)
        else:
            drop.append(item)
            _NOT_FOR_VERSION.append((item.nodeid, reason))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _NOT_FOR_VERSION:
        terminalreporter.section("not for this Kubernetes version (deselected)")
        for nodeid, reason in _NOT_FOR_VERSION:
            terminalreporter.write_line(f"{nodeid}: {reason}")
