"""Prioritize and bind charge a placement for the memory nobody else can use after it.

The defect: on a cluster with exclusive H100 nodes beside time-sliced A100s, MIG and T4 nodes,
listed in name order, five single-GPU pods of 7 to 40 GiB opened five whole exclusive H100s of
`ex-h100-0`, while two idle time-sliced A100 GPUs could hold them all. Here through the service's
filter, prioritize and bind; then the per-node summary path against the device-by-device path
on clusters where placements strand memory (exclusive GPUs, MIG slices, time-sliced GPUs at
their last replica, MPS shares), with a brute-force count of what each node's choice strands.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import numpy as np
import pytest
from builders import A100_80, H100_80, cluster, gpu_node, mig_mixed_node, mig_single_node, pod
from builders import service as make_service

import extender.placement.choose as choosing
import extender.placement.score as scoring
from extender.demand import Demand, pod_demand
from extender.ledger import Ledger, Reservation, check_invariant
from extender.placement import choose_devices, score_rows
from extender.placement.fit import demand_fit
from extender.placement.views import candidate_rows, resource_arrays
from extender.planner.capacity import Capacity, FragIndex, Workload
from extender.planner.greedy import choose, place_one
from extender.planner.model import solve_batch
from extender.quantity import GIB, MIB
from extender.wire import ExtenderArgs, ExtenderBindingArgs

T4 = "Tesla-T4"
#: the issue's five single-GPU pods, 7 to 40 GiB
FIVE = ["7Gi", "14Gi", "24Gi", "32Gi", "40Gi"]


def mixed_pools() -> list[dict]:
    """The issue's cluster, nodes in name order as an informer lists them: the exclusive H100
    nodes first, then MIG, T4 and time-sliced A100 nodes."""
    nodes = [
        gpu_node("ex-h100-0", count=8, memory_mib=81559, product=H100_80),
        gpu_node("ex-h100-1", count=8, memory_mib=81559, product=H100_80),
        mig_mixed_node("mig-a100-0", {"1g.10gb": (7, 9984)}, gpus=1),
        mig_single_node("mig-a100-1", "1g.10gb", slices=7, memory_mib=9984),
        gpu_node("t4-0", count=4, memory_mib=15360, product=T4),
        gpu_node("ts-a100-0", count=8, replicas=4),
        gpu_node("ts-a100-1", count=8, replicas=4),
    ]
    assert [n["metadata"]["name"] for n in nodes] == sorted(n["metadata"]["name"] for n in nodes)
    return nodes


def stranded_now(ledger: Ledger) -> int:
    """Memory nobody can use (the simulator's `strandedBytes`): on every GPU, the free memory
    its free replicas cannot reach (each takes at most the per-pod cap)."""
    a = ledger.arrays
    left = np.maximum(a.replicas - a.used_replicas, 0).astype(np.int64)
    return int(np.maximum(a.capacity - a.used - left * a.per_pod_cap, 0).sum())


def schedule(svc, names: list[str], p: dict) -> str:
    """kube-scheduler's round for one pod: filter, prioritize the survivors, bind to the node
    scored 10 (the only one: kube-scheduler would pick it)."""
    out = svc.filter(ExtenderArgs(Pod=p, NodeNames=names))
    assert out.NodeNames, out
    scores = svc.prioritize(ExtenderArgs(Pod=p, NodeNames=out.NodeNames))
    top = [h.Host for h in scores if h.Score == 10]
    assert len(top) == 1, scores
    meta = p["metadata"]
    result = asyncio.run(
        svc.bind(
            ExtenderBindingArgs(
                PodName=meta["name"], PodNamespace="default", PodUID=meta["uid"], Node=top[0]
            )
        )
    )
    assert not result.Error, result.Error
    return top[0]


def test_five_llm_pods_share_two_time_sliced_gpus_instead_of_five_exclusive_h100s():
    c = cluster(*mixed_pools())
    svc = make_service(c)
    names = [n.name for n in c.ledger.nodes()]
    placed = {f"m{i}": schedule(svc, names, pod(f"m{i}", size)) for i, size in enumerate(FIVE)}
    assert set(placed.values()) == {"ts-a100-0"}, placed
    a = c.ledger.arrays
    assert int((a.used_replicas > 0).sum()) == 2  # two GPUs hold all five
    assert stranded_now(c.ledger) == 0
    assert check_invariant(c.ledger, c.live_pod_keys()) == []


def test_the_planner_avoids_the_exclusive_h100_too():
    """FGD's one-pod rule (the planner's) counts a GPU with no replica left as a fragment: it
    opens no exclusive H100 either, one pod at a time or as a batch. (It may put the 7 GiB pod
    on a 1g.10gb MIG slice: 2.75 GiB left that no pod of this workload but another 7 GiB one
    could use anyway, by FGD's measure; any H100 would strand 39 GiB or more.)"""
    c = cluster(*mixed_pools())
    demands = [pod_demand(pod(f"m{i}", s)) for i, s in enumerate(FIVE)]
    cap = Capacity.from_ledger(c.ledger, c.cpu_used, c.memory_used)
    frag = FragIndex(cap, Workload.from_demands(demands))
    names = cap.arrays.node_names
    for d in demands:
        ch = choose("fgd", cap, d, frag)
        assert ch is not None and not names[ch[1]].startswith("ex-"), names[ch[1]]
        place_one(cap, d, ch, frag)
    assert stranded_now(cap.ledger) < 10 * GIB  # 2.75 on the slice, 1 behind a last replica
    again = cluster(*mixed_pools())
    fresh = Capacity.from_ledger(again.ledger, again.cpu_used, again.memory_used)
    plan = solve_batch(fresh, demands, time_limit=1.0, num_workers=1)
    assert len(plan.choices) == len(demands)
    assert not any(names[node].startswith("ex-") for _, node, _ in plan.choices.values())


def test_the_old_bands_opened_the_first_idle_node_whatever_it_strands():
    """What the issue saw, on the same cluster: every idle node used to score alike, so the
    first in name order (an exclusive H100) won. With the charge, the time-sliced A100 wins; a
    pod too big for any time-sliced GPU's free replicas still gets the H100."""
    c = cluster(*mixed_pools())
    names = [n.name for n in c.ledger.nodes()]
    d = pod_demand(pod("p", "7Gi"))
    scores = dict(scoring.score_nodes(c.ledger, d, names))
    assert scores["ts-a100-0"] == 10
    assert scores["ex-h100-0"] == scores["t4-0"] == 0  # fits, but strands memory
    assert scores["ts-a100-1"] == 0  # an idle node, nothing stranded: best fit's loosest band
    whole = pod_demand(pod("w", None))  # no annotation: a whole GPU strands nothing anywhere
    assert dict(scoring.score_nodes(c.ledger, whole, names))["ex-h100-0"] == 10


# ----- the summary path against the device-by-device path, on stranding-heavy clusters -----


def _random_cluster(rng: random.Random, names: list[str]):
    """Random nodes, a MIG node of two profiles (each resource then has its own view, which the
    per-node summaries answer for: a fleet of one resource is scored device by device) and a
    time-sliced node of two replicas (whose GPUs reach their last replica one by one)."""
    c = cluster(
        *[_random_node(rng, n) for n in names],
        gpu_node("zz-ts", count=4, replicas=2),
        mig_mixed_node("zz-mig", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)}),
    )
    names += ["zz-ts", "zz-mig"]
    return c


def _random_node(rng: random.Random, name: str) -> dict:
    product = rng.choice([A100_80, H100_80, T4])
    memory = {A100_80: 81920, H100_80: 81559, T4: 15360}[product]
    kind = rng.choice(["exclusive", "time-slicing", "time-slicing", "mps", "mig-single", "mig"])
    if kind == "exclusive":
        return gpu_node(name, count=rng.randint(1, 8), memory_mib=memory, product=product)
    if kind == "time-slicing":  # few replicas: last replicas are common
        return gpu_node(
            name,
            count=rng.randint(1, 8),
            replicas=rng.randint(2, 4),
            memory_mib=memory,
            product=product,
        )
    if kind == "mps":
        return gpu_node(
            name,
            count=rng.randint(1, 4),
            replicas=rng.randint(2, 5),
            strategy="mps",
            memory_mib=memory,
            product=product,
        )
    if kind == "mig-single":
        return mig_single_node(name, "1g.10gb", slices=rng.randint(1, 7), memory_mib=9984)
    return mig_mixed_node(
        name, {"1g.10gb": (rng.randint(1, 4), 9984), "3g.40gb": (rng.randint(0, 1), 40192)}
    )


def _random_pod(rng: random.Random, name: str) -> dict:
    resource = rng.choice(["nvidia.com/gpu"] * 6 + ["nvidia.com/mig-1g.10gb"])
    gpus = 1 if "mig" in resource or rng.random() < 0.7 else rng.randint(2, 4)
    memory = rng.choice(
        [None, f"{rng.randint(1, 40)}Gi", f"{rng.randint(500, 20000)}Mi", "7Gi", "9Gi", "20Gi"]
    )
    return pod(name, memory, gpus=gpus, resource=resource)


def _step(rng: random.Random, c, names: list[str], step: int) -> None:
    ledger = c.ledger
    held = [r.key for r in ledger.reservations()]
    roll = rng.random()
    if roll < 0.65:
        d = pod_demand(_random_pod(rng, f"r{step}"))
        res = choose_devices(ledger, d, rng.choice(names))
        if isinstance(res, Reservation):
            ledger.reserve(res)
    elif roll < 0.9 and held:
        ledger.release(rng.choice(held))
    else:  # a pod that runs there already, possibly beyond an MPS share or the GPU's memory
        node = rng.choice(names)
        inv = ledger.node(node)
        if inv is not None and inv.devices:
            dev = rng.choice(inv.devices)
            ledger.record(
                Reservation(
                    pod=pod_demand(pod(f"rec{step}")).pod,
                    node=node,
                    device_ids=(dev.device_id,),
                    bytes_per_device=(rng.randint(0, 50) * GIB,),
                )
            )


def _afresh(ledger: Ledger, demand: Demand, names: list[str]):
    """The device-by-device path over the current columns, no kept tables."""
    base = resource_arrays(ledger, demand)
    a = ledger.arrays if base is None else base
    fit = demand_fit(ledger, demand, base)
    rows, _ = candidate_rows(ledger, names)
    keys, placed = scoring._device_scores(
        fit, demand.gpu_count, rows, ledger.arrays.node_used_replicas > 0
    )
    return keys, placed, scoring._finish_scores(ledger, a, rows, keys, placed, None)


def least_stranded(ledger: Ledger, demand: Demand, node: str) -> int | None:
    """By hand, device by device: the least memory any k fitting devices of `node` leave that no
    other pod can use (None when fewer than k fit). A device's: its free memory after the pod
    minus what its other free replicas can still take (each at most the per-pod cap), at least 0
    and at most the rest of the pod's own share."""
    a = ledger.arrays
    r = ledger.node_row(node)
    costs = []
    for i in range(int(a.node_start[r]), int(a.node_start[r + 1])):
        dev = a.devices[i]
        share = dev.per_pod_cap_bytes
        need = share if demand.bytes_per_gpu is None else demand.bytes_per_gpu
        free = dev.memory_bytes - int(a.used[i])
        left = dev.replicas - int(a.used_replicas[i])
        if dev.resource != demand.resource or need > share or left < 1 or free < need:
            continue
        reach = (left - 1) * share  # what the other free replicas can take
        costs.append(min(max(free - need - reach, 0), share - need))
    if len(costs) < demand.gpu_count:
        return None
    return min(sum(c) for c in itertools.combinations(costs, demand.gpu_count))


def key_stranded_mib(key: int) -> int:
    """MiB stranded that an order key says (see `score._CLEAN`)."""
    return (scoring._CLEAN + (key & 15) - key) >> 4


@pytest.mark.parametrize("seed", range(8))
def test_summary_and_device_paths_agree_and_count_what_each_node_strands(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    names = [f"n{i:02d}" for i in range(rng.randint(6, 20))]
    c = _random_cluster(rng, names)
    seen: list[int] = []
    least = scoring._least_stranding

    def spy(busy, *args):
        seen.append(args[-1])  # k
        return least(busy, *args)

    monkeypatch.setattr(scoring, "_least_stranding", spy)
    kinds = set()
    for step in range(120):
        _step(rng, c, names, step)
        assert [v for v in check_invariant(c.ledger) if "oversubscribed" not in v.what] == []
        for j in range(3):
            demand = pod_demand(_random_pod(rng, f"q{step}-{j}"))
            if not demand.wants_gpu:
                continue
            fast = score_rows(c.ledger, demand, names)
            keys, placed, slow = _afresh(c.ledger, demand, names)
            assert fast[2].tolist() == slow[2].tolist(), (step, demand)
            for r, name in enumerate(names):
                want = least_stranded(c.ledger, demand, name)
                assert (want is not None) == bool(placed[r]), (step, name)
                if want is not None:
                    assert key_stranded_mib(int(keys[r])) == -(-want // MIB), (step, name)
                    kinds.add(want > 0)
            top = [n for n, s in zip(fast[0][fast[1]], fast[2]) if s == 10]
            if top:  # the node at 10 strands no more than any other that fits
                best = min(key_stranded_mib(int(k)) for k in keys[placed])
                assert key_stranded_mib(int(keys[c.ledger.node_row(top[0])])) == best
    assert kinds == {True, False}
    # nodes whose devices strand unequal amounts were worked out, for one GPU and for several
    assert 1 in seen and max(seen) > 1, seen


@pytest.mark.parametrize("seed", range(4))
def test_kept_tables_follow_stranding_changes(seed: int) -> None:
    """Kept per shape and patched from the ledger's log: after reserves, releases and records
    that take or free last replicas, the kept answer equals the one computed afresh."""
    rng = random.Random(50 + seed)
    names = [f"n{i:02d}" for i in range(12)]
    c = _random_cluster(rng, names)
    shapes = [
        pod_demand(pod(f"s{i}", m, gpus=k))
        for i, (m, k) in enumerate([("7Gi", 1), ("9Gi", 1), ("20Gi", 1), ("5Gi", 2), (None, 1)])
    ]
    for step in range(100):
        for i in range(rng.randint(1, 3)):
            _step(rng, c, names, step * 10 + i)
        for d in rng.sample(shapes, len(shapes)):
            fast = score_rows(c.ledger, d, names)
            assert fast[2].tolist() == _afresh(c.ledger, d, names)[2][2].tolist(), (step, d)


@pytest.mark.parametrize("seed", range(4))
def test_binds_python_choice_equals_the_vector_path_where_devices_strand(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(200 + seed)
    names = [f"n{i:02d}" for i in range(10)]
    c = _random_cluster(rng, names)
    answered = 0
    for step in range(120):
        _step(rng, c, names, step)
        demand = pod_demand(_random_pod(rng, f"b{step}"))
        node = rng.choice(names)
        fast = choose_devices(c.ledger, demand, node)
        with monkeypatch.context() as m:
            m.setattr(choosing, "_choose_on_node", lambda *args: None)
            slow = choose_devices(c.ledger, demand, node)
        assert fast == slow, (step, demand, node)
        if isinstance(fast, Reservation) and demand.bytes_per_gpu is not None:
            answered += 1
            # bind takes devices that strand the least on that node
            held = c.ledger.reserve(fast)
            before = stranded_now(c.ledger)
            c.ledger.release(held.key)
            want = least_stranded(c.ledger, demand, node)
            assert before - stranded_now(c.ledger) == want, (step, demand, node)
    assert answered > 20


def test_least_stranding_row_by_row_equals_the_vector_form():
    """The two forms of the summary's per-device choice (Python for a few rows, numpy beyond)
    give the same sums, bit for bit, on random lists (sorted as the summary keeps them)."""
    rng = np.random.default_rng(3)
    pad = np.int64(-(1 << 62))
    for trial in range(200):
        g, w, k = int(rng.integers(1, 12)), int(rng.integers(1, 9)), int(rng.integers(1, 4))
        cap = rng.choice([15360, 40192, 81559, 81920], g) * MIB
        need = int(rng.integers(1, 40)) * GIB
        lists = []
        for _ in range(2):
            free = rng.integers(0, cap[:, None] + 1, (g, w))
            sole = np.minimum(free - rng.integers(0, 3, (g, w)) * cap[:, None] // 4, cap[:, None])
            free[rng.random((g, w)) < 0.3] = pad
            order = np.lexsort((-sole, -free), axis=1)
            free, sole = np.take_along_axis(free, order, 1), np.take_along_axis(sole, order, 1)
            sole[free == pad] = pad
            lists += [free, sole]
        ok = ((lists[0] >= need).sum(1) + (lists[2] >= need).sum(1)) >= k
        if not ok.any():
            continue
        args = [x[ok] for x in lists]
        rows = scoring._least_stranding_rows(*args[:2], *args[2:], need, cap[ok], k)
        scoring_few = scoring._FEW_ROWS
        try:
            scoring._FEW_ROWS = -1
            vector = scoring._least_stranding(*args[:2], *args[2:], need, cap[ok], k)
        finally:
            scoring._FEW_ROWS = scoring_few
        for got, want in zip(rows, vector):
            assert got.tolist() == want.tolist(), trial
