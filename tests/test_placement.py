from builders import cluster, gpu_node, mig_mixed_node, mig_single_node, pod, service

from extender.demand import pod_demand
from extender.ledger import check_invariant
from extender.placement import choose_devices, filter_nodes, preempt_victims, score_nodes
from extender.quantity import GIB
from extender.wire import ExtenderArgs


def place(c, p, node):
    r = choose_devices(c.ledger, pod_demand(p), node)
    assert not isinstance(r, str), r
    c.ledger.reserve(r)
    return r


def test_filter_reasons_are_specific():
    c = cluster(
        gpu_node("full", count=1, replicas=2),
        gpu_node("small", count=1, memory_mib=24576),
        gpu_node("ok", count=1, replicas=2),
    )
    place(c, pod("x", "60Gi"), "full")
    out = filter_nodes(c.ledger, pod_demand(pod("p", "40Gi")), ["full", "small", "ok", "ghost"])
    assert out.feasible == ["ok"]
    assert out.failed == {"full": "no GPU with 40Gi free"}
    assert out.unresolvable["small"] == "need 40Gi per GPU, GPUs have 24Gi"
    assert out.unresolvable["ghost"] == "node unknown to vramsched"


def test_multi_gpu_pod_needs_all_gpus_on_one_node():
    c = cluster(gpu_node("n", count=4, replicas=2))
    place(c, pod("a", "70Gi"), "n")
    place(c, pod("b", "70Gi"), "n")
    d = pod_demand(pod("p", "120Gi", gpus=4))  # 30Gi per GPU
    out = filter_nodes(c.ledger, d, ["n"])
    assert out.failed == {"n": "only 2 of 4 GPUs with 30Gi free"}
    r = choose_devices(c.ledger, pod_demand(pod("q", "120Gi", gpus=2)), "n")
    assert r.device_ids == ("2", "3") and r.bytes_per_device == (60 * GIB, 60 * GIB)
    assert filter_nodes(c.ledger, pod_demand(pod("p", "8Gi", gpus=8)), ["n"]).unresolvable == {
        "n": "node has 4 GPUs, pod needs 8"
    }


def test_replicas_exhausted():
    c = cluster(gpu_node("n", count=1, replicas=2))
    place(c, pod("a", "1Gi"), "n")
    place(c, pod("b", "1Gi"), "n")
    out = filter_nodes(c.ledger, pod_demand(pod("p", "1Gi")), ["n"])
    assert "replicas in use" in out.failed["n"]


def test_best_fit_prefers_partly_used_gpu_and_never_opens_empty_one():
    c = cluster(
        gpu_node("a", count=2, replicas=4),
        gpu_node("b", count=2, replicas=4),
        gpu_node("c", count=2, replicas=4),
    )
    place(c, pod("x", "60Gi"), "a")  # 20Gi left on a/0
    place(c, pod("y", "30Gi"), "b")  # 50Gi left on b/0
    scores = dict(score_nodes(c.ledger, pod_demand(pod("p", "16Gi")), ["a", "b", "c"]))
    assert scores["a"] > scores["b"] > scores["c"]
    # the chosen GPU on `a` is the partly used one
    assert choose_devices(c.ledger, pod_demand(pod("p", "16Gi")), "a").device_ids == ("0",)
    # a pod that fits only an empty GPU: node already in use beats an untouched node
    scores = dict(score_nodes(c.ledger, pod_demand(pod("q", "70Gi")), ["a", "c"]))
    assert scores["a"] > scores["c"]


def test_planned_node_gets_top_score_only():
    c = cluster(gpu_node("a", count=1, replicas=4), gpu_node("b", count=1, replicas=4))
    scores = dict(score_nodes(c.ledger, pod_demand(pod("p", "16Gi")), ["a", "b"], planned="b"))
    assert scores == {"a": scores["a"], "b": 10} and scores["a"] < 10


def test_without_a_plan_the_first_node_of_the_best_band_alone_gets_top_score():
    # kube-scheduler picks at random among equal top totals: one node must stand out.
    c = cluster(*(gpu_node(n, count=1, replicas=4) for n in ("a", "b", "c", "d")))
    place(c, pod("x", "60Gi"), "b")
    place(c, pod("y", "60Gi"), "d")
    d = pod_demand(pod("p", "16Gi"))
    # asked in another order than the ledger's: b and d tie in the best band, b comes first
    scores = dict(score_nodes(c.ledger, d, ["d", "c", "b", "a"]))
    assert scores["b"] == 10 and scores["d"] == 9 and scores["a"] == scores["c"] < 9
    # the tie is broken among the asked nodes only, and duplicates of the chosen one all score 10
    assert dict(score_nodes(c.ledger, d, ["d", "a"])) == {"d": 10, "a": scores["a"]}
    assert [s for n, s in score_nodes(c.ledger, d, ["b", "d", "b"])] == [10, 9, 10]
    # a plan whose node was not asked about, or where the pod no longer fits, gives way to that choice
    assert dict(score_nodes(c.ledger, d, ["c", "d"], planned="b")) == {"c": scores["c"], "d": 10}
    place(c, pod("z", "20Gi"), "a")
    place(c, pod("w", "80Gi"), "c")
    assert dict(score_nodes(c.ledger, d, ["c", "d", "b"], planned="c")) == {"c": 0, "d": 9, "b": 10}
    # nowhere to go: nobody gets 10
    assert dict(score_nodes(c.ledger, pod_demand(pod("big", "70Gi")), ["b", "c"])) == {
        "b": 0,
        "c": 0,
    }


def test_no_annotation_needs_an_empty_gpu():
    c = cluster(gpu_node("n", count=2, replicas=4))
    place(c, pod("a", "1Gi"), "n")
    r = choose_devices(c.ledger, pod_demand(pod("whole", None)), "n")
    assert r.device_ids == ("1",) and r.bytes_per_device == (80 * GIB,)
    c.ledger.reserve(r)
    assert filter_nodes(c.ledger, pod_demand(pod("more", "1Gi")), ["n"]).feasible == ["n"]
    assert filter_nodes(c.ledger, pod_demand(pod("w2", None)), ["n"]).feasible == []


def test_mps_respects_per_replica_cap():
    c = cluster(gpu_node("m", count=1, replicas=4, strategy="mps"))
    assert filter_nodes(c.ledger, pod_demand(pod("p", "21Gi")), ["m"]).unresolvable == {
        "m": "need 21Gi per GPU, MPS caps each replica at 20Gi"
    }
    for i in range(4):
        place(c, pod(f"p{i}", "20Gi"), "m")
    assert (
        "replicas in use" in filter_nodes(c.ledger, pod_demand(pod("q", "1Gi")), ["m"]).failed["m"]
    )
    assert check_invariant(c.ledger) == []


def test_mig_mixed_profile_too_small_names_both_numbers_and_a_fitting_profile():
    c = cluster(mig_mixed_node("m", {"1g.10gb": (4, 9984), "3g.40gb": (1, 40192)}))
    d = pod_demand(pod("p", "12Gi", resource="nvidia.com/mig-1g.10gb"))
    out = filter_nodes(c.ledger, d, ["m"])
    assert out.unresolvable == {
        "m": "model needs 12Gi but 1g.10gb has 9.75Gi; smallest profile on node that fits: 3g.40gb"
    }
    ok = pod_demand(pod("q", "5Gi", resource="nvidia.com/mig-1g.10gb"))
    assert filter_nodes(c.ledger, ok, ["m"]).feasible == ["m"]
    r = choose_devices(c.ledger, ok, "m")
    assert r.device_ids[0].endswith(":1g.10gb:0")


def test_mig_single_strategy_places_on_slices():
    c = cluster(mig_single_node("s", "1g.10gb", slices=7, memory_mib=9984))
    for i in range(7):
        place(c, pod(f"p{i}", "9Gi"), "s")
    out = filter_nodes(c.ledger, pod_demand(pod("x", "1Gi")), ["s"])
    assert out.failed and check_invariant(c.ledger) == []
    assert (
        filter_nodes(c.ledger, pod_demand(pod("y", "10Gi")), ["s"])
        .unresolvable["s"]
        .startswith("need 10Gi per GPU")
    )


def test_allowed_products():
    c = cluster(
        gpu_node("a", product="NVIDIA-A100-SXM4-80GB"),
        gpu_node("h", product="NVIDIA-H100-80GB-HBM3"),
    )
    d = pod_demand(
        pod("p", "8Gi", annotations={"vramsched.io/gpu-products": "NVIDIA-H100-80GB-HBM3"})
    )
    out = filter_nodes(c.ledger, d, ["a", "h"])
    assert out.feasible == ["h"] and "not in the pod's allowed products" in out.unresolvable["a"]


def test_preempt_keeps_fewest_lowest_priority_victims():
    c = cluster(gpu_node("n", count=1, replicas=4))
    victims = {}
    for name, gib, prio in [
        ("low-big", "40Gi", 1),
        ("low-small", "10Gi", 1),
        ("mid", "20Gi", 5),
        ("high", "10Gi", 100),
    ]:
        p = pod(name, gib, priority=prio)
        c.upsert_pod(p)
        place(c, p, "n")
        victims[name] = p["metadata"]["uid"]
    d = pod_demand(pod("new", "35Gi", priority=50))
    out = preempt_victims(c.ledger, d, {"n": list(victims.values())})
    assert out == {"n": [victims["low-big"]]}
    # 45Gi: two victims are needed; the two lowest-priority ones, never the priority-100 pod
    d = pod_demand(pod("new", "45Gi", priority=50))
    out = preempt_victims(c.ledger, d, {"n": list(victims.values())})
    assert sorted(out["n"]) == sorted([victims["low-big"], victims["low-small"]])
    # nothing a lower-priority set of victims could free: node dropped
    d2 = pod_demand(pod("huge", "79Gi", priority=50))
    assert preempt_victims(c.ledger, d2, {"n": list(victims.values())}) == {}


def test_label_only_reasons_are_shared_read_only_and_encoded_once():
    """Asked again with the same candidate list and demand shape, filter hands back the very
    dict of label-only reasons (not a copy) when nothing else is unresolvable; it refuses to be
    changed, and the server writes it as the JSON of its items, once."""
    import orjson
    import pytest

    from extender.namelists import NameLists
    from extender.placement import SharedReasons
    from extender.server import encode_names_result
    from extender.wire import ExtenderFilterResult

    c = cluster(
        mig_mixed_node("mig", {"1g.10gb": (7, 9984)}),
        gpu_node("ok", count=2),
        gpu_node("small", count=1, memory_mib=24576),
    )
    names = ["mig", "ok", "small"]
    small_pod, big_pod = pod_demand(pod("p", "10Gi")), pod_demand(pod("q", "40Gi"))
    first, second, third = (filter_nodes(c.ledger, small_pod, names) for _ in range(3))
    assert first.unresolvable == second.unresolvable == {"mig": "node has no nvidia.com/gpu"}
    assert (
        isinstance(second.unresolvable, SharedReasons) and second.unresolvable is third.unresolvable
    )
    with pytest.raises(TypeError):
        second.unresolvable["x"] = "y"
    with pytest.raises(TypeError):
        second.unresolvable.update({"x": "y"})
    assert second.unresolvable == {"mig": "node has no nvidia.com/gpu"}
    for _ in range(2):
        result = ExtenderFilterResult.model_construct(
            NodeNames=second.feasible,
            FailedNodes={},
            FailedAndUnresolvableNodes=second.unresolvable,
        )
        assert orjson.loads(encode_names_result(result, NameLists()))[
            "FailedAndUnresolvableNodes"
        ] == dict(second.unresolvable)
    # a pod too big for "small" adds a reason of its own: a plain dict holding both, the shared one untouched
    for _ in range(2):
        big = filter_nodes(c.ledger, big_pod, names)
    assert type(big.unresolvable) is dict and big.unresolvable == {
        "mig": "node has no nvidia.com/gpu",
        "small": "need 40Gi per GPU, GPUs have 24Gi",
    }
    assert filter_nodes(c.ledger, small_pod, names).unresolvable == {
        "mig": "node has no nvidia.com/gpu"
    }


def test_shared_reasons_under_a_replica_policy_are_copied_before_anything_is_added():
    """Live mode (a replica policy) shares the label-only reasons too; a pod that then needs a
    reason of its own (a time-sliced node it cannot be pinned on) gets a copy holding both,
    and the shared dict stays as it was for every other answer."""
    from extender.placement import SharedReasons
    from extender.placement.pin_rule import PIN_MISSING

    c = cluster(
        mig_mixed_node("mig", {"1g.10gb": (7, 9984)}),
        gpu_node("ts0", count=2, memory_mib=23034, replicas=4),
        gpu_node("x", count=2),
        replica_policy="pinned",
    )
    names = ["mig", "ts0", "x"]
    pinned = pod("p", "10Gi")
    pinned["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "vramsched-p"}}]
    mig_only = {"mig": "node has no nvidia.com/gpu"}
    first, second = (filter_nodes(c.ledger, pod_demand(pinned), names) for _ in range(2))
    assert first.unresolvable == mig_only and sorted(second.feasible) == ["ts0", "x"]
    assert isinstance(second.unresolvable, SharedReasons)
    # the same shape without a pin: ts0 refuses it for good, on top of the shared reasons
    plain = filter_nodes(c.ledger, pod_demand(pod("q", "10Gi")), names)
    assert type(plain.unresolvable) is dict and plain.unresolvable == {
        **mig_only,
        "ts0": PIN_MISSING,
    }
    assert plain.feasible == ["x"]
    again = filter_nodes(c.ledger, pod_demand(pinned), names)
    assert again.unresolvable is second.unresolvable and again.unresolvable == mig_only


# ----- a placement is charged for the memory nobody else can use after it -----------------------


def test_among_placements_that_strand_the_one_that_strands_least_wins():
    # every GPU is exclusive: any pod strands the rest of one; a 7 GiB model on a 16 GB T4
    # strands 8 GiB, on an 80 GB H100 73 GiB. The H100 node comes first in the list.
    c = cluster(
        gpu_node("a-h100", count=2, product="NVIDIA-H100-80GB-HBM3"),
        gpu_node("b-t4", count=2, memory_mib=15360, product="Tesla-T4"),
    )
    d = pod_demand(pod("p", "7Gi"))
    assert dict(score_nodes(c.ledger, d, ["a-h100", "b-t4"])) == {"a-h100": 0, "b-t4": 10}
    # a model too big for a T4 still gets the H100
    big = pod_demand(pod("q", "20Gi"))
    assert dict(score_nodes(c.ledger, big, ["a-h100", "b-t4"])) == {"a-h100": 10, "b-t4": 0}


def test_a_mig_slice_strands_less_than_a_whole_gpu_and_more_than_a_shared_one():
    c = cluster(
        gpu_node("a-h100", count=1, product="NVIDIA-H100-80GB-HBM3"),
        mig_single_node("b-mig", "1g.10gb", slices=7, memory_mib=9984),
        gpu_node("c-ts", count=1, replicas=4),
    )
    d = pod_demand(pod("p", "7Gi"))
    assert dict(score_nodes(c.ledger, d, ["a-h100", "b-mig"]))["b-mig"] == 10
    assert dict(score_nodes(c.ledger, d, ["a-h100", "b-mig", "c-ts"])) == {
        "a-h100": 0,
        "b-mig": 0,
        "c-ts": 10,
    }


def test_a_time_sliced_gpus_last_replica_goes_to_the_pod_that_strands_least():
    c = cluster(gpu_node("n", count=2, replicas=2))
    place(c, pod("a", "10Gi"), "n")  # GPU 0: one replica left, 70 GiB free
    # 20 GiB there would leave 50 GiB behind its last replica: the empty GPU takes it
    assert choose_devices(c.ledger, pod_demand(pod("p", "20Gi")), "n").device_ids == ("1",)
    # 70 GiB fills it exactly: nothing stranded, and no GPU opened
    assert choose_devices(c.ledger, pod_demand(pod("q", "70Gi")), "n").device_ids == ("0",)
    # across nodes: a GPU with replicas to spare beats one whose last replica the pod would take
    c = cluster(gpu_node("a", count=1, replicas=2), gpu_node("b", count=1, replicas=4))
    place(c, pod("x", "10Gi"), "a")
    place(c, pod("y", "10Gi"), "b")
    scores = dict(score_nodes(c.ledger, pod_demand(pod("p", "20Gi")), ["a", "b"]))
    assert scores == {"a": 0, "b": 10}
    assert check_invariant(c.ledger) == []


def test_an_mps_share_strands_its_unused_rest():
    # MPS caps each client at memory / replicas: a 7 GiB model strands the rest of its share,
    # 13 GiB of a 20 GiB share, 33 GiB of a 40 GiB one; a time-sliced GPU strands nothing
    c = cluster(
        gpu_node("a-mps2", count=1, replicas=2, strategy="mps"),
        gpu_node("b-mps4", count=1, replicas=4, strategy="mps"),
        gpu_node("c-ts", count=1, replicas=4),
    )
    d = pod_demand(pod("p", "7Gi"))
    assert dict(score_nodes(c.ledger, d, ["a-mps2", "b-mps4"])) == {"a-mps2": 0, "b-mps4": 10}
    assert dict(score_nodes(c.ledger, d, ["a-mps2", "b-mps4", "c-ts"]))["c-ts"] == 10
    # a pod that fills its share strands nothing
    full = pod_demand(pod("q", "20Gi"))
    assert dict(score_nodes(c.ledger, full, ["a-mps2", "b-mps4"])) == {"a-mps2": 0, "b-mps4": 10}


def test_answer_bands():
    # placements that strand nothing keep best fit's bands: 9..5 partly used GPUs, 4..2 an empty
    # GPU on a node in use, 1..0 an idle node; one that strands memory scores 0, as does a node
    # the pod does not fit. The one node at 10 is chosen by the finer order.
    c = cluster(
        gpu_node("busy", count=1, replicas=4),
        gpu_node("room", count=2, replicas=4),
        gpu_node("idle", count=1, replicas=4, memory_mib=24576),
        gpu_node("excl", count=1),
        gpu_node("small", count=1, memory_mib=10240),
        gpu_node("t4", count=1, memory_mib=15360, product="Tesla-T4"),
    )
    place(c, pod("x", "60Gi"), "busy")
    place(c, pod("y", "70Gi"), "room")
    names = ["busy", "room", "idle", "excl", "small", "t4"]
    scores = dict(score_nodes(c.ledger, pod_demand(pod("p", "16Gi")), names))
    assert scores["busy"] == 10  # the best band's first node
    assert 2 <= scores["room"] <= 4 and scores["idle"] == 1  # 16 of 24 GiB: tight
    assert scores["excl"] == scores["small"] == scores["t4"] == 0
    # among placements that all strand, the least stranding one still stands out: 3 GiB of a T4
    # rather than 68 GiB of an exclusive 80 GB GPU
    only = dict(score_nodes(c.ledger, pod_demand(pod("q", "12Gi")), ["excl", "t4"]))
    assert only == {"excl": 0, "t4": 10}


def test_room_freed_by_preemption_is_kept_for_the_nominated_pod():
    """After preempting for a pod, kube-scheduler nominates it to the node and counts it there
    against pods of lower or equal priority; extenders are not told. A lower-priority pod could
    take the VRAM the victims freed, and the nominated pod would preempt again."""
    preemptor = pod("preemptor", "60Gi", priority=100)
    preemptor["status"]["nominatedNodeName"] = "a"
    c = cluster(gpu_node("a", count=1, replicas=4), gpu_node("b", count=1, replicas=4), preemptor)
    svc = service(c)
    before = c.ledger.totals()

    def feasible(p):
        r = svc.filter(ExtenderArgs(Pod=p, NodeNames=["a", "b"]))
        return r.NodeNames, r.FailedNodes

    names, failed = feasible(pod("low", "30Gi", priority=0))
    assert names == ["b"]
    assert failed["a"] == "GPU memory here is kept for default/preemptor, nominated by preemption"
    assert feasible(pod("same", "30Gi", priority=100))[0] == ["b"]  # equal priority: kept too
    assert feasible(pod("higher", "30Gi", priority=200))[0] == ["a", "b"]  # as kube-scheduler
    assert feasible(pod("small", "20Gi", priority=0))[0] == ["a", "b"]  # fits beside it
    assert feasible(preemptor)[0] == ["a", "b"]  # its own room
    assert c.ledger.totals() == before and check_invariant(c.ledger) == []
    # bound (or nominated no more), it keeps nothing beyond what it holds
    c.upsert_pod({**preemptor, "status": {"phase": "Pending"}})
    assert not c.nominated and feasible(pod("low2", "30Gi"))[0] == ["a", "b"]


def test_books_demand_takes_a_choice_only_for_the_pod_and_bytes_it_asks_now():
    """What bind checks before booking a placement chosen earlier (a plan, a hold, a pick)."""
    from dataclasses import replace

    from extender.demand import PodRef
    from extender.placement import books_demand

    c = cluster(
        gpu_node("ts", count=2, memory_mib=80 * 1024, replicas=4),
        gpu_node("ex", count=1, memory_mib=80 * 1024),
        mig_mixed_node("mig", {"1g.10gb": (2, 9728)}),
    )
    d = pod_demand(pod("p", "20Gi", uid="u1"))
    chosen = choose_devices(c.ledger, d, "ts")
    assert not isinstance(chosen, str) and books_demand(c.ledger, d, chosen)
    edited = pod_demand(pod("p", "30Gi", uid="u1"))
    assert not books_demand(c.ledger, edited, chosen)  # sized for 20Gi
    assert not books_demand(c.ledger, pod_demand(pod("p", "20Gi", uid="u2")), chosen)
    other = replace(chosen, pod=PodRef("default", "q", "u1"))
    assert not books_demand(c.ledger, d, other)
    two = pod_demand(pod("p", "40Gi", gpus=2, uid="u1"))  # 20Gi on each of 2 GPUs
    assert not books_demand(c.ledger, two, chosen)  # one device where it asks two
    twice = replace(chosen, device_ids=("0", "0"), bytes_per_device=(20 * GIB, 20 * GIB))
    assert not books_demand(c.ledger, two, twice)  # the same GPU counted twice
    both = replace(chosen, device_ids=("0", "1"), bytes_per_device=(20 * GIB, 20 * GIB))
    assert books_demand(c.ledger, two, both)
    assert not books_demand(c.ledger, d, replace(chosen, node="ghost"))
    assert not books_demand(c.ledger, d, replace(chosen, device_ids=("7",)))  # no such GPU
    # a whole device books what the device's cap is: all of an exclusive GPU
    whole = pod_demand(pod("w", None, uid="w"))
    on_ex = choose_devices(c.ledger, whole, "ex")
    assert not isinstance(on_ex, str) and books_demand(c.ledger, whole, on_ex)
    assert not books_demand(c.ledger, whole, replace(on_ex, bytes_per_device=(20 * GIB,)))
    # a MIG slice is not a GPU of the resource the pod asks
    mig = pod_demand(pod("m", "9Gi", uid="m", resource="nvidia.com/mig-1g.10gb"))
    slice_ = choose_devices(c.ledger, mig, "mig")
    assert not isinstance(slice_, str) and books_demand(c.ledger, mig, slice_)
    as_gpu = replace(slice_, pod=d.pod, bytes_per_device=(20 * GIB,))
    assert not books_demand(c.ledger, d, as_gpu)
