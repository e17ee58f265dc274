"""The bound without moves for a scheduler that places every pod that fits
(`extender.simulate.fit_rule`, `budget_bound(arrivals=...)`), against exhaustive replays."""

from __future__ import annotations

import pytest
from ortools.linear_solver import pywraplp  # type: ignore[import-untyped]
from test_budget_bound import _case as budget_case
from test_budget_bound import _cluster, _held_bytes, _place
from test_planner_repack import placements

from extender.demand import Demand, PodRef
from extender.planner.capacity import demand_kind
from extender.quantity import MIB
from extender.simulate.budget_bound import budget_bound, snapshot
from extender.simulate.fit_rule import add_fit_rule


def _best_online(cap, later) -> int:
    """The most GPU memory held at the end over every run that places each of `later`, in
    order, wherever it fits, and turns it away only when it fits nowhere (exhaustive; `cap` is
    left as it was)."""
    if not later:
        return _held_bytes(cap)
    d, rest = later[0], later[1:]
    ways = placements(cap, d)
    if not ways:
        return _best_online(cap, rest)
    best = -1
    for n, rows in ways:
        _place(cap, d, n, rows)
        best = max(best, _best_online(cap, rest))
        cap.remove(d, n)
    return best


def _case(tmp_path, seed: int):
    """Two small nodes with pods already placed (first fit), and 4 pods to come."""
    return budget_case(tmp_path, seed, held_pods=4, later_pods=4, sizes=(200, 300, 500, 700, 1000))


def _fits_now(cap, later) -> bool:
    """Whether the first GPU pod of `later` has a place in `cap` as it is."""
    gpu = [d for d in later if d.gpu_count > 0]
    return bool(gpu) and bool(placements(cap, gpu[0]))


@pytest.mark.parametrize("seed", range(16))
def test_the_bound_is_never_below_the_best_run_that_places_every_fit(tmp_path, seed):
    """On small clusters, the bound with the rule is at least what the best run placing every
    pod that fits ends with, and at most the bound without the rule."""
    cap, state, later = _case(tmp_path, seed)
    arrivals = [float(i) for i in range(len(later))]
    first_failed = not _fits_now(cap, later)
    best = _best_online(cap, later)
    rule = budget_bound(state, later, arrivals=arrivals, first_failed=first_failed)
    plain = budget_bound(state, later)
    assert rule.status == plain.status == "OPTIMAL"
    assert best - 1 <= rule.bytes <= plain.bytes + 1, (best, rule.bytes, plain.bytes)


def test_the_rule_lowers_the_bound_in_some_of_the_small_cases(tmp_path):
    """The cases above include ones where the rule matters: the bound without it keeps room
    for a later pod by leaving out one that fitted when it came."""
    lower = 0
    for seed in range(16):
        cap, state, later = _case(tmp_path, seed)
        arrivals = [float(i) for i in range(len(later))]
        first_failed = not _fits_now(cap, later)
        rule = budget_bound(state, later, arrivals=arrivals, first_failed=first_failed)
        lower += rule.bytes < budget_bound(state, later).bytes - 1
    assert lower >= 1


def test_a_pod_that_fits_is_not_left_out_for_a_larger_one(tmp_path):
    """One idle GPU of 1,000 MiB; an 810 MiB pod comes, then a whole-GPU pod. Any subset may
    hold the whole-GPU pod (1,000 MiB), but a scheduler places the 810 MiB pod, which fits,
    and then the whole-GPU pod finds no room: 810 MiB. The LP, with the rule, may place half
    of each (905 MiB): lower than without it, still a bound."""
    cap = _cluster(tmp_path, ["n0,8000,65536,1,T4"])
    state = snapshot(cap, [])
    later = [Demand(PodRef("t", "small"), 1, 810 * MIB), Demand(PodRef("t", "whole"), 1, None)]
    assert budget_bound(state, later).bytes == pytest.approx(1000 * MIB)
    rule = budget_bound(state, later, arrivals=[0.0, 1.0], first_failed=False)
    assert rule.bytes == pytest.approx(905 * MIB)
    assert _best_online(cap, later) == 810 * MIB
    # arriving together, a batch may take either: the rule says nothing between them
    same = budget_bound(state, later, arrivals=[0.0, 0.0], first_failed=False)
    assert same.bytes == pytest.approx(1000 * MIB)


def _solve(later, first_failed=True):
    """add_fit_rule alone: at most 2 pods of each kind taken, each worth 1, maximised."""
    solver = pywraplp.Solver.CreateSolver("GLOP")
    taken = {}
    for d, _ in later:
        kind = demand_kind(d)
        if d.gpu_count and kind not in taken:
            taken[kind] = solver.NumVar(0.0, 2.0, "")
    add_fit_rule(solver, taken, later, first_failed=first_failed)
    objective = solver.Objective()
    for v in taken.values():
        objective.SetCoefficient(v, 1.0)
    objective.SetMaximization()
    assert solver.Solve() == pywraplp.Solver.OPTIMAL
    return {k: round(v.solution_value(), 6) for k, v in taken.items()}


def test_the_first_failure_turns_away_its_kind_and_every_larger_one():
    """The failed pod's kind, and a kind asking more in every way that comes later, take
    nothing; a kind asking more cores but less memory per GPU is not turned away."""
    small = Demand(PodRef("t", "a"), 1, 300 * MIB, cpu_milli=1000)
    larger = Demand(PodRef("t", "b"), 1, 500 * MIB, cpu_milli=2000)
    other = Demand(PodRef("t", "c"), 1, 200 * MIB, cpu_milli=4000)
    later = [
        (small, 0.0),
        (larger, 1.0),
        (other, 1.0),
        (Demand(PodRef("t", "a2"), 1, 300 * MIB, cpu_milli=1000), 2.0),
        (Demand(PodRef("t", "b2"), 1, 500 * MIB, cpu_milli=2000), 3.0),
        (Demand(PodRef("t", "c2"), 1, 200 * MIB, cpu_milli=4000), 3.0),
    ]
    got = _solve(later)
    assert got[demand_kind(small)] == 0
    assert got[demand_kind(larger)] == 0
    assert got[demand_kind(other)] == 2
    # the same pods after a batch that placed everything: nothing is turned away
    assert set(_solve(later, first_failed=False).values()) == {2}


def test_a_larger_pod_in_the_failed_batch_is_not_implied_by_a_smaller_one():
    """A kind turned away only later does not turn away a larger pod of an earlier batch."""
    small = Demand(PodRef("t", "a"), 1, 300 * MIB)
    larger = Demand(PodRef("t", "b"), 1, 600 * MIB)
    later = [(larger, 0.0), (small, 1.0)]
    # the first batch (the larger pod) failed; the smaller one may still be placed
    got = _solve(later)
    assert got == {demand_kind(larger): 0, demand_kind(small): 1}


def test_the_rule_refuses_moves_and_mismatched_arrivals(tmp_path):
    """The rule holds only without moves, and needs one arrival per pod."""
    cap = _cluster(tmp_path, ["n0,8000,65536,1,T4"])
    state = snapshot(cap, [])
    later = [Demand(PodRef("t", "p"), 1, 500 * MIB)]
    with pytest.raises(ValueError, match="no moves"):
        budget_bound(state, later, arrivals=[0.0], max_moves=1)
    with pytest.raises(ValueError, match="no moves"):
        budget_bound(state, later, arrivals=[0.0], fraction=0.02)
    with pytest.raises(ValueError, match="2 arrivals for 1 pods"):
        budget_bound(state, later, arrivals=[0.0, 1.0])
    with pytest.raises(ValueError, match="must not decrease"):
        budget_bound(state, [*later, later[0]], arrivals=[1.0, 0.0])
