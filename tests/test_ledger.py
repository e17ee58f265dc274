import pytest
from builders import cluster, gpu_node, mig_mixed_node, pod

from extender.assignment import AssignmentError, decode_assignment, encode_assignment
from extender.demand import PodRef, pod_demand
from extender.inventory import node_inventory
from extender.ledger import Ledger, LedgerError, Reservation, check_invariant
from extender.placement import choose_devices
from extender.quantity import GIB, MIB


def _ledger(*nodes):
    led = Ledger()
    for n in nodes:
        led.upsert_node(node_inventory(n))
    return led


def res(name, node, devices, gib, **kw):
    return Reservation(
        PodRef("ns", name, f"u-{name}"), node, tuple(devices), tuple(g * GIB for g in gib), **kw
    )


def test_reserve_checks_memory_and_replicas():
    led = _ledger(gpu_node("n", count=1, replicas=2))
    led.reserve(res("a", "n", ["0"], [50]))
    with pytest.raises(LedgerError, match="not enough free VRAM"):
        led.reserve(res("b", "n", ["0"], [31]))
    led.reserve(res("b", "n", ["0"], [30]))
    with pytest.raises(LedgerError, match="no free replica"):
        led.reserve(res("c", "n", ["0"], [0]))
    assert check_invariant(led) == []
    assert led.totals() == (80 * GIB, 80 * GIB)


def test_reserve_is_idempotent_and_rejects_a_second_placement():
    led = _ledger(gpu_node("n", count=2, replicas=2))
    first = led.reserve(res("a", "n", ["0"], [10]))
    assert led.reserve(res("a", "n", ["0"], [10])) is first
    with pytest.raises(LedgerError, match="already holds"):
        led.reserve(res("a", "n", ["1"], [10]))
    assert int(led.arrays.used_replicas.sum()) == 1


def test_record_moves_a_pod_the_api_says_is_elsewhere_and_counts_it_once():
    """The API is the truth: a pod recorded on other devices (or another node) leaves the old
    ones, even where the new ones are over their memory, and is never counted twice."""
    led = _ledger(gpu_node("n", count=2, replicas=2), gpu_node("m", count=1, replicas=2))
    led.reserve(res("a", "n", ["0"], [60]))
    led.reserve(res("b", "n", ["1"], [50]))
    led.record(res("a", "n", ["1"], [60]))  # 110 GiB on an 80 GiB GPU: recorded all the same
    a = led.arrays
    assert int(a.used[led.row("n", "0")]) == 0 and int(a.used_replicas[led.row("n", "0")]) == 0
    assert int(a.used[led.row("n", "1")]) == 110 * GIB
    assert int(a.used_replicas[led.row("n", "1")]) == 2
    led.record(res("a", "m", ["0"], [60]))
    assert int(a.used[led.row("n", "1")]) == 50 * GIB and led.totals()[0] == 110 * GIB
    assert [r.node for r in led.reservations() if r.pod.name == "a"] == ["m"]
    assert check_invariant(led) == []


def test_unknown_device_or_node_or_duplicate_device():
    led = _ledger(gpu_node("n", count=2, replicas=2))
    with pytest.raises(LedgerError, match="no GPU device 7"):
        led.reserve(res("a", "n", ["7"], [1]))
    with pytest.raises(LedgerError, match="not known"):
        led.reserve(res("a", "x", ["0"], [1]))
    with pytest.raises(LedgerError, match="twice"):
        led.reserve(res("a", "n", ["0", "0"], [1, 1]))
    assert led.totals()[0] == 0


def test_release_and_node_relabel_keep_totals_consistent():
    led = _ledger(gpu_node("n", count=2, replicas=2))
    led.reserve(res("a", "n", ["1"], [10]))
    led.upsert_node(node_inventory(gpu_node("n", count=4, replicas=2)))
    a = led.arrays
    assert int(a.used[led.row("n", "1")]) == 10 * GIB
    assert check_invariant(led) == []
    led.release("ns/a")
    assert led.totals()[0] == 0 and check_invariant(led) == []


def test_expire_drops_only_assumed_past_ttl():
    led = _ledger(gpu_node("n", count=2, replicas=2))
    led.reserve(res("a", "n", ["0"], [10], assumed=True, expires_at=5.0))
    led.reserve(res("b", "n", ["1"], [10], assumed=True, expires_at=50.0))
    led.reserve(res("c", "n", ["1"], [10]))
    gone = led.expire(now=10.0)
    assert [r.key for r in gone] == ["ns/a"]
    assert led.reservation("ns/b") and led.reservation("ns/c")


def test_invariant_checker_detects_overcommit_and_ghosts():
    led = _ledger(gpu_node("n", count=1, replicas=2))
    led.record(res("a", "n", ["0"], [60]))
    led.record(res("b", "n", ["0"], [60]))  # recorded from the API even though it overcommits
    problems = check_invariant(led, live_pods=["ns/a"])
    text = "\n".join(map(str, problems))
    assert "VRAM oversubscribed" in text
    assert "ns/b: held by a pod that no longer exists" in text


def test_cluster_rebuild_from_annotations_is_identical():
    from extender.embedded import EmbeddedBinder

    objs = [
        gpu_node("n", count=2, replicas=4),
        pod("a", "30Gi"),
        pod("b", "60Gi"),
        pod("c", "20Gi"),
    ]
    c1 = cluster(*objs)
    binder = EmbeddedBinder(c1)
    import asyncio

    from extender.demand import pod_demand
    from extender.placement import choose_devices

    for key in ["default/a", "default/b", "default/c"]:
        p = c1.pod(key)
        r = c1.ledger.reserve(choose_devices(c1.ledger, pod_demand(p), "n"))
        asyncio.run(binder.bind(p, "n", r))
    # a restart: a new cluster state from the same objects as the API would list them
    c2 = cluster(
        *[c1.nodes["n"] | {"kind": "Node"}], *[p | {"kind": "Pod"} for p in c1.pods.values()]
    )

    def snap(c):
        return sorted(
            (r.key, r.node, r.device_ids, r.bytes_per_device) for r in c.ledger.reservations()
        )

    assert snap(c1) == snap(c2) and len(snap(c2)) == 3
    assert check_invariant(c2.ledger, c2.live_pod_keys()) == []


def test_terminal_and_deleted_pods_release():
    c = cluster(
        gpu_node("n", count=1, replicas=4),
        pod(
            "a",
            "30Gi",
            node="n",
            phase="Running",
            annotations={
                "vramsched.io/assignment": '{"node":"n","devices":["0"],"bytesPerDevice":[32212254720]}'
            },
        ),
    )
    assert c.ledger.totals()[0] == 30 * GIB
    done = dict(c.pod("default/a"), status={"phase": "Succeeded"})
    c.upsert_pod(done)
    assert c.ledger.totals()[0] == 0
    c.upsert_pod(dict(done, status={"phase": "Running"}))
    assert c.ledger.totals()[0] == 30 * GIB
    c.delete_pod("default/a")
    assert c.ledger.totals()[0] == 0


def test_bound_pod_without_assignment_is_counted_conservatively():
    c = cluster(gpu_node("n", count=2, replicas=4), pod("legacy", None, node="n", phase="Running"))
    # no annotation: it holds a whole GPU
    assert c.ledger.totals()[0] == 80 * GIB
    assert "default/legacy" in c.guessed


@pytest.mark.parametrize("value", ["16Gx", "0", "-4Gi", "1e400"])
def test_a_bound_pod_whose_model_memory_is_unreadable_still_holds_its_gpu(value: str) -> None:
    """Annotations are not checked by the API server and may be edited after bind. A running
    pod whose `model-memory` no longer parses was counted on no GPU, so its GPU looked free
    to the next pods while the pod used it; it is now counted on whole GPUs (or, with a readable
    assignment, where the assignment says)."""
    from extender.cluster import check_cluster

    odd = pod("odd", value, node="n", phase="Running")
    odd["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "2"
    c = cluster(gpu_node("n", count=2, replicas=4), odd)
    assert c.ledger.totals()[0] == 80 * GIB and "default/odd" in c.guessed
    assert c.cpu_used == {"n": 2000} and check_cluster(c) == []
    assert not c.demand_mix  # not a kind of pod to plan room for
    # bound by vramsched, then edited: the assignment written at bind still says where and how much
    booked = pod("booked", "30Gi", node="n", phase="Running")
    booked["metadata"]["annotations"]["vramsched.io/assignment"] = (
        '{"node":"n","devices":["1"],"bytesPerDevice":[32212254720]}'
    )
    c.upsert_pod(booked)
    edited = {
        **booked,
        "metadata": {
            **booked["metadata"],
            "annotations": {
                **booked["metadata"]["annotations"],
                "vramsched.io/model-memory": value,
            },
        },
    }
    c.upsert_pod(edited)
    assert c.ledger.reservation("default/booked").device_ids == ("1",)
    assert c.ledger.totals()[0] == 110 * GIB and check_cluster(c) == []


@pytest.mark.parametrize("memory", [None, "30Gi", "oops"])
def test_a_running_pod_asking_several_gpu_resources_holds_a_device_of_each(
    memory: str | None,
) -> None:
    """vramsched refuses to schedule a pod asking two GPU resources, but another scheduler may
    run one on its nodes (a MIG slice of two profiles, say). It was counted on no device, and not
    even its CPU: both slices looked free. It now holds whole devices of each resource."""
    from extender.cluster import check_cluster

    node = mig_mixed_node("m", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)})
    both = pod("both", memory, resource="nvidia.com/mig-1g.10gb", node="m", phase="Running")
    requests = both["spec"]["containers"][0]["resources"]["requests"]
    requests.update({"nvidia.com/mig-3g.40gb": "1", "cpu": "3"})
    both["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/mig-3g.40gb"] = "1"
    c = cluster(node, both)
    held = c.ledger.reservation("default/both")
    assert held is not None and sorted(held.bytes_per_device) == [9984 * MIB, 40192 * MIB]
    assert len({d.split(":")[1] for d in held.device_ids}) == 2  # one slice of each profile
    assert c.cpu_used == {"m": 3000} and "default/both" in c.guessed
    assert check_cluster(c) == [] and not c.demand_mix
    # the only 3g.40gb slice is taken; one 1g.10gb slice is left
    for profile, room in (("3g.40gb", False), ("1g.10gb", True)):
        wants = pod_demand(pod("next", None, resource=f"nvidia.com/mig-{profile}"))
        assert isinstance(choose_devices(c.ledger, wants, "m"), Reservation) is room, profile
    c.delete_pod("default/both")
    assert c.ledger.totals()[0] == 0 and c.cpu_used.get("m", 0) == 0 and check_cluster(c) == []


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('{"node":"n","devices":"0","bytesPerDevice":1}', "is not a list of device IDs"),
        ('{"node":"n","devices":[0],"bytesPerDevice":1}', "is not a list of device IDs"),
        ('{"node":"n","devices":["0","0"],"bytesPerDevice":[1,1]}', "names a device twice"),
        ('{"node":"n","devices":["0"],"bytesPerDevice":[1,2]}', "one size per device"),
        ('{"node":"n","devices":["0"],"bytesPerDevice":[1.5]}', "1.5 is not a whole number"),
        ('{"node":"n","devices":["0"],"bytesPerDevice":true}', "one size per device"),
        ('{"node":"n","devices":["0"],"bytesPerDevice":[-1]}', "-1 is not a whole number"),
        ('{"node":"n","devices":["0"],"bytesPerDevice":[18446744073709551615]}', "from 0 to 64Ti"),
        ('{"node":7,"devices":["0"],"bytesPerDevice":[1]}', "node 7 is not a name"),
        ('{"node":"n","devices":["01"],"bytesPerDevice":[1]}', "is not a GPU index"),
        ('{"node":"n","devices":["\u0661"],"bytesPerDevice":[1]}', "is not a GPU index"),
        ('{"node":"n","devices":["+1"],"bytesPerDevice":[1]}', "is not a GPU index"),
        ('{"node":"n","devices":["1 "],"bytesPerDevice":[1]}', "is not a GPU index"),
        ('{"node":"n","devices":[""],"bytesPerDevice":[1]}', "is not a GPU index"),
        ('{"node":"n","devices":["0:1g.10gb:01"],"bytesPerDevice":[1]}', "is not a GPU index"),
        ('{"node":"n","devices":["0:1G.10GB:0"],"bytesPerDevice":[1]}', "is not a GPU index"),
    ],
)
def test_an_assignment_that_only_looks_like_one_is_counted_by_a_guess(body: str, says: str):
    """Read loosely, a string of devices became one device per character (a device held twice,
    over its replicas) and sizes beyond int64 or fractions were taken: the ledger then counted
    the pod on devices it does not hold, or not at all. A device ID the inventory would not write
    (`01`, `+1`, digits of other scripts) was counted on no device, while the device plugin,
    reading it with int(), handed the pod that GPU."""
    ref = PodRef("default", "odd", "u")
    with pytest.raises(AssignmentError, match=says):
        decode_assignment(ref, {"vramsched.io/assignment": body})
    bound = pod("odd", "30Gi", node="n", phase="Running")
    bound["metadata"]["annotations"]["vramsched.io/assignment"] = body
    c = cluster(gpu_node("n", count=2, replicas=4), bound)
    assert "default/odd" in c.guessed and c.ledger.totals()[0] == 30 * GIB
    assert check_invariant(c.ledger) == []


def test_what_vramsched_writes_reads_back():
    held = res("a", "n", ["0", "1"], [30, 30])
    assert decode_assignment(held.pod, encode_assignment(held)) == held


def test_clone_copies_and_a_capacity_clone_keeps_only_the_used_columns():
    led = _ledger(gpu_node("n", count=2, replicas=2), gpu_node("m", count=1))
    led.reserve(res("a", "n", ["0"], [30]))
    led.reserve(res("b", "m", ["0"], [80]))
    full, capacity = led.clone(), led.clone(reservations=False)
    assert check_invariant(full) == [] and full.reservation("ns/a") is not None
    assert [r.key for r in full.pods_on("n")] == ["ns/a"]
    for c in (full, capacity):
        assert (c.arrays.used == led.arrays.used).all() and (
            c.arrays.used_replicas == led.arrays.used_replicas
        ).all()
    assert (
        capacity.reservation("ns/a") is None
        and list(capacity.reservations()) == []
        and capacity.pods_on("n") == []
    )
    # the capacity clone still refuses what does not fit, and reserves and releases its own pods
    with pytest.raises(LedgerError, match="no free replica"):
        capacity.reserve(res("c", "m", ["0"], [0]))
    capacity.reserve(res("c", "n", ["0"], [50]))
    assert (
        capacity.arrays.used[led.row("n", "0")] == 80 * GIB
        and led.arrays.used[led.row("n", "0")] == 30 * GIB
    )
    capacity.release("ns/c")
    assert (capacity.arrays.used == led.arrays.used).all()
    # and the original changes without either copy seeing it
    led.release("ns/b")
    assert (
        full.reservation("ns/b") is not None and capacity.arrays.used[led.row("m", "0")] == 80 * GIB
    )


def test_allocatable_follows_node_updates_that_keep_the_devices():
    node = gpu_node("n", cpu="64", memory="512Gi")
    led = _ledger(node, gpu_node("m", cpu="8", memory="64Gi"))
    cpu, mem = led.allocatable()
    assert cpu.tolist() == [64_000, 8_000] and mem.tolist() == [512 * GIB, 64 * GIB]
    assert not cpu.flags.writeable
    clone = led.clone(reservations=False)
    assert clone.allocatable()[0] is cpu  # shared, not recomputed
    smaller = gpu_node("n", cpu="32", memory="512Gi")  # same GPUs: the arrays are not rebuilt
    led.upsert_node(node_inventory(smaller))
    assert led.allocatable()[0].tolist() == [32_000, 8_000]
    assert clone.allocatable()[0].tolist() == [
        64_000,
        8_000,
    ]  # the copy keeps what it was taken with
    led.remove_node("m")
    assert led.allocatable()[0].tolist() == [32_000]


def test_touched_rows_name_the_rows_of_the_touched_nodes_across_the_log_trim():
    """`touched_rows_since` (prioritize's kept scores read it) gives the rows of exactly the nodes
    `touched_since` names, also right after the log was trimmed (its rows move with the names),
    and None once the asked position was trimmed away."""
    led = _ledger(*(gpu_node(f"n{i}", count=1, replicas=4) for i in range(6)))
    led.arrays  # rows numbered
    start, base, checked = led.position, led.touched_base, 0
    for i in range(70_000):  # past the trim at 65,536 entries
        node = f"n{(i * 7) % 5}"  # consecutive entries name different nodes
        led.reserve(res(f"p{i}", node, ["0"], [1]))
        led.release(f"ns/p{i}")
        if led.touched_base != base or i >= 69_990:
            base = led.touched_base
            for back in (1, 2, 3, 5, 40_000):
                names, rows = (
                    led.touched_since(led.position - back),
                    led.touched_rows_since(led.position - back),
                )
                if names is None:  # trimmed away
                    assert rows is None
                    continue
                assert rows.tolist() == sorted(led.node_row(n) for n in names)
                checked += 1
    assert checked > 20
    assert led.touched_rows_since(start) is None
    assert led.touched_rows_since(led.position).tolist() == []
    assert "n5" not in led.touched_since(led.position - 40_000)
