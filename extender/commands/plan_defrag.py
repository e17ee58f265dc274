"""`vramsched plan-defrag`: propose the fewest pod moves that free the most whole GPUs (dry run)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from extender.commands.argtypes import number, whole
from extender.observe.sources import (
    SourceError,
    add_source_args,
    load_cluster,
    load_profile,
    load_spread_defaults,
    load_storage,
)
from extender.scheduler_profile import SchedulerConfigError
from extender.text_table import print_table

__all__ = ["register", "run"]

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Any

    import numpy as np

    from extender.volume_rules import Storage


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan-defrag",
        help="propose pod moves that free whole GPUs (dry run, nothing is evicted)",
        description="Reads a cluster (Nodes and bound Pods with vramsched assignments) from the API "
        "server (--kubeconfig, $KUBECONFIG, ~/.kube/config, else in-cluster, as `vramsched top`) "
        "or a cluster file (--cluster) and proposes the fewest moves of GPU-sharing pods that "
        "free the most whole GPUs. Every move's target has room before any other move, so they "
        "can be done one by one in any order, and kube-scheduler's own rules (node affinity, "
        "taints, pod affinity, topology spread, where its volumes reach, CSI attach limits) let "
        "the pod's new copy there. A pod with PersistentVolumeClaims moves only if its claims "
        "and their volumes are read, and one with CSI volumes to another node only if the "
        "CSINodes, VolumeAttachments and StorageClasses are: listed from the API server, or in "
        "the cluster file. With --scheduler-config, the scheduler profile's ignored resources, "
        "default spread constraints and added node affinity count too (the Services and "
        "controllers those select by are listed, or taken from the file). Nothing is evicted.",
    )
    add_source_args(p, server=False)
    p.add_argument(
        "--scheduler-config",
        metavar="FILE",
        help="the KubeSchedulerConfiguration of the kube-scheduler that places the moved pods: "
        "moves are checked with its profile's ignored resources, default spread constraints and "
        "added node affinity (--scheduler-name's profile; default: the defaults)",
    )
    p.add_argument(
        "--max-moves", type=whole(at_least=0), default=None, help="at most N moves in total"
    )
    p.add_argument(
        "--max-per-namespace",
        type=whole(at_least=0),
        default=None,
        help="at most N moves per namespace (like a PodDisruptionBudget maxUnavailable)",
    )
    p.add_argument(
        "--max-per-node",
        type=whole(at_least=0),
        default=None,
        help="at most N pods moved off any one node",
    )
    p.add_argument(
        "--exclude-namespace",
        action="append",
        default=[],
        metavar="NS",
        help="never move pods of NS (repeatable)",
    )
    p.add_argument(
        "--time-limit", type=number(above=0), default=10.0, help="solver seconds (default 10)"
    )
    p.add_argument("--workers", type=whole(at_least=1), default=2)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import orjson

    from extender.demand import DemandError, pod_demand
    from extender.planner.capacity import Capacity
    from extender.planner.defrag import Limits, plan_defrag
    from extender.quantity import format_bytes
    from extender.target_rules import node_masks, target_problem

    if args.kubeconfig and args.cluster:
        print(
            "vramsched plan-defrag: choose one source: --kubeconfig or --cluster", file=sys.stderr
        )
        return 2
    try:
        profile = load_profile(args.scheduler_config, args.scheduler_name)
    except SchedulerConfigError as exc:
        print(f"vramsched plan-defrag: --scheduler-config {exc}", file=sys.stderr)
        return 2
    try:
        cluster = load_cluster(args)
        spread = load_spread_defaults(args, profile)
    except SourceError as exc:
        print(f"vramsched plan-defrag: {exc}", file=sys.stderr)
        return 2
    storage, unread = load_storage(args)
    if unread is not None:
        print(f"vramsched plan-defrag: {unread}", file=sys.stderr)
    cap = Capacity.from_ledger(cluster.ledger, cluster.cpu_used, cluster.memory_used)
    demands = {}
    for pod in cluster.pods.values():
        if not (pod.get("spec") or {}).get("nodeName"):
            continue
        try:
            d = pod_demand(pod)
        except DemandError:
            continue
        demands[d.pod.key] = (d.cpu_milli, d.memory_bytes, d.resource)
    left_out: dict[str, str] = {}
    mask, kept = kept_home(
        node_masks(cluster.nodes, cluster.pods, cap.arrays.node_names, storage, profile),
        cluster.pods,
        cap.arrays.node_names,
        storage,
    )
    if kept and args.cluster:
        print(
            f"vramsched plan-defrag: {args.cluster} holds no CSINodes, VolumeAttachments or "
            f"StorageClasses; {len(kept)} pod(s) whose volumes attach limits count stay on "
            "their nodes",
            file=sys.stderr,
        )
    for _ in range(ATTEMPTS):
        limits = Limits(
            args.max_moves,
            args.max_per_namespace,
            args.max_per_node,
            frozenset(args.exclude_namespace),
            frozenset(left_out),
        )
        plan = plan_defrag(
            cap,
            demands,
            limits,
            time_limit=args.time_limit,
            num_workers=args.workers,
            node_mask=mask,
        )
        sent = [
            (mv.pod, moved, mv.to_node)
            for mv in plan.moves
            if (moved := cluster.pods.get(mv.pod)) is not None
        ]
        leaving = {mv.pod for mv in plan.moves}
        problem = target_problem(
            cluster.nodes, cluster.pods, sent, leaving, storage, profile=profile, spread=spread
        )
        if problem is None:
            break
        why, who = problem
        left_out[who or sent[-1][0] or "?"] = why
    else:
        plan = replace(plan, moves=[], freed=[], status="REFUSED")
    if args.json:
        body = {
            "status": plan.status,
            "gpusFreeBefore": plan.gpus_free_before,
            "gpusFreed": len(plan.freed),
            "gpusFreedBound": plan.bound_freed,
            "moves": [m.__dict__ for m in plan.moves],
            "leftOut": left_out,
            "freed": [{"node": n, "device": d} for n, d in plan.freed],
            "seconds": round(plan.seconds, 3),
        }
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(
        f"dry run: {len(plan.moves)} moves free {len(plan.freed)} whole GPUs "
        f"({plan.gpus_free_before} free now; solver {plan.status}, {plan.seconds:.2f}s). Nothing was evicted."
    )
    if plan.moves:
        head = ["pod", "from", "to", "VRAM"]
        rows = [
            [
                mv.pod,
                f"{mv.from_node}/GPU {mv.from_device}",
                f"{mv.to_node}/GPU {mv.to_device}",
                format_bytes(mv.bytes),
            ]
            for mv in plan.moves
        ]
        print_table(head, rows)
        print("GPUs freed: " + ", ".join(f"{n}/GPU {d}" for n, d in plan.freed))
    for key, why in left_out.items():
        print(f"left out: {key}: kube-scheduler would refuse its move ({why})")
    return 0


#: plans tried, each without the pods whose moves kube-scheduler would refuse in the one before
ATTEMPTS = 3


def kept_home(
    mask: Callable[[str], np.ndarray | None],
    pods: Mapping[str, Mapping[str, Any]],
    node_names: Sequence[str],
    storage: Storage,
) -> tuple[Callable[[str], np.ndarray | None], list[str]]:
    """`mask`, with every bound pod whose volumes attach limits would count kept to its own node
    when what counting needs was not read (a move within the node attaches nothing new): the
    model then never proposes the moves the check would refuse one by one. And those pods."""
    import numpy as np

    from extender.attach_limits import needs_counting
    from extender.object_fields import spec

    if None not in (storage.csinodes, storage.attachments, storage.classes):
        return mask, []
    names = np.asarray(node_names, dtype=object)
    home = {
        key: str(spec(pod).get("nodeName"))
        for key, pod in pods.items()
        if spec(pod).get("nodeName") and needs_counting([pod], storage)
    }

    def kept(key: str) -> np.ndarray | None:
        allowed = mask(key)
        if key not in home:
            return allowed
        own: np.ndarray = names == home[key]
        return own if allowed is None else own & allowed

    return kept, sorted(home)
