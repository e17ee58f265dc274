"""Where the room the bound finds comes from: which later pods the LP takes, and which the
replay placed.

`budget_bound` from `planner+repack`'s first failure says how much more memory the pods that
arrive later could add, within a move budget; its optimum also says which of them it takes
(per demand kind). Next to that, the pods of each kind `planner+repack` placed after the first
failure. Where the LP leaves out pods the replay had to place (a scheduler places a pod that
fits), the bound's room is foresight no online rule has, not moves. The LP that places every
pod that fits (`fit_rule`, no moves) shows what is left of that room once it may not.

    .venv/bin/python benchmarks/bound_choices.py --lists gpushare40 multigpu30 [--rows 12]

Results go to benchmarks/results/bound_choices.json; a table per list is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import trace_packing as tp

from extender.commands.argtypes import number, output_file, whole
from extender.planner.capacity import demand_kind
from extender.simulate.bound_report import bound_placing_fits, bound_within_budget, later_demands
from extender.simulate.budget_bound import budget_bound
from extender.simulate.engine import MOVE_BUDGET, replay

OUT = ROOT / "benchmarks" / "results" / "bound_choices.json"


def choices(pod_list: str, budget: float, time_limit: float) -> dict:
    """`planner+repack` at `budget` on one list (inflate 1.3), and per demand kind of the pods
    that arrive after its first failure: how many arrived, how many the bound's LP takes without
    moves (also when every pod that fits is placed) and within the budget, and how many the
    replay placed (deterministic: `engine.replay`)."""
    nodes, tasks, bound, _, workload = tp.load(pod_list, 1.3)
    r = replay(
        True,  # time limits count work: the same plans on every run
        "planner+repack",
        nodes,
        tasks,
        bound,
        workload=workload,
        time_limit=time_limit,
        move_budget=budget,
    )
    state = r.stateAtFirstFailure
    if state is None:
        return {"podList": pod_list, "failed": False}
    later = later_demands(state, tasks)
    none = budget_bound(state, later)
    fits = bound_placing_fits(r, tasks)
    assert fits is not None
    within = bound_within_budget(r, tasks, budget)
    assert within is not None  # the same first failure
    later_keys = {d.pod.key for d in later}
    placed = Counter(demand_kind(d) for d in r.placedAtEnd or () if d.pod.key in later_keys)
    arrived = Counter(demand_kind(d) for d in later if d.gpu_count > 0)
    capacity = r.capacityMemoryBytes
    rows: list[dict[str, Any]] = []
    for kind, n in arrived.items():
        gpus, per, cpu = int(kind[0]), int(kind[1]), int(kind[2])
        gpu_mib = gpus * (tp.GPU_MIB if per < 0 else per) / (1 << 20)
        rows.append(
            {
                "gpus": gpus,
                "mibPerGpu": None if per < 0 else per // (1 << 20),
                "cores": cpu / 1000,
                "arrived": n,
                "lpNoMoves": round(max(0.0, none.taken.get(kind, 0.0)), 1),
                "lpPlacingFits": round(max(0.0, fits.taken.get(kind, 0.0)), 1),
                "lpWithinBudget": round(max(0.0, within.taken.get(kind, 0.0)), 1),
                "placed": placed.get(kind, 0),
                "gpuMibEach": gpu_mib,
            }
        )
    rows.sort(key=lambda x: -x["arrived"] * x["gpuMibEach"])
    return {
        "podList": pod_list,
        "failed": True,
        "moveBudget": budget,
        "placedAtFirstFailure": len(state.pods),
        "allocatedPct": round(100 * r.allocatedMemoryBytes / capacity, 3),
        "boundNoMovesPct": round(100 * none.bytes / capacity, 3),
        "boundPlacingFitsPct": round(100 * fits.bytes / capacity, 3),
        "boundWithinBudgetPct": round(100 * within.bytes / capacity, 3),
        "lpMovesWithinBudget": round(within.moves, 1),
        "moves": r.moves,
        "kinds": rows,
    }


def table(run: dict, rows: int) -> str:
    """The kinds that brought the most GPU memory after the first failure (markdown)."""

    def gpu(k: dict) -> str:
        return f"{k['gpus']} whole" if k["mibPerGpu"] is None else f"{k['mibPerGpu']} MiB"

    def gib(key: str) -> float:
        return sum(k[key] * k["gpuMibEach"] for k in run["kinds"]) / 1000

    out = [
        f"**{run['podList']}**: planner+repack {run['allocatedPct']:.2f}% ({run['moves']} moves); "
        f"bound without moves {run['boundNoMovesPct']:.2f}%, placing every pod that fits "
        f"{run['boundPlacingFitsPct']:.2f}%, within {run['moveBudget']:.0%} "
        f"{run['boundWithinBudgetPct']:.2f}% ({run['lpMovesWithinBudget']:.0f} moves in the LP)",
        "",
        "| GPU | cores | arrived | LP, no moves | LP, no moves, every fit placed "
        "| LP, within the budget | placed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k in run["kinds"][:rows]:
        out.append(
            f"| {gpu(k)} | {k['cores']:g} | {k['arrived']} | {k['lpNoMoves']:.1f} | "
            f"{k['lpPlacingFits']:.1f} | {k['lpWithinBudget']:.1f} | {k['placed']} |"
        )
    out.append(
        f"| all kinds, GPUs of memory | | {gib('arrived'):.0f} | {gib('lpNoMoves'):.0f} | "
        f"{gib('lpPlacingFits'):.0f} | {gib('lpWithinBudget'):.0f} | {gib('placed'):.0f} |"
    )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lists", nargs="+", default=["gpushare40"])
    ap.add_argument("--move-budget", type=number(at_least=0), default=MOVE_BUDGET)
    ap.add_argument("--time-limit", type=number(above=0), default=0.25)
    ap.add_argument(
        "--rows",
        type=whole(at_least=1),
        default=12,
        help="kinds per table (most memory first)",
    )
    ap.add_argument("--out", type=output_file, default=OUT)
    return ap


def main() -> int:
    args = build_parser().parse_args()
    runs = [choices(x, args.move_budget, args.time_limit) for x in args.lists]
    args.out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    for run in runs:
        if run["failed"]:
            print(table(run, args.rows) + "\n")
        else:
            print(f"{run['podList']}: no GPU pod failed, nothing to bound\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
