"""`kubectl vramsched top` / `why` and the leader gauge against the real control plane.

The deployed stack of test_extender_e2e (kube-scheduler 1.20 with the shipped configuration,
`vramsched serve --kubeconfig` as the deploy ServiceAccount), here with leader election on as
deploy/ runs it (Lease vramsched/vramsched) and the deploy Role that lets the pod read it. The
plugin is run through kubectl itself, found on PATH as `kubectl-vramsched`, with the admin
kubeconfig in $KUBECONFIG, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane
from test_extender_e2e import (
    NS,
    SA_NAME,
    Extender,
    _grant_extender_rbac,
    add_node,
    core,
    gpu_pod,
    scheduler_config,
    scheduling_events,
    wait_bound,
)

from extender.observe.usage import report_dict, sort_nodes, summarize, usage_from_state

GIB = 1 << 30
#: printed by the test for docs/observe.md and the README (pytest -s)
CAPTURE = os.environ.get("VRAMSCHED_CAPTURE")


def _grant_lease_role(cp: ControlPlane) -> None:
    """deploy/rbac.yaml's leader-election Role and RoleBinding, as shipped (the extender's pod
    shares kube-scheduler's ServiceAccount, so it may read the Lease)."""
    docs = [
        d
        for d in yaml.safe_load_all((REPO_ROOT / "deploy" / "rbac.yaml").read_text())
        if d and d["metadata"]["name"] == "vramsched-leader-election"
    ]
    assert {d["kind"] for d in docs} == {"Role", "RoleBinding"}
    cp.create_rbac(docs)
    assert docs[1]["subjects"][0]["name"] == SA_NAME


@pytest.fixture
def elected(cluster: ControlPlane) -> Iterator[tuple[ControlPlane, Extender]]:
    kubeconfig = _grant_extender_rbac(cluster)
    _grant_lease_role(cluster)
    ext = Extender(cluster, kubeconfig, [])  # default --leader-lease vramsched/vramsched
    ext.start()
    cluster.start_scheduler(scheduler_config(ext.url), leader_elect=True)
    try:
        yield cluster, ext
    finally:
        ext.stop()


def kubectl(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    bindir = Path(sys.executable).parent
    env = dict(
        os.environ,
        KUBECONFIG=str(cp.kubeconfig_path),
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        COLUMNS="200",
    )
    return subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, timeout=120)


def metric(ext: Extender, name: str) -> float | None:
    with urllib.request.urlopen(ext.url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.e2e
def test_top_why_and_leader_on_a_real_cluster(elected: tuple[ControlPlane, Extender]) -> None:
    cp, ext = elected
    add_node(cp, "a100", "NVIDIA-A100-SXM4-80GB", count=2, memory_mib=81920)
    add_node(cp, "l4-ts", "NVIDIA-L4", count=1, memory_mib=23034, replicas=4)
    api = core(cp)
    api.create_namespaced_pod(NS, gpu_pod("llama-70b-awq", "60Gi"))
    api.create_namespaced_pod(NS, gpu_pod("mixtral-awq", "30Gi"))
    assert set(wait_bound(cp, api, ["llama-70b-awq", "mixtral-awq"]).values()) == {"a100"}
    api.create_namespaced_pod(NS, gpu_pod("phi-3", "16Gi"))
    assert wait_bound(cp, api, ["phi-3"])["phi-3"] == "l4-ts"  # both A100s are taken (exclusive)
    api.create_namespaced_pod(NS, gpu_pod("mistral-7b", "10Gi"))
    events = cp.wait_for(
        lambda: scheduling_events(api, "mistral-7b"), timeout=60, message="mistral-7b refused"
    )

    # top, through kubectl's plugin lookup: the extender's own ledger, figure for figure
    top = kubectl(cp, "vramsched", "top", "-o", "json")
    assert top.returncode == 0, top.stderr
    state = ext.get("/state")
    nodes = sort_nodes(usage_from_state(state))
    assert json.loads(top.stdout) == report_dict(nodes, summarize(nodes))
    summary = json.loads(top.stdout)["summary"]
    assert (summary["gpusInUse"], summary["gpusFree"], summary["pods"]) == (3, 0, 3)
    # an exclusive A100 holding 30Gi strands the other 50Gi; the 60Gi pod's GPU strands 20Gi
    assert summary["strandedBytes"] == 70 * GIB
    text = kubectl(cp, "vramsched", "top")
    assert text.returncode == 0 and "\x1b[" not in text.stdout
    assert "default/phi-3 16Gi" in text.stdout

    # why: the reason kube-scheduler put in the event, the closest node and who is in the way
    why = kubectl(cp, "vramsched", "why", "-n", NS, "mistral-7b", "-o", "json")
    assert why.returncode == 0, why.stderr
    doc = json.loads(why.stdout)
    assert doc["feasible"] == []
    l4_reason = next(r["reason"] for r in doc["reasons"] if "l4-ts" in r["nodes"])
    assert any(l4_reason in m for m in events), (l4_reason, events)
    assert doc["closest"]["node"] == "l4-ts"
    assert [p["pod"] for p in doc["closest"]["remove"]] == ["default/phi-3"]
    plain = kubectl(cp, "vramsched", "why", "-n", NS, "mistral-7b")
    assert plain.returncode == 0 and l4_reason in plain.stdout
    assert "fits once default/phi-3 (16Gi) is gone" in plain.stdout
    if CAPTURE:
        Path(CAPTURE).write_text(
            f"$ kubectl vramsched top\n{text.stdout}\n$ kubectl vramsched why -n {NS} mistral-7b\n"
            f"{plain.stdout}\n# the pod's event: {events[-1]}\n"
        )

    # the pending class filter noted, and the leader: this host's kube-scheduler holds the Lease
    cp.wait_for(lambda: metric(ext, 'vramsched_pods_pending{reason="vram"}') == 1, timeout=30)
    cp.wait_for(
        lambda: cp.scheduler_lease_holder("vramsched", "vramsched"), timeout=60, message="lease"
    )
    cp.wait_for(lambda: metric(ext, "vramsched_leader") == 1, timeout=30, message="leader 1")
    cp.stop_scheduler(keep_lease=True)  # the Lease stays, as after a replica's crash
    with cp.api_client() as client:
        coord = kubernetes.client.CoordinationV1Api(client)
        coord.patch_namespaced_lease(
            "vramsched", "vramsched", {"spec": {"holderIdentity": "other-replica_1234"}}
        )
    try:
        cp.wait_for(lambda: metric(ext, "vramsched_leader") == 0, timeout=30, message="leader 0")
    finally:  # a later test's scheduler must not wait out this holder
        with cp.api_client() as client:
            kubernetes.client.CoordinationV1Api(client).delete_namespaced_lease(
                "vramsched", "vramsched"
            )
