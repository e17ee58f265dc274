"""/metrics: the per-GPU gauges, the health gauges and the pending classes, as a scraper reads them."""

from __future__ import annotations

import gzip

from builders import assigned, cluster, gpu_node, mig_mixed_node, pod, service
from prometheus_client.parser import text_string_to_metric_families

from extender.observe.collector import HealthCollector
from extender.observe.gpu_metrics import GpuExposition, escape_label
from extender.observe.leader import LeaseLeader, holds, parse_lease_name
from extender.observe.pending import outcome_class, reason_kind
from extender.server import create_app
from extender.wire import ExtenderArgs

GIB = 1 << 30


def _samples(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _gpu(node: str, gpu: str, product: str, sharing: str) -> tuple:
    return tuple(sorted({"node": node, "gpu": gpu, "product": product, "sharing": sharing}.items()))


def _cluster():
    return cluster(
        gpu_node("ts", count=2, replicas=2),
        mig_mixed_node("mig", {"3g.40gb": (2, 40192)}),
        pod("a", "30Gi", node="ts", annotations=assigned("ts", "0", 30)),
        pod(
            "m",
            "20Gi",
            node="mig",
            resource="nvidia.com/mig-3g.40gb",
            annotations=assigned("mig", "0:3g.40gb:1", 20),
        ),
    )


def test_one_series_per_device_with_the_ledgers_figures() -> None:
    c = _cluster()
    got = _samples(GpuExposition(lambda: c.ledger).render().decode())
    ts0 = _gpu("ts", "0", "NVIDIA-A100-SXM4-80GB-SHARED", "time-slicing")
    slice1 = _gpu("mig", "0:3g.40gb:1", "NVIDIA-A100-SXM4-80GB", "mig")
    assert got["vramsched_gpu_memory_bytes"][ts0] == 80 * GIB
    assert got["vramsched_gpu_memory_allocated_bytes"][ts0] == 30 * GIB
    assert got["vramsched_gpu_replicas"][ts0] == 2
    assert got["vramsched_gpu_replicas_allocated"][ts0] == 1
    assert got["vramsched_gpu_memory_bytes"][slice1] == 40192 << 20
    assert got["vramsched_gpu_memory_allocated_bytes"][slice1] == 20 * GIB
    # every device of the ledger, once per family
    assert all(len(v) == len(c.ledger.arrays.devices) for v in got.values())


def test_scrape_after_changes_equals_a_fresh_render() -> None:
    c = _cluster()
    exp = GpuExposition(lambda: c.ledger, chunk=2)  # several pieces per family
    first = exp.render()
    c.upsert_pod(pod("b", "40Gi", node="ts", annotations=assigned("ts", "1", 40)))
    c.delete_pod("default/a")
    second = exp.render()
    assert second != first
    assert second == GpuExposition(lambda: c.ledger).render()
    got = _samples(second.decode())["vramsched_gpu_memory_allocated_bytes"]
    assert got[_gpu("ts", "0", "NVIDIA-A100-SXM4-80GB-SHARED", "time-slicing")] == 0
    assert got[_gpu("ts", "1", "NVIDIA-A100-SXM4-80GB-SHARED", "time-slicing")] == 40 * GIB
    c.upsert_node(gpu_node("new", count=1))  # inventory changed: labels built again
    third = _samples(exp.render().decode())
    assert (
        third["vramsched_gpu_memory_bytes"][_gpu("new", "0", "NVIDIA-A100-SXM4-80GB", "exclusive")]
        == 80 * GIB
    )


def _big_cluster(gpus: int = 8):
    """One node of `gpus` exclusive GPUs, a 10Gi pod on each."""
    return cluster(
        gpu_node("n", count=gpus),
        *(
            pod(f"p{i}", "10Gi", node="n", annotations=assigned("n", str(i), 10))
            for i in range(gpus)
        ),
    )


def test_changed_lines_are_written_a_chunk_at_a_time() -> None:
    """Thousands of devices change between two scrapes under churn: their lines are written
    `step` at a time, with a pause (an empty piece: the server serves requests there) between."""
    c = _big_cluster()
    exp = GpuExposition(lambda: c.ledger, step=4)  # 2 devices (4 lines) per pause
    exp.render()
    for i in range(8):
        c.delete_pod(f"default/p{i}")
    pieces = list(exp.pieces())
    first_header = next(i for i, p in enumerate(pieces) if p.startswith(b"# HELP"))
    assert pieces[:first_header] == [b""] * 4  # 8 changed devices, 2 per step
    assert b"".join(pieces) == GpuExposition(lambda: c.ledger).render()


def test_two_interleaved_scrapes_end_with_the_latest_values() -> None:
    """Two scrapers (an HA pair of Prometheus servers) whose refreshes interleave while the
    ledger keeps changing: each scrape is whole, and the next one shows the ledger as it is."""
    c = _big_cluster()
    exp = GpuExposition(lambda: c.ledger, step=2)  # one device per step
    exp.render()
    for i in range(4):
        c.delete_pod(f"default/p{i}")
    one = exp.pieces()
    next(one)  # the first scrape wrote one device of four...
    c.delete_pod("default/p6")  # ...the ledger changes...
    two = b"".join(exp.pieces())  # ...a second scrape runs whole in between...
    c.upsert_pod(pod("q", "30Gi", node="n", annotations=assigned("n", "1", 30)))
    rest = b"".join(one)  # ...and the first one finishes
    fresh = GpuExposition(lambda: c.ledger).render()
    for text in (two, rest):
        assert len(_samples(text.decode())["vramsched_gpu_memory_allocated_bytes"]) == 8
    # the second scrape wrote what the first had not reached: no line older than it
    seen = _samples(two.decode())["vramsched_gpu_memory_allocated_bytes"]
    for i in (0, 1, 2, 3, 6):
        assert seen[_gpu("n", str(i), "NVIDIA-A100-SXM4-80GB", "exclusive")] == 0, i
    assert exp.render() == fresh
    got = _samples(fresh.decode())["vramsched_gpu_memory_allocated_bytes"]
    assert got[_gpu("n", "1", "NVIDIA-A100-SXM4-80GB", "exclusive")] == 30 * GIB
    assert got[_gpu("n", "6", "NVIDIA-A100-SXM4-80GB", "exclusive")] == 0


def test_label_values_are_escaped() -> None:
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


async def test_metrics_endpoint_gzip_health_and_pending_classes(aiohttp_client) -> None:
    c = cluster(
        gpu_node("n", count=1, replicas=2, memory_mib=81920),
        pod("held", "60Gi", node="n", annotations=assigned("n", "0", 60)),
        pod("vram", "30Gi"),  # 20Gi free on the only GPU, a replica free: waits on VRAM
        pod("never", "100Gi"),  # no GPU is that large
        pod("fits", "10Gi"),
        pod("unasked", "1Gi"),
    )
    svc = service(c)
    client = await aiohttp_client(create_app(svc))
    for name in ("vram", "never", "fits"):
        body = ExtenderArgs.model_validate({"Pod": c.pod(f"default/{name}"), "NodeNames": ["n"]})
        resp = await client.post("/filter", data=body.model_dump_json())
        assert resp.status == 200
    resp = await client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert resp.headers["Content-Encoding"] == "gzip"
    raw = await resp.read()  # aiohttp's client inflates it
    text = raw.decode()
    got = _samples(text)
    assert got["vramsched_build_info"] == {(("version", "0.1.0"),): 1.0}
    assert got["vramsched_ready"][()] == 1 and got["vramsched_leader"][()] == 1
    assert got["vramsched_informer_stale_seconds"][(("resource", "pods"),)] == 0
    pending = {k[0][1]: v for k, v in got["vramsched_pods_pending"].items()}
    assert pending == {
        "fits": 1,
        "vram": 1,
        "replicas": 0,
        "other": 0,
        "unschedulable": 1,
        "invalid": 0,
        "unfiltered": 1,
    }
    assert "vramsched_requests_total" in got  # the registry's own families are still there
    n0 = _gpu("n", "0", "NVIDIA-A100-SXM4-80GB-SHARED", "time-slicing")
    assert got["vramsched_gpu_memory_allocated_bytes"][n0] == 60 * GIB
    plain = await client.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert "Content-Encoding" not in plain.headers
    assert gzip.compress(await plain.read())  # plain text, same families
    c.delete_pod("default/vram")
    got = _samples((await (await client.get("/metrics")).read()).decode())
    assert {k[0][1]: v for k, v in got["vramsched_pods_pending"].items()}["vram"] == 0


def test_reason_kinds_follow_placements_wording() -> None:
    assert reason_kind("no GPU with 30Gi free") == "vram"
    assert reason_kind("only 1 of 2 GPUs with 30Gi free") == "vram"
    assert reason_kind("device plugin (distributed) may stack 90Gi on a 80Gi GPU") == "vram"
    assert (
        reason_kind("all GPU replicas in use: 0 of 1 needed GPUs have a free replica") == "replicas"
    )
    assert (
        outcome_class(
            False,
            [
                "all GPU replicas in use: 0 of 1 needed GPUs have a free replica",
                "no GPU with 1Gi free",
            ],
        )
        == "vram"
    )
    assert outcome_class(False, []) == "unschedulable"
    assert outcome_class(True, []) == "fits"


def test_health_collector_reports_informer_outage() -> None:
    detail = {
        "informers": {
            "nodes": {"synced": True, "downForS": 0.0},
            "pods": {"synced": False, "downForS": 42.5},
        }
    }
    col = HealthCollector(ready=lambda: (False, detail), pending=lambda: {}, leader=lambda: False)
    got = {(s.name, tuple(s.labels.items())): s.value for f in col.collect() for s in f.samples}
    assert got[("vramsched_informer_stale_seconds", (("resource", "pods"),))] == 42.5
    assert got[("vramsched_informer_synced", (("resource", "pods"),))] == 0
    assert got[("vramsched_ready", ())] == 0 and got[("vramsched_leader", ())] == 0
    unknown = HealthCollector(ready=lambda: (True, {}), pending=lambda: {}, leader=lambda: None)
    assert "vramsched_leader" not in {f.name for f in unknown.collect()}


def test_leader_is_the_lease_holders_hostname() -> None:
    lease = {"spec": {"holderIdentity": "vramsched-6d5f-abcde_0f1e2d3c-aaaa-bbbb"}}
    assert holds(lease, "vramsched-6d5f-abcde")
    assert not holds(lease, "vramsched-6d5f-zzzzz")
    assert not holds({"spec": {}}, "x")  # a Lease nobody holds (between two leaders)
    assert holds(None, "x")  # no Lease: no election, the only replica leads
    answers = iter([lease, RuntimeError("apiserver away"), {"spec": {"holderIdentity": "other_1"}}])

    def read():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    leader = LeaseLeader(read, identity="vramsched-6d5f-abcde")
    assert leader.value() is None
    leader.poll()
    assert leader.value() is True
    leader.poll()  # an error keeps the last answer
    assert leader.value() is True and leader.errors == 1
    leader.poll()
    assert leader.value() is False
    assert parse_lease_name("vramsched/vramsched") == ("vramsched", "vramsched")
    for bad in ("vramsched", "/x", "a/b/c"):
        try:
            parse_lease_name(bad)
        except ValueError as exc:
            assert "NAMESPACE/NAME" in str(exc)
        else:
            raise AssertionError(bad)
