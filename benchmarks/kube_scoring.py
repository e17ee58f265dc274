"""How kube-scheduler's own scoring changes what vramsched's prioritize achieves.

The simulator's `hot-path` policy is the server's answer alone deciding: exactly one node scores
10. This script replays the Alibaba trace (filled to F times its GPUs, FGD's protocol) with that
policy and two variants:
- `default-scorers`: kube-scheduler's default NodeResourcesFit score (LeastAllocated on CPU and
  memory, 0..100, weight 1), which the shipped profile keeps, added to the extender's score x
  weight 5 x 10 as kube-scheduler sums them (BalancedAllocation, ImageLocality and the
  user-intent scorers are left out);
- `random-top`: the extender's bands as they were before one node was made to stand out (the
  best band shared by many nodes), kube-scheduler choosing at random among the top total (seeded).
GPU-less pods go to the first node with room in every variant.

    .venv/bin/python benchmarks/kube_scoring.py [--lists default gpushare40 gpuspec10] [--inflate 1.3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from trace_packing import load

from extender import placement
from extender.commands.argtypes import number
from extender.commands.simulate import MAX_INFLATE
from extender.demand import Demand
from extender.planner import greedy
from extender.planner.capacity import Capacity, FragIndex
from extender.simulate.engine import run_policy

WEIGHT, STEP = 5, 10  # the shipped extender weight; MaxNodeScore / MaxExtenderPriority


def _variant(mode: str, seed: int = 7):
    """A one-pod rule: filter, prioritize on the survivors, then kube-scheduler's pick by `mode`."""
    rng = np.random.default_rng(seed)

    def pick(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> greedy.Choice | None:
        rows = np.flatnonzero(cap.fits_host(demand))
        if not len(rows) or not demand.wants_gpu:
            return greedy.hot_path(cap, demand, frag)
        names = cap.arrays.node_names
        feasible = placement.filter_nodes(
            cap.ledger, demand, [names[r] for r in rows.tolist()], explain_all=False
        ).feasible
        if not feasible:
            return None
        _, at, scores = placement.score_rows(
            cap.ledger, demand, feasible, single_top=mode != "random-top"
        )
        if mode == "random-top":
            total = scores.astype(np.int64) * 1000 + rng.integers(0, 1000, len(at))
        else:
            total = scores.astype(np.int64) * WEIGHT * STEP + greedy.least_allocated(
                cap, demand, at
            )
        best = int(at[int(np.argmax(total))])
        res = placement.choose_devices(cap.ledger, demand, names[best])
        return None if isinstance(res, str) else (res, best, False)

    return pick


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lists", nargs="*", default=["default", "gpushare40", "gpuspec10"])
    ap.add_argument("--inflate", type=number(at_least=0, at_most=MAX_INFLATE), default=1.3)
    return ap


def main() -> int:
    args = build_parser().parse_args()
    greedy.POLICIES["default-scorers"] = _variant("default-scorers")
    greedy.POLICIES["random-top"] = _variant("random-top")
    print("| pod list | hot-path | default-scorers | random-top |")
    print("|---|---:|---:|---:|")
    for name in args.lists:
        nodes, tasks, bound, _, workload = load(name, args.inflate)
        row = []
        for policy in ("hot-path", "default-scorers", "random-top"):
            r = run_policy(policy, nodes, tasks, bound, workload=workload)
            assert r.overcommittedGpusPeak == 0 and r.invariantViolations == 0
            row.append(f"{r.allocatedMemoryBytes / (1000 * 2**20):.2f}")
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
