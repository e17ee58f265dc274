"""Generate a large embedded cluster for load tests: GPU nodes plus the pods already on them.

The output is a Kubernetes `List` of Nodes and Pods in JSON (also valid YAML), the format
`vramsched serve --cluster FILE` reads; JSON because orjson parses a 100,000-pod file in
about a second. Node labels are what GPU Feature Discovery writes; every pre-filled pod is
bound and carries the `vramsched.io/assignment` annotation, so start-up reads placements
back instead of guessing them.

A sidecar `<out>.nodes.json` lists the node names (in file order) for the load generator,
which needs the candidate list without parsing the whole cluster.

    python -m loadtest.gen_cluster --nodes 5000 --gpus 8 --occupancy 0.6 --out cluster.json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extender.commands.argtypes import number, whole
from extender.demand import ASSIGNMENT, GPU_INDEX, MODEL_MEMORY
from extender.inventory import MAX_DEVICES_PER_NODE, node_inventory

GIB = 1 << 30
SCHEDULER_NAME = "vramsched"


@dataclass(frozen=True)
class NodeType:
    """One kind of GPU node in the fleet; `weight` is its share of the node count."""

    prefix: str
    product: str
    memory_mib: int
    weight: float
    replicas: int = 1
    sharing: str = "none"  # none | time-slicing | mps | mig
    instance_type: str = ""
    mig_per_gpu: tuple[tuple[str, int], ...] = ()  # mixed-strategy geometry of every GPU
    mig_memory_mib: tuple[tuple[str, int], ...] = ()


# A fleet like the ones that run LLM inference and fine-tuning: mostly H100/A100, some H200;
# big models on exclusive GPUs, small ones packed by time-slicing, MPS or MIG.
NODE_TYPES: tuple[NodeType, ...] = (
    NodeType("h100-x", "NVIDIA-H100-80GB-HBM3", 81559, 0.22, instance_type="p5.48xlarge"),
    NodeType("h200-x", "NVIDIA-H200", 143771, 0.12, instance_type="p5e.48xlarge"),
    NodeType(
        "a100-ts",
        "NVIDIA-A100-SXM4-80GB-SHARED",
        81920,
        0.20,
        replicas=10,
        sharing="time-slicing",
        instance_type="p4de.24xlarge",
    ),
    NodeType(
        "h200-ts",
        "NVIDIA-H200-SHARED",
        143771,
        0.10,
        replicas=8,
        sharing="time-slicing",
        instance_type="p5e.48xlarge",
    ),
    NodeType(
        "h100-mps",
        "NVIDIA-H100-80GB-HBM3-SHARED",
        81559,
        0.14,
        replicas=4,
        sharing="mps",
        instance_type="p5.48xlarge",
    ),
    NodeType(
        "a100-mig",
        "NVIDIA-A100-SXM4-80GB",
        81920,
        0.11,
        sharing="mig",
        instance_type="p4de.24xlarge",
        mig_per_gpu=(("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)),
        mig_memory_mib=(("1g.10gb", 9728), ("2g.20gb", 19968), ("3g.40gb", 40192)),
    ),
    NodeType(
        "h100-mig",
        "NVIDIA-H100-80GB-HBM3",
        81559,
        0.11,
        sharing="mig",
        instance_type="p5.48xlarge",
        mig_per_gpu=(("1g.10gb", 7),),
        mig_memory_mib=(("1g.10gb", 9984),),
    ),
)
#: `--gpus`' largest count: a node's label of a MIG profile's count may say at most
#: MAX_DEVICES_PER_NODE, and a MIG node type here has up to 7 slices of one profile per GPU
MAX_GPUS = MAX_DEVICES_PER_NODE // max(n for t in NODE_TYPES for _, n in t.mig_per_gpu)
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d")
NAMESPACES = tuple(f"team-{i:02d}" for i in range(24))
# Pods already running: (name stem, model memory GiB per GPU choices). Small ones share GPUs.
SMALL_MODELS = (
    ("bge-m3", 3),
    ("llama3-8b-awq", 6),
    ("qwen25-7b", 16),
    ("mistral-7b", 15),
    ("phi3-mini", 8),
    ("gemma2-9b", 19),
    ("llama3-8b", 17),
    ("qwen25-14b-awq", 10),
    ("whisper-large", 4),
)
BIG_MODELS = (
    ("llama3-70b", 36),
    ("qwen25-72b", 40),
    ("mixtral-8x22b", 70),
    ("llama31-405b-fp8", 58),
    ("deepseek-coder-33b", 66),
    ("llama3-70b-awq", 42),
)


def node_type_names() -> list[str]:
    return [t.prefix for t in NODE_TYPES]


def _node(t: NodeType, name: str, gpus: int, zone: str) -> dict[str, Any]:
    labels: dict[str, str] = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": t.instance_type,
        "topology.kubernetes.io/zone": zone,
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": t.product,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(t.memory_mib),
        "nvidia.com/cuda.driver.major": "550",
    }
    alloc: dict[str, str] = {
        "cpu": "188",
        "memory": "1900Gi",
        "pods": "250",
        "ephemeral-storage": "3Ti",
    }
    if t.sharing == "mig":
        labels["nvidia.com/mig.capable"] = "true"
        labels["nvidia.com/mig.strategy"] = "mixed"
        labels["nvidia.com/gpu.replicas"] = "0"
        mem = dict(t.mig_memory_mib)
        for profile, per_gpu in t.mig_per_gpu:
            count = per_gpu * gpus
            labels[f"nvidia.com/mig-{profile}.count"] = str(count)
            labels[f"nvidia.com/mig-{profile}.memory"] = str(mem[profile])
            labels[f"nvidia.com/mig-{profile}.replicas"] = "1"
            alloc[f"nvidia.com/mig-{profile}"] = str(count)
    else:
        labels["nvidia.com/gpu.replicas"] = str(t.replicas)
        labels["nvidia.com/gpu.sharing-strategy"] = t.sharing
        alloc["nvidia.com/gpu"] = str(gpus * t.replicas)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "resourceVersion": "1"},
        "status": {"allocatable": alloc, "capacity": dict(alloc)},
    }


class _PodFactory:
    """Bound pods with the annotations vramsched itself writes at bind time."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.count = 0

    def make(
        self, stem: str, node: str, devices: list[Any], per_device: int, model_memory: int | None
    ) -> dict[str, Any]:
        self.count += 1
        rng = self.rng
        ns = NAMESPACES[self.count % len(NAMESPACES)]
        resource = devices[0].resource
        annotations = {
            ASSIGNMENT: orjson.dumps(
                {
                    "node": node,
                    "devices": [d.device_id for d in devices],
                    "bytesPerDevice": [per_device] * len(devices),
                }
            ).decode(),
            GPU_INDEX: ",".join(str(i) for i in sorted({d.gpu_index for d in devices})),
        }
        if model_memory is not None:
            annotations[MODEL_MEMORY] = f"{model_memory // GIB}Gi"
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{stem}-{self.count:07d}",
                "namespace": ns,
                "uid": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                "labels": {"app": stem},
                "annotations": annotations,
            },
            "spec": {
                "schedulerName": SCHEDULER_NAME,
                "nodeName": node,
                "priority": rng.choice((0, 0, 0, 100, 1000)),
                "containers": [
                    {
                        "name": "server",
                        "image": "vllm/vllm-openai:v0.6.4",
                        "resources": {
                            "requests": {"cpu": "4", "memory": "32Gi"},
                            "limits": {resource: str(len(devices))},
                        },
                    }
                ],
            },
            "status": {"phase": "Running"},
        }


def _fill_node(
    t: NodeType, name: str, devices: list[Any], occupancy: float, pods: _PodFactory
) -> list[dict]:
    """Pods already running on one node, about `occupancy` of its slots and VRAM taken."""
    rng = pods.rng
    out: list[dict] = []
    if t.sharing == "mig":
        for d in devices:
            if rng.random() < occupancy:
                if rng.random() < 0.7:  # declared model memory below the slice size
                    gib = max(1, rng.randint(d.memory_bytes // GIB // 3, d.memory_bytes // GIB))
                    out.append(
                        pods.make(
                            f"mig-{rng.choice(SMALL_MODELS)[0]}", name, [d], gib * GIB, gib * GIB
                        )
                    )
                else:  # no annotation: the whole slice
                    out.append(pods.make("mig-notebook", name, [d], d.memory_bytes, None))
        return out
    if t.replicas == 1:
        free = list(devices)
        taken = sum(rng.random() < occupancy for _ in devices)
        while taken > 0:
            k = rng.choice([k for k in (1, 2, 4, 8) if k <= taken])
            group, free = free[:k], free[k:]
            taken -= k
            stem, gib = rng.choice(BIG_MODELS)
            gib = min(gib, devices[0].memory_bytes // GIB)
            out.append(pods.make(stem, name, group, gib * GIB, gib * GIB * k))
        return out
    # time-slicing / MPS: small models stacked on each GPU until the occupancy is reached
    for d in devices:
        cap = d.per_pod_cap_bytes
        target_bytes = occupancy * d.memory_bytes
        target_pods = max(1, round(occupancy * d.replicas)) if rng.random() < occupancy * 1.6 else 0
        used = 0
        n = 0
        while n < target_pods and used < target_bytes:
            stem, gib = rng.choice(SMALL_MODELS)
            need = gib * GIB
            if need > cap or used + need > d.memory_bytes:
                need = min(cap, d.memory_bytes - used) // GIB * GIB
                if need < GIB:
                    break
            out.append(pods.make(stem, name, [d], need, need))
            used += need
            n += 1
    return out


def generate(
    nodes: int, gpus: int = 8, occupancy: float = 0.6, seed: int = 1
) -> tuple[list[dict], list[dict]]:
    """(node objects, pod objects) of a deterministic cluster of `nodes` nodes."""
    if nodes < 1 or gpus < 1:
        raise ValueError("need at least one node with one GPU")
    if not 0.0 <= occupancy <= 1.0:
        raise ValueError("occupancy is a fraction between 0 and 1")
    rng = random.Random(seed)
    total = sum(t.weight for t in NODE_TYPES)
    # largest-remainder split of the node count over the types, every type at least once when possible
    quotas = [nodes * t.weight / total for t in NODE_TYPES]
    counts = [int(q) for q in quotas]
    for i in sorted(range(len(quotas)), key=lambda i: counts[i] - quotas[i])[: nodes - sum(counts)]:
        counts[i] += 1
    kinds = [t for t, c in zip(NODE_TYPES, counts) for _ in range(c)]
    rng.shuffle(kinds)
    node_objs: list[dict] = []
    pod_objs: list[dict] = []
    pods = _PodFactory(rng)
    seq: dict[str, int] = {}
    for t in kinds:
        seq[t.prefix] = seq.get(t.prefix, 0) + 1
        name = f"{t.prefix}-{seq[t.prefix]:05d}"
        node = _node(t, name, gpus, rng.choice(ZONES))
        inv = node_inventory(node)
        if inv.problem:
            raise AssertionError(f"generator wrote a node vramsched rejects: {name}: {inv.problem}")
        node_objs.append(node)
        pod_objs.extend(_fill_node(t, name, list(inv.devices), occupancy, pods))
    return node_objs, pod_objs


def write_cluster(path: Path, nodes: list[dict], pods: list[dict], meta: dict[str, Any]) -> Path:
    """Write the List and its `.nodes.json` sidecar; returns the sidecar path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "metadata": {"annotations": {"loadtest/params": orjson.dumps(meta).decode()}},
        "items": nodes + pods,
    }
    path.write_bytes(orjson.dumps(doc))
    sidecar = nodes_file(path)
    sidecar.write_bytes(
        orjson.dumps({**meta, "pods": len(pods), "nodes": [n["metadata"]["name"] for n in nodes]})
    )
    return sidecar


def nodes_file(cluster: Path) -> Path:
    return cluster.with_name(cluster.stem + ".nodes.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole(at_least=1), default=5000)
    p.add_argument(
        "--gpus",
        type=whole(at_least=1, at_most=MAX_GPUS),
        default=8,
        help="GPUs per node (default 8)",
    )
    p.add_argument(
        "--occupancy",
        type=number(at_least=0, at_most=1),
        default=0.6,
        help="fraction of GPU slots and VRAM already taken (default 0.6: 100,000 pods at 5,000 nodes)",
    )
    p.add_argument("--seed", type=whole(at_least=0), default=1)
    p.add_argument("--out", type=Path, required=True, help="cluster file to write (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    started = time.monotonic()
    nodes, pods = generate(args.nodes, args.gpus, args.occupancy, args.seed)
    meta = {
        "nodes_requested": args.nodes,
        "gpus": args.gpus,
        "occupancy": args.occupancy,
        "seed": args.seed,
    }
    write_cluster(args.out, nodes, pods, meta)
    print(
        f"wrote {args.out}: {len(nodes)} nodes x {args.gpus} GPUs, {len(pods)} running pods "
        f"({time.monotonic() - started:.1f}s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
