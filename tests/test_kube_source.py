"""Informers and LiveSource against a scripted API: resume, relist on 410, backoff, readiness,
and a ledger that is a pure function of what the API returns."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import orjson
import pytest
from builders import gpu_node, pod
from kube_fakes import FakeApi

from extender.cluster import ClusterState
from extender.demand import ASSIGNMENT
from extender.inventory import ReplicaPolicy
from extender.ledger import check_invariant
from extender.live.api_client import ApiError
from extender.live.gate import NOT_SYNCED, live_service
from extender.live.informer import Informer
from extender.live.source import LiveSource
from extender.wire import ExtenderArgs, ExtenderBindingArgs


def ev(kind: str, obj: dict[str, Any], rv: str) -> dict[str, Any]:
    obj = dict(obj)
    obj["metadata"] = {**obj.get("metadata", {}), "resourceVersion": rv}
    return {"type": kind, "object": obj}


def bookmark(rv: str) -> dict[str, Any]:
    return {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": rv}}}


def gone() -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "kind": "Status",
            "code": 410,
            "reason": "Expired",
            "message": "too old resource version",
        },
    }


def run_informer(
    api: FakeApi, kind: str = "pods", **kw: Any
) -> tuple[Informer, list[tuple[str, Any]]]:
    """Run an informer in this thread until the fake's scripts are used up."""
    got: list[tuple[str, Any]] = []
    inf = Informer(
        kind,
        api,
        lambda op, obj: got.append((op, obj)),
        backoff_initial=0.001,
        backoff_max=0.004,
        **kw,
    )
    api.on_exhausted = lambda _kind: inf.stop()
    inf.run()
    return inf, got


def names(got: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out = []
    for op, obj in got:
        if op == "replace":
            out.append((op, sorted(o["metadata"]["name"] for o in obj)))
        else:
            out.append((op, obj["metadata"]["name"]))
    return out


# ----- the informer loop ---------------------------------------------------------------------------


def test_watch_resumes_from_the_last_version_seen_without_relisting() -> None:
    api = FakeApi()
    api.lists["pods"] = [([pod("a")], "10")]
    api.watches["pods"] = [
        [
            ev("ADDED", pod("b"), "11"),
            ev("MODIFIED", pod("b"), "12"),
        ],  # then the server times the watch out
        [ev("DELETED", pod("a"), "13")],
    ]
    inf, got = run_informer(api)
    watch_calls = [c for c in api.calls if c[0] == "watch"]
    assert watch_calls[:3] == [
        ("watch", "pods", "10"),
        ("watch", "pods", "12"),
        ("watch", "pods", "13"),
    ]
    assert [c for c in api.calls if c[0] == "list"] == [("list", "pods")]
    assert names(got) == [("replace", ["a"]), ("ADDED", "b"), ("MODIFIED", "b"), ("DELETED", "a")]
    assert inf.stats.watch_resumes == 2 and inf.stats.relists_gone == 0 and inf.stats.synced


def test_bookmarks_move_the_version_and_are_not_delivered() -> None:
    api = FakeApi()
    api.lists["pods"] = [([], "5")]
    api.watches["pods"] = [[bookmark("40")], []]
    _, got = run_informer(api)
    assert ("watch", "pods", "40") in api.calls
    assert names(got) == [("replace", [])]


@pytest.mark.parametrize("how", ["error event", "http status"])
def test_410_gone_relists_and_watches_from_the_new_list(how: str) -> None:
    api = FakeApi()
    api.lists["pods"] = [([pod("a")], "10"), ([pod("b")], "90")]
    expired = [gone()] if how == "error event" else ApiError(410, "Expired", "too old")
    api.watches["pods"] = [
        [ev("ADDED", pod("c"), "11")] + ([] if how == "http status" else expired),
        [ev("ADDED", pod("d"), "91")],
    ]
    if how == "http status":
        api.watches["pods"].insert(1, expired)
    inf, got = run_informer(api)
    assert [c for c in api.calls if c[0] == "list"] == [("list", "pods")] * 2
    assert ("watch", "pods", "90") in api.calls
    assert names(got)[:2] == [("replace", ["a"]), ("ADDED", "c")]
    assert ("replace", ["b"]) in names(got) and names(got)[-1] == ("ADDED", "d")
    assert inf.stats.relists_gone == 1


def test_connection_errors_back_off_and_resume_without_a_relist() -> None:
    api = FakeApi()
    api.lists["pods"] = [ApiError(0, "ConnectionRefused", "down"), ([pod("a")], "10")]
    api.watches["pods"] = [
        [ev("ADDED", pod("b"), "11"), ApiError(0, "ProtocolError", "Response ended prematurely")],
        ApiError(503, "ServiceUnavailable", "apiserver restarting"),
        [ev("ADDED", pod("c"), "12")],
    ]
    inf, got = run_informer(api)
    assert [c for c in api.calls if c[0] == "list"] == [
        ("list", "pods")
    ] * 2  # the first one failed
    assert [c for c in api.calls if c[0] == "watch"][:3] == [
        ("watch", "pods", "10"),
        ("watch", "pods", "11"),
        ("watch", "pods", "11"),
    ]
    assert names(got) == [("replace", ["a"]), ("ADDED", "b"), ("ADDED", "c")]
    assert inf.stats.errors == 3 and "apiserver restarting" in inf.stats.last_error


def test_backoff_doubles_up_to_its_cap_and_resets_after_success() -> None:
    api = FakeApi()
    inf = Informer("nodes", api, lambda *_: None, backoff_initial=0.001, backoff_max=0.004)
    delays = []
    for _ in range(4):
        inf._failed(ApiError(0, "x", "y"))  # the schedule is the behaviour under test
        delays.append(inf._delay)
    assert delays == [0.001, 0.002, 0.004, 0.004]
    api.lists["nodes"] = [([], "1")]
    inf._list()
    assert inf._delay == 0.0


def test_stop_unblocks_a_waiting_informer_thread() -> None:
    api = FakeApi()
    gate = threading.Event()
    inf = Informer("pods", api, lambda *_: None, may_start=gate)
    inf.start()
    inf.stop()
    inf.join(timeout=5)
    assert not inf._thread.is_alive()
    assert api.calls == []


# ----- LiveSource: events into the cluster ----------------------------------------------------------


def assigned(name: str, node: str, devices: list[str], nbytes: int, **kw: Any) -> dict[str, Any]:
    body = {"node": node, "devices": devices, "bytesPerDevice": [nbytes] * len(devices)}
    return pod(name, "16Gi", node=node, annotations={ASSIGNMENT: orjson.dumps(body).decode()}, **kw)


GIB = 1024**3


def source(api: FakeApi | None = None, **kw: Any) -> tuple[LiveSource, ClusterState]:
    c = ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED)  # live mode's default
    return LiveSource(c, api=api or FakeApi(), **kw), c


def holds(c: ClusterState) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {r.key: (r.node, r.device_ids) for r in c.ledger.reservations()}


def test_ready_only_after_nodes_and_pods_are_both_listed() -> None:
    src, c = source()
    assert src.ready()[0] is False
    src.apply("nodes", "replace", [gpu_node("n1")])
    assert src.ready()[0] is False
    src.apply("pods", "replace", [assigned("p", "n1", ["2"], 16 * GIB)])
    ready, detail = src.ready()
    assert (
        ready
        and detail["nodes"] == 1
        and detail["pods"] == 1
        and detail["replicaPolicy"] == "distributed"
    )
    assert holds(c) == {"default/p": ("n1", ("2",))}


def test_a_full_pod_list_is_left_out_of_later_garbage_collections() -> None:
    """At 100,000 pods a full collection scans ~1M objects (~360 ms, measured): the pods a list
    delivered are frozen, as `serve --cluster` freezes what it loaded."""
    import gc

    src, c = source()
    src.apply("nodes", "replace", [gpu_node("n1")])
    pod = assigned("p", "n1", ["2"], 16 * GIB)
    before = gc.get_freeze_count()
    src.apply("pods", "replace", [pod])
    assert gc.get_freeze_count() > before
    assert not any(
        o is c.pods["default/p"] for o in gc.get_objects()
    )  # in no generation a collection scans


def test_a_restart_rebuilds_the_same_ledger_from_the_same_objects() -> None:
    objects = [gpu_node("n1", replicas=4), gpu_node("n2")]
    pods = [
        assigned("a", "n1", ["0"], 30 * GIB),
        assigned("b", "n1", ["0"], 20 * GIB),
        assigned("c", "n2", ["1"], 80 * GIB),
        pod("pending", "10Gi"),
    ]
    first, c1 = source()
    first.apply("nodes", "replace", objects)
    first.apply("pods", "replace", pods)
    again, c2 = source()
    again.apply("nodes", "replace", objects)
    for p in reversed(pods):  # watch order must not matter either
        again.apply("pods", "ADDED", p)
    assert holds(c1) == holds(c2) and len(holds(c1)) == 3
    assert check_invariant(c1.ledger, c1.live_pod_keys()) == []


def test_relist_drops_what_disappeared_and_keeps_what_is_still_there() -> None:
    src, c = source()
    src.apply("nodes", "replace", [gpu_node("n1"), gpu_node("gone")])
    src.apply("pods", "replace", [assigned("a", "n1", ["0"], GIB), assigned("b", "n1", ["1"], GIB)])
    # 410 -> relist: node "gone" and pod "b" were deleted while the watch was down.
    src.apply("nodes", "replace", [gpu_node("n1")])
    src.apply("pods", "replace", [assigned("a", "n1", ["0"], GIB)])
    assert set(c.nodes) == {"n1"} and holds(c) == {"default/a": ("n1", ("0",))}


def test_terminal_and_deleted_pods_release_but_terminating_pods_keep_their_vram() -> None:
    src, c = source()
    src.apply("nodes", "replace", [gpu_node("n1")])
    a, b, t = (
        assigned(n, "n1", [d], GIB, uid=f"u-{n}") for n, d in (("a", "0"), ("b", "1"), ("t", "2"))
    )
    src.apply("pods", "replace", [a, b, t])
    src.apply("pods", "MODIFIED", {**a, "status": {"phase": "Succeeded"}})
    src.apply("pods", "DELETED", b)
    terminating = {**t, "metadata": {**t["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    src.apply("pods", "MODIFIED", terminating)
    assert holds(c) == {"default/t": ("n1", ("2",))}
    # The late DELETED of an older pod with the same name must not free the new one.
    src.apply("pods", "DELETED", {**t, "metadata": {**t["metadata"], "uid": "u-older"}})
    assert "default/t" in holds(c)
    src.apply("pods", "DELETED", terminating)
    assert holds(c) == {}


def test_a_pod_seen_before_its_node_is_counted_when_the_node_arrives() -> None:
    src, c = source()
    src.apply("nodes", "replace", [])
    src.apply(
        "pods", "replace", [pod("early", "40Gi", node="late-node")]
    )  # bound by someone else, no assignment
    assert holds(c) == {}
    src.apply("nodes", "ADDED", gpu_node("late-node"))
    assert list(holds(c)) == ["default/early"]


def test_informers_feed_the_loop_and_pods_wait_for_the_first_node_list() -> None:
    api = FakeApi()
    api.lists["nodes"] = [([gpu_node("n1")], "1")]
    api.lists["pods"] = [([assigned("p", "n1", ["0"], GIB)], "2")]
    api.watches["nodes"] = [[ev("ADDED", gpu_node("n2"), "3")]]
    api.watches["pods"] = [[ev("ADDED", assigned("q", "n2", ["1"], GIB), "4")]]

    async def main() -> tuple[bool, dict[str, Any]]:
        c = ClusterState(replica_policy=ReplicaPolicy.DISTRIBUTED)
        src = LiveSource(c, api=api, backoff_initial=0.01, backoff_max=0.02)
        await src.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(holds(c)) < 2:
            await asyncio.sleep(0.01)
        await src.stop()
        return src.ready()[0], holds(c)

    ready, held = asyncio.run(main())
    assert ready and held == {"default/p": ("n1", ("0",)), "default/q": ("n2", ("1",))}
    first_pod_call = next(i for i, c in enumerate(api.calls) if c[1:2] == ("pods",))
    first_node_list = api.calls.index(("list", "nodes"))
    assert first_node_list < first_pod_call


async def test_verbs_are_refused_until_the_first_sync() -> None:
    src, c = source()
    service = live_service(c, src)
    p = pod("p", "10Gi")
    result = service.filter(ExtenderArgs.model_validate({"Pod": p, "NodeNames": ["n1"]}))
    assert result.Error == NOT_SYNCED
    bound = await service.bind(
        ExtenderBindingArgs(
            PodName="p", PodNamespace="default", PodUID=p["metadata"]["uid"], Node="n1"
        )
    )
    assert bound.Error == NOT_SYNCED
    src.apply("nodes", "replace", [gpu_node("n1")])
    src.apply("pods", "replace", [p])
    assert service.filter(
        ExtenderArgs.model_validate({"Pod": p, "NodeNames": ["n1"]})
    ).NodeNames == ["n1"]
