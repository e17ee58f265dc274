"""A tiny cluster builder used by every test, so each test states its cluster in a few lines."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from extender.cluster import ClusterState
from extender.embedded import EmbeddedBinder
from extender.service import ExtenderService

FIXTURES = Path(__file__).parent / "fixtures" / "kube-scheduler-1.20"
_uid = itertools.count(1)

A100_80 = "NVIDIA-A100-SXM4-80GB"
H100_80 = "NVIDIA-H100-80GB-HBM3"


def gpu_node(
    name: str,
    *,
    count: int = 4,
    memory_mib: int = 81920,
    replicas: int = 1,
    strategy: str | None = None,
    product: str = A100_80,
    cpu: str = "64",
    memory: str = "512Gi",
    resource: str = "nvidia.com/gpu",
    allocatable: int | None = None,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node labelled like GPU Feature Discovery labels a time-sliced, MPS or exclusive GPU node."""
    if strategy is None:
        strategy = "time-slicing" if replicas > 1 else "none"
    shared = replicas > 1 and resource == "nvidia.com/gpu"
    labels = {
        "kubernetes.io/hostname": name,
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product + ("-SHARED" if shared else ""),
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": strategy,
        **(extra_labels or {}),
    }
    alloc = {
        "cpu": cpu,
        "memory": memory,
        "pods": "110",
        resource: str(allocatable if allocatable is not None else count * replicas),
    }
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": alloc, "capacity": dict(alloc)},
    }


def mig_mixed_node(
    name: str, profiles: dict[str, tuple[int, int]], *, gpus: int = 1, product: str = A100_80
) -> dict[str, Any]:
    """A mixed-strategy MIG node: `profiles` maps profile -> (count on node, memory MiB)."""
    labels = {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.replicas": "0",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig.capable": "true",
    }
    alloc: dict[str, str] = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    for profile, (count, mib) in profiles.items():
        labels[f"nvidia.com/mig-{profile}.count"] = str(count)
        labels[f"nvidia.com/mig-{profile}.memory"] = str(mib)
        labels[f"nvidia.com/mig-{profile}.replicas"] = "1"
        alloc[f"nvidia.com/mig-{profile}"] = str(count)
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": alloc},
    }


def mig_single_node(
    name: str, profile: str, *, slices: int, memory_mib: int, product: str = A100_80
) -> dict[str, Any]:
    labels = {
        "nvidia.com/gpu.product": f"{product}-MIG-{profile}",
        "nvidia.com/gpu.count": str(slices),
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/mig.strategy": "single",
    }
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": str(slices)}},
    }


def pod(
    name: str,
    memory: str | None = "16Gi",
    *,
    gpus: int = 1,
    namespace: str = "default",
    resource: str = "nvidia.com/gpu",
    priority: int = 0,
    node: str | None = None,
    annotations: dict[str, str] | None = None,
    scheduler: str = "vramsched",
    phase: str = "Pending",
    uid: str | None = None,
) -> dict[str, Any]:
    ann = dict(annotations or {})
    if memory is not None:
        ann["vramsched.io/model-memory"] = memory
    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "priority": priority,
        "containers": [
            {
                "name": "main",
                "image": "vllm",
                "resources": {"limits": {resource: str(gpus)}, "requests": {resource: str(gpus)}},
            }
        ],
    }
    if node:
        spec["nodeName"] = node
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{next(_uid)}",
            "annotations": ann,
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def assigned(node: str, device: str, gib: int) -> dict[str, str]:
    """The `vramsched.io/assignment` annotation of a pod holding `gib` GiB on one device."""
    return {
        "vramsched.io/assignment": json.dumps(
            {"node": node, "devices": [device], "bytesPerDevice": [gib << 30]}
        )
    }


def cluster(*objects: dict[str, Any], **kwargs: Any) -> ClusterState:
    c = ClusterState(**kwargs)
    c.load(objects)
    return c


def service(c: ClusterState) -> ExtenderService:
    return ExtenderService(c, EmbeddedBinder(c))


def fixture(name: str) -> dict[str, Any]:
    """A request body recorded from a real kube-scheduler, with our annotation key and schedulerName."""
    body = json.loads((FIXTURES / name).read_text())
    p = body.get("Pod")
    if p:
        ann = p["metadata"].get("annotations") or {}
        if "vram.example/request" in ann:
            ann["vramsched.io/model-memory"] = ann.pop("vram.example/request")
        p["spec"]["schedulerName"] = "vramsched"
    return body


def fixture_nodes() -> list[dict[str, Any]]:
    """The three GPU nodes the recorded scheduler saw (from the nodeCacheCapable=false run)."""
    return [dict(n, kind="Node") for n in fixture("042-filter.json")["Nodes"]["items"]]


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `add` and `test`, all the admission webhook emits, on a copy of `doc`."""
    import copy

    out = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = out
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] == "test":
            assert (parent[int(last)] if isinstance(parent, list) else parent[last]) == op["value"]
        elif isinstance(parent, list):
            if last == "-":
                parent.append(op["value"])
            else:
                parent.insert(int(last), op["value"])
        else:
            assert op["op"] == "add" and last not in parent, op
            parent[last] = op["value"]
    return out
