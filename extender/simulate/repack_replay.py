"""`planner+repack` in the replay: when a GPU pod fits nowhere after the planner's placements,
repacking by migration (`planner.repack`) finds the fewest moves of running pods that make it fit
and applies them at once, within a budget of a fraction of the pods placed so far (moves spent
count against it), at most so many moves per GPU the pod asks and, when set, per pod (live
mode's caps, same defaults). In the replay every running pod may move (the trace says nothing
about which could not); the live mode's per-minute cap and its movable label are `serve
--repack`'s. Searches that cannot succeed are skipped (`RepackSkips`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from extender.demand import Demand
from extender.ledger import LedgerError, Reservation
from extender.planner.capacity import Capacity, FragIndex, demand_kind
from extender.quantity import format_bytes
from extender.repack_policy import MOVES_PER_GPU, moves_to_place
from extender.simulate.result import PolicyResult
from extender.simulate.trace import Task

__all__ = [
    "MOVE_BUDGET",
    "REPACK_TIME_LIMIT",
    "REQUEST_TALLY",
    "RepackLimits",
    "RepackSkips",
    "held",
    "repack_failed",
    "request_label",
]

#: `planner+repack`'s default move budget: moves as a fraction of the pods placed so far.
MOVE_BUDGET = 0.02
#: seconds one repack search may take (`planner.repack.search_repack`'s time limit)
REPACK_TIME_LIMIT = 1.0


@dataclass(frozen=True)
class RepackLimits:
    """What `planner+repack` may spend: moves as a fraction of the pods placed so far, moves
    to place one pod per GPU it asks and in all (live mode's caps: without one, a search could
    spend the whole budget on a long chain for one small pod; on the trace, searches capped at
    3 place more pods with the same budget, and per GPU, a pod that asks 8 GPUs may free 8),
    seconds per search, CP-SAT workers."""

    budget: float = MOVE_BUDGET
    per_gpu: int = MOVES_PER_GPU
    per_pod: int | None = None
    time_limit: float = REPACK_TIME_LIMIT
    num_workers: int = 2

    def allowed(self, d: Demand, placed: int, moved: int) -> int:
        """Moves the search for `d` may make, after `moved` moves and `placed` pods placed."""
        cap = moves_to_place(d.gpu_count, self.per_gpu, self.per_pod)
        return min(cap, int(self.budget * placed) - moved)


@dataclass
class RepackSkips:
    """Repack searches that cannot succeed, skipped: a demand that asks at least what a failed
    search asked (`repack.dominates`), with no more moves allowed than that search had, until the
    layout changes other than by an arrival (a pod leaves, or a plan moves pods). Sound when the
    failure was proven (a pod added only takes capacity); a cut for a search that stopped at its
    neighbourhood or time limit. The replay at inflate 1.3 fails thousands of pods; without this,
    thousands of searches."""

    failed: list[tuple[Demand, int]] = field(default_factory=list)

    def forget(self) -> None:
        """The layout changed other than by an arrival: any failed search may succeed now
        (after a plan's moves, a plan of m moves may exist where none did before)."""
        self.failed.clear()

    def skip(self, d: Demand, max_moves: int) -> bool:
        from extender.planner.repack import dominates

        return any(m >= max_moves and dominates(d, f) for f, m in self.failed)

    def add(self, d: Demand, max_moves: int) -> None:
        from extender.planner.repack import dominates

        self.failed = [(f, m) for f, m in self.failed if not (m <= max_moves and dominates(f, d))]
        self.failed.append((d, max_moves))


def held(cap: Capacity, d: Demand, node: int) -> Reservation:
    """What a placed pod holds, as repacking reads it: its reservation, or for a GPU-less pod
    one with no devices that names its node."""
    return cap.ledger.reservation(d.pod.key) or Reservation(
        d.pod, cap.arrays.node_names[node], (), ()
    )


#: what `PolicyResult.repackByRequest` counts per GPU request, in this order, and the column
#: title `vramsched simulate` prints for each
REQUEST_TALLY = {
    "blocked": "blocked",
    "budgetSpent": "no budget left",
    "skipped": "skipped",
    "searched": "searched",
    "placed": "placed",
    "moves": "moves",
}


def request_label(d: Demand) -> str:
    """A GPU request as `repackByRequest` names it: GPUs x memory per GPU (whole: devices)."""
    per_gpu = "whole" if d.bytes_per_gpu is None else format_bytes(d.bytes_per_gpu)
    return f"{d.gpu_count} x {per_gpu}"


def repack_failed(
    cap: Capacity,
    place_rule: str,
    frag: FragIndex | None,
    batch: Sequence[Task],
    placed_now: int,
    running: dict[str, tuple[Demand, Reservation]],
    where: dict[str, int],
    demands_of: dict[str, Task],
    out: PolicyResult,
    skips: RepackSkips,
    nowhere: set[tuple],
    limits: RepackLimits,
) -> list[tuple[Task, int]]:
    """Repack for every GPU pod of the batch left out, in order, while the budget lasts; the
    pods it places, indexed like the others."""
    from extender.planner.repack import apply_plan, search_repack

    more: list[tuple[Task, int]] = []
    for t in batch:
        d = t.demand
        if t.key in where or not d.wants_gpu:
            continue
        allowed = limits.allowed(d, out.placed + placed_now + len(more), out.moves)
        tally = out.repackByRequest.setdefault(request_label(d), dict.fromkeys(REQUEST_TALLY, 0))
        tally["blocked"] += 1
        if allowed < 1 or demand_kind(d) in nowhere or skips.skip(d, allowed):
            out.repackSkipped += 1
            tally["budgetSpent" if allowed < 1 else "skipped"] += 1
            continue
        tally["searched"] += 1
        found = search_repack(
            cap,
            d,
            list(running.values()),
            max_moves=allowed,
            time_limit=limits.time_limit,
            num_workers=limits.num_workers,
            place_rule=place_rule,
            frag=frag,
        )
        out.repackSearches += 1
        out.repackSeconds += found.seconds
        plan = found.plan
        if plan is None:
            out.repackUnproven += not found.proven
            skips.add(d, allowed)
            continue
        try:
            apply_plan(cap, plan)
        except LedgerError:  # cannot happen for a plan read back and checked; counted as failed
            skips.add(d, allowed)
            continue
        touched = set()
        for mv in plan.moves:
            n = cap.ledger.node_row(mv.target.node)
            assert n is not None
            touched |= {where[mv.pod.key], n}
            where[mv.pod.key] = n
            running[mv.pod.key] = (mv.demand, held(cap, mv.demand, n))
        n = cap.ledger.node_row(plan.placement.node)
        assert n is not None
        touched.add(n)
        if frag is not None:
            frag.refresh(sorted(touched))
        out.moves += len(plan.moves)
        out.repackPlaced += 1
        tally["placed"] += 1
        tally["moves"] += len(plan.moves)
        if plan.moves:
            skips.forget()
        where[t.key] = n
        demands_of[t.key] = t
        running[t.key] = (d, held(cap, d, n))
        more.append((t, n))
    return more
