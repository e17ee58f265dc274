"""Reading a batch plan back from the model's solution: which pod goes to which node and GPUs.

The model counts pods per class, node copy and device; here the counts become one `Choice` per
pod: a copy is the node the layout put first for it, pods of a class are handed out in their
order, and a k-GPU pod takes the k devices of its copy with the most shares left (the model's
`sum_g s = k z`, `s <= z` guarantees k distinct devices for every one of the z pods).
"""

from __future__ import annotations

from collections.abc import Mapping

from extender.ledger import Reservation
from extender.planner.batch_model import BatchModel
from extender.planner.greedy import Choice

__all__ = ["read_back"]


def read_back(bm: BatchModel, values: Mapping[int, int]) -> dict[int, Choice]:
    """The plan in `values` (decision variable index -> value), per pod index of the batch."""
    lay = bm.layout
    a = lay.a
    queue = {p: list(pc.members) for p, pc in enumerate(lay.classes)}
    choices: dict[int, Choice] = {}
    for ci, cp in enumerate(lay.copies):
        n = cp.nodes[cp.index]
        actual = lay.dev_order[n]
        for p, pc in enumerate(lay.classes):
            d = pc.demand
            if pc.k == 0:
                v = bm.z.get((p, ci))
                for _ in range(values.get(v.index, 0) if v is not None else 0):
                    i = queue[p].pop()
                    choices[i] = (None, n, False)
                continue
            if pc.k == 1:
                for li in range(len(actual)):
                    xv = bm.x.get((p, ci, li))
                    if xv is None:
                        continue
                    for _ in range(values[xv.index]):
                        i = queue[p].pop()
                        g = actual[li]
                        choices[i] = (
                            Reservation(
                                lay.demands[i].pod,
                                a.node_names[n],
                                (a.devices[g].device_id,),
                                (int(lay.need[p, g]),),
                                d.priority,
                                d.bytes_per_gpu is not None,
                            ),
                            n,
                            False,
                        )
                continue
            v = bm.z.get((p, ci))
            zc = values.get(v.index, 0) if v is not None else 0
            left = {
                li: values[bm.x[p, ci, li].index]
                for li in range(len(actual))
                if (p, ci, li) in bm.x
            }
            for _ in range(zc):
                pick = sorted(left, key=lambda li: (-left[li], li))[: pc.k]
                for li in pick:
                    left[li] -= 1
                rows = sorted(actual[li] for li in pick)
                i = queue[p].pop()
                choices[i] = (
                    Reservation(
                        lay.demands[i].pod,
                        a.node_names[n],
                        tuple(a.devices[g].device_id for g in rows),
                        tuple(int(lay.need[p, g]) for g in rows),
                        d.priority,
                        d.bytes_per_gpu is not None,
                    ),
                    n,
                    False,
                )
    return choices
