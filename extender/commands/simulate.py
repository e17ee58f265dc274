"""`vramsched simulate`: replay pods on a cluster with several placement policies side by side."""

from __future__ import annotations

import argparse
import sys

import orjson

__all__ = ["register", "run"]

POLICY_CHOICES = ("planner", "hot-path", "best-fit", "first-fit", "spread", "fgd", "all")


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
        help="policy to run (repeatable; default all): planner, hot-path (what the server does to a pod "
        "placed at once), best-fit, first-fit, spread, fgd",
    )
    p.add_argument("--churn", action="store_true", help="pods leave at their deletion time")
    p.add_argument(
        "--inflate",
        type=float,
        default=0.0,
        metavar="F",
        help="FGD protocol: repeat the pods until arrived GPU demand is F x the cluster's GPU capacity",
    )
    p.add_argument(
        "--skip-cpu-only", action="store_true", help="drop trace tasks that request no GPU"
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="time-slicing replicas per trace GPU (default 20)",
    )
    p.add_argument(
        "--time-limit", type=float, default=1.0, help="planner: seconds per batch solve (default 1)"
    )
    p.add_argument("--workers", type=int, default=2, help="planner: CP-SAT workers (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="draw the metrics side by side")
    p.set_defaults(run=run)


def _policies(chosen: list[str] | None) -> list[str]:
    from extender.simulate.engine import ALL_POLICIES

    if not chosen or "all" in chosen:
        return list(ALL_POLICIES)
    return list(dict.fromkeys(chosen))


def run(args: argparse.Namespace) -> int:
    from extender.planner.capacity import Workload
    from extender.quantity import MIB
    from extender.simulate.engine import all_fit_line, build_capacity, run_policy, while_all_fit
    from extender.simulate.trace import DEFAULT_REPLICAS, TRACE_GPU_MIB, inflate, read_inputs
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
    workload = Workload.from_demands(t.demand for t in tasks)
    _, cap = build_capacity(nodes, bound)
    a = cap.arrays
    gpu_bytes = int(a.capacity.mean()) if len(a.capacity) else TRACE_GPU_MIB * MIB
    gpu_count = len({(d.node, d.gpu_index) for d in a.devices})
    if args.inflate > 0:
        tasks = inflate(tasks, gpu_count, args.inflate, gpu_bytes)
    results = []
    for policy in _policies(args.policy):
        r = run_policy(
            policy,
            nodes,
            tasks,
            bound,
            churn=args.churn,
            workload=workload,
            time_limit=args.time_limit,
            num_workers=args.workers,
        )
        results.append(r)
        if not args.json:
            print(f"  {policy}: done in {r.seconds:.1f}s", file=sys.stderr)
    all_fit = while_all_fit(results)
    if args.json:
        body = {
            "policies": {r.policy: r.to_json() for r in results},
            "input": {
                "nodes": len(nodes),
                "gpus": gpu_count,
                "tasks": len(tasks),
                "inflate": args.inflate,
                "churn": args.churn,
            },
            "whileAllFit": all_fit,
        }
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        _table(results, len(tasks), gpu_count)
        if all_fit:
            print(all_fit_line(all_fit))
    if args.plot:
        from extender.simulate.plot import plot_results

        plot_results(
            results,
            args.plot,
            title=f"{len(nodes)} nodes, {gpu_count} GPUs, {len(tasks)} pods"
            + (f", inflate {args.inflate}" if args.inflate else ""),
        )
    bad = [
        r.policy
        for r in results
        if r.policy == "planner" and (r.overcommittedGpusPeak or r.invariantViolations)
    ]
    if bad:
        print(f"vramsched simulate: INVARIANT BROKEN by {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _table(results, n_tasks: int, gpus: int) -> None:
    from extender.quantity import format_bytes
    from extender.simulate.engine import overcommit_text

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
            f"{r.seconds:.1f}",
        ]
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print(f"{n_tasks} pods, {gpus} GPUs")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
