"""The device plugin's choice of GPU for time-sliced replicas, and the bound vramsched keeps.

The central test simulates the stock plugin (kubelet admitting bound pods in any order, the plugin
breaking ties any way it likes) and checks that no GPU ever holds more VRAM than it has when
every bind passed vramsched's node-level rule, for both policies.
"""

from __future__ import annotations

import numpy as np
from builders import cluster, gpu_node, pod
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.demand import PodRef, pod_demand
from extender.inventory import ReplicaPolicy
from extender.ledger import Reservation, check_invariant
from extender.pinning import pin_environment, references_pin_configmap
from extender.placement import (
    FilterOutcome,
    choose_devices,
    filter_nodes,
    plugin_allows,
    preempt_victims,
)
from extender.stock_plugin import plugin_candidates, stack_depth, worst_case_load

GIB = 1024**3
D, P = ReplicaPolicy.DISTRIBUTED, ReplicaPolicy.PACKED


def test_the_plugin_candidates_follow_allocate_go() -> None:
    # distributed: fewest allocated replicas first; every tied GPU is possible.
    assert plugin_candidates([1, 0, 0], [4, 4, 4], D) == [1, 2]
    # packed: most allocated among GPUs that still have a free replica.
    assert plugin_candidates([4, 2, 2], [4, 4, 4], P) == [1, 2]
    assert plugin_candidates([2, 2], [2, 2], D) == []


def test_stack_depth() -> None:
    assert [stack_depth(D, u, 2, 4) for u in range(0, 9)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [stack_depth(P, u, 2, 4) for u in range(0, 9)] == [0, 1, 2, 3, 4, 4, 4, 4, 4]


def test_worst_case_of_the_e2e_example() -> None:
    # 12, 8, 8 on two GPUs: a 12 more can land next to the first 12.
    assert worst_case_load([12, 8, 8], 12, 1, gpus=2, replicas=4, policy=D) == 24
    assert worst_case_load([12, 8, 8], 2, 1, gpus=2, replicas=4, policy=D) == 20
    # packed may stack all four on one GPU.
    assert worst_case_load([12, 8, 8], 2, 1, gpus=2, replicas=4, policy=P) == 30
    # A 2-replica pod of 5 each makes 4 replicas on 2 GPUs, depth 2: the 12 and the 8 may meet.
    assert worst_case_load([12, 8], 5, 2, gpus=2, replicas=4, policy=D) == 20
    assert (
        worst_case_load([12, 8], 15, 2, gpus=2, replicas=4, policy=D) == 30
    )  # or its own two replicas


def test_per_gpu_books_alone_are_not_sound_under_the_plugin() -> None:
    """Best-fit books put 12+8 and 8+12 on two 22.5 GPUs; the plugin, breaking one tie its own
    way, puts both 12s on one GPU."""
    capacity = 22.5
    assert max(12 + 8, 8 + 12) <= capacity  # what per-GPU books believe
    gpus: list[list[int]] = [[], []]
    for size, tie in ((12, 0), (8, 0), (8, 1), (12, 0)):
        candidates = plugin_candidates([len(g) for g in gpus], [4, 4], D)
        gpus[candidates[min(tie, len(candidates) - 1)]].append(size)
    assert gpus == [[12, 12], [8, 8]] and sum(gpus[0]) > capacity
    # vramsched's rule refuses that fourth pod.
    assert worst_case_load([12, 8, 8], 12, 1, gpus=2, replicas=4, policy=D) > capacity


ops = st.lists(
    st.tuples(
        st.sampled_from(["bind", "bind", "admit", "admit", "depart"]),
        st.integers(1, 100),
        st.integers(0, 50),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    gpus=st.integers(1, 3), replicas=st.integers(2, 4), policy=st.sampled_from([D, P]), script=ops
)
def test_no_gpu_overflows_whatever_the_plugin_and_kubelet_do(
    gpus: int, replicas: int, policy: ReplicaPolicy, script: list
) -> None:
    """Binds go through vramsched's rule; kubelet admits bound pods in any order; the plugin
    breaks ties any way; pods leave. No GPU ever holds more than its memory."""
    memory = 100
    bound: dict[int, int] = {}  # pod id -> size, everything bound to the node
    waiting: list[int] = []  # bound, not yet admitted by kubelet
    gpu_of: dict[int, int] = {}
    next_id = 0
    for kind, size, choice in script:
        if kind == "bind":
            if (
                len(bound) < gpus * replicas
                and worst_case_load(list(bound.values()), size, 1, gpus, replicas, policy) <= memory
            ):
                bound[next_id] = size
                waiting.append(next_id)
                next_id += 1
        elif kind == "admit" and waiting:
            pid = waiting.pop(choice % len(waiting))
            allocated = [sum(1 for g in gpu_of.values() if g == i) for i in range(gpus)]
            candidates = plugin_candidates(allocated, [replicas] * gpus, policy)
            assert candidates, "kubelet always finds a free replica for a bound pod"
            gpu_of[pid] = candidates[choice % len(candidates)]
            load = sum(bound[p] for p, g in gpu_of.items() if g == gpu_of[pid])
            assert load <= memory, (gpu_of, bound)
        elif kind == "depart" and bound:
            pid = sorted(bound)[choice % len(bound)]
            del bound[pid]
            gpu_of.pop(pid, None)
            if pid in waiting:
                waiting.remove(pid)


# ----- the rule inside placement ---------------------------------------------------------------------


def ts_cluster(policy: str | None, *holds: tuple[str, int, int]):
    """One time-sliced node, 2 x 22.49Gi (L4), 4 replicas; `holds` = (pod, gpu, GiB) already bound."""
    c = cluster(gpu_node("ts", count=2, memory_mib=23034, replicas=4), replica_policy=policy)
    for name, gpu, gib in holds:
        c.ledger.reserve(
            Reservation(PodRef("default", name, name), "ts", (str(gpu),), (gib * GIB,))
        )
    return c


def test_distributed_refuses_what_the_plugin_could_stack_and_says_so() -> None:
    c = ts_cluster("distributed", ("a", 0, 12), ("b", 0, 8), ("c", 1, 8))
    out = filter_nodes(c.ledger, pod_demand(pod("d", "12Gi")), ["ts"])
    assert out.feasible == [] and out.failed == {
        "ts": "device plugin (distributed) may stack 24Gi on a 22.49Gi GPU"
    }
    assert filter_nodes(c.ledger, pod_demand(pod("e", "2Gi")), ["ts"]).feasible == ["ts"]
    # Exact per-GPU books (no device plugin: embedded cluster, simulator) would take it.
    exact = ts_cluster(None, ("a", 0, 12), ("b", 0, 8), ("c", 1, 8))
    assert filter_nodes(exact.ledger, pod_demand(pod("d", "12Gi")), ["ts"]).feasible == ["ts"]


def test_packed_is_stricter_than_distributed() -> None:
    c = ts_cluster("packed", ("a", 0, 12), ("b", 1, 8))
    out = filter_nodes(c.ledger, pod_demand(pod("c", "8Gi")), ["ts"])
    assert out.failed == {"ts": "device plugin (packed) may stack 28Gi on a 22.49Gi GPU"}


def test_distributed_books_each_replica_on_a_least_used_gpu() -> None:
    c = ts_cluster("distributed", ("a", 0, 4))
    res = choose_devices(c.ledger, pod_demand(pod("b", "4Gi")), "ts")
    assert isinstance(res, Reservation) and res.device_ids == ("1",)  # best fit would say GPU 0
    exact = ts_cluster(None, ("a", 0, 4))
    assert choose_devices(exact.ledger, pod_demand(pod("b", "4Gi")), "ts").device_ids == ("0",)


def test_mps_and_exclusive_gpus_keep_per_gpu_books() -> None:
    """MPS caps each client at memory/replicas and an exclusive GPU holds one pod: the plugin's
    choice cannot overcommit them, so no node-level rule applies."""
    c = cluster(
        gpu_node("mps", count=2, memory_mib=81920, replicas=4, strategy="mps"),
        gpu_node("x", count=2),
        replica_policy="distributed",
    )
    for i in range(6):
        d = pod_demand(pod(f"m{i}", "20Gi"))
        res = choose_devices(c.ledger, d, "mps")
        assert isinstance(res, Reservation)
        c.ledger.reserve(res)
    assert filter_nodes(c.ledger, pod_demand(pod("m6", "20Gi")), ["mps"]).feasible == ["mps"]
    assert check_invariant(c.ledger) == []


def test_pinning_environment_and_reference() -> None:
    p = pod("web-0", "4Gi")
    assert not references_pin_configmap(p) and not pod_demand(p).pin_configmap
    p["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "vramsched-web-0"}}]
    assert references_pin_configmap(p) and pod_demand(p).pin_configmap
    res = Reservation(PodRef("default", "web-0"), "n", ("3", "1"), (GIB, GIB))
    assert pin_environment(res, pinned=True) == {
        "NVIDIA_VISIBLE_DEVICES": "1,3",
        "VRAMSCHED_PINNED": "true",
    }
    assert pin_environment(res, pinned=False) == {"VRAMSCHED_PINNED": "false"}
    assert pin_environment(res, pinned=True, time_sliced=False) == {"VRAMSCHED_PINNED": "false"}
    mig = Reservation(PodRef("default", "web-0"), "n", ("0:1g.10gb:2",), (GIB,))
    assert pin_environment(mig, pinned=True) == {"VRAMSCHED_PINNED": "false"}


def test_preemption_only_evicts_what_lets_the_pod_past_the_plugins_worst_case() -> None:
    """12+8+8 on 2 x 22.49Gi; a 12Gi preemptor. Evicting an 8 frees a GPU in the books but the
    plugin could still stack 12+12: useless, so not offered. Evicting the 12 works."""
    c = ts_cluster("distributed", ("a", 0, 12), ("b", 1, 8), ("c", 0, 8))
    preemptor = pod_demand(pod("p", "12Gi", priority=10))
    assert preempt_victims(c.ledger, preemptor, {"ts": ["b"]}) == {}
    assert preempt_victims(c.ledger, preemptor, {"ts": ["a"]}) == {"ts": ["a"]}
    exact = ts_cluster(None, ("a", 0, 12), ("b", 1, 8), ("c", 0, 8))
    assert preempt_victims(exact.ledger, preemptor, {"ts": ["b"]}) == {
        "ts": ["b"]
    }  # exact books: it would fit


def test_plugin_allows_checks_devices_chosen_elsewhere_against_the_node_level_bound() -> None:
    """What bind asks of a background plan's GPUs (plans are made on per-GPU books alone)."""

    def res(gpu: int, gib: int) -> Reservation:
        return Reservation(PodRef("default", "d", "d"), "ts", (str(gpu),), (gib * GIB,))

    c = ts_cluster("distributed", ("a", 0, 12), ("b", 0, 8), ("c", 1, 8))
    d = pod_demand(pod("d", "12Gi"))
    assert c.ledger.fits(res(1, 12)) is None  # the per-GPU books take it ...
    assert not plugin_allows(c.ledger, d, res(1, 12))  # ... the plugin may stack 12 + 12 on one GPU
    assert plugin_allows(c.ledger, pod_demand(pod("e", "2Gi")), res(1, 2))
    # exact per-GPU books (no replica policy): nothing more to check
    assert plugin_allows(
        ts_cluster(None, ("a", 0, 12), ("b", 0, 8), ("c", 1, 8)).ledger, d, res(1, 12)
    )


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(["distributed", "packed"]),
    holds=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 30)), max_size=40
    ),
    gib=st.integers(1, 40),
    count=st.integers(2, 3),
)
def test_the_bound_for_a_multi_gpu_pod_is_worst_case_load_of_each_group(
    policy, holds, gib, count
) -> None:
    """`shared_fit` bounds every group at once (`_group_worst`); it must equal `worst_case_load`
    group by group, including groups holding more replicas than they have (recorded from the API:
    up to 40 on a node of 12), and groups with no pod (ts-big). Half the pods arrive after the
    view was first built, so its per-group keys are also kept up to date node by node."""
    from extender.placement.fit import plugin_view
    from extender.stock_plugin import shared_fit

    c = cluster(
        *(gpu_node(f"ts{i}", count=3, memory_mib=40 * 1024, replicas=4) for i in range(3)),
        gpu_node("ts-big", count=2, memory_mib=81920, replicas=8),
        replica_policy=policy,
    )
    a = c.ledger.arrays
    need = np.full(len(a.capacity), gib * GIB, np.int64)
    for j, (node, gpu, size) in enumerate(holds):
        if j == len(holds) // 2:
            shared_fit(
                plugin_view(c.ledger), need, count, pin_configmap=True
            )  # the view as it is now
        c.ledger.record(
            Reservation(
                PodRef("default", f"h{j}", f"h{j}"), f"ts{node}", (str(gpu),), (size * GIB,)
            )
        )
    fit = shared_fit(plugin_view(c.ledger), need, count, pin_configmap=True)
    v = plugin_view(c.ledger)
    groups = [g for gs in v.groups.values() for g in gs]
    assert groups and all(
        fit.worst[g.rows].tolist()
        == [worst_case_load(g.sizes, gib * GIB, count, g.gpus, g.replicas, g.policy)] * len(g.rows)
        for g in groups
    )


def _explain_one_node(fit, demand, r: int) -> str | None:
    """The per-node rule `placement.reasons._explain_shared` applies in vector form (its code before it
    was vectorised): the reason the device plugin is owed for node row `r`, or None (memory)."""
    from extender.placement.pin_rule import PIN_MISSING
    from extender.quantity import format_bytes

    a, s = fit.a, fit.shared
    lo, hi = int(a.node_start[r]), int(a.node_start[r + 1])
    rows = np.arange(lo, hi)
    match = fit.matches[rows]
    if match.any() and int((match & ~s.needs_pin[rows]).sum()) < demand.gpu_count:
        return PIN_MISSING
    local = (
        match
        & (a.used_replicas[rows] < a.replicas[rows])
        & (a.capacity[rows] - a.used[rows] >= fit.need[rows])
        & (a.per_pod_cap[rows] >= fit.need[rows])
    )
    blocked = local & ~s.allowed[rows]
    if int(local.sum()) < demand.gpu_count or not blocked.any():
        return None
    i = rows[blocked][np.argmin(s.worst[rows][blocked])]
    return f"device plugin ({s.policy}) may stack {format_bytes(int(s.worst[i]))} on a {format_bytes(int(a.capacity[i]))} GPU"


#: a small time-sliced fleet under a replica policy, pods recorded on it (overcommit included), and a pod
_POLICY_CASES = dict(
    policy=st.sampled_from(["distributed", "packed", "pinned"]),
    holds=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(1, 20)), max_size=30
    ),
    gib=st.integers(1, 24),
    gpus=st.integers(1, 2),
    pinned_pod=st.booleans(),
)
_POLICY_NODES = ("ts0", "ts1", "ts2", "ts3", "x")


def _policy_case(policy: str, holds, gib: int, gpus: int, pinned_pod: bool):
    c = cluster(
        *(gpu_node(f"ts{i}", count=2, memory_mib=23034, replicas=4) for i in range(4)),
        gpu_node("x", count=2),
        replica_policy=policy,
    )
    for j, (node, gpu, size) in enumerate(holds):
        c.ledger.record(
            Reservation(
                PodRef("default", f"h{j}", f"h{j}"), f"ts{node}", (str(gpu),), (size * GIB,)
            )
        )
    p = pod("new", f"{gib}Gi", gpus=gpus)
    if pinned_pod:
        p["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "vramsched-new"}}]
    return c, pod_demand(p)


@settings(max_examples=60, deadline=None)
@given(**_POLICY_CASES)
def test_filter_words_the_plugin_reasons_node_by_node_as_the_per_node_rule(
    policy, holds, gib, gpus, pinned_pod
) -> None:
    from extender.placement.fit import demand_fit
    from extender.placement.pin_rule import PIN_MISSING

    c, d = _policy_case(policy, holds, gib, gpus, pinned_pod)
    out = filter_nodes(c.ledger, d, list(_POLICY_NODES))
    fit = demand_fit(c.ledger, d)
    for name, reason in {**out.failed, **out.unresolvable}.items():
        plugin = reason == PIN_MISSING or reason.startswith("device plugin")
        memory = reason.endswith("free") and not reason.startswith("all GPU replicas")
        if plugin or memory:
            assert _explain_one_node(fit, d, c.ledger.node_row(name)) == (
                reason if plugin else None
            ), (name, reason)


def _choose_cluster_wide(ledger, demand, node: str):
    """`choose_devices` as it was before it read only the node's rows under a replica policy:
    the bound computed over every device of the cluster, then this node's rows picked."""
    from extender.placement.choose import best_fit_devices
    from extender.placement.filter import filter_rows
    from extender.placement.fit import demand_fit

    r = ledger.node_row(node)
    fit, rows = demand_fit(ledger, demand), np.asarray([r], np.int64)
    outcome = FilterOutcome()
    filter_rows(ledger, fit, demand, rows, outcome)
    if not outcome.feasible:
        return outcome.failed.get(node) or outcome.unresolvable.get(node) or "does not fit"
    chosen = np.sort(best_fit_devices(fit, demand.gpu_count, rows))
    return tuple(fit.a.devices[i].device_id for i in chosen.tolist())


@settings(max_examples=60, deadline=None)
@given(**_POLICY_CASES)
def test_bind_reads_only_its_node_and_chooses_as_over_the_whole_cluster(
    policy, holds, gib, gpus, pinned_pod
) -> None:
    c, d = _policy_case(policy, holds, gib, gpus, pinned_pod)
    for node in _POLICY_NODES:
        got = choose_devices(c.ledger, d, node)
        want = _choose_cluster_wide(c.ledger, d, node)
        assert (got if isinstance(got, str) else got.device_ids) == want, node
        if not isinstance(got, str):
            assert plugin_allows(c.ledger, d, got)


@settings(max_examples=60, deadline=None)
@given(**_POLICY_CASES)
def test_the_bound_over_the_cluster_is_each_nodes_bound(
    policy, holds, gib, gpus, pinned_pod
) -> None:
    """Over every row, `shared_fit` works out only the rows the bound or the pin rule applies to
    and keeps its label-only masks with the view; node by node (bind's slices) or for several
    nodes' rows (kept scores) it works them all out: all give the same rows, asked once or again
    after more pods."""
    from extender.placement.fit import plugin_view
    from extender.stock_plugin import shared_fit

    c, d = _policy_case(policy, holds, gib, gpus, pinned_pod)
    for extra in range(2):
        a = c.ledger.arrays
        need = np.full(len(a.capacity), d.bytes_per_gpu, np.int64)
        whole = shared_fit(plugin_view(c.ledger), need, d.gpu_count, d.pin_configmap)
        for r in range(len(a.node_names)):
            sl = slice(int(a.node_start[r]), int(a.node_start[r + 1]))
            part = shared_fit(plugin_view(c.ledger), need[sl], d.gpu_count, d.pin_configmap, sl)
            for field in ("allowed", "worst", "needs_pin", "distributed"):
                want = (
                    np.zeros(sl.stop - sl.start, bool if field != "worst" else np.int64)
                    if part is None
                    else getattr(part, field)
                )
                if part is None and field == "allowed":
                    want = np.ones(sl.stop - sl.start, bool)
                assert getattr(whole, field)[sl].tolist() == want.tolist(), (a.node_names[r], field)
        for picked in (
            [0, 2],
            [1, 2, 3],
            [0, 4],
            list(range(len(a.node_names))),
        ):  # several nodes' rows at once
            rows = np.concatenate([np.arange(a.node_start[r], a.node_start[r + 1]) for r in picked])
            part = shared_fit(plugin_view(c.ledger), need[rows], d.gpu_count, d.pin_configmap, rows)
            if part is not None:
                for field in ("allowed", "worst", "needs_pin", "distributed"):
                    assert getattr(part, field).tolist() == getattr(whole, field)[rows].tolist(), (
                        picked,
                        field,
                    )
        c.ledger.record(
            Reservation(PodRef("default", f"more{extra}", f"m{extra}"), "ts0", ("0",), (3 * GIB,))
        )
