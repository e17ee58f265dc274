"""Preemption by VRAM on the Alibaba GPU-sharing trace: the planner with and without it.

    .venv/bin/python benchmarks/trace_preemption.py                    # every pod list, inflate 1.3
    .venv/bin/python benchmarks/trace_preemption.py --lists default gpushare40

Priorities come from the trace's `qos` column (`vramsched simulate --priorities qos`: LS and
Guaranteed 1000, Burstable 500, BE 0); lists without it (the `multigpu` ones) are skipped, as
every pod there has one priority. Each list is replayed by `planner` and `planner+preempt` (the
planner, and when a GPU pod fits nowhere, what `serve --preempt` plans; the victims are offered
again), which is what `vramsched simulate --priorities qos --policy planner --policy
planner+preempt --inflate F --json` prints for the same inputs. Per list: GPU pods failed and
GPU memory held at the end per priority, preemptions, pods evicted and placed again, wall time.
Results and the command line go to benchmarks/results/trace_preemption.json; a Markdown table
is printed (and by --summary from an existing file). The trace: see trace_packing.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from trace_packing import GPU_MIB, load, trace_lists

from extender.commands.argtypes import number, output_file
from extender.commands.simulate import MAX_INFLATE
from extender.simulate.engine import PREEMPT_POLICY, replay
from extender.simulate.trace import with_qos_priorities

POLICIES = ("planner", PREEMPT_POLICY)
OUT = ROOT / "benchmarks" / "results" / "trace_preemption.json"


def run(pod_list: str, factor: float, time_limit: float) -> dict | None:
    """Both policies on one list, or None when its pods have one priority."""
    nodes, tasks, bound, gpus, workload = load(pod_list, factor)
    tasks = with_qos_priorities(tasks)
    if len({t.demand.priority for t in tasks}) < 2:
        return None
    out = {"tasks": len(tasks), "gpus": gpus, "policies": {}}
    for policy in POLICIES:
        start = time.perf_counter()
        r = replay(False, policy, nodes, tasks, bound, workload=workload, time_limit=time_limit)
        body = r.to_json()
        body["wallSeconds"] = round(time.perf_counter() - start, 1)
        out["policies"][policy] = body
        print(f"  {pod_list} x{factor:g} {policy}: {body['wallSeconds']}s", file=sys.stderr)
    return out


def table(results: dict) -> str:
    """One row per list: GPU pods failed and GPU memory held (GPUs of 1000 MiB) per priority,
    planner -> planner+preempt, then what preemption did and cost."""
    rows = [
        "| pod list | GPU pods failed, 1000 / 500 / 0 | GPUs held, 1000 | 500 | 0 | all "
        "| preemptions / evicted / placed again | seconds |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, run_ in results.items():
        if run_ is None:
            continue
        a, b = (run_["policies"][p] for p in POLICIES)

        def held(r: dict, p: str) -> float:
            return r["allocatedByPriority"].get(p, 0) / GPU_MIB

        def failed(r: dict) -> str:
            f = r["failedGpuPodsByPriority"]
            return " / ".join(str(f.get(p, 0)) for p in ("1000", "500", "0"))

        cells = [
            name,
            f"{failed(a)} -> {failed(b)}",
            *(f"{held(a, p):,.0f} -> {held(b, p):,.0f}" for p in ("1000", "500", "0")),
            f"{a['allocatedMemoryBytes'] / GPU_MIB:,.0f} -> {b['allocatedMemoryBytes'] / GPU_MIB:,.0f}",
            f"{b.get('preemptions', 0)} / {b.get('preempted', 0)} / {b.get('preemptedPlacedAgain', 0)}",
            f"{a['wallSeconds']:g} / {b['wallSeconds']:g}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lists", nargs="+", help="pod lists to run (default: every one found)")
    p.add_argument(
        "--inflate",
        type=number(at_least=0, at_most=MAX_INFLATE),
        default=1.3,
        help="FGD protocol factor (default 1.3; 0: the list as it is)",
    )
    p.add_argument("--time-limit", type=number(above=0), default=0.25, help="per batch solve")
    p.add_argument("--out", type=output_file, default=OUT, help="JSON results file")
    p.add_argument("--summary", action="store_true", help="print the table of --out and stop")
    args = p.parse_args()
    if args.summary:
        print(table(json.loads(Path(args.out).read_text())["results"]))
        return 0
    results = {}
    for name in args.lists or trace_lists():
        results[name] = run(name, args.inflate, args.time_limit)
    Path(args.out).write_text(
        json.dumps(
            {
                "command": " ".join(["benchmarks/trace_preemption.py", *sys.argv[1:]]),
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                "inflate": args.inflate,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
