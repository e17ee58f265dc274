"""The HTTP adapter against request bodies recorded from a real kube-scheduler v1.20."""

import csv

import numpy as np
import orjson
import pytest
from builders import FIXTURES, cluster, fixture, fixture_nodes, gpu_node, pod, service
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.ledger import check_invariant
from extender.server import create_app, route_paths
from extender.wire import MAX_PRIORITY, MIN_PRIORITY, ScoredHosts


@pytest.fixture
def state():
    return cluster(*fixture_nodes())


@pytest.fixture
async def client(aiohttp_client, state):
    return await aiohttp_client(create_app(service(state), max_body_bytes=4 * 1024 * 1024))


async def post(client, verb, body, status=200):
    resp = await client.post(
        f"/{verb}",
        data=body if isinstance(body, (bytes, str)) else orjson.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    return orjson.loads(await resp.read())


async def test_filter_node_names_mode_exact_keys(client):
    body = fixture("003-filter.json")
    out = await post(client, "filter", body)
    assert list(out) == ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]
    assert out["Nodes"] is None and out["Error"] == ""
    assert out["NodeNames"] == body["NodeNames"]


async def test_filter_full_nodes_mode_returns_nodes(client):
    body = fixture("042-filter.json")
    out = await post(client, "filter", body)
    assert out["NodeNames"] is None
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == [
        "gpu-node-a",
        "gpu-node-b",
        "gpu-node-c",
    ]
    # the node objects come back as they were sent
    assert out["Nodes"]["items"][0] == body["Nodes"]["items"][0]


async def test_prioritize_is_a_bare_array_in_range(client):
    body = fixture("004-prioritize.json")
    out = await post(client, "prioritize", body)
    assert isinstance(out, list)
    assert [h["Host"] for h in out] == body["NodeNames"]
    assert all(set(h) == {"Host", "Score"} and 0 <= h["Score"] <= 10 for h in out)


async def test_bind_reserves_annotates_and_is_idempotent(client, state):
    await post(client, "filter", fixture("003-filter.json"))
    bind = fixture("005-bind.json")
    assert await post(client, "bind", bind) == {"Error": ""}
    assert await post(client, "bind", bind) == {"Error": ""}  # kube-scheduler retry after a timeout
    p = state.pod("default/gpu-pod-2")
    assert p["spec"]["nodeName"] == "gpu-node-c"
    assert p["metadata"]["annotations"]["vramsched.io/gpu-index"] == "0"
    held = state.ledger.reservation("default/gpu-pod-2")
    assert held.node == "gpu-node-c" and held.bytes_per_device == (16 * 1024**3,)
    other = dict(bind, Node="gpu-node-a")
    out = await post(client, "bind", other)
    assert out["Error"] == "pod default/gpu-pod-2 is already bound to gpu-node-c"
    assert check_invariant(state.ledger, state.live_pod_keys()) == []


async def test_bind_errors_change_nothing(client, state):
    assert (await post(client, "bind", fixture("002-bind.json")))[
        "Error"
    ] == "pod default/gpu-pod-1 is unknown to vramsched"
    await post(client, "filter", fixture("001-filter.json"))
    wrong_node = dict(fixture("002-bind.json"), Node="nope")
    assert (await post(client, "bind", wrong_node))["Error"] == "node nope is unknown to vramsched"
    wrong_uid = dict(fixture("002-bind.json"), PodUID="other")
    assert "re-created" in (await post(client, "bind", wrong_uid))["Error"]
    assert state.ledger.totals()[0] == 0


async def test_replay_whole_recorded_session(client, state):
    """Every recorded filter/prioritize/bind, in the order the scheduler sent them."""
    rows = list(csv.reader((FIXTURES / "index.tsv").open(), delimiter="\t"))
    bound = 0
    for number, _time, _run, verb, _pod, _told, _answered in rows:
        files = sorted(FIXTURES.glob(f"{number}-{verb}.json"))
        assert files, number
        out = await post(client, verb, fixture(files[0].name))
        if verb == "bind":
            bound += out["Error"] == ""
        if verb == "prioritize":
            assert all(0 <= h["Score"] <= 10 for h in out)
    assert bound >= 10
    assert check_invariant(state.ledger, state.live_pod_keys()) == []
    # the recorded scheduler chose the nodes; on each node we packed onto as few GPUs as possible
    # without leaving memory behind a GPU's last replica: on gpu-node-c a fourth 16 GiB pod on
    # GPU 0 (48 GiB held, 3 of 4 replicas) would have stranded 16 GiB, so it opened one more GPU
    a = state.ledger.arrays
    assert not ((a.used_replicas == a.replicas) & (a.used < a.capacity)).any()
    by_node = {}
    for r in state.ledger.reservations():
        by_node.setdefault(r.node, []).append(r)
    for node, held in by_node.items():
        gpus = {d for r in held for d in r.device_ids}
        memory = sum(r.total_bytes for r in held)
        least = max(-(-memory // (80 * 1024**3)), -(-len(held) // 4))
        assert len(gpus) == least + (node == "gpu-node-c"), (node, gpus)


async def test_filter_error_field_for_bad_annotation(client, state):
    body = fixture("003-filter.json")
    body["Pod"]["metadata"]["annotations"]["vramsched.io/model-memory"] = "16Gx"
    out = await post(client, "filter", body)
    assert out["Error"].startswith(
        "pod default/gpu-pod-2: annotation vramsched.io/model-memory='16Gx' is invalid"
    )
    assert state.ledger.totals()[0] == 0


async def test_preempt_meta_victims(aiohttp_client):
    c = cluster(gpu_node("n", count=1, replicas=4))
    app = create_app(service(c))
    cl = await aiohttp_client(app)
    low = pod("low", "60Gi", priority=1)
    await post(cl, "filter", {"Pod": low, "NodeNames": ["n"]})
    assert await post(
        cl,
        "bind",
        {
            "PodName": "low",
            "PodNamespace": "default",
            "PodUID": low["metadata"]["uid"],
            "Node": "n",
        },
    ) == {"Error": ""}
    high = pod("high", "40Gi", priority=10)
    body = {
        "Pod": high,
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            "n": {"Pods": [{"UID": low["metadata"]["uid"]}], "NumPDBViolations": 0}
        },
    }
    out = await post(cl, "preempt", body)
    assert out == {
        "NodeNameToMetaVictims": {
            "n": {"Pods": [{"UID": low["metadata"]["uid"]}], "NumPDBViolations": 0}
        }
    }
    small = pod("small", "10Gi", priority=10)
    body["Pod"] = small  # fits already: the scheduler's own victims are left as they are
    assert (await post(cl, "preempt", body))["NodeNameToMetaVictims"]["n"]["Pods"] == [
        {"UID": low["metadata"]["uid"]}
    ]


@pytest.mark.parametrize(
    "verb, body, status, needle",
    [
        ("filter", b"{not json", 400, "not valid JSON"),
        ("filter", b"", 400, "empty body"),
        ("filter", b"[]", 400, "must be a JSON object"),
        ("filter", {"NodeNames": ["a"]}, 400, "Pod: Field required"),
        ("filter", {"Pod": "x", "NodeNames": ["a"]}, 400, "invalid ExtenderArgs"),
        ("filter", {"Pod": {}, "NodeNames": "a"}, 400, "NodeNames"),
        ("bind", {"PodName": 1, "PodNamespace": "d", "Node": "n"}, 400, "PodName"),
        ("preempt", {"Pod": None}, 400, "Pod"),
        ("frobnicate", {}, 404, "unknown verb 'frobnicate'"),
    ],
)
async def test_bad_requests_get_clear_4xx(client, state, verb, body, status, needle):
    out = await post(client, verb, body, status=status)
    assert needle in out["Error"]
    assert state.ledger.totals()[0] == 0
    assert (await client.get("/healthz")).status == 200


async def test_body_limit(aiohttp_client, state):
    cl = await aiohttp_client(create_app(service(state), max_body_bytes=1024))
    resp = await cl.post(
        "/filter", data=b"{" + b" " * 4096 + b"}", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 413
    assert "Error" in orjson.loads(await resp.read())


async def test_health_metrics_state(client, state):
    await post(client, "filter", fixture("003-filter.json"))
    await post(client, "bind", fixture("005-bind.json"))
    assert (await client.get("/readyz")).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'vramsched_request_duration_seconds_bucket{le="0.001",verb="filter"}' in metrics
    assert 'vramsched_requests_total{code="200",verb="bind"} 1.0' in metrics
    gauges = dict(
        line.split(" ") for line in metrics.splitlines() if line.startswith("vramsched_vram_")
    )
    assert float(gauges["vramsched_vram_allocated_bytes"]) == 16 * 1024**3
    assert float(gauges["vramsched_vram_free_bytes"]) == 12 * 81920 * 1024**2 - 16 * 1024**3
    st = orjson.loads(await (await client.get("/state")).read())
    node_c = next(n for n in st["nodes"] if n["name"] == "gpu-node-c")
    g0 = node_c["gpus"][0]
    assert {k: g0[k] for k in ("index", "memoryBytes", "usedBytes", "replicas", "pods")} == {
        "index": 0,
        "memoryBytes": 81920 * 1024**2,
        "usedBytes": 16 * 1024**3,
        "replicas": 4,
        "pods": ["default/gpu-pod-2"],
    }
    # no background planner in this service: no counters for it anywhere
    assert st["planner"] is None and "vramsched_planner_" not in metrics


async def test_state_and_metrics_count_what_the_planner_did(aiohttp_client):
    from extender.embedded import EmbeddedBinder
    from extender.planner.background import BackgroundPlanner
    from extender.service import ExtenderService

    c = cluster(
        gpu_node("a", count=2, memory_mib=80 * 1024, replicas=4), pod("p", "40Gi"), pod("q", "20Gi")
    )
    planner = BackgroundPlanner(c, time_limit=1.0, num_workers=1)
    svc = ExtenderService(c, EmbeddedBinder(c), planner=planner)
    client = await aiohttp_client(create_app(svc))
    planner.plan_once()
    planned = planner.entries["default/q"].reservation
    await post(client, "bind", {"PodName": "p", "PodNamespace": "default", "Node": "a"})
    # q's planned GPU is taken from under it before its bind: its entry is stale, bind takes best fit
    c.ledger.reserve(
        planned.__class__(
            planned.pod.__class__("other", "x"), "a", planned.device_ids, (70 * 1024**3,)
        )
    )
    await post(client, "bind", {"PodName": "q", "PodNamespace": "default", "Node": "a"})
    st = orjson.loads(await (await client.get("/state")).read())["planner"]
    assert (st["plans"], st["hits"], st["stale"], st["refusedAtBind"], st["errors"]) == (
        1,
        1,
        1,
        0,
        0,
    )
    assert st["lastStatus"] == "GREEDY" and st["lastBatch"] == 2 and st["lastPlaced"] == 2
    # what the plans weigh free memory by: both pods, bound now, still count
    kind = {"gpus": 1, "resource": "nvidia.com/gpu", "gpuModels": None, "cpuMilli": 0}
    assert st["profile"] == [
        {**kind, "memoryPerGpuBytes": 40 * 1024**3, "memoryBytes": 0, "pods": 1, "share": 0.5},
        {**kind, "memoryPerGpuBytes": 20 * 1024**3, "memoryBytes": 0, "pods": 1, "share": 0.5},
    ]
    metrics = await (await client.get("/metrics")).text()
    values = dict(
        line.split(" ") for line in metrics.splitlines() if line.startswith("vramsched_planner_")
    )
    assert (
        float(values["vramsched_planner_plans_total"]) == 1.0
        and float(values["vramsched_planner_bind_hits_total"]) == 1.0
    )
    assert (
        float(values["vramsched_planner_stale_entries_total"]) == 1.0
        and float(values["vramsched_planner_bind_refused_total"]) == 0.0
    )
    assert c.ledger.reservation("default/q") is not None and check_invariant(c.ledger) == []


def test_route_paths():
    assert {
        "/filter",
        "/prioritize",
        "/bind",
        "/preempt",
        "/healthz",
        "/readyz",
        "/metrics",
        "/state",
    } <= route_paths()


async def test_probe_app_serves_only_probes_and_metrics(aiohttp_client, state):
    from extender.server import create_probe_app

    main = create_app(service(state))
    main_client = await aiohttp_client(main)
    probes = await aiohttp_client(create_probe_app(main))
    await post(main_client, "filter", fixture("003-filter.json"))
    assert (await probes.get("/healthz")).status == 200
    assert (await probes.get("/readyz")).status == 200
    text = await (await probes.get("/metrics")).text()
    assert (
        'vramsched_requests_total{code="200",verb="filter"} 1.0' in text
    )  # the main app's registry
    assert (await probes.post("/filter", data=orjson.dumps(fixture("003-filter.json")))).status in (
        404,
        405,
    )
    assert (await probes.get("/state")).status == 404


async def test_a_pod_sent_again_with_another_annotation_gets_its_new_demand(aiohttp_client):
    """Demands are kept per pod JSON between filter, prioritize and bind: a changed pod is parsed anew."""
    state = cluster(gpu_node("g1", count=1))
    client = await aiohttp_client(create_app(service(state)))
    small, big = pod("same", "16Gi"), pod("same", "100Gi")
    for p, fits in ((small, True), (big, False), (small, True)):
        out = await post(client, "filter", {"Pod": p, "Nodes": None, "NodeNames": ["g1"]})
        assert (out["NodeNames"] == ["g1"]) is fits, out


@pytest.mark.parametrize("legacy", [True, False])
async def test_unresolvable_nodes_are_in_failed_nodes_only_for_old_schedulers(
    aiohttp_client, legacy
):
    """kube-scheduler < 1.21 reads only FailedNodes; newer ones read both maps, so there the
    unresolvable entries are not sent twice."""
    state = cluster(gpu_node("big", count=1), gpu_node("small", count=1, memory_mib=24576))
    svc = service(state)
    svc.legacy_failed_nodes = legacy
    client = await aiohttp_client(create_app(svc))
    out = await post(
        client,
        "filter",
        {"Pod": pod("p", "90Gi"), "Nodes": None, "NodeNames": ["big", "small", "ghost"]},
    )
    assert out["NodeNames"] == []
    assert set(out["FailedAndUnresolvableNodes"]) == {"big", "small", "ghost"}
    assert out["FailedNodes"] == (out["FailedAndUnresolvableNodes"] if legacy else {})
    svc.explain_all = True  # reasons also when some node passes: the same rule
    out = await post(
        client,
        "filter",
        {"Pod": pod("q", "40Gi"), "Nodes": None, "NodeNames": ["big", "small", "ghost"]},
    )
    assert out["NodeNames"] == ["big"]
    assert set(out["FailedAndUnresolvableNodes"]) == {"small", "ghost"}
    assert out["FailedNodes"] == (out["FailedAndUnresolvableNodes"] if legacy else {})


async def test_refused_nodes_are_explained_when_none_passes_or_when_asked(aiohttp_client):
    """kube-scheduler reads filter's reasons only when no node is left (FitError event,
    preemption): by default they are sent then, for every refused node, and not otherwise."""
    state = cluster(
        gpu_node("big", count=1, replicas=4), gpu_node("small", count=1, memory_mib=24576)
    )
    state.upsert_pod(pod("busy", "70Gi", node="big"))
    svc = service(state)
    svc.legacy_failed_nodes = False  # today's kube-scheduler: each refused node in one map
    client = await aiohttp_client(create_app(svc))
    names = ["big", "small", "ghost"]
    out = await post(client, "filter", {"Pod": pod("p", "8Gi"), "Nodes": None, "NodeNames": names})
    assert out["NodeNames"] == ["big", "small"]
    assert (
        out["FailedNodes"] == out["FailedAndUnresolvableNodes"] == {}
    )  # ghost dropped, unexplained
    out = await post(client, "filter", {"Pod": pod("q", "20Gi"), "Nodes": None, "NodeNames": names})
    assert out["NodeNames"] == ["small"]
    assert out["FailedNodes"] == out["FailedAndUnresolvableNodes"] == {}
    out = await post(client, "filter", {"Pod": pod("r", "30Gi"), "Nodes": None, "NodeNames": names})
    assert out["NodeNames"] == []  # big is full for now (preemption may help), small too small
    assert set(out["FailedNodes"]) == {"big"} and set(out["FailedAndUnresolvableNodes"]) == {
        "small",
        "ghost",
    }
    assert out["FailedAndUnresolvableNodes"]["ghost"] == "node unknown to vramsched"
    svc.explain_all = True
    out = await post(client, "filter", {"Pod": pod("s", "20Gi"), "Nodes": None, "NodeNames": names})
    assert out["NodeNames"] == ["small"]
    assert set(out["FailedNodes"]) == {"big"} and set(out["FailedAndUnresolvableNodes"]) == {
        "ghost"
    }


def test_which_control_planes_need_unresolvable_nodes_in_failed_nodes():
    from extender.live.versions import needs_legacy_failed_nodes

    assert needs_legacy_failed_nodes({"major": "1", "minor": "20"})
    assert not needs_legacy_failed_nodes({"major": "1", "minor": "21"})
    assert not needs_legacy_failed_nodes({"major": "1", "minor": "34+"})  # as EKS/GKE report it
    assert not needs_legacy_failed_nodes({"major": "2", "minor": "0"})
    assert needs_legacy_failed_nodes({}) and needs_legacy_failed_nodes(None)
    assert needs_legacy_failed_nodes({"major": "one", "minor": "x"})


async def test_serve_reads_the_choice_from_the_api_server_and_keeps_it_when_unreadable():
    from types import SimpleNamespace

    from extender.commands.serve import _legacy_failed_nodes

    def version(minor):
        return lambda: {"major": "1", "minor": minor}

    def broken():
        raise OSError("connection refused")

    assert (
        await _legacy_failed_nodes(
            SimpleNamespace(api=SimpleNamespace(server_version=version("20")))
        )
        is True
    )
    assert (
        await _legacy_failed_nodes(
            SimpleNamespace(api=SimpleNamespace(server_version=version("34")))
        )
        is False
    )
    assert (
        await _legacy_failed_nodes(SimpleNamespace(api=SimpleNamespace(server_version=broken)))
        is True
    )


async def test_delete_frees_what_a_bound_pod_held_and_refuses_what_it_cannot_do(client, state):
    await post(client, "filter", fixture("003-filter.json"))
    assert await post(client, "bind", fixture("005-bind.json")) == {"Error": ""}
    held = state.ledger.totals()[0]
    assert held == 16 * 1024**3
    resp = await client.delete("/pods/default/gpu-pod-2")
    assert resp.status == 200 and orjson.loads(await resp.read()) == {"Error": ""}
    assert (
        state.pod("default/gpu-pod-2") is None
        and state.ledger.reservation("default/gpu-pod-2") is None
    )
    assert state.ledger.totals()[0] == 0
    assert check_invariant(state.ledger, state.live_pod_keys()) == []
    again = await client.delete("/pods/default/gpu-pod-2")  # gone: nothing changes
    assert (
        again.status == 404 and "unknown to vramsched" in orjson.loads(await again.read())["Error"]
    )
    # the freed GPU takes the pod again when kube-scheduler retries it
    await post(client, "filter", fixture("003-filter.json"))
    assert await post(client, "bind", fixture("005-bind.json")) == {"Error": ""}
    assert state.ledger.totals()[0] == held
    wrong_method = await client.post("/pods/default/gpu-pod-2")
    assert wrong_method.status == 405 and "DELETE" in wrong_method.headers["Allow"]


async def test_delete_is_refused_in_live_mode_and_during_a_bind(aiohttp_client, state):
    import asyncio

    from extender.live.source import WatchedPods
    from extender.service import ExtenderService

    live = ExtenderService(state, None, pods=WatchedPods(state))  # type: ignore[arg-type]
    c = await aiohttp_client(create_app(live))
    state.upsert_pod(fixture("003-filter.json")["Pod"])  # live mode learns pods from the watch
    resp = await c.delete("/pods/default/gpu-pod-2")
    assert resp.status == 405 and resp.headers["Allow"] == ""
    assert "kubectl delete pod -n default gpu-pod-2" in orjson.loads(await resp.read())["Error"]
    assert state.pod("default/gpu-pod-2") is not None

    class SlowBinder:
        def __init__(self):
            self.release = asyncio.Event()

        async def bind(self, pod, node, reservation):
            await self.release.wait()

    binder = SlowBinder()
    svc = ExtenderService(state, binder)  # type: ignore[arg-type]
    c = await aiohttp_client(create_app(svc))
    await post(c, "filter", fixture("003-filter.json"))
    binding = asyncio.ensure_future(c.post("/bind", data=orjson.dumps(fixture("005-bind.json"))))
    for _ in range(100):
        if svc._in_flight:
            break
        await asyncio.sleep(0.01)
    resp = await c.delete("/pods/default/gpu-pod-2")
    assert resp.status == 409 and "being bound" in orjson.loads(await resp.read())["Error"]
    binder.release.set()
    assert orjson.loads(await (await binding).read()) == {"Error": ""}
    assert state.ledger.reservation("default/gpu-pod-2") is not None


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=12, unique=True),
    picks=st.lists(
        st.tuples(st.integers(0, 11), st.integers(MIN_PRIORITY, MAX_PRIORITY)), max_size=30
    ),
)
def test_prioritize_encoding_is_the_json_of_its_hosts(names, picks):
    """Fixed-width entries (padded with JSON whitespace) decode to exactly the hosts and scores,
    whatever the names hold (quotes, backslashes, control characters, non-ASCII)."""
    table = np.array(names, dtype=object)
    rows = np.array([r % len(names) for r, _ in picks], np.int64)
    scores = np.array([s for _, s in picks], np.int64)
    hosts = ScoredHosts(table, rows, scores)
    assert orjson.loads(hosts.to_json()) == [
        {"Host": names[r], "Score": int(s)} for r, s in zip(rows, scores)
    ]


async def test_concurrent_cycles_are_pointed_at_different_nodes_of_the_best_band(monkeypatch):
    """kube-scheduler may prioritize the next pod before the previous one's bind reaches us: the
    node just given 10 is avoided for other pods until that bind comes (or CHOSEN_TTL passes)."""
    import extender.service as service_module
    from extender.wire import ExtenderArgs, ExtenderBindingArgs

    c = cluster(
        *(gpu_node(n, count=1, replicas=8) for n in ("a", "b", "c")),
        pod("x", "40Gi", node="a"),
        pod("y", "40Gi", node="b"),
        pod("big", "70Gi", node="c"),
    )
    s = service(c)
    names = ["a", "b", "c"]

    def top(name: str) -> str:
        p = pod(name, "16Gi")
        s.filter(ExtenderArgs(Pod=p, NodeNames=names))
        (best,) = [
            h.Host for h in s.prioritize(ExtenderArgs(Pod=p, NodeNames=names)) if h.Score == 10
        ]
        return best

    assert top("p1") == "a"
    assert top("p2") == "b"  # a and b tie in the best band; a is p1's until p1 binds
    assert top("p1") == "a"  # asked again: its own choice does not count against it
    assert (
        top("p3") == "a"
    )  # every node of the best band is taken: the first one, as without others
    assert (
        await s.bind(ExtenderBindingArgs(PodName="p1", PodNamespace="default", Node="a"))
    ).Error == ""
    assert s._chosen.keys() == {"default/p2", "default/p3"}  # a bind ends its pod's choice
    # a alone is in the best band now (its GPU is fuller): taken by p3, still the top
    assert top("p4") == "a"
    monkeypatch.setattr(service_module, "CHOSEN_TTL", -1.0)
    assert top("p5") == "a"  # choices older than the TTL are forgotten
    assert s._chosen.keys() == {"default/p5"}


def test_host_tables_keep_one_table_per_names_array_while_it_lives():
    """The server reuses a names array's entry table from answer to answer, builds another for
    another array (a new inventory), and drops the tables of arrays that are gone."""
    import gc

    from extender.wire import HostTables

    tables = HostTables()
    names = np.array(["a", 'b"q'], dtype=object)
    first = tables.table(names)
    assert tables.table(names) is first
    other = np.array(["a", 'b"q'], dtype=object)
    assert tables.table(other) is not first
    hosts = ScoredHosts(names, np.array([1, 0], np.int64), np.array([10, 3], np.int64))
    assert hosts.to_json(tables) == hosts.to_json()
    assert orjson.loads(hosts.to_json(tables)) == [
        {"Host": 'b"q', "Score": 10},
        {"Host": "a", "Score": 3},
    ]
    del names, hosts, first
    gc.collect()
    third = np.array(["c"], dtype=object)
    tables.table(third)  # a new array clears out what is gone
    assert len(tables._tables) == 2 and all(ref() is not None for ref, _ in tables._tables.values())
