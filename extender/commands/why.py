"""`vramsched why POD` (also `kubectl vramsched why -n NS POD`): why a pod waits."""

from __future__ import annotations

import argparse
import sys

from extender.commands.argtypes import number
from extender.observe.render import console, dump, emit, why_renderables
from extender.observe.sources import SourceError, add_source_args, default_kubeconfig, load_cluster
from extender.observe.why import explain, explanation_dict


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "why",
        help="why a pod is pending: filter's answer now, node by node, and what would make it fit",
        description="What vramsched's filter says of POD now on every node, grouped by reason (the "
        "text of its FailedScheduling event), the closest node (the one that misses by the least "
        "VRAM) and the fewest pods whose removal would let it fit there, or for a MIG pod the "
        "smallest profile that holds it. Read from the API server (default) or a cluster file.",
    )
    p.add_argument("pod", metavar="POD", help="the pod: NAME (with -n) or NAMESPACE/NAME")
    p.add_argument(
        "-n", "--namespace", help="the pod's namespace (default: the context's, else default)"
    )
    add_source_args(p, server=False)
    p.add_argument(
        "--headroom",
        type=number(at_least=0, at_most=1),
        default=0.0,
        help="the extender's --headroom (extra VRAM fraction over the declared model memory)",
    )
    p.add_argument(
        "--wide", action="store_true", help="every node of every reason, not the first 5"
    )
    p.add_argument("-o", "--output", choices=("json", "yaml", "wide"), help="output format")
    p.set_defaults(run=run)


def _namespace(args: argparse.Namespace) -> str:
    if args.namespace:
        return args.namespace
    if not args.cluster:
        path = default_kubeconfig(args.kubeconfig)
        if path:
            try:
                import kubernetes.config

                _, active = kubernetes.config.list_kube_config_contexts(config_file=path)
                ns = (active or {}).get("context", {}).get("namespace")
                if ns:
                    return str(ns)
            except Exception:  # an unreadable context: the loader reports it next
                pass
    return "default"


def run(args: argparse.Namespace) -> int:
    if args.kubeconfig and args.cluster:
        print("error: choose one source: --kubeconfig or --cluster", file=sys.stderr)
        return 1
    key = args.pod if "/" in args.pod else f"{_namespace(args)}/{args.pod}"
    try:
        cluster = load_cluster(args, headroom=args.headroom)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    pod = cluster.pod(key)
    if pod is None:
        print(f"error: pod {key} not found", file=sys.stderr)
        return 1
    scheduler = (pod.get("spec") or {}).get("schedulerName") or "default-scheduler"
    if scheduler != cluster.scheduler_name:
        print(
            f"error: pod {key} is scheduled by {scheduler!r}, not {cluster.scheduler_name!r}: "
            "vramsched never sees it",
            file=sys.stderr,
        )
        return 1
    explanation = explain(cluster.ledger, pod, pods=cluster.pods, headroom=args.headroom)
    if args.output in ("json", "yaml"):
        dump(explanation_dict(explanation), args.output)
    else:
        emit(console(), *why_renderables(explanation, wide=args.wide or args.output == "wide"))
    return 1 if explanation.error else 0
