"""The ledger's per-node summaries and filter's fast path that reads them.

Randomized (seeded) clusters of every kind of GPU node, random reservation histories (reserve,
release, record even when it overcommits, node relabelled) and random pods: filter must give
exactly what the straightforward per-device computation gives, and the summaries must always
equal a recomputation from scratch (`check_invariant` verifies that too).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from builders import A100_80, H100_80, cluster, gpu_node, mig_mixed_node, mig_single_node, pod

import extender.placement.choose as choosing
import extender.placement.filter as filtering
import extender.placement.score as scoring
from extender.demand import Demand, pod_demand
from extender.inventory import node_inventory
from extender.ledger import LedgerError, Reservation, check_invariant, slot_free_of
from extender.placement import FilterOutcome, choose_devices, filter_nodes, row_counts, score_rows
from extender.placement.cache import cache_of
from extender.placement.choose import best_fit_devices
from extender.placement.filter import _filter_one, filter_rows
from extender.placement.fit import demand_fit
from extender.placement.views import candidate_rows, resource_arrays

GIB = 1 << 30
RESOURCES = ["nvidia.com/gpu"] * 5 + [
    "nvidia.com/mig-1g.10gb",
    "nvidia.com/mig-2g.20gb",
    "nvidia.com/mig-3g.40gb",
]


def _random_node(rng: random.Random, name: str) -> dict:
    product = rng.choice([A100_80, H100_80, "NVIDIA-L4"])
    kind = rng.choice(["exclusive", "time-slicing", "mps", "mig-mixed", "mig-single", "cpu"])
    if kind == "exclusive":
        return gpu_node(
            name,
            count=rng.randint(1, 8),
            memory_mib=rng.choice([24576, 40960, 81920]),
            product=product,
        )
    if kind == "time-slicing":
        return gpu_node(name, count=rng.randint(1, 8), replicas=rng.randint(2, 10), product=product)
    if kind == "mps":
        return gpu_node(
            name,
            count=rng.randint(1, 4),
            replicas=rng.randint(2, 4),
            strategy="mps",
            product=product,
        )
    if kind == "mig-mixed":
        profiles = {
            "1g.10gb": (rng.randint(1, 7), 9984),
            "2g.20gb": (rng.randint(0, 2), 19968),
            "3g.40gb": (rng.randint(0, 2), 40192),
        }
        return mig_mixed_node(
            name,
            {p: v for p, v in profiles.items() if v[0]},
            gpus=rng.randint(1, 4),
            product=product,
        )
    if kind == "mig-single":
        return mig_single_node(
            name, "1g.10gb", slices=rng.randint(1, 14), memory_mib=9984, product=product
        )
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": {}},
        "status": {"allocatable": {"cpu": "8", "memory": "32Gi"}},
    }


def _random_pod(rng: random.Random, name: str) -> dict:
    resource = rng.choice(RESOURCES)
    gpus = 1 if "mig" in resource or rng.random() < 0.6 else rng.randint(2, 8)
    memory = rng.choice(
        [None, f"{rng.randint(1, 90)}Gi", f"{rng.randint(500, 90000)}Mi", "10Gi", "40Gi"]
    )
    annotations = {}
    if rng.random() < 0.25:
        annotations["vramsched.io/gpu-products"] = ",".join(
            rng.sample([A100_80, H100_80, "NVIDIA-L4", "NVIDIA-B200"], rng.randint(1, 2))
        )
    return pod(name, memory, gpus=gpus, resource=resource, annotations=annotations)


def _scores_afresh(ledger, demand: Demand, names: list[str], planned: str | None):
    """`score_rows` as it was before any scores were kept: device by device, the asked nodes only."""
    base = resource_arrays(ledger, demand)
    a = ledger.arrays if base is None else base
    fit = demand_fit(ledger, demand, base)
    rows, _ = candidate_rows(ledger, names)
    scores, placed = scoring._device_scores(
        fit, demand.gpu_count, rows, ledger.arrays.node_used_replicas > 0
    )
    return scoring._finish_scores(ledger, a, rows, scores, placed, planned)


def _reference(ledger, demand: Demand, names: list[str]) -> FilterOutcome:
    """filter as it was before the summaries: per device, over the current used columns."""
    out = FilterOutcome()
    view = resource_arrays(ledger, demand)
    one = view is not None and demand.gpu_count == 1 and demand.bytes_per_gpu is not None
    fit = demand_fit(ledger, demand, view, with_ok=not one)
    rows, unknown = candidate_rows(ledger, names)
    for n in unknown:
        out.unresolvable[n] = "node unknown to vramsched"
    if one:
        _filter_one(ledger, fit, demand, rows, out, None)
    else:
        filter_rows(ledger, fit, demand, rows, out)
    return out


def _feasible_by_hand(ledger, demand: Demand, names: list[str]) -> list[str]:
    """The definition, device by device in plain Python."""
    a = ledger.arrays
    out = []
    for name in names:
        r = ledger.node_row(name)
        if r is None:
            continue
        fitting = 0
        for i in range(int(a.node_start[r]), int(a.node_start[r + 1])):
            d = a.devices[i]
            need = d.per_pod_cap_bytes if demand.bytes_per_gpu is None else demand.bytes_per_gpu
            product_ok = (
                demand.allowed_products is None
                or d.product.removesuffix("-SHARED") in demand.allowed_products
                or d.product in demand.allowed_products
            )
            if (
                d.resource == demand.resource
                and product_ok
                and d.per_pod_cap_bytes >= need
                and a.used_replicas[i] < a.replicas[i]
                and a.capacity[i] - a.used[i] >= need
            ):
                fitting += 1
        if fitting >= demand.gpu_count:
            out.append(name)
    return out


def _broken(ledger) -> list:
    """check_invariant without what the history may legitimately leave: a pod `record`ed overcommitted,
    a pod on a device that a relabel removed."""
    return [
        v
        for v in check_invariant(ledger)
        if "oversubscribed" not in v.what and "missing device" not in v.what
    ]


def _random_step(rng: random.Random, c, names: list[str], step: int) -> None:
    ledger = c.ledger
    roll = rng.random()
    held = [r.key for r in ledger.reservations()]
    if roll < 0.5:
        demand = pod_demand(_random_pod(rng, f"r{step}"))
        node = rng.choice(names)
        res = choose_devices(ledger, demand, node)
        if isinstance(res, Reservation):
            ledger.reserve(res)
    elif roll < 0.7 and held:
        ledger.release(rng.choice(held))
    elif roll < 0.85:  # a pod that runs there already, even if it overcommits the device
        node = rng.choice(names)
        inv = ledger.node(node)
        if inv is not None and inv.devices:
            devs = rng.sample(inv.devices, rng.randint(1, min(2, len(inv.devices))))
            demand = pod_demand(pod(f"rec{step}"))
            ledger.record(
                Reservation(
                    pod=demand.pod,
                    node=node,
                    device_ids=tuple(d.device_id for d in devs),
                    bytes_per_device=tuple(rng.randint(0, 90) * GIB for _ in devs),
                )
            )
    elif roll < 0.9:  # relabel a node: the arrays (and summaries) are rebuilt
        c.ledger.upsert_node(node_inventory(_random_node(rng, rng.choice(names))))
    else:
        demand = pod_demand(_random_pod(rng, f"x{step}"))
        node = rng.choice(names)
        res = choose_devices(ledger, demand, node)
        if isinstance(res, Reservation):
            ledger.reserve(res)
            with pytest.raises(LedgerError):
                ledger.reserve(
                    Reservation(
                        pod=pod_demand(pod(f"y{step}")).pod,
                        node=node,
                        device_ids=res.device_ids * 2,
                        bytes_per_device=res.bytes_per_device * 2,
                    )
                )


@pytest.mark.parametrize("seed", range(10))
def test_filter_fast_path_equals_per_device_computation(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    used: list[str] = []

    def spy(real):
        def call(*args):
            got = real(*args)
            if got is not None:
                used.append(real.__name__)
            return got

        return call

    monkeypatch.setattr(filtering, "one_largest", spy(filtering.one_largest))
    monkeypatch.setattr(filtering, "node_fit", spy(filtering.node_fit))
    monkeypatch.setattr(scoring, "_score_summary", spy(scoring._score_summary))
    rng = random.Random(seed)
    n_nodes = rng.randint(3, 30)
    names = [f"n{i}" for i in range(n_nodes)] + [
        "mig"
    ]  # one MIG node at least: per-resource views exist
    c = cluster(
        *[_random_node(rng, n) for n in names[:-1]],
        mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
    )
    asked = names + ["ghost"]
    for step in range(60):
        _random_step(rng, c, names, step)
        assert _broken(c.ledger) == [], step
        for j in range(4):
            demand = pod_demand(_random_pod(rng, f"q{step}-{j}"))
            subset = asked if j % 2 else rng.sample(asked, rng.randint(0, len(asked)))
            got = filter_nodes(c.ledger, demand, subset)
            want = _reference(c.ledger, demand, subset)
            assert got.feasible == want.feasible, (step, demand)
            assert got.failed == want.failed, (step, demand)
            assert got.unresolvable == want.unresolvable, (step, demand)
            assert got.feasible == _feasible_by_hand(c.ledger, demand, subset)
            if demand.wants_gpu:
                planned = rng.choice([None, *asked])
                for candidates in (got.feasible, subset):
                    fast = score_rows(c.ledger, demand, candidates, planned)
                    slow = _scores_afresh(c.ledger, demand, candidates, planned)
                    assert fast[0] is slow[0] and np.array_equal(fast[1], slow[1]), (step, demand)
                    assert fast[2].tolist() == slow[2].tolist(), (step, demand, candidates)
                # bind's one-node choice equals that node's share of the choice over several nodes
                fit = demand_fit(c.ledger, demand)
                rows = np.arange(len(fit.a.node_names))
                many = best_fit_devices(fit, demand.gpu_count, rows)
                for r in rows.tolist():
                    one = best_fit_devices(fit, demand.gpu_count, np.asarray([r]))
                    assert sorted(one.tolist()) == sorted(
                        i for i in many.tolist() if fit.a.node_of[i] == r
                    ), (step, r)
    assert {"one_largest", "node_fit", "_score_summary"} <= set(
        used
    )  # every fast path was taken (and compared)


@pytest.mark.parametrize("seed", range(6))
def test_binds_one_node_choice_in_python_equals_the_vector_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(100 + seed)
    names = [f"n{i}" for i in range(12)] + ["mig"]
    c = cluster(
        *[_random_node(rng, n) for n in names[:-1]],
        mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
    )
    quick_fits = 0
    for step in range(80):
        _random_step(rng, c, names, step)
        for j in range(4):
            demand = pod_demand(_random_pod(rng, f"b{step}-{j}"))
            node = rng.choice(names)
            fast = choose_devices(c.ledger, demand, node)
            with monkeypatch.context() as m:
                m.setattr(choosing, "_choose_on_node", lambda *args: None)
                slow = choose_devices(c.ledger, demand, node)
            assert fast == slow, (step, demand, node)
            quick_fits += isinstance(fast, Reservation) and demand.wants_gpu
    assert quick_fits > 20  # the Python path did answer, and agreed


def test_summary_follows_every_change_and_invariant_catches_a_stale_one() -> None:
    rng = random.Random(42)
    names = [f"n{i}" for i in range(12)]
    c = cluster(
        *[gpu_node(n, count=4, replicas=rng.randint(1, 4)) for n in names],
        mig_mixed_node("m", {"1g.10gb": (3, 9984), "3g.40gb": (1, 40192)}),
    )
    ledger = c.ledger
    rids = list(ledger.arrays.resources.values())
    for rid in rids:
        ledger.slot_free(rid)  # built: from now on kept current by the changes
    for step in range(80):
        _random_step(rng, c, names + ["m"], step)
        a = ledger.arrays
        for rid in a.resources.values():
            assert np.array_equal(ledger.slot_free(rid), slot_free_of(a, rid)), step
    assert _broken(ledger) == []
    rid = ledger.arrays.resources["nvidia.com/gpu"]
    stale = ledger.slot_free(rid)
    stale.flags.writeable = True
    stale[0] += 1  # what a missed update would leave behind
    assert [v.what for v in _broken(ledger)] == ["stale summary of free nvidia.com/gpu"]


def test_a_full_gpu_reads_as_no_free_replica_and_an_overcommitted_one_as_none_free() -> None:
    c = cluster(gpu_node("a", count=2, replicas=2, memory_mib=10240))
    ledger = c.ledger
    rid = ledger.arrays.resources["nvidia.com/gpu"]
    assert ledger.slot_free(rid).tolist() == [10 * GIB]
    p1, p2, p3 = (pod_demand(pod(f"p{i}")).pod for i in range(3))
    ledger.reserve(Reservation(pod=p1, node="a", device_ids=("0",), bytes_per_device=(4 * GIB,)))
    ledger.reserve(Reservation(pod=p2, node="a", device_ids=("0",), bytes_per_device=(4 * GIB,)))
    assert ledger.slot_free(rid).tolist() == [10 * GIB]  # GPU 0 has no replica left, GPU 1 is empty
    ledger.record(Reservation(pod=p3, node="a", device_ids=("1",), bytes_per_device=(12 * GIB,)))
    # GPU 1 has a replica left but is 2 GiB overcommitted (0 free, not below); GPU 0 has no
    # replica (-1): the max is 0
    assert ledger.slot_free(rid).tolist() == [0]
    demand = pod_demand(pod("q", "1Gi"))
    assert filter_nodes(ledger, demand, ["a"]).failed == {"a": "no GPU with 1Gi free"}
    ledger.release(p1.key)
    assert ledger.slot_free(rid).tolist() == [6 * GIB]  # GPU 0 has a replica again, 6 GiB free
    ledger.reserve(Reservation(pod=p1, node="a", device_ids=("0",), bytes_per_device=(4 * GIB,)))
    out = filter_nodes(ledger, demand, ["a"])
    assert out.feasible == [] and out.failed == _reference(ledger, demand, ["a"]).failed
    ledger.release(p2.key)
    assert ledger.slot_free(rid).tolist() == [6 * GIB]
    assert filter_nodes(ledger, demand, ["a"]).feasible == ["a"]
    assert [v.what for v in check_invariant(ledger)] == [
        "VRAM oversubscribed: 12884901888 > 10737418240"
    ]


def test_summary_after_most_nodes_changed_at_once() -> None:
    """More than 64 nodes changed between two reads: recomputed in one pass, same result."""
    names = [f"n{i}" for i in range(100)]
    c = cluster(*[gpu_node(n, count=2, replicas=2, memory_mib=10240) for n in names])
    ledger = c.ledger
    rid = ledger.arrays.resources["nvidia.com/gpu"]
    before = ledger.slot_free(rid).copy()
    for i, n in enumerate(names[:90]):
        ledger.record(
            Reservation(
                pod=pod_demand(pod(f"p{i}")).pod,
                node=n,
                device_ids=("0", "1"),
                bytes_per_device=(i * GIB // 8, i * GIB // 4),
            )
        )
    after = ledger.slot_free(rid)
    assert np.array_equal(after, slot_free_of(ledger.arrays, rid))
    assert (after[90:] == before[90:]).all()
    assert after[:90].tolist() == [
        max(10 * GIB - i * GIB // 8, 0) for i in range(90)
    ]  # GPU 0 has the most left (none, when both are overcommitted)
    ledger.record(
        Reservation(
            pod=pod_demand(pod("q")).pod, node="n0", device_ids=("0",), bytes_per_device=(11 * GIB,)
        )
    )
    assert (
        ledger.slot_free(rid)[0] == 10 * GIB
    )  # GPU 1: 1 replica left, 10 GiB free; GPU 0: none left
    assert _broken(ledger) == []


def test_a_lone_overcommitted_gpu_with_a_free_replica_reads_none_free() -> None:
    """Records over a GPU's memory (pods bound by another scheduler, or before a relabel): its
    free replica still counts, so filter says no memory is free, not that no replica is."""
    c = cluster(
        gpu_node("b", count=1, replicas=2, memory_mib=10240),
        mig_mixed_node("m", {"1g.10gb": (1, 9984)}),
    )
    ledger = c.ledger
    rid = ledger.arrays.resources["nvidia.com/gpu"]
    ledger.slot_free(rid)
    ledger.record(
        Reservation(
            pod=pod_demand(pod("p")).pod, node="b", device_ids=("0",), bytes_per_device=(12 * GIB,)
        )
    )
    assert ledger.slot_free(rid).tolist() == [0, -1]
    demand = pod_demand(pod("q", "1Gi"))
    failed = filter_nodes(ledger, demand, ["b", "m"]).failed
    assert failed == _reference(ledger, demand, ["b", "m"]).failed
    assert failed["b"] == "no GPU with 1Gi free"


@pytest.mark.parametrize("width", [0, 1, 5, 8, 16, 56])
def test_row_counts_equals_summing_each_row(width):
    rng = np.random.default_rng(width)
    mask = rng.random((300, width)) < 0.4
    assert row_counts(mask).tolist() == mask.sum(axis=1).tolist()
    assert row_counts(mask[::2]).tolist() == mask[::2].sum(axis=1).tolist()  # not contiguous
    full = np.ones((3, width), bool)
    assert row_counts(full).tolist() == [width] * 3


def _reference_per_device(ledger, demand: Demand, names: list[str]) -> FilterOutcome:
    """filter under a replica policy before `_filter_plugin`: every device, the bound in `demand_fit`."""
    out = FilterOutcome()
    fit = demand_fit(ledger, demand)
    rows, unknown = candidate_rows(ledger, names)
    for n in unknown:
        out.unresolvable[n] = "node unknown to vramsched"
    filter_rows(ledger, fit, demand, rows, out)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_filter_under_a_replica_policy_fast_path_equals_per_device(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a device-plugin policy (live mode) filter answers from the per-node summary plus the
    bound per node: same feasible nodes and reasons as over every device, except the wording
    `_filter_one` has always had for an overcommitted GPU with a free replica."""
    taken: list[tuple[bool, int]] = []
    real = filtering._filter_plugin

    def spy(ledger, demand, names, out):
        taken.append((real(ledger, demand, names, out), demand.gpu_count))
        return taken[-1][0]

    monkeypatch.setattr(filtering, "_filter_plugin", spy)
    rng = random.Random(100 + seed)
    names = [f"n{i}" for i in range(rng.randint(3, 25))] + ["mig"]
    nodes = [_random_node(rng, n) for n in names[:-1]]
    c = cluster(
        *nodes,
        mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
        replica_policy=rng.choice(["distributed", "packed", "pinned"]),
    )
    asked = names + ["ghost"]
    for step in range(50):
        _random_step(rng, c, names, step)
        for j in range(4):
            p = _random_pod(rng, f"q{step}-{j}")
            if rng.random() < 0.5:
                p["spec"]["containers"][0]["envFrom"] = [
                    {"configMapRef": {"name": f"vramsched-q{step}-{j}"}}
                ]
            demand = pod_demand(p)
            if not demand.wants_gpu:
                continue
            subset = asked if j % 2 else rng.sample(asked, rng.randint(0, len(asked)))
            got = filter_nodes(c.ledger, demand, subset)
            want = _reference_per_device(c.ledger, demand, subset)
            assert got.feasible == want.feasible, (step, demand)
            assert got.unresolvable == want.unresolvable, (step, demand)
            assert got.failed == want.failed, (step, demand)
    # the fast path answered one-GPU and multi-GPU pods (test_stock_plugin covers the per-device
    # path it gives way to: a fleet of one resource has no per-resource view)
    assert {k > 1 for ok, k in taken if ok} == {False, True}


@pytest.mark.parametrize("seed", range(8))
def test_scores_kept_per_shape_equal_scores_computed_afresh(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prioritize keeps each demand shape's scores for every node and brings them up to date
    from the ledger's log of touched nodes: after any history (reserve, release, records that
    overcommit, relabels, the log trimmed past a shape's last look) they equal the per-device
    computation, for a handful of shapes asked again and again."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(rng.randint(3, 30))] + ["mig"]
    c = cluster(
        *[_random_node(rng, n) for n in names[:-1]],
        mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
        # device by device under a policy
        replica_policy=[None, None, "distributed", "pinned", "packed"][seed % 5],
    )
    shapes = [pod_demand(_random_pod(rng, f"shape{i}")) for i in range(6)]
    shapes = [d for d in shapes if d.wants_gpu] or [pod_demand(pod("s", "10Gi"))]
    score_summary, patched = scoring._score_summary, []

    def spy(ledger, demand, rows, a):
        entry = cache_of(a).scores.get(
            (demand.bytes_per_gpu, demand.allowed_products, demand.gpu_count)
        )
        got = score_summary(ledger, demand, rows, a)
        if entry is not None and got is not None and got[0] is entry.scores:
            patched.append(demand)  # an entry kept from an earlier call answered
        return got

    def spy_devices(ledger, demand, a, full, at=None):
        before = dict(cache_of(a).device_scores)
        got = device_scores(ledger, demand, a, full, at)
        if any(got[0] is e.scores for e in before.values()):
            patched.append(demand)
        return got

    device_scores = scoring._device_scores_kept
    monkeypatch.setattr(scoring, "_score_summary", spy)
    monkeypatch.setattr(scoring, "_device_scores_kept", spy_devices)
    for step in range(80):
        for i in range(rng.randint(0, 4)):
            _random_step(rng, c, names, step * 10 + i)
        if (
            rng.random() < 0.05
        ):  # the log was trimmed past what the entries last saw: they start over
            c.ledger.touched_base += len(c.ledger.touched) + 1
            c.ledger.touched.clear()
        for demand in rng.sample(shapes, len(shapes)):
            fast = score_rows(c.ledger, demand, names, None)
            assert fast[2].tolist() == _scores_afresh(c.ledger, demand, names, None)[2].tolist(), (
                step,
                demand,
            )
    assert patched  # kept entries were used (and compared), not only fresh ones


@pytest.mark.parametrize("seed", range(16))
def test_filter_under_a_replica_policy_equals_the_per_device_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live mode's filter (`_filter_plugin`: per-node summaries, the bound per node, resources the
    bound never applies to skipped) gives what the per-device path gives under the same policy,
    on random clusters with MIG, MPS and time-sliced nodes, after random histories."""
    rng = random.Random(100 + seed)
    names = [f"n{i}" for i in range(rng.randint(3, 30))] + ["mig"]
    c = cluster(
        *[_random_node(rng, n) for n in names[:-1]],
        mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
        replica_policy=["distributed", "packed", "pinned"][seed % 3],
    )
    plugin, taken = filtering._filter_plugin, []

    def spy(*args):
        got = plugin(*args)
        taken.append(got)
        return got

    asked = names + ["ghost"]
    for step in range(40):
        _random_step(rng, c, names, step)
        for j in range(4):
            demand = pod_demand(_random_pod(rng, f"q{step}-{j}"))
            monkeypatch.setattr(filtering, "_filter_plugin", spy)
            got = filter_nodes(c.ledger, demand, asked)
            monkeypatch.setattr(filtering, "_filter_plugin", lambda *args: False)
            want = filter_nodes(c.ledger, demand, asked)
            assert (got.feasible, dict(got.failed), dict(got.unresolvable)) == (
                want.feasible,
                dict(want.failed),
                dict(want.unresolvable),
            ), (step, demand)
    assert any(taken)  # the live-mode path answered (and was compared)


@pytest.mark.parametrize("seed", range(16))
def test_filter_passes_exactly_the_nodes_bind_can_place_the_pod_on(seed: int) -> None:
    """kube-scheduler binds to a node filter passed: bind must find devices there, and a node
    filter refused must be one bind could not use either. On random clusters (every sharing
    mode, MIG, records over a GPU's memory, relabels), with and without a replica policy."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(rng.randint(3, 20))] + ["mig"]
    c = cluster(
        *[_random_node(rng, n) for n in names[:-1]],
        mig_mixed_node("mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
        replica_policy=rng.choice([None, "distributed", "packed", "pinned"]),
    )
    passed = 0
    for step in range(40):
        _random_step(rng, c, names, step)
        for j in range(6):
            demand = pod_demand(_random_pod(rng, f"q{step}-{j}"))
            feasible = set(filter_nodes(c.ledger, demand, names).feasible)
            for node in names:
                placed = isinstance(choose_devices(c.ledger, demand, node), Reservation)
                assert placed == (node in feasible), (step, demand, node)
            passed += len(feasible)
    assert passed > 50  # pods did fit, and were placed
