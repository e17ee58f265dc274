"""What planning ahead (`serve --plan-ahead N`) costs, beside the hot path it stands in for.

On generated clusters (the load test's fleet, 60% full), CPU time of one round of planning
ahead for the N most common pod types (`ahead.DEPTH` pods each), split into the event loop's part (snapshot, held
entries) and the worker thread's (`ahead.plan_ahead_round`), against prioritize for one pod on the hot
path, and the inline rule a pod without an entry gets (`ahead.InlineRule`): its measure built
afresh (the first such pod after a round with a new mix) and one pod's choice on it. Figures are
process time per call; never asserted anywhere.

    .venv/bin/python -m benchmarks.plan_ahead --nodes 100 1000 5000 --types 8
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from extender.assignment import encode_assignment
from extender.cluster import ClusterState
from extender.commands.argtypes import whole
from extender.demand import Demand, pod_demand
from extender.embedded import EmbeddedBinder
from extender.planner.ahead import InlineRule, plan_ahead_round
from extender.planner.background import BackgroundPlanner
from extender.service import ExtenderService
from extender.wire import ExtenderArgs
from loadtest.gen_cluster import generate

#: the pod placed: one 16 GiB model on one GPU
POD: dict[str, Any] = {
    "kind": "Pod",
    "metadata": {
        "name": "bench-0",
        "namespace": "bench",
        "uid": "bench-0",
        "annotations": {"vramsched.io/model-memory": "16Gi"},
    },
    "spec": {
        "schedulerName": "vramsched",
        "containers": [
            {"name": "m", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        ],
    },
    "status": {"phase": "Pending"},
}


def _ms(fn: Callable[[], object], repeat: int) -> float:
    """Median process time of `fn` in milliseconds."""
    out = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        out.append((time.process_time() - t) * 1000)
    return statistics.median(out)


def measure(nodes: int, types: int, repeat: int) -> dict[str, float]:
    node_objs, pods = generate(nodes)
    c = ClusterState()
    c.load([*({**n, "kind": "Node"} for n in node_objs), *({**p, "kind": "Pod"} for p in pods)])
    planner = BackgroundPlanner(c, plan_ahead=types)
    svc = ExtenderService(c, EmbeddedBinder(c))
    names = list(c.nodes)
    p = POD
    c.upsert_pod(p)
    demand = pod_demand(p)
    inputs = planner._ahead_inputs()
    assert inputs is not None
    cap, examples, _, _ = inputs
    assert planner.ahead is not None
    depth = planner.ahead.depth
    workload = planner.workload([])
    out = {
        "nodes": nodes,
        "types": len(examples),
        "pods per type": depth,
        "loop ms": _ms(planner._ahead_inputs, repeat),
        "thread ms": _ms(lambda: plan_ahead_round(cap, examples, workload, depth, 0.2), repeat),
        "hot-path prioritize ms": _ms(
            lambda: svc.prioritize(ExtenderArgs(Pod=p, NodeNames=names)), repeat
        ),
    }
    planner.ahead.install({}, 0, {}, c.demand_mix)
    rule = planner.ahead.rule

    kind = next(iter(c.demand_mix))
    calls = itertools.count(1)

    def build() -> None:
        # the cluster's mix with one more pod each time: one it was not built with, rebuilt
        rule.use({**c.demand_mix, kind: c.demand_mix[kind] + next(calls)})
        rule.choose(demand)

    out["inline: measure built + one pod, ms"] = _ms(build, repeat)
    rule.use(c.demand_mix)
    fresh = InlineRule(c, rule.open_cost, memo=False)
    fresh.use(c.demand_mix)
    for name, r in (("inline: one pod after a bind, ms", rule), ("scores kept: no, ms", fresh)):
        out[name] = _after_binds(c, r, demand, repeat)
    return out


def _after_binds(c: ClusterState, rule: InlineRule, demand: Demand, repeat: int) -> float:
    """Median process time of the inline rule's choice for `demand`, each after the pod before it
    was bound where the rule put it (what a stream of pods placed at once costs)."""
    times = []
    rule.choose(demand)
    for i in range(repeat):
        got = rule.choose(demand)
        assert got is not None and got[0] is not None
        res = got[0]
        name = f"bound-{id(rule)}-{i}"
        bound: dict[str, Any] = {
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "bench",
                "uid": name,
                "annotations": {"vramsched.io/model-memory": "16Gi", **encode_assignment(res)},
            },
            "spec": {**POD["spec"], "nodeName": res.node},
            "status": {"phase": "Running"},
        }
        c.upsert_pod(bound)
        t = time.process_time()
        rule.choose(demand)
        times.append((time.process_time() - t) * 1000)
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=whole(at_least=1), nargs="+", default=[100, 1000, 5000])
    ap.add_argument(
        "--types",
        type=whole(at_least=1),
        default=8,
        help="pod types planned ahead (default 8)",
    )
    ap.add_argument(
        "--repeat",
        type=whole(at_least=1),
        default=5,
        help="runs per figure, median (default 5)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [measure(n, args.types, args.repeat) for n in args.nodes]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---:|" * len(keys))
    for r in rows:
        print(
            "| "
            + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys)
            + " |"
        )
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
