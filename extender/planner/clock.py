"""When the planner's time limits run out: by the wall clock (live, and by default), or by the
work done (`work_clock`, for replays that must give the same result however busy the machine is).

Why: every search (batch plans, repack, plan-defrag) stops at a time limit, so a replay's plans,
and every later placement they change, used to depend on the machine's speed and load. Under
`work_clock` CP-SAT stops at a deterministic time instead (its own count of work, about seconds on
a desktop CPU, the same on every run) and the planner's own loops read a clock that advances by
that count and by a fixed `step` per reading, so a loop that checks a deadline runs as many
rounds however busy the machine is."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ortools.sat.python import cp_model

#: what one reading of the work clock costs, in seconds of work: about what one round of the
#: planner's deadline-checked loops (a repack chain step, an arc-flow class) takes on 2 cores
STEP = 1e-3


@dataclass
class WorkClock:
    """Seconds of work done: CP-SAT's deterministic time of every solve, plus `step` per
    reading."""

    step: float = STEP
    seconds: float = 0.0

    def now(self) -> float:
        self.seconds += self.step
        return self.seconds


_work: ContextVar[WorkClock | None] = ContextVar("vramsched_work_clock", default=None)

#: the wall clock (a name of its own so that tests can make the machine slow)
wall = time.perf_counter


def now() -> float:
    """The planner's clock: `time.perf_counter()`, or the work clock inside `work_clock`."""
    w = _work.get()
    return wall() if w is None else w.now()


def limit(solver: cp_model.CpSolver, seconds: float) -> None:
    """Stop `solver` after `seconds`: of wall time, or inside `work_clock` of deterministic
    time, with its workers interleaved in one deterministic schedule."""
    p = solver.parameters
    if _work.get() is None:
        p.max_time_in_seconds = seconds
        return
    p.max_deterministic_time = seconds
    if p.num_workers > 1:
        p.interleave_search = True


def solve(solver: cp_model.CpSolver, model: cp_model.CpModel) -> cp_model.CpSolverStatus:
    """`solver.solve(model)`, its work counted on the work clock (nothing on the wall clock)."""
    status = solver.solve(model)
    w = _work.get()
    if w is not None:
        w.seconds += float(solver.response_proto.deterministic_time)
    return status


@contextmanager
def work_clock(step: float = STEP) -> Iterator[WorkClock]:
    """Within the block, the planner's time limits count work, not wall time."""
    w = WorkClock(step)
    token = _work.set(w)
    try:
        yield w
    finally:
        _work.reset(token)
