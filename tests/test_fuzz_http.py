"""Property-based fuzzing of every HTTP verb with malformed and adversarial bodies.

Each example is sent to the real aiohttp app (in-process, aiohttp's TestServer on loopback)
over a small cluster that already holds reservations. After every request:

- the answer is never a 5xx, always JSON, and a 4xx always carries a non-empty `Error`;
- `check_cluster` finds nothing wrong (the invariant, and the ledger agrees with the pods);
- a request that was refused (4xx, or `Error` set) left the ledger exactly as it was;
- the server still answers `/healthz`.

The examples are derandomized and use no database, so every run sends the same inputs.

Why one module of over 600 lines: a fuzz failure is read against the strategy that drew its
input. The strategies (adversarial pods, corruptions, garbage nodes), the driver and the
properties each test checks sit together so that the shrunk example, what could be drawn and
what must hold are on one page; the fixed cases at the end (regressions and limits) use the same
driver.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from builders import cluster, gpu_node, mig_mixed_node, pod, service
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extender.cluster import check_cluster
from extender.server import create_app
from extender.wire import VERBS

pytestmark = pytest.mark.integration

MAX_BODY = 256 * 1024
FUZZ = settings(
    max_examples=250,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
NODES = ("a100-0", "h100-0", "mig-0")


def dumps(obj: Any) -> bytes:
    """JSON as a client might send it: integers beyond 64 bits, lone surrogates escaped."""
    return json.dumps(obj).encode()


class Driver:
    """The app on its own event loop, driven synchronously so hypothesis can shrink failures."""

    def __init__(self) -> None:
        self.cluster = cluster(
            gpu_node("a100-0", count=4, replicas=4),
            gpu_node("h100-0", count=2, memory_mib=81559, product="NVIDIA-H100-80GB-HBM3"),
            mig_mixed_node("mig-0", {"1g.10gb": (7, 9728)}),
            pod("running-0", "24Gi", node="a100-0", phase="Running", namespace="inference"),
            pod("running-1", "70Gi", node="h100-0", phase="Running", namespace="inference"),
            pod("whole-0", None, node="h100-0", phase="Running", namespace="inference"),
            pod("pending-0", "16Gi"),
        )
        assert len(list(self.cluster.ledger.reservations())) == 3
        self.loop = asyncio.new_event_loop()
        app = create_app(service(self.cluster), max_body_bytes=MAX_BODY)
        self.client = TestClient(TestServer(app, host="127.0.0.1"), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())
        self.sent = 0
        self.posts = 0  # requests to the verbs
        self.refused = 0  # of which answered 4xx or with Error

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()

    def request(self, method: str, path: str, data: bytes | None = None) -> tuple[int, Any]:
        async def go() -> tuple[int, bytes, str]:
            async with self.client.request(
                method, path, data=data, headers={"Content-Type": "application/json"}
            ) as r:
                return r.status, await r.read(), r.content_type

        status, raw, ctype = self.loop.run_until_complete(go())
        self.sent += 1
        body = orjson.loads(raw) if ctype == "application/json" else raw
        return status, body

    def snapshot(self) -> tuple:
        """Everything a refused request must not change: reservations, inventories, per-device totals."""
        ledger = self.cluster.ledger
        a = ledger.arrays
        held = sorted(
            (r.key, r.node, r.device_ids, r.bytes_per_device, r.assumed)
            for r in ledger.reservations()
        )
        nodes = {n: (ledger.node(n).devices, ledger.node(n).problem) for n in NODES}
        rows = [ledger.row(n, d.device_id) for n in NODES for d in ledger.node(n).devices]
        totals = [(int(a.used[i]), int(a.used_replicas[i])) for i in rows]
        bound = {k: (p.get("spec") or {}).get("nodeName") for k, p in self.cluster.pods.items()}
        return held, nodes, totals, {k: v for k, v in bound.items() if v}

    def send(self, verb: str, data: bytes) -> tuple[int, Any]:
        """POST, then check every property of the module docstring; returns the answer."""
        before = self.snapshot()
        status, body = self.request("POST", f"/{verb}", data)
        self.posts += 1
        assert status < 500, body
        assert isinstance(body, (dict, list)), body
        if status >= 400:
            assert (
                isinstance(body, dict) and isinstance(body.get("Error"), str) and body["Error"]
            ), body
        refused = status >= 400 or (isinstance(body, dict) and body.get("Error"))
        if refused:
            self.refused += 1
            assert self.snapshot() == before, (
                f"{verb} refused ({status} {body}) but changed the ledger"
            )
        violations = check_cluster(self.cluster)
        assert violations == [], [str(v) for v in violations]
        health, text = self.request("GET", "/healthz")
        assert (health, text) == (200, b"ok")
        return status, body


@pytest.fixture(scope="module")
def driver() -> Iterator[Driver]:
    d = Driver()
    yield d
    d.close()
    print(
        f"\nfuzz: {d.posts} requests to the verbs ({d.refused} refused), each followed by the checks"
    )


# ----- strategies ---------------------------------------------------------------------------------
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
bad_quantities = st.one_of(
    st.sampled_from(
        [
            "16Gx",
            "-1",
            "-16Gi",
            "1e400",
            "1e31",
            "NaN",
            "nan",
            "Infinity",
            "inf",
            "",
            " ",
            "0",
            "0Gi",
            "1e30",
            "16 Gi",
            "0x10",
            "1_000",
            "9" * 100,
            "64Ti",
            "65Ti",
            "1Pi",
            "16Gi\n",
            "1.5.5",
            ".",
            "+",
            "16gi",
            "\u0661\u0666Gi",
            "16\x00Gi",
            "1" * 65,
        ]
    ),
    st.sampled_from([16, -1, 0, 1.5, 1e308, None, [], {}, True, [1], {"a": 1}, 2**70]),
    st.text(max_size=12),
)
gpu_counts = st.one_of(
    st.sampled_from(
        ["1", "2", "4", "0", "-1", "65", "64", "1000000", "1.5", "1e400", "NaN", "", "1e2", "500m"]
    ),
    st.sampled_from([1, 2, 0, -3, 2**70, 1.0, 1.5, None, True, [], {}]),
)
names = st.one_of(
    st.sampled_from(
        ["p0", "p1", "pending-0", "running-0", "", "x" * 300, "日本", "a/b", "../../etc", "p\x00"]
    ),
    st.sampled_from([None, 5, [], {}, True]),
    st.text(max_size=20),
)
node_names = st.one_of(
    st.sampled_from(NODES + ("nope", "", "A100-0", "x" * 254, "mig-0 ")), st.text(max_size=10)
)
resources = st.sampled_from(
    [
        "nvidia.com/gpu",
        "nvidia.com/gpu.shared",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-",
        "nvidia.com/gpux",
        "cpu",
    ]
)
CORRUPTIONS = (
    "none",
    "metadata-list",
    "metadata-null",
    "spec-str",
    "spec-missing",
    "containers-dict",
    "container-int",
    "resources-list",
    "requests-list",
    "annotations-list",
    "annotation-int",
    "priority-str",
    "priority-float",
    "priority-huge",
    "status-list",
    "phase-list",
    "phase-succeeded",
    "node-name",
    "node-name-int",
    "uid-int",
    "namespace-int",
    "init-huge",
    "two-gpu-resources",
    "assignment-bogus",
    "products-odd",
)


@st.composite
def adversarial_pods(draw: st.DrawFn) -> dict[str, Any]:
    """A pod that looks like a GPU pod with one or two things wrong (or nothing: some are valid)."""
    name = draw(names)
    resource = draw(resources)
    count = draw(gpu_counts)
    annotations: dict[str, Any] = {}
    if draw(st.booleans()):
        annotations["vramsched.io/model-memory"] = draw(
            st.one_of(bad_quantities, st.sampled_from(["16Gi", "80Gi", "1Mi"]))
        )
    limits: dict[str, Any] = {resource: count}
    if draw(st.booleans()):
        limits["cpu"] = draw(bad_quantities)
        limits["memory"] = draw(bad_quantities)
    p: dict[str, Any] = {
        "metadata": {
            "name": name,
            "namespace": draw(st.sampled_from(["default", "inference", "", "x" * 300])),
            "uid": draw(st.sampled_from(["", "u-1", "u-2"])),
            "annotations": annotations,
        },
        "spec": {
            "schedulerName": "vramsched",
            "containers": [{"name": "c", "resources": {"limits": limits}}],
        },
        "status": {"phase": "Pending"},
    }
    for _ in range(draw(st.integers(0, 2))):
        corruption = draw(st.sampled_from(CORRUPTIONS))
        meta, spec = p.get("metadata"), p.get("spec")
        if not isinstance(meta, dict) or not isinstance(spec, dict):
            break
        containers = spec.get("containers")
        match corruption:
            case "metadata-list":
                p["metadata"] = [meta]
            case "metadata-null":
                p["metadata"] = None
            case "spec-str":
                p["spec"] = "spec"
            case "spec-missing":
                del p["spec"]
            case "containers-dict":
                spec["containers"] = {"c": containers}
            case "container-int" if isinstance(containers, list):
                containers.append(7)
            case "resources-list" if (
                isinstance(containers, list) and containers and isinstance(containers[0], dict)
            ):
                containers[0]["resources"] = [limits]
            case "requests-list" if (
                isinstance(containers, list) and containers and isinstance(containers[0], dict)
            ):
                containers[0]["resources"] = {"requests": [1], "limits": limits}
            case "annotations-list":
                meta["annotations"] = ["vramsched.io/model-memory"]
            case "annotation-int":
                annotations["vramsched.io/model-memory"] = 17179869184
            case "priority-str":
                spec["priority"] = "high"
            case "priority-float":
                spec["priority"] = 1.5
            case "priority-huge":
                spec["priority"] = 2**80
            case "status-list":
                p["status"] = ["Pending"]
            case "phase-list":
                p["status"] = {"phase": ["Running"]}
            case "phase-succeeded":
                p["status"] = {"phase": "Succeeded"}
            case "node-name":
                spec["nodeName"] = draw(node_names)
            case "node-name-int":
                spec["nodeName"] = 3
            case "uid-int":
                meta["uid"] = 12
            case "namespace-int":
                meta["namespace"] = 12
            case "init-huge":
                spec["initContainers"] = [{"resources": {"limits": {resource: "1e30"}}}]
            case "two-gpu-resources" if isinstance(containers, list):
                containers.append({"resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}})
            case "assignment-bogus":
                annotations["vramsched.io/assignment"] = draw(
                    st.sampled_from(
                        [
                            '{"node":"a100-0","devices":["0"],"bytesPerDevice":[85899345920000]}',
                            "{",
                            "[]",
                            "null",
                            '{"node":"h100-0","devices":["0","0"],"bytesPerDevice":[1,1]}',
                        ]
                    )
                )
            case "products-odd":
                annotations["vramsched.io/gpu-products"] = draw(
                    st.sampled_from([",,,", "*", "x" * 1000, 5])
                )
            case _:
                pass
    if draw(st.booleans()):
        p[draw(st.text(min_size=1, max_size=8))] = draw(json_values)  # an unknown key
    return p


node_lists = st.one_of(
    st.none(),
    st.lists(node_names, max_size=6),  # duplicates and unknown names included
    st.sampled_from([[], list(NODES), list(NODES) * 3]),
)


def fuzz_node(name: str, garbage: Any) -> dict[str, Any]:
    """A node object with a fresh name (never one holding reservations) and garbage somewhere."""
    base = gpu_node(f"fuzz-{name}")
    base.pop("kind")
    where = abs(hash(name)) % 4
    if where == 0:
        base["metadata"]["labels"]["nvidia.com/gpu.count"] = garbage
    elif where == 1:
        base["status"] = garbage
    elif where == 2:
        base["metadata"]["labels"] = garbage
    else:
        base["status"]["allocatable"] = {"nvidia.com/gpu": garbage}
    return base


# ----- tests ----------------------------------------------------------------------------------------
@FUZZ
@given(
    verb=st.sampled_from(VERBS),
    body=st.one_of(
        st.binary(max_size=300),
        st.text(max_size=200).map(str.encode),
        json_values.map(orjson.dumps),
        st.sampled_from(
            [
                b"",
                b"null",
                b"{}",
                b"[]",
                b"true",
                b"0",
                b'"Pod"',
                b"{'Pod': 1}",
                b'{"Pod":',
                b"\xff\xfe",
                b'{"Pod": {}, "Pod": null}',
                b"\x00" * 64,
                b'{"Pod": NaN}',
                b'{"Pod": Infinity}',
            ]
        ),
    ),
)
def test_garbage_bodies_are_refused_with_an_error(driver: Driver, verb: str, body: bytes) -> None:
    status, _ = driver.send(verb, body)
    if body.strip()[:1] != b"{":
        assert status == 400


@settings(FUZZ, max_examples=40)
@given(
    verb=st.sampled_from(VERBS),
    depth=st.integers(min_value=100, max_value=20000),
    inside=st.booleans(),
)
def test_deeply_nested_json_is_refused_or_survived(
    driver: Driver, verb: str, depth: int, inside: bool
) -> None:
    nested = b"[" * depth + b"]" * depth
    body = b'{"Pod": {"metadata": {"name": "deep"}, "x": ' + nested + b"}}" if inside else nested
    driver.send(verb, body)


@FUZZ
@given(
    verb=st.sampled_from(VERBS),
    envelope=st.dictionaries(
        st.one_of(
            st.sampled_from(
                [
                    "Pod",
                    "Nodes",
                    "NodeNames",
                    "PodName",
                    "PodNamespace",
                    "PodUID",
                    "Node",
                    "NodeNameToVictims",
                    "NodeNameToMetaVictims",
                    "pod",
                    "nodenames",
                ]
            ),
            st.text(max_size=10),
        ),
        json_values,
        max_size=6,
    ),
)
def test_wrong_types_missing_null_and_unknown_keys(
    driver: Driver, verb: str, envelope: dict[str, Any]
) -> None:
    driver.send(verb, dumps(envelope))


@FUZZ
@given(the_pod=adversarial_pods(), nodes=node_lists, verb=st.sampled_from(["filter", "prioritize"]))
def test_adversarial_pods_filter_and_prioritize(
    driver: Driver, the_pod: dict, nodes: list | None, verb: str
) -> None:
    status, body = driver.send(verb, dumps({"Pod": the_pod, "NodeNames": nodes}))
    if any(len(n) > 253 for n in nodes or []):
        assert (
            status == 400 and "NodeNames" in body["Error"]
        )  # not a Kubernetes name: the envelope is wrong
        return
    assert status == 200
    if verb == "prioritize":  # unknown nodes get no score, which kube-scheduler reads as no opinion
        assert {h["Host"] for h in body} <= set(nodes or [])
        assert all(0 <= h["Score"] <= 10 for h in body)
    elif not body["Error"]:
        sent = set(nodes or [])
        assert set(body["NodeNames"]) <= sent
        assert set(body["NodeNames"]).isdisjoint(body["FailedNodes"]) and set(
            body["NodeNames"]
        ).isdisjoint(body["FailedAndUnresolvableNodes"])


@FUZZ
@given(
    the_pod=adversarial_pods(),
    node=node_lists.filter(bool),
    uid=st.sampled_from(["", "u-1", "other"]),
    twice=st.booleans(),
)
def test_adversarial_pods_bind(
    driver: Driver, the_pod: dict, node: list, uid: str, twice: bool
) -> None:
    """Filter (which is how embedded mode learns a pending pod), then bind it, maybe twice."""
    driver.send("filter", dumps({"Pod": the_pod, "NodeNames": list(NODES)}))
    meta = the_pod.get("metadata") if isinstance(the_pod.get("metadata"), dict) else {}
    args = {
        "PodName": meta.get("name"),
        "PodNamespace": meta.get("namespace") or "default",
        "PodUID": uid,
        "Node": node[0],
    }
    for _ in range(2 if twice else 1):
        status, body = driver.send("bind", dumps(args))
    key = f"{args['PodNamespace']}/{args['PodName']}"
    held = driver.cluster.ledger.reservation(key)
    if held is not None:  # bound at most once, and where the API (here: the cluster) says
        assert (driver.cluster.pods[key].get("spec") or {}).get("nodeName") == held.node


@FUZZ
@given(
    the_pod=adversarial_pods(),
    meta_victims=st.one_of(
        st.none(),
        st.dictionaries(
            node_names,
            st.fixed_dictionaries(
                {
                    "Pods": st.lists(
                        st.fixed_dictionaries({"UID": st.sampled_from(["u-1", "", "zz"])}),
                        max_size=3,
                    )
                },
                optional={"NumPDBViolations": st.sampled_from([0, 1, -1, 2**62])},
            ),
            max_size=3,
        ),
    ),
    full_victims=st.one_of(
        st.none(),
        st.dictionaries(
            node_names,
            st.fixed_dictionaries(
                {
                    "Pods": st.lists(
                        st.one_of(adversarial_pods(), st.just({"metadata": ["x"]})), max_size=2
                    )
                }
            ),
            max_size=2,
        ),
    ),
)
def test_adversarial_preempt(
    driver: Driver, the_pod: dict, meta_victims: Any, full_victims: Any
) -> None:
    status, body = driver.send(
        "preempt",
        dumps(
            {
                "Pod": the_pod,
                "NodeNameToMetaVictims": meta_victims,
                "NodeNameToVictims": full_victims,
            }
        ),
    )
    if status == 200:
        proposed = meta_victims if meta_victims is not None else (full_victims or {})
        assert set(body["NodeNameToMetaVictims"]) <= set(proposed)


@settings(FUZZ, max_examples=60)
@given(
    garbage=st.one_of(json_values, bad_quantities),
    name=st.text(min_size=1, max_size=8),
    verb=st.sampled_from(["filter", "prioritize"]),
)
def test_full_node_objects_with_garbage(driver: Driver, garbage: Any, name: str, verb: str) -> None:
    """nodeCacheCapable=false: the scheduler sends whole Nodes, which the extender must survive."""
    nodes = [fuzz_node(name, garbage), {"metadata": garbage}, {"metadata": {"name": garbage}}]
    status, body = driver.send(
        verb, dumps({"Pod": pod("p-nodes", "16Gi"), "Nodes": {"items": nodes}})
    )
    assert status == 200


# ----- fixed adversarial cases (regressions and limits) ----------------------------------------------
def test_body_over_the_limit_is_413_and_changes_nothing(driver: Driver) -> None:
    big = dumps({"Pod": pod("big", "16Gi"), "NodeNames": ["x" * 200] * (MAX_BODY // 200)})
    assert len(big) > MAX_BODY
    status, body = driver.send("filter", big)
    assert status == 413 and body["Error"]


def test_large_body_under_the_limit_is_served(driver: Driver) -> None:
    p = pod("large-annotations", "16Gi")
    p["metadata"]["annotations"]["note"] = "x" * (MAX_BODY - 4096)
    status, body = driver.send("filter", dumps({"Pod": p, "NodeNames": list(NODES)}))
    assert status == 200 and body["Error"] == "" and "a100-0" in body["NodeNames"]


def test_deeply_nested_node_echoed_back_by_filter(driver: Driver) -> None:
    """Regression: full-Nodes filter echoes the nodes it keeps, and a Node nested deeper than the JSON
    encoder's limit (~250 levels; orjson reads up to 1024) made that a 500. Now: 200 with `Error`."""

    def node_nested(name: str, depth: int) -> dict[str, Any]:
        node = gpu_node(name)
        node.pop("kind")
        nested: Any = []
        for _ in range(depth):
            nested = [nested]
        node["extra"] = nested
        return node

    deep = node_nested("fuzz-deep", 600)
    status, body = driver.send(
        "filter", dumps({"Pod": pod("deep-0", "16Gi"), "Nodes": {"items": [deep]}})
    )
    assert status == 200 and "nested too deeply" in body["Error"]
    fine = node_nested("fuzz-deep", 200)
    status, body = driver.send(
        "filter", dumps({"Pod": pod("deep-1", "16Gi"), "Nodes": {"items": [fine]}})
    )
    assert status == 200 and body["Error"] == "" and body["Nodes"]["items"] == [fine]


def test_filter_body_cannot_write_a_bound_pod_into_the_ledger(driver: Driver) -> None:
    """Regression: a filter body claiming `nodeName` plus an assignment used to be recorded as bound
    (in embedded mode), oversubscribing a GPU through `record()`."""
    forged = pod(
        "forged",
        "900Gi",
        node="h100-0",
        phase="Running",
        annotations={
            "vramsched.io/assignment": '{"node":"h100-0","devices":["0"],"bytesPerDevice":[966367641600]}'
        },
    )
    before = driver.snapshot()
    driver.send("filter", dumps({"Pod": forged, "NodeNames": list(NODES)}))
    assert driver.snapshot() == before
    assert driver.cluster.ledger.reservation("default/forged") is None


def test_filter_body_cannot_release_a_running_pod(driver: Driver) -> None:
    """A pod sent as Succeeded (or re-created with another UID) must not free a running pod's VRAM."""
    for variant in (
        pod("running-0", "24Gi", namespace="inference", phase="Succeeded"),
        pod("running-0", "24Gi", namespace="inference", uid="another-uid"),
    ):
        before = driver.snapshot()
        driver.send("filter", dumps({"Pod": variant, "NodeNames": list(NODES)}))
        assert driver.snapshot() == before
    assert driver.cluster.ledger.reservation("inference/running-0") is not None


def test_bad_pod_with_nodes_leaves_inventory_alone(driver: Driver) -> None:
    """A filter answered with `Error` does not take the Nodes it was sent either."""
    bad = pod("bad-nodes", "16Gx")
    node = gpu_node("a100-0", count=1)  # would shrink a100-0 from 4 GPUs to 1
    node.pop("kind")
    before = driver.snapshot()
    status, body = driver.send("filter", dumps({"Pod": bad, "Nodes": {"items": [node]}}))
    assert status == 200 and "16Gx" in body["Error"]
    assert driver.snapshot() == before


def test_absurd_but_valid_demands_fit_nowhere(driver: Driver) -> None:
    for name, memory, gpus in (
        ("huge-mem", "64Ti", 1),
        ("many-gpus", "16Gi", 64),
        ("zero-gpus", None, 0),
    ):
        p = pod(name, memory, gpus=gpus)
        status, body = driver.send("filter", dumps({"Pod": p, "NodeNames": list(NODES)}))
        assert status == 200
        if gpus:
            assert body["NodeNames"] == [] and body["Error"] == ""
            status, body = driver.send(
                "bind", dumps({"PodName": name, "PodNamespace": "default", "Node": "h100-0"})
            )
            assert body["Error"]


def test_preempt_full_victims_with_malformed_metadata(driver: Driver) -> None:
    """Regression: a victim Pod whose metadata was not an object made preempt a 500."""
    victims = {
        "h100-0": {
            "Pods": [{"metadata": ["x"]}, {"metadata": {"uid": 7}}, {}],
            "NumPDBViolations": 0,
        }
    }
    status, body = driver.send(
        "preempt",
        dumps({"Pod": pod("preemptor", "16Gi", priority=100), "NodeNameToVictims": victims}),
    )
    assert status == 200 and set(body["NodeNameToMetaVictims"]) <= {"h100-0"}


async def test_embedded_mode_keeps_a_bounded_number_of_learned_pending_pods(monkeypatch) -> None:
    """A long-running embedded server is asked about endless unschedulable pods: it must not keep them all."""
    import extender.embedded as embedded
    from extender.wire import ExtenderArgs, ExtenderBindingArgs

    monkeypatch.setattr(embedded, "MAX_LEARNED_PENDING", 50)
    state = cluster(gpu_node("n0", count=1), pod("from-file", "16Gi"))
    s = service(state)
    for i in range(200):
        s.filter(ExtenderArgs(Pod=pod(f"big-{i}", "1Ti"), NodeNames=["n0"]))  # fits nowhere
        if i == 100:
            s.filter(ExtenderArgs(Pod=pod("fits", "16Gi"), NodeNames=["n0"]))
            assert (
                await s.bind(ExtenderBindingArgs(PodName="fits", PodNamespace="default", Node="n0"))
            ).Error == ""
    learned = [k for k in state.pods if k.startswith("default/big-")]
    assert len(learned) == 50 and "default/big-199" in learned and "default/big-0" not in learned
    assert (
        "default/from-file" in state.pods and state.pods["default/fits"]["spec"]["nodeName"] == "n0"
    )
    assert check_cluster(state) == []
