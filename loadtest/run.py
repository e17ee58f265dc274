"""`make loadtest`: vramsched and the floor under the same locust scenario, one summary.

1. generate (or reuse) the cluster file for --nodes;
2. start `vramsched serve --cluster` on it, time start-up until /readyz answers;
3. run locust headless for --duration against it (CSV + HTML under --out);
4. the same against the floor (loadtest/floor.py);
5. print a one-screen summary and write `<out>/summary.json`.

    python -m loadtest.run --nodes 5000 --duration 60s
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from extender.commands.argtypes import number, whole
from extender.inventory import ReplicaPolicy
from loadtest.gen_cluster import MAX_GPUS, generate, nodes_file, write_cluster

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
VERBS = ("filter", "prioritize", "bind")


def _seconds(text: str) -> float:
    """`60s`, `2m`, `1m30s`, `90` -> seconds (locust's --run-time syntax)."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"duration {text!r}: use e.g. 60s, 2m, 1m30s")
    return float(sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts))


def run_time(text: str) -> str:
    """argparse type: a locust run time (`_seconds`' syntax), checked while parsing and kept as
    text for locust and the messages."""
    _seconds(text)
    return text


def positive_run_time(text: str) -> str:
    """`run_time` above zero: a run of no time measures nothing."""
    if _seconds(text) <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r}: must be above 0")
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM of a process in bytes (Linux)."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"server not ready after {timeout:.0f}s: {url}")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cluster_file(out: Path, nodes: int, gpus: int, occupancy: float, seed: int) -> Path:
    """The generated cluster for these parameters, written once and reused."""
    path = out / f"cluster-{nodes}n-{gpus}g-{occupancy:g}-s{seed}.json"
    if not path.exists() or not nodes_file(path).exists():
        t = time.monotonic()
        node_objs, pods = generate(nodes, gpus, occupancy, seed)
        write_cluster(
            path,
            node_objs,
            pods,
            {"nodes_requested": nodes, "gpus": gpus, "occupancy": occupancy, "seed": seed},
        )
        print(
            f"generated {path.name}: {len(node_objs)} nodes, {len(pods)} running pods ({time.monotonic() - t:.1f}s)",
            flush=True,
        )
    return path


def run_locust(
    name: str, port: int, args: argparse.Namespace, sidecar: Path, out: Path, server_pid: int
) -> dict[str, Any]:
    raw = out / f"{name}.raw"
    for old in out.glob(f"{name}.raw.*.json"):
        old.unlink()
    env = dict(
        os.environ,
        LOADTEST_NODES_FILE=str(sidecar),
        LOADTEST_RAW=str(raw),
        LOADTEST_RATE=str(args.rate),
        LOADTEST_WARMUP=str(args.warmup),
        LOADTEST_CHURN=str(getattr(args, "churn", 0)),
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        "-u",
        str(args.users),
        "-r",
        str(args.users),
        "-t",
        f"{int(args.duration_s)}s",
        "--stop-timeout",
        "5",
        "-H",
        f"http://127.0.0.1:{port}",
        "--csv",
        str(out / name),
        "--html",
        str(out / f"{name}.html"),
        "--exit-code-on-error",
        "0",
        "--loglevel",
        "WARNING",
    ]
    if args.processes > 1:
        cmd += ["--processes", str(args.processes)]
    log = (out / f"{name}.locust.log").open("wb")
    server_cpu, locust_cpu = _cpu_seconds(server_pid), _children_cpu()
    code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server_cpu, locust_cpu = _cpu_seconds(server_pid) - server_cpu, _children_cpu() - locust_cpu
    log.close()
    if code != 0:
        raise SystemExit(f"locust exited with {code}: see {out / f'{name}.locust.log'}")
    result = _merge_raw(out, name, args)
    cycles = result["counts"].get("cycles", 0)
    # CPU per cycle holds on a busy machine where wall-clock latency does not (whole run, warm-up included)
    result["cpu_s"] = {"server": round(server_cpu, 2), "locust": round(locust_cpu, 2)}
    result["server_cpu_ms_per_cycle"] = (
        round(server_cpu * 1000 / result["cycles_total"], 3) if cycles else 0.0
    )
    result["locust_cpu_ms_per_cycle"] = (
        round(locust_cpu * 1000 / result["cycles_total"], 3) if cycles else 0.0
    )
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q * len(v))) - 1))]


def _merge_raw(out: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    lat: dict[str, list[float]] = {v: [] for v in (*VERBS, "cycle")}
    counts: dict[str, int] = {}
    spans = []
    total_cycles = 0
    for f in sorted(out.glob(f"{name}.raw.*.json")):
        d = orjson.loads(f.read_bytes())
        for k, v in d["latency_ms"].items():
            lat.setdefault(k, []).extend(v)
        for k, v in d["counts"].items():
            counts[k] = counts.get(k, 0) + v
        spans.append(d["span_s"])
        total_cycles += d.get("cycles_total", 0)
    span = max(spans) if spans else 0.0
    verbs = {
        v: {
            "count": len(lat[v]),
            "p50_ms": round(_pct(lat[v], 0.50), 3),
            "p95_ms": round(_pct(lat[v], 0.95), 3),
            "p99_ms": round(_pct(lat[v], 0.99), 3),
        }
        for v in (*VERBS, "cycle")
    }
    # The locustfile counts every failure itself; locust's CSV also has failures raised inside its
    # client, but it is rewritten once a second and not at exit (locust 2.47), so it misses the last
    # second of the run. Each undercounts in its own way: the larger is the count.
    failures = max(_csv_failures(out / f"{name}_stats.csv"), counts.get("failures", 0))
    return {
        "cycles_per_s": round(counts.get("cycles", 0) / span, 1) if span else 0.0,
        "failures": failures,
        "counts": counts,
        "verbs": verbs,
        "measured_s": round(span, 1),
        "cycles_total": total_cycles,
    }


def _planner_counters(port: int) -> dict[str, float] | None:
    """The server's `vramsched_planner_*` metrics (plans made, binds handed a plan, ...), or None."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        if line.startswith("vramsched_planner_"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("vramsched_planner_")] = float(value)
    return out or None


def _csv_failures(path: Path) -> int:
    """Failure count of the Aggregated row of locust's stats CSV."""
    import csv

    with path.open() as f:
        for row in csv.DictReader(f):
            if row.get("Name") == "Aggregated":
                return int(row["Failure Count"])
    raise SystemExit(f"no Aggregated row in {path}")


def start_server(cluster: Path, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    """`vramsched serve --cluster` as the load test runs it (planner and replica policy from
    `args`)."""
    # --no-legacy-failed-nodes: the scenario is today's kube-scheduler (deploy/ runs 1.34), which
    # reads FailedAndUnresolvableNodes; only < 1.21 needs those nodes in FailedNodes again.
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extender",
            "serve",
            "--cluster",
            str(cluster),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-legacy-failed-nodes",
            "--planner" if args.planner else "--no-planner",
            *(["--replica-policy", args.replica_policy] if args.replica_policy else []),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=whole(at_least=1), default=5000)
    p.add_argument("--gpus", type=whole(at_least=1, at_most=MAX_GPUS), default=8)
    p.add_argument("--occupancy", type=number(at_least=0, at_most=1), default=0.6)
    p.add_argument("--seed", type=whole(at_least=0), default=1)
    p.add_argument(
        "--duration",
        type=positive_run_time,
        default="60s",
        help="locust run time per target (default 60s)",
    )
    p.add_argument(
        "--users",
        type=whole(at_least=1),
        default=4,
        help="concurrent scheduling loops (default 4)",
    )
    p.add_argument(
        "--rate",
        type=number(at_least=0),
        default=0.0,
        help="cycles/s per user; 0 = back to back (default)",
    )
    p.add_argument(
        "--processes",
        type=whole(at_least=1),
        default=1,
        help="locust worker processes (default 1)",
    )
    p.add_argument(
        "--warmup",
        type=number(at_least=0),
        default=3.0,
        help="seconds at the start left out of the figures",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the floor run (no ratio)")
    p.add_argument(
        "--replica-policy",
        choices=[p.value for p in ReplicaPolicy],
        default=None,
        help="serve with the device plugin's replica policy, as live mode does (default: none)",
    )
    p.add_argument(
        "--planner",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve with the background CP-SAT planner (default on, as `vramsched serve`)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.duration_s = _seconds(args.duration)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()

    cluster = cluster_file(out, args.nodes, args.gpus, args.occupancy, args.seed)
    sidecar = nodes_file(cluster)
    meta = orjson.loads(sidecar.read_bytes())

    port = _free_port()
    server = start_server(cluster, port, args, out / "vramsched.server.log")
    try:
        startup = _wait_ready(f"http://127.0.0.1:{port}/readyz", server, timeout=120)
        startup_cpu = _cpu_seconds(
            server.pid
        )  # holds on a busy machine, where the wall clock does not
        rss_ready = _proc_status(server.pid).get("VmRSS", 0)
        print(
            f"vramsched ready in {startup:.2f}s (RSS {rss_ready / 2**20:.0f} MiB); locust {args.duration} ...",
            flush=True,
        )
        ours = run_locust("vramsched", port, args, sidecar, out, server.pid)
        status = _proc_status(server.pid)
        planner_counters = _planner_counters(port) if args.planner else None
    finally:
        stop_process(server)
    floor = None
    if not args.no_floor:
        fport = _free_port()
        fproc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.floor", "--port", str(fport)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=(out / "floor.server.log").open("wb"),
        )
        try:
            _wait_ready(f"http://127.0.0.1:{fport}/readyz", fproc, timeout=30)
            print(f"floor ready; locust {args.duration} ...", flush=True)
            floor = run_locust("floor", fport, args, sidecar, out, fproc.pid)
        finally:
            stop_process(fproc)

    ratios = {}
    if floor:
        for v in VERBS + ("cycle",):
            f99 = floor["verbs"][v]["p99_ms"]
            if f99 and ours["verbs"][v]["count"]:
                ratios[v] = round(ours["verbs"][v]["p99_ms"] / f99, 2)
    summary = {
        "nodes": len(meta["nodes"]),
        "cycles_per_s": ours["cycles_per_s"],
        "failures": ours["failures"],
        "rss_bytes": status.get("VmHWM", status.get("VmRSS", 0)),
        # p99 of a whole cycle (filter + prioritize + bind) over the floor's, same scenario and load
        "floor_ratio": ratios.get("cycle", 0.0),
        "verbs": {
            v: {k: ours["verbs"][v][k] for k in ("p50_ms", "p95_ms", "p99_ms")} for v in VERBS
        },
        "startup_s": round(startup, 2),
        "startup_cpu_s": round(startup_cpu, 2),
        "pods_at_start": meta["pods"],
        "gpus_per_node": args.gpus,
        "users": args.users,
        "planner": args.planner,
        "replica_policy": args.replica_policy,
        "rate_per_user": args.rate,
        "locust_processes": args.processes,
        "duration_s": args.duration_s,
        "measured_s": ours["measured_s"],
        "counts": ours["counts"],
        # what the background planner did in the run (its /metrics counters at the end)
        "planner_counters": planner_counters,
        "cycle_ms": {k: ours["verbs"]["cycle"][k] for k in ("p50_ms", "p95_ms", "p99_ms")},
        "floor": floor
        and {
            "cycles_per_s": floor["cycles_per_s"],
            "failures": floor["failures"],
            "verbs": {
                v: {k: floor["verbs"][v][k] for k in ("p50_ms", "p95_ms", "p99_ms")}
                for v in (*VERBS, "cycle")
            },
        },
        "floor_ratio_p99": ratios,
        "cpu_ms_per_cycle": {
            "server": ours["server_cpu_ms_per_cycle"],
            "locust": ours["locust_cpu_ms_per_cycle"],
            "floor_server": floor["server_cpu_ms_per_cycle"] if floor else None,
        },
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "results": os.path.relpath(out, ROOT) if out.resolve().is_relative_to(ROOT) else str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(render(summary))
    return 0


def render(s: dict[str, Any]) -> str:
    lines = [
        f"vramsched load test: {s['nodes']} nodes x {s['gpus_per_node']} GPUs, {s['pods_at_start']} pods at start, "
        f"{s['users']} users, {s['duration_s']:.0f}s ({s['measured_s']:.0f}s measured after warm-up)",
        f"  start-up {s['startup_s']:.2f}s ({s['startup_cpu_s']:.2f}s CPU)   server RSS peak {s['rss_bytes'] / 2**20:.0f} MiB   "
        f"load avg before/after {s['loadavg_before'][0]}/{s['loadavg_after'][0]} on {s['cpus']} CPUs",
        f"  cycles/s {s['cycles_per_s']:.1f}   failures {s['failures']}   bound {s['counts'].get('bound', 0)}   "
        f"lost races {s['counts'].get('races', 0)} (retried {s['counts'].get('retries', 0)})   "
        f"unschedulable {s['counts'].get('unschedulable', 0)}",
        f"  {'verb':<11}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"
        + (f"{'floor p99':>11}{'ratio':>7}" if s["floor"] else ""),
    ]
    for v in (*VERBS, "cycle"):
        row = s["verbs"].get(v) or s["cycle_ms"]
        line = f"  {v:<11}{row['p50_ms']:>9.2f}{row['p95_ms']:>9.2f}{row['p99_ms']:>9.2f}"
        if s["floor"]:
            line += (
                f"{s['floor']['verbs'][v]['p99_ms']:>11.2f}{s['floor_ratio_p99'].get(v, 0):>7.2f}"
            )
        lines.append(line)
    if s["floor"]:
        lines.append(
            f"  floor: {s['floor']['cycles_per_s']:.1f} cycles/s; floor_ratio (cycle p99) {s['floor_ratio']:.2f}"
        )
    p = s.get("planner_counters")
    if p:
        lines.append(
            f"  planner: {p.get('plans_total', 0):.0f} plans, {p.get('bind_hits_total', 0):.0f} binds handed a "
            f"planned reservation ({p.get('bind_refused_total', 0):.0f} not taken), "
            f"{p.get('stale_entries_total', 0):.0f} stale entries, {p.get('errors_total', 0):.0f} errors"
        )
    c = s["cpu_ms_per_cycle"]
    lines.append(
        f"  CPU ms per cycle: server {c['server']:.2f}, locust {c['locust']:.2f}"
        + (f", floor server {c['floor_server']:.2f}" if c.get("floor_server") is not None else "")
    )
    lines.append(f"  results: {s['results']} (summary.json, *_stats.csv, *.html)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
