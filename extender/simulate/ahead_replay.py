"""Replaying `serve --plan-ahead`: pods placed at once, with the planner's choices kept ready.

Before each arrival the server has made a round of planning ahead (`planner.ahead`) for the most
common pod types seen so far, `ahead.DEPTH` pods each; kube-scheduler then places the arriving pods one
at a time, within milliseconds, faster than another round. So each pod takes its type's next
entry while the entry's node was changed since the round only by pods that took entries and the
GPUs still fit, and otherwise gets the same rule's choice made then with the round's measure
(`ahead.InlineRule`); the hot path's before any round had a pod type to plan for.
"""

from __future__ import annotations

from extender.ledger import LedgerError
from extender.planner.capacity import Capacity, FragIndex, Kind, demand_kind
from extender.planner.greedy import Choice, choose, place_one
from extender.simulate.profile import LiveProfile
from extender.simulate.trace import Task

__all__ = ["place_with_ahead"]


def place_with_ahead(
    cap: Capacity, frag: FragIndex, batch: list[Task], live: LiveProfile, types: int
) -> tuple[list[tuple[Task, int]], int]:
    """Place `batch` (arrived together) after a round for the `types` most common GPU pod types
    of `live` (the pods before this batch); the pods placed with their node rows, and how many
    took an entry planned ahead."""
    from extender.planner.ahead import DEPTH, plan_ahead, same_shape  # imports OR-Tools
    from extender.planner.model import SEQUENTIAL_RULE

    examples = live.mix.common(types)
    entries = plan_ahead(cap, examples, frag, DEPTH)
    taken: dict[Kind, int] = {}
    other: set[int] = set()  # nodes a pod without an entry went to
    placed: list[tuple[Task, int]] = []
    ahead = 0
    for t in batch:
        d = t.demand
        kind = demand_kind(d)
        choice: Choice | None = None
        queue = entries.get(kind, [])
        i = taken.get(kind, 0)
        if i < len(queue) and same_shape(queue[i].demand, d):
            e = queue[i]
            row = cap.ledger.node_row(e.node)
            if row is not None and row not in other and cap.ledger.fits(e.reservation) is None:
                choice = (e.for_pod(d), row, False)
        planned = choice is not None
        if choice is None:
            # the round's measure; before any round (no GPU pod seen yet) the hot path
            choice = (
                choose(SEQUENTIAL_RULE, cap, d, frag) if examples else choose("hot-path", cap, d)
            )
        if choice is None:
            continue
        try:
            place_one(cap, d, choice, frag)
        except LedgerError:
            continue
        if planned:
            taken[kind] = i + 1
            ahead += 1
        else:
            other.add(choice[1])
        placed.append((t, choice[1]))
    return placed, ahead
