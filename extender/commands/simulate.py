"""`vramsched simulate`: replay pods on a cluster with several placement policies side by side."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any

import orjson

from extender.commands.argtypes import number, output_file, whole
from extender.inventory import MAX_REPLICAS, NO_GPUS, NodeInventory

__all__ = ["register", "run"]

POLICY_CHOICES = (
    "planner",
    "planner+repack",
    "hot-path",
    "best-fit",
    "first-fit",
    "spread",
    "fgd",
    "plan-ahead",
    "planner+preempt",
    "all",
)
#: the move budgets `--budget-curve` replays `planner+repack` with
BUDGETS = (0.0, 0.005, 0.01, 0.02, 0.05)
#: `--inflate`'s largest factor: FGD's protocol runs at 1.3, and a larger factor only makes a
#: longer replay of the same pods (one that takes more than `trace.MAX_COPIES` copies of the list
#: is refused)
MAX_INFLATE = 10.0


#: at most this many nodes are named by `gpu_nodes_left_out`
NODES_NAMED = 10


def gpu_nodes_left_out(inventories: Iterable[NodeInventory]) -> list[str]:
    """One line per node that NVIDIA's labels describe as a GPU node but that holds no GPUs in
    the replay, with why (a label out of range, a plugin not registered...), as the filter would
    say; a node with no `nvidia.com/` label is a CPU node and is not named. Without these lines
    the replay silently ran on fewer GPUs than the file."""
    left = [
        f"node {inv.name} holds no GPUs in this replay: {inv.problem}"
        for inv in inventories
        if inv.problem
        and inv.problem != NO_GPUS
        and any(str(k).startswith("nvidia.com/") for k in inv.labels)
    ]
    if len(left) > NODES_NAMED:
        left[NODES_NAMED:] = [f"and {len(left) - NODES_NAMED} more nodes"]
    return left


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay pods against a cluster with several placement policies",
        description="Replay pods in arrival order with each policy (same placement core as the server) "
        "and compare pods placed, GPU memory allocated, GPUs in use/free, fragmentation, "
        "VRAM overcommit and wall time.",
    )
    p.add_argument(
        "--nodes",
        required=True,
        metavar="FILE",
        help="cluster YAML/JSON (List of Nodes, bound Pods) or a trace node CSV",
    )
    p.add_argument(
        "--pods",
        required=True,
        metavar="FILE",
        help="pods to replay: YAML/JSON List of Pods or a trace pod CSV",
    )
    p.add_argument(
        "--policy",
        action="append",
        choices=POLICY_CHOICES,
        help="policy to run (repeatable; default all): planner, planner+repack (the planner, and "
        "when a GPU pod fits nowhere, the fewest moves of running pods that make it fit), hot-path "
        "(what the server does to a pod placed at once), best-fit, first-fit, spread, fgd; "
        "plan-ahead (what serve --plan-ahead 8 does to pods placed at once; not in all); "
        "planner+preempt (the planner, and when a GPU pod fits nowhere, preemption by VRAM as "
        "serve --preempt plans it; not in all; needs pods of different priorities)",
    )
    p.add_argument(
        "--priorities",
        choices=("none", "qos"),
        default="none",
        help="trace pods' priorities: none (every pod 0, the default) or qos (from the trace's "
        "qos column: LS and Guaranteed 1000, Burstable 500, BE 0); YAML pods keep spec.priority",
    )
    p.add_argument(
        "--move-budget",
        type=number(at_least=0),
        default=None,
        metavar="F",
        help="planner+repack: moves allowed, as a fraction of the pods placed so far (default 0.02); "
        "in the replay every running pod may move",
    )
    p.add_argument(
        "--max-moves-per-gpu",
        type=whole(at_least=1),
        default=None,
        metavar="N",
        help="planner+repack: at most N moves per GPU the pod to place asks (default 3, as "
        "serve --repack-max-moves-per-gpu)",
    )
    p.add_argument(
        "--max-moves-per-pod",
        type=whole(at_least=1),
        default=None,
        metavar="N",
        help="planner+repack: and never more than N moves to place one pod (default: no cap "
        "beyond --max-moves-per-gpu; as serve --repack-max-moves-per-pod)",
    )
    p.add_argument(
        "--repack-time-limit",
        type=number(above=0),
        default=None,
        metavar="S",
        help="planner+repack: seconds per repack search (default 1)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="time limits count work, not wall time (CP-SAT's deterministic time; "
        "extender/planner/clock.py): a replay whose plans come from the solver gives the same "
        "result on every run, however busy the machine",
    )
    p.add_argument(
        "--open-gpu-cost",
        type=number(at_least=0),
        default=0.0,
        metavar="F",
        help="planner, planner+repack: charge each placement F GPUs of memory per idle GPU it "
        "opens, on top of FGD's measure (default 0; 0.2 uses far fewer GPUs on mixed LLM pools, "
        "see docs/benchmarks/llm-mixed.md)",
    )
    p.add_argument(
        "--profile",
        choices=("whole", "live"),
        default="whole",
        help="the pod mix FGD's fragmentation measure (fgd, planner, planner+repack) weighs by: "
        "every pod of --pods (whole, FGD's protocol; default) or the pods arrived and not yet "
        "left, which is all serve can know (live)",
    )
    p.add_argument(
        "--bound",
        action="store_true",
        help="also compute an upper bound on the GPU memory any policy can allocate (pods stay; "
        "an LP over the arrived pods), and the bound for policies that place like the planner "
        "until a GPU pod first fits nowhere (planner+repack at any budget)",
    )
    p.add_argument(
        "--budget-curve",
        type=output_file,
        metavar="FILE.png",
        help="replay planner+repack at move budgets 0, 0.5%%, 1%%, 2%% and 5%% and plot GPU memory "
        "allocated against the budget, with FGD's and the bound (needs no --churn)",
    )
    p.add_argument("--churn", action="store_true", help="pods leave at their deletion time")
    p.add_argument(
        "--inflate",
        type=number(at_least=0, at_most=MAX_INFLATE),
        default=0.0,
        metavar="F",
        help="FGD protocol: repeat the pods until arrived GPU demand is F x the cluster's GPU capacity "
        f"(0: as listed, the default; at most {MAX_INFLATE:g})",
    )
    p.add_argument(
        "--skip-cpu-only", action="store_true", help="drop trace tasks that request no GPU"
    )
    p.add_argument(
        "--replicas",
        type=whole(at_least=1, at_most=MAX_REPLICAS),
        default=None,
        help="time-slicing replicas per trace GPU (default 20)",
    )
    p.add_argument(
        "--time-limit",
        type=number(above=0),
        default=1.0,
        help="planner: seconds per batch solve (default 1)",
    )
    p.add_argument(
        "--workers", type=whole(at_least=1), default=2, help="planner: CP-SAT workers (default 2)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--plot", type=output_file, metavar="FILE.png", help="draw the metrics side by side"
    )
    p.set_defaults(run=run)


def _policies(chosen: list[str] | None) -> list[str]:
    from extender.simulate.engine import ALL_POLICIES

    if not chosen or "all" in chosen:
        return list(ALL_POLICIES)
    return list(dict.fromkeys(chosen))


def run(args: argparse.Namespace) -> int:
    from extender.planner.capacity import Workload
    from extender.quantity import MIB
    from extender.simulate.bound_report import bound_line, budget_curve_point
    from extender.simulate.engine import (
        MOVE_BUDGET,
        MOVES_PER_GPU,
        PREEMPT_POLICY,
        REPACK_TIME_LIMIT,
        all_fit_line,
        build_capacity,
        replay,
        while_all_fit,
    )
    from extender.simulate.trace import (
        DEFAULT_REPLICAS,
        TRACE_GPU_MIB,
        inflate,
        read_inputs,
        with_qos_priorities,
    )
    from extender.source_file import ClusterFileError

    try:
        nodes, tasks, bound = read_inputs(
            args.nodes,
            args.pods,
            replicas=args.replicas or DEFAULT_REPLICAS,
            skip_cpu_only=args.skip_cpu_only,
        )
    except (OSError, ClusterFileError, KeyError, ValueError) as exc:
        print(f"vramsched simulate: cannot read inputs: {exc}", file=sys.stderr)
        return 2
    if not nodes:
        print("vramsched simulate: no nodes in --nodes", file=sys.stderr)
        return 2
    if args.priorities == "qos":
        tasks = with_qos_priorities(tasks)
    if PREEMPT_POLICY in (args.policy or ()) and len({t.demand.priority for t in tasks}) < 2:
        print(
            f"vramsched simulate: {PREEMPT_POLICY} needs pods of different priorities, and "
            "every pod of --pods has the same one (a trace's come from --priorities qos)",
            file=sys.stderr,
        )
        return 2
    workload = Workload.from_demands(t.demand for t in tasks)
    cluster, cap = build_capacity(nodes, bound)
    for note in gpu_nodes_left_out(cluster.ledger.nodes()):
        print(f"vramsched simulate: note: {note}", file=sys.stderr)
    a = cap.arrays
    gpu_bytes = int(a.capacity.mean()) if len(a.capacity) else TRACE_GPU_MIB * MIB
    gpu_count = len({(d.node, d.gpu_index) for d in a.devices})
    if args.inflate > 0:
        try:
            tasks = inflate(tasks, gpu_count, args.inflate, gpu_bytes)
        except ValueError as exc:
            print(f"vramsched simulate: --inflate {args.inflate:g}: {exc}", file=sys.stderr)
            return 2
    if (args.budget_curve or args.bound) and args.churn:
        print(
            "vramsched simulate: --bound and --budget-curve are for replays without --churn",
            file=sys.stderr,
        )
        return 2
    move_budget = MOVE_BUDGET if args.move_budget is None else args.move_budget
    repack_limit = REPACK_TIME_LIMIT if args.repack_time_limit is None else args.repack_time_limit
    per_gpu = MOVES_PER_GPU if args.max_moves_per_gpu is None else args.max_moves_per_gpu
    per_pod = args.max_moves_per_pod
    results = []
    for policy in _policies(args.policy):
        r = replay(
            args.deterministic,
            policy,
            nodes,
            tasks,
            bound,
            churn=args.churn,
            workload=workload,
            time_limit=args.time_limit,
            num_workers=args.workers,
            move_budget=move_budget,
            repack_time_limit=repack_limit,
            moves_per_gpu=per_gpu,
            moves_per_pod=per_pod,
            open_cost=args.open_gpu_cost,
            profile=args.profile,
        )
        results.append(r)
        if not args.json:
            print(f"  {policy}: done in {r.seconds:.1f}s", file=sys.stderr)
    bounds = _bounds(nodes, bound, tasks, results) if args.bound or args.budget_curve else None
    curve = None
    if args.budget_curve:
        curve = []
        for budget in BUDGETS:
            r = replay(
                args.deterministic,
                "planner+repack",
                nodes,
                tasks,
                bound,
                workload=workload,
                time_limit=args.time_limit,
                num_workers=args.workers,
                move_budget=budget,
                repack_time_limit=repack_limit,
                moves_per_gpu=per_gpu,
                moves_per_pod=per_pod,
                open_cost=args.open_gpu_cost,
                profile=args.profile,
            )
            curve.append(budget_curve_point(budget, r, tasks))
            if not args.json:
                print(
                    f"  planner+repack at budget {budget:g}: done in {r.seconds:.1f}s",
                    file=sys.stderr,
                )
    all_fit = while_all_fit(results)
    if args.json:
        body: dict[str, Any] = {
            "policies": {r.policy: r.to_json() for r in results},
            "input": {
                "nodes": len(nodes),
                "gpus": gpu_count,
                "tasks": len(tasks),
                "inflate": args.inflate,
                "churn": args.churn,
                "profile": args.profile,
                "priorities": args.priorities,
                "deterministic": args.deterministic,
            },
            "whileAllFit": all_fit,
        }
        if bounds is not None:
            body["bound"] = bounds
        if curve is not None:
            body["budgetCurve"] = curve
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        _table(results, len(tasks), gpu_count)
        if all_fit:
            print(all_fit_line(all_fit))
        if bounds is not None:
            print(bound_line(bounds))
        if curve is not None:
            print(
                "planner+repack by move budget: "
                + ", ".join(
                    f"{c['moveBudget']:.1%}: {c['allocatedPct']:.2f}% ({c['moves']} moves)"
                    for c in curve
                )
            )
    title = f"{len(nodes)} nodes, {gpu_count} GPUs, {len(tasks)} pods" + (
        f", inflate {args.inflate}" if args.inflate else ""
    )
    if args.plot:
        from extender.simulate.plot import plot_results

        plot_results(results, args.plot, title=title)
    if curve is not None:
        from extender.simulate.plot import plot_budget_curves

        fgd = next((r for r in results if r.policy == "fgd"), None)
        plot_budget_curves(
            {
                "": {
                    "budgetCurve": curve,
                    "fgdPct": _pct(fgd.allocatedMemoryBytes, fgd.capacityMemoryBytes)
                    if fgd
                    else None,
                    "bound": bounds,
                }
            },
            args.budget_curve,
            title=title,
        )
    bad = [
        r.policy
        for r in results
        if r.policy in ("planner", "planner+repack", PREEMPT_POLICY)
        and (r.overcommittedGpusPeak or r.invariantViolations)
    ]
    if bad:
        print(f"vramsched simulate: INVARIANT BROKEN by {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _pct(part: float, whole: float) -> float:
    return 100 * part / whole if whole else 0.0


def _bounds(nodes, bound, tasks, results) -> dict:
    from extender.simulate.bound_report import allocation_bounds

    return allocation_bounds(nodes, bound, tasks, results)


def _table(results, n_tasks: int, gpus: int) -> None:
    from extender.quantity import format_bytes
    from extender.simulate.engine import overcommit_text
    from extender.simulate.repack_replay import REQUEST_TALLY
    from extender.text_table import print_table

    head = [
        "policy",
        "placed",
        "failed",
        "GPU mem allocated",
        "GPUs in use",
        "GPUs free",
        "usable",
        "frag",
        "overcommitted",
        "moves",
        "seconds",
    ]
    rows = [
        [
            r.policy,
            str(r.placed),
            str(r.failed),
            format_bytes(r.allocatedMemoryBytes),
            str(r.gpusInUse),
            str(r.gpusFree),
            f"{r.gpusFreeUsable:.1f}",
            f"{r.fragmentationRate:.3f}",
            overcommit_text(r.overcommittedGpus, r.overcommittedGpusPeak),
            str(r.moves),
            f"{r.seconds:.1f}",
        ]
        for r in results
    ]
    print(f"{n_tasks} pods, {gpus} GPUs")
    print_table(head, rows)
    for r in results:
        held = r.extra.get("allocatedByPriority")
        if held:
            failed = r.extra["failedGpuPodsByPriority"]
            line = ", ".join(
                f"{p}: {format_bytes(b)} ({failed[p]} GPU pods failed)" for p, b in held.items()
            )
            print(f"{r.policy}, by priority: {line}")
        if "preempted" in r.extra:
            print(
                f"{r.policy}: {r.extra['preemptions']} preemptions evicted "
                f"{r.extra['preempted']} pods, {r.extra['preemptedPlacedAgain']} placed again"
            )
    for r in results:
        if r.repackByRequest:
            print(f"{r.policy}, GPU pods that found no place, by request:")
            print_table(
                ["request", *REQUEST_TALLY.values()],
                [
                    [label, *(str(t[k]) for k in REQUEST_TALLY)]
                    for label, t in sorted(
                        r.repackByRequest.items(), key=lambda kv: (-kv[1]["blocked"], kv[0])
                    )
                ],
            )
