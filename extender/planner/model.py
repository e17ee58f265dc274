"""The batch planner: place pending pods together onto the current free capacity (CP-SAT).

Goals, lexicographic (`batch_goals.evaluate` measures them exactly):
  1. most pods placed (priority-weighted: one pod outweighs all pods of lower priority together);
  2. least stranded VRAM (FGD's expected fragmentation over the most common pending types: free
     memory a type cannot use, or all of a node's free memory when the type cannot run there),
     then fewest empty GPUs opened, then fewest nodes touched.
("Fewest empty GPUs" before "stranded VRAM" loses memory to FGD on the Alibaba trace, see
docs/packing.md, so stranded VRAM comes first.)
The reference plan is the one-pod rule `SEQUENTIAL_RULE` (FGD's choice, GPU-less pods where the
GPUs are taken: `greedy.fgd_packed`) pod by pod in queue order, what a sequential scheduler does;
when it leaves pods out, a largest-first plan by vramsched's rule and a smallest-first plan by the
same one-pod rule compete with it. The best is the hint of stage 1 and the fallback. The solver's plan replaces it only when it is better on
the goals named by `accept` (default ACCEPT = "placed": more pods placed; then there is nothing to
gain when the reference places every pod and the solver does not run), so the result is never worse
than the sequential plan on the goals that decide.
Batches whose model would exceed MAX_COPIES node copies are solved over a candidate subset
(small batches) or by large-neighbourhood search; their stage 1 bound then comes from a class
relaxation of the whole cluster, which is valid for the full problem.
A batch of more than SMALL_BATCH pods that a greedy plan places whole gets the arc-flow plan
(`arcflow`, `flow_plan`: the per-GPU relaxation solved exactly, its paths placed, the rest by FGD's
rule) when it strands less VRAM; `prove=True` also bounds stranded VRAM with that relaxation.
Each stage reports its objective, proven bound and gap.

The steps live apart, as OR-Tools' examples keep them: what the model is built over
(`batch_layout`), building it (`batch_model`), solving it in stages (`batch_solve`, on the
`staged` harness), reading the plan back (`batch_readback`), bounds (`batch_bounds`) and the exact
goals (`batch_goals`). This module is the policy that picks among the plans.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from extender.demand import Demand
from extender.ledger import LedgerError
from extender.planner import batch_solve, clock
from extender.planner.batch_bounds import (
    batch_arcflow,
    opened_lower_bound,
    stranded_lower_bound,
)
from extender.planner.batch_goals import ACCEPT_GOALS, Cost, better, evaluate, valid
from extender.planner.batch_layout import MAX_COPIES, MODEL_TYPES, layout, pod_classes
from extender.planner.batch_model import build_model
from extender.planner.capacity import Candidates, Capacity, FragIndex, Workload
from extender.planner.greedy import Choice, greedy_batch, place_one
from extender.planner.staged import StageOutcome

__all__ = [
    "ACCEPT",
    "ACCEPT_GOALS",
    "EXTRA_GREEDY",
    "MAX_COPIES",
    "MODEL_TYPES",
    "SEQUENTIAL_RULE",
    "Plan",
    "flow_plan",
    "opened_lower_bound",
    "solve_batch",
    "stranded_lower_bound",
]

log = logging.getLogger(__name__)

#: batches up to this size on many distinct nodes use the candidate-subset model (`solve_small`).
SMALL_BATCH = 16
#: a small batch gets the exact model over the whole cluster only up to this many node copies.
SMALL_EXACT = 24
#: measured on the Alibaba trace (docs/benchmarks/packing-experiments.md): batch plans that only
#: strand less VRAM than the one-pod rule's sequential plan gain up to 38 GPUs of memory where
#: batches are GPU pods and lose up to 351 where they hold GPU-less pods (FGD's measure alone
#: places those worse than the rule); taken only for batches of GPU pods they still leave lists
#: where the planner ties FGD behind it; "all" lost in 4 of 9 runs. So by default the solver's
#: plan is used when it places more pods.
ACCEPT = "placed"
#: the one-pod rule of the reference plan (and of a batch of one pod): FGD's choice, with GPU-less
#: pods where the GPUs are taken (`greedy.fgd_packed`; why: its docstring and docs/packing.md).
SEQUENTIAL_RULE = "fgd-packed"
#: further greedy plans (order, rule) tried against the reference before the solver, when the
#: reference leaves pods out; the best is the solver's hint. Smallest first places the most pods:
#: on `make bench-planner`'s 100-node batch it places the proven optimum (481 of 500) where the
#: reference placed 466 and the solver's 1 s search from it reached 470.
EXTRA_GREEDY: tuple[tuple[str, str], ...] = (("size", "vramsched"), ("small", SEQUENTIAL_RULE))


@dataclass(frozen=True)
class Plan:
    """Chosen placement per pod index of the batch; `improved` when a plan beat the reference.
    `stages`: what each goal's solve found and proved; `cost`/`greedy_cost`: the exact goals
    (`batch_goals.evaluate`) of the plan and of the reference."""

    choices: dict[int, Choice]
    status: str = "GREEDY"
    improved: bool = False
    stages: tuple[StageOutcome, ...] = ()
    seconds: float = 0.0
    greedy_cost: Cost = ()
    cost: Cost = ()
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def gap(self) -> float:
        return max((s.gap for s in self.stages), default=0.0)

    @property
    def placed(self) -> int:
        return len(self.choices)


def solve_batch(
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex | None = None,
    *,
    time_limit: float = 1.0,
    num_workers: int = 2,
    workload: Workload | None = None,
    accept: str | None = None,
    prove: bool = False,
) -> Plan:
    """Plan `demands` on `cap` (not modified). Falls back to the reference plan on any solver trouble.

    `accept` (default ACCEPT) says which of the plan's goals must be better than the reference's
    for the solver's plan to be used: "placed" (pods placed, priority-weighted), "stranded" (then
    stranded VRAM) or "all" (then empty GPUs opened, then nodes touched).
    A batch of more than SMALL_BATCH pods that a greedy plan places whole is also planned by
    `flow_plan`, whose plan is used when it strands less VRAM (status "FLOW").
    `prove`: when a plan places every pod (no solver run), also prove within the time limit how
    many empty GPUs such a plan must open (`stats["openedLowerBound"]`, `opened_lower_bound`) and
    how little its stranded VRAM can change (`stats["strandedLowerBoundKiB"]`, a stage "BOUNDED",
    `stranded_lower_bound`). For reports: the background planner does not spend the CPU."""
    start = clock.now()
    accept = accept or ACCEPT
    if accept not in ACCEPT_GOALS:
        raise ValueError(f"accept must be one of {sorted(ACCEPT_GOALS)}")
    if frag is None:
        frag = FragIndex(cap, workload or Workload.from_demands(demands), count_foreign=False)
    # the reference: the one-pod rule pod by pod in queue order (priority, then arrival), what a
    # sequential scheduler would do; a batch of one pod gets exactly that rule's choice
    greedy = greedy_batch(cap, demands, frag, order="arrival", rule=SEQUENTIAL_RULE)
    # what the flow plan needs: about half the reference's time (0.22 s against 0.44 s at 5,000 nodes)
    flow_by = start + time_limit - 0.6 * (clock.now() - start)
    if len(demands) <= 1:
        # one pod: the rule enumerates every placement: exact for its measure
        return Plan(greedy, seconds=clock.now() - start)
    if accept == "placed" and len(greedy) == len(demands):
        # every pod placed: no plan can be better on the goal that decides, so no solver run
        cost = evaluate(cap, demands, greedy, frag)
        ref = _Reference(greedy, cost, cost)
        ref = _try_flow(ref, cap, demands, frag, flow_by, start + time_limit, num_workers, accept)
        return _all_placed(ref, cap, demands, frag, start, time_limit, num_workers, prove)
    best = evaluate(cap, demands, greedy, frag)
    for order, rule in EXTRA_GREEDY:
        # other greedy plans compete with the reference on the same goals (ties keep the reference)
        other = greedy_batch(cap, demands, frag, order=order, rule=rule)
        c = evaluate(cap, demands, other, frag)
        if better(c, best, accept):
            greedy, best = other, c
    ref = _Reference(greedy, best, best)
    if best[0] == 0:  # as above: a greedy plan placed every pod
        ref = _try_flow(ref, cap, demands, frag, flow_by, start + time_limit, num_workers, accept)
        greedy = ref.choices
        if accept == "placed":
            return _all_placed(ref, cap, demands, frag, start, time_limit, num_workers, prove)
    stats: dict[str, int] = {}
    try:
        lay = layout(cap, demands, frag, greedy)
        stats = lay.stats
        if lay.empty:
            return ref.plan(stats=stats, seconds=clock.now() - start)
        remaining = max(0.05, time_limit - (clock.now() - start))
        exact_limit = SMALL_EXACT if len(demands) <= SMALL_BATCH else MAX_COPIES
        if lay.full_copies <= exact_limit:
            solved = batch_solve.solve_exact(build_model(lay), remaining, num_workers)
        elif len(demands) <= SMALL_BATCH:
            solved = batch_solve.solve_small(lay, remaining, num_workers)
            stats = {**lay.stats, "candidateSubset": solved.rounds}
        else:
            solved = batch_solve.solve_large(lay, remaining, num_workers)
            stats = {**lay.stats, "lnsRounds": solved.rounds, "lnsAccepted": solved.accepted}
            if solved.opened_bound is not None:
                stats["openedLowerBound"] = solved.opened_bound
    except Exception:  # the solver must never take the hot path down: greedy answers
        log.exception("planner model failed; using the greedy plan")
        return ref.plan(status="ERROR", stats=stats, seconds=clock.now() - start)
    if (
        solved.choices is not None
        and better(solved.cost, solved.greedy_cost, accept)
        and valid(cap, demands, solved.choices, frag)
    ):
        choices, improved, cost = solved.choices, True, solved.cost
    else:
        choices, improved, cost = ref.choices, ref.improved, solved.greedy_cost
    return Plan(
        choices,
        solved.status,
        improved,
        solved.stages,
        clock.now() - start,
        solved.greedy_cost,
        cost,
        stats,
    )


@dataclass(frozen=True)
class _Reference:
    """The plan the solver has to beat: a greedy plan, or the flow plan that replaced it."""

    choices: dict[int, Choice]
    greedy_cost: Cost
    cost: Cost
    status: str = "GREEDY"
    improved: bool = False

    def plan(
        self,
        *,
        status: str | None = None,
        stages: tuple[StageOutcome, ...] = (),
        stats: dict[str, int] | None = None,
        seconds: float = 0.0,
    ) -> Plan:
        return Plan(
            self.choices,
            status or self.status,
            self.improved,
            stages,
            seconds,
            self.greedy_cost,
            self.cost,
            stats or {},
        )


def _all_placed(
    ref: _Reference,
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex,
    start: float,
    time_limit: float,
    num_workers: int,
    prove: bool,
) -> Plan:
    """A greedy (or flow) plan that places every pod: stage 1 is proven (nothing left out), and with
    `prove`, in the time left, the GPUs it opens are bounded by the class relaxation and its
    stranded VRAM by the arc-flow relaxation (a third stage, "BOUNDED")."""
    stages = [StageOutcome("placed", "OPTIMAL", 0.0, 0.0)]
    stats: dict[str, int] = {}
    if prove:
        left = max(0.05, time_limit - (clock.now() - start))
        bound = opened_lower_bound(cap, demands, frag, left, num_workers)
        if bound is not None:
            stats["openedLowerBound"] = bound
        t0 = clock.now()
        left = max(0.05, time_limit - (t0 - start))
        stranded = stranded_lower_bound(cap, demands, frag, left, num_workers)
        if stranded is not None:
            # stage 2's first goal, for the plan as it stands: its stranded VRAM increase against
            # the fewest KiB any plan placing every pod can reach
            stats["strandedLowerBoundKiB"] = stranded
            stages.append(
                StageOutcome(
                    "stranded",
                    "BOUNDED",
                    float(ref.cost[1]),
                    float(stranded),
                    seconds=clock.now() - t0,
                )
            )
    return ref.plan(stages=tuple(stages), stats=stats, seconds=clock.now() - start)


def _try_flow(
    ref: _Reference,
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex,
    start_by: float,
    deadline: float,
    num_workers: int,
    accept: str,
) -> _Reference:
    """A batch of more than SMALL_BATCH pods that a greedy plan places whole: the arc-flow plan
    (`flow_plan`) replaces it when it strands less VRAM (and is better on what `accept` names
    beyond that). Small batches (the trace's 2-8 pods) keep FGD's plan: one pod at a time is
    exact for one pod, and plans better only by stranded VRAM on such batches were noise on the
    trace (docs/packing.md). Not started after `start_by`: it would not finish by `deadline`."""
    if len(demands) <= SMALL_BATCH or clock.now() >= start_by:
        return ref
    flow = flow_plan(cap, demands, frag, deadline - clock.now(), num_workers)
    if len(flow) < len(demands):
        return ref
    c = evaluate(cap, demands, flow, frag)
    if better(c, ref.cost, "stranded" if accept == "placed" else accept) and valid(
        cap, demands, flow, frag
    ):
        return _Reference(flow, ref.greedy_cost, c, "FLOW", True)
    return ref


def flow_plan(
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex,
    time_limit: float,
    num_workers: int = 2,
) -> dict[int, Choice]:
    """A plan steered by the arc-flow relaxation's solution: pods of several GPUs first by the
    one-pod rule in queue order (they need GPUs of one node, which the relaxation drops), then
    single-GPU pods onto the GPUs the relaxed solution gives them (where the node's CPU and memory
    still allow), then whatever is left by the one-pod rule. Capacity is restored after.
    Why: a one-pod-at-a-time rule cannot see that filling a GPU with two small pods strands
    less than one larger pod would; on `make bench-planner` its plan was 10% from the bound."""
    deadline = clock.now() + time_limit
    a = cap.arrays
    choices: dict[int, Choice] = {}
    done: list[tuple[Demand, int]] = []

    def place(i: int, ch: Choice) -> bool:
        try:
            place_one(cap, demands[i], ch, frag)
        except LedgerError:
            return False
        choices[i] = ch
        done.append((demands[i], ch[1]))
        return True

    def by_rule(indices: list[int]) -> None:
        sub = [demands[i] for i in indices]
        for j, ch in greedy_batch(
            cap, sub, frag, order="arrival", rule=SEQUENTIAL_RULE, apply=True
        ).items():
            choices[indices[j]] = ch
            done.append((demands[indices[j]], ch[1]))

    try:
        by_rule([i for i, d in enumerate(demands) if d.gpu_count >= 2])
        if clock.now() >= deadline:
            choices.clear()  # out of time: no plan, the caller keeps its own
            return choices
        singles = [i for i, d in enumerate(demands) if d.gpu_count == 1]
        classes = pod_classes([demands[i] for i in singles])
        flow = batch_arcflow(cap, classes, frag, deadline)
        if flow.solve(deadline, num_workers, keep=True) is None:
            choices.clear()
            return choices
        pools = [[singles[m] for m in reversed(pc.members)] for pc in classes]
        touched = np.zeros(len(a.node_names), bool)  # the last goal: touch few nodes
        touched[[ch[1] for ch in choices.values()]] = True
        for rows, walks in flow.paths():
            # GPUs of a class are interchangeable for the other goals: those on nodes already in
            # the plan first, then node by node (rows are in node order)
            free_rows = rows[np.argsort(~touched[a.node_of[rows]], kind="stable")].tolist()
            for walk in sorted((w for w in walks if w), key=len, reverse=True):
                cpu = sum(demands[pools[p][-1]].cpu_milli for p in walk)
                mem = sum(demands[pools[p][-1]].memory_bytes for p in walk)
                g = next(
                    (
                        g
                        for g in free_rows
                        if cap.cpu_free[a.node_of[g]] >= cpu and cap.mem_free[a.node_of[g]] >= mem
                    ),
                    None,
                )
                if g is None:
                    continue  # no node of this class has the CPU or memory left: FGD places them
                free_rows.remove(g)
                n = int(a.node_of[g])
                touched[n] = True
                for p in walk:
                    i = pools[p].pop()
                    need = classes[p].demand.bytes_per_gpu
                    one = Candidates(
                        np.asarray([n]),
                        np.asarray([[g]]),
                        np.asarray([[a.per_pod_cap[g] if need is None else need]]),
                    )
                    if not place(i, (one.reservation(a, 0, demands[i]), n, False)):
                        pools[p].append(i)
        by_rule([i for i in range(len(demands)) if i not in choices])
    finally:
        for d, n in reversed(done):
            cap.remove(d, n)
        frag.refresh(sorted({n for _, n in done}))
    return choices
