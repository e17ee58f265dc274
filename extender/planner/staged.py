"""Lexicographic goals as successive CP-SAT stages: the one solve loop every planner model uses.

Why stages: a plan's goals come in a strict order (most pods placed, then least stranded VRAM,
...). One weighted objective would need weights large enough to keep the order, which makes the
objective's range huge and the solver's bound weak; so each goal is one solve. A stage's optimum
(or the best value found in its time) becomes a constraint before the next stage runs, and the
next stage starts from the previous solution as a hint: it begins feasible and cannot trade a
higher goal for a lower one. All stages share one deadline.

Users: the batch planner (`batch_solve`: pods placed, then stranded VRAM / GPUs opened / nodes
touched), its bounds (`batch_bounds`, `arcflow`: one stage each), the MIG geometry planner
(`mig_geometry`: pods, GPUs, reconfigured GPUs, waste) and plan-defrag (`defrag`: one stage).

A further model (say, repacking by migration) uses it in four separate steps, as OR-Tools' own
examples keep model, solve and read-back apart:

1. build a `cp_model.CpModel`, its decision variables and one linear expression per goal; a goal
   that needs extra variables may be a function that builds them, called only when its stage runs;
2. hint, if a plan is known (a greedy one): `model.add_hint(var, value)`;
3. solve::

       result = staged_solve(
           model,
           [Stage("freed", freed, maximize=True, share=0.6), Stage("moves", moved)],
           clock.now() + time_limit,
           variables=decisions,
           settings=Settings(num_workers=2, random_seed=0),
       )

4. read the plan back from `result.values` (variable index -> value, from the last stage that
   found a solution) with the model's own code; `result.stages` says per stage what was found and
   proven (status, objective, bound, seconds).

Each stage's time limit is `max(least, share * time left - keep)`. A stage that ends by proving its
goal with one worker and a fixed seed is reproducible; one that ends at its time limit, or runs
several workers (the planners' default, 2), may not be.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from extender.planner import clock

__all__ = [
    "CONSTANT",
    "SKIPPED",
    "Goal",
    "Settings",
    "Stage",
    "StageOutcome",
    "StagedResult",
    "solved",
    "staged_solve",
]

#: the status of a stage whose goal is a constant: nothing to solve, nothing fixed.
CONSTANT = "CONSTANT"
#: the status of a stage that was not started because too little time was left.
SKIPPED = "SKIPPED (time limit)"

#: a goal: a linear expression, or a function building one (and the variables it needs) when its
#: stage runs. A plain int is a constant goal.
Goal = cp_model.LinearExprT | Callable[[], cp_model.LinearExprT]


@dataclass(frozen=True)
class Settings:
    """How each stage's solver runs. `light_presolve`: no probing, no symmetry detection and one
    presolve pass, for models already reduced by hand that must answer within a short budget."""

    num_workers: int = 2
    random_seed: int | None = None  # None: CP-SAT's default
    light_presolve: bool = False


@dataclass(frozen=True)
class Stage:
    """One goal. Its time limit is `max(least, share * time left - keep)` seconds when it starts;
    after an earlier stage found a solution it is skipped when at most `skip_below` seconds are
    left. `relative_gap`: stop within this relative gap (None: CP-SAT's default, exact).
    `rebound`: for a model that is a restriction of the real problem (a neighbourhood), turns the
    solver's proven bound into one valid for the whole problem (or +-inf: none); an OPTIMAL stage
    whose bound no longer meets its objective is then FEASIBLE."""

    name: str
    objective: Goal
    maximize: bool = False
    share: float = 1.0
    keep: float = 0.0
    least: float = 0.05
    skip_below: float = 0.0
    relative_gap: float | None = None
    rebound: Callable[[float], float] | None = None


@dataclass(frozen=True)
class StageOutcome:
    """What one stage found: CP-SAT's status name (OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN,
    MODEL_INVALID), CONSTANT (objective and bound: the constant) or SKIPPED; the objective and
    proven bound (NaN without a solution);
    the solver's own wall time and the wall time around the call."""

    name: str
    status: str
    objective: float = math.nan
    bound: float = math.nan
    solver_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def solved(self) -> bool:
        return solved(self.status)

    @property
    def gap(self) -> float:
        """How far the objective may be from the optimum, relative to the objective (0: proven)."""
        if self.objective == 0:
            return 0.0 if self.bound == 0 else math.inf
        return abs(self.objective - self.bound) / abs(self.objective)


@dataclass(frozen=True)
class StagedResult:
    """Per stage what it found (in order, up to the first that found nothing or was skipped) and
    the decision variables' values from the last solution (None: no stage found one). `status`
    is the status of the last solve run (so of a stage that failed, when one did)."""

    stages: tuple[StageOutcome, ...]
    values: Mapping[int, int] | None
    status: str

    def outcome(self, name: str) -> StageOutcome | None:
        return next((s for s in self.stages if s.name == name), None)

    def value(self, var: cp_model.IntVar) -> int:
        """`var`'s value in the solution (one of the `variables` given to `staged_solve`)."""
        if self.values is None:
            raise LookupError("no stage found a solution")
        return self.values[var.index]


def solved(status: str) -> bool:
    """A status with a solution."""
    return status in ("OPTIMAL", "FEASIBLE")


def _solver(settings: Settings, seconds: float, relative_gap: float | None) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = max(1, settings.num_workers)
    clock.limit(solver, seconds)
    if settings.random_seed is not None:
        p.random_seed = settings.random_seed
    if settings.light_presolve:
        p.cp_model_probing_level = 0
        p.symmetry_level = 0
        p.max_presolve_iterations = 1
    if relative_gap is not None:
        p.relative_gap_limit = relative_gap
    return solver


def staged_solve(
    model: cp_model.CpModel,
    stages: Sequence[Stage],
    deadline: float,
    *,
    variables: Sequence[cp_model.IntVar] = (),
    settings: Settings = Settings(),
    hint: Callable[[Mapping[int, int]], Iterable[tuple[cp_model.IntVar, int]]] | None = None,
) -> StagedResult:
    """Solve `stages` in order on `model` by `deadline` (a `clock.now()` value).

    Between two stages: the next goal is built (when it is a function), the previous optimum is
    added as a constraint, and the hints are replaced by the previous solution: `hint(values)`
    gives them (default: every one of `variables` at its value). Stops at the first stage that
    finds nothing, keeping the solution before it. When every goal is a constant, one solve for
    any feasible solution gives `values`. On return the model carries every solved stage's optimum
    as a constraint (and the last goal as its objective): a caller may add a further goal."""
    outcomes: list[StageOutcome] = []
    values: dict[int, int] | None = None
    pending: cp_model.BoundedLinearExpression | bool | np.bool_ | None = None
    status = CONSTANT
    for stage in stages:
        goal = stage.objective
        if isinstance(goal, int):
            outcomes.append(StageOutcome(stage.name, CONSTANT, goal, goal))
            continue
        if values is not None and deadline - clock.now() <= stage.skip_below:
            outcomes.append(StageOutcome(stage.name, SKIPPED))
            break
        if callable(goal):
            goal = goal()
            if isinstance(goal, int):
                outcomes.append(StageOutcome(stage.name, CONSTANT, goal, goal))
                continue
        if pending is not None:
            model.add(pending)
            pending = None
        if values is not None:
            model.clear_hints()
            for var, v in hint(values) if hint is not None else _same(variables, values):
                model.add_hint(var, v)
        if stage.maximize:
            model.maximize(goal)
        else:
            model.minimize(goal)
        left = deadline - clock.now()
        solver = _solver(
            settings, max(stage.least, stage.share * left - stage.keep), stage.relative_gap
        )
        t0 = clock.now()
        st = clock.solve(solver, model)
        seconds = clock.now() - t0
        status = solver.status_name(st)
        if not solved(status):
            outcomes.append(StageOutcome(stage.name, status, seconds=seconds))
            break
        objective, bound = solver.objective_value, solver.best_objective_bound
        if stage.rebound is not None:
            bound = stage.rebound(bound)
            if status == "OPTIMAL" and (bound > objective if stage.maximize else bound < objective):
                status = "FEASIBLE"
        outcomes.append(
            StageOutcome(stage.name, status, objective, bound, solver.wall_time, seconds)
        )
        values = {v.index: int(solver.value(v)) for v in variables}
        best = int(round(objective))
        pending = goal >= best if stage.maximize else goal <= best
    if pending is not None:
        model.add(pending)
    if values is None and all(o.status == CONSTANT for o in outcomes):
        solver = _solver(settings, max(0.05, deadline - clock.now()), None)
        status = solver.status_name(clock.solve(solver, model))
        if solved(status):
            values = {v.index: int(solver.value(v)) for v in variables}
    return StagedResult(tuple(outcomes), values, status)


def _same(
    variables: Sequence[cp_model.IntVar], values: Mapping[int, int]
) -> Iterable[tuple[cp_model.IntVar, int]]:
    return ((v, values[v.index]) for v in variables)
