"""Trace packing benchmark: every policy on the Alibaba GPU-sharing trace (../shared/traces).

    .venv/bin/python benchmarks/trace_packing.py                       # all pod lists, inflate 1.3 and none
    .venv/bin/python benchmarks/trace_packing.py --lists default --inflate 1.3

Each run is what `vramsched simulate --nodes <node list> --pods <pod list> --inflate F --json`
prints for the same inputs (same code path). Results, margins of the planner over every
baseline, and the command line go to benchmarks/results/trace_packing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extender.planner.capacity import Workload
from extender.simulate.engine import (
    ALL_POLICIES,
    all_fit_line,
    overcommit_text,
    run_policy,
    while_all_fit,
)
from extender.simulate.trace import inflate, read_inputs

TRACES = Path(os.environ.get("VRAMSCHED_TRACES", ROOT.parent / "shared" / "traces"))
LISTS = ["default", "gpushare40", "gpuspec10"]


def load(pod_list: str, factor: float, shuffle: int | None = None):
    """(nodes, tasks, bound pods, GPU count, workload of the list before inflation) of a replay."""
    nodes, tasks, bound = read_inputs(
        TRACES / "openb_node_list_gpu_node.csv", TRACES / f"openb_pod_list_{pod_list}.csv"
    )
    if shuffle is not None:
        # another node order: every policy's lowest-index tie-break lands elsewhere (a robustness check)
        random.Random(shuffle).shuffle(nodes)
    workload = Workload.from_demands(t.demand for t in tasks)
    gpus = sum(int(n["metadata"]["labels"]["nvidia.com/gpu.count"]) for n in nodes)
    if factor > 0:
        tasks = inflate(tasks, gpus, factor)
    return nodes, tasks, bound, gpus, workload


def run(
    pod_list: str,
    factor: float,
    policies: list[str],
    time_limit: float,
    churn: bool,
    accept: str | None = None,
    shuffle: int | None = None,
) -> dict:
    nodes, tasks, bound, gpus, workload = load(pod_list, factor, shuffle)
    out = {
        "podList": pod_list,
        "inflate": factor,
        "churn": churn,
        "tasks": len(tasks),
        "gpus": gpus,
        "policies": {},
    }
    if shuffle is not None:
        out["shuffleNodes"] = shuffle
    results = []
    for p in policies:
        r = run_policy(
            p,
            nodes,
            tasks,
            bound,
            churn=churn,
            workload=workload,
            time_limit=time_limit,
            accept=accept,
        )
        results.append(r)
        out["policies"][p] = r.to_json()
        print(
            f"  {pod_list} inflate={factor} churn={churn} {p}: placed {r.placed} alloc {r.allocatedMemoryBytes / 2**20 / 1000:.2f} GPUs "
            f"free {r.gpusFree} over {r.overcommittedGpus} {r.seconds:.1f}s"
            + (
                f" solver {r.solverRuns}/{r.solverBatches} improved {r.solverImproved}"
                if p == "planner"
                else ""
            ),
            flush=True,
        )
    all_fit = while_all_fit(results)
    if all_fit:
        # the curve only where pods stay (with churn, at most 1.1% of the GPUs are ever in use)
        out["whileAllFit"] = (
            all_fit if churn else {**all_fit, "curve": free_curve(results, all_fit)}
        )
    pl = out["policies"].get("planner")
    if pl:
        out["planner margins"] = {
            p: {
                "allocatedGpus": round(
                    (pl["allocatedMemoryBytes"] - r["allocatedMemoryBytes"]) / (1000 * 2**20), 2
                ),
                "allocatedPct": round(
                    100
                    * (pl["allocatedMemoryBytes"] - r["allocatedMemoryBytes"])
                    / max(1, r["allocatedMemoryBytes"]),
                    3,
                ),
                "gpusFree": pl["gpusFree"] - r["gpusFree"],
                "gpusFreeUsable": round(pl["gpusFreeUsable"] - r["gpusFreeUsable"], 2),
                "placed": pl["placed"] - r["placed"],
            }
            for p, r in out["policies"].items()
            if p != "planner"
        }
        if all_fit:
            free = all_fit["gpusFree"]
            for p, m in out["planner margins"].items():
                if p in free:  # not spread: it overcommits
                    m["gpusFreeWhileAllFit"] = free["planner"] - free[p]
    return out


def free_curve(results, all_fit: dict, points: int = 40) -> dict:
    """GPUs fully free per policy `while_all_fit` compares, at `points` evenly spaced batches up to
    the last one every such policy placed in full: the curve `--plots` draws, small enough for
    the results file."""
    fair = [r for r in results if r.policy in all_fit["gpusFree"]]
    batches = all_fit["batches"]
    at = sorted({round(i * (batches - 1) / (points - 1)) for i in range(points)})
    return {
        "arrivals": [fair[0].freeSeries[i][0] for i in at],
        "gpusFree": {r.policy: [r.freeSeries[i][1] for i in at] for r in fair},
    }


def markdown(body: dict) -> str:
    lines = []
    for run in body["runs"]:
        title = f"{run['podList']}, inflate {run['inflate'] or 'none'}" + (
            ", churn" if run["churn"] else ""
        )
        lines += [
            f"**{title}** ({run['tasks']} tasks, {run['gpus']} GPUs)",
            "",
            "| policy | placed | failed | GPU memory allocated (GPUs) | GPUs in use | GPUs fully free | mean free | usable free | frag. rate | overcommitted GPUs (peak) | seconds |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in run["policies"].items():
            lines.append(
                f"| {name} | {r['placed']} | {r['failed']} | {r['allocatedMemoryBytes'] / (1000 * 2**20):.2f} | {r['gpusInUse']} | "
                f"{r['gpusFree']} | {r['gpusFreeMean']:.0f} | {r.get('gpusFreeUsable', float('nan')):.2f} | {r['fragmentationRate']:.3f} | "
                f"{overcommit_text(r['overcommittedGpus'], r.get('overcommittedGpusPeak', r['overcommittedGpus']))} | "
                f"{r['seconds']:.1f} |"
            )
        fit = run.get("whileAllFit")
        if fit:
            lines += ["", all_fit_line(fit)]
        m = run.get("planner margins")
        if m:
            lines += [
                "",
                "planner minus baseline: "
                + "; ".join(
                    f"{p}: {v['allocatedGpus']:+.2f} GPUs of memory ({v['allocatedPct']:+.3f}%), {v['gpusFree']:+d} free GPUs "
                    f"({v.get('gpusFreeUsable', float('nan')):+.2f} usable), {v['placed']:+d} pods"
                    for p, v in m.items()
                ),
            ]
        lines.append("")
    return "\n".join(lines)


def plots(body: dict, where: Path) -> None:
    from dataclasses import fields

    from extender.simulate.engine import PolicyResult
    from extender.simulate.plot import plot_free_curve, plot_results

    known = {f.name for f in fields(PolicyResult)}
    for run in body["runs"]:
        fit = run.get("whileAllFit")
        if fit and not run["churn"] and "best-fit" in fit["gpusFree"]:
            plot_free_curve(
                fit["curve"],
                where / f"trace_{run['podList']}_inflate{run['inflate'] or 0}_allfit.png",
                title=f"Alibaba trace {run['podList']}, inflate {run['inflate'] or 'none'}: GPUs fully free "
                f"while every pod fits, minus best-fit's",
            )
        results = [
            PolicyResult(policy=name, **{k: v for k, v in r.items() if k in known})
            for name, r in run["policies"].items()
        ]
        name = f"trace_{run['podList']}_inflate{run['inflate'] or 0}{'_churn' if run['churn'] else ''}.png"
        plot_results(
            results,
            where / name,
            title=f"Alibaba trace {run['podList']}, inflate {run['inflate'] or 'none'}"
            + (", churn" if run["churn"] else "")
            + f" ({run['tasks']} tasks, {run['gpus']} GPUs)",
        )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lists", nargs="*", default=LISTS)
    ap.add_argument("--inflate", type=float, nargs="*", default=[1.3, 0.0])
    ap.add_argument(
        "--churn", action="store_true", help="also run every list without inflation with churn"
    )
    ap.add_argument("--policies", nargs="*", default=list(ALL_POLICIES))
    ap.add_argument(
        "--time-limit", type=float, default=1.0, help="planner: seconds per batch solve"
    )
    ap.add_argument(
        "--accept",
        choices=["placed", "stranded", "all"],
        default=None,
        help="planner: goals on which a solver plan must beat FGD's sequential plan (default: extender.planner.model.ACCEPT)",
    )
    ap.add_argument(
        "--shuffle-nodes",
        type=int,
        default=None,
        metavar="SEED",
        help="shuffle the node list with this seed",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trace_packing.json"))
    ap.add_argument(
        "--markdown",
        action="store_true",
        help="print the tables of an existing --out file and exit",
    )
    ap.add_argument(
        "--plots",
        action="store_true",
        help="draw one PNG per run of an existing --out file and exit",
    )
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.out).read_text())))
        return 0
    if args.plots:
        plots(json.loads(Path(args.out).read_text()), Path(args.out).parent)
        return 0
    started = time.time()
    runs = []
    for pod_list in args.lists:
        for f in args.inflate:
            runs.append(
                run(
                    pod_list,
                    f,
                    args.policies,
                    args.time_limit,
                    False,
                    args.accept,
                    args.shuffle_nodes,
                )
            )
        if args.churn:
            runs.append(
                run(
                    pod_list,
                    0.0,
                    args.policies,
                    args.time_limit,
                    True,
                    args.accept,
                    args.shuffle_nodes,
                )
            )
    body = {
        "command": " ".join(["benchmarks/trace_packing.py", *sys.argv[1:]]),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "wallSeconds": round(time.time() - started, 1),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
