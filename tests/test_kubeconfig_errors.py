"""Every command that talks to the API server reports a client configuration it cannot load as
one line naming where it looked and why (`api_client.load_client`), never a traceback: serve,
device-plugin, top/why/plan-defrag's `--kubeconfig`, and the webhook's certificate bootstrap."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from extender.cli import main
from extender.cluster import ClusterState
from extender.live.api_client import ClientApi, KubeconfigError, load_client
from extender.webhook.launch import start_webhook

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "cannot load the Kubernetes client configuration from "


def bad_configs(tmp_path: Path) -> dict[str, Path]:
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: v1\nclusters: [\n  - name: a\n    cluster: {server: x\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    return {"missing": tmp_path / "no" / "kubeconfig", "broken": broken, "empty": empty}


@pytest.mark.parametrize("kind", ["missing", "broken", "empty"])
def test_a_kubeconfig_that_is_not_one_is_one_line_naming_it(tmp_path, kind):
    path = bad_configs(tmp_path)[kind]
    with pytest.raises(KubeconfigError) as caught:
        load_client(str(path))
    message = str(caught.value)
    assert message.startswith(f"{PREFIX}{path}: ") and "\n" not in message
    assert len(message) > len(f"{PREFIX}{path}: ")  # says why
    with pytest.raises(KubeconfigError):
        ClientApi(str(path))


def test_without_a_kubeconfig_outside_a_cluster_the_service_account_is_named(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(KubeconfigError, match=f"^{PREFIX}the in-cluster ServiceAccount: "):
        load_client(None)


def test_plan_defrag_top_and_why_say_it_in_one_line(tmp_path, capsys):
    path = bad_configs(tmp_path)["broken"]
    for argv in (
        ["plan-defrag", "--kubeconfig", str(path)],
        ["top", "--kubeconfig", str(path)],
        ["why", "ns/pod", "--kubeconfig", str(path)],
    ):
        assert main(argv) != 0, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1, (argv, err)
        assert f"{PREFIX}{path}: " in err, (argv, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extender", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_device_plugin_stops_with_the_line(tmp_path):
    path = bad_configs(tmp_path)["broken"]
    done = run("device-plugin", "--node-name", "n", "--fake-gpus", "1", "--kubeconfig", str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{PREFIX}{path}: " in done.stderr.strip().splitlines()[-1], done.stderr


def test_the_webhook_bootstrap_stops_with_the_line(tmp_path):
    # serve loads the same kubeconfig first; this is the webhook's own load, reached directly
    path = bad_configs(tmp_path)["broken"]
    args = argparse.Namespace(
        webhook_port=free_port(),
        webhook_secret="vramsched/webhook-cert",
        kubeconfig=str(path),
    )
    with pytest.raises(SystemExit) as stopped:
        asyncio.run(start_webhook(args, ClusterState()))
    assert str(stopped.value.code).startswith(f"webhook certificate: {PREFIX}{path}: ")
