"""`make soak`: a bounded soak of vramsched under the load-test scenario, on loopback only.

1. generate (or reuse) a cluster file (loadtest.gen_cluster) and start `vramsched serve` on it;
   read the GPU memory allocated at start (GET /state);
2. probe: locust back to back for --probe, to measure the maximum cycle rate right now;
3. soak: locust at half that rate (constant throughput per user) for --duration (10 min),
   sampling the server's RSS every few seconds;
4. check the ledger at the end through GET /state (no GPU or slice over its memory or replicas),
   then delete every pod the load test bound and check that the GPU memory allocated is back to
   what it was at start, to the byte (nothing lost, nothing double-counted);
5. report: failures, RSS growth from the end of the warm-up to the end, the RSS timeline.

Churn: each locust user keeps at most --churn pods bound; beyond that it deletes the oldest one it
bound (embedded mode's `DELETE /pods/{ns}/{name}`). Pods leave as they arrive, so the cluster stays
at a steady occupancy, binds keep succeeding for the whole soak and every release path runs; RSS
growth then measures leaks, not the state of pods that legitimately stay. `--churn 0` is the old
soak (no deletions: the cluster fills up and later cycles are pods that fit nowhere).

    python -m loadtest.soak                      # 10 minutes, the figures for docs/reliability.md
    python -m loadtest.soak --duration 60s --warmup 20s --probe 15s   # a quick look

Exit status 1 when there was any failure, RSS grew 5% or more, the ledger broke the invariant, or
the memory allocated did not come back to its value at start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from extender.commands.argtypes import number, whole
from loadtest.gen_cluster import MAX_GPUS, nodes_file
from loadtest.run import (
    ROOT,
    _free_port,
    _proc_status,
    _seconds,
    _wait_ready,
    cluster_file,
    positive_run_time,
    run_locust,
    run_time,
    stop_process,
)

RSS_GROWTH_LIMIT = 0.05


class RssSampler(threading.Thread):
    """(seconds since start, VmRSS bytes) of a process every `every` seconds."""

    def __init__(self, pid: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int]] = []
        self._stop_event = threading.Event()
        self.started = time.monotonic()

    def run(self) -> None:
        while not self._stop_event.is_set():
            rss = _proc_status(self.pid).get("VmRSS", 0)
            if rss:
                self.samples.append((round(time.monotonic() - self.started, 1), rss))
            self._stop_event.wait(self.every)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def at(self, t: float) -> int:
        """RSS of the first sample at or after `t` seconds."""
        for s, rss in self.samples:
            if s >= t:
                return rss
        return self.samples[-1][1]


def _state(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/state", timeout=120) as r:
        return orjson.loads(r.read())


LOADTEST_PODS = "loadtest/lt-"  # the keys of the pods the locustfile creates


def held_pods(state: dict[str, Any], prefix: str = LOADTEST_PODS) -> set[str]:
    """Keys starting with `prefix` of the pods holding a GPU or MIG slice in a GET /state answer."""
    return {
        k
        for node in state["nodes"]
        for gpu in node["gpus"]
        for d in gpu.get("slices") or [gpu]
        for k in d["pods"]
        if k.startswith(prefix)
    }


def delete_loadtest_pods(port: int, prefix: str = LOADTEST_PODS) -> int:
    """Delete every pod the load test bound (those holding a GPU or slice in GET /state); how many."""
    keys = held_pods(_state(port), prefix)
    for key in sorted(keys):
        namespace, name = key.split("/", 1)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/pods/{namespace}/{name}", method="DELETE"
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            if orjson.loads(r.read()) != {"Error": ""}:
                raise SystemExit(f"DELETE {key} did not succeed")
    return len(keys)


def ledger_check(port: int) -> dict[str, Any]:
    """Invariant over GET /state: every GPU and MIG slice within its memory and replicas."""
    state = _state(port)
    bad: list[str] = []
    devices = 0
    for node in state["nodes"]:
        for gpu in node["gpus"]:
            parts = gpu.get("slices") or [gpu]
            for d in parts:
                devices += 1
                if d["usedBytes"] > d["memoryBytes"] or d["usedReplicas"] > d["replicas"]:
                    bad.append(
                        f"{node['name']}/GPU {gpu['index']}{'/' + d['profile'] if 'profile' in d else ''}"
                    )
    return {
        "devices": devices,
        "violations": bad,
        "allocated_bytes": state["allocatedBytes"],
        "capacity_bytes": state["capacityBytes"],
        "pending": len(state["pending"]),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole(at_least=1), default=1000)
    p.add_argument("--gpus", type=whole(at_least=1, at_most=MAX_GPUS), default=8)
    p.add_argument("--occupancy", type=number(at_least=0, at_most=1), default=0.6)
    p.add_argument("--seed", type=whole(at_least=0), default=1)
    p.add_argument(
        "--users",
        type=whole(at_least=1),
        default=4,
        help="concurrent scheduling loops (default 4)",
    )
    p.add_argument(
        "--churn",
        type=whole(at_least=0),
        default=250,
        help="pods each user keeps bound before it deletes its oldest (default 250; 0: no deletions)",
    )
    p.add_argument(
        "--probe",
        type=positive_run_time,
        default="30s",
        help="back-to-back run that measures the maximum rate (default 30s)",
    )
    p.add_argument(
        "--duration",
        type=positive_run_time,
        default="10m",
        help="soak length at half the maximum rate (default 10m)",
    )
    p.add_argument(
        "--warmup",
        type=run_time,
        default="2m",
        help="start of the soak left out of the RSS baseline (default 2m)",
    )
    p.add_argument(
        "--sample", type=number(above=0), default=5.0, help="seconds between RSS samples"
    )
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    probe_s, soak_s, warmup_s = _seconds(args.probe), _seconds(args.duration), _seconds(args.warmup)
    if warmup_s >= soak_s:
        raise SystemExit("--warmup must be shorter than --duration")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    cluster = cluster_file(out, args.nodes, args.gpus, args.occupancy, args.seed)
    sidecar = nodes_file(cluster)
    meta = orjson.loads(sidecar.read_bytes())
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extender",
            "serve",
            "--cluster",
            str(cluster),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=(out / "soak.server.log").open("wb"),
    )
    try:
        startup = _wait_ready(f"http://127.0.0.1:{port}/readyz", server, timeout=300)
        allocated_at_start = _state(port)["allocatedBytes"]
        print(
            f"vramsched ready in {startup:.1f}s: {len(meta['nodes'])} nodes, {meta['pods']} pods; "
            f"probing the maximum rate for {args.probe} ...",
            flush=True,
        )
        run_args = argparse.Namespace(
            users=args.users,
            rate=0.0,
            duration_s=probe_s,
            warmup=min(5.0, probe_s / 3),
            processes=1,
            churn=args.churn,
        )
        probe = run_locust("soak-probe", port, run_args, sidecar, out, server.pid)
        max_rate = probe["cycles_per_s"]
        if max_rate <= 0:
            raise SystemExit("the probe measured no cycles")
        rate = max_rate / 2
        print(
            f"maximum {max_rate:.1f} cycles/s ({probe['failures']} failures); soaking at {rate:.1f} cycles/s "
            f"for {args.duration} ...",
            flush=True,
        )
        sampler = RssSampler(server.pid, args.sample)
        sampler.start()
        run_args = argparse.Namespace(
            users=args.users,
            rate=rate / args.users,
            duration_s=soak_s,
            warmup=warmup_s,
            processes=1,
            churn=args.churn,
        )
        soak = run_locust("soak", port, run_args, sidecar, out, server.pid)
        sampler.stop()
        ledger = ledger_check(port)
        ledger["deleted_at_end"] = delete_loadtest_pods(port)
        ledger["allocated_bytes_at_start"] = allocated_at_start
        ledger["allocated_bytes_after_deleting"] = _state(port)["allocatedBytes"]
        ledger["returned_exactly"] = ledger["allocated_bytes_after_deleting"] == allocated_at_start
        alive = server.poll() is None
    finally:
        stop_process(server)

    base, end = sampler.at(warmup_s), sampler.samples[-1][1]
    peak = max(rss for _, rss in sampler.samples)
    growth = (end - base) / base
    counts = soak["counts"]
    summary = {
        "nodes": len(meta["nodes"]),
        "pods_at_start": meta["pods"],
        "occupancy": args.occupancy,
        "users": args.users,
        "churn_per_user": args.churn,
        "max_cycles_per_s": max_rate,
        "soak_cycles_per_s": soak["cycles_per_s"],
        "target_cycles_per_s": round(rate, 1),
        "duration_s": soak_s,
        "warmup_s": warmup_s,
        "measured_s": soak["measured_s"],
        "failures": soak["failures"] + probe["failures"],
        "counts_after_warmup": counts,
        "rss_bytes": {"after_warmup": base, "end": end, "peak": peak},
        "rss_growth": round(growth, 4),
        # caches (demands, learned pending pods, reasons) fill during the first minutes; a leak keeps
        # growing: the second half of the soak alone tells them apart
        "rss_growth_second_half": round((end - sampler.at(soak_s / 2)) / sampler.at(soak_s / 2), 4),
        # every bound pod stays in memory for good in embedded mode (~5 KiB): what growth per bound pod
        # looks like tells legitimate state from a leak when the run binds a lot
        "rss_growth_per_bound_pod_bytes": round((end - base) / counts["bound"])
        if counts.get("bound")
        else None,
        "rss_growth_limit": RSS_GROWTH_LIMIT,
        "rss_timeline": sampler.samples,
        "ledger": ledger,
        "server_alive_at_end": alive,
        "verbs": soak["verbs"],
        "cpus": os.cpu_count(),
        "results": str(out / "soak.json"),
    }
    ok = (
        summary["failures"] == 0
        and growth < RSS_GROWTH_LIMIT
        and not ledger["violations"]
        and alive
        and ledger["returned_exactly"]
    )
    summary["passed"] = ok
    (out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(render(summary))
    return 0 if ok else 1


def render(s: dict[str, Any]) -> str:
    mib = 2**20
    r = s["rss_bytes"]
    c = s["counts_after_warmup"]
    return "\n".join(
        [
            f"vramsched soak: {s['nodes']} nodes, {s['pods_at_start']} pods at start (occupancy {s['occupancy']}), "
            f"{s['users']} users, each keeping at most {s['churn_per_user']} pods bound, loopback",
            f"  maximum {s['max_cycles_per_s']:.1f} cycles/s; soak at {s['soak_cycles_per_s']:.1f} cycles/s "
            f"(target {s['target_cycles_per_s']:.1f}) for {s['duration_s']:.0f}s, {s['warmup_s']:.0f}s warm-up",
            f"  after warm-up: {c.get('cycles', 0)} cycles, {c.get('bound', 0)} bound, {c.get('unschedulable', 0)} unschedulable, "
            f"{c.get('races', 0)} lost races, {c.get('deleted', 0)} deleted; failures {s['failures']}",
            f"  RSS after warm-up {r['after_warmup'] / mib:.1f} MiB, end {r['end'] / mib:.1f} MiB, peak {r['peak'] / mib:.1f} MiB: "
            f"growth {s['rss_growth'] * 100:+.2f}% (limit {s['rss_growth_limit'] * 100:.0f}%), "
            f"{s['rss_growth_second_half'] * 100:+.2f}% over the second half"
            + (
                f", {s['rss_growth_per_bound_pod_bytes'] / 1024:.1f} KiB per pod bound meanwhile"
                if s["rss_growth_per_bound_pod_bytes"] is not None
                else ""
            ),
            f"  ledger at the end: {s['ledger']['devices']} devices, {len(s['ledger']['violations'])} over memory or replicas; "
            f"after deleting the {s['ledger']['deleted_at_end']} load-test pods still bound, GPU memory allocated "
            f"{'back to its value at start, to the byte' if s['ledger']['returned_exactly'] else 'NOT back to its value at start'}"
            f" ({s['ledger']['allocated_bytes_after_deleting']} vs {s['ledger']['allocated_bytes_at_start']} bytes)",
            f"  {'PASSED' if s['passed'] else 'FAILED'}  ({s.get('results', 'loadtest/results/soak.json')})",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
