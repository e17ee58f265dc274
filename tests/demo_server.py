"""`vramsched serve --cluster config/demo-cluster.yaml` as a subprocess on a free port, with a
hand to schedule pods through its own filter and bind (as kube-scheduler would), for the tests
that need a running extender: `top --server`, and the dashboard against a real Prometheus."""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path
from typing import Any

from controlplane import free_port

from loadtest.run import _wait_ready, start_server, stop_process

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "config" / "demo-cluster.yaml"


def gpu_pod(
    name: str, memory: str, *, gpus: int = 1, namespace: str = "inference"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "annotations": {"vramsched.io/model-memory": memory},
        },
        "spec": {
            "schedulerName": "vramsched",
            "containers": [
                {
                    "name": "main",
                    "image": "vllm",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
        "status": {"phase": "Pending"},
    }


class DemoServer:
    def __init__(self, log: Path, cluster: Path = DEMO) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nodes = ["a100-ts-0", "a100-ts-1", "h100-excl-0", "h100-mps-0", "cpu-only-0"]
        self.proc = start_server(
            cluster, self.port, argparse.Namespace(planner=False, replica_policy=None), log
        )
        _wait_ready(self.url + "/readyz", self.proc, timeout=60)

    def post(self, verb: str, body: Any) -> Any:
        req = urllib.request.Request(
            f"{self.url}/{verb}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def schedule(self, pod: dict[str, Any], nodes: list[str] | None = None) -> str | None:
        """filter over `nodes` (default all), then bind to the first that passed (None: none
        did, and the pod stays pending)."""
        answer = self.post("filter", {"Pod": pod, "NodeNames": nodes or self.nodes})
        if answer.get("Error") or not answer["NodeNames"]:
            return None
        node = answer["NodeNames"][0]
        meta = pod["metadata"]
        result = self.post(
            "bind",
            {
                "PodName": meta["name"],
                "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"],
                "Node": node,
            },
        )
        assert not result.get("Error"), result
        return node

    def stop(self) -> None:
        stop_process(self.proc)
