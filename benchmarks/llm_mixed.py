"""Heterogeneous LLM scenario: every simulator policy on exclusive, time-sliced, MPS and MIG pools.

    .venv/bin/python benchmarks/llm_mixed.py                # make bench-llm-mixed
    .venv/bin/python benchmarks/llm_mixed.py --write        # regenerate the scenario file
    .venv/bin/python benchmarks/llm_mixed.py --streams 12   # 12 other streams of the same mix

The cluster and the pod stream are in config/scenarios/llm-mixed.yaml (a List of Nodes and Pods,
as `vramsched simulate --nodes F --pods F` reads it). Nodes are named so that, listed in name
order as an informer lists them, the exclusive H100 nodes come first. Pod sizes are the
`vramsched estimate` figures of catalogue models (vLLM, 8,192-token context); `--write` asks the
sizing module again, so a catalogue change shows up in the file's diff. Per policy the table
has the pods placed and failed, the GPUs in use, the memory stranded (on every GPU, the free
memory its free replicas cannot reach: the rest of an exclusive GPU or MIG slice in use, a
time-sliced GPU's memory behind its last replica, the unused rest of MPS shares) and the GPUs
overcommitted; `--json FILE` also writes every figure of each policy.

`--streams N` asks whether the result holds beyond the one stream the scenario file holds: it
draws N other streams from the same mix (seeds after `SEED`) on the same cluster, replays each
at several loads (a share of its pods) and counts per policy the streams where it is ahead of,
tied with or behind the best of FGD, first-fit and best-fit, comparing (pods failed, GPUs in
use, memory stranded) in that order.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml

from extender.commands.argtypes import number, output_file, whole
from extender.planner.capacity import Workload
from extender.quantity import GIB, parse_bytes
from extender.simulate.engine import (
    ALL_POLICIES,
    MOVE_BUDGET,
    REPACK_TIME_LIMIT,
    PolicyResult,
    overcommit_text,
    run_policy,
)
from extender.simulate.profile import PROFILES
from extender.simulate.trace import Task, read_inputs
from extender.sizing.engines import EngineSettings
from extender.sizing.estimate import estimate, resolve_model

SCENARIO = ROOT / "config" / "scenarios" / "llm-mixed.yaml"

H100 = ("NVIDIA-H100-80GB-HBM3", 81559)
A100 = ("NVIDIA-A100-SXM4-80GB", 81920)
T4 = ("Tesla-T4", 15360)
#: one A100's MIG layout on the MIG nodes (mixed strategy): 3+2+1+1 compute slices of 7
MIG_LAYOUT = {"3g.40gb": (1, 40192), "2g.20gb": (1, 19968), "1g.10gb": (2, 9984)}

#: (prefix, nodes, GPUs per node, (product, MiB), sharing, replicas); names sort in this order
POOLS: list[tuple[str, int, int, tuple[str, int], str, int]] = [
    ("ex-h100", 4, 8, H100, "none", 1),
    ("mig-a100", 2, 8, A100, "mig", 1),
    ("mps-h100", 2, 8, H100, "mps", 4),
    ("t4", 4, 4, T4, "none", 1),
    ("ts-a100", 6, 8, A100, "time-slicing", 4),
]

#: deployments: (model or None for a whole GPU without annotation, tensor parallel GPUs,
#: resource, weight); each arrives with 1-4 replicas at once
DEPLOYMENTS: list[tuple[str | None, int, str, int]] = [
    ("Qwen/Qwen2.5-0.5B-Instruct", 1, "nvidia.com/gpu", 7),
    ("Qwen/Qwen3-0.6B", 1, "nvidia.com/gpu", 7),
    ("Qwen/Qwen2.5-1.5B-Instruct", 1, "nvidia.com/gpu", 6),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", 1, "nvidia.com/gpu", 12),
    ("meta-llama/Llama-3.1-8B-Instruct", 1, "nvidia.com/gpu", 15),
    ("Qwen/Qwen2.5-7B-Instruct", 1, "nvidia.com/gpu", 8),
    ("Qwen/Qwen2.5-14B-Instruct-AWQ", 1, "nvidia.com/gpu", 6),
    ("Qwen/Qwen2.5-14B-Instruct", 1, "nvidia.com/gpu", 8),
    ("Qwen/Qwen2.5-32B-Instruct-AWQ", 1, "nvidia.com/gpu", 8),
    ("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", 2, "nvidia.com/gpu", 5),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", 2, "nvidia.com/gpu", 3),
    ("meta-llama/Llama-3.1-70B-Instruct", 4, "nvidia.com/gpu", 2),
    ("Qwen/Qwen2.5-0.5B-Instruct", 1, "nvidia.com/mig-1g.10gb", 4),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", 1, "nvidia.com/mig-2g.20gb", 3),
    ("Qwen/Qwen2.5-32B-Instruct-AWQ", 1, "nvidia.com/mig-3g.40gb", 2),
    (None, 1, "nvidia.com/gpu", 4),  # a whole GPU: a notebook, a fine-tuning job
]
CONTEXT = 8192
SEED = 7
#: the stream stops once the model memory asked reaches this share of the cluster's GPU memory
FILL = 0.9


def _node(name: str, gpus: int, gpu: tuple[str, int], sharing: str, replicas: int) -> dict:
    product, mib = gpu
    labels = {
        "kubernetes.io/hostname": name,
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(mib),
    }
    alloc: dict[str, str] = {"cpu": "192", "memory": "2Ti", "pods": "110"}
    if sharing == "mig":
        labels.update(
            {
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.replicas": "0",
                "nvidia.com/mig.capable": "true",
                "nvidia.com/mig.strategy": "mixed",
            }
        )
        for profile, (per_gpu, slice_mib) in MIG_LAYOUT.items():
            labels[f"nvidia.com/mig-{profile}.count"] = str(per_gpu * gpus)
            labels[f"nvidia.com/mig-{profile}.memory"] = str(slice_mib)
            labels[f"nvidia.com/mig-{profile}.replicas"] = "1"
            alloc[f"nvidia.com/mig-{profile}"] = str(per_gpu * gpus)
    else:
        shared = replicas > 1
        labels.update(
            {
                "nvidia.com/gpu.product": product + ("-SHARED" if shared else ""),
                "nvidia.com/gpu.replicas": str(replicas),
                "nvidia.com/gpu.sharing-strategy": sharing,
            }
        )
        alloc["nvidia.com/gpu"] = str(gpus * replicas)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": alloc, "capacity": dict(alloc)},
    }


def _model_memory(model: str, tp: int) -> str:
    """`vramsched estimate MODEL --max-model-len 8192 -tp TP`'s annotation value."""
    settings = EngineSettings(max_model_len=CONTEXT, tp=tp)
    return estimate(resolve_model(model), settings).model_memory


def _pod(
    name: str, app: str, when: datetime, tp: int, resource: str, memory: str | None
) -> dict[str, Any]:
    annotations = {} if memory is None else {"vramsched.io/model-memory": memory}
    limits = {resource: str(tp), "cpu": "4", "memory": "32Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": f"uid-{name}",
            "creationTimestamp": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "labels": {"app": app},
            "annotations": annotations,
        },
        "spec": {
            "schedulerName": "vramsched",
            "containers": [
                {"name": "server", "image": "vllm/vllm-openai", "resources": {"limits": limits}}
            ],
        },
    }


def scenario(seed: int = SEED) -> dict[str, Any]:
    """The cluster and the pod stream (deterministic: `seed`; the scenario file's is `SEED`)."""
    nodes = [
        _node(f"{prefix}-{i}", gpus, gpu, sharing, replicas)
        for prefix, count, gpus, gpu, sharing, replicas in POOLS
        for i in range(count)
    ]
    names = [n["metadata"]["name"] for n in nodes]
    assert names == sorted(names), "nodes are listed in name order"
    capacity = sum(
        count * gpus * gpu[1] * 2**20 for _, count, gpus, gpu, _, _ in POOLS
    )  # the MIG GPUs counted whole
    sizes = {(m, tp): _model_memory(m, tp) for m, tp, _, _ in DEPLOYMENTS if m is not None}
    rng = random.Random(seed)
    when = datetime(2025, 1, 1, tzinfo=UTC)
    pods: list[dict] = []
    asked = 0
    weights = [w for *_, w in DEPLOYMENTS]
    while asked < FILL * capacity:
        model, tp, resource, _ = rng.choices(DEPLOYMENTS, weights)[0]
        when += timedelta(seconds=rng.randint(1, 30))
        memory = sizes[(model, tp)] if model is not None else None
        app = (model or "whole-gpu").split("/")[-1].lower().replace(".", "-")
        if resource != "nvidia.com/gpu":
            app += "-" + resource.removeprefix("nvidia.com/")
        for _ in range(rng.randint(1, 4)):
            pods.append(_pod(f"{app}-{len(pods):03d}", app, when, tp, resource, memory))
            asked += parse_bytes(memory) if memory else 80 * GIB * tp
    return {
        "apiVersion": "v1",
        "kind": "List",
        "items": nodes + pods,
    }


HEADER = """\
# Heterogeneous LLM scenario for `vramsched simulate` (benchmarks/llm_mixed.py; regenerate with
# `benchmarks/llm_mixed.py --write`). Nodes in name order, exclusive H100 first; pod sizes are
# `vramsched estimate MODEL --max-model-len 8192 [-tp N]` of catalogue models; MIG pods ask for
# a profile, whole-GPU pods carry no model-memory annotation.
"""


def write() -> Path:
    SCENARIO.parent.mkdir(parents=True, exist_ok=True)
    SCENARIO.write_text(HEADER + yaml.safe_dump(scenario(), sort_keys=False, width=100))
    return SCENARIO


def run(
    policies: list[str],
    time_limit: float,
    pods: int | None = None,
    repack_limits: list[float] | None = None,
    move_budget: float = MOVE_BUDGET,
    profile: str = "whole",
) -> list[PolicyResult]:
    """Every policy on the scenario, or on its first `pods` pods (the same stream, stopped
    earlier: a lighter load); `planner+repack` once per repack search time limit, labelled with
    it unless it is the default, and once with `OPEN_GPU_COST` (`REPACK_OPEN_LABEL`); the
    planner also with it (`OPEN_LABEL`). `profile`: `run_policy`'s."""
    nodes, tasks, bound = read_inputs(SCENARIO, SCENARIO)
    tasks = tasks[:pods]
    workload = Workload.from_demands(t.demand for t in tasks)
    out = []
    for policy in policies:
        repack = policy == "planner+repack"
        for limit in (repack_limits or [REPACK_TIME_LIMIT]) if repack else [REPACK_TIME_LIMIT]:
            r = run_labelled(
                policy, nodes, tasks, bound, workload, time_limit, move_budget, limit, profile
            )
            if limit != REPACK_TIME_LIMIT:
                r = replace(r, policy=f"{policy}, {limit:g} s per search")
            print(f"  {r.policy}: done in {r.seconds:.1f}s", file=sys.stderr, flush=True)
            out.append(r)
        if policy == "planner+repack":
            out.append(
                run_labelled(
                    REPACK_OPEN_LABEL,
                    nodes,
                    tasks,
                    bound,
                    workload,
                    time_limit,
                    move_budget,
                    profile=profile,
                )
            )
        if policy == "planner":
            out.append(
                run_labelled(OPEN_LABEL, nodes, tasks, bound, workload, time_limit, profile=profile)
            )
    return out


#: the planner's `--open-gpu-cost` this benchmark runs beside the default (0): a charge of a fifth
#: of a GPU's memory for each idle GPU a placement opens
OPEN_GPU_COST = 0.2
OPEN_LABEL = f"planner, open-GPU cost {OPEN_GPU_COST:g}"
#: the same with repacking (`serve --repack --open-gpu-cost 0.2`): moves within the default budget
REPACK_OPEN_LABEL = f"planner+repack, open-GPU cost {OPEN_GPU_COST:g}"
#: pods placed at once with the charged rule planned ahead (`serve --plan-ahead 8
#: --open-gpu-cost 0.2`): what live mode does for a stream, where no pod waits for a plan
AHEAD_OPEN_LABEL = f"plan-ahead, open-GPU cost {OPEN_GPU_COST:g}"


def run_labelled(
    label: str,
    nodes: list[Mapping[str, Any]],
    tasks: list[Task],
    bound: list[Mapping[str, Any]],
    workload: Workload,
    time_limit: float,
    move_budget: float = MOVE_BUDGET,
    repack_time_limit: float = REPACK_TIME_LIMIT,
    profile: str = "whole",
) -> PolicyResult:
    """`label` is a policy name, or `OPEN_LABEL` / `REPACK_OPEN_LABEL` / `AHEAD_OPEN_LABEL`: the
    planner / planner+repack / plan-ahead with `OPEN_GPU_COST`. `move_budget`, `repack_time_limit`: planner+repack's; `profile`: the
    pod mix FGD's measure weighs by (`run_policy`'s)."""
    policy, cost = {
        OPEN_LABEL: ("planner", OPEN_GPU_COST),
        REPACK_OPEN_LABEL: ("planner+repack", OPEN_GPU_COST),
        AHEAD_OPEN_LABEL: ("plan-ahead", OPEN_GPU_COST),
    }.get(label, (label, 0.0))
    r = run_policy(
        policy,
        nodes,
        tasks,
        bound,
        workload=workload,
        time_limit=time_limit,
        open_cost=cost,
        move_budget=move_budget,
        repack_time_limit=repack_time_limit,
        profile=profile,
    )
    return replace(r, policy=label)


#: `--streams`: each stream replayed up to these shares of its pods
STREAM_LOADS = (0.3, 0.45, 0.6, 0.75, 1.0)
#: the policies a stream's result is compared with
BASELINES = ("fgd", "first-fit", "best-fit")
#: the policies compared (spread overcommits; planner+repack, with its default move budget, only
#: with the open-GPU charge: without it the planner makes FGD's choices here)
STREAM_POLICIES = ("planner", OPEN_LABEL, REPACK_OPEN_LABEL, AHEAD_OPEN_LABEL, "hot-path")


def stream_inputs(seed: int) -> tuple[list[Mapping[str, Any]], list[Task], list[Mapping[str, Any]]]:
    """Nodes, tasks and bound pods of the stream drawn with `seed`, read through the same reader
    as the scenario file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stream.yaml"
        path.write_text(yaml.safe_dump(scenario(seed), sort_keys=False))
        return read_inputs(path, path)


def rank(r: PolicyResult) -> tuple[int, int, int]:
    """Better is smaller: fewer pods failed, then fewer GPUs in use, then less memory stranded."""
    return (r.failed, r.gpusInUse, r.strandedBytes)


def streams(
    seeds: list[int],
    time_limit: float,
    move_budget: float = MOVE_BUDGET,
    profile: str = "whole",
) -> dict[int, dict[float, dict[str, PolicyResult]]]:
    """Every compared policy and baseline on each stream, at each of `STREAM_LOADS` (the
    workload profile FGD and the planner get is the replayed part's, as `run` gives it, or with
    `profile="live"` the pods arrived so far)."""
    out: dict[int, dict[float, dict[str, PolicyResult]]] = {}
    for seed in seeds:
        nodes, tasks, bound = stream_inputs(seed)
        out[seed] = {}
        for share in STREAM_LOADS:
            part = tasks[: round(share * len(tasks))]
            workload = Workload.from_demands(t.demand for t in part)
            out[seed][share] = {
                p: run_labelled(
                    p, nodes, part, bound, workload, time_limit, move_budget, profile=profile
                )
                for p in (*STREAM_POLICIES, *BASELINES)
            }
        print(f"  stream {seed}: {len(tasks)} pods done", file=sys.stderr, flush=True)
    return out


def streams_table(res: dict[int, dict[float, dict[str, PolicyResult]]]) -> str:
    """Per policy and load: streams ahead of / tied with / behind the best baseline (`rank`)."""
    lines = [
        "| policy | " + " | ".join(f"{share:.0%} of the pods" for share in STREAM_LOADS) + " |",
        "|---|" + "---:|" * len(STREAM_LOADS),
    ]
    for policy in STREAM_POLICIES:
        cells = []
        for share in STREAM_LOADS:
            ahead = tied = behind = 0
            for runs in res.values():
                mine = rank(runs[share][policy])
                best = min(rank(runs[share][b]) for b in BASELINES)
                ahead += mine < best
                tied += mine == best
                behind += mine > best
            cells.append(f"{ahead} / {tied} / {behind}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def streams_detail(res: dict[int, dict[float, dict[str, PolicyResult]]]) -> str:
    """Every run: pods failed, GPUs in use, memory stranded (GiB), per stream and load."""
    policies = (*STREAM_POLICIES, *BASELINES)
    lines = [
        "| stream | load | " + " | ".join(policies) + " |",
        "|---:|---:|" + "---|" * len(policies),
    ]
    for seed, runs in res.items():
        for share in STREAM_LOADS:
            cells = [
                f"{r.failed} / {r.gpusInUse} / {r.strandedBytes / GIB:.0f}"
                for r in (runs[share][p] for p in policies)
            ]
            lines.append(f"| {seed} | {share:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: list[PolicyResult]) -> str:
    lines = [
        "| policy | pods placed | failed | GPUs in use (a MIG slice is one) "
        "| memory stranded (GiB) | GPU memory allocated (GiB) | overcommitted GPUs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.placed} | {r.failed} | {r.gpusInUse} "
            f"| {r.strandedBytes / GIB:.1f} | {r.allocatedMemoryBytes / GIB:.1f} "
            f"| {overcommit_text(r.overcommittedGpus, r.overcommittedGpusPeak)} |"
        )
    return "\n".join(lines)


def by_load(runs: dict[int, list[PolicyResult]]) -> str:
    """GPUs in use / memory stranded (GiB) per policy after the first N pods of the stream,
    with the pods that failed."""
    loads = sorted(runs)
    lines = [
        "| policy | " + " | ".join(f"first {n} pods" for n in loads) + " |",
        "|---|" + "---:|" * len(loads),
    ]
    for i, policy in enumerate(r.policy for r in runs[loads[0]]):
        cells = []
        for n in loads:
            r = runs[n][i]
            failed = f", {r.failed} failed" if r.failed else ""
            over = f", {r.overcommittedGpusPeak} overcommitted" if r.overcommittedGpusPeak else ""
            cells.append(f"{r.gpusInUse} / {r.strandedBytes / GIB:.0f}{failed}{over}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="regenerate the scenario file and stop")
    p.add_argument("--policies", nargs="*", default=list(ALL_POLICIES))
    p.add_argument(
        "--time-limit", type=number(above=0), default=0.25, help="planner: seconds per batch"
    )
    p.add_argument(
        "--repack-time-limits",
        type=number(above=0),
        nargs="*",
        default=[REPACK_TIME_LIMIT, 5.0],
        help="planner+repack: seconds per repack search, one row each (default 1 5)",
    )
    p.add_argument(
        "--loads",
        type=whole(at_least=1),
        nargs="*",
        default=[100, 150, 200, 250],
        help="also replay the first N pods of the stream (default 100 150 200 250)",
    )
    p.add_argument(
        "--streams",
        type=whole(at_least=1),
        metavar="N",
        help="instead: N other streams of the same mix, each at several loads, against the baselines",
    )
    p.add_argument(
        "--move-budget",
        type=number(at_least=0, at_most=1),
        default=MOVE_BUDGET,
        help=f"planner+repack's moves, a fraction of the pods placed (default {MOVE_BUDGET:g})",
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="whole",
        help="the pod mix FGD's measure (FGD's and the planner's) weighs by: the replayed pods' "
        "(whole, default) or the pods arrived so far, as serve counts them (live)",
    )
    p.add_argument("--json", type=output_file, help="also write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.write:
        print(f"wrote {write().relative_to(ROOT)}")
        return 0
    if args.streams:
        seeds = list(range(SEED + 1, SEED + 1 + args.streams))
        res = streams(seeds, args.time_limit, args.move_budget, args.profile)
        print(
            f"{args.streams} other streams (seeds {seeds[0]}-{seeds[-1]}): streams ahead / tied /"
            " behind the best of " + ", ".join(BASELINES)
        )
        print(streams_table(res))
        print()
        print("pods failed / GPUs in use / memory stranded (GiB):")
        print(streams_detail(res))
        if args.json:
            keep = ("placed", "failed", "gpusInUse", "strandedBytes", "allocatedMemoryBytes")
            body = {
                "command": " ".join(["benchmarks/llm_mixed.py", *(argv or sys.argv[1:])]),
                "loads": list(STREAM_LOADS),
                "profile": args.profile,
                "streams": {
                    str(seed): {
                        f"{share:g}": {
                            p: {k: getattr(r, k) for k in keep} for p, r in runs[share].items()
                        }
                        for share in STREAM_LOADS
                    }
                    for seed, runs in res.items()
                },
            }
            args.json.write_text(json.dumps(body, indent=1) + "\n")
        return 0
    nodes, tasks, _ = read_inputs(SCENARIO, SCENARIO)
    print(f"{len(nodes)} nodes, {len(tasks)} pods ({SCENARIO.relative_to(ROOT)})")
    results = run(
        args.policies,
        args.time_limit,
        None,
        args.repack_time_limits,
        args.move_budget,
        args.profile,
    )
    print(table(results))
    if args.loads:
        runs = {
            n: run(
                args.policies,
                args.time_limit,
                n,
                args.repack_time_limits,
                args.move_budget,
                args.profile,
            )
            for n in args.loads
        }
        print()
        print("GPUs in use / memory stranded (GiB), by load:")
        print(by_load({**runs, len(tasks): results}))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(["benchmarks/llm_mixed.py", *(argv or sys.argv[1:])]),
                    "python": platform.python_version(),
                    "results": {r.policy: r.to_json() for r in results},
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
