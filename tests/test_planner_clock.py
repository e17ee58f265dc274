"""The planner's time limits by work done (`extender.planner.clock.work_clock`): a replay whose
plans come from searches that stop at a time limit gives the same plans however slow or busy the
machine is, which the wall clock cannot (a busy machine's searches stop with less done)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from ortools.sat.python import cp_model
from test_planner_repack import demand, neighbourhood_case
from test_simulate import REPACK_NODES, REPACK_PODS, write

from extender.cli import main
from extender.planner import clock
from extender.planner.repack import Neighbourhood, search_repack
from extender.planner.staged import Settings, Stage, _solver, staged_solve
from extender.simulate.engine import replay
from extender.simulate.trace import read_inputs


@pytest.fixture
def slow_machine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A machine where every reading of the wall clock finds 10 s gone."""
    t = [0.0]

    def wall() -> float:
        t[0] += 10.0
        return t[0]

    monkeypatch.setattr(clock, "wall", wall)
    yield


def test_the_solver_stops_at_wall_time_or_at_deterministic_time():
    s = _solver(Settings(num_workers=2), 0.7, None)
    assert s.parameters.max_time_in_seconds == 0.7
    assert s.parameters.max_deterministic_time > 1e30  # CP-SAT's default: no limit
    with clock.work_clock():
        s = _solver(Settings(num_workers=2), 0.7, None)
    assert s.parameters.max_deterministic_time == 0.7
    assert s.parameters.max_time_in_seconds > 1e30
    assert s.parameters.interleave_search  # two workers in one deterministic schedule


def test_the_work_clock_counts_each_solve_and_each_reading(monkeypatch):
    monkeypatch.setattr(clock, "wall", lambda: 42.0)
    m = cp_model.CpModel()
    xs = [m.new_int_var(0, 9, f"x{i}") for i in range(30)]
    m.add(sum(xs) <= 100)
    with clock.work_clock(step=0.5):
        assert (clock.now(), clock.now()) == (0.5, 1.0)
    with clock.work_clock(step=0.0) as w:  # readings free: only the solve counts
        result = staged_solve(m, [Stage("most", sum(xs))], 10.0, variables=xs)
        assert result.status == "OPTIMAL" and w.seconds > 0
    assert clock.now() == 42.0  # the wall clock again after the block


def _search(cap, running):
    found = search_repack(cap, demand("big", 80), running, neighbourhood=Neighbourhood())
    plan = found.plan
    moves = None if plan is None else [(m.pod.name, m.target.node) for m in plan.moves]
    return moves, found.proven, found.nodes, found.rounds


def test_a_repack_search_on_a_slow_machine_finds_what_it_finds_on_a_fast_one(slow_machine):
    cap, running = neighbourhood_case()
    moves, _, _, _ = _search(cap, running)
    assert moves is None  # wall clock: the deadline passed before the search began
    with clock.work_clock():
        slow = _search(cap, running)
    clock.wall = clock.time.perf_counter  # a fast machine (the fixture restores its own)
    with clock.work_clock():
        fast = _search(cap, running)
    assert slow == fast and slow[0] is not None and len(slow[0]) == 1 and slow[1]


def test_a_deterministic_replay_is_the_same_on_a_slow_machine(tmp_path, slow_machine):
    nodes, tasks, bound = read_inputs(*write(tmp_path, REPACK_NODES, REPACK_PODS))
    wall = replay(False, "planner+repack", nodes, tasks, bound, move_budget=0.5)
    slow = replay(True, "planner+repack", nodes, tasks, bound, move_budget=0.5)
    clock.wall = clock.time.perf_counter
    fast = replay(True, "planner+repack", nodes, tasks, bound, move_budget=0.5)

    def result(r):
        return r.placed, r.failed, r.moves, r.repackPlaced, r.allocatedMemoryBytes

    assert wall.moves == 0 and wall.repackPlaced == 0  # no search had time to find the move
    assert result(slow) == result(fast) and slow.moves == 1
    assert slow.allocatedMemoryBytes > wall.allocatedMemoryBytes


def test_simulate_deterministic_on_a_slow_machine_moves_as_on_a_fast_one(
    tmp_path, capsys, slow_machine
):
    """`vramsched simulate --deterministic`: the replay on a machine where the wall clock runs
    out at once still finds the move, and says how it was timed."""
    n, p = write(tmp_path, REPACK_NODES, REPACK_PODS)
    args = ["simulate", "--nodes", str(n), "--pods", str(p), "--move-budget", "0.5"]
    args += ["--policy", "planner+repack", "--json"]
    assert main(args) == 0
    wall = json.loads(capsys.readouterr().out)
    assert main([*args, "--deterministic"]) == 0
    work = json.loads(capsys.readouterr().out)
    assert (wall["input"]["deterministic"], work["input"]["deterministic"]) == (False, True)
    assert wall["policies"]["planner+repack"]["moves"] == 0
    assert work["policies"]["planner+repack"]["moves"] == 1
