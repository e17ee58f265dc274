"""The usage report: the ledger's books per device, `/state` both ways, filters, order, summary."""

from __future__ import annotations

import asyncio

from builders import assigned, cluster, gpu_node, mig_mixed_node, pod, service

from extender.observe.usage import (
    report_dict,
    select,
    sort_nodes,
    state_nodes,
    summarize,
    usage_from_ledger,
    usage_from_state,
)
from extender.wire import ExtenderBindingArgs

GIB = 1 << 30
MIB = 1 << 20


def _demo():
    return cluster(
        gpu_node("ts", count=2, replicas=2),  # time-sliced: 2 pods per GPU
        gpu_node("ex", count=2),  # exclusive
        mig_mixed_node("mig", {"3g.40gb": (2, 40192), "1g.10gb": (1, 9728)}),
        pod("a", "30Gi", node="ts", namespace="team-a", annotations=assigned("ts", "0", 30)),
        pod("b", "40Gi", node="ts", namespace="team-b", annotations=assigned("ts", "0", 40)),
        pod("c", "10Gi", node="ex", namespace="team-a", annotations=assigned("ex", "1", 10)),
        pod("d", None, node="ex", namespace="team-b"),  # undeclared: a whole GPU, guessed
        pod(
            "e",
            "20Gi",
            node="mig",
            resource="nvidia.com/mig-3g.40gb",
            annotations=assigned("mig", "0:3g.40gb:0", 20),
        ),
    )


def test_rows_are_the_ledgers_books_with_each_pods_share_and_declared_memory() -> None:
    c = _demo()
    nodes = {n.name: n for n in usage_from_ledger(c.ledger, c.pods)}
    ts0 = nodes["ts"].devices[0]
    assert (ts0.used, ts0.used_replicas, ts0.replicas) == (70 * GIB, 2, 2)
    assert [(p.key, p.bytes, p.model_memory) for p in ts0.pods] == [
        ("team-a/a", 30 * GIB, 30 * GIB),
        ("team-b/b", 40 * GIB, 40 * GIB),
    ]
    # both replicas taken: the last 10Gi can hold no pod
    assert ts0.full and ts0.stranded == 10 * GIB
    ex = nodes["ex"].devices
    assert ex[1].stranded == 70 * GIB  # exclusive GPU, 10Gi used by its only pod
    (guess,) = [d for d in ex if any(p.key == "team-b/d" for p in d.pods)]
    assert guess.pods[0].model_memory is None and guess.used == guess.memory
    mig = nodes["mig"].devices
    assert {d.device_id for d in mig} == {"0:3g.40gb:0", "0:3g.40gb:1", "0:1g.10gb:0"}
    assert all(d.sharing == "mig" for d in mig)
    assert [p.key for d in mig for p in d.pods] == ["default/e"]


def test_state_round_trip_and_old_keys_kept() -> None:
    c = _demo()
    state = service(c).state()
    assert usage_from_state(state) == usage_from_ledger(c.ledger, c.pods)
    ts = state["nodes"][0]["gpus"][0]
    # the keys /state had before `holders` are all there, with the same values
    assert ts["pods"] == ["team-a/a", "team-b/b"] and ts["usedBytes"] == 70 * GIB
    assert ts["holders"][1] == {"pod": "team-b/b", "bytes": 40 * GIB, "modelMemory": 40 * GIB}
    mig_gpu = state["nodes"][2]["gpus"][0]
    assert mig_gpu["sharing"] == "mig" and len(mig_gpu["slices"]) == 3
    assert mig_gpu["memoryBytes"] == sum(s["memoryBytes"] for s in mig_gpu["slices"])
    # an extender from before `holders`: pods by key, bytes unknown
    for g in state["nodes"][0]["gpus"]:
        del g["holders"]
    assert [p.bytes for p in usage_from_state(state)[0].devices[0].pods] == [None, None]


def test_state_follows_a_bind() -> None:
    c = cluster(gpu_node("n", count=1, replicas=4), pod("p", "12Gi"))
    svc = service(c)
    result = asyncio.run(
        svc.bind(
            ExtenderBindingArgs(
                PodName="p",
                PodNamespace="default",
                PodUID=c.pod("default/p")["metadata"]["uid"],
                Node="n",
            )
        )
    )
    assert not result.Error
    (d,) = usage_from_state(svc.state())[0].devices
    assert d.used == 12 * GIB and d.pods[0].key == "default/p"
    assert state_nodes(usage_from_ledger(c.ledger, c.pods)) == svc.state()["nodes"]


def test_filters_sort_and_summary() -> None:
    nodes = usage_from_ledger(_demo().ledger, _demo().pods)
    assert [n.name for n in select(nodes, node="m*")] == ["mig"]
    assert [n.name for n in select(nodes, product="a100")] == ["ts", "ex", "mig"]
    assert select(nodes, product="h100") == []
    team_a = select(nodes, namespace="team-a")
    assert [(n.name, [d.device_id for d in n.devices]) for n in team_a] == [
        ("ts", ["0"]),
        ("ex", ["1"]),
    ]
    assert [p.key for p in team_a[0].devices[0].pods] == ["team-a/a"]  # team-b's pod hidden
    assert team_a[0].devices[0].used == 70 * GIB  # the device's own figure
    # most stranded first: ex (70Gi beside its 10Gi pod), mig (the 3g.40gb slice's 19.25Gi
    # beside its 20Gi pod: a slice holds one pod), ts (10Gi beside its two pods)
    assert [n.name for n in sort_nodes(nodes)] == ["ex", "mig", "ts"]
    assert [n.name for n in sort_nodes(nodes, "name")] == ["ex", "mig", "ts"]
    s = summarize(nodes)
    # physical GPUs: ts 2, ex 2, mig 1; in use: ts/0, ex/0 (guess), ex/1, mig/0
    assert (s.gpus, s.gpus_in_use, s.gpus_free) == (5, 4, 1)
    assert s.stranded == 70 * GIB + (40192 * MIB - 20 * GIB) + 10 * GIB
    assert s.pods == 5 and s.nodes == 3
    doc = report_dict(nodes, s)
    assert doc["summary"]["gpusFree"] == 1
    assert doc["nodes"][0]["devices"][0]["pods"][0]["pod"] == "team-a/a"
