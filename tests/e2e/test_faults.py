"""Faults with the real control plane: the API server stopped during binds, watch connections
dropped, the extender SIGKILLed under locust load, concurrent binds racing in live mode.

After every fault the same three things are proven on the API's own state:

- nothing double-booked: the ledger rebuilt from the API's pods holds the invariant
  (`assert_sound`, which also requires every bound GPU pod to carry its assignment);
- nothing lost: every pod that fits is bound, each exactly once, the others wait with our reason;
- the extender that lived through the fault has the ledger a freshly started one derives
  from the API (their `/state` are equal).

Helpers and the `stack` fixture (extender + kube-scheduler running the deploy config) come from
test_extender_e2e.py; the control plane from conftest.py.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml
from controlplane import REPO_ROOT, ControlPlane
from test_extender_e2e import (  # noqa: F401 - fixtures are used by name
    NS,
    Extender,
    _grant_extender_rbac,
    add_node,
    assert_sound,
    core,
    extender_args,
    gpu_pod,
    stack,
    start_shipped_scheduler,
    wait_bound,
)

from extender.inventory import ReplicaPolicy

GIB = 1024**3


# ----- helpers ------------------------------------------------------------------------------------


def held(ext: Extender) -> set[str]:
    return {p for n in ext.get("/state")["nodes"] for g in n["gpus"] for p in g["pods"]}


def bound_names(api: kubernetes.client.CoreV1Api, names: list[str]) -> dict[str, str]:
    return {n: api.read_namespaced_pod(n, NS).spec.node_name for n in names}


def nudge(api: kubernetes.client.CoreV1Api, node: str) -> None:
    """A node event sends pods parked after an extender error back to the scheduling queue at once."""
    api.patch_node(node, {"metadata": {"labels": {"e2e/nudge": str(time.monotonic_ns())}}})


def settle(
    cp: ControlPlane,
    api: kubernetes.client.CoreV1Api,
    names: list[str],
    expect: int,
    nodes: list[str],
    ext: Extender,
    timeout: float = 150,
) -> dict[str, str]:
    """Wait until exactly `expect` of `names` are bound (nudging now and then), and return them."""
    deadline = time.monotonic() + timeout
    last_nudge = 0.0
    while True:
        got = bound_names(api, names)
        if sum(1 for v in got.values() if v) == expect:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{sum(1 for v in got.values() if v)}/{expect} bound: {got}\n{ext.describe()}"
            )
        if time.monotonic() - last_nudge > 10:
            nudge(api, nodes[0])
            last_nudge = time.monotonic()
        time.sleep(0.5)


def fresh_state_equals(cp: ControlPlane, survivor: Extender, pods: int) -> dict[str, Any]:
    """Start a second, fresh extender on the same API; its /state must equal the survivor's."""
    fresh = Extender(cp, _grant_extender_rbac(cp), [])
    fresh.start()
    try:
        cp.wait_for(
            lambda: (
                (fresh.get("/readyz") or {}).get("ready")
                and fresh.get("/state")["nodes"] == survivor.get("/state")["nodes"]
            ),
            timeout=30,
            message=f"fresh extender agrees with the survivor\n{json.dumps(fresh.get('/state'))[:2000]}\n"
            f"{json.dumps(survivor.get('/state'))[:2000]}",
        )
        state = fresh.get("/state")
        assert sum(len(g["pods"]) for n in state["nodes"] for g in n["gpus"]) == pods
        return state
    finally:
        fresh.stop()


def check_outcome(
    cp: ControlPlane, api: kubernetes.client.CoreV1Api, ext: Extender, got: dict[str, str]
) -> None:
    """Each bound pod holds exactly one reservation where it is bound; the rest are refused by us."""
    state = assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    bound = {f"{NS}/{n}" for n, v in got.items() if v}
    assert {r.key for r in state.ledger.reservations()} == bound == held(ext)
    for res in state.ledger.reservations():
        assert res.node == got[res.key.split("/", 1)[1]]
    for name in (n for n, v in got.items() if not v):
        pod = api.api_client.sanitize_for_serialization(api.read_namespaced_pod(name, NS))
        answer = ext.post(
            "/filter",
            {
                "Pod": pod,
                "Nodes": None,
                "NodeNames": sorted({n.metadata.name for n in api.list_node().items}),
            },
        )
        assert answer["NodeNames"] == [] and answer["FailedNodes"], answer
        assert all("30Gi" in reason for reason in answer["FailedNodes"].values()), answer


def two_time_sliced_nodes(cp: ControlPlane) -> list[str]:
    """2 nodes x 4 A100 80GB x 4 replicas: exactly 16 pods of 30Gi fit (2 per GPU whatever the plugin does)."""
    names = ["ts-0", "ts-1"]
    for n in names:
        add_node(cp, n, "NVIDIA-A100-SXM4-80GB", count=4, memory_mib=81920, replicas=4)
    return names


# ----- API server down -------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("extender_args", [["--assume-ttl", "15"]])
def test_apiserver_stopped_and_restarted_during_binds(
    stack: tuple[ControlPlane, Extender], extender_args: list[str]
) -> None:
    """20 pods for 16 places; the API server is killed while they are being bound and comes back
    5 s later: 16 bound exactly once with their annotations, 4 waiting with our reason."""
    cp, ext = stack
    nodes = two_time_sliced_nodes(cp)
    api = core(cp)
    names = [f"api-{i:02d}" for i in range(20)]
    for name in names[:12]:
        api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))
    cp.wait_for(
        lambda: any(bound_names(api, names[:12]).values()),
        timeout=60,
        interval=0.05,
        message="binding under way",
    )
    cp.stop_apiserver()
    time.sleep(5)
    cp.start_apiserver()
    api = core(cp)
    for name in names[12:]:
        api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))
    got = settle(cp, api, names, 16, nodes, ext)
    check_outcome(cp, api, ext, got)
    fresh_state_equals(cp, ext, 16)


@pytest.mark.e2e
def test_filter_answers_from_the_last_view_while_the_api_is_down_and_readyz_says_so(
    stack: tuple[ControlPlane, Extender],
) -> None:
    cp, ext = stack
    cp.stop_scheduler()  # this test is the scheduler
    add_node(cp, "h100", "NVIDIA-H100-80GB-HBM3", count=2, memory_mib=81559)
    api = core(cp)
    api.create_namespaced_pod(NS, gpu_pod("down-0", "40Gi"))
    cp.wait_for(
        lambda: (ext.get("/readyz") or {}).get("pods", 0) >= 1, timeout=30, message="pod seen"
    )
    pod = api.api_client.sanitize_for_serialization(api.read_namespaced_pod("down-0", NS))
    body = {"Pod": pod, "Nodes": None, "NodeNames": ["h100"]}
    before = ext.post("/filter", body)
    assert before["NodeNames"] == ["h100"]
    ready = cp.wait_for(
        lambda: (r := ext.get("/readyz")) and r["apiServer"] == "connected" and r,
        timeout=30,
        message=f"/readyz connected: {ext.get('/readyz')}",
    )
    assert ready["ready"] is True

    def ledger_view() -> dict:  # /state without the planner's counters, which move on their own
        return {k: v for k, v in ext.get("/state").items() if k != "planner"}

    state_before = ledger_view()

    cp.stop_apiserver()
    try:
        down = cp.wait_for(
            lambda: (r := ext.get("/readyz")) and r["apiServer"] == "unreachable" and r,
            timeout=30,
            message="/readyz reports the API server unreachable",
        )
        assert down["ready"] is True  # still serving from the last consistent view
        assert (
            down["informers"]["pods"]["connected"] is False
            and down["informers"]["pods"]["lastError"]
        )
        time.sleep(1.5)
        down = ext.get("/readyz")
        assert down["staleForS"] >= 1.0
        assert ext.post("/filter", body) == before
        scores = ext.post("/prioritize", body)
        assert [h["Host"] for h in scores] == ["h100"] and 0 <= scores[0]["Score"] <= 10
        # a bind cannot be written now: refused, and the ledger keeps nothing for it
        answer = ext.post(
            "/bind",
            {
                "PodName": "down-0",
                "PodNamespace": NS,
                "PodUID": pod["metadata"]["uid"],
                "Node": "h100",
            },
        )
        assert answer["Error"]
        assert ledger_view() == state_before
    finally:
        cp.start_apiserver()
    cp.wait_for(
        lambda: (ext.get("/readyz") or {}).get("apiServer") == "connected",
        timeout=60,
        message="/readyz reports the API server back",
    )
    assert ext.get("/readyz")["staleForS"] == 0.0
    assert ext.post(
        "/bind",
        {"PodName": "down-0", "PodNamespace": NS, "PodUID": pod["metadata"]["uid"], "Node": "h100"},
    ) == {"Error": ""}
    wait_bound(cp, api, ["down-0"])
    assert_sound(api, ReplicaPolicy.DISTRIBUTED)


# ----- dropped watch connections ---------------------------------------------------------------------


class Proxy:
    """A TCP relay in front of the API server whose connections the test can cut at will."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.lock = threading.Lock()
        self.closed = False
        self.drops = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def drop(self) -> int:
        """Cut every open connection (watches included) mid-stream; returns how many."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self.drops += 1
        return len(pairs)

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        self.drop()


@pytest.fixture
def proxied(cluster: ControlPlane) -> Iterator[tuple[ControlPlane, Extender, Proxy]]:
    """The extender talking to the API through a Proxy; kube-scheduler talks to it directly."""
    kubeconfig = _grant_extender_rbac(cluster)
    doc = yaml.safe_load(kubeconfig.read_text())
    server = doc["clusters"][0]["cluster"]["server"]
    proxy = Proxy(int(server.rsplit(":", 1)[1]))
    doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    via_proxy = kubeconfig.with_name("vramsched-via-proxy.kubeconfig")
    via_proxy.write_text(yaml.safe_dump(doc))
    ext = Extender(cluster, via_proxy, [])
    ext.start()
    start_shipped_scheduler(cluster, ext.url)
    try:
        yield cluster, ext, proxy
    finally:
        ext.stop()
        proxy.close()


@pytest.mark.e2e
def test_dropped_watch_connections_resume_without_losing_an_event(
    proxied: tuple[ControlPlane, Extender, Proxy],
) -> None:
    """Binds, deletions and new pods happen while the extender's connections are cut again and
    again; its informers resume and its ledger ends equal to the API's."""
    cp, ext, proxy = proxied
    nodes = two_time_sliced_nodes(cp)
    api = core(cp)
    names = [f"drop-{i:02d}" for i in range(12)]
    for name in names[:8]:
        api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))
    wait_bound(cp, api, names[:8], timeout=90)
    cut = 0
    for round_ in range(3):
        cut += proxy.drop()
        # changes while the watches are down: a pod finishes, one is deleted, new ones come
        api.patch_namespaced_pod_status(names[round_], NS, {"status": {"phase": "Succeeded"}})
        api.delete_namespaced_pod(names[round_ + 4], NS, grace_period_seconds=0)
        api.create_namespaced_pod(NS, gpu_pod(names[8 + round_], "30Gi"))
        time.sleep(1.0)
    cut += proxy.drop()
    api.create_namespaced_pod(NS, gpu_pod(names[11], "30Gi"))
    alive = [n for i, n in enumerate(names) if i not in (0, 1, 2, 4, 5, 6)]
    got = settle(cp, api, alive, len(alive), nodes, ext)
    assert cut >= 4  # the watches (and the binder's keep-alive connections) really were cut
    expected = {f"{NS}/{n}" for n in alive}
    cp.wait_for(
        lambda: held(ext) == expected,
        timeout=60,
        message=f"ledger caught up: {held(ext)} vs {expected}",
    )
    ready = cp.wait_for(
        lambda: (r := ext.get("/readyz")) and r["apiServer"] == "connected" and r,
        timeout=60,
        message=f"informers reconnected: {ext.get('/readyz')}",
    )
    resumed = {
        k: v["watchResumes"] + v["relistsGone"] + v["lists"] - 1
        for k, v in ready["informers"].items()
    }
    assert all(n >= 1 for n in resumed.values()), ready
    state = assert_sound(api, ReplicaPolicy.DISTRIBUTED)
    assert {r.key for r in state.ledger.reservations()} == expected
    assert all(got[n] for n in alive)
    fresh_state_equals(cp, ext, len(alive))


# ----- SIGKILL under load ----------------------------------------------------------------------------

LOCUSTFILE = """
import json, os
from locust import FastHttpUser, constant_throughput, task

NODES = json.loads(os.environ["FAULT_NODES"])
POD = {"metadata": {"name": "load", "namespace": "load", "uid": "load",
                    "annotations": {"vramsched.io/model-memory": "30Gi"}},
       "spec": {"schedulerName": "vramsched",
                "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
BODY = json.dumps({"Pod": POD, "Nodes": None, "NodeNames": NODES})

class Scheduler(FastHttpUser):
    wait_time = constant_throughput(float(os.environ.get("FAULT_RATE", "15")))
    network_timeout = 5.0
    connection_timeout = 5.0

    @task
    def filter_and_prioritize(self):
        headers = {"Content-Type": "application/json"}
        self.client.post("/filter", data=BODY, headers=headers, name="filter")
        self.client.post("/prioritize", data=BODY, headers=headers, name="prioritize")
"""


class Locust:
    """locust headless against the extender (filter + prioritize: the load kube-scheduler's
    own cycles add to), running until stopped; its request counts land in a CSV."""

    def __init__(self, tmp: Path, url: str, nodes: list[str]) -> None:
        self.tmp = tmp
        (tmp / "faults_locustfile.py").write_text(LOCUSTFILE)
        env = dict(os.environ, FAULT_NODES=json.dumps(nodes))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(tmp / "faults_locustfile.py"),
                "--headless",
                "-u",
                "4",
                "-r",
                "4",
                "-t",
                "600s",
                "-H",
                url,
                "--csv",
                str(tmp / "load"),
                "--only-summary",
                "--loglevel",
                "ERROR",
                "--exit-code-on-error",
                "0",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp / "locust.log").open("wb"),
        )

    def stop(self) -> dict[str, int]:
        self.proc.send_signal(2)  # SIGINT: locust writes its CSV and exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        import csv

        path = self.tmp / "load_stats.csv"
        if not path.exists():
            return {"requests": 0, "failures": 0}
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("Name") == "Aggregated":
                    return {
                        "requests": int(row["Request Count"]),
                        "failures": int(row["Failure Count"]),
                    }
        return {"requests": 0, "failures": 0}


@pytest.mark.e2e
def test_sigkill_under_locust_load_three_times_loses_nothing(
    stack: tuple[ControlPlane, Extender], tmp_path: Path
) -> None:
    """The extender is SIGKILLed three times while kube-scheduler binds and locust adds load, and
    restarted on the same port each time: 16 of 22 pods bound exactly once with annotations,
    the rest refused for lack of room, and the ledger equals a fresh extender's."""
    cp, ext = stack
    nodes = two_time_sliced_nodes(cp)
    api = core(cp)
    load = Locust(tmp_path, ext.url, nodes)
    names = [f"kill-{i:02d}" for i in range(22)]
    batches = [names[0:6], names[6:12], names[12:18], names[18:22]]
    restarts = 0
    try:
        for name in batches[0]:
            api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))
        for batch, more in zip(batches, batches[1:]):
            # kill while this batch is being bound (or, once the GPUs are full, refused)
            cp.wait_for(
                lambda: (
                    any(v for v in bound_names(api, batch).values())
                    or sum(1 for v in bound_names(api, names).values() if v) >= 16
                ),
                timeout=60,
                interval=0.05,
                message=f"binding of {batch} under way",
            )
            ext.kill9()
            for name in more:  # created while the extender is down
                api.create_namespaced_pod(NS, gpu_pod(name, "30Gi"))
            ext.start()
            restarts += 1
            nudge(api, nodes[0])
        got = settle(cp, api, names, 16, nodes, ext, timeout=180)
    finally:
        stats = load.stop()
    assert restarts == 3
    assert stats["requests"] > 100, stats  # the load was there
    check_outcome(cp, api, ext, got)
    for name, node in got.items():
        if node:
            ann = api.read_namespaced_pod(name, NS).metadata.annotations or {}
            assert json.loads(ann["vramsched.io/assignment"])["node"] == node
    fresh_state_equals(cp, ext, 16)


# ----- live-mode concurrent binds ------------------------------------------------------------------


@pytest.mark.e2e
def test_live_concurrent_binds_for_the_same_gpus(cluster: ControlPlane) -> None:
    """No scheduler: the test sends 3 concurrent binds per pod (to both nodes) for 24 pods that
    compete for 16 places, interleaved with filters and a node label change. Each pod is bound at
    most once, every success is a real Binding, and nothing is double-booked."""
    cp = cluster
    ext = Extender(cp, _grant_extender_rbac(cp), [])
    ext.start()
    try:
        nodes = two_time_sliced_nodes(cp)
        api = core(cp)
        names = [f"race-{i:02d}" for i in range(24)]
        uids = {}
        for name in names:
            uids[name] = api.create_namespaced_pod(NS, gpu_pod(name, "30Gi")).metadata.uid
        cp.wait_for(
            lambda: (ext.get("/readyz") or {}).get("pods", 0) >= len(names),
            timeout=30,
            message="pods seen",
        )
        pod_json = {
            n: api.api_client.sanitize_for_serialization(api.read_namespaced_pod(n, NS))
            for n in names
        }

        def bind(name: str, node: str) -> tuple[str, str, str]:
            body = {"PodName": name, "PodNamespace": NS, "PodUID": uids[name], "Node": node}
            return name, node, ext.post("/bind", body)["Error"]

        def filt(name: str) -> None:
            ext.post("/filter", {"Pod": pod_json[name], "Nodes": None, "NodeNames": nodes})

        jobs = [(bind, (n, nodes[(i + k) % 2])) for i, n in enumerate(names) for k in range(3)]
        jobs += [(filt, (n,)) for n in names]
        jobs.append((lambda: nudge(api, nodes[1]), ()))
        random.Random(3).shuffle(jobs)
        with ThreadPoolExecutor(max_workers=12) as pool:
            results = [f.result() for f in [pool.submit(fn, *args) for fn, args in jobs]]
        wins: dict[str, set[str]] = {}
        for r in results:
            if isinstance(r, tuple) and not r[2]:
                wins.setdefault(r[0], set()).add(r[1])
        assert all(len(v) == 1 for v in wins.values()), wins
        got = bound_names(api, names)
        assert {n: v for n, v in got.items() if v} == {n: next(iter(v)) for n, v in wins.items()}
        assert len(wins) == 16  # exactly the room there is: no pod lost to a race either
        cp.wait_for(
            lambda: held(ext) == {f"{NS}/{n}" for n in wins}, timeout=30, message="ledger confirmed"
        )
        check_outcome(cp, api, ext, got)
        fresh_state_equals(cp, ext, 16)
    finally:
        ext.stop()
