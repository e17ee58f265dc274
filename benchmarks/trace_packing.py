"""Trace packing benchmark: every policy on the Alibaba GPU-sharing trace.

    .venv/bin/python benchmarks/trace_packing.py                       # every pod list, inflate 1.3 and none
    .venv/bin/python benchmarks/trace_packing.py --lists default --inflate 1.3
    .venv/bin/python benchmarks/trace_packing.py --inflate 1.3 --budgets  # + planner+repack by move budget

The trace is not in this repository: download `openb_node_list_gpu_node.csv` and the
`openb_pod_list_*.csv` files from the public alibaba/clusterdata repository, folder
cluster-trace-gpu-v2023/csv, into one directory and set VRAMSCHED_TRACES to it (default: a
shared/traces directory beside the repository checkout). Every pod list found there is run
unless --lists names some.

Each run is what `vramsched simulate --nodes <node list> --pods <pod list> --inflate F --json`
prints for the same inputs (same code path). Results, margins of the planner (and of
planner+repack) over every baseline, the bounds on GPU memory allocated (runs without churn)
and the command line go to benchmarks/results/trace_packing.json; a summary table per list and
per policy (allocated % of capacity, pods failed, moves, margin over the best baseline) is
printed at the end, and by --summary from an existing file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extender.commands.argtypes import number, output_file, whole
from extender.commands.simulate import MAX_INFLATE
from extender.planner.capacity import Workload
from extender.simulate.bound_report import allocation_bounds, bound_line, budget_curve_point
from extender.simulate.engine import (
    ALL_POLICIES,
    MOVE_BUDGET,
    REPACK_TIME_LIMIT,
    all_fit_line,
    overcommit_text,
    replay,
    while_all_fit,
)
from extender.simulate.profile import PROFILES
from extender.simulate.trace import inflate, read_inputs

TRACES = Path(os.environ.get("VRAMSCHED_TRACES", ROOT.parent / "shared" / "traces"))
NODE_LIST = "openb_node_list_gpu_node.csv"
#: the baselines the planner's margin is taken over (spread is left out: it overcommits VRAM)
BASELINES = ("best-fit", "first-fit", "fgd", "hot-path")
#: ours: the policies whose margins are reported
OURS = ("planner", "planner+repack")
#: the move budgets --budgets replays planner+repack with, when it names none
BUDGETS = (0.0, 0.005, 0.01, 0.02, 0.05)
GPU_MIB = 1000 * 2**20


def trace_lists() -> list[str]:
    """Every pod list in the traces directory (`openb_pod_list_<name>.csv` -> name), sorted; a
    missing directory or node list is an error that says where to get the trace."""
    if not (TRACES / NODE_LIST).is_file():
        raise SystemExit(
            f"trace_packing: no {NODE_LIST} in {TRACES}. Download the node list and the "
            "openb_pod_list_*.csv files from the public alibaba/clusterdata repository, folder "
            "cluster-trace-gpu-v2023/csv, into one directory and set VRAMSCHED_TRACES to it."
        )
    found = sorted(p.name[len("openb_pod_list_") : -4] for p in TRACES.glob("openb_pod_list_*.csv"))
    if not found:
        raise SystemExit(f"trace_packing: no openb_pod_list_*.csv in {TRACES}")
    return found


def load(pod_list: str, factor: float, shuffle: int | None = None):
    """(nodes, tasks, bound pods, GPU count, workload of the list before inflation) of a replay."""
    nodes, tasks, bound = read_inputs(TRACES / NODE_LIST, TRACES / f"openb_pod_list_{pod_list}.csv")
    if shuffle is not None:
        # another node order: every policy's lowest-index tie-break lands elsewhere (a robustness check)
        random.Random(shuffle).shuffle(nodes)
    workload = Workload.from_demands(t.demand for t in tasks)
    gpus = sum(int(n["metadata"]["labels"]["nvidia.com/gpu.count"]) for n in nodes)
    if factor > 0:
        tasks = inflate(tasks, gpus, factor)
    return nodes, tasks, bound, gpus, workload


def margins(policies: dict, ours: str) -> dict:
    """`ours` minus every other policy: GPU memory (GPUs of 1000 MiB, % of theirs, points of
    capacity), GPUs fully free, usable free GPUs, pods placed."""
    pl = policies[ours]
    return {
        p: {
            "allocatedGpus": round(
                (pl["allocatedMemoryBytes"] - r["allocatedMemoryBytes"]) / GPU_MIB, 2
            ),
            "allocatedPct": round(
                100
                * (pl["allocatedMemoryBytes"] - r["allocatedMemoryBytes"])
                / max(1, r["allocatedMemoryBytes"]),
                3,
            ),
            "allocatedPoints": round(
                100
                * (pl["allocatedMemoryBytes"] - r["allocatedMemoryBytes"])
                / max(1, r["capacityMemoryBytes"]),
                3,
            ),
            "gpusFree": pl["gpusFree"] - r["gpusFree"],
            "gpusFreeUsable": round(pl["gpusFreeUsable"] - r["gpusFreeUsable"], 2),
            "placed": pl["placed"] - r["placed"],
        }
        for p, r in policies.items()
        if p != ours
    }


def run(
    pod_list: str,
    factor: float,
    policies: list[str],
    time_limit: float,
    churn: bool,
    accept: str | None = None,
    shuffle: int | None = None,
    move_budget: float = MOVE_BUDGET,
    repack_time_limit: float = REPACK_TIME_LIMIT,
    budgets: list[float] | None = None,
    profile: str = "whole",
    bounds: bool = True,
    deterministic: bool = False,
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
    if profile != "whole":
        out["profile"] = profile
    if deterministic:
        out["deterministic"] = True
    if "planner+repack" in policies:
        out["moveBudget"] = move_budget
    results = []
    for p in policies:
        r = replay(
            deterministic,
            p,
            nodes,
            tasks,
            bound,
            churn=churn,
            workload=workload,
            time_limit=time_limit,
            accept=accept,
            move_budget=move_budget,
            repack_time_limit=repack_time_limit,
            profile=profile,
        )
        results.append(r)
        out["policies"][p] = r.to_json()
        print(
            f"  {pod_list} inflate={factor} churn={churn} {p}: placed {r.placed} alloc {r.allocatedMemoryBytes / GPU_MIB:.2f} GPUs "
            f"free {r.gpusFree} over {r.overcommittedGpus} {r.seconds:.1f}s"
            + (
                f" solver {r.solverRuns}/{r.solverBatches} improved {r.solverImproved}"
                if p in OURS
                else ""
            )
            + (
                f" moves {r.moves} searches {r.repackSearches} repacked {r.repackPlaced}"
                f" unproven {r.repackUnproven}"
                if p == "planner+repack"
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
    for ours in OURS:
        if ours in out["policies"]:
            key = "planner margins" if ours == "planner" else f"{ours} margins"
            out[key] = margins(out["policies"], ours)
            if all_fit and ours in all_fit["gpusFree"]:
                free = all_fit["gpusFree"]
                for p, m in out[key].items():
                    if p in free:  # not spread: it overcommits
                        m["gpusFreeWhileAllFit"] = free[ours] - free[p]
    if bounds and not churn:
        out["bound"] = allocation_bounds(nodes, bound, tasks, results)
        print(f"  {pod_list} inflate={factor}: {bound_line(out['bound'])}", flush=True)
    if budgets and not churn:
        out["budgetCurve"] = []
        done = {r.policy: r for r in results}
        for b in budgets:
            # budget 0 is the planner (no move is ever allowed), the run's own budget was run
            if b == 0 and "planner" in done:
                r = done["planner"]
            elif b == move_budget and "planner+repack" in done:
                r = done["planner+repack"]
            else:
                r = replay(
                    deterministic,
                    "planner+repack",
                    nodes,
                    tasks,
                    bound,
                    workload=workload,
                    time_limit=time_limit,
                    accept=accept,
                    move_budget=b,
                    repack_time_limit=repack_time_limit,
                    profile=profile,
                )
            out["budgetCurve"].append(budget_curve_point(b, r, tasks))
            print(
                f"  {pod_list} inflate={factor} planner+repack budget {b:g}: "
                f"{out['budgetCurve'][-1]['allocatedPct']:.3f}% moves {r.moves} {r.seconds:.1f}s",
                flush=True,
            )
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


def _pct(r: dict) -> float:
    return 100 * r["allocatedMemoryBytes"] / max(1, r["capacityMemoryBytes"])


def best_baseline(run: dict) -> tuple[str, float] | None:
    """The baseline that allocated the most GPU memory in a run, and its % of capacity."""
    base = [(p, _pct(r)) for p, r in run["policies"].items() if p in BASELINES]
    return max(base, key=lambda t: t[1]) if base else None


def run_title(run: dict) -> str:
    return f"{run['podList']}, inflate {run['inflate'] or 'none'}" + (
        ", churn" if run["churn"] else ""
    )


def summary_rows(body: dict) -> list[list[str]]:
    """Per run and per policy: allocated %, pods failed, moves, and for ours the margin over the
    best baseline (points of GPU memory capacity); the bound on runs without churn."""
    rows = []
    for run in body["runs"]:
        best = best_baseline(run)
        b = run.get("bound") or {}
        first = b.get("fromFirstFailure")
        for p, r in run["policies"].items():
            margin = ""
            if p in OURS and best:
                margin = f"{_pct(r) - best[1]:+.2f} ({best[0]})"
            bound = ""
            if p == "planner+repack" and first:
                bound = f"{first['pct']:.2f}"
            elif p == "planner+repack" and b:
                bound = f"{b['anyPolicyPct']:.2f}"
            rows.append(
                [
                    run["podList"],
                    f"{run['inflate'] or 'none'}" + (" churn" if run["churn"] else ""),
                    p,
                    f"{_pct(r):.2f}",
                    str(r["failed"]),
                    str(r.get("moves", 0)),
                    margin,
                    bound,
                ]
            )
    return rows


SUMMARY_HEAD = [
    "pod list",
    "inflate",
    "policy",
    "allocated %",
    "failed",
    "moves",
    "margin over best baseline (points)",
    "bound %",
]


def summary(body: dict) -> str:
    """The summary as a plain table (what `make bench-packing` prints)."""
    rows = summary_rows(body)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(SUMMARY_HEAD)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(SUMMARY_HEAD, widths))]
    last = None
    for r in rows:
        shown = list(r)
        if last is not None and r[:2] == last[:2]:
            shown[0] = shown[1] = ""
        last = r
        lines.append("  ".join(c.ljust(w) for c, w in zip(shown, widths)).rstrip())
    lines += [
        "",
        "allocated %: GPU memory allocated at the end, % of the cluster's; margin: ours minus the "
        f"best of {', '.join(BASELINES)}; moves: pods moved by repacking",
        "bound %: no policy that places like the planner until a GPU pod first fits nowhere "
        "(planner+repack at any move budget) allocates more, whatever it moves",
    ]
    return "\n".join(lines)


def summary_markdown(body: dict) -> str:
    rows = summary_rows(body)
    out = [
        "| " + " | ".join(SUMMARY_HEAD) + " |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def order_spread(bodies: Sequence[dict], policies: Sequence[str] = ("fgd", "planner")) -> str:
    """Per pod list and inflation found in every node order of `bodies` (result files, one or more
    per order; churn runs left out): each policy's GPU memory allocated in each order and its
    spread, the largest minus the smallest (markdown), then the spread's median and maximum per
    policy. For FGD, whose measure does not depend on the node order, another order changes only
    which of exactly equal placements comes first: its spread is what such a change moves."""
    got: dict[tuple[str, float], dict[int | None, dict[str, float]]] = {}
    for body in bodies:
        for r in body["runs"]:
            if r.get("churn"):
                continue
            by_order = got.setdefault((r["podList"], r["inflate"]), {})
            alloc = {p: v["allocatedMemoryBytes"] / GPU_MIB for p, v in r["policies"].items()}
            by_order.setdefault(r.get("shuffleNodes"), {}).update(alloc)
    orders = sorted({o for by in got.values() for o in by}, key=lambda o: -1 if o is None else o)
    names = ["file" if o is None else f"order {o}" for o in orders]
    head = ["pod list", "inflate"]
    for p in policies:
        head += [f"{p}: {n}" for n in names] + [f"{p}: spread"]
    out = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    spreads: dict[str, list[float]] = {p: [] for p in policies}
    for (pod_list, factor), by in sorted(got.items()):
        if any(o not in by or any(p not in by[o] for p in policies) for o in orders):
            continue
        cells = [pod_list, f"{factor:g}" if factor else "none"]
        for p in policies:
            values = [by[o][p] for o in orders]
            spreads[p].append(max(values) - min(values))
            cells += [f"{v:.2f}" for v in values] + [f"{spreads[p][-1]:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for p in policies:
        v = spreads[p]
        if v:
            out.append(
                f"{p}: spread over {len(v)} lists x inflations: "
                f"median {statistics.median(v):.2f}, max {max(v):.2f}"
            )
    return "\n".join(out)


def repack_table(body: dict) -> str:
    """Per run with a budget curve (markdown): FGD, the best baseline, planner+repack at each move
    budget (pods moved), its gain over FGD at the run's own budget, and the bounds: from the
    first failure (planner+repack at any budget) and FGD's end state with any moves."""
    runs = [r for r in body["runs"] if r.get("budgetCurve")]
    if not runs:
        return ""
    budgets = [c["moveBudget"] for c in runs[0]["budgetCurve"]]
    # the bound with the run's own budget, in results that have it (`budget_bound`)
    budgeted = any((r.get("bound") or {}).get("fromFirstFailureWithBudget") for r in runs)
    head = (
        ["pod list", "FGD %", "best baseline %"]
        + [f"planner+repack {b:.1%} (moves)" for b in budgets]
        + ["gain over FGD at 2%", "bound % (gain at most)"]
        + (["bound with the run's budget % (gain at most)"] if budgeted else [])
        + ["FGD's end state, any moves %"]
    )
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for run in runs:
        fgd = _pct(run["policies"]["fgd"]) if "fgd" in run["policies"] else float("nan")
        best = best_baseline(run)
        curve = {c["moveBudget"]: c for c in run["budgetCurve"]}
        at2 = curve.get(0.02)
        b = run.get("bound") or {}
        first = b.get("fromFirstFailure")
        within = b.get("fromFirstFailureWithBudget")
        end = (b.get("fromEnd") or {}).get("fgd")
        lines.append(
            "| "
            + " | ".join(
                [
                    run_title(run).replace(", inflate 1.3", ""),
                    f"{fgd:.2f}",
                    f"{best[1]:.2f} ({best[0]})" if best else "",
                    *(f"{curve[x]['allocatedPct']:.2f} ({curve[x]['moves']})" for x in budgets),
                    f"**{at2['allocatedPct'] - fgd:+.2f}**" if at2 else "",
                    f"{first['pct']:.2f} ({first['pct'] - fgd:+.2f})" if first else "",
                    *(
                        [f"{within['pct']:.2f} ({within['pct'] - fgd:+.2f})" if within else ""]
                        if budgeted
                        else []
                    ),
                    f"{end['pct']:.2f}" if end else "",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def markdown(body: dict) -> str:
    lines = ["**Summary**", "", summary_markdown(body), ""]
    for run in body["runs"]:
        lines += [
            f"**{run_title(run)}** ({run['tasks']} tasks, {run['gpus']} GPUs)",
            "",
            "| policy | placed | failed | GPU memory allocated (GPUs) | GPUs in use | GPUs fully free | mean free | usable free | frag. rate | overcommitted GPUs (peak) | moves | seconds |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in run["policies"].items():
            lines.append(
                f"| {name} | {r['placed']} | {r['failed']} | {r['allocatedMemoryBytes'] / GPU_MIB:.2f} | {r['gpusInUse']} | "
                f"{r['gpusFree']} | {r['gpusFreeMean']:.0f} | {r.get('gpusFreeUsable', float('nan')):.2f} | {r['fragmentationRate']:.3f} | "
                f"{overcommit_text(r['overcommittedGpus'], r.get('overcommittedGpusPeak', r['overcommittedGpus']))} | "
                f"{r.get('moves', 0)} | {r['seconds']:.1f} |"
            )
        fit = run.get("whileAllFit")
        if fit:
            lines += ["", all_fit_line(fit)]
        if run.get("bound"):
            lines += ["", bound_line(run["bound"])]
        for ours in OURS:
            m = run.get("planner margins" if ours == "planner" else f"{ours} margins")
            if m:
                lines += [
                    "",
                    f"{ours} minus baseline: "
                    + "; ".join(
                        f"{p}: {v['allocatedGpus']:+.2f} GPUs of memory ({v['allocatedPct']:+.3f}%), {v['gpusFree']:+d} free GPUs "
                        f"({v.get('gpusFreeUsable', float('nan')):+.2f} usable), {v['placed']:+d} pods"
                        for p, v in m.items()
                    ),
                ]
        curve = run.get("budgetCurve")
        if curve:
            lines += [
                "",
                "planner+repack by move budget: "
                + ", ".join(
                    f"{c['moveBudget']:.1%}: {c['allocatedPct']:.2f}% ({c['moves']} moves)"
                    for c in curve
                ),
            ]
        lines.append("")
    return "\n".join(lines)


def plots(body: dict, where: Path) -> None:
    from dataclasses import fields

    from extender.simulate.engine import PolicyResult
    from extender.simulate.plot import plot_budget_curves, plot_free_curve, plot_results

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
    curves = {}
    for run in body["runs"]:
        if run.get("budgetCurve"):
            fgd = run["policies"].get("fgd")
            curves[run_title(run)] = {
                "budgetCurve": run["budgetCurve"],
                "fgdPct": _pct(fgd) if fgd else None,
                "bound": run.get("bound"),
            }
    if curves:
        plot_budget_curves(curves, where / "trace_packing_budget.png", title="Alibaba trace")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--lists", nargs="*", default=None, help="pod lists (default: every one in the traces)"
    )
    ap.add_argument(
        "--inflate", type=number(at_least=0, at_most=MAX_INFLATE), nargs="*", default=[1.3, 0.0]
    )
    ap.add_argument(
        "--churn", action="store_true", help="also run every list without inflation with churn"
    )
    ap.add_argument("--policies", nargs="*", default=list(ALL_POLICIES))
    ap.add_argument(
        "--time-limit", type=number(above=0), default=1.0, help="planner: seconds per batch solve"
    )
    ap.add_argument(
        "--accept",
        choices=["placed", "stranded", "all"],
        default=None,
        help="planner: goals on which a solver plan must beat FGD's sequential plan (default: extender.planner.model.ACCEPT)",
    )
    ap.add_argument(
        "--move-budget",
        type=number(at_least=0),
        default=MOVE_BUDGET,
        help=f"planner+repack: moves as a fraction of pods placed (default {MOVE_BUDGET})",
    )
    ap.add_argument(
        "--repack-time-limit",
        type=number(above=0),
        default=REPACK_TIME_LIMIT,
        help=f"planner+repack: seconds per repack search (default {REPACK_TIME_LIMIT:g})",
    )
    ap.add_argument(
        "--budgets",
        type=number(at_least=0),
        nargs="*",
        default=None,
        help="also replay planner+repack at these move budgets on every run without churn "
        f"(no value: {' '.join(f'{b:g}' for b in BUDGETS)}); --plots draws them",
    )
    ap.add_argument(
        "--shuffle-nodes",
        type=whole(at_least=0),
        default=None,
        metavar="SEED",
        help="shuffle the node list with this seed",
    )
    ap.add_argument(
        "--profile",
        choices=PROFILES,
        default="whole",
        help="the pod mix FGD's measure weighs by: the whole list's (whole, FGD's protocol, "
        "default) or the pods arrived so far, as serve counts them (live)",
    )
    ap.add_argument(
        "--no-bound",
        action="store_true",
        help="skip the upper bounds on GPU memory allocated (minutes per run)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trace_packing.json"))
    ap.add_argument(
        "--markdown",
        action="store_true",
        help="print the tables of an existing --out file and exit",
    )
    ap.add_argument(
        "--repack-table",
        action="store_true",
        help="print the move-budget table of an existing --out file (markdown) and exit",
    )
    ap.add_argument(
        "--summary",
        action="store_true",
        help="print the summary table of an existing --out file and exit",
    )
    ap.add_argument(
        "--plots",
        action="store_true",
        help="draw one PNG per run of an existing --out file (and the budget curves) and exit",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="time limits count work, not wall time (vramsched simulate --deterministic): "
        "replays whose plans come from the solver give the same result on every run",
    )
    ap.add_argument(
        "--order-spread",
        nargs="+",
        metavar="FILE",
        help="print, per pod list and inflation found in every node order of these result files, "
        "FGD's and the planner's GPU memory allocated per order and its spread, and exit",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="FILE",
        help="write the runs of these result files (e.g. one per pod list) into --out, print "
        "the summary and exit",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    reads = args.markdown or args.summary or args.repack_table or args.plots or args.order_spread
    if not reads:
        # --out is written once the runs are done (hours for every list) or merged: a path that
        # cannot be written stops here; --markdown, --summary, --repack-table, --plots only read it
        try:
            output_file(args.out)
        except argparse.ArgumentTypeError as exc:
            ap.error(f"argument --out: {exc}")
    if args.markdown:
        print(markdown(json.loads(Path(args.out).read_text())))
        return 0
    if args.summary:
        print(summary(json.loads(Path(args.out).read_text())))
        return 0
    if args.repack_table:
        print(repack_table(json.loads(Path(args.out).read_text())))
        return 0
    if args.plots:
        plots(json.loads(Path(args.out).read_text()), Path(args.out).parent)
        return 0
    if args.order_spread:
        print(order_spread([json.loads(Path(f).read_text()) for f in args.order_spread]))
        return 0
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        body = {
            "command": "; ".join(p["command"] for p in parts),
            "machine": parts[0]["machine"],
            "cpus": parts[0]["cpus"],
            "python": parts[0]["python"],
            "wallSeconds": round(sum(p["wallSeconds"] for p in parts), 1),
            "runs": [r for p in parts for r in p["runs"]],
        }
        Path(args.out).write_text(json.dumps(body, indent=2) + "\n")
        print(summary(body))
        return 0
    lists = args.lists if args.lists else trace_lists()
    budgets = None if args.budgets is None else (args.budgets or list(BUDGETS))
    started = time.time()
    runs = []
    for pod_list in lists:
        todo = [(f, False) for f in args.inflate] + ([(0.0, True)] if args.churn else [])
        for f, churn in todo:
            try:
                runs.append(
                    run(
                        pod_list,
                        f,
                        args.policies,
                        args.time_limit,
                        churn,
                        args.accept,
                        args.shuffle_nodes,
                        args.move_budget,
                        args.repack_time_limit,
                        budgets if f > 0 else None,
                        args.profile,
                        not args.no_bound,
                        args.deterministic,
                    )
                )
            except (OSError, KeyError, ValueError) as exc:
                print(f"trace_packing: cannot replay {pod_list}: {exc}", file=sys.stderr)
                break
    body = {
        "command": " ".join(["benchmarks/trace_packing.py", *sys.argv[1:]]),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "wallSeconds": round(time.time() - started, 1),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(body, indent=2) + "\n")
    print()
    print(summary(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
