"""Benchmark: MIG geometry planner vs uniform geometries on a 100-node, 800-GPU cluster.

    .venv/bin/python benchmarks/mig_geometry.py [--time-limit 30] [--seed 7] [--write-cluster FILE]

Builds a Kubernetes List (nodes with GFD mixed-strategy MIG labels, running pods with vramsched
assignments, pending LLM pods with vramsched.io/model-memory), reads it back through the
``plan-mig`` cluster reader, then solves with the planner and with every uniform geometry.
Writes ``benchmarks/results/mig_geometry.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extender import mig
from extender.commands.argtypes import number, output_file, whole
from extender.commands.plan_mig import read_cluster
from extender.planner.mig_geometry import evaluate_uniform, plan_mig_geometry

GIB = mig.GIB
MIB = mig.MIB

# --- demand: vLLM serving memory ------------------------------------------------------------------
# slice memory needed = (weights + overhead + KV for KV_TOKENS tokens) / gpu_memory_utilization:
# vLLM's budget (vllm/v1/worker/gpu_worker.py, determine_available_memory), its default
# gpu_memory_utilization 0.92 (vllm/config/cache.py). KV bytes/token = 2 x num_hidden_layers x
# num_key_value_heads x head_dim x 2 (bf16), weights = parameters x bytes each, from each model's
# config.json and checkpoint on Hugging Face.
UTIL = 0.92
# activations + CUDA graphs + non-torch: vLLM measures it at start-up; an assumption here
OVERHEAD_GIB = 1.5
KV_TOKENS = 8192  # e.g. one 8k sequence or four 2k ones
LLMS = [
    # name, weights GiB, KV bytes/token, share of pending pods
    ("Qwen2.5-7B AWQ", 5.19, 57_344, 0.20),
    ("Llama-3-8B AWQ", 5.33, 131_072, 0.25),
    ("Qwen2.5-14B AWQ", 9.29, 196_608, 0.15),
    ("Llama-3-8B bf16", 14.96, 131_072, 0.15),
    ("Qwen2.5-32B AWQ", 18.00, 262_144, 0.12),
    ("Llama-3-70B AWQ", 37.04, 327_680, 0.08),
    ("Qwen2.5-32B bf16", 61.03, 262_144, 0.05),
]


def llm_bytes(weights_gib: float, kv_per_token: int) -> int:
    need = weights_gib * GIB + OVERHEAD_GIB * GIB + KV_TOKENS * kv_per_token
    return int(need / UTIL)


# --- cluster ----------------------------------------------------------------------------------------
NODE_MODELS = [("NVIDIA-A100-SXM4-80GB", 40), ("NVIDIA-H100-80GB-HBM3", 40), ("NVIDIA-H200", 20)]
START_LAYOUTS = [("all-balanced", 0.40), ("1g", 0.25), ("3g", 0.15), ("2g", 0.10), ("7g", 0.10)]
GPUS_PER_NODE = 8
BUSY_GPU_SHARE = 0.25  # GPUs that already run pods


def _pick(rng: random.Random, weighted):
    r = rng.random() * sum(w for _, w in weighted)
    for item, w in weighted:
        r -= w
        if r <= 0:
            return item
    return weighted[-1][0]


def build_cluster(seed: int, n_pending: int) -> list[dict]:
    rng = random.Random(seed)
    objs: list[dict] = []
    node_i = 0
    running_sizes = [llm_bytes(w, kv) for _, w, kv, _ in LLMS]
    for product, n_nodes in NODE_MODELS:
        model = mig.model_for_product(product)
        assert model is not None
        for _ in range(n_nodes):
            name = f"gpu-{node_i:03d}"
            node_i += 1
            fam = _pick(rng, START_LAYOUTS)
            fam = fam if fam == "all-balanced" else f"all-{fam}"
            geo = mig.uniform_geometry(model, fam)
            cfg = next(k for k, v in mig.named_geometries(model).items() if v == geo)
            labels = {
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/mig.capable": "true",
                "nvidia.com/mig.config": cfg,
                "nvidia.com/mig.config.state": "success",
            }
            for p, k in geo:
                key = "nvidia.com/" + mig.resource_name(p)[len("nvidia.com/") :]
                labels[key + ".count"] = str(k * GPUS_PER_NODE)
                labels[key + ".memory"] = str(model.profile(p).memory_bytes // MIB)
            objs.append(
                {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
            )
            ordinal: Counter[str] = Counter()
            for g in range(GPUS_PER_NODE):
                if rng.random() >= BUSY_GPU_SHARE:
                    continue
                slices = [p for p, k in geo for _ in range(k)]
                rng.shuffle(slices)
                for p in slices[: rng.randint(1, min(2, len(slices)))]:
                    fitting = [b for b in running_sizes if b <= model.profile(p).memory_bytes]
                    b = rng.choice(fitting) if fitting else model.profile(p).memory_bytes // 2
                    pod = f"run-{name}-{g}-{ordinal[p]}"
                    assignment = {
                        "node": name,
                        "devices": [f"{g}:{p}:{ordinal[p]}"],
                        "bytesPerDevice": b,
                    }
                    ordinal[p] += 1
                    objs.append(
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "metadata": {
                                "name": pod,
                                "namespace": "llm",
                                "annotations": {
                                    "vramsched.io/model-memory": f"{-(-b // MIB)}Mi",
                                    "vramsched.io/assignment": json.dumps(assignment),
                                },
                            },
                            "spec": {
                                "nodeName": name,
                                "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}],
                            },
                            "status": {"phase": "Running"},
                        }
                    )
    for i in range(n_pending):
        llm = _pick(rng, [((n, w, kv), s) for n, w, kv, s in LLMS])
        b = llm_bytes(llm[1], llm[2])
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"pending-{i:05d}",
                    "namespace": "llm",
                    "labels": {"model": llm[0].replace(" ", "-").replace(".", "-").lower()},
                    "annotations": {"vramsched.io/model-memory": f"{-(-b // MIB)}Mi"},
                },
                "spec": {
                    "schedulerName": "vramsched",
                    "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}],
                },
                "status": {"phase": "Pending"},
            }
        )
    return objs


def _timed(fn, *a, **kw):
    """Run a solve; return (plan, cpu seconds of this process, all threads)."""
    c0 = time.process_time()
    plan = fn(*a, **kw)
    return plan, time.process_time() - c0


def _summary(plan, cpu_s: float) -> dict:
    return {
        "pods_placed": plan.pods_placed,
        "pods_bound": plan.pods_bound,
        "status": plan.status,
        "stage_status": plan.stage_status,
        "gpus_in_use": plan.gpus_used,
        "new_gpus_used": plan.new_gpus_used,
        "reconfigured_gpus": plan.reconfigured_gpus,
        "nodes_relabelled": len(plan.node_labels()),
        "wasted_gib": round(plan.wasted_bytes / GIB, 1),
        "solve_seconds": round(plan.wall_seconds, 3),
        "cpu_seconds": round(cpu_s, 3),
        "stage_seconds": plan.stage_seconds,
        "model_size": plan.model_size,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--time-limit", type=number(above=0), default=30.0, help="planner time limit per solve (s)"
    )
    ap.add_argument("--uniform-time-limit", type=number(above=0), default=10.0)
    ap.add_argument("--workers", type=whole(at_least=1), default=2)
    ap.add_argument("--seed", type=whole(at_least=0), default=7)
    ap.add_argument(
        "--pending",
        type=whole(at_least=1),
        nargs="*",
        default=[1500, 3000, 4500],
        help="pending pod counts",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "mig_geometry.json",
    )
    ap.add_argument(
        "--write-cluster",
        type=output_file,
        help="also keep the generated cluster YAML (largest scenario)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    scenarios = []
    for n_pending in args.pending:
        objs = build_cluster(args.seed, n_pending)
        with tempfile.TemporaryDirectory() as td:
            path = Path(td) / "cluster.yaml"
            path.write_text(
                yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs}, sort_keys=False)
            )
            if args.write_cluster and n_pending == max(args.pending):
                args.write_cluster.write_text(path.read_text())
            t = time.perf_counter()
            snap = read_cluster(path)
            read_s = time.perf_counter() - t
        busy = sum(1 for g in snap.gpus if g.is_occupied)
        demand = Counter(p.model_memory_bytes for p in snap.pending)
        plan, cpu = _timed(
            plan_mig_geometry,
            snap.gpus,
            snap.pending,
            time_limit_s=args.time_limit,
            num_workers=args.workers,
        )
        uni = {
            fam: _summary(
                *_timed(
                    evaluate_uniform,
                    snap.gpus,
                    snap.pending,
                    fam,
                    time_limit_s=args.uniform_time_limit,
                    num_workers=args.workers,
                )
            )
            for fam in mig.UNIFORM_FAMILIES
        }
        best_fam = max(uni, key=lambda f: uni[f]["pods_placed"])
        scenarios.append(
            {
                "pending_pods": len(snap.pending),
                "mig_gpus": len(snap.gpus),
                "gpus_with_running_pods": busy,
                "cluster_read_seconds": round(read_s, 3),
                "demand_gib": {f"{b / GIB:.2f}": k for b, k in sorted(demand.items())},
                "planner": _summary(plan, cpu),
                "uniform": uni,
                "best_uniform": best_fam,
                "planner_minus_best_uniform": plan.pods_placed - uni[best_fam]["pods_placed"],
            }
        )
        print(
            f"pending={n_pending}: planner {plan.pods_placed} pods in {plan.wall_seconds:.2f}s ({plan.status}); "
            f"best uniform {best_fam} {uni[best_fam]['pods_placed']}",
            file=sys.stderr,
        )

    result = {
        "benchmark": "mig_geometry",
        "command": "python benchmarks/mig_geometry.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "cluster": {
            "nodes": sum(n for _, n in NODE_MODELS),
            "gpus_per_node": GPUS_PER_NODE,
            "models": {p: n for p, n in NODE_MODELS},
            "start_layouts": dict(START_LAYOUTS),
            "busy_gpu_share": BUSY_GPU_SHARE,
            "seed": args.seed,
        },
        "demand_model": {
            "formula": "(weights + overhead + KV_TOKENS x kv_bytes_per_token) / gpu_memory_utilization",
            "gpu_memory_utilization": UTIL,
            "overhead_gib": OVERHEAD_GIB,
            "kv_tokens": KV_TOKENS,
            "llms": {
                n: {"weights_gib": w, "slice_gib": round(llm_bytes(w, kv) / GIB, 2), "share": s}
                for n, w, kv, s in LLMS
            },
        },
        "solver": {
            "time_limit_s": args.time_limit,
            "uniform_time_limit_s": args.uniform_time_limit,
            "workers": args.workers,
        },
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "scenarios": scenarios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = []
    for sc in result["scenarios"]:
        lines.append(
            f"\n**{sc['pending_pods']} pending pods**, {sc['mig_gpus']} MIG GPUs "
            f"({sc['gpus_with_running_pods']} already running pods)\n"
        )
        lines.append(
            "| geometry | pods placed | new GPUs used | GPUs reconfigured | nodes relabelled | wasted GiB "
            "| solve s (wall) | CPU s | status |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        rows = [("**planner**", sc["planner"])] + [
            (f"uniform `{f}`", s) for f, s in sc["uniform"].items()
        ]
        for name, s in rows:
            lines.append(
                f"| {name} | {s['pods_placed']} | {s['new_gpus_used']} | {s['reconfigured_gpus']} | "
                f"{s['nodes_relabelled']} | {s['wasted_gib']} | {s['solve_seconds']} | {s['cpu_seconds']} | {s['status']} |"
            )
        p = sc["planner"]
        lines.append(
            f"\nplanner upper bound {p['pods_bound']}; best uniform `{sc['best_uniform']}` "
            f"({sc['planner_minus_best_uniform']:+d} pods for the planner)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
