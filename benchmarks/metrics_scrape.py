"""What one Prometheus scrape of the per-GPU gauges costs at 5,000 nodes, and what it would cost
through prometheus_client's own formatter (the baseline, same run, same ledger).

Two fleets of 5,000 nodes x 8 GPUs: the load test's generated cluster (loadtest/gen_cluster.py:
H100/H200/A100 nodes, time-slicing, MPS and MIG, so MIG slices make more devices than GPUs), and
5,000 nodes of 8 whole H100s. Per fleet: the first scrape (every label built), a scrape with
nothing changed, one after 500 pods left; the longest the event loop is held between two pieces
(what a request waits behind a scrape at worst), the size, and the CPU of the gzip (level 1) the
server runs off the loop when Prometheus asks for it. Figures are CPU time (the scrape runs on
one thread); never asserted.

    .venv/bin/python -m benchmarks.metrics_scrape            # make bench-metrics
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import zlib
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extender.cluster import ClusterState
from extender.commands.argtypes import whole
from extender.inventory import MigSlice
from extender.ledger import Ledger
from extender.observe.gpu_metrics import FAMILIES, GpuExposition
from extender.observe.usage import MIG
from extender.placement import warm
from loadtest.gen_cluster import MAX_GPUS, generate

RESULTS = Path(__file__).resolve().parent / "results" / "metrics_scrape.json"


class _Baseline(Collector):
    """The same four families through prometheus_client (labels and values read at scrape)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self):
        a = self.ledger.arrays
        labels = [
            (d.node, d.device_id, d.product, MIG if isinstance(d, MigSlice) else d.sharing.value)
            for d in a.devices
        ]
        for (name, doc), column in zip(FAMILIES, (a.capacity, a.used, a.replicas, a.used_replicas)):
            fam = GaugeMetricFamily(name, doc, labels=["node", "gpu", "product", "sharing"])
            for lab, value in zip(labels, column.tolist()):
                fam.add_metric(lab, value)
            yield fam


def _h100_fleet(nodes: int, gpus: int) -> list[dict]:
    """`nodes` nodes of `gpus` exclusive H100s, one pod on every other GPU (assignment annotated)."""
    objs: list[dict] = []
    for n in range(nodes):
        name = f"h100-{n:05d}"
        objs.append(
            {
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {
                        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                        "nvidia.com/gpu.count": str(gpus),
                        "nvidia.com/gpu.memory": "81559",
                        "nvidia.com/gpu.replicas": "1",
                    },
                },
                "status": {
                    "allocatable": {"cpu": "192", "memory": "2Ti", "nvidia.com/gpu": str(gpus)}
                },
            }
        )
        for g in range(0, gpus, 2):
            objs.append(
                {
                    "kind": "Pod",
                    "metadata": {
                        "name": f"p-{n}-{g}",
                        "namespace": "bench",
                        "uid": f"u-{n}-{g}",
                        "annotations": {
                            "vramsched.io/model-memory": "40Gi",
                            "vramsched.io/assignment": json.dumps(
                                {"node": name, "devices": [str(g)], "bytesPerDevice": [40 << 30]}
                            ),
                        },
                    },
                    "spec": {
                        "schedulerName": "vramsched",
                        "nodeName": name,
                        "containers": [
                            {"name": "m", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                        ],
                    },
                    "status": {"phase": "Running"},
                }
            )
    return objs


def _scrape(exp: GpuExposition) -> tuple[float, float, int, list[bytes]]:
    """(CPU s, CPU s of the longest piece, bytes, pieces) of one scrape as the server streams it.
    CPU time (`time.process_time`): on a shared machine the wall clock also counts the
    neighbours' time slices, which the scrape does not cause."""
    pieces, longest = [], 0.0
    started = last = time.process_time()
    for piece in exp.pieces():
        now = time.process_time()
        longest = max(longest, now - last)
        pieces.append(piece)
        last = time.process_time()
    return time.process_time() - started, longest, sum(map(len, pieces)), pieces


def bench_fleet(name: str, cluster: ClusterState) -> dict:
    ledger = cluster.ledger
    exp = GpuExposition(lambda: ledger)
    first = _scrape(exp)
    same = min((_scrape(exp) for _ in range(3)), key=lambda r: r[0])
    for res in list(ledger.reservations())[:500]:
        ledger.release(res.key)
    changed = _scrape(exp)
    body = b"".join(changed[3])
    t = time.process_time()
    gz = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # the server's gzip (level 1)
    gz_size = sum(len(gz.compress(p)) for p in changed[3]) + len(gz.flush())
    gzip_s = time.process_time() - t
    registry = CollectorRegistry()
    registry.register(_Baseline(ledger))
    t = time.process_time()
    baseline = generate_latest(registry)
    baseline_s = time.process_time() - t
    assert len(baseline) > 0 and body.count(b"\n") == 4 * len(ledger.arrays.devices) + 8
    return {
        "fleet": name,
        "nodes": len(ledger),
        "devices": len(ledger.arrays.devices),
        "series": 4 * len(ledger.arrays.devices),
        "first_scrape_s": round(first[0], 3),
        "scrape_s": round(same[0], 3),
        "scrape_after_500_changes_s": round(changed[0], 3),
        "longest_piece_first_ms": round(1000 * first[1], 2),
        "longest_piece_ms": round(1000 * max(same[1], changed[1]), 2),
        "bytes": changed[2],
        "gzip_bytes": gz_size,
        "gzip_cpu_s_off_loop": round(gzip_s, 3),
        "prometheus_client_s": round(baseline_s, 3),
        "prometheus_client_bytes": len(baseline),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole(at_least=1), default=5000)
    p.add_argument("--gpus", type=whole(at_least=1, at_most=MAX_GPUS), default=8)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = []
    for name in ("load-test fleet", "8 x H100 per node"):
        gc.collect()
        cluster = ClusterState()
        if name == "load-test fleet":
            nodes, pods = generate(args.nodes, args.gpus, 0.6, 1)
            cluster.load(
                [dict(n, kind="Node") for n in nodes] + [dict(p, kind="Pod") for p in pods]
            )
        else:
            cluster.load(_h100_fleet(args.nodes, args.gpus))
        warm(cluster.ledger)  # as `serve` does before it listens: the device arrays are built
        gc.freeze()  # and the cluster's objects are left out of later collections
        rows.append(bench_fleet(name, cluster))
        print(json.dumps(rows[-1]), flush=True)
    print()
    print(
        "| fleet | devices | series | first scrape (longest hold) | scrape | after 500 pods left | longest loop hold | size | gzip (off loop) | prometheus_client |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['fleet']} | {r['devices']:,} | {r['series']:,} "
            f"| {r['first_scrape_s'] * 1000:.0f} ms ({r['longest_piece_first_ms']:.0f} ms) "
            f"| {r['scrape_s'] * 1000:.0f} ms | {r['scrape_after_500_changes_s'] * 1000:.0f} ms "
            f"| {r['longest_piece_ms']:.1f} ms | {r['bytes'] / 2**20:.1f} MiB "
            f"| {r['gzip_bytes'] / 2**20:.1f} MiB, {r['gzip_cpu_s_off_loop'] * 1000:.0f} ms CPU "
            f"| {r['prometheus_client_s']:.2f} s |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python -m benchmarks.metrics_scrape " + " ".join(argv or sys.argv[1:]),
                "machine": {
                    "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count(),
                },
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
