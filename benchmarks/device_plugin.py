"""What vramsched's device plugin buys, and what it costs the kubelet. Two benchmarks:

**packing** (on a real control plane: etcd 3.5 + kube-apiserver + kube-scheduler 1.36.3 running
the shipped scheduler config, and `vramsched serve` in live mode): four time-sliced 8 x
A100-80GB nodes (4 replicas per GPU, API-only nodes) and one seeded stream of inference pods
(7 to 60 GiB on one GPU, every tenth on two GPUs). The same stream, in the same run:

- `live-stock`: live mode, nodes under NVIDIA's plugin (the `distributed` worst case);
- `live-plugin`: live mode, the same nodes labelled vramsched.io/device-plugin=true with the
  plugin's state annotation (exact per-GPU books);
- `embedded`: the same stream through filter, prioritize and bind of an in-process embedded
  ExtenderService (exact books, no API server).

Placed pods, VRAM booked, and GPUs over their VRAM counted independently: from the pods'
assignment annotations alone (per-GPU sums for the exact modes; for live-stock, the most any
choice of NVIDIA's plugin could stack on one GPU), with no ledger code.

**allocate**: `Allocate` latency on a node with 16 GPUs x 4 replicas = 64 replicas, called over
gRPC as the kubelet's device manager calls it (SimKubelet: GetPreferredAllocation, then Allocate,
the kubelet's PodResources List answering from the pods it holds), the node holding 0 to 63 pods;
beside it, in the same run, the floor: a plugin that answers Allocate at once without identifying
the pod (what NVIDIA's plugin does).

    .venv/bin/python benchmarks/device_plugin.py            # both; make bench-device-plugin
    .venv/bin/python benchmarks/device_plugin.py --only allocate
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent import futures
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import grpc
import kubernetes.client
import orjson

from extender.device_plugin.api import deviceplugin_v1beta1_pb2 as dp
from extender.device_plugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from extender.device_plugin.gpus import FakeGpus
from extender.device_plugin.kubelet import PodResources
from extender.device_plugin.server import DevicePluginService, PluginRunner
from extender.device_plugin.simkubelet import SimKubelet
from extender.plugin_state import STATE_ANNOTATION, PluginState, encode_state

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


SERVED_STATE = {STATE_ANNOTATION: encode_state(PluginState(True, GPUS, REPLICAS))}


# ----- the independent count ---------------------------------------------------------------------------


def independent_count(pods: list[dict[str, Any]], exact: bool) -> dict[str, Any]:
    """From assignment annotations only. Exact: per (node, GPU) sums and replicas. Stock plugin:
    the worst any tie-break could stack on one GPU of a node (the `ceil(U/n)` largest)."""
    per_gpu: dict[tuple[str, str], list[int]] = defaultdict(list)
    per_node: dict[str, list[int]] = defaultdict(list)
    for p in pods:
        raw = (p["metadata"].get("annotations") or {}).get("vramsched.io/assignment")
        node = (p.get("spec") or {}).get("nodeName")
        if not raw or not node:
            continue
        a = json.loads(raw)
        sizes = a["bytesPerDevice"]
        sizes = sizes if isinstance(sizes, list) else [sizes] * len(a["devices"])
        for dev, b in zip(a["devices"], sizes):
            per_gpu[(node, dev)].append(int(b))
            per_node[node].append(int(b))
    cap = MEMORY_MIB * 1024**2
    if exact:
        over = sum(1 for v in per_gpu.values() if sum(v) > cap or len(v) > REPLICAS)
    else:
        over = 0
        for sizes in per_node.values():
            depth = min(REPLICAS, -(-len(sizes) // GPUS))
            if sum(sorted(sizes, reverse=True)[:depth]) > cap:
                over += 1  # a whole node's worth of GPUs the plugin could overfill
    booked = sum(sum(v) for v in per_gpu.values())
    return {
        "gpusOverVram": over,
        "bookedGiB": round(booked / GIB, 1),
        "bookedPercent": round(100 * booked / (NODES * GPUS * cap), 1),
        "gpusUsed": len(per_gpu),
    }


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
            for mode, served in (("live-stock", False), ("live-plugin", True)):
                for i in range(NODES):
                    meta: dict[str, Any] = {"labels": node_labels(served)}
                    meta["annotations"] = SERVED_STATE if served else {STATE_ANNOTATION: None}
                    if not served:
                        meta["labels"]["vramsched.io/device-plugin"] = None
                    core.patch_node(f"a100-{i}", {"metadata": meta})
                time.sleep(2)  # the extender's node watch
                out[mode] = _run_live(cp, core, pods, served, quiet, timeout)
                print(f"{mode}: {out[mode]}", file=sys.stderr)
                for p in core.list_namespaced_pod("default").items:
                    core.delete_namespaced_pod(p.metadata.name, "default", grace_period_seconds=0)
                cp.wait_for(lambda: not core.list_namespaced_pod("default").items, timeout=60)
                time.sleep(2)
        finally:
            if ext is not None:
                ext.stop()
            cp.stop()
    return out


def _run_live(cp: Any, core: Any, pods: list, served: bool, quiet: float, timeout: float) -> dict:
    started = time.monotonic()
    for name, gib, gpus in pods:
        core.create_namespaced_pod("default", pod_body(name, gib, gpus))
    last_change, bound = time.monotonic(), -1
    while time.monotonic() - started < timeout:
        items = orjson.loads(core.list_namespaced_pod("default", _preload_content=False).data)[
            "items"
        ]
        now = sum(1 for p in items if (p.get("spec") or {}).get("nodeName"))
        if now != bound:
            bound, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > quiet:
            break
        time.sleep(1)
    return {
        "placed": bound,
        "placedTwoGpu": sum(
            1
            for p in items
            if (p.get("spec") or {}).get("nodeName")
            and p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        ),
        "seconds": round(last_change - started, 1),
        **independent_count(items, exact=served),
    }


def embedded(pods: list[tuple[str, int, int]]) -> dict[str, Any]:
    from extender.cluster import ClusterState
    from extender.embedded import EmbeddedBinder
    from extender.service import ExtenderService
    from extender.wire import ExtenderArgs, ExtenderBindingArgs

    nodes = [
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
        body = dict(pod_body(name, gib, gpus), kind="Pod")
        body["metadata"]["uid"] = f"uid-{i}"
        c.upsert_pod(body)
        feasible = svc.filter(ExtenderArgs(Pod=body, NodeNames=names)).NodeNames or []
        if not feasible:
            continue
        scores = svc.prioritize(ExtenderArgs(Pod=body, NodeNames=feasible))
        scores = scores.to_list() if hasattr(scores, "to_list") else scores
        best = max(scores, key=lambda h: h.Score if hasattr(h, "Score") else h["Score"])
        host = best.Host if hasattr(best, "Host") else best["Host"]
        loop.run_until_complete(
            svc.bind(
                ExtenderBindingArgs(
                    PodName=name, PodNamespace="default", PodUID=f"uid-{i}", Node=host
                )
            )
        )
    loop.close()
    items = list(c.pods.values())
    return {
        "placed": sum(1 for p in items if (p.get("spec") or {}).get("nodeName")),
        "placedTwoGpu": sum(
            1
            for p in items
            if (p.get("spec") or {}).get("nodeName")
            and p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        ),
        **independent_count(items, exact=True),
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


def _timed(servicer: Any, times: list[tuple[float, float]]) -> None:
    """Record each Allocate's wall time and CPU time in its own thread (the CPU time does not
    grow when the machine is busy: the plugin's own cost, whatever else runs)."""
    inner = servicer.Allocate

    def allocate(request: Any, context: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(request, context)
        finally:
            times.append((time.perf_counter() - wall, time.thread_time() - cpu))

    servicer.Allocate = allocate


def _plugin_process(kind: str, root: str, gpus: int, replicas: int, pods: int) -> None:
    """The plugin under test, in a process of its own as on a node (the kubelet is another).
    On SIGTERM it writes the times `_timed` kept to <root>/times.json."""
    import signal

    root_path = Path(root)
    source = FakeGpus("bench", gpus, MEMORY_MIB)
    stop = threading.Event()
    times: list[tuple[float, float]] = []

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
    server.add_insecure_port(f"unix:{root_path / 'dp' / 'p.sock'}")
    server.start()
    register(root_path / "dp", "p.sock", "nvidia.com/gpu")
    stop.wait()


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
                "pluginWall": _summary([w for w, _ in inside]),
                "pluginCpu": _summary([c for _, c in inside]),
                "podsOnNodeMean": round(statistics.fmean(load), 1),
            }
            print(f"allocate {kind}: {out[kind]}", file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["packing", "allocate"])
    parser.add_argument("--pods", type=int, default=140)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--quiet", type=float, default=20.0, help="seconds without a new binding")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=40, help="allocate: fill-and-drain rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
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
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
