"""`why`: filter's reasons grouped, the event text, the closest node and what would make it fit."""

from __future__ import annotations

import random

from builders import assigned, cluster, gpu_node, mig_mixed_node, pod
from test_node_summary import _random_node, _random_pod, _random_step

from extender.demand import pod_demand
from extender.ledger import Reservation
from extender.observe.why import describe_closest, event_text, explain, explanation_dict
from extender.placement import choose_devices

GIB = 1 << 30


def test_groups_event_closest_and_fewest_removals() -> None:
    c = cluster(
        gpu_node("a", count=1, replicas=4),  # 80Gi: 30 + 30 held -> 20Gi free
        gpu_node("b", count=1, replicas=4),  # 80Gi: 10 + 20 + 40 held -> 10Gi free
        gpu_node("small", count=2, memory_mib=24576, product="NVIDIA-L4"),
        {"kind": "Node", "metadata": {"name": "cpu"}, "status": {}},
        pod("a1", "30Gi", node="a", annotations=assigned("a", "0", 30), priority=5),
        pod("a2", "30Gi", node="a", annotations=assigned("a", "0", 30)),
        pod("b1", "10Gi", node="b", annotations=assigned("b", "0", 10)),
        pod("b2", "20Gi", node="b", annotations=assigned("b", "0", 20)),
        pod("b3", "40Gi", node="b", annotations=assigned("b", "0", 40)),
        pod("want", "45Gi", priority=1),
    )
    e = explain(c.ledger, c.pod("default/want"), pods=c.pods)
    assert e.feasible == [] and e.nodes == 4
    groups = {r: (ns, u) for r, ns, u in e.groups}
    assert groups["no GPU with 45Gi free"] == (["a", "b"], False)
    assert groups["need 45Gi per GPU, GPUs have 24Gi"] == (["small"], True)
    assert groups["not a GPU node: missing label nvidia.com/gpu.product"] == (["cpu"], True)
    # kube-scheduler's FitError wording: counts and reasons sorted as strings
    assert event_text(e) == (
        "0/4 nodes are available: 1 need 45Gi per GPU, GPUs have 24Gi, "
        "1 not a GPU node: missing label nvidia.com/gpu.product, 2 no GPU with 45Gi free."
    )
    # a misses by 25Gi, b by 35Gi: a is closest; removing one 30Gi pod leaves 50Gi free.
    # a2 (priority 0) goes rather than a1 (priority 5): it may be preempted (want is 1)
    cl = e.closest
    assert (cl.node, cl.short_bytes) == ("a", 25 * GIB)
    assert [p.key for p in cl.remove] == ["default/a2"] and cl.preemptible
    assert "fits once default/a2 (30Gi) is gone" in describe_closest(cl)
    assert "`serve --preempt` for VRAM" in describe_closest(cl)
    doc = explanation_dict(e)
    assert doc["closest"]["remove"] == [
        {"pod": "default/a2", "bytes": 30 * GIB, "modelMemory": 30 * GIB}
    ]


def test_no_removal_helps_and_higher_priority_holders() -> None:
    c = cluster(
        gpu_node("x", count=1, replicas=2),
        pod("big", "70Gi", node="x", annotations=assigned("x", "0", 70), priority=10),
        pod("want", "75Gi"),
    )
    e = explain(c.ledger, c.pod("default/want"), pods=c.pods)
    assert e.closest.node == "x" and e.closest.short_bytes == 65 * GIB
    assert [p.key for p in e.closest.remove] == ["default/big"]
    assert not e.closest.preemptible  # big outranks want: only deleting it frees the GPU
    c2 = cluster(gpu_node("y", count=1, replicas=2), pod("want", "79Gi", gpus=2))
    e2 = explain(c2.ledger, c2.pod("default/want"), pods=c2.pods)
    assert e2.closest is None  # one GPU, the pod needs two: refused for good, nothing to free
    assert e2.groups == [("node has 1 GPUs, pod needs 2", ["y"], True)]


def test_fits_now_and_bad_demand() -> None:
    c = cluster(gpu_node("x", count=1), pod("ok", "10Gi"), pod("bad", "lots"))
    e = explain(c.ledger, c.pod("default/ok"))
    assert e.feasible == ["x"] and event_text(e) == "" and e.closest is None
    bad = explain(c.ledger, c.pod("default/bad"))
    assert bad.error and "lots" in bad.error


def test_a_bound_pod_whose_demand_cannot_be_read_says_where_it_is_counted() -> None:
    """A running pod asking two GPU resources is refused by filter but held by the ledger on a
    device of each: `why` says both, and names the pod once."""
    from extender.observe.render import why_renderables

    both = pod("both", None, resource="nvidia.com/mig-1g.10gb", node="m", phase="Running")
    for part in ("requests", "limits"):
        both["spec"]["containers"][0]["resources"][part]["nvidia.com/mig-3g.40gb"] = "1"
    c = cluster(mig_mixed_node("m", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}), both)
    e = explain(c.ledger, c.pod("default/both"), pods=c.pods)
    assert e.error and "several GPU resources" in e.error
    assert e.bound_to == "m" and sorted(e.held) == ["0:1g.10gb:0", "0:3g.40gb:0"]
    lines = [str(r) for r in why_renderables(e)]
    assert lines[0].startswith("pod default/both: requests several") and lines[0].count("pod ") == 1
    assert lines[1] == "bound to m; the ledger counts it on 0:1g.10gb:0, 0:3g.40gb:0"
    assert explanation_dict(e)["heldOn"] == e.held


def test_a_gated_pod_is_said_to_wait_for_its_gates() -> None:
    """A pod Kueue holds with a scheduling gate fits, and `why` said only that: vramsched would
    not refuse it, so kube-scheduler's filters or a backoff must hold it. The gate does."""
    from extender.observe.render import why_renderables

    gated = pod("queued", "10Gi")
    gated["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    c = cluster(gpu_node("x", count=1), gated)
    e = explain(c.ledger, c.pod("default/queued"))
    assert e.feasible == ["x"] and e.gates == ["kueue.x-k8s.io/admission"]
    assert explanation_dict(e)["schedulingGates"] == ["kueue.x-k8s.io/admission"]
    text = " ".join(str(getattr(r, "plain", r)) for r in why_renderables(e))
    assert "held by scheduling gates (kueue.x-k8s.io/admission)" in text
    assert "vramsched would not refuse it" not in text


def test_mig_pod_gets_the_smallest_profile_that_holds_it() -> None:
    c = cluster(
        mig_mixed_node("m", {"1g.10gb": (2, 9728), "3g.40gb": (1, 40192)}),
        pod("want", "15Gi", resource="nvidia.com/mig-1g.10gb"),
    )
    e = explain(c.ledger, c.pod("default/want"))
    assert e.mig.profile == "3g.40gb" and e.mig.resource == "nvidia.com/mig-3g.40gb"
    assert (e.mig.free_slices, e.mig.nodes) == (1, ("m",))
    only_small = cluster(
        mig_mixed_node("m", {"1g.10gb": (7, 9728)}),
        pod("want", "15Gi", resource="nvidia.com/mig-1g.10gb"),
    )
    e2 = explain(only_small.ledger, only_small.pod("default/want"))
    # no slice that large exists: the A100-80GB's smallest profile over 15Gi is 1g.20gb
    assert e2.mig.profile == "1g.20gb" and e2.mig.free_slices == 0
    assert e2.mig.reconfigure


def test_the_pods_named_for_the_closest_node_do_make_room_there() -> None:
    """`why` tells the user the pod fits on its closest node once the pods it names are gone:
    on random clusters (every sharing mode, MIG, records over a GPU's memory), releasing them
    lets bind's device choice place the pod on that node."""
    named = 0
    for seed in range(24):
        rng = random.Random(seed)
        names = [f"n{i}" for i in range(rng.randint(3, 12))] + ["mig"]
        c = cluster(
            *[_random_node(rng, n) for n in names[:-1]],
            mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
        )
        for step in range(30):
            _random_step(rng, c, names, step)
            for j in range(4):
                p = _random_pod(rng, f"q{step}-{j}")
                closest = explain(c.ledger, p, pods=c.pods).closest
                if closest is None or closest.remove is None:
                    continue
                named += 1
                ledger = c.ledger.clone()
                for share in closest.remove:
                    assert ledger.reservation(share.key).node == closest.node
                    ledger.release(share.key)
                placed = choose_devices(ledger, pod_demand(p), closest.node)
                assert isinstance(placed, Reservation), (seed, step, closest)
    assert named >= 20  # the advice was given, and checked
