"""Nodes served by vramsched's device plugin (label vramsched.io/device-plugin=true): exact per-GPU
books whatever the replica policy, and no GPU offered unless the plugin reports it served."""

from __future__ import annotations

import asyncio
from typing import Any

from builders import cluster, gpu_node, pod, service

from extender.demand import PodRef, pod_demand
from extender.inventory import node_inventory
from extender.ledger import Reservation
from extender.placement import choose_devices, filter_nodes
from extender.plugin_state import STATE_ANNOTATION, PluginState, encode_state
from extender.wire import ExtenderBindingArgs

GIB = 1024**3
SERVING = PluginState(True, 2, 4)


def served_node(
    name: str = "ts",
    *,
    state: PluginState | None = SERVING,
    allocatable: int | None = None,
    count: int = 2,
    replicas: int = 4,
    raw_state: str | None = None,
) -> dict[str, Any]:
    """An L4 node (2 x 22.49Gi, 4 replicas) under vramsched's plugin, which reports `state`."""
    node = gpu_node(
        name,
        count=count,
        memory_mib=23034,
        replicas=replicas,
        allocatable=allocatable,
        extra_labels={"vramsched.io/device-plugin": "true"},
    )
    if raw_state is not None or state is not None:
        node["metadata"]["annotations"] = {STATE_ANNOTATION: raw_state or encode_state(state)}
    return node


def hold(c, node: str, *holds: tuple[str, int, int]):
    for name, gpu, gib in holds:
        c.ledger.reserve(
            Reservation(PodRef("default", name, name), node, (str(gpu),), (gib * GIB,))
        )
    return c


def test_served_nodes_keep_exact_books_under_the_stock_plugin_policy() -> None:
    # The stock plugin could put the two 12s together (docs/live.md): distributed refuses a
    # second 12 on an unlabelled node; vramsched's plugin puts it where the books say.
    for policy in ("distributed", "packed", "pinned"):
        plain = hold(
            cluster(gpu_node("ts", count=2, memory_mib=23034, replicas=4), replica_policy=policy),
            "ts",
            ("a", 0, 12),
            ("b", 0, 8),
            ("c", 1, 8),
        )
        assert filter_nodes(plain.ledger, pod_demand(pod("d", "12Gi")), ["ts"]).feasible == []
        served = hold(
            cluster(served_node(), replica_policy=policy),
            "ts",
            ("a", 0, 12),
            ("b", 0, 8),
            ("c", 1, 8),
        )
        assert filter_nodes(served.ledger, pod_demand(pod("d", "12Gi")), ["ts"]).feasible == ["ts"]
        res = choose_devices(served.ledger, pod_demand(pod("d", "12Gi")), "ts")
        assert res.device_ids == ("1",)  # the only GPU with 12Gi free: exact, best fit
        # a GPU's VRAM and replicas still bound it
        assert filter_nodes(served.ledger, pod_demand(pod("e", "16Gi")), ["ts"]).feasible == []


def test_served_gpus_are_the_healthy_ones_the_plugin_reports() -> None:
    inv = node_inventory(served_node(state=PluginState(True, 2, 4, (0,)), allocatable=4))
    assert inv.problem is None
    assert [(d.index, d.plugin_served) for d in inv.devices] == [(1, True)]
    assert node_inventory(gpu_node("x", replicas=4)).devices[0].plugin_served is False


def test_a_served_node_without_a_working_plugin_offers_nothing() -> None:
    cases = {
        "has not reported": served_node(state=None),
        "is not registered with the kubelet": served_node(state=PluginState(False, 2, 4)),
        "is unreadable": served_node(raw_state="{oops"),
        "serves 2 replicas per GPU, label nvidia.com/gpu.replicas says 4": served_node(
            state=PluginState(True, 2, 2)
        ),
        # the kubelet lost the plugin (crash, restart): allocatable drops before any annotation
        "not serving: allocatable nvidia.com/gpu is 0": served_node(allocatable=0),
    }
    for says, node in cases.items():
        inv = node_inventory(node)
        assert inv.devices == () and says in (inv.problem or ""), (says, inv.problem)


def test_bind_refuses_a_served_node_whose_plugin_is_down() -> None:
    c = cluster(served_node(allocatable=0), pod("p", "4Gi"))
    out = asyncio.run(
        service(c).bind(ExtenderBindingArgs(PodName="p", PodNamespace="default", Node="ts"))
    )
    assert out.Error == (
        "node ts cannot serve GPUs: vramsched's device plugin is not serving: allocatable "
        "nvidia.com/gpu is 0, 2 healthy GPUs x 4 expected"
    )
    assert c.ledger.reservation("default/p") is None


def test_pods_reading_the_gpu_index_may_go_to_served_nodes() -> None:
    from extender.placement.pin_rule import annotation_pin_refusal

    served = node_inventory(served_node())
    assert annotation_pin_refusal(served.devices, "nvidia.com/gpu", "distributed") is None
    plain = node_inventory(gpu_node("x", replicas=4))
    assert annotation_pin_refusal(plain.devices, "nvidia.com/gpu", "distributed") is not None
