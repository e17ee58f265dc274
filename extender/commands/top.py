"""`vramsched top` (also `kubectl vramsched top`): VRAM per node and per GPU / MIG slice."""

from __future__ import annotations

import argparse
import sys

from extender.observe.render import console, dump, emit, summary_line, top_table
from extender.observe.sources import (
    SourceError,
    add_source_args,
    load_cluster,
    state_from_server,
)
from extender.observe.usage import (
    SORT_KEYS,
    NodeUsage,
    StateError,
    report_dict,
    select,
    sort_nodes,
    summarize,
    usage_from_ledger,
    usage_from_state,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "top",
        help="VRAM per node and per GPU / MIG slice: who holds how much, what is free or stranded",
        description="VRAM per node and per GPU / MIG slice, from the scheduler's own ledger. Read "
        "from the API server (default), a running extender (--server) or a cluster file "
        "(--cluster); most stranded VRAM first (free VRAM on a device with no replica left).",
    )
    add_source_args(p, server=True)
    p.add_argument("--node", metavar="NAME", help="only this node (a shell glob works: 'a100-*')")
    p.add_argument(
        "--product", metavar="TEXT", help="only GPUs whose product contains TEXT (any case)"
    )
    p.add_argument(
        "-n",
        "--namespace",
        help="only GPUs holding a pod of this namespace, and only its pods (default: all)",
    )
    p.add_argument(
        "--wide", action="store_true", help="also free, stranded, resource; non-GPU nodes"
    )
    p.add_argument("-o", "--output", choices=("json", "yaml", "wide"), help="output format")
    p.add_argument("--sort", choices=SORT_KEYS, default="waste", help="node order (default waste)")
    p.set_defaults(run=run)


def _usage(args: argparse.Namespace) -> list[NodeUsage]:
    chosen = [f for f in ("kubeconfig", "server", "cluster") if getattr(args, f, None)]
    if len(chosen) > 1:
        raise SourceError(f"choose one source: --{' or --'.join(chosen)}")
    if args.server:
        try:
            return usage_from_state(state_from_server(args.server))
        except StateError as exc:
            raise SourceError(f"{args.server}: {exc}") from None
    cluster = load_cluster(args)
    return usage_from_ledger(cluster.ledger, cluster.pods)


def run(args: argparse.Namespace) -> int:
    try:
        nodes = _usage(args)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    shown = sort_nodes(
        select(nodes, node=args.node, product=args.product, namespace=args.namespace), args.sort
    )
    summary = summarize(shown)
    if args.output in ("json", "yaml"):
        dump(report_dict(shown, summary), args.output)
        return 0
    emit(
        console(), top_table(shown, wide=args.wide or args.output == "wide"), summary_line(summary)
    )
    return 0
