"""The load test's scenario: its failure rules, the floor, and a few seconds of it for real.

Speed is never asserted here (shared 2-core machine): `make loadtest` measures it.
"""

from __future__ import annotations

import csv
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from loadtest.checks import RACE_MARK, Checks, check_bind
from loadtest.floor import create_app as floor_app
from loadtest.gen_cluster import generate, nodes_file, write_cluster
from loadtest.pods import make_pod
from loadtest.run import stop_process

ROOT = Path(__file__).resolve().parent.parent
SENT = frozenset({"a", "b", "c", "d"})
CHECKS = Checks(sorted(SENT))
check_prioritize = CHECKS.prioritize


def answer(**over):
    out = {
        "Nodes": None,
        "NodeNames": ["a", "b"],
        "FailedNodes": {"c": "no GPU with 40Gi free"},
        "FailedAndUnresolvableNodes": {"d": "need 90Gi per GPU, GPUs have 80Gi"},
        "Error": "",
    }
    out.update(over)
    return out


def _filter(out):
    return CHECKS.filter(out if isinstance(out, bytes) else orjson.dumps(out))


def test_filter_rules_accept_a_usable_answer_and_name_every_unusable_one():
    assert _filter(answer()) == (None, ["a", "b"])
    # unresolvable nodes may also be listed in FailedNodes (kube-scheduler < 1.21 compatibility)
    both = {"c": "x", "d": "need 90Gi per GPU, GPUs have 80Gi"}
    assert _filter(answer(FailedNodes=both)) == (None, ["a", "b"])
    # vramsched's default: no reasons while some node passes (kube-scheduler reads none then)
    assert _filter(answer(FailedNodes={}, FailedAndUnresolvableNodes={})) == (None, ["a", "b"])
    assert _filter(answer(NodeNames=[], FailedNodes={"a": "x", "b": "x", "c": "x"})) == (None, [])
    bad = {
        "keys": {k: v for k, v in answer().items() if k != "Error"},
        "extra key": answer(Extra=1),
        "Error": answer(Error="pod default/p: annotation is invalid"),
        "not sent": answer(NodeNames=["a", "b", "zz"]),
        "twice": answer(NodeNames=["a", "b", "c"]),
        "twice in NodeNames": answer(NodeNames=["a", "a", "b"], FailedNodes={}),
        "missing": answer(NodeNames=["a"]),
        "some explained, not all": answer(FailedAndUnresolvableNodes={}),
        "none passes, none explained": answer(
            NodeNames=[], FailedNodes={}, FailedAndUnresolvableNodes={}
        ),
        "none passes, one unexplained": answer(NodeNames=[], FailedNodes={"a": "x", "b": "x"}),
        "empty reason": answer(FailedNodes={"c": ""}),
        "reason type": answer(FailedNodes={"c": 3}),
        "Nodes": answer(Nodes={"items": []}),
        "names type": answer(NodeNames="a,b"),
        "unhashable": answer(NodeNames=[["a"], "b"]),
        "not an object": ["a", "b"],
        "not JSON": b'{"Nodes":null,',
        "empty body": b"",
    }
    for why, out in bad.items():
        reason, feasible = _filter(out)
        assert reason is not None and feasible is None, why
    assert "FailedNodes" in _filter(answer(FailedNodes={"c": ""}))[0]  # msgspec names where
    for out in (
        answer(NodeNames=["a", "b", "zz"]),
        answer(FailedNodes={"zz": "x"}),
        answer(FailedAndUnresolvableNodes={"d": "x", "zz": "x"}),
    ):
        assert "not sent" in _filter(out)[0] and "zz" in _filter(out)[0]


def test_checks_hand_back_the_sent_name_objects():
    """Decoded names are the sent str objects (no fresh strings per answer), for any list size."""
    sent = [f"node-{i:05d}" for i in range(5000)]
    checks = Checks(sent)
    why, feasible = checks.filter(
        orjson.dumps(
            {
                "Nodes": None,
                "NodeNames": sent[:10],
                "FailedNodes": {},
                "FailedAndUnresolvableNodes": dict.fromkeys(sent[10:], "r"),
                "Error": "",
            }
        )
    )
    assert why is None and feasible == sent[:10] and all(a is b for a, b in zip(feasible, sent))
    assert (
        Checks([]).filter(
            orjson.dumps(answer(NodeNames=[], FailedNodes={}, FailedAndUnresolvableNodes={}))
        )[0]
        is None
    )


def test_prioritize_rules_check_range_type_and_hosts_and_pick_a_best_host():
    rng = random.Random(1)
    ok = orjson.dumps(
        [{"Host": "a", "Score": 3}, {"Host": "b", "Score": 10}, {"Host": "c", "Score": 10}]
    )
    seen = set()
    for _ in range(40):
        why, best = check_prioritize(ok, ["a", "b", "c"], rng)
        assert why is None and best in ("b", "c")
        seen.add(best)
    assert seen == {"b", "c"}  # ties are broken at random
    assert check_prioritize(b"[]", ["a", "b"], rng)[0] is None  # no opinion is valid
    for out in (
        [{"Host": "a", "Score": 11}],
        [{"Host": "a", "Score": -1}],
        [{"Host": "a", "Score": "5"}],
        [{"Host": "a", "Score": True}],
        [{"Host": "a", "Score": 2.5}],
        [{"Host": "zz", "Score": 1}],
        [{"Host": "a"}],
        ["a"],
        {"Host": "a", "Score": 1},
        [{"Host": 1, "Score": 1}],
        [{"Host": "a", "Score": 1}, {"Host": "b", "Score": 1}, {"Host": "zz", "Score": 1}],
        [{"Host": "a", "Score": 1}, {"Host": "d", "Score": 1}],
    ):  # "d" was sent to filter, not here
        why, best = check_prioritize(orjson.dumps(out), ["a", "b", "c"], rng)
        assert why is not None and best is None, out
    assert "not sent" in check_prioritize(orjson.dumps([{"Host": "zz", "Score": 1}]), ["a"], rng)[0]
    assert check_prioritize(b"[{", ["a"], rng)[1] is None


def test_bind_rules_count_a_lost_race_apart_and_fail_any_other_error():
    assert check_bind(b'{"Error":""}') == (None, False)
    assert check_bind(orjson.dumps({"Error": f"pod x/y {RACE_MARK} n-1: no GPU"})) == (None, True)
    for raw in (
        b'{"Error":"pod x/y is unknown to vramsched"}',
        b"{}",
        b'{"Error":3}',
        b"[]",
        b"oops",
    ):
        why, race = check_bind(raw)
        assert why is not None and not race, raw


async def test_floor_parses_the_same_requests_and_answers_validly(aiohttp_client):
    client = await aiohttp_client(floor_app())
    pod = make_pod(random.Random(3), "p-1")
    body = {"Pod": pod, "Nodes": None, "NodeNames": sorted(SENT)}
    out = await (await client.post("/filter", data=orjson.dumps(body))).read()
    assert CHECKS.filter(out) == (None, sorted(SENT))
    scores = await (await client.post("/prioritize", data=orjson.dumps(body))).read()
    assert check_prioritize(scores, sorted(SENT), random.Random(1))[0] is None
    bind = {"PodName": "p-1", "PodNamespace": "loadtest", "PodUID": "u", "Node": "a"}
    assert check_bind(await (await client.post("/bind", data=orjson.dumps(bind))).read()) == (
        None,
        False,
    )


def test_generated_cluster_is_what_vramsched_reads_with_every_pod_placed_by_annotation(tmp_path):
    from extender.cluster import ClusterState
    from extender.ledger import check_invariant
    from extender.source_file import read_cluster_file

    nodes, pods = generate(60, 8, 0.6, seed=5)
    path = tmp_path / "c.json"
    write_cluster(path, nodes, pods, {"seed": 5})
    state = ClusterState()
    state.load(read_cluster_file(path))
    assert len(state.ledger) == 60 and len(state.pods) == len(pods) > 0
    assert state.guessed == set()  # every running pod carries its assignment
    assert sum(1 for _ in state.ledger.reservations()) == len(pods)
    assert check_invariant(state.ledger, state.live_pod_keys()) == []
    products = {n["metadata"]["labels"]["nvidia.com/gpu.product"] for n in nodes}
    strategies = {
        n["metadata"]["labels"].get("nvidia.com/gpu.sharing-strategy", "mig") for n in nodes
    }
    assert {"none", "time-slicing", "mps", "mig"} <= strategies
    assert (
        any("H100" in p for p in products)
        and any("H200" in p for p in products)
        and any("A100" in p for p in products)
    )
    assert orjson.loads(nodes_file(path).read_bytes())["nodes"] == [
        n["metadata"]["name"] for n in nodes
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("churn", [0, 1])
def test_a_few_seconds_of_the_scenario_against_vramsched_have_no_failures(tmp_path, churn):
    """With `churn`, each user keeps at most that many pods bound and deletes the oldest (the soak)."""
    from loadtest.soak import delete_loadtest_pods, held_pods

    nodes, pods = generate(40, 8, 0.5, seed=2)
    cluster = tmp_path / "cluster.json"
    write_cluster(cluster, nodes, pods, {"seed": 2})
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen(
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
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stderr.read().decode()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "server not ready"
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state", timeout=10) as r:
            allocated_at_start = orjson.loads(r.read())["allocatedBytes"]
        raw = tmp_path / "raw"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(ROOT / "loadtest" / "locustfile.py"),
                "--headless",
                "--only-summary",
                "-u",
                "2",
                "-r",
                "2",
                "-t",
                "4s",
                "-H",
                f"http://127.0.0.1:{port}",
                "--csv",
                str(tmp_path / "smoke"),
                "--loglevel",
                "WARNING",
            ],
            cwd=ROOT,
            env=dict(
                env,
                LOADTEST_NODES_FILE=str(nodes_file(cluster)),
                LOADTEST_RAW=str(raw),
                LOADTEST_WARMUP="0",
                LOADTEST_CHURN=str(churn),
            ),
            capture_output=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stdout.decode()[-2000:] + run.stderr.decode()[-2000:]
        with (tmp_path / "smoke_stats.csv").open() as f:
            rows = {r["Name"]: r for r in csv.DictReader(f)}
        assert rows["Aggregated"]["Failure Count"] == "0"
        assert int(rows["filter"]["Request Count"]) > 0 and int(rows["bind"]["Request Count"]) > 0
        counts = orjson.loads(next(tmp_path.glob("raw.*.json")).read_bytes())["counts"]
        assert counts["failures"] == 0 and counts["bound"] > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state", timeout=10) as r:
            state = orjson.loads(r.read())
        # the pods locust bound are in the ledger, and no GPU or slice holds more than it has
        assert len(state["nodes"]) == 40
        for node in state["nodes"]:
            for gpu in node["gpus"]:
                for dev in gpu.get("slices") or [gpu]:
                    assert (
                        dev["usedBytes"] <= dev["memoryBytes"]
                        and dev["usedReplicas"] <= dev["replicas"]
                    ), (node["name"], dev)
        held = held_pods(state)
        if churn:
            assert counts["deleted"] > 0 and int(rows["delete"]["Request Count"]) > 0
            assert len(held) <= 2 * (
                churn + 1
            )  # 2 users (one more each if stopped between bind and delete)
            # every pod bound and not held was deleted. Locust stops each of the 2 users where it is:
            # one stopped mid-DELETE did not count its last deletion, one stopped mid-bind holds a
            # pod the server bound and it did not count
            assert (
                counts["bound"] - len(held) - 2
                <= counts["deleted"]
                <= counts["bound"] - len(held) + 2
            )
        else:
            assert (
                "delete" not in rows and counts["bound"] <= len(held) <= counts["bound"] + 2
            )  # (mid-bind, as above)
        # deleting what the load test bound gives back exactly what it held
        assert delete_loadtest_pods(port) == len(held)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/state", timeout=10) as r:
            assert orjson.loads(r.read())["allocatedBytes"] == allocated_at_start
    finally:
        stop_process(server)


def test_race_mark_is_what_a_lost_bind_says():
    import asyncio

    from extender.cluster import ClusterState
    from extender.embedded import EmbeddedBinder
    from extender.service import ExtenderService
    from extender.wire import ExtenderArgs, ExtenderBindingArgs

    nodes, _ = generate(7, 1, 0.0, seed=3)  # one node of each kind, one GPU each, empty
    state = ClusterState()
    state.load(nodes)
    svc = ExtenderService(state, EmbeddedBinder(state))
    excl = next(n["metadata"]["name"] for n in nodes if n["metadata"]["name"].startswith("h100-x"))
    pods = []
    for i in range(2):  # both pass filter on the exclusive H100 before either binds
        p = make_pod(random.Random(0), f"race-{i}")
        p["metadata"]["annotations"] = {"vramsched.io/model-memory": "40Gi"}
        p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        assert excl in svc.filter(ExtenderArgs(Pod=p, NodeNames=[excl])).NodeNames
        pods.append(p)
    results = [
        asyncio.run(
            svc.bind(
                ExtenderBindingArgs(
                    PodName=p["metadata"]["name"],
                    PodNamespace="loadtest",
                    PodUID=p["metadata"]["uid"],
                    Node=excl,
                )
            )
        )
        for p in pods
    ]
    assert results[0].Error == "" and RACE_MARK in results[1].Error


@pytest.mark.parametrize(
    ("csv_failures", "raw_failures", "want"), [(0, 3, 3), (2, 0, 2), (1, 1, 1), (0, 0, 0)]
)
def test_the_summary_counts_failures_the_csv_missed_and_the_other_way_round(
    tmp_path, csv_failures, raw_failures, want
):
    """Locust rewrites its stats CSV once a second and not at exit, so failures in the last second
    are only in the locustfile's own counts; failures inside locust's client only in the CSV."""
    import argparse

    from loadtest.run import _merge_raw

    with (tmp_path / "x_stats.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Type", "Name", "Request Count", "Failure Count"])
        w.writerow(["POST", "filter", "10", str(csv_failures)])
        w.writerow(["", "Aggregated", "10", str(csv_failures)])
    counts = {
        "cycles": 10,
        "bound": 8,
        "races": 0,
        "unschedulable": 2,
        "failures": raw_failures,
        "deleted": 0,
    }
    lat = {
        "filter": [1.0] * 10,
        "prioritize": [1.0] * 8,
        "bind": [1.0] * 8,
        "cycle": [3.0] * 10,
        "delete": [],
    }
    (tmp_path / "x.raw.1.json").write_bytes(
        orjson.dumps({"latency_ms": lat, "counts": counts, "span_s": 2.0, "cycles_total": 12})
    )
    out = _merge_raw(tmp_path, "x", argparse.Namespace())
    assert (
        out["failures"] == want
        and out["cycles_per_s"] == 5.0
        and out["verbs"]["filter"]["count"] == 10
    )
