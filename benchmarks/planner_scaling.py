"""Planner scaling benchmark: a batch of pending pods on N nodes x 8 GPUs.

    .venv/bin/python benchmarks/planner_scaling.py                 # 100..5000 nodes, 500 pods
    .venv/bin/python benchmarks/planner_scaling.py --nodes 1000 --pods 500 --time-limit 1

The cluster: N nodes of 8 x 80 GiB GPUs (time-slicing, 8 replicas), 64 CPUs, 512 GiB. Nodes
already run LLM-serving pods of the usual sizes (10/20/40/80 GiB, a seeded draw per node from a
few deployment "shapes", like a fleet that runs a handful of services), 20% of nodes idle. The
pending batch draws from the same sizes plus 2- and 4-GPU pods. Results go to
benchmarks/results/planner_scaling.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extender.assignment import encode_assignment
from extender.commands.argtypes import number, output_file, whole
from extender.demand import Demand, PodRef
from extender.ledger import Reservation
from extender.planner.capacity import FragIndex, Workload
from extender.planner.greedy import greedy_batch
from extender.planner.model import solve_batch
from extender.quantity import GIB
from extender.simulate.engine import build_capacity

GPU_GIB = 80
SHAPES = [  # GiB used per GPU on a node of that shape
    [80, 80, 80, 80, 0, 0, 0, 0],
    [40, 40, 40, 40, 40, 40, 0, 0],
    [20, 20, 60, 60, 80, 80, 0, 0],
    [10, 30, 50, 70, 0, 0, 0, 0],
    [80, 80, 80, 80, 80, 80, 40, 40],
    [60, 60, 60, 60, 20, 20, 20, 20],
]


def cluster(n_nodes: int, seed: int):
    rng = random.Random(seed)
    nodes, bound = [], []
    for i in range(n_nodes):
        name = f"node-{i:05d}"
        labels = {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
            "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.memory": str(GPU_GIB * 1024),
            "nvidia.com/gpu.replicas": "8",
            "nvidia.com/gpu.sharing-strategy": "time-slicing",
        }
        alloc = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "64"}
        nodes.append(
            {
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
                "status": {"allocatable": alloc},
            }
        )
        if rng.random() < 0.2:
            continue
        shape = rng.choice(SHAPES)
        for g, gib in enumerate(shape):
            if gib == 0:
                continue
            pod = PodRef("bench", f"run-{i}-{g}")
            res = Reservation(pod, name, (str(g),), (gib * GIB,))
            bound.append(
                {
                    "kind": "Pod",
                    "metadata": {
                        "name": pod.name,
                        "namespace": "bench",
                        "annotations": {
                            "vramsched.io/model-memory": f"{gib}Gi",
                            **encode_assignment(res),
                        },
                    },
                    "spec": {
                        "nodeName": name,
                        "containers": [
                            {
                                "name": "c",
                                "resources": {
                                    "requests": {"cpu": "2", "memory": "16Gi"},
                                    "limits": {"nvidia.com/gpu": "1"},
                                },
                            }
                        ],
                    },
                    "status": {"phase": "Running"},
                }
            )
    return nodes, bound


def batch(n_pods: int, seed: int) -> list[Demand]:
    rng = random.Random(seed + 1)
    kinds = [(1, 10), (1, 20), (1, 20), (1, 40), (1, 40), (1, 80), (2, 80), (4, 80)]
    out = []
    for i in range(n_pods):
        k, gib = rng.choice(kinds)
        out.append(
            Demand(
                PodRef("bench", f"pending-{i}"),
                k,
                gib * GIB,
                cpu_milli=2000 * k,
                memory_bytes=16 * GIB * k,
                model_memory=gib * GIB * k,
            )
        )
    return out


def run(n_nodes: int, n_pods: int, time_limit: float, workers: int, seed: int) -> dict:
    nodes, bound = cluster(n_nodes, seed)
    _, cap = build_capacity(nodes, bound)
    demands = batch(n_pods, seed)
    wl = Workload.from_demands(demands)
    frag = FragIndex(cap, wl, count_foreign=False)
    t0 = time.perf_counter()
    greedy = greedy_batch(cap, demands, frag)
    t_greedy = time.perf_counter() - t0
    # what a scheduler placing one pod at a time does: FGD's rule in queue order (the plan's reference)
    sequential = greedy_batch(cap, demands, frag, order="arrival", rule="fgd")
    # prove: a plan that places every pod without the solver also proves, within the same time
    # limit, how many empty GPUs it must open (the plan's seconds include that proof)
    plan = solve_batch(cap, demands, frag, time_limit=time_limit, num_workers=workers, prove=True)
    return (
        {
            "nodes": n_nodes,
            "gpus": n_nodes * 8,
            "pods": n_pods,
            "timeLimit": time_limit,
            "workers": workers,
            "greedySeconds": round(t_greedy, 3),
            "planSeconds": round(plan.seconds, 3),
            "status": plan.status,
            "improved": plan.improved,
            "greedyPlaced": len(greedy),
            "sequentialPlaced": len(sequential),
            "placed": plan.placed,
            "greedyCost": list(plan.greedy_cost),
            "cost": list(plan.cost),
            "stages": [
                {
                    "status": s.status,
                    "objective": s.objective,
                    "bound": s.bound,
                    "gap": round(s.gap, 5),
                    "seconds": round(s.seconds, 3),
                }
                for s in plan.stages
            ],
            "gap": round(plan.gap, 5),
            **plan.stats,
            "goals": "cost = (priority-weighted pods left out, stranded VRAM increase KiB, empty GPUs opened, nodes touched)",
        }
        | _opened_gap(plan)
        | _stranded_gap(plan)
    )


def _opened_gap(plan) -> dict:
    lb = plan.stats.get("openedLowerBound")
    if lb is None or len(plan.cost) < 3:
        return {}
    opened = plan.cost[2]
    return {"openedGpus": opened, "openedGap": round((opened - lb) / opened, 5) if opened else 0.0}


def _stranded_gap(plan) -> dict:
    """Stranded VRAM: the plan's change (KiB, negative when the batch fills partly used GPUs) against
    the arc-flow bound on any plan placing every pod; the gap relative to the plan's change."""
    lb = plan.stats.get("strandedLowerBoundKiB")
    if lb is None or len(plan.cost) < 2:
        return {}
    kib = plan.cost[1]
    return {
        "strandedKiB": kib,
        "referenceStrandedKiB": plan.greedy_cost[1],
        "strandedGap": round(abs(kib - lb) / abs(kib), 9) if kib else float(kib != lb),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--nodes", type=whole(at_least=1), nargs="*", default=[100, 500, 1000, 2000, 5000]
    )
    ap.add_argument("--pods", type=whole(at_least=1), default=500)
    ap.add_argument("--time-limit", type=number(above=0), default=1.0)
    ap.add_argument("--workers", type=whole(at_least=1), default=2)
    ap.add_argument("--seed", type=whole(at_least=0), default=7)
    ap.add_argument(
        "--out",
        type=output_file,
        default=str(ROOT / "benchmarks" / "results" / "planner_scaling.json"),
    )
    return ap


def main() -> int:
    args = build_parser().parse_args()
    rows = []
    for n in args.nodes:
        r = run(n, args.pods, args.time_limit, args.workers, args.seed)
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = {
        "command": " ".join(["benchmarks/planner_scaling.py", *sys.argv[1:]]),
        "machine": platform.platform(),
        "python": platform.python_version(),
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
