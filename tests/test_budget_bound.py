"""The bound with a move budget (`extender.simulate.budget_bound`) against exhaustive search."""

from __future__ import annotations

import itertools
import random

import pytest
from test_planner_repack import placements
from test_simulate import NODE_HEAD, _best_packing

from extender.demand import Demand, PodRef
from extender.planner.capacity import demand_kind
from extender.planner.move_model import reservation_for
from extender.quantity import MIB
from extender.simulate.budget_bound import budget_bound, snapshot
from extender.simulate.engine import build_capacity
from extender.simulate.trace import read_trace_nodes


def _cluster(tmp_path, rows):
    path = tmp_path / "nodes.csv"
    path.write_text(NODE_HEAD + "".join(r + "\n" for r in rows))
    return build_capacity(read_trace_nodes(path))[1]


def _place(cap, d, n, rows):
    cap.apply(d, reservation_for(cap, d, n, rows) if rows else None, n)


def _held_bytes(cap) -> int:
    return int(cap.arrays.used.sum())


def _best_with_moves(cap, state, later, max_moves: int) -> int:
    """The most GPU memory held at the end: the pods of `state` stay where they are except at
    most `max_moves` of them, which are placed again anywhere, and any of `later` join
    (exhaustive; `cap` is left as it was)."""
    held = [(p.demand, p.node) for p in state.pods]
    best = -1
    for k in range(max_moves + 1):
        for moved in itertools.combinations(range(len(held)), k):
            for i in moved:
                cap.remove(*held[i])
            staying = _held_bytes(cap)
            pods = [held[i][0] for i in moved] + list(later)
            got = _best_packing(cap, pods, must=set(range(k)))
            if got >= 0:
                best = max(best, staying + got)
            for i in moved:  # back where they were
                p = state.pods[i]
                _place(cap, p.demand, p.node, tuple(r for r, _ in p.devices))
    return best


def _case(tmp_path, seed: int, held_pods: int = 5, later_pods: int = 3, sizes=(200, 300, 500, 700)):
    """A small cluster with pods already placed (first fit, of `held_pods` tried), and
    `later_pods` pods to come; pods of one GPU ask one of `sizes` MiB."""
    rng = random.Random(seed)
    cap = _cluster(
        tmp_path,
        [f"n{i},{rng.choice([4000, 8000])},65536,{rng.choice([1, 2])},T4" for i in range(2)],
    )

    def pod(name: str) -> Demand:
        g = rng.choice([0, 1, 1, 1, 2])
        size = None if g > 1 else rng.choice(sizes) * MIB
        return Demand(PodRef("t", name), g, size, cpu_milli=rng.choice([1000, 2000, 3000]))

    held = []
    for i in range(held_pods):
        d = pod(f"h{i}")
        ways = placements(cap, d)
        if ways:
            n, rows = ways[0]
            _place(cap, d, n, rows)
            held.append((d, n))
    return cap, snapshot(cap, held), [pod(f"l{i}") for i in range(later_pods)]


@pytest.mark.parametrize("seed", range(12))
def test_the_budget_bound_is_never_below_the_best_end_state(tmp_path, seed):
    """With 0, 1 and 2 moves, the bound is at least the best end state an exhaustive search
    finds, at most the capacity, and it never falls as the budget grows."""
    cap, state, later = _case(tmp_path, seed)
    got = []
    for m in (0, 1, 2):
        b = budget_bound(state, later, max_moves=m)
        assert b.status == "OPTIMAL"
        best = _best_with_moves(cap, state, later, m)
        assert best - 1 <= b.bytes <= int(cap.arrays.capacity.sum()) + 1, (m, best, b)
        got.append(b.bytes)
    assert got[0] <= got[1] + 1 <= got[2] + 2


def test_moves_matter_in_some_of_the_small_cases(tmp_path):
    """The cases above are not all ones where moving changes nothing: in some, the best end
    state with 2 moves holds more than the bound without moves allows."""
    gains = 0
    for seed in range(12):
        cap, state, later = _case(tmp_path, seed)
        best = _best_with_moves(cap, state, later, 2)
        gains += best > budget_bound(state, later).bytes + 1
    assert gains >= 2


def test_one_move_frees_a_whole_gpu_and_the_budget_decides(tmp_path):
    """Two GPUs, each half held by a 500 MiB pod; a whole-GPU pod arrives. Without a move it
    fits nowhere (1,000 MiB held); moving one half onto the other GPU lets it in (2,000). With
    moves limited to a fraction of the pods placed, 1/3 of 3 pods allows that move, 0.3 does
    not."""
    cap = _cluster(tmp_path, ["n0,64000,65536,2,T4"])
    a = cap.arrays
    held = []
    for i in range(2):
        d = Demand(PodRef("t", f"h{i}"), 1, 500 * MIB)
        _place(cap, d, 0, (int(a.node_start[0]) + i,))
        held.append((d, 0))
    state = snapshot(cap, held)
    whole = [Demand(PodRef("t", "w"), 1, 1000 * MIB)]
    assert budget_bound(state, whole).bytes == pytest.approx(1000 * MIB)
    one = budget_bound(state, whole, max_moves=1)
    assert one.bytes == pytest.approx(2000 * MIB)
    # where the room comes from: the whole-GPU pod taken, after one move
    assert one.taken == {demand_kind(whole[0]): pytest.approx(1.0)}
    assert one.moves == pytest.approx(1.0)
    assert budget_bound(state, whole).taken == {demand_kind(whole[0]): pytest.approx(0.0)}
    assert budget_bound(state, whole, fraction=1 / 3).bytes == pytest.approx(2000 * MIB)
    # 0.3 x (2 held + 1 taken) = 0.9 moves: the LP moves 0.9 of a pod, no more
    assert budget_bound(state, whole, fraction=0.3).bytes < 2000 * MIB - 1


def test_moving_a_gpu_less_pod_frees_the_cores_a_gpu_pod_needs(tmp_path):
    """A node whose cores a GPU-less pod holds: the GPU pod fits there only once that pod
    moves to the other node (GPU-less, room for it)."""
    cap = _cluster(tmp_path, ["n0,4000,65536,1,T4", "n1,4000,65536,0,T4"])
    cpu_pod = Demand(PodRef("t", "c"), 0, None, cpu_milli=4000)
    _place(cap, cpu_pod, 0, ())
    state = snapshot(cap, [(cpu_pod, 0)])
    gpu_pod = [Demand(PodRef("t", "g"), 1, 600 * MIB, cpu_milli=2000)]
    assert budget_bound(state, gpu_pod).bytes == pytest.approx(0, abs=1)
    assert budget_bound(state, gpu_pod, max_moves=1).bytes == pytest.approx(600 * MIB)


def test_a_multi_gpu_pod_needs_its_gpus_on_one_node(tmp_path):
    """Two nodes of two GPUs, one GPU of each half held: two free GPUs in all, one per node.
    A 2-GPU pod of 600 MiB per GPU does not fit until a move empties one node (the arc-flow
    alone would spread it over the two nodes)."""
    cap = _cluster(tmp_path, ["n0,64000,65536,2,T4", "n1,64000,65536,2,T4"])
    a = cap.arrays
    held = []
    for n in range(2):
        d = Demand(PodRef("t", f"h{n}"), 1, 500 * MIB)
        _place(cap, d, n, (int(a.node_start[n]),))
        held.append((d, n))
    state = snapshot(cap, held)
    pair = [Demand(PodRef("t", "pair"), 2, 600 * MIB)]
    assert budget_bound(state, pair).bytes == pytest.approx(1000 * MIB)
    assert budget_bound(state, pair, max_moves=1).bytes == pytest.approx(2200 * MIB)
    assert _best_with_moves(cap, state, pair, 1) == 2200 * MIB


def test_a_pod_needs_its_cores_and_its_gpu_on_one_node(tmp_path):
    """The pooled CPU row would let pods span nodes. Two nodes with 9 free cores and an idle
    GPU each hold no 11-core pod; nor do a node with cores but a full GPU and a node with an
    idle GPU but no cores. One move (the GPU-less pod holding the cores of the node whose GPU
    is idle) lets one in."""
    cap = _cluster(tmp_path, ["n0,9000,65536,1,T4", "n1,9000,65536,1,T4"])
    state = snapshot(cap, [])
    big = [Demand(PodRef("t", f"b{i}"), 1, 500 * MIB, cpu_milli=11000) for i in range(2)]
    assert budget_bound(state, big).bytes == pytest.approx(0, abs=1)

    cap = _cluster(tmp_path, ["n0,16000,65536,1,T4", "n1,16000,65536,1,T4"])
    a = cap.arrays
    full = Demand(PodRef("t", "full"), 1, 1000 * MIB, cpu_milli=1000)
    cores = Demand(PodRef("t", "cores"), 0, None, cpu_milli=12000)
    _place(cap, full, 0, (int(a.node_start[0]),))
    _place(cap, cores, 1, ())
    state = snapshot(cap, [(full, 0), (cores, 1)])
    pod = [Demand(PodRef("t", "p"), 1, 500 * MIB, cpu_milli=11000)]
    assert budget_bound(state, pod).bytes == pytest.approx(1000 * MIB)  # what is held
    assert budget_bound(state, pod, max_moves=1).bytes == pytest.approx(1500 * MIB)
    assert _best_with_moves(cap, state, pod, 0) == 1000 * MIB
    assert _best_with_moves(cap, state, pod, 1) == 1500 * MIB
