"""`vramsched serve` started with something it cannot use (a certificate that is not one, an
address it cannot listen on, a kubeconfig that is not one) stops with one line naming the flags,
not a traceback. Run as a process, as an operator starts it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "config" / "demo-cluster.yaml"
README = ROOT / "README.md"


def serve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extender", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.pem"],
            "--tls-cert/--tls-key: cannot load them: [Errno 2] No such file or directory",
        ),
        (
            ["--tls-cert", str(README), "--tls-key", str(README)],
            "--tls-cert/--tls-key: cannot load them: [SSL]",
        ),
        (["--host", "999.1.1.1"], "--host/--port: cannot listen on 999.1.1.1:0:"),
    ],
)
def test_serve_names_what_it_cannot_use(argv: list[str], says: str) -> None:
    done = serve("--cluster", str(DEMO), "--port", "0", *argv)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1].startswith(says)


def test_a_port_in_use_is_one_line(taken_port: int) -> None:
    for flags, argv in (
        ("--host/--port", ["--port", str(taken_port)]),
        (
            "--metrics-host/--metrics-port",
            ["--port", "0", "--metrics-host", "127.0.0.1", "--metrics-port", str(taken_port)],
        ),
    ):
        done = serve("--cluster", str(DEMO), *argv)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"{flags}: cannot listen on 127.0.0.1:{taken_port}:"), last
        assert "address already in use" in last


@pytest.mark.parametrize("kubeconfig", ["/nonexistent/kubeconfig", str(README)])
def test_a_kubeconfig_that_is_not_one_is_one_line(kubeconfig: str) -> None:
    done = serve("--kubeconfig", kubeconfig, "--port", "0")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"cannot load the Kubernetes client configuration from {kubeconfig}: ")
    )


def test_an_unknown_log_level_is_refused_while_parsing() -> None:
    done = serve("--cluster", str(DEMO), "--log-level", "loud")
    assert done.returncode == 2
    assert "argument --log-level: invalid choice: 'loud'" in done.stderr


def test_a_cluster_file_it_cannot_use_is_one_line(tmp_path: Path) -> None:
    """The file's path once, then what is wrong with it (it was named twice)."""
    missing = tmp_path / "missing.yaml"
    twice = tmp_path / "twice.yaml"
    node = {"kind": "Node", "metadata": {"name": "n"}}
    twice.write_text(f"kind: List\nitems: [{node}, {node}]\n")
    for path, says in (
        (missing, f"cannot load {missing}: No such file or directory"),
        (twice, f"cannot load {twice}: node n is given more than once"),
    ):
        done = serve("--cluster", str(path), "--port", "0")
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1] == says
