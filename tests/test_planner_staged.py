"""The staged CP-SAT harness (extender.planner.staged): lexicographic goals, hints carried over."""

from __future__ import annotations

import time

import pytest
from ortools.sat.python import cp_model

from extender.planner.staged import CONSTANT, SKIPPED, Settings, Stage, staged_solve

LATER = 1e9  # a deadline no test reaches: solves end when proven, not by time


def two_goals() -> tuple[cp_model.CpModel, cp_model.IntVar, cp_model.IntVar]:
    """x + y <= 10 and x <= 7: most of x + y first (10), then least x: x = 3, y = 7 (y <= 7)."""
    m = cp_model.CpModel()
    x = m.new_int_var(0, 10, "x")
    y = m.new_int_var(0, 7, "y")
    m.add(x + y <= 10)
    m.add(x <= 7)
    return m, x, y


def test_a_later_stage_keeps_the_earlier_optimum():
    m, x, y = two_goals()
    result = staged_solve(
        m,
        [Stage("sum", x + y, maximize=True), Stage("x", x)],
        LATER,
        variables=[x, y],
        settings=Settings(num_workers=1),
    )
    assert [s.status for s in result.stages] == ["OPTIMAL", "OPTIMAL"]
    assert result.stages[0].objective == result.stages[0].bound == 10
    # without the first optimum as a constraint, least x alone would be x = 0 (and y anything)
    assert (result.value(x), result.value(y)) == (3, 7)
    assert result.stages[1].objective == 3 and result.stages[1].gap == 0


def test_the_previous_solution_is_the_next_stages_hint():
    m, x, y = two_goals()
    seen: list[dict[int, int]] = []

    def hint(values):
        seen.append(dict(values))
        return [(x, values[x.index]), (y, values[y.index])]

    result = staged_solve(
        m,
        [Stage("2x+y", 2 * x + y, maximize=True), Stage("y", y, maximize=True)],
        LATER,
        variables=[x, y],
        settings=Settings(num_workers=1),
        hint=hint,
    )
    # stage 1's only optimum (17) is x = 7, y = 3: given to stage 2 as its hint
    assert seen == [{x.index: 7, y.index: 3}]
    hinted = m.proto.solution_hint
    assert dict(zip(hinted.vars, hinted.values)) == {x.index: 7, y.index: 3}
    # stage 2: most y with 2x + y still 17 (and x + y <= 10) leaves that optimum as it is
    assert (result.value(x), result.value(y)) == (7, 3)


def test_the_model_leaves_with_every_solved_optimum_fixed():
    m, x, y = two_goals()
    before = len(m.proto.constraints)
    staged_solve(
        m, [Stage("sum", x + y, maximize=True)], LATER, variables=[x, y], settings=Settings(1)
    )
    assert len(m.proto.constraints) == before + 1
    # a further goal on the same model cannot undo the first: least y with x + y = 10 is y = 3
    again = staged_solve(m, [Stage("y", y)], LATER, variables=[x, y], settings=Settings(1))
    assert again.value(y) == 3


def test_constant_goals_are_not_solved_but_a_feasible_solution_is_found():
    m, x, y = two_goals()
    m.add(x >= 4)
    result = staged_solve(
        m, [Stage("a", 0), Stage("b", 5)], LATER, variables=[x], settings=Settings(1)
    )
    assert [(s.status, s.objective, s.bound) for s in result.stages] == [
        (CONSTANT, 0, 0),
        (CONSTANT, 5, 5),
    ]
    assert result.status in ("OPTIMAL", "FEASIBLE") and result.values is not None
    assert 4 <= result.value(x) <= 7


def test_an_infeasible_first_stage_gives_no_solution():
    m, x, y = two_goals()
    m.add(x + y >= 11)
    built = []
    result = staged_solve(
        m,
        [Stage("sum", x + y, maximize=True), Stage("x", lambda: built.append(1) or x)],
        LATER,
        variables=[x, y],
        settings=Settings(1),
    )
    assert [s.name for s in result.stages] == ["sum"]
    assert result.stages[0].status == "INFEASIBLE" and not result.stages[0].solved
    assert result.values is None and result.status == "INFEASIBLE"
    assert built == []  # a stage that never runs never builds its goal
    with pytest.raises(LookupError):
        result.value(x)


def test_a_stage_without_time_left_is_skipped_and_the_solution_before_it_kept():
    m, x, y = two_goals()
    built = []
    result = staged_solve(
        m,
        [
            Stage("sum", x + y, maximize=True),
            Stage("x", lambda: built.append(1) or x, skip_below=0.0),
        ],
        time.perf_counter(),  # already passed: the first stage still runs, the second cannot
        variables=[x, y],
        settings=Settings(1),
    )
    assert [s.status for s in result.stages][1:] == [SKIPPED]
    assert result.stages[0].solved and built == []
    assert result.value(x) + result.value(y) == 10


def test_a_rebound_weaker_than_the_objective_makes_an_optimal_stage_feasible():
    m, x, y = two_goals()
    result = staged_solve(
        m,
        [
            Stage("sum", x + y, maximize=True, rebound=lambda bound: bound + 2),
            Stage("x", x, rebound=lambda bound: bound),
        ],
        LATER,
        variables=[x, y],
        settings=Settings(1),
    )
    first, second = result.stages
    assert (first.status, first.objective, first.bound) == ("FEASIBLE", 10, 12)
    assert first.gap == pytest.approx(0.2)
    assert second.status == "OPTIMAL"


def test_settings_reach_every_stage(monkeypatch):
    m, x, y = two_goals()
    seen = []
    solve = cp_model.CpSolver.solve

    def spy(self, model, callback=None):
        p = self.parameters
        seen.append(
            (
                p.num_workers,
                p.random_seed,
                p.cp_model_probing_level,
                p.symmetry_level,
                p.max_presolve_iterations,
                p.relative_gap_limit,
            )
        )
        return solve(self, model, callback)

    monkeypatch.setattr(cp_model.CpSolver, "solve", spy)
    staged_solve(
        m,
        [Stage("sum", x + y, maximize=True), Stage("x", x, relative_gap=0.25)],
        LATER,
        variables=[x, y],
        settings=Settings(num_workers=1, random_seed=7, light_presolve=True),
    )
    assert seen == [(1, 7, 0, 0, 1, 0.0), (1, 7, 0, 0, 1, 0.25)]
