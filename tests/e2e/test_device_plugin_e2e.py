"""vramsched's device plugin under a real kubelet: each container gets exactly the GPU vramsched
booked, no GPU holds more than its memory, and restarts of the plugin and of the kubelet hand out
nothing twice.

The stack (tests/e2e/kubelet.py): etcd 3.5 + kube-apiserver + kube-scheduler 1.36.3 running the
shipped scheduler config, `vramsched serve` in live mode as the deploy RBAC allows, one real node
(containerd 1.6 + runc + kubelet 1.36.3) labelled vramsched.io/device-plugin=true and served by
`vramsched device-plugin --fake-gpus 8` (8 x 80 GiB, 4 replicas, as deploy/device-plugin's RBAC
allows), and two API-only GPU nodes beside it (no kubelet: the stock plugin's worst case applies).
Pods are busybox (built locally) printing what they were handed; what counts is what a container
saw, read from its log, never what vramsched's books say.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from controlplane import REPO_ROOT, Component, free_port
from kubelet import BUSYBOX_IMAGE, ControlPlane136, KubeletNode
from test_extender_e2e import (
    SHIPPED_CONFIG,
    Extender,
    _grant_extender_rbac,
    add_node,
    gpu_labels,
)

from extender.device_plugin.gpus import fake_uuid
from extender.device_plugin.kubelet import PodResources
from extender.inventory import ReplicaPolicy
from extender.plugin_state import STATE_ANNOTATION, decode_state
from extender.stock_plugin import worst_case_load

NS = "default"
GIB = 1024**3
GPU = "nvidia.com/gpu"
NODE = "kubelet-node"
GPUS, MEMORY_MIB, REPLICAS = 8, 81920, 4
PLUGIN_NS = PLUGIN_SA = "vramsched-device-plugin"

pytestmark = pytest.mark.e2e


class Plugin:
    """`vramsched device-plugin` as a subprocess on the host, with the ServiceAccount of
    deploy/device-plugin, restartable with other flags."""

    def __init__(self, cp: ControlPlane136, node: KubeletNode, kubeconfig: Path) -> None:
        self.cp, self.node, self.kubeconfig = cp, node, kubeconfig
        self.component: Component | None = None
        self.probe_port = 0
        self.starts = 0

    def start(self, *extra: str) -> None:
        self.probe_port = free_port()
        self.starts += 1
        boot = f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); from extender.cli import main; sys.exit(main())"
        argv = [
            sys.executable,
            "-c",
            boot,
            "device-plugin",
            "--node-name",
            NODE,
            "--kubeconfig",
            str(self.kubeconfig),
            "--fake-gpus",
            str(GPUS),
            "--fake-memory-mib",
            str(MEMORY_MIB),
            "--pod-resources-socket",
            str(self.node.root / "pod-resources" / "kubelet.sock"),
            "--probe-port",
            str(self.probe_port),
            "--probe-host",
            "127.0.0.1",
            *extra,
        ]
        self.component = Component(
            "device-plugin", argv, self.cp.logs_dir / f"device-plugin-{self.starts}.log"
        )
        self.component.start()

    def kill9(self) -> None:
        assert self.component is not None and self.component.proc is not None
        os.killpg(self.component.proc.pid, signal.SIGKILL)
        self.component.proc.wait(timeout=10)
        self.component.stop()

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()

    def metric(self, outcome: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        m = re.search(
            rf'^vramsched_device_plugin_allocations_total{{outcome="{outcome}"}} (\S+)$', text, re.M
        )
        return float(m.group(1)) if m else 0.0

    def log(self) -> str:
        return "\n".join(
            (self.cp.logs_dir / f"device-plugin-{i}.log").read_text(errors="replace")
            for i in range(1, self.starts + 1)
        )


def _plugin_kubeconfig(cp: ControlPlane136) -> Path:
    kubeconfig = cp.service_account_kubeconfig(PLUGIN_NS, PLUGIN_SA)
    docs = [
        d
        for d in yaml.safe_load_all((REPO_ROOT / "deploy/device-plugin/rbac.yaml").read_text())
        if d
    ]
    with cp.api_client() as client:
        rbac = kubernetes.client.RbacAuthorizationV1Api(client)
        for doc in docs:
            if doc["kind"] == "ClusterRole":
                rbac.create_cluster_role(doc)
            elif doc["kind"] == "ClusterRoleBinding":
                rbac.create_cluster_role_binding(doc)
    return kubeconfig


class Stack:
    def __init__(
        self, cp: ControlPlane136, node: KubeletNode, ext: Extender, plugin: Plugin
    ) -> None:
        self.cp, self.node, self.ext, self.plugin = cp, node, ext, plugin
        self.core = kubernetes.client.CoreV1Api(cp.api_client())

    def served_state(self) -> Any:
        ann = self.core.read_node(NODE).metadata.annotations or {}
        return decode_state(ann[STATE_ANNOTATION]) if STATE_ANNOTATION in ann else None

    def wait_serving(self, gpus: int = GPUS, unhealthy: tuple[int, ...] = ()) -> None:
        def serving() -> bool:
            node = self.core.read_node(NODE)
            state = self.served_state()
            alloc = int((node.status.allocatable or {}).get(GPU, "0"))
            return bool(
                state
                and state.registered
                and state.unhealthy == unhealthy
                and alloc == (gpus - len(unhealthy)) * REPLICAS
            )

        self.cp.wait_for(
            serving, timeout=60, message=f"plugin serving\n{self.plugin.log()[-3000:]}"
        )

    def create(
        self, name: str, memory: str, gpus: int = 1, selector: dict[str, str] | None = None
    ) -> None:
        script = (
            "trap 'exit 0' TERM; "
            'echo "GPUS=$NVIDIA_VISIBLE_DEVICES"; echo "INDEX=$VRAMSCHED_GPU_INDEX"; '
            'for m in /var/run/nvidia-container-devices/*; do [ -e "$m" ] && echo "MOUNT=${m##*/}"; done; '
            "echo END; sleep 3600 & wait"
        )
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "annotations": {"vramsched.io/model-memory": memory}},
            "spec": {
                "schedulerName": "vramsched",
                "nodeSelector": selector
                if selector is not None
                else {"vramsched.io/device-plugin": "true"},
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "main",
                        "image": BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", script],
                        "resources": {
                            "requests": {"cpu": "10m", "memory": "8Mi"},
                            "limits": {GPU: str(gpus)},
                        },
                    }
                ],
            },
        }
        self.core.create_namespaced_pod(NS, body)

    def pods(self) -> list[Any]:
        return self.core.list_namespaced_pod(NS).items

    def settle(self, names: set[str], timeout: float = 180) -> dict[str, Any]:
        """Wait until each pod is running with its output written, failed, or left unscheduled."""

        def settled() -> dict[str, Any] | None:
            out = {}
            for p in self.pods():
                if p.metadata.name not in names:
                    continue
                phase = p.status.phase
                if phase == "Failed":
                    out[p.metadata.name] = p
                elif phase == "Running" and "END" in self.output(p):
                    out[p.metadata.name] = p
                elif phase == "Pending" and not p.spec.node_name and unschedulable(p):
                    out[p.metadata.name] = p
            return out if set(out) == names else None

        return self.cp.wait_for(
            settled, timeout=timeout, interval=1.0, message=f"pods {sorted(names)} settled"
        )

    def output(self, p: Any) -> str:
        return self.node.pod_log(NS, p.metadata.name, p.metadata.uid, "main")

    def delete_all(self) -> None:
        for p in self.pods():
            self.core.delete_namespaced_pod(p.metadata.name, NS, grace_period_seconds=0)
        self.cp.wait_for(lambda: not self.pods(), timeout=60, message="pods deleted")


def unschedulable(p: Any) -> bool:
    return any(c.type == "PodScheduled" and c.status == "False" for c in p.status.conditions or [])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("kubelet-e2e")
    cp = ControlPlane136(root / "cp")
    cp.start()
    node = KubeletNode(cp, root / "node", NODE)
    ext: Extender | None = None
    plugin: Plugin | None = None
    try:
        node.start()
        with cp.api_client() as client:
            core = kubernetes.client.CoreV1Api(client)
            labels = gpu_labels("NVIDIA-A100-SXM4-80GB", GPUS, MEMORY_MIB, REPLICAS)
            core.patch_node(
                NODE, {"metadata": {"labels": {**labels, "vramsched.io/device-plugin": "true"}}}
            )
        for i in range(2):  # API-only GPU nodes: the stock plugin's worst case applies there
            add_node(cp, f"api-only-{i}", "NVIDIA-A100-SXM4-80GB", GPUS, MEMORY_MIB, REPLICAS)
            with cp.api_client() as client:
                kubernetes.client.CoreV1Api(client).patch_node(
                    f"api-only-{i}", {"metadata": {"labels": {"pool": "api-only"}}}
                )
        plugin = Plugin(cp, node, _plugin_kubeconfig(cp))
        plugin.start()
        ext = Extender(cp, _grant_extender_rbac(cp), [])
        ext.start()
        cp.start_scheduler(SHIPPED_CONFIG.read_text(), extender_url=ext.url)
        s = Stack(cp, node, ext, plugin)
        s.wait_serving()
        yield s
    finally:
        if plugin is not None:
            plugin.stop()
        if ext is not None:
            ext.stop()
        node.stop()
        cp.stop()


# ----- what containers saw ------------------------------------------------------------------------------


def handed(stack: Stack, p: Any) -> tuple[list[int], list[str], list[str]]:
    """(GPU indices vramsched's plugin said, UUIDs in NVIDIA_VISIBLE_DEVICES, mounted UUIDs)."""
    text = stack.output(p)
    fields: dict[str, list[str]] = defaultdict(list)
    for line in text.splitlines():
        key, _, value = line.partition("=")
        fields[key].append(value)
    index = [int(i) for i in (fields["INDEX"] or [""])[0].split(",") if i]
    gpus = [u for u in (fields["GPUS"] or [""])[0].split(",") if u]
    return index, gpus, fields["MOUNT"]


def check_running_pods(stack: Stack, strategy: str = "envvar") -> dict[int, list[tuple[str, int]]]:
    """Every running pod on the node saw exactly its assigned GPUs; per physical GPU (by what
    the containers received) the declared VRAM never exceeds 80 GiB and the pods never exceed
    the replicas. Returns GPU -> [(pod, bytes)]."""
    uuid_to_index = {fake_uuid(NODE, i): i for i in range(GPUS)}
    on_gpu: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for p in stack.pods():
        if p.spec.node_name != NODE or p.status.phase != "Running":
            continue
        assignment = json.loads(p.metadata.annotations["vramsched.io/assignment"])
        booked = [int(d) for d in assignment["devices"]]
        index, gpus, mounts = handed(stack, p)
        if strategy == "envvar":
            got = [uuid_to_index[u] for u in gpus]
        else:
            assert gpus == ["/var/run/nvidia-container-devices"], gpus
            got = [uuid_to_index[u] for u in mounts]
        assert sorted(got) == sorted(booked), (p.metadata.name, got, booked)
        assert index == booked
        assert p.metadata.annotations.get("vramsched.io/gpu-index") == ",".join(
            map(str, sorted(booked))
        )
        for gpu, nbytes in zip(got, [assignment["bytesPerDevice"][booked.index(g)] for g in got]):
            on_gpu[gpu].append((p.metadata.name, nbytes))
    for gpu, held in on_gpu.items():
        assert sum(b for _, b in held) <= MEMORY_MIB * 1024**2, (gpu, held)
        assert len(held) <= REPLICAS, (gpu, held)
    return on_gpu


def kubelet_record(stack: Stack) -> dict[str, set[str]]:
    """The kubelet's own record (PodResources): pod -> GPU UUIDs of its device IDs."""
    out = {}
    for kp in PodResources(stack.node.root / "pod-resources" / "kubelet.sock", GPU).list():
        ids = {d.split("::")[0] for ids in kp.devices.values() for d in ids}
        if ids:
            out[kp.name] = ids
    return out


def check_api_only_nodes(stack: Stack) -> None:
    """Pods on the API-only nodes keep the stock plugin's worst-case bound."""
    sizes: dict[str, list[int]] = defaultdict(list)
    for p in stack.pods():
        if p.spec.node_name and p.spec.node_name.startswith("api-only"):
            a = json.loads(p.metadata.annotations["vramsched.io/assignment"])
            sizes[p.spec.node_name] += a["bytesPerDevice"]
            assert "vramsched.io/gpu-index" not in p.metadata.annotations
    for node, held in sizes.items():
        worst = worst_case_load(held, 0, 0, GPUS, REPLICAS, ReplicaPolicy.DISTRIBUTED)
        assert worst <= MEMORY_MIB * 1024**2, (node, held)


# ----- the tests ------------------------------------------------------------------------------------------


STREAM = [40, 40, 30, 30, 20, 20, 20, 50, 10, 10, 60, 7, 15, 25]  # 377 GiB on 8 x 80 GiB


def test_each_container_gets_exactly_the_gpu_vramsched_booked(stack: Stack) -> None:
    names = set()
    for i in range(2):  # 2-GPU pods: 2 x 30 GiB
        stack.create(f"pair{i}", "60Gi", gpus=2)
        names.add(f"pair{i}")
    for i, gib in enumerate(STREAM):
        stack.create(f"m{i}", f"{gib}Gi")
        names.add(f"m{i}")
    for i in range(3):  # beside them, API-only nodes under the stock plugin's worst case
        stack.create(f"api{i}", "50Gi", selector={"pool": "api-only"})
    # a GPU pod vramsched never saw, put on the node by hand: the plugin refuses it, visibly
    stranger = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stranger"},
        "spec": {
            "nodeName": NODE,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["true"],
                    "resources": {"limits": {GPU: "1"}},
                }
            ],
        },
    }
    pods = stack.settle(names)
    stack.core.create_namespaced_pod(NS, stranger)
    failed = stack.cp.wait_for(
        lambda: (
            (p := stack.core.read_namespaced_pod("stranger", NS)).status.phase == "Failed" and p
        ),
        timeout=60,
        message="stranger refused",
    )
    assert failed.status.reason == "UnexpectedAdmissionError"
    assert "has no vramsched.io/assignment" in failed.status.message
    running = [n for n, p in pods.items() if p.status.phase == "Running"]
    assert sorted(running) == sorted(names), {n: p.status.phase for n, p in pods.items()}
    on_gpu = check_running_pods(stack)
    # exact books packed models onto shared GPUs: more pods than GPUs, several per GPU
    assert max(len(v) for v in on_gpu.values()) >= 2 and len(running) > GPUS
    # the kubelet's own record names the same physical GPUs (GetPreferredAllocation)
    record = kubelet_record(stack)
    uuid = {i: fake_uuid(NODE, i) for i in range(GPUS)}
    for name in running:
        p = pods[name]
        booked = {
            uuid[int(d)]
            for d in json.loads(p.metadata.annotations["vramsched.io/assignment"])["devices"]
        }
        assert record[name] == booked, (name, record.get(name), booked)
    check_api_only_nodes(stack)
    assert stack.plugin.metric("ambiguous") == 0
    assert stack.plugin.metric("served") == len(names)
    assert stack.plugin.metric("refused") == 1  # the stranger
    stack.delete_all()


def test_plugin_and_kubelet_restarts_hand_out_nothing_twice(stack: Stack) -> None:
    rng = random.Random(20)
    sizes = [rng.randint(7, 60) for _ in range(24)]
    names: set[str] = set()
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            for i, gib in enumerate(sizes):
                stack.create(f"r{i}", f"{gib}Gi", gpus=2 if i % 7 == 6 else 1)
                names.add(f"r{i}")
                time.sleep(0.7)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def registrations() -> int:
        return stack.plugin.log().count('"registered with the kubelet"')

    before = registrations()
    creator = threading.Thread(target=stream)
    creator.start()
    time.sleep(3)
    stack.plugin.kill9()  # mid-stream: no shutdown path runs
    time.sleep(2)
    stack.plugin.start()
    stack.cp.wait_for(lambda: registrations() == before + 1, timeout=60, message="plugin back")
    time.sleep(2)
    stack.node.restart_kubelet()  # deletes every socket in the device-plugin folder
    stack.cp.wait_for(
        lambda: registrations() == before + 2, timeout=60, message="registered with the new kubelet"
    )
    creator.join()
    assert not errors, errors
    stack.wait_serving()
    pods = stack.settle(names, timeout=240)
    # pods bound while the plugin or the kubelet was away may fail admission, visibly; none may
    # run on a GPU it was not booked, and none may be handed out twice
    for name, p in pods.items():
        if p.status.phase == "Failed":
            assert p.status.reason == "UnexpectedAdmissionError", (
                name,
                p.status.reason,
                p.status.message,
            )
    running = [n for n, p in pods.items() if p.status.phase == "Running"]
    assert running, {n: (p.status.phase, p.status.message) for n, p in pods.items()}
    check_running_pods(stack)
    # every running pod holds exactly one allocation in the kubelet's record, on its GPUs
    record = kubelet_record(stack)
    assert set(record) >= set(running)
    assert stack.plugin.metric("ambiguous") == 0
    # what failed is released: a fresh ledger from the API counts only running pods here
    counted = Counter()
    for p in stack.pods():
        if p.spec.node_name == NODE and p.status.phase not in ("Failed", "Succeeded"):
            counted[p.metadata.name] += 1
    assert set(counted) == set(running)
    stack.delete_all()


def test_volume_mounts_and_an_unhealthy_gpu(stack: Stack) -> None:
    stack.plugin.stop()
    stack.plugin.start("--device-list-strategy", "volume-mounts", "--fake-unhealthy", "7")
    stack.wait_serving(unhealthy=(7,))
    names = set()
    for i, gib in enumerate([70, 70, 70, 70, 70, 70, 70, 30]):
        stack.create(f"v{i}", f"{gib}Gi")
        names.add(f"v{i}")
    pods = stack.settle(names)
    running = {n for n, p in pods.items() if p.status.phase == "Running"}
    on_gpu = check_running_pods(stack, strategy="volume-mounts")
    assert 7 not in on_gpu
    # 7 healthy GPUs of 80 GiB: seven 70s, and the 30 does not fit beside any of them
    assert len(running) == 7 and pods["v7"].status.phase == "Pending", {
        n: p.status.phase for n, p in pods.items()
    }
    assert stack.plugin.metric("ambiguous") == 0
    stack.delete_all()
    stack.plugin.stop()
    stack.plugin.start()
    stack.wait_serving()
