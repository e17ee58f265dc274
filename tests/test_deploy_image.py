"""The images deploy/ runs: the extender's Dockerfile (a pinned slim Python, the Deployment's
non-root user and command, a build context pip can install from), and the upstream
kube-scheduler image, which must be the newest version the e2e suite runs.
"""

from __future__ import annotations

import re
import tomllib

import yaml
from deploy_objects import (
    ROOT,
    container,
    deployment,
)


def test_upstream_scheduler_image_is_the_newest_version_the_e2e_suite_runs() -> None:
    """deploy/ ships the kube-scheduler the suite proves: bumping one without the other fails."""
    from releases import K8S_VERSIONS, NEWEST_K8S_VERSION  # tests/e2e, on sys.path (conftest)

    image = container(deployment(), "kube-scheduler")["image"]
    m = re.fullmatch(r"registry\.k8s\.io/kube-scheduler:v(\d+\.\d+\.\d+)", image)
    assert m, image
    assert (
        m[1] == NEWEST_K8S_VERSION == max(K8S_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    )
    assert tuple(map(int, m[1].split(".")))[:2] >= (1, 27), (
        "profile-level percentageOfNodesToScore needs kube-scheduler >= 1.27"
    )


def dockerfile() -> list[str]:
    """Instructions, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_base_is_a_pinned_slim_python() -> None:
    lines = dockerfile()
    (arg,) = [line for line in lines if line.startswith("ARG PYTHON_IMAGE=")]
    base = arg.split("=", 1)[1]
    m = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base)
    assert m, f"base image not pinned to a patch release of a slim image: {base}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={m[1]}.{m[2]}"
    assert all(line.split()[1] == "${PYTHON_IMAGE}" for line in lines if line.startswith("FROM"))


def test_dockerfile_runs_as_the_deployments_non_root_user() -> None:
    users = [line.split()[1] for line in dockerfile() if line.startswith("USER")]
    uid, gid = users[-1].split(":")
    sc = deployment()["spec"]["template"]["spec"]["securityContext"]
    assert (int(uid), int(gid)) == (sc["runAsUser"], sc["runAsGroup"]) and int(uid) != 0


def test_dockerfile_entrypoint_is_what_the_deployment_runs() -> None:
    (entry,) = [line for line in dockerfile() if line.startswith("ENTRYPOINT")]
    assert yaml.safe_load(entry.split(None, 1)[1]) == ["vramsched", "serve"]
    assert container(deployment(), "extender")["command"] == ["vramsched", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vramsched"] == "extender.cli:main"


def test_docker_build_context_has_what_pip_install_needs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {
        inc.rstrip("*") for inc in project["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied: set[str] = set()
    for line in dockerfile():
        if line.startswith("COPY") and "--from=" not in line:
            copied |= {s.rstrip("/").removeprefix("./") for s in line.split()[1:-1]}
    assert needed <= copied, f"not copied into the build stage: {needed - copied}"
    ignored = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    assert not needed & set(ignored), f".dockerignore drops {needed & set(ignored)}"
    assert {".git", ".venv"} <= set(ignored)
