"""A batch plan's goals measured exactly, and the check that it never overcommits.

The model works with rounded units and the most common demand types only; the plans it competes
with (greedy, arc-flow) are not models at all. So every plan is judged here on the same exact
tuple, smaller is better: (priority-weighted pods left out, stranded VRAM increase in KiB over the
full workload profile, empty GPUs opened, nodes touched), by applying it to the capacity through
the ledger's check-and-set and undoing it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from extender.demand import Demand
from extender.ledger import DeviceArrays, LedgerError
from extender.planner.batch_layout import pod_classes
from extender.planner.capacity import Capacity, FragIndex
from extender.planner.greedy import Choice, place_one

__all__ = ["ACCEPT_GOALS", "Cost", "better", "device_rows", "evaluate", "valid"]

#: a plan's goals, see the module docstring; (1 << 62,) for a plan the ledger refuses
Cost = tuple[int, ...]

#: goals (a prefix of `evaluate`'s tuple) on which a solver plan must beat the reference plan.
ACCEPT_GOALS = {"placed": 1, "stranded": 2, "all": 4}


def evaluate(
    cap: Capacity, demands: Sequence[Demand], choices: dict[int, Choice], frag: FragIndex
) -> Cost:
    """The goals of a plan, measured exactly (full workload profile, bytes), smaller is better:
    (priority-weighted pods left out, stranded VRAM increase in KiB, empty GPUs opened, nodes touched)."""
    classes = pod_classes(demands)
    weight = {i: pc.weight for pc in classes for i in pc.members}
    a = cap.arrays
    unplaced = sum(weight[i] for i in range(len(demands)) if i not in choices)
    opened = 0
    seen: set[int] = set()
    for ch in choices.values():
        for g in device_rows(a, ch):
            if a.used_replicas[g] == 0 and g not in seen:
                opened += 1
                seen.add(g)
    nodes = sorted({ch[1] for ch in choices.values()})
    before = float(frag.node_frag(np.asarray(nodes, np.int64)).sum()) if nodes else 0.0
    done = []
    try:
        for i, ch in choices.items():
            place_one(cap, demands[i], ch, None)
            done.append((demands[i], ch[1]))
        frag.refresh(nodes)
        after = float(frag.node_frag(np.asarray(nodes, np.int64)).sum()) if nodes else 0.0
    except LedgerError:
        return (1 << 62,)
    finally:
        for d, n in reversed(done):
            cap.remove(d, n)
        frag.refresh(nodes)
    return (unplaced, int(round((after - before) / 1024)), opened, len(nodes))


def better(cost: Cost, ref: Cost, accept: str) -> bool:
    """`cost` beats `ref` on the goals `accept` names (lexicographic)."""
    n = ACCEPT_GOALS[accept]
    return cost[:n] < ref[:n]


def valid(
    cap: Capacity, demands: Sequence[Demand], choices: dict[int, Choice], frag: FragIndex
) -> bool:
    """Apply the plan through the ledger's check-and-set, then undo: proof that it never overcommits."""
    done = []
    ok = True
    nodes = sorted({ch[1] for ch in choices.values()})
    cpu0, mem0 = cap.cpu_free[nodes].copy(), cap.mem_free[nodes].copy()
    try:
        for i, ch in choices.items():
            place_one(cap, demands[i], ch, None)
            done.append((demands[i], ch[1]))
        cpu1, mem1 = cap.cpu_free[nodes], cap.mem_free[nodes]
        # CPU or memory the plan itself takes below zero (a node already over is not the plan's doing)
        if ((cpu1 < 0) & (cpu1 < cpu0)).any() or ((mem1 < 0) & (mem1 < mem0)).any():
            ok = False
    except LedgerError:
        ok = False
    finally:
        for d, n in reversed(done):
            cap.remove(d, n)
    return ok


def device_rows(a: DeviceArrays, ch: Choice) -> list[int]:
    """The ledger device rows a choice reserves."""
    res = ch[0]
    if res is None:
        return []
    start = int(a.node_start[ch[1]])
    end = int(a.node_start[ch[1] + 1])
    ids = set(res.device_ids)
    return [g for g in range(start, end) if a.devices[g].device_id in ids]
