"""vramsched against a real control plane: etcd + kube-apiserver + kube-scheduler, on every
Kubernetes version the suite runs (1.20 and 1.36: the `control_plane` fixture is parametrised).

The secondary kube-scheduler runs config/KubeSchedulerConfiguration.yaml with leader election on
(urlPrefix pointed at a `vramsched serve --kubeconfig` subprocess; 1.36 loads the file as shipped
plus that overlay, 1.20 reads it translated to v1beta1). The
extender runs as a ServiceAccount bound to the ClusterRoles of deploy/rbac.yaml (and
deploy/pin-gpus/rbac.yaml), so these tests also prove the manifests grant enough and no more is
needed. Nodes are fake (labels + status, no kubelet): binding only writes spec.nodeName.

Every test checks the invariant on the API's own state: the ledger rebuilt from the pods'
annotations (extender.cluster + check_invariant) and, for time-sliced GPUs, the worst case the
device plugin could produce (extender.stock_plugin).

Why one module of over 600 lines: its first half (cluster objects, the `Extender` process, the
`stack` fixture, the checks on the API's own state) is the deployed stack's harness, which the
other e2e modules (test_faults, test_kube_scheduler_contract, test_observe_e2e, test_sizing_e2e,
test_device_plugin_e2e) and benchmarks/device_plugin.py import from here by name; the tests below
it are the stack's own, and are where a change to the harness shows first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.watch
import orjson
import pytest
import yaml
from controlplane import REPO_ROOT, Component, ControlPlane, free_port
from fake_extender import FakeExtender

from extender.bind_event import REASON
from extender.cluster import ClusterState
from extender.inventory import ReplicaPolicy
from extender.ledger import check_invariant
from extender.placement.pin_rule import PIN_MISSING
from extender.stock_plugin import is_time_sliced, worst_case_load

GPU = "nvidia.com/gpu"
GIB = 1024**3
NS = "default"
SA_NAMESPACE, SA_NAME = "vramsched", "vramsched"


# ----- cluster objects ------------------------------------------------------------------------------


def gpu_labels(product: str, count: int, memory_mib: int, replicas: int = 1) -> dict[str, str]:
    shared = replicas > 1
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product + ("-SHARED" if shared else ""),
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": "time-slicing" if shared else "none",
    }


def add_node(
    cp: ControlPlane, name: str, product: str, count: int, memory_mib: int, replicas: int = 1
) -> None:
    cp.create_gpu_node(
        name, gpu_labels(product, count, memory_mib, replicas), {GPU: str(count * replicas)}
    )


def gpu_pod(
    name: str, memory: str | None, *, gpus: int = 1, scheduler: str = "vramsched", pin: bool = False
) -> dict[str, Any]:
    ann = {"vramsched.io/model-memory": memory} if memory else {}
    container: dict[str, Any] = {
        "name": "main",
        "image": "vllm/vllm-openai",
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {GPU: str(gpus)}},
    }
    if pin:
        container["envFrom"] = [{"configMapRef": {"name": f"vramsched-{name}"}}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": ann},
        "spec": {"schedulerName": scheduler, "containers": [container]},
    }


# ----- the extender process and the scheduler -------------------------------------------------------


def _grant_extender_rbac(cp: ControlPlane) -> Path:
    """ServiceAccount vramsched/vramsched with the extender's ClusterRoles from deploy/."""
    kubeconfig = cp.service_account_kubeconfig(SA_NAMESPACE, SA_NAME)
    wanted = {"vramsched-extender", "vramsched-extender-pinning"}
    docs = []
    for path in (
        REPO_ROOT / "deploy" / "rbac.yaml",
        REPO_ROOT / "deploy" / "pin-gpus" / "rbac.yaml",
    ):
        docs += [
            d for d in yaml.safe_load_all(path.read_text()) if d and d["metadata"]["name"] in wanted
        ]
    cp.create_rbac(docs)
    assert {d["kind"] for d in docs} == {"ClusterRole", "ClusterRoleBinding"}, (
        "deploy/ RBAC for the extender is missing"
    )
    return kubeconfig


SHIPPED_CONFIG = REPO_ROOT / "config" / "KubeSchedulerConfiguration.yaml"


def scheduler_config(extender_url: str) -> dict[str, Any]:
    """config/KubeSchedulerConfiguration.yaml parsed and pointed at our extender (a dict for
    ``start_scheduler``; :func:`start_shipped_scheduler` hands kube-scheduler the file's text)."""
    doc = yaml.safe_load(SHIPPED_CONFIG.read_text())
    for ext in doc["extenders"]:
        ext["urlPrefix"] = extender_url
    return doc


def start_shipped_scheduler(cp: ControlPlane, extender_url: str) -> Path:
    """kube-scheduler running config/KubeSchedulerConfiguration.yaml as deployed (leader election
    on, its own lease), pointed at our extender. 1.36 loads the file as shipped plus the harness's
    overlay (urlPrefix, kubeconfig); 1.20 gets it translated to v1beta1."""
    return cp.start_scheduler(
        SHIPPED_CONFIG.read_text(), extender_url=extender_url, leader_elect=True
    )


class Extender:
    """`vramsched serve --kubeconfig` as a subprocess, restartable on the same port."""

    def __init__(self, cp: ControlPlane, kubeconfig: Path, args: list[str]) -> None:
        self.cp = cp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = cp.logs_dir / f"vramsched-{self.port}.log"
        # `python -m extender`, with this checkout first on the path whatever the cwd.
        boot = f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); from extender.cli import main; sys.exit(main())"
        argv = [
            sys.executable,
            "-c",
            boot,
            "serve",
            "--kubeconfig",
            str(kubeconfig),
            "--port",
            str(self.port),
            "--log-level",
            "info",
            *args,
        ]
        self.component = Component("vramsched", argv, self.log_path)

    def start(self) -> None:
        self.component.start()
        self.cp.wait_for(
            lambda: self.get("/readyz") is not None,
            timeout=60,
            message=f"vramsched ready\n{self.describe()}",
        )

    def kill9(self) -> None:
        """SIGKILL: no shutdown path runs, as when a node dies."""
        proc = self.component.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        self.component.stop()

    def stop(self) -> None:
        self.component.stop()

    def get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def post(self, path: str, body: Any) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def describe(self) -> str:
        return self.component.describe(60)

    def log_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out


@pytest.fixture
def extender_args() -> list[str]:
    """Extra `vramsched serve` flags; a test overrides it with parametrize."""
    return []


@pytest.fixture
def stack(
    cluster: ControlPlane, extender_args: list[str]
) -> Iterator[tuple[ControlPlane, Extender]]:
    """Extender (with `extender_args`) + kube-scheduler running the deploy config."""
    kubeconfig = _grant_extender_rbac(cluster)
    ext = Extender(cluster, kubeconfig, extender_args)
    ext.start()
    start_shipped_scheduler(cluster, ext.url)
    try:
        yield cluster, ext
    finally:
        ext.stop()


@pytest.fixture
def proxied_vramsched(
    cluster: ControlPlane, extender_args: list[str]
) -> Iterator[tuple[ControlPlane, Extender, FakeExtender]]:
    """Like `stack`, with a recording proxy between kube-scheduler and vramsched (a test may
    script a verb on it, and pass the call on with `FakeExtender.forward`)."""
    ext = Extender(cluster, _grant_extender_rbac(cluster), extender_args)
    ext.start()
    proxy = FakeExtender(cluster, forward_to=ext.url)
    start_shipped_scheduler(cluster, proxy.url)
    try:
        yield cluster, ext, proxy
    finally:
        proxy.close()
        ext.stop()


# ----- observations -----------------------------------------------------------------------------------


def core(cp: ControlPlane) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(cp.api_client())


def raw_list(api: kubernetes.client.CoreV1Api, kind: str) -> list[dict[str, Any]]:
    """Nodes or pods as the API's JSON (what the extender sees)."""
    fn = api.list_node if kind == "Node" else api.list_pod_for_all_namespaces
    resp = fn(_preload_content=False)
    return [dict(item, kind=kind) for item in orjson.loads(resp.data)["items"]]


def rebuilt_ledger(api: kubernetes.client.CoreV1Api, policy: ReplicaPolicy) -> ClusterState:
    """The ledger a fresh vramsched would derive from the API right now."""
    state = ClusterState(replica_policy=policy)
    state.load(raw_list(api, "Node") + raw_list(api, "Pod"))
    return state


def assert_sound(api: kubernetes.client.CoreV1Api, policy: ReplicaPolicy) -> ClusterState:
    """No GPU over its VRAM or replicas in the API's state, and none the device plugin could make so."""
    state = rebuilt_ledger(api, policy)
    assert state.guessed == set(), (
        f"bound GPU pods without a readable assignment: {sorted(state.guessed)}"
    )
    assert check_invariant(state.ledger, state.live_pod_keys()) == []
    for pod in state.pods.values():
        node = (pod.get("spec") or {}).get("nodeName")
        ann = pod["metadata"].get("annotations") or {}
        if node and "vramsched.io/assignment" in ann:
            assert json.loads(ann["vramsched.io/assignment"])["node"] == node
    if policy is not ReplicaPolicy.PINNED:
        for inv in state.ledger.nodes():
            shared = [d for d in inv.devices if is_time_sliced(d)]
            if not shared:
                continue
            ids = {d.device_id for d in shared}
            sizes = [
                b
                for r in state.ledger.pods_on(inv.name)
                for dev, b in zip(r.device_ids, r.bytes_per_device)
                if dev in ids
            ]
            worst = worst_case_load(sizes, 0, 0, len(shared), shared[0].replicas, policy)
            assert worst <= shared[0].memory_bytes, (
                f"{inv.name}: plugin could stack {worst} bytes on one GPU"
            )
    return state


def wait_bound(
    cp: ControlPlane, api: kubernetes.client.CoreV1Api, names: list[str], timeout: float = 60
) -> dict[str, str]:
    def all_bound() -> dict[str, str] | None:
        got = {n: api.read_namespaced_pod(n, NS).spec.node_name for n in names}
        return got if all(got.values()) else None

    return cp.wait_for(all_bound, timeout=timeout, message=f"pods {names} bound")


def scheduling_events(api: kubernetes.client.CoreV1Api, name: str) -> list[str]:
    events = api.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
    return [e.message or "" for e in events if e.reason == "FailedScheduling"]


def probe_scores(ext: Extender, name: str, memory: str, nodes: list[str]) -> dict[str, int]:
    """Prioritize's scores for a pod `name` asking `memory` that the cluster does not hold yet
    (the hot path's answer; with `--plan-ahead`, the planner's rule). Use the name of the pod created next: prioritize keeps the node it
    gave 10 away from *other* pods for a few seconds."""
    probe = gpu_pod(name, memory)
    probe["metadata"].update(namespace=NS, uid="probe")
    answer = ext.post("/prioritize", {"Pod": probe, "NodeNames": nodes})
    return {h["Host"]: h["Score"] for h in answer}


def annotations(api: kubernetes.client.CoreV1Api, name: str) -> dict[str, str]:
    return api.read_namespaced_pod(name, NS).metadata.annotations or {}


# ----- the tests -------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_binds_to_right_nodes_with_annotations_and_explains_refusals(
    stack: tuple[ControlPlane, Extender],
) -> None:
    cp, ext = stack
    add_node(cp, "a100", "NVIDIA-A100-SXM4-80GB", count=2, memory_mib=81920)
    add_node(cp, "l4", "NVIDIA-L4", count=1, memory_mib=23034)
    api = core(cp)
    # 60Gi fits only an A100; 20Gi on one GPU fits the L4 best; 2x70Gi needs both A100s.
    api.create_namespaced_pod(NS, gpu_pod("big", "60Gi"))
    got = wait_bound(cp, api, ["big"])
    assert got["big"] == "a100"
    api.create_namespaced_pod(NS, gpu_pod("small", "20Gi"))
    api.create_namespaced_pod(NS, gpu_pod("huge", "200Gi"))  # fits no GPU anywhere
    api.create_namespaced_pod(NS, gpu_pod("stranger", "1Gi", scheduler="default-scheduler"))
    got = wait_bound(cp, api, ["small"])
    assert got["small"] in {"a100", "l4"}
    ann = annotations(api, "small")
    assignment = json.loads(ann["vramsched.io/assignment"])
    assert assignment["node"] == got["small"] and assignment["bytesPerDevice"] == [20 * GIB]
    # Exclusive GPUs: the device plugin, not vramsched, picks which one; no index is claimed.
    assert "vramsched.io/gpu-index" not in ann

    events = cp.wait_for(
        lambda: scheduling_events(api, "huge"), timeout=30, message="FailedScheduling for huge"
    )
    # Whichever node still has a free GPU reached the extender; its refusal is in the event.
    free_gpu = {"a100": "80Gi", "l4": "22.49Gi"}["l4" if got["small"] == "a100" else "a100"]
    assert any(f"1 need 200Gi per GPU, GPUs have {free_gpu}" in m for m in events), events
    huge = api.read_namespaced_pod("huge", NS)
    assert huge.spec.node_name is None and "vramsched.io/assignment" not in (
        huge.metadata.annotations or {}
    )

    stranger = api.read_namespaced_pod("stranger", NS)
    assert stranger.spec.node_name is None
    assert "vramsched.io/assignment" not in (stranger.metadata.annotations or {})
    assert scheduling_events(api, "stranger") == []
    assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    state = ext.get("/state")
    held = {p for n in state["nodes"] for g in n["gpus"] for p in g["pods"]}
    assert held == {"default/big", "default/small"}


@pytest.mark.e2e
def test_kube_scheduler_binds_where_vramsched_chooses_among_equal_nodes(
    stack: tuple[ControlPlane, Extender],
) -> None:
    """Two idle identical GPU nodes are in the same band for vramsched, so prioritize gives one of
    them 10 (the first in its order) and the other its band, 0. A CPU-heavy pod on the chosen one
    makes kube-scheduler's own CPU/memory scorers prefer the other node (~85 points); our 10 steps
    (500 points) decide. With equal scores, those scorers (or kube-scheduler's random pick among
    equal totals) would spread pods over idle nodes."""
    cp, ext = stack
    for name in ("tie-0", "tie-1"):
        add_node(cp, name, "NVIDIA-A100-SXM4-80GB", count=1, memory_mib=81920)
    api = core(cp)
    cp.wait_for(
        lambda: (
            {"tie-0", "tie-1"} <= {n["name"] for n in (ext.get("/state") or {}).get("nodes", [])}
        ),
        timeout=30,
        message="both nodes in the extender's ledger",
    )
    scores = probe_scores(ext, "tie-pod", "16Gi", ["tie-0", "tie-1"])
    (chosen,) = [n for n, s in scores.items() if s == 10]
    (other,) = [n for n, s in scores.items() if s != 10]
    assert scores[other] == 0  # an idle node, and a loose fit: the lowest band
    hog = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "cpu-hog"},
        "spec": {
            "nodeName": chosen,
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "resources": {"requests": {"cpu": "48", "memory": "256Gi"}},
                }
            ],
        },
    }
    api.create_namespaced_pod(NS, hog)
    api.create_namespaced_pod(NS, gpu_pod("tie-pod", "16Gi"))
    assert wait_bound(cp, api, ["tie-pod"])["tie-pod"] == chosen
    assert json.loads(annotations(api, "tie-pod")["vramsched.io/assignment"])["node"] == chosen


@pytest.mark.e2e
def test_time_sliced_gpus_are_booked_for_the_device_plugins_worst_case(
    stack: tuple[ControlPlane, Extender],
) -> None:
    """Default policy `distributed`: the plugin, not vramsched, picks the GPU of each replica.

    2 x 22.5Gi GPUs, 4 replicas each. 12+8+8 fit however the plugin spreads them; a second
    12Gi could land next to the first one (24Gi on one GPU), although per-GPU books would say
    it fits on the GPU holding 8Gi. A 2Gi pod still fits.
    """
    cp, ext = stack
    add_node(cp, "l4-ts", "NVIDIA-L4", count=2, memory_mib=23034, replicas=4)
    api = core(cp)
    for name, memory in (("ts-a", "12Gi"), ("ts-b", "8Gi"), ("ts-c", "8Gi")):
        api.create_namespaced_pod(NS, gpu_pod(name, memory))
        wait_bound(cp, api, [name])
    api.create_namespaced_pod(NS, gpu_pod("ts-d", "12Gi"))
    events = cp.wait_for(
        lambda: scheduling_events(api, "ts-d"), timeout=30, message="FailedScheduling for ts-d"
    )
    assert any(
        "device plugin (distributed) may stack 24Gi on a 22.49Gi GPU" in m for m in events
    ), events
    api.create_namespaced_pod(NS, gpu_pod("ts-e", "2Gi"))
    wait_bound(cp, api, ["ts-e"])
    assert api.read_namespaced_pod("ts-d", NS).spec.node_name is None
    for name in ("ts-a", "ts-b", "ts-c", "ts-e"):
        assert "vramsched.io/gpu-index" not in annotations(api, name)  # the plugin picks: no claim
    state = assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    # The extender's own ledger is the one the API rebuilds.
    served = {p for n in ext.get("/state")["nodes"] for g in n["gpus"] for p in g["pods"]}
    assert (
        served
        == {r.key for r in state.ledger.reservations()}
        == {f"default/ts-{x}" for x in "abce"}
    )


@pytest.mark.e2e
def test_kill_and_restart_mid_run_loses_nothing_and_double_books_nothing(
    stack: tuple[ControlPlane, Extender],
) -> None:
    """Two time-sliced nodes hold exactly 16 pods of 30Gi (8 per node: at most 2 per 80Gi GPU
    whatever the plugin does). 10 pods, SIGKILL the extender while they are being bound, 8 more
    while it is down, restart it: 16 bound, 2 Pending with our reason, no GPU over its VRAM."""
    cp, ext = stack
    for n in ("ts-0", "ts-1"):
        add_node(cp, n, "NVIDIA-A100-SXM4-80GB", count=4, memory_mib=81920, replicas=4)
    api = core(cp)
    first = [f"run-{i:02d}" for i in range(10)]
    for name in first:
        api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))

    def some_bound() -> int:
        return sum(1 for n in first if api.read_namespaced_pod(n, NS).spec.node_name)

    cp.wait_for(some_bound, timeout=60, interval=0.05, message="first binds")
    ext.kill9()
    bound_at_kill = some_bound()
    second = [f"run-{i:02d}" for i in range(10, 18)]
    for name in second:
        api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))
    ext.start()
    # A node event sends pods parked after "connection refused" back to the scheduling queue.
    api.patch_node("ts-0", {"metadata": {"labels": {"e2e/extender-restarted": "true"}}})
    everyone = first + second

    def settled() -> dict[str, str] | None:
        nodes = {n: api.read_namespaced_pod(n, NS).spec.node_name for n in everyone}
        return nodes if sum(1 for v in nodes.values() if v) == 16 else None

    nodes = cp.wait_for(
        settled, timeout=120, interval=0.5, message=f"16 pods bound\n{ext.describe()}"
    )
    state = assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    # The two left over are refused by the restarted extender itself. (Their FailedScheduling
    # events may lag: the event recorder rate-limits a pod that failed many times while the
    # extender was down.) The books spread like the plugin: 2 x 30Gi per GPU.
    waiting = [n for n, v in nodes.items() if not v]
    assert len(waiting) == 2
    for name in waiting:
        pod = api.api_client.sanitize_for_serialization(api.read_namespaced_pod(name, NS))
        answer = ext.post("/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["ts-0", "ts-1"]})
        assert answer["NodeNames"] == [] and set(answer["FailedNodes"].values()) == {
            "no GPU with 30Gi free"
        }
    per_node = {n: sum(1 for v in nodes.values() if v == n) for n in ("ts-0", "ts-1")}
    assert per_node == {"ts-0": 8, "ts-1": 8}
    assert 1 <= bound_at_kill < 18
    served = ext.get("/state")
    held = {p for n in served["nodes"] for g in n["gpus"] for p in g["pods"]}
    assert held == {r.key for r in state.ledger.reservations()}
    assert len(held) == 16


@pytest.mark.e2e
def test_watches_resume_after_apiserver_restart_and_release_finished_pods(
    stack: tuple[ControlPlane, Extender],
) -> None:
    cp, ext = stack
    add_node(cp, "h100", "NVIDIA-H100-80GB-HBM3", count=2, memory_mib=81559)
    api = core(cp)
    api.create_namespaced_pod(NS, gpu_pod("w-1", "70Gi"))
    api.create_namespaced_pod(NS, gpu_pod("w-2", "70Gi"))
    wait_bound(cp, api, ["w-1", "w-2"])
    cp.stop_apiserver()
    time.sleep(2)
    cp.start_apiserver()
    api = core(cp)
    # Both GPUs are full: w-3 waits. Finishing w-1 (Succeeded) and deleting w-2 frees them.
    api.create_namespaced_pod(NS, gpu_pod("w-3", "70Gi"))
    api.create_namespaced_pod(NS, gpu_pod("w-4", "70Gi"))
    cp.wait_for(lambda: scheduling_events(api, "w-3"), timeout=30, message="w-3 refused while full")
    api.patch_namespaced_pod_status("w-1", NS, {"status": {"phase": "Succeeded"}})
    api.delete_namespaced_pod("w-2", NS, grace_period_seconds=0)

    def held() -> set[str]:
        return {p for n in ext.get("/state")["nodes"] for g in n["gpus"] for p in g["pods"]}

    cp.wait_for(
        lambda: not held() & {"default/w-1", "default/w-2"},
        timeout=30,
        message="VRAM of w-1, w-2 released",
    )
    # A node event sends the refused pods back to the scheduling queue at once (else ~60 s).
    api.patch_node("h100", {"metadata": {"labels": {"e2e/freed": "true"}}})
    wait_bound(cp, api, ["w-3", "w-4"], timeout=90)
    ready = ext.get("/readyz")
    informers = ready["informers"]
    assert ready["ready"] is True
    assert informers["pods"]["watchResumes"] + informers["pods"]["relistsGone"] >= 1
    assert informers["nodes"]["watchResumes"] + informers["nodes"]["relistsGone"] >= 1
    state = assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    assert held() == {r.key for r in state.ledger.reservations()} == {"default/w-3", "default/w-4"}


@pytest.mark.e2e
@pytest.mark.parametrize("extender_args", [["--replica-policy", "pinned"]])
def test_pinned_policy_hands_the_gpu_choice_to_the_container(
    stack: tuple[ControlPlane, Extender], extender_args: list[str]
) -> None:
    cp, ext = stack
    add_node(cp, "ts-pin", "NVIDIA-L4", count=2, memory_mib=23034, replicas=4)
    api = core(cp)
    for name, memory in (("pin-a", "12Gi"), ("pin-b", "8Gi"), ("pin-c", "8Gi"), ("pin-d", "12Gi")):
        api.create_namespaced_pod(NS, gpu_pod(name, memory, pin=True))
        wait_bound(cp, api, [name])
    api.create_namespaced_pod(NS, gpu_pod("unpinned", "1Gi"))
    events = cp.wait_for(
        lambda: scheduling_events(api, "unpinned"), timeout=30, message="unpinned refused"
    )
    assert any(PIN_MISSING in m for m in events), events
    per_gpu: dict[str, int] = {}
    for name in ("pin-a", "pin-b", "pin-c", "pin-d"):
        pod = api.read_namespaced_pod(name, NS)
        cm = api.read_namespaced_config_map(f"vramsched-{name}", NS)
        index = pod.metadata.annotations["vramsched.io/gpu-index"]
        assert cm.data == {"NVIDIA_VISIBLE_DEVICES": index, "VRAMSCHED_PINNED": "true"}
        assert [(o.kind, o.name, o.uid) for o in cm.metadata.owner_references] == [
            ("Pod", name, pod.metadata.uid)
        ]
        per_gpu[index] = (
            per_gpu.get(index, 0)
            + json.loads(pod.metadata.annotations["vramsched.io/assignment"])["bytesPerDevice"][0]
        )
    # Pinned, the books are exact: 12+8 and 12+8 on the two 22.5Gi GPUs (distributed would refuse pin-d).
    assert sorted(per_gpu.values()) == [20 * GIB, 20 * GIB]
    assert_sound(api, ReplicaPolicy.PINNED)


@pytest.mark.e2e
def test_a_standby_replica_tracks_the_active_one_and_takes_over(
    stack: tuple[ControlPlane, Extender],
) -> None:
    """Two replicas run (as in deploy/: two pods, one scheduler leads). The standby learns every
    bind from the API alone; after a failover it fills the node to exactly its capacity."""
    cp, active = stack
    standby = Extender(cp, _grant_extender_rbac(cp), [])
    standby.start()
    try:
        add_node(
            cp, "ts", "NVIDIA-A100-SXM4-80GB", count=4, memory_mib=81920, replicas=4
        )  # 8 x 30Gi fit
        api = core(cp)
        first = [f"ha-{i}" for i in range(6)]
        for name in first:
            api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))
        wait_bound(cp, api, first)

        def held(ext: Extender) -> set[str]:
            return {p for n in ext.get("/state")["nodes"] for g in n["gpus"] for p in g["pods"]}

        expected = {f"default/{n}" for n in first}
        cp.wait_for(lambda: held(standby) == expected, timeout=30, message="standby saw every bind")
        assert standby.get("/state")["nodes"] == active.get("/state")["nodes"]
        # Failover: the standby's scheduler takes the lead, the old replica dies.
        start_shipped_scheduler(cp, standby.url)
        active.kill9()
        second = [f"ha-{i}" for i in range(6, 10)]
        for name in second:
            api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))

        def bound() -> list[str]:
            names = [n for n in first + second if api.read_namespaced_pod(n, NS).spec.node_name]
            return names if len(names) == 8 else []

        cp.wait_for(bound, timeout=60, message=f"8 pods bound after failover\n{standby.describe()}")
        state = assert_sound(api, ReplicaPolicy.DISTRIBUTED)
        assert (
            held(standby) == {r.key for r in state.ledger.reservations()}
            and len(held(standby)) == 8
        )
    finally:
        standby.stop()


def example_template_pod(path: Path) -> dict[str, Any]:
    """A Pod as the ReplicaSet of the example Deployment would create it: random name, no ConfigMap."""
    doc = yaml.safe_load(path.read_text())
    assert doc["kind"] == "Deployment"
    tpl = doc["spec"]["template"]
    meta = {**tpl["metadata"], "generateName": f"{doc['metadata']['name']}-"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": tpl["spec"]}


def versions_until_bound(api: kubernetes.client.CoreV1Api, name: str, since: str) -> list[Any]:
    """Every version of the pod the API server committed from `since` up to the first one bound."""
    seen: list[Any] = []
    w = kubernetes.watch.Watch()
    for event in w.stream(
        api.list_namespaced_pod,
        NS,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=30,
    ):
        seen.append(event["object"])
        if event["object"].spec.node_name:
            w.stop()
    return seen


def assigned_events(api: kubernetes.client.CoreV1Api, name: str) -> list[Any]:
    events = api.list_namespaced_event(NS, field_selector=f"involvedObject.name={name}").items
    return [e for e in events if e.reason == REASON]


@pytest.mark.e2e
@pytest.mark.parametrize("extender_args", [["--replica-policy", "pinned"]])
def test_deployment_pods_pin_through_the_downward_api_and_each_bind_records_an_event(
    stack: tuple[ControlPlane, Extender], extender_args: list[str]
) -> None:
    """Pods of deploy/examples/pinned-deployment.yaml (random names, NVIDIA_VISIBLE_DEVICES from
    the gpu-index annotation): the API server accepts the field path, vramsched pins them on the
    time-sliced GPUs only, and every version of a pod that is bound already holds its GPU index,
    so kubelet can never start the container with an empty variable."""
    cp, ext = stack
    add_node(cp, "a100-ts", "NVIDIA-A100-SXM4-80GB", count=2, memory_mib=81920, replicas=4)
    add_node(
        cp, "a100-x", "NVIDIA-A100-SXM4-80GB", count=2, memory_mib=81920
    )  # exclusive: cannot pin
    api = core(cp)
    template = example_template_pod(REPO_ROOT / "deploy" / "examples" / "pinned-deployment.yaml")
    (env,) = [
        e for e in template["spec"]["containers"][0]["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES"
    ]
    assert (
        env["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['vramsched.io/gpu-index']"
    )
    created = [api.create_namespaced_pod(NS, template).metadata for _ in range(3)]
    names = [m.name for m in created]
    nodes = wait_bound(cp, api, names)
    assert set(nodes.values()) == {"a100-ts"}
    per_gpu: dict[str, int] = {}
    for meta in created:
        versions = versions_until_bound(api, meta.name, meta.resource_version)
        bound = versions[-1]
        assert bound.spec.node_name == "a100-ts", [v.spec.node_name for v in versions]
        index = (bound.metadata.annotations or {}).get("vramsched.io/gpu-index")
        assignment = json.loads(bound.metadata.annotations["vramsched.io/assignment"])
        # The first bound version carries the index, and it names the GPU vramsched booked.
        assert (
            index is not None and index == ",".join(assignment["devices"]) and index in {"0", "1"}
        )
        # Written by an earlier write than the Binding: a version holds it while still unbound.
        assert any(
            v.spec.node_name is None
            and (v.metadata.annotations or {}).get("vramsched.io/gpu-index") == index
            for v in versions[:-1]
        ), meta.name
        # No ConfigMap is involved in this form.
        with pytest.raises(kubernetes.client.ApiException):
            api.read_namespaced_config_map(f"vramsched-{meta.name}", NS)
        per_gpu[index] = per_gpu.get(index, 0) + 1
    # Pinned books are exact and spread by best fit: all three fit, each on one of the two GPUs.
    assert sum(per_gpu.values()) == 3

    # One VramschedAssigned event per bind, after the Binding, naming the pinned GPU.
    for meta in created:
        (event,) = cp.wait_for(
            lambda n=meta.name: assigned_events(api, n),
            timeout=30,
            message=f"event for {meta.name}",
        )
        index = annotations(api, meta.name)["vramsched.io/gpu-index"]
        assert event.type == "Normal" and event.involved_object.uid == meta.uid
        assert re.fullmatch(
            rf"reserved 16Gi on GPU {index} of a100-ts \(time-slicing, [1-4]/4 replicas, pinned\)",
            event.message,
        ), event.message
        assert event.source.component == "vramsched-extender"
    assert ext.get("/readyz")["events"]["failed"] == 0

    # The exclusive node is never offered to such a pod: there it would see no GPU at all.
    probe = api.api_client.sanitize_for_serialization(api.read_namespaced_pod(names[0], NS))
    probe["metadata"]["name"] = "dw-probe"
    probe["spec"].pop("nodeName", None)
    probe["spec"].pop("nodeSelector", None)
    answer = ext.post("/filter", {"Pod": probe, "Nodes": None, "NodeNames": ["a100-ts", "a100-x"]})
    assert answer["NodeNames"] == ["a100-ts"]
    answer = ext.post(
        "/filter", {"Pod": probe, "Nodes": None, "NodeNames": ["a100-x"]}
    )  # why, when nothing passes
    assert (
        answer["NodeNames"] == []
        and "cannot be pinned" in answer["FailedAndUnresolvableNodes"]["a100-x"]
    )
    assert_sound(api, ReplicaPolicy.PINNED)
