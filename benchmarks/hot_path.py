"""Micro-benchmark of the extender hot path in-process: filter, prioritize and bind over a
generated cluster, at several sizes, without HTTP (the server's own decode and encode included).

Figures are CPU time per call (time.process_time), so they hold better than wall-clock
on a shared machine; they are never asserted anywhere.

    .venv/bin/python -m benchmarks.hot_path --nodes 100 1000 5000 --cycles 300
    .venv/bin/python -m benchmarks.hot_path --replica-policy distributed   # as live mode serves
    .venv/bin/python -m benchmarks.hot_path --explain-all   # reasons on every filter answer
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time

import orjson

from extender.cluster import ClusterState
from extender.commands.argtypes import number, output_file, whole
from extender.embedded import EmbeddedBinder
from extender.inventory import ReplicaPolicy
from extender.namelists import NameLists
from extender.server import decode_args, encode_names_result
from extender.service import ExtenderService
from extender.wire import ExtenderBindingArgs, HostTables, ScoredHosts
from loadtest.gen_cluster import generate
from loadtest.pods import make_pod

VERBS = ("filter", "prioritize", "bind")


def _pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def bench(
    nodes: int,
    cycles: int,
    occupancy: float,
    seed: int,
    replica_policy: str | None = None,
    explain_all: bool = False,
) -> dict:
    node_objs, pods = generate(nodes, 8, occupancy, seed)
    gc.disable()
    # live mode always has one (the stock device plugin picks time-sliced GPUs): `distributed` by default
    cluster = ClusterState(replica_policy=replica_policy)
    cluster.load(node_objs + pods)
    gc.freeze()
    gc.enable()
    # as the load test serves it: a current kube-scheduler reads FailedAndUnresolvableNodes
    svc = ExtenderService(
        cluster, EmbeddedBinder(cluster), legacy_failed_nodes=False, explain_all=explain_all
    )
    lists = NameLists()  # what the server keeps: the all-nodes list, filter's answers
    tables = HostTables()  # and prioritize's per-node entries
    names_json = orjson.dumps([n["metadata"]["name"] for n in node_objs])
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    cpu: dict[str, list[float]] = {v: [] for v in VERBS}
    clock = time.process_time

    def cycle(i: int, record: bool) -> None:
        pod = make_pod(rng, f"bench-{i}")
        pod_json = orjson.dumps(pod)
        body = b'{"Pod":' + pod_json + b',"Nodes":null,"NodeNames":' + names_json + b"}"
        t = clock()
        res = svc.filter(decode_args(body, lists, learn=True))
        encode_names_result(res, lists)
        if record:
            cpu["filter"].append(clock() - t)
        feasible = res.NodeNames or []
        if not feasible:
            return
        best = feasible[0]
        if len(feasible) > 1:
            body = (
                b'{"Pod":'
                + pod_json
                + b',"Nodes":null,"NodeNames":'
                + orjson.dumps(feasible)
                + b"}"
            )
            t = clock()
            hosts = svc.prioritize(decode_args(body, lists, learn=False))
            out = (
                hosts.to_json(tables)
                if isinstance(hosts, ScoredHosts)
                else orjson.dumps([h.model_dump() for h in hosts])
            )
            if record:
                cpu["prioritize"].append(clock() - t)
            scores = orjson.loads(out)
            best = max(scores, key=lambda h: h["Score"])["Host"]
        meta = pod["metadata"]
        body = orjson.dumps(
            {
                "PodName": meta["name"],
                "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"],
                "Node": best,
            }
        )
        t = clock()
        result = loop.run_until_complete(
            svc.bind(ExtenderBindingArgs.model_validate(orjson.loads(body)))
        )
        result.__pydantic_serializer__.to_json(result)
        if record:
            cpu["bind"].append(clock() - t)

    for i in range(min(50, cycles)):  # warm-up: first-use caches, code paths
        cycle(i, False)
    for i in range(cycles):
        cycle(10_000 + i, True)
    loop.close()
    return {
        "nodes": nodes,
        "pods": len(pods),
        "devices": len(cluster.ledger.arrays.devices),
        **{
            v: {
                "calls": len(cpu[v]),
                "p50_ms": round(_pct(cpu[v], 0.5) * 1e3, 3),
                "p99_ms": round(_pct(cpu[v], 0.99) * 1e3, 3),
                "mean_ms": round(sum(cpu[v]) / len(cpu[v]) * 1e3, 3) if cpu[v] else 0.0,
            }
            for v in VERBS
        },
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole(at_least=1), nargs="+", default=[100, 1000, 5000])
    p.add_argument("--cycles", type=whole(at_least=1), default=300)
    p.add_argument("--occupancy", type=number(at_least=0, at_most=1), default=0.6)
    p.add_argument("--seed", type=whole(at_least=0), default=1)
    p.add_argument(
        "--replica-policy",
        choices=[p.value for p in ReplicaPolicy],
        default=None,
        help="the device plugin's replica policy, as in live mode (default: none, exact per-GPU books)",
    )
    p.add_argument(
        "--explain-all",
        action="store_true",
        help="a reason for every refused node on every filter answer, as `serve --explain-all` "
        "(default: only when no node passes)",
    )
    p.add_argument("--json", type=output_file, help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = []
    print(
        f"{'nodes':>6} {'pods':>7} {'devices':>8}  "
        + "  ".join(f"{v + ' p50/p99 ms':>24}" for v in VERBS)
    )
    for n in args.nodes:
        r = bench(n, args.cycles, args.occupancy, args.seed, args.replica_policy, args.explain_all)
        rows.append(r)
        print(
            f"{r['nodes']:>6} {r['pods']:>7} {r['devices']:>8}  "
            + "  ".join(f"{r[v]['p50_ms']:>11.3f} / {r[v]['p99_ms']:>8.3f}" for v in VERBS),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"cpu_ms_per_call": rows, "loadavg": __import__("os").getloadavg()}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
