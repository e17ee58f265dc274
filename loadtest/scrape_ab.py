"""`make loadtest-scrape`: does a Prometheus scraper move the load test's latency?

The load test's scenario (loadtest/locustfile.py) against `vramsched serve` on the generated
5,000-node cluster, alternately without (A) and with (B) a scraper that GETs /metrics (gzip, as
Prometheus asks) every --interval seconds for the whole run. A new server per run; the order
alternates by round (A B, then B A, ...) so that a neighbour's load on the shared machine does not
land on one variant only. Prints each run and the median per variant of the cycle and verb p99,
cycles/s and the scrapes' own time and size; writes `<out>/scrape_ab.json`.

    python -m loadtest.scrape_ab --nodes 5000 --duration 45s --rounds 2 --interval 5

Each run also records the server's CPU on its main thread (the event loop: requests, and the
scrape's rendering) and on its other threads (the scrape's gzip, the background planner), from
/proc, so a difference between A and B shows where it is spent. `--py-spy PATH` samples the server with py-spy for the length of each run (raw folded
stacks in `<out>/<run>.py-spy.txt`; it costs CPU of its own: keep it out of a measuring run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from extender.commands.argtypes import number, whole
from loadtest.gen_cluster import MAX_GPUS, nodes_file
from loadtest.run import (
    ROOT,
    VERBS,
    _free_port,
    _seconds,
    _wait_ready,
    cluster_file,
    positive_run_time,
    run_locust,
    start_server,
    stop_process,
)


def _scraper(
    url: str, interval: float, stop: threading.Event, out: list[tuple[float, int]]
) -> None:
    """GET /metrics as Prometheus does (gzip accepted) every `interval` s: (seconds, bytes) each."""
    while not stop.is_set():
        started = time.perf_counter()
        req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                size = len(resp.read())
            out.append((time.perf_counter() - started, size))
        except OSError:
            pass
        stop.wait(max(0.0, interval - (time.perf_counter() - started)))


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the server's main thread, which runs the event loop (`loop`), and of its
    other threads (`threads`: the default executor, where the scrape's gzip and the background
    planner's plans run). From /proc: the threads are all named `python` there, so no finer."""
    out = {"loop": 0.0, "threads": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended meanwhile
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        out["loop" if task.name == str(pid) else "threads"] += cpu
    return out


def _py_spy(binary: str, pid: int, seconds: float, path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [binary, "record", "--pid", str(pid), "--format", "raw", "--rate", "100", "--threads"]
        + ["--nonblocking", "--duration", str(int(seconds)), "--output", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def one_run(
    name: str, scrape: bool, args: argparse.Namespace, cluster: Path, out: Path
) -> dict[str, Any]:
    port = _free_port()
    server = start_server(cluster, port, args, out / f"{name}.server.log")
    scrapes: list[tuple[float, int]] = []
    stop = threading.Event()
    spy: subprocess.Popen | None = None
    try:
        _wait_ready(f"http://127.0.0.1:{port}/readyz", server, timeout=180)
        if scrape:
            threading.Thread(
                target=_scraper,
                args=(f"http://127.0.0.1:{port}/metrics", args.interval, stop, scrapes),
                daemon=True,
            ).start()
        if args.py_spy:
            spy = _py_spy(args.py_spy, server.pid, args.duration_s, out / f"{name}.py-spy.txt")
        threads_before = _thread_cpu(server.pid)
        result = run_locust(name, port, args, nodes_file(cluster), out, server.pid)
        threads = {k: v - threads_before[k] for k, v in _thread_cpu(server.pid).items()}
    finally:
        stop.set()
        if spy is not None:
            spy.wait(timeout=60)
        stop_process(server)
    cycles = max(1, result.get("cycles_total", 0))
    row = {
        "run": name,
        "scraper": scrape,
        "cycles_per_s": result["cycles_per_s"],
        "failures": result["failures"],
        "cycle_p99_ms": result["verbs"]["cycle"]["p99_ms"],
        "cycle_p50_ms": result["verbs"]["cycle"]["p50_ms"],
        **{f"{v}_p99_ms": result["verbs"][v]["p99_ms"] for v in VERBS},
        "server_cpu_ms_per_cycle": result["server_cpu_ms_per_cycle"],
        **{f"{k}_cpu_ms_per_cycle": round(v * 1000 / cycles, 3) for k, v in threads.items()},
        "scrapes": len(scrapes),
        "scrape_s_median": round(statistics.median(s for s, _ in scrapes), 3) if scrapes else None,
        "scrape_gzip_bytes": scrapes[-1][1] if scrapes else None,
    }
    print(json.dumps(row), flush=True)
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole(at_least=1), default=5000)
    p.add_argument("--gpus", type=whole(at_least=1, at_most=MAX_GPUS), default=8)
    p.add_argument(
        "--duration",
        type=positive_run_time,
        default="45s",
        help="locust run time per run (default 45s)",
    )
    p.add_argument("--users", type=whole(at_least=1), default=4)
    p.add_argument(
        "--rounds", type=whole(at_least=1), default=2, help="rounds of A and B (default 2)"
    )
    # 0: the next scrape as soon as the last one is read (_scraper waits what is left of it)
    p.add_argument(
        "--interval",
        type=number(at_least=0),
        default=5.0,
        help="seconds between scrapes (default 5)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "scrape_ab")
    p.add_argument(
        "--py-spy", metavar="PATH", help="py-spy binary: sample the server during each run"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # what run_locust and start_server read, as `make loadtest` sets them
    args.duration_s, args.rate, args.warmup, args.processes = _seconds(args.duration), 0.0, 3.0, 1
    args.planner, args.replica_policy = True, None
    args.out.mkdir(parents=True, exist_ok=True)
    cluster = cluster_file(args.out.parent, args.nodes, args.gpus, 0.6, 1)
    rows = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for scrape in order:
            rows.append(one_run(f"{'B' if scrape else 'A'}{r}", scrape, args, cluster, args.out))
    print()
    print(
        "| variant | runs | cycle p99 ms | filter p99 | prioritize p99 | bind p99 | cycles/s | server CPU ms/cycle (loop, other threads) | scrapes (median s, gzip size) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    summary = {}
    for scrape in (False, True):
        mine = [x for x in rows if x["scraper"] is scrape]
        med = {
            k: statistics.median(x[k] for x in mine)
            for k in (
                "cycle_p99_ms",
                "filter_p99_ms",
                "prioritize_p99_ms",
                "bind_p99_ms",
                "cycles_per_s",
                "server_cpu_ms_per_cycle",
                "loop_cpu_ms_per_cycle",
                "threads_cpu_ms_per_cycle",
            )
        }
        label = f"B: scrape every {args.interval:g} s" if scrape else "A: no scraper"
        scr = (
            f"{sum(x['scrapes'] for x in mine)} ({statistics.median(x['scrape_s_median'] for x in mine):.2f} s, "
            f"{mine[0]['scrape_gzip_bytes'] / 2**20:.1f} MiB)"
            if scrape and all(x["scrapes"] for x in mine)
            else "-"
        )
        print(
            f"| {label} | {len(mine)} | {med['cycle_p99_ms']:.2f} | {med['filter_p99_ms']:.2f} "
            f"| {med['prioritize_p99_ms']:.2f} | {med['bind_p99_ms']:.2f} | {med['cycles_per_s']:.0f} "
            f"| {med['server_cpu_ms_per_cycle']:.2f} ({med['loop_cpu_ms_per_cycle']:.2f}, "
            f"{med['threads_cpu_ms_per_cycle']:.2f}) | {scr} |"
        )
        summary["B" if scrape else "A"] = med
    (args.out / "scrape_ab.json").write_text(
        json.dumps({"argv": argv or sys.argv[1:], "runs": rows, "medians": summary}, indent=2)
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
