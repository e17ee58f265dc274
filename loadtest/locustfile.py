"""Locust scenario: kube-scheduler's scheduling cycle against a scheduler extender.

One task = one cycle as kube-scheduler runs it with `nodeCacheCapable: true` and
`percentageOfNodesToScore: 100`: POST /filter with every node name, POST /prioritize with
the survivors (skipped when only one survives, as kube-scheduler does), POST /bind to the
best-scored node (ties broken at random, standing in for the in-tree scores).

A request fails when the answer is not what kube-scheduler could use: non-200, malformed
JSON, a key missing or of the wrong type, a node that was not sent, a node reported twice, a
refused node left unexplained (reasons are all or nothing, and nothing only when some node
passes: kube-scheduler reads them only when none does), a score outside 0..10, a filter `Error` for a well-formed pod, or a bind `Error`
other than losing a race. Losing a race (another user took the GPU between our filter and
our bind) is a legitimate outcome: it is counted apart, as "bind lost a race", and the pod is
scheduled again after kube-scheduler's backoff (1 s, doubling up to 10 s), as kube-scheduler
requeues a pod whose binding failed; meanwhile it waits, so the background planner plans it.

Environment:
  LOADTEST_NODES_FILE  the `<cluster>.nodes.json` sidecar of gen_cluster (node names)
  LOADTEST_RATE        cycles/s per user (0 or unset: back to back, like a busy scheduler)
  LOADTEST_SEED        pod mix seed (default 7)
  LOADTEST_WARMUP      seconds at the start not counted in the latency file (default 2)
  LOADTEST_RAW         path prefix for exact per-request latencies (`<prefix>.<pid>.json`)
  LOADTEST_CHURN       pods each user keeps bound (0 or unset: no deletions); beyond that the
                       oldest one it bound is deleted (embedded mode's DELETE /pods/{ns}/{name}),
                       after the cycle and outside its timing: pods leave as they arrive (the soak)
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
import time
from collections import deque
from pathlib import Path

import orjson
from locust import FastHttpUser, constant, constant_throughput, events, task

from loadtest.checks import Checks, check_bind
from loadtest.pods import make_pod

_JSON_HEADERS = {"Content-Type": "application/json"}


def _load_names() -> list[str]:
    path = os.environ.get("LOADTEST_NODES_FILE")
    if not path:
        raise SystemExit(
            "set LOADTEST_NODES_FILE to the .nodes.json sidecar written by loadtest.gen_cluster"
        )
    return list(orjson.loads(Path(path).read_bytes())["nodes"])


NAMES = _load_names()
CHECKS = Checks(NAMES)
NAMES_JSON = orjson.dumps(NAMES)
RATE = float(os.environ.get("LOADTEST_RATE") or 0)
CHURN = int(os.environ.get("LOADTEST_CHURN") or 0)
WARMUP = float(os.environ.get("LOADTEST_WARMUP") or 2)
_seeds = random.Random(int(os.environ.get("LOADTEST_SEED") or 7) + os.getpid())
READ_BLOCK = 256 * 1024  # bytes per socket read of an answer
#: kube-scheduler's defaults (podInitialBackoffSeconds, podMaxBackoffSeconds) for a pod whose bind failed
BACKOFF_INITIAL_S, BACKOFF_MAX_S = 1.0, 10.0


class _Raw:
    """Exact latencies (ms) per verb after the warm-up, and outcome counts, for the summary:
    locust's own percentiles are rounded to whole milliseconds below 100 ms."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.lat: dict[str, list[float]] = {
            "filter": [],
            "prioritize": [],
            "bind": [],
            "cycle": [],
            "delete": [],
        }
        self.counts = {
            "cycles": 0,
            "bound": 0,
            "races": 0,
            "retries": 0,
            "unschedulable": 0,
            "failures": 0,
            "deleted": 0,
        }
        self.first = self.last = None
        self.cycles_total = 0  # warm-up included, for CPU per cycle

    def counting(self) -> bool:
        return time.monotonic() - self.start >= WARMUP

    def add(self, verb: str, ms: float) -> None:
        if self.counting():
            self.lat[verb].append(ms)

    def fail(self) -> None:
        """A failure counts whenever it happens: the warm-up leaves out latencies, not errors."""
        self.counts["failures"] += 1

    def count(self, what: str) -> None:
        if self.counting():
            now = time.monotonic()
            self.first = self.first or now
            self.last = now
            self.counts[what] += 1

    def dump(self, prefix: str) -> None:
        span = (self.last - self.first) if self.first and self.last else 0.0
        Path(f"{prefix}.{os.getpid()}.json").write_bytes(
            orjson.dumps(
                {
                    "latency_ms": self.lat,
                    "counts": self.counts,
                    "span_s": span,
                    "cycles_total": self.cycles_total,
                }
            )
        )


RAW = _Raw()


@events.test_start.add_listener
def _reset(**_kw) -> None:
    global RAW
    RAW = _Raw()


@events.quitting.add_listener
def _dump(**_kw) -> None:
    prefix = os.environ.get("LOADTEST_RAW")
    if prefix:
        RAW.dump(prefix)


class SchedulerUser(FastHttpUser):
    """One kube-scheduler scheduling loop (cycles are serialized per scheduler)."""

    wait_time = constant_throughput(RATE) if RATE > 0 else constant(0)
    network_timeout = 10.0
    connection_timeout = 10.0

    def __init__(self, environment) -> None:
        super().__init__(environment)
        # geventhttpclient reads an answer in 4 KiB blocks by default (each a recv and a parser
        # feed in Python): ~75 of them for a 300 KB filter answer. Its clients are made on first
        # use from these arguments (FastHttpUser has no setting for it).
        self.client.client.clientpool.client_args["block_size"] = READ_BLOCK
        # kube-scheduler's Go HTTP client keeps no cookies (http.Client.Jar is nil), and vramsched
        # sets none: no jar, so no per-request cookie header and no per-answer cookie scan.
        self.client.client.cookiejar = None

    def on_start(self) -> None:
        self.rng = random.Random(_seeds.getrandbits(64))
        self.tag = f"{os.getpid():x}-{self.rng.getrandbits(32):08x}"
        self.n = 0
        self.bound: deque[str] = (
            deque()
        )  # names of the pods this user bound, oldest first (LOADTEST_CHURN)
        #: pods that lost a bind race, by when they are due again: (due, tie, attempts, pod)
        self.backoff: list[tuple[float, int, int, dict]] = []
        self._seq = itertools.count()

    def _post(self, verb: str, body: bytes):
        return self.client.post(
            f"/{verb}", data=body, headers=_JSON_HEADERS, catch_response=True, name=verb
        )

    @task
    def cycle(self) -> None:
        try:
            self._cycle()
        except Exception:
            RAW.fail()  # a cycle that raised (locust logs it under exceptions) failed too
            raise

    def _cycle(self) -> None:
        if self.backoff and self.backoff[0][0] <= time.monotonic():
            _, _, attempts, pod = heapq.heappop(self.backoff)  # a pod whose bind lost a race, again
            RAW.count("retries")
        else:
            self.n += 1
            attempts, pod = 0, make_pod(self.rng, f"lt-{self.tag}-{self.n}")
        pod_json = orjson.dumps(pod)
        started = time.perf_counter()
        feasible = self._filter(pod_json)
        if feasible is None:
            return
        if not feasible:
            RAW.count("unschedulable")
            self._cycle_done(started)
            return
        best = feasible[0] if len(feasible) == 1 else self._prioritize(pod_json, feasible)
        if best is None:
            return
        outcome = self._bind(pod, best)
        self._cycle_done(started)
        bound = outcome == "bound"
        if outcome == "race":
            delay = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2**attempts)
            heapq.heappush(
                self.backoff, (time.monotonic() + delay, next(self._seq), attempts + 1, pod)
            )
        if CHURN and bound:
            self.bound.append(pod["metadata"]["name"])
            if len(self.bound) > CHURN:
                self._delete(self.bound.popleft())

    def _cycle_done(self, started: float) -> None:
        ms = (time.perf_counter() - started) * 1000
        RAW.cycles_total += 1
        RAW.count("cycles")
        RAW.add("cycle", ms)
        events.request.fire(
            request_type="CYCLE",
            name="cycle",
            response_time=ms,
            response_length=0,
            exception=None,
            context={},
        )

    def _filter(self, pod_json: bytes) -> list[str] | None:
        body = b'{"Pod":' + pod_json + b',"Nodes":null,"NodeNames":' + NAMES_JSON + b"}"
        return self._checked("filter", body, CHECKS.filter)

    def _prioritize(self, pod_json: bytes, feasible: list[str]) -> str | None:
        body = b'{"Pod":' + pod_json + b',"Nodes":null,"NodeNames":' + orjson.dumps(feasible) + b"}"
        return self._checked(
            "prioritize", body, lambda raw: CHECKS.prioritize(raw, feasible, self.rng)
        )

    def _checked(self, verb: str, body: bytes, answer):
        """POST, time it and read the answer with `answer(body bytes) -> (why, value)`: a non-200
        or a `why` is a failure (counted, None returned), else `value`."""
        t = time.perf_counter()
        with self._post(verb, body) as r:
            ms = (time.perf_counter() - t) * 1000
            value = None
            if r.status_code != 200:
                why = f"HTTP {r.status_code}: {(r.text or '')[:200]}"
            else:
                why, value = answer(r.content or b"")
            if why:
                r.failure(why)
                RAW.fail()
                return None
            RAW.add(verb, ms)
            return value

    def _bind(self, pod: dict, node: str) -> str:
        """POST bind: "bound", "race" (lost to another scheduling loop) or "failed"."""
        meta = pod["metadata"]
        body = orjson.dumps(
            {
                "PodName": meta["name"],
                "PodNamespace": meta["namespace"],
                "PodUID": meta["uid"],
                "Node": node,
            }
        )
        t = time.perf_counter()
        with self._post("bind", body) as r:
            ms = (time.perf_counter() - t) * 1000
            if r.status_code != 200:
                why, race = f"HTTP {r.status_code}: {(r.text or '')[:200]}", False
            else:
                why, race = check_bind(r.content or b"")
            if why:
                r.failure(why)
                RAW.fail()
                return "failed"
            if race:
                RAW.count("races")
                events.request.fire(
                    request_type="RACE",
                    name="bind lost a race",
                    response_time=ms,
                    response_length=0,
                    exception=None,
                    context={},
                )
            else:
                RAW.count("bound")
            RAW.add("bind", ms)
            return "race" if race else "bound"

    def _delete(self, name: str) -> None:
        """Delete a pod this user bound: 200 `{"Error": ""}` or it is a failure."""
        t = time.perf_counter()
        with self.client.delete(f"/pods/loadtest/{name}", catch_response=True, name="delete") as r:
            ms = (time.perf_counter() - t) * 1000
            if r.status_code != 200 or (r.content or b"") != b'{"Error":""}':
                r.failure(f"delete of a bound pod: HTTP {r.status_code}: {(r.text or '')[:200]}")
                RAW.fail()
                return
            RAW.count("deleted")
            RAW.add("delete", ms)
