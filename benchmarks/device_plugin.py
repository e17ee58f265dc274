"""What vramsched's device plugin buys, and what it costs the kubelet. Three benchmarks:

**packing** (on a real control plane: etcd 3.5 + kube-apiserver + kube-scheduler 1.36.3 running
the shipped scheduler config, and `vramsched serve` in live mode): four time-sliced 8 x
A100-80GB nodes (4 replicas per GPU) and one seeded stream of 140 inference pods created at
once: 7 to 60 GiB (uniform) on one GPU, every tenth pod on two GPUs with 7 to 60 GiB on each.
The same stream, in the same run:

- `live-stock`: live mode, the nodes under NVIDIA's plugin (vramsched books its `distributed`
  worst case); API-only nodes: nothing is admitted, the worst case is all that is known;
- `live-plugin`: live mode, the nodes labelled vramsched.io/device-plugin=true and each served
  by a real `vramsched device-plugin --fake-gpus 8 --replicas 4` process, registered with a
  stand-in for the node's kubelet (`StandInKubelet`: SimKubelet's device-manager and
  PodResources gRPC) that admits every pod bound to its node one at a time, calling
  GetPreferredAllocation and Allocate, and writes Running or Failed (UnexpectedAdmissionError)
  to the pod's status as the kubelet does. Real: the plugin process, its API informer, its
  PodResources client, the gRPC, the extender's exact books and its reaction to statuses.
  Simulated: the kubelet (no containers; admission in creation order);
- `embedded`: the same stream through filter, prioritize and bind of an in-process embedded
  ExtenderService (exact books, no API server).

The last count is independent of vramsched's books: bytes are each pod's declared
vramsched.io/model-memory over its GPU count; for live-plugin the GPUs are the ones the plugin's
Allocate answers named (NVIDIA_VISIBLE_DEVICES), per (node, GPU); embedded mode has only the
assignment; for live-stock no one knows the GPU, so the count is of nodes where some choice of
NVIDIA's plugin could put more than 80 GiB on one GPU.

**allocate**: `Allocate` latency on a node with 16 GPUs x 4 replicas = 64 replicas, called over
gRPC as the kubelet's device manager calls it by SimKubelet (simulated kubelet: Python), the
plugin's service in a process of its own, the node holding 0 to 63 pods; beside it, in the same
run, the floor: a plugin that answers GetPreferredAllocation and Allocate at once without
identifying the pod (what NVIDIA's plugin does). Exact percentiles of Allocate and of
GetPreferredAllocation + Allocate as the kubelet waits, and the plugin's CPU time of each.

**kubelet**: the same 64 replicas under a real kubelet 1.36.3 (containerd, runc, busybox pods,
the e2e suite's node) served by a real `vramsched device-plugin --fake-gpus 16 --replicas 4`,
pods placed by vramsched through kube-scheduler until every replica is taken, then a random share
deleted, 3 times, in a burst (each fill created at once) and paced (one pod at a time); the
kubelet's own Allocate histogram (buckets 5 ms, 10 ms, ...) and the plugin's, with the kubelet's
PodResources List and the plugin's pod lookup apart, and the plugin's GetPreferredAllocation
(the kubelet waits on it too, just before Allocate, and keeps no histogram of it; it carries the
admission's one List, whose answer Allocate reuses). Beside it, the floor under the same kubelet
and control plane; each plugin and pace 4 times (`--kubelet-repeats`), alternating which plugin
goes first, each run on a settled machine, the kubelet's histogram pooled per plugin and pace.
About 40 minutes. Needs root and the node packages (`make node-deps`).

    .venv/bin/python benchmarks/device_plugin.py            # all three; make bench-device-plugin
    .venv/bin/python benchmarks/device_plugin.py --only packing|allocate|kubelet
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import grpc
import kubernetes.client
import kubernetes.utils
import orjson
from processes import Component, free_port

from extender.commands.argtypes import number, output_file, whole
from extender.device_plugin.api import deviceplugin_v1beta1_pb2 as dp
from extender.device_plugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from extender.device_plugin.gpus import FakeGpus, fake_uuid
from extender.device_plugin.kubelet import DEVICE_PLUGIN_DIR, PodResources
from extender.device_plugin.server import DevicePluginService, PluginRunner
from extender.device_plugin.simkubelet import AdmissionError, SimKubelet
from extender.plugin_state import STATE_ANNOTATION, PluginState, decode_state, encode_state

GIB = 1024**3
NODES, GPUS, MEMORY_MIB, REPLICAS = 4, 8, 81920, 4
RESULTS = REPO / "benchmarks" / "results" / "device_plugin.json"


# ----- the pod stream ---------------------------------------------------------------------------------


def stream(count: int, seed: int) -> list[tuple[str, int, int]]:
    """(name, GiB in total, GPUs): 7..60 GiB per GPU, every tenth pod on two GPUs."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        gpus = 2 if i % 10 == 9 else 1
        out.append((f"p{i:03d}", rng.randint(7, 60) * gpus, gpus))
    return out


def pod_body(name: str, gib: int, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "annotations": {"vramsched.io/model-memory": f"{gib}Gi"},
        },
        "spec": {
            "schedulerName": "vramsched",
            "containers": [
                {
                    "name": "main",
                    "image": "vllm/vllm-openai",
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "64Mi"},
                        "limits": {"nvidia.com/gpu": str(gpus)},
                    },
                }
            ],
        },
    }


def node_labels(served: bool) -> dict[str, str]:
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-SHARED",
        "nvidia.com/gpu.count": str(GPUS),
        "nvidia.com/gpu.memory": str(MEMORY_MIB),
        "nvidia.com/gpu.replicas": str(REPLICAS),
        "nvidia.com/gpu.sharing-strategy": "time-slicing",
    }
    if served:
        labels["vramsched.io/device-plugin"] = "true"
    return labels


# ----- the independent count ---------------------------------------------------------------------------

#: one pod's hold as counted independently: (node, GPU indices it received, bytes per GPU)
Hold = tuple[str, list[int], int]


def declared_per_gpu(pod: Mapping[str, Any]) -> int:
    """The pod's own declaration, not vramsched's books: its vramsched.io/model-memory over
    the GPUs its container asks for."""
    declared = kubernetes.utils.parse_quantity(
        pod["metadata"]["annotations"]["vramsched.io/model-memory"]
    )
    gpus = int(pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    return int(declared) // gpus


def exact_count(holds: list[Hold]) -> dict[str, Any]:
    """Per (node, GPU) sums of what the pods declared, and the pods per GPU, on the GPUs the
    pods received; GPUs over their VRAM or their replicas."""
    per_gpu: dict[tuple[str, int], list[int]] = defaultdict(list)
    for node, gpus, nbytes in holds:
        for gpu in gpus:
            per_gpu[(node, gpu)].append(nbytes)
    cap = MEMORY_MIB * 1024**2
    booked = sum(sum(v) for v in per_gpu.values())
    return {
        "gpusOverVram": sum(1 for v in per_gpu.values() if sum(v) > cap or len(v) > REPLICAS),
        "bookedGiB": round(booked / GIB, 1),
        "bookedPercent": round(100 * booked / (NODES * GPUS * cap), 1),
        "gpusUsed": len(per_gpu),
    }


def stock_worst_case(holds: list[Hold]) -> dict[str, Any]:
    """Under NVIDIA's plugin no one knows the GPU: per node, whether some choice its
    `distributed` policy can make stacks more than a GPU's memory on one GPU (the
    `ceil(pods/GPUs)` largest pods on one GPU). Counts nodes, not GPUs."""
    per_node: dict[str, list[int]] = defaultdict(list)
    for node, gpus, nbytes in holds:
        per_node[node] += [nbytes] * len(gpus)
    cap = MEMORY_MIB * 1024**2
    at_risk = 0
    for sizes in per_node.values():
        depth = min(REPLICAS, -(-len(sizes) // GPUS))
        at_risk += sum(sorted(sizes, reverse=True)[:depth]) > cap
    booked = sum(sum(v) for v in per_node.values())
    return {
        "nodesWhereAGpuCouldGoOverVram": at_risk,
        "bookedGiB": round(booked / GIB, 1),
        "bookedPercent": round(100 * booked / (NODES * GPUS * cap), 1),
    }


def assigned_holds(pods: Sequence[Mapping[str, Any]]) -> list[Hold]:
    """Bound pods with the GPUs of their vramsched.io/assignment (embedded mode and NVIDIA's
    plugin: nothing else says which GPU a pod has)."""
    out = []
    for p in pods:
        raw = (p["metadata"].get("annotations") or {}).get("vramsched.io/assignment")
        node = (p.get("spec") or {}).get("nodeName")
        if raw and node:
            gpus = [int(d) for d in json.loads(raw)["devices"]]
            out.append((node, gpus, declared_per_gpu(p)))
    return out


def two_gpu(pods: Sequence[Mapping[str, Any]]) -> int:
    return sum(
        1
        for p in pods
        if p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    )


# ----- the kubelet's part on API-only nodes ------------------------------------------------------------


class StandInKubelet:
    """The kubelet's device manager for one API-only node, as far as vramsched's device plugin
    can tell: SimKubelet (extender.device_plugin.simkubelet: the Registration and PodResources
    gRPC servers, ListAndWatch, GetPreferredAllocation then Allocate per container), fed by the
    pods bound to the node, admitted one at a time in creation order as the kubelet admits a
    batch, each outcome written to the pod's status as the kubelet writes it (Running, or
    Failed with UnexpectedAdmissionError and the plugin's reason). No containers run."""

    def __init__(self, node: str, root: Path, core: Any) -> None:
        self.node, self.root, self.core = node, root, core
        self.sim = SimKubelet(root / "dp", root / "pr" / "kubelet.sock", "nvidia.com/gpu")
        self.admitted: dict[str, tuple[dict[str, Any], list[str]]] = {}  # pod -> (pod, UUIDs)
        self.refused: dict[str, str] = {}
        self.allocate_seconds: list[float] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{node}", daemon=True)

    def start(self) -> StandInKubelet:
        self.sim.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sim.stop()

    def settled(self) -> bool:
        """Every pod bound here so far has been admitted or refused."""
        return self._pending() == []

    def _pending(self) -> list[dict[str, Any]]:
        raw = self.core.list_namespaced_pod(
            "default", field_selector=f"spec.nodeName={self.node}", _preload_content=False
        ).data
        items = orjson.loads(raw)["items"]
        fresh = [p for p in items if p["metadata"]["uid"] not in self._seen]
        return sorted(
            fresh, key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"])
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pending = self._pending() if self.sim.registrations else []
            except Exception as exc:  # the API may be busy: next round
                print(f"stand-in kubelet {self.node}: {exc}", file=sys.stderr)
                pending = []
            for pod in pending:
                self._admit(pod)
            self._stop.wait(0.2)

    def _admit(self, pod: dict[str, Any]) -> None:
        """Admit one pod; it counts as seen (settled) once its status is written (or given up)."""
        name = pod["metadata"]["name"]
        try:
            got = self.sim.admit(pod)
        except (AdmissionError, grpc.RpcError) as exc:
            reason = exc.reason if isinstance(exc, AdmissionError) else str(exc)
            self.refused[name] = reason
            status = {
                "phase": "Failed",
                "reason": "UnexpectedAdmissionError",
                "message": f"Allocate failed due to {reason}",
            }
        else:
            env = got.responses["main"].envs
            self.admitted[name] = (pod, env["NVIDIA_VISIBLE_DEVICES"].split(","))
            self.allocate_seconds += got.allocate_seconds
            status = {"phase": "Running"}
        for attempt in range(5):  # the API may be busy; a pod is admitted once, whatever
            try:
                self.core.patch_namespaced_pod_status(name, "default", {"status": status})
                break
            except Exception as exc:
                print(f"stand-in kubelet {self.node}: status of {name}: {exc}", file=sys.stderr)
                time.sleep(1 + attempt)
        self._seen.add(pod["metadata"]["uid"])


def plugin_process(
    node: str,
    kubeconfig: Path,
    logs: Path,
    *,
    pod_resources: Path,
    plugin_dir: Path | None = None,
    gpus: int = GPUS,
    extra: tuple[str, ...] = (),
) -> Component:
    """`vramsched device-plugin` as a process of its own, as the DaemonSet runs it on a node,
    with fake GPUs; `plugin_dir` None: the kubelet's own /var/lib/kubelet/device-plugins."""
    boot = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); "
        "from extender.cli import main; sys.exit(main())"
    )
    argv = [
        sys.executable,
        "-c",
        boot,
        "device-plugin",
        "--node-name",
        node,
        "--kubeconfig",
        str(kubeconfig),
        "--fake-gpus",
        str(gpus),
        "--fake-memory-mib",
        str(MEMORY_MIB),
        "--replicas",
        str(REPLICAS),
        "--pod-resources-socket",
        str(pod_resources),
        "--log-level",
        "warning",
        *(("--device-plugin-dir", str(plugin_dir)) if plugin_dir else ()),
        *extra,
    ]
    return Component(f"device-plugin-{node}", argv, logs / f"device-plugin-{node}.log")


# ----- live mode on the real control plane -------------------------------------------------------------


def live(pods: list[tuple[str, int, int]], quiet: float, timeout: float) -> dict[str, Any]:
    from kubelet import ControlPlane136
    from test_extender_e2e import Extender, _grant_extender_rbac, scheduler_config

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        cp = ControlPlane136(Path(tmp) / "cp")
        cp.start()
        ext = None
        try:
            for i in range(NODES):
                cp.create_gpu_node(
                    f"a100-{i}", node_labels(False), {"nvidia.com/gpu": str(GPUS * REPLICAS)}
                )
            ext = Extender(cp, _grant_extender_rbac(cp), [])
            ext.start()
            cp.start_scheduler(scheduler_config(ext.url))
            core = kubernetes.client.CoreV1Api(cp.api_client())
            out["live-stock"] = _live_stock(cp, core, pods, quiet, timeout)
            _clear(cp, core)
            out["live-plugin"] = _live_plugin(cp, core, pods, Path(tmp), quiet, timeout)
        finally:
            if ext is not None:
                ext.stop()
            cp.stop()
    return out


def _clear(cp: Any, core: Any) -> None:
    for p in core.list_namespaced_pod("default").items:
        core.delete_namespaced_pod(p.metadata.name, "default", grace_period_seconds=0)
    cp.wait_for(lambda: not core.list_namespaced_pod("default").items, timeout=60)
    time.sleep(2)


def _items(core: Any) -> list[dict[str, Any]]:
    return list(
        orjson.loads(core.list_namespaced_pod("default", _preload_content=False).data)["items"]
    )


def _stream_until_quiet(
    core: Any, pods: list, quiet: float, timeout: float, settled: Any = lambda: True
) -> tuple[list[dict[str, Any]], float]:
    """Create the stream at once, then wait until no pod was bound for `quiet` seconds and
    `settled()` holds; the pods, and the seconds until the last binding."""
    started = time.monotonic()
    for name, gib, gpus in pods:
        core.create_namespaced_pod("default", pod_body(name, gib, gpus))
    last_change, bound = time.monotonic(), -1
    while time.monotonic() - started < timeout:
        items = _items(core)
        now = sum(1 for p in items if (p.get("spec") or {}).get("nodeName"))
        if now != bound:
            bound, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > quiet and settled():
            break
        time.sleep(1)
    return _items(core), round(last_change - started, 1)


def _live_stock(cp: Any, core: Any, pods: list, quiet: float, timeout: float) -> dict[str, Any]:
    """NVIDIA's plugin (nothing runs on the nodes: vramsched books its worst case)."""
    items, seconds = _stream_until_quiet(core, pods, quiet, timeout)
    bound = [p for p in items if (p.get("spec") or {}).get("nodeName")]
    result = {
        "placed": len(bound),
        "placedTwoGpu": two_gpu(bound),
        "seconds": seconds,
        **stock_worst_case(assigned_holds(bound)),
    }
    print(f"live-stock: {result}", file=sys.stderr)
    return result


def _live_plugin(
    cp: Any, core: Any, pods: list, tmp: Path, quiet: float, timeout: float
) -> dict[str, Any]:
    """vramsched's plugin serving every node: one `vramsched device-plugin` process per node,
    registered with the node's stand-in kubelet, which admits every pod bound there."""
    kubelets, plugins = [], []
    try:
        for i in range(NODES):
            node = f"a100-{i}"
            core.patch_node(node, {"metadata": {"labels": node_labels(True)}})
            kubelet = StandInKubelet(node, tmp / node, core).start()
            plugin = plugin_process(
                node,
                cp.kubeconfig_path,
                cp.logs_dir,
                pod_resources=tmp / node / "pr" / "kubelet.sock",
                plugin_dir=tmp / node / "dp",
            )
            plugin.start()
            kubelets.append(kubelet)
            plugins.append(plugin)
        for kubelet in kubelets:
            kubelet.sim.wait_devices(GPUS * REPLICAS, timeout=60)

        def published() -> bool:
            for i in range(NODES):
                ann = core.read_node(f"a100-{i}").metadata.annotations or {}
                raw = ann.get(STATE_ANNOTATION)
                if not raw or not decode_state(raw).registered:
                    return False
            return True

        cp.wait_for(published, timeout=60, message="plugins published their state")
        time.sleep(2)  # the extender's node watch
        items, seconds = _stream_until_quiet(
            core, pods, quiet, timeout, lambda: all(k.settled() for k in kubelets)
        )
    finally:
        for plugin in plugins:
            plugin.stop()
        for kubelet in kubelets:
            kubelet.stop()
    bound = [p for p in items if (p.get("spec") or {}).get("nodeName")]
    admitted = [pod for k in kubelets for pod, _ in k.admitted.values()]
    # the independent count: the GPUs named in the Allocate answers the containers would get
    # (NVIDIA_VISIBLE_DEVICES), with the bytes the pods declared
    holds: list[Hold] = []
    other_gpu = 0
    for k in kubelets:
        index = {fake_uuid(k.node, i): i for i in range(GPUS)}
        for pod, uuids in k.admitted.values():
            got = [index[u] for u in uuids]
            holds.append((k.node, got, declared_per_gpu(pod)))
            booked = json.loads(pod["metadata"]["annotations"]["vramsched.io/assignment"])
            other_gpu += sorted(got) != sorted(int(d) for d in booked["devices"])
    seconds_all = [s for k in kubelets for s in k.allocate_seconds]
    result = {
        "bound": len(bound),
        "placed": len(admitted),
        "placedTwoGpu": two_gpu(admitted),
        "refusedAtAdmission": sum(len(k.refused) for k in kubelets),
        "refusals": sorted({r for k in kubelets for r in k.refused.values()})[:5],
        "givenOtherGpuThanBooked": other_gpu,
        "seconds": seconds,
        "allocateCalls": _summary(seconds_all) if seconds_all else None,
        **exact_count(holds),
    }
    print(f"live-plugin: {result}", file=sys.stderr)
    return result


def embedded(pods: list[tuple[str, int, int]]) -> dict[str, Any]:
    from extender.cluster import ClusterState
    from extender.embedded import EmbeddedBinder
    from extender.service import ExtenderService
    from extender.wire import ExtenderArgs, ExtenderBindingArgs

    nodes: list[dict[str, Any]] = [
        {
            "kind": "Node",
            "metadata": {"name": f"a100-{i}", "labels": node_labels(False)},
            "status": {
                "allocatable": {
                    "cpu": "64",
                    "memory": "512Gi",
                    "pods": "110",
                    "nvidia.com/gpu": str(GPUS * REPLICAS),
                }
            },
        }
        for i in range(NODES)
    ]
    c = ClusterState()
    c.load(nodes)  # no replica policy: exact per-GPU books, as `serve --cluster` keeps them
    svc = ExtenderService(c, EmbeddedBinder(c))
    names = [n["metadata"]["name"] for n in nodes]
    loop = asyncio.new_event_loop()
    for i, (name, gib, gpus) in enumerate(pods):
        body: dict[str, Any] = {**pod_body(name, gib, gpus), "kind": "Pod"}
        body["metadata"]["uid"] = f"uid-{i}"
        c.upsert_pod(body)
        feasible = svc.filter(ExtenderArgs(Pod=body, NodeNames=names)).NodeNames or []
        if not feasible:
            continue
        scores = svc.prioritize(ExtenderArgs(Pod=body, NodeNames=list(feasible)))
        host = max(scores, key=lambda h: h.Score).Host
        loop.run_until_complete(
            svc.bind(
                ExtenderBindingArgs(
                    PodName=name, PodNamespace="default", PodUID=f"uid-{i}", Node=host
                )
            )
        )
    loop.close()
    bound = [p for p in c.pods.values() if (p.get("spec") or {}).get("nodeName")]
    return {
        "placed": len(bound),
        "placedTwoGpu": two_gpu(bound),
        **exact_count(assigned_holds(bound)),
    }


# ----- Allocate latency ----------------------------------------------------------------------------------


class _Floor(dp_grpc.DevicePluginServicer):
    """The floor: answers Allocate at once, as a plugin that need not know the pod."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return dp.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(self, request: Any, context: Any) -> Any:
        yield dp.ListAndWatchResponse(devices=[dp.Device(ID=i, health="Healthy") for i in self.ids])
        while context.is_active():
            time.sleep(0.2)

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return dp.PreferredAllocationResponse(
            container_responses=[
                dp.ContainerPreferredAllocationResponse(
                    deviceIDs=list(r.available_deviceIDs)[: r.allocation_size]
                )
                for r in request.container_requests
            ]
        )

    def Allocate(self, request: Any, context: Any) -> Any:
        return dp.AllocateResponse(
            container_responses=[
                dp.ContainerAllocateResponse(
                    envs={"NVIDIA_VISIBLE_DEVICES": ",".join(r.devices_ids)}
                )
                for r in request.container_requests
            ]
        )


def _bench_pod(n: int, gpus: int) -> dict[str, Any]:
    """Pod n of the Allocate benchmark: one GPU, chosen by a seeded RNG (the same in both
    processes, so the plugin's cache holds every pod the kubelet will admit, as its informer
    would)."""
    gpu = random.Random(n).randrange(gpus)
    return {
        "metadata": {
            "name": f"p{n}",
            "namespace": "default",
            "uid": f"u{n}",
            "annotations": {
                "vramsched.io/assignment": orjson.dumps(
                    {"node": "bench", "devices": [str(gpu)], "bytesPerDevice": GIB}
                ).decode()
            },
        },
        "spec": {
            "nodeName": "bench",
            "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        },
    }


def _timed(servicer: Any, times: dict[str, list[tuple[float, float]]]) -> None:
    """Record each Allocate's and GetPreferredAllocation's wall time and CPU time in its own
    thread (the CPU time does not grow when the machine is busy: the plugin's own cost, whatever
    else runs), under `times["Allocate"]` and `times["GetPreferredAllocation"]`."""
    for method in ("Allocate", "GetPreferredAllocation"):
        inner = getattr(servicer, method)
        kept = times.setdefault(method, [])

        def timed(request: Any, context: Any, inner: Any = inner, kept: Any = kept) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(request, context)
            finally:
                kept.append((time.perf_counter() - wall, time.thread_time() - cpu))

        setattr(servicer, method, timed)


def _plugin_process(
    kind: str, root: str, gpus: int, replicas: int, pods: int, plugin_dir: str | None = None
) -> None:
    """The plugin under test, in a process of its own as on a node (the kubelet is another).
    On SIGTERM it writes the times `_timed` kept to <root>/times.json. `plugin_dir`: where the
    floor registers (a real kubelet's device-plugin folder), else <root>/dp."""
    import signal

    root_path = Path(root)
    source = FakeGpus("bench", gpus, MEMORY_MIB)
    stop = threading.Event()
    times: dict[str, list[tuple[float, float]]] = {}

    def done(*_: Any) -> None:
        # once: a daemon child can get a second SIGTERM at interpreter exit, after the parent
        # has read the file and removed the folder
        if stop.is_set():
            return
        stop.set()
        (root_path / "times.json").write_text(json.dumps(times))

    signal.signal(signal.SIGTERM, done)
    if kind == "vramsched":
        cache = {f"default/p{n}": _bench_pod(n, gpus) for n in range(pods)}
        service = DevicePluginService(
            node="bench",
            gpus=source.gpus(),
            replicas=replicas,
            strategies=("envvar",),
            kubelet_pods=PodResources(root_path / "pr" / "kubelet.sock", "nvidia.com/gpu").list,
            lookup=lambda keys: {k: cache[k] for k in keys if k in cache},
        )
        _timed(service, times)
        runner = PluginRunner(
            service,
            plugin_dir=root_path / "dp",
            socket_name="p.sock",
            source=source,
            publish=lambda s: None,
            poll=0.2,
        )
        threading.Thread(target=runner.run, daemon=True).start()
        stop.wait()
        runner.stop()
        return
    from extender.device_plugin.kubelet import register

    ids = [f"{g.uuid}::{r}" for g in source.gpus() for r in range(replicas)]
    server = grpc.server(futures.ThreadPoolExecutor(8))
    floor = _Floor(ids)
    _timed(floor, times)
    dp_grpc.add_DevicePluginServicer_to_server(floor, server)
    folder = Path(plugin_dir) if plugin_dir else root_path / "dp"
    server.add_insecure_port(f"unix:{folder / 'p.sock'}")
    server.start()
    register(folder, "p.sock", "nvidia.com/gpu")
    stop.wait()
    server.stop(0)


def _summary(seconds: list[float]) -> dict[str, Any]:
    seconds = sorted(seconds)
    return {
        "calls": len(seconds),
        "p50Ms": round(1000 * seconds[len(seconds) // 2], 3),
        "p99Ms": round(1000 * seconds[int(0.99 * (len(seconds) - 1))], 3),
        "maxMs": round(1000 * seconds[-1], 3),
        "meanMs": round(1000 * statistics.fmean(seconds), 3),
    }


def allocate(rounds: int, gpus: int = 16, replicas: int = 4) -> dict[str, Any]:
    import multiprocessing

    out: dict[str, Any] = {"replicas": gpus * replicas, "gpus": gpus, "rounds": rounds}
    out["loadAverageAtStart"] = [round(x, 1) for x in os.getloadavg()]
    slots = gpus * replicas
    budget = rounds * slots * 2  # pods the run may admit, known to the plugin's cache up front
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-alloc-") as tmp:
        for kind in ("vramsched", "floor"):
            root = Path(tmp) / kind
            kubelet = SimKubelet(
                root / "dp", root / "pr" / "kubelet.sock", "nvidia.com/gpu"
            ).start()
            proc = ctx.Process(
                target=_plugin_process, args=(kind, str(root), gpus, replicas, budget), daemon=True
            )
            proc.start()
            try:
                kubelet.wait_devices(slots, timeout=60)
                seconds: list[float] = []
                both: list[float] = []  # GetPreferredAllocation + Allocate, per container
                held: list[str] = []
                load: list[int] = []
                rng = random.Random(7)
                n = 0
                for _ in range(rounds):
                    # pods arrive until every replica is taken, then a random share leaves
                    while len(held) < slots and n < budget - 1:
                        body = _bench_pod(n, gpus)
                        n += 1
                        load.append(len(held))
                        try:
                            got = kubelet.admit(body)
                        except Exception:  # its GPU has no free replica
                            continue
                        seconds += got.allocate_seconds
                        both += map(sum, zip(got.preferred_seconds, got.allocate_seconds))
                        held.append(f"default/{body['metadata']['name']}")
                    for _ in range(rng.randint(1, slots)):
                        kubelet.remove(held.pop(rng.randrange(len(held))))
            finally:
                proc.terminate()
                proc.join(10)
                kubelet.stop()
            inside = json.loads((root / "times.json").read_text())
            out[kind] = {
                "kubeletWall": _summary(seconds),
                "kubeletWallWithPreferred": _summary(both),
                "pluginWall": _summary([w for w, _ in inside["Allocate"]]),
                "pluginCpu": _summary([c for _, c in inside["Allocate"]]),
                "pluginPreferredWall": _summary([w for w, _ in inside["GetPreferredAllocation"]]),
                "pluginPreferredCpu": _summary([c for _, c in inside["GetPreferredAllocation"]]),
                "podsOnNodeMean": round(statistics.fmean(load), 1),
            }
            print(f"allocate {kind}: {out[kind]}", file=sys.stderr)
    return out


# ----- Allocate latency under a real kubelet -------------------------------------------------------------


def _histogram(text: str, name: str) -> list[tuple[float, float]]:
    """A Prometheus histogram's cumulative buckets (le, count) from a /metrics page."""
    out = []
    for m in re.finditer(rf'^{name}_bucket{{(?:[^}}]*,)?le="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
        out.append((float(m.group(1)), float(m.group(2))))
    return sorted(out)


def _share_within(buckets: list[tuple[float, float]]) -> dict[str, Any]:
    total = buckets[-1][1] if buckets else 0.0
    within = dict(buckets)
    p99 = next((le for le, n in buckets if total and n >= 0.99 * total), None)
    return {
        "calls": int(total),
        "within5ms": round(within.get(0.005, 0.0) / total, 4) if total else None,
        "within10ms": round(within.get(0.01, 0.0) / total, 4) if total else None,
        "p99AtMostMs": None if p99 is None else round(1000 * p99, 1),
    }


def _shares(out: dict[str, Any], key: str) -> str:
    """`within 5 ms x%, within 10 ms y%, p99 <= z ms` of one histogram's summary."""
    h = out[key]
    if not h["calls"]:
        return "no calls"
    return (
        f"within 5 ms {100 * h['within5ms']:.1f}%, within 10 ms {100 * h['within10ms']:.1f}%, "
        f"p99 <= {h['p99AtMostMs']} ms"
    )


def _running(core: Any, names: list[str]) -> Any:
    def check() -> bool:
        phases = {
            p.metadata.name: p.status.phase for p in core.list_namespaced_pod("default").items
        }
        bad = [n for n in names if phases.get(n) == "Failed"]
        assert not bad, f"pods failed admission: {bad}"
        return all(phases.get(n) == "Running" for n in names)

    return check


def _pods_left(core: Any, count: int) -> Any:
    return lambda: len(core.list_namespaced_pod("default").items) == count


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _plugin_split(out: dict[str, Any], metrics: str) -> str:
    """Where vramsched's plugin spent the kubelet's wait, from its /metrics, into `out`; returns
    a line saying so."""
    out["pluginAllocate"] = _share_within(
        _histogram(metrics, "vramsched_device_plugin_allocate_seconds")
    )
    # the kubelet's other wait: GetPreferredAllocation, just before Allocate (the kubelet has no
    # histogram of it), where the plugin lists the kubelet's PodResources
    preferred = _histogram(metrics, "vramsched_device_plugin_preferred_allocation_seconds")
    out["pluginPreferredAllocation"] = _share_within(preferred)
    out["pluginPreferredAllocationBuckets"] = preferred
    # where the plugin's time goes: real List calls (GetPreferredAllocation's, and an Allocate's
    # without a fresh one to reuse), and the pod lookups of both
    out["pluginPodResourcesList"] = _share_within(
        _histogram(metrics, "vramsched_device_plugin_podresources_list_seconds")
    )
    out["pluginPodLookup"] = _share_within(
        _histogram(metrics, "vramsched_device_plugin_pod_lookup_seconds")
    )

    def counter(series: str) -> int:
        m = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.M)
        return int(float(m.group(1))) if m else 0

    out["served"] = counter('vramsched_device_plugin_allocations_total{outcome="served"}')
    out["podsReadFromApi"] = counter("vramsched_device_plugin_pods_read_from_api_total")
    out["podResourcesListReused"] = counter(
        "vramsched_device_plugin_podresources_list_reused_total"
    )
    return (
        f"GetPreferredAllocation inside the plugin {_shares(out, 'pluginPreferredAllocation')}; "
        f"{out['pluginPodResourcesList']['calls']} PodResources List calls, "
        f"{out['podResourcesListReused']} reused"
    )


def kubelet_allocate(
    rounds: int, *, paced: bool, floor: bool = False, gpus: int = 16, seed: int = 7
) -> dict[str, Any]:
    """Allocate as a real kubelet 1.36.3 waits on it: the e2e suite's node (containerd, runc,
    busybox pods) served by `vramsched device-plugin --fake-gpus 16 --replicas 4` (64 replicas),
    pods placed by vramsched through kube-scheduler until every replica is taken, then a random
    share deleted, `rounds` times; `paced`: one pod at a time, each running before the next
    is created (a node admitting a pod now and then), else each fill at once (a burst: the
    kubelet admits while it starts dozens of containers). The kubelet's own histogram
    (kubelet_device_plugin_alloc_duration_seconds, buckets 5 ms, 10 ms, ...) and the plugin's
    (vramsched_device_plugin_allocate_seconds) say how many calls took how long.

    `floor`: everything the same (control plane, vramsched placing the pods through
    kube-scheduler, the same seeded pods, the kubelet, containerd) but the node served by `_Floor`,
    a plugin that answers GetPreferredAllocation and Allocate at once without identifying the
    pod; the benchmark writes the state annotation the real plugin would. What the kubelet
    measures for it is what any plugin costs on this machine under this load."""
    import multiprocessing

    from kubelet import BUSYBOX_IMAGE, ControlPlane136, KubeletNode
    from test_extender_e2e import Extender, _grant_extender_rbac, gpu_labels, scheduler_config

    name = "bench-kubelet"
    slots = gpus * REPLICAS
    rng = random.Random(seed)
    out: dict[str, Any] = {
        "plugin": "floor" if floor else "vramsched",
        "replicas": slots,
        "gpus": gpus,
        "rounds": rounds,
        "paced": paced,
    }
    out["loadAverageAtStart"] = [round(x, 1) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="bench-dp-kubelet-") as tmp:
        cp = ControlPlane136(Path(tmp) / "cp")
        cp.start()
        node = KubeletNode(cp, Path(tmp) / "node", name, read_only_port=True)
        plugin = ext = None
        try:
            node.start()
            core = kubernetes.client.CoreV1Api(cp.api_client())
            labels = gpu_labels("NVIDIA-A100-SXM4-80GB", gpus, MEMORY_MIB, REPLICAS)
            core.patch_node(
                name, {"metadata": {"labels": {**labels, "vramsched.io/device-plugin": "true"}}}
            )
            probe = free_port()
            if floor:
                plugin = multiprocessing.get_context("spawn").Process(
                    target=_plugin_process,
                    args=("floor", tmp, gpus, REPLICAS, 0, str(DEVICE_PLUGIN_DIR)),
                    daemon=True,
                )
                plugin.start()
                state = PluginState(registered=True, gpus=gpus, replicas=REPLICAS)
                core.patch_node(
                    name, {"metadata": {"annotations": {STATE_ANNOTATION: encode_state(state)}}}
                )
            else:
                plugin = plugin_process(
                    name,
                    cp.kubeconfig_path,
                    cp.logs_dir,
                    pod_resources=node.root / "pod-resources" / "kubelet.sock",
                    gpus=gpus,
                    extra=("--probe-port", str(probe), "--probe-host", "127.0.0.1"),
                )
                plugin.start()
            ext = Extender(cp, _grant_extender_rbac(cp), [])
            ext.start()
            cp.start_scheduler(scheduler_config(ext.url))

            def serving() -> bool:
                n = core.read_node(name)
                meta, status = n.metadata, n.status
                raw = ((meta and meta.annotations) or {}).get(STATE_ANNOTATION)
                alloc = int(((status and status.allocatable) or {}).get("nvidia.com/gpu", "0"))
                return bool(raw and decode_state(raw).registered and alloc == slots)

            cp.wait_for(serving, timeout=90, message="plugin serving")
            held: list[str] = []
            made = 0
            for _ in range(rounds):
                fresh: list[str] = []
                while len(held) + len(fresh) < slots:
                    pod = pod_body(f"k{made:04d}", rng.randint(7, 20), 1)
                    pod["spec"]["nodeSelector"] = {"vramsched.io/device-plugin": "true"}
                    pod["spec"]["terminationGracePeriodSeconds"] = 0
                    c = pod["spec"]["containers"][0]
                    c.update(
                        image=BUSYBOX_IMAGE,
                        imagePullPolicy="Never",
                        command=["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
                    )
                    c["resources"]["requests"] = {"cpu": "1m", "memory": "4Mi"}
                    # the client serialises a plain dict body as it does a V1Pod
                    core.create_namespaced_pod("default", pod)  # type: ignore[arg-type]
                    fresh.append(pod["metadata"]["name"])
                    made += 1
                    if paced:
                        cp.wait_for(_running(core, fresh[-1:]), timeout=120, message="pod running")
                cp.wait_for(_running(core, fresh), timeout=600, interval=2, message="pods running")
                held += fresh
                for _ in range(rng.randint(slots // 4, 3 * slots // 4)):
                    gone = held.pop(rng.randrange(len(held)))
                    core.delete_namespaced_pod(gone, "default", grace_period_seconds=0)
                cp.wait_for(
                    _pods_left(core, len(held)),
                    timeout=300,
                    interval=2,
                    message="pods deleted",
                )
            kubelet_metrics = _get(f"http://127.0.0.1:{node.read_only_port}/metrics")
            buckets = _histogram(kubelet_metrics, "kubelet_device_plugin_alloc_duration_seconds")
            out["kubelet"] = _share_within(buckets)
            out["kubeletBuckets"] = buckets
            out["podsCreated"] = made
            out["loadAverageAtEnd"] = [round(x, 1) for x in os.getloadavg()]
            if floor:
                plugin.terminate()  # it writes the times it kept when told to stop
                plugin.join(10)
                plugin = None
                inside = json.loads((Path(tmp) / "times.json").read_text())
                out["floorAllocateInside"] = _summary([w for w, _ in inside["Allocate"]])
                split = f"inside the floor {out['floorAllocateInside']}"
            else:
                split = _plugin_split(out, _get(f"http://127.0.0.1:{probe}/metrics"))
            print(f"kubelet allocate: {out}", file=sys.stderr)
            print(
                f"kubelet allocate, {out['plugin']} ({'paced' if paced else 'burst'}, load average "
                f"at start {out['loadAverageAtStart'][0]}): {_shares(out, 'kubelet')} as the "
                f"kubelet waits on Allocate; {split}",
                file=sys.stderr,
            )
        finally:
            if isinstance(plugin, Component):
                plugin.stop()
            elif plugin is not None:
                plugin.terminate()
                plugin.join(10)
            if ext is not None:
                ext.stop()
            node.stop()
            cp.stop()
        node.check_host()
    return out


def _settle(below: float = 3.0, limit: float = 180.0) -> None:
    """Wait until the 1-minute load average is under `below` (or `limit` seconds passed), so
    no run starts in the previous one's wake (each run records its load average at start)."""
    deadline = time.monotonic() + limit
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)


def _pooled(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One histogram's shares over several runs (bucket counts summed)."""
    total: dict[float, float] = defaultdict(float)
    for run in runs:
        for le, n in run[key]:
            total[le] += n
    return _share_within(sorted(total.items()))


def kubelet_pairs(rounds: int, repeats: int) -> dict[str, Any]:
    """`kubelet_allocate` for vramsched's plugin and the floor, burst and paced, `repeats` times,
    the two plugins alternating which goes first, each run on a settled machine; every run, and
    the kubelet's histogram pooled per plugin and pace."""
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        for paced in (False, True):
            for floor in (False, True) if rep % 2 == 0 else (True, False):
                _settle()
                runs.append(kubelet_allocate(rounds, paced=paced, floor=floor))
    pooled: dict[str, Any] = {}
    for pace in ("burst", "paced"):
        mine = [r for r in runs if r["paced"] == (pace == "paced")]
        pooled[pace] = {
            plugin: {
                "kubeletAllocate": _pooled(
                    [r for r in mine if r["plugin"] == plugin], "kubeletBuckets"
                ),
                "runs": sum(r["plugin"] == plugin for r in mine),
            }
            for plugin in ("vramsched", "floor")
        }
        pooled[pace]["vramsched"]["pluginPreferredAllocation"] = _pooled(
            [r for r in mine if r["plugin"] == "vramsched"], "pluginPreferredAllocationBuckets"
        )
    for pace, both in pooled.items():
        print(
            f"kubelet allocate, {pace}, pooled over {repeats} runs each: "
            f"vramsched {both['vramsched']['kubeletAllocate']}, "
            f"floor {both['floor']['kubeletAllocate']}",
            file=sys.stderr,
        )
    return {"repeats": repeats, "pooled": pooled, "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["packing", "allocate", "kubelet"])
    parser.add_argument("--pods", type=whole(at_least=1), default=140)
    parser.add_argument("--seed", type=whole(at_least=0), default=20)
    parser.add_argument(
        "--quiet", type=number(above=0), default=20.0, help="seconds without a new binding"
    )
    parser.add_argument("--timeout", type=number(above=0), default=300.0)
    parser.add_argument(
        "--rounds", type=whole(at_least=1), default=40, help="allocate: fill-and-drain rounds"
    )
    parser.add_argument(
        "--kubelet-rounds", type=whole(at_least=1), default=3, help="kubelet: fill-and-drain rounds"
    )
    parser.add_argument(
        "--kubelet-repeats",
        type=whole(at_least=1),
        default=4,
        help="kubelet: runs of each plugin and pace",
    )
    parser.add_argument("--out", type=output_file, default=RESULTS)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    results["command"] = "make bench-device-plugin"
    if args.only in (None, "packing"):
        pods = stream(args.pods, args.seed)
        packing = {
            "pods": len(pods),
            "seed": args.seed,
            "nodes": f"{NODES} x {GPUS} x A100-80GB, {REPLICAS} replicas",
        }
        packing["embedded"] = embedded(pods)
        packing.update(live(pods, args.quiet, args.timeout))
        packing["pluginVsEmbedded"] = round(
            packing["live-plugin"]["placed"] / max(1, packing["embedded"]["placed"]), 3
        )
        results["packing"] = packing
    if args.only in (None, "allocate"):
        results["allocate"] = allocate(args.rounds)
    if args.only in (None, "kubelet"):
        results["allocateUnderKubelet"] = kubelet_pairs(args.kubelet_rounds, args.kubelet_repeats)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
