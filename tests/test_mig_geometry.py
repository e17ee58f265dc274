"""MIG geometry planner (extender.planner.mig_geometry)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import yaml

from extender import mig
from extender.mig import GIB
from extender.planner.mig_geometry import (
    MigGpuState,
    MigPlan,
    MigSliceState,
    PendingPod,
    config_name,
    evaluate_uniform,
    plan_mig_geometry,
)

TL = 5.0  # generous solver limit; the small cases below solve in milliseconds


def gpu(
    node: str,
    index: int,
    model: mig.MigModel,
    layout: str | dict | None = "all-balanced",
    occupied: dict | None = None,
    **kw,
) -> MigGpuState:
    """A GPU with a named or explicit layout; `occupied` = {profile: [bytes, ...]} marks slices used."""
    if layout is None:
        g = ()
    elif isinstance(layout, str):
        g = mig.named_geometries(model)[layout]
    else:
        g = mig.geometry(layout)
    occ = {p: list(v) for p, v in (occupied or {}).items()}
    slices = []
    for name, k in g:
        for _ in range(k):
            b = occ.get(name, [])
            slices.append(MigSliceState(name, b.pop(0) if b else None, None, None))
    assert not any(occ.values()), "occupied profile not in layout"
    return MigGpuState(node, index, model, tuple(slices), **kw)


def pods(*gib: float, prefix: str = "p") -> list[PendingPod]:
    return [PendingPod(f"{prefix}{i}", int(g * GIB)) for i, g in enumerate(gib)]


def check_plan(plan: MigPlan, gpus: list[MigGpuState], pending: list[PendingPod]) -> None:
    """Invariants every plan must satisfy."""
    by_key = {(g.node, g.gpu_index): g for g in gpus}
    assert len(plan.gpus) == len(gpus)
    keys = [p.pod for p in plan.placements]
    assert len(keys) == len(set(keys)), "a pod placed twice"
    assert set(keys) | {k for k, _ in plan.unplaced} == {p.key for p in pending}
    assert not set(keys) & {k for k, _ in plan.unplaced}
    pend = {p.key: p for p in pending}
    for gp in plan.gpus:
        state = by_key[(gp.node, gp.gpu_index)]
        # occupied slices survive
        assert mig.geometry_is_subset(state.occupied, gp.planned)
        if gp.changed:
            assert gp.frozen_reason is None
            assert state.model is not None and mig.is_valid_geometry(state.model, gp.planned)
        if state.model is not None and gp.placement is not None:
            assert mig.placement_is_valid(state.model, gp.placement)
            assert Counter(n for n, _ in gp.placement) == Counter(dict(gp.planned))
        # one pod per free slice, each pod fits
        free = Counter(dict(gp.planned))
        free.subtract(Counter(dict(state.occupied)))
        used = Counter(p.profile for p in gp.pods)
        for prof, k in used.items():
            assert k <= free[prof]
        for p in gp.pods:
            assert p.slice_bytes >= pend[p.pod].model_memory_bytes
            allowed = pend[p.pod].allowed_profiles
            assert allowed is None or p.profile in allowed
    assert plan.pods_placed == len(plan.placements) <= plan.pods_bound


# --------------------------------------------------------------------------------------------- basics


def test_empty_demand_changes_nothing() -> None:
    gpus = [gpu("n1", i, mig.H100_80GB) for i in range(4)]
    plan = plan_mig_geometry(gpus, [], time_limit_s=TL)
    check_plan(plan, gpus, [])
    assert plan.reconfigured_gpus == 0 and plan.node_labels() == {}
    assert yaml.safe_load(plan.mig_parted_yaml()) == {"version": "v1", "mig-configs": {}}


def test_big_model_gets_a_whole_gpu_slice() -> None:
    gpus = [gpu("n1", 0, mig.H100_80GB), gpu("n1", 1, mig.H100_80GB)]
    pending = pods(70)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 1 and plan.reconfigured_gpus == 1  # only one GPU needs to change
    (p,) = plan.placements
    assert p.profile == "7g.80gb"


def test_too_big_pod_is_unplaced_with_reason() -> None:
    gpus = [gpu("n1", 0, mig.H100_80GB)]
    plan = plan_mig_geometry(gpus, pods(100), time_limit_s=TL)
    assert plan.pods_placed == 0 and plan.pods_bound == 0
    (key, reason) = plan.unplaced[0]
    assert key == "p0" and "100.0 GiB" in reason and "largest 79.2 GiB" in reason
    assert plan.reconfigured_gpus == 0


def test_prefers_free_slices_on_gpus_already_in_use() -> None:
    m = mig.H100_80GB
    gpus = [gpu("n1", 0, m, occupied={"3g.40gb": [30 * GIB]}), gpu("n1", 1, m), gpu("n2", 0, m)]
    pending = pods(8, 8, 15)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 3 and plan.new_gpus_used == 0
    assert {(p.node, p.gpu_index) for p in plan.placements} == {("n1", 0)}


def test_least_waste_among_equal_plans() -> None:
    m = mig.H100_80GB
    gpus = [gpu("n1", 0, m, occupied={"3g.40gb": [30 * GIB]})]  # free: 2x1g.10gb, 1x2g.20gb
    pending = pods(8)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    assert plan.placements[0].profile == "1g.10gb"


def test_allowed_profiles_are_respected() -> None:
    m = mig.A100_80GB
    gpus = [gpu("n1", 0, m, layout="all-1g.10gb")]
    pending = [
        PendingPod("a", 0, frozenset({"2g.20gb"})),
        PendingPod("b", 0, frozenset({"2g.20gb"})),
    ]
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 2 and all(p.profile == "2g.20gb" for p in plan.placements)


def test_input_validation() -> None:
    g = [gpu("n1", 0, mig.H100_80GB)]
    with pytest.raises(ValueError):
        plan_mig_geometry(g, pods(1) + pods(2), time_limit_s=TL)  # duplicate keys p0
    with pytest.raises(ValueError):
        plan_mig_geometry(g + g, pods(1), time_limit_s=TL)
    with pytest.raises(ValueError):
        plan_mig_geometry(g, pods(1), reconfigure="everything", time_limit_s=TL)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        plan_mig_geometry(g, pods(1), tie_breakers=("waste", "gpus"), time_limit_s=TL)


# --------------------------------------------------------------------------------------------- occupied slices


def test_whole_gpu_mode_keeps_partly_used_gpus_exactly() -> None:
    m = mig.H100_80GB
    gpus = [gpu("n1", 0, m, layout="all-1g.10gb", occupied={"1g.10gb": [5 * GIB]})]
    pending = pods(70)  # would need the 7g, which means destroying the used 1g
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 0 and plan.gpus[0].planned == gpus[0].current
    assert plan.node_labels() == {}


def test_free_slices_mode_recarves_around_pinned_instance() -> None:
    m = mig.H100_80GB
    # 3g.40gb at slot 4 is in use, the rest is 4 x 1g.10gb: re-carve the free half into a 3g or 4g
    slices = [MigSliceState("3g.40gb", 30 * GIB, 4, "ns/running")] + [
        MigSliceState("1g.10gb", None, s) for s in range(4)
    ]
    gpus = [MigGpuState("n1", 0, m, tuple(slices))]
    pending = pods(35)
    whole = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    assert whole.pods_placed == 0
    plan = plan_mig_geometry(gpus, pending, reconfigure="free-slices", time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 1
    gp = plan.gpus[0]
    assert gp.planned in (mig.geometry({"4g.40gb": 1, "3g.40gb": 1}), mig.geometry({"3g.40gb": 2}))
    assert ("3g.40gb", 4) in gp.placement
    assert plan.placements[0].profile in ("3g.40gb", "4g.40gb") and plan.placements[0].start == 0
    assert any("mig-parted clears" in w for w in plan.warnings)


def test_node_with_inferred_layout_and_used_slice_is_frozen() -> None:
    m = mig.H100_80GB
    gpus = [
        gpu("n1", 0, m, occupied={"1g.10gb": [4 * GIB]}, layout_known=False),
        gpu("n1", 1, m, layout_known=False),
        gpu("n2", 0, m, layout_known=False),  # no used slice: free to change
    ]
    pending = pods(70, 70)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 1
    assert plan.placements[0].node == "n2"
    n1 = next(n for n in plan.nodes if n.node == "n1")
    assert not n1.changed and n1.frozen_reason and "inferred" in n1.frozen_reason


def test_unknown_gpu_is_left_alone_but_its_free_slices_count() -> None:
    slices = (MigSliceState("2g.12gb", None), MigSliceState("1g.6gb", None))
    unknown = MigGpuState(
        "x1",
        0,
        None,
        slices,
        product="NVIDIA-RTX-PRO-6000",
        profile_memory={"2g.12gb": 11 * GIB, "1g.6gb": 5 * GIB},
    )
    gpus = [unknown]
    pending = pods(10, 4, 20)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 2 and not plan.gpus[0].changed
    assert "no MIG profile table" in (plan.nodes[0].frozen_reason or "")


# --------------------------------------------------------------------------------------------- output


def test_mig_parted_config_realises_the_plan() -> None:
    m = mig.H100_80GB
    gpus = [gpu("n1", i, m, layout="all-1g.10gb") for i in range(2)] + [
        gpu("n2", i, m, layout="all-1g.10gb") for i in range(2)
    ]
    gpus[0] = gpu("n1", 0, m, layout="all-1g.10gb", occupied={"1g.10gb": [3 * GIB]})
    pending = pods(70, 70, 70)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 3
    doc = yaml.safe_load(plan.mig_parted_yaml())
    assert doc["version"] == "v1"
    labels = plan.node_labels()
    assert set(labels) == {"n1", "n2"}
    for node, value in labels.items():
        assert len(value) <= 63 and value.startswith("vramsched-")
        entries = doc["mig-configs"][value]
        planned = {gp.gpu_index: dict(gp.planned) for gp in plan.gpus if gp.node == node}
        got = {}
        for e in entries:
            assert e["mig-enabled"] is True
            idx = list(planned) if e["devices"] == "all" else e["devices"]
            for i in idx:
                got[i] = e["mig-devices"]
        assert got == planned
    # n2 is uniform -> one "devices: all" entry with a descriptive name; n1 keeps GPU 0 as it is
    assert (
        labels["n2"] == "vramsched-7g.80gb"
        and doc["mig-configs"]["vramsched-7g.80gb"][0]["devices"] == "all"
    )
    assert doc["mig-configs"][labels["n1"]][0] == {
        "devices": [0],
        "mig-enabled": True,
        "mig-devices": {"1g.10gb": 7},
    }


def test_config_name_is_label_safe_and_stable() -> None:
    g1 = mig.geometry({"1g.10gb+me": 1, "1g.10gb": 6})
    g2 = mig.H100_80GB.balanced
    assert config_name([(0, g1), (1, g1)]) == "vramsched-1g.10gbx6_1g.10gb-me"
    mixed = config_name([(0, g1), (1, g2)])
    assert mixed == config_name([(1, g2), (0, g1)]) and mixed.startswith("vramsched-mixed-")
    assert mixed != config_name([(0, g2), (1, g1)])


# --------------------------------------------------------------------------------------------- vs baselines


def _random_case(seed: int) -> tuple[list[MigGpuState], list[PendingPod]]:
    rng = random.Random(seed)
    models = [mig.A100_80GB, mig.H100_80GB, mig.H200_141GB]
    gpus = []
    for n in range(3):
        m = rng.choice(models)
        layout = rng.choice(list(mig.named_geometries(m)))
        for i in range(2):
            g = gpu(f"node{n}", i, m, layout=layout)
            if rng.random() < 0.3:
                first = g.slices[0]
                g = MigGpuState(
                    g.node, g.gpu_index, m, (MigSliceState(first.profile, GIB),) + g.slices[1:]
                )
            gpus.append(g)
    sizes = [7.8, 8.5, 13.4, 19.0, 23.4, 44.6, 70.1]
    pending = [
        PendingPod(f"pod{i}", int(rng.choice(sizes) * GIB)) for i in range(rng.randint(6, 20))
    ]
    return gpus, pending


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_planner_places_at_least_best_uniform(seed: int) -> None:
    gpus, pending = _random_case(seed)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL, seed=seed)
    check_plan(plan, gpus, pending)
    assert plan.status == "OPTIMAL"
    best = 0
    for fam in mig.UNIFORM_FAMILIES:
        u = evaluate_uniform(gpus, pending, fam, time_limit_s=TL)
        check_plan(u, gpus, pending)
        for gp, st in zip(u.gpus, sorted(gpus, key=lambda g: (g.node, g.gpu_index))):
            assert gp.planned == (
                st.current if st.is_occupied else mig.uniform_geometry(st.model, fam)
            )
        best = max(best, u.pods_placed)
    assert plan.pods_placed >= best


# --------------------------------------------------------------------------------------------- brute force


def _max_matching(pod_bytes: list[int], slice_bytes: list[int]) -> int:
    """Maximum bipartite matching pod -> slice with slice >= pod (augmenting paths)."""
    match: dict[int, int] = {}

    def try_pod(i: int, seen: set[int]) -> bool:
        for j, sb in enumerate(slice_bytes):
            if sb >= pod_bytes[i] and j not in seen:
                seen.add(j)
                if j not in match or try_pod(match[j], seen):
                    match[j] = i
                    return True
        return False

    return sum(try_pod(i, set()) for i in range(len(pod_bytes)))


def _brute_force(gpus: list[MigGpuState], pending: list[PendingPod]) -> tuple[int, int]:
    """(max pods, min GPUs used for that many) over all maximal geometries of free GPUs."""
    options = []
    for g in gpus:
        if g.is_occupied:
            options.append([g.current])
        else:
            opts = mig.enumerate_geometries(g.model)
            options.append(opts + ([g.current] if g.current not in opts else []))
    best = (0, 0)
    pb = [p.model_memory_bytes for p in pending]
    for combo in itertools.product(*options):
        for hosts in itertools.product([False, True], repeat=len(gpus)):
            slices = []
            n_new = 0
            for g, geo, host in zip(gpus, combo, hosts):
                if not (host or g.is_occupied):
                    continue
                n_new += not g.is_occupied
                free = Counter(dict(geo)) - Counter(dict(g.occupied))
                slices += [g.model.profile(n).memory_bytes for n in free.elements()]
            k = _max_matching(pb, slices)
            if (k, -n_new) > (best[0], -best[1]):
                best = (k, n_new)
    return best


@pytest.mark.parametrize(
    "models, sizes, occupied",
    [
        ((mig.H100_80GB, mig.H100_80GB), [8, 8, 8, 15, 15, 23, 44], False),
        ((mig.A100_40GB, mig.H200_141GB), [4, 9, 9, 15, 30, 30, 60, 100], False),
        ((mig.H100_80GB, mig.A100_80GB), [9, 9, 9, 9, 9, 19, 19, 19, 30], True),
    ],
)
def test_small_cases_match_brute_force(models, sizes, occupied) -> None:
    gpus = [gpu(f"n{i}", 0, m, layout="all-balanced") for i, m in enumerate(models)]
    if occupied:
        gpus[0] = gpu("n0", 0, models[0], layout="all-balanced", occupied={"2g.20gb": [GIB]})
    pending = pods(*sizes)
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.status == "OPTIMAL"
    assert (plan.pods_placed, plan.new_gpus_used) == _brute_force(gpus, pending)


def test_identical_gpus_aggregate_and_scale() -> None:
    # 64 identical free GPUs and 200 small pods: one class; everything fits on 29 GPUs at 7 per GPU
    m = mig.H100_80GB
    gpus = [gpu(f"n{i // 8:02d}", i % 8, m, layout="all-7g.80gb") for i in range(64)]
    pending = pods(*([8.0] * 200))
    plan = plan_mig_geometry(gpus, pending, time_limit_s=TL)
    check_plan(plan, gpus, pending)
    assert plan.pods_placed == 200 and plan.new_gpus_used == 29  # ceil(200 / 7)
    assert plan.reconfigured_gpus == 29  # idle GPUs keep their layout
