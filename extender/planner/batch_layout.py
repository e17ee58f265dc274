"""What the batch model is built over: pod classes, node classes and their interchangeable copies.

Identical pending pods form a *pod class* (same GPU count, bytes per GPU, resource, allowed
products, CPU, memory, priority) with a count; candidate nodes with identical free state (CPU,
memory, the sorted states of their devices, the pod classes they can host) form a *node class*.
A node class of M nodes gets only as many interchangeable copies as could ever be used: at most
the number of compatible pending pods. Kept apart from the CP-SAT model (`batch_model`) because
the bounds (`batch_bounds`), the candidate-subset search and the arc-flow relaxation read it too,
without building a model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from extender.demand import Demand
from extender.ledger import DeviceArrays
from extender.planner.capacity import Capacity, FragIndex, device_matches
from extender.planner.greedy import Choice

__all__ = [
    "MAX_COPIES",
    "MODEL_TYPES",
    "BatchLayout",
    "NodeCopy",
    "PodClass",
    "compat",
    "device_key",
    "layout",
    "pod_classes",
    "stranded_unit",
]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: pending-demand types the model's stranded-VRAM term looks at (the most frequent ones).
MODEL_TYPES = 4
#: stranded VRAM is counted in units of 1/1000 of the largest GPU in the model.
_STRANDED_UNITS = 1000
#: above this many node copies the exact model is restricted to the greedy plan's neighbourhood
#: (its nodes of each class plus slack); the proven bound then comes from the class relaxation.
MAX_COPIES = 120
_WEIGHT_RES = 100

#: a device's state as the model compares devices: (resource, product, capacity, per-pod cap,
#: replicas, used bytes, used replicas)
DeviceKey = tuple[int, int, int, int, int, int, int]


@dataclass(frozen=True)
class PodClass:
    demand: Demand
    members: list[int]
    weight: int

    @property
    def k(self) -> int:
        return self.demand.gpu_count


@dataclass(frozen=True)
class NodeCopy:
    cls: int
    nodes: list[int]  # actual node rows of the class (the copy is any one of them)
    devices: list[int]  # local device order -> device rows of the class's first node
    index: int  # copy number inside its class


@dataclass(frozen=True)
class BatchLayout:
    """A batch on a capacity snapshot, ready to be modelled. `need[p, g]`: bytes a pod of class p
    takes on device g; `fit[p, g]`: one of its GPUs fits g now; `usable[p, n]`: node n could host
    a whole pod now. `groups`: node classes (key, nodes); `copies`: the model's node copies.
    `types`/`tw`: the workload types the stranded-VRAM goal looks at and their integer weights."""

    cap: Capacity
    demands: Sequence[Demand]
    frag: FragIndex
    greedy: dict[int, Choice]
    classes: list[PodClass]
    need: IntArray
    fit: BoolArray
    usable: BoolArray
    cand_nodes: IntArray
    types: IntArray
    tw: IntArray
    dev_order: dict[int, list[int]]
    groups: list[tuple[tuple[object, ...], list[int]]]
    copies: list[NodeCopy]
    full_copies: int
    restricted: bool
    stats: dict[str, int]

    @property
    def a(self) -> DeviceArrays:
        return self.cap.arrays

    @property
    def empty(self) -> bool:
        return not self.copies


def pod_classes(demands: Sequence[Demand]) -> list[PodClass]:
    groups: dict[tuple[object, ...], list[int]] = defaultdict(list)
    for i, d in enumerate(demands):
        groups[
            (
                d.gpu_count,
                d.bytes_per_gpu,
                d.resource,
                d.allowed_products,
                d.cpu_milli,
                d.memory_bytes,
                d.priority,
            )
        ].append(i)
    # strict priority: one pod of a higher priority outweighs all pods of the lower ones together
    weight: dict[int, int] = {}
    below = 0
    for p in sorted({d.priority for d in demands}):
        weight[p] = min(below + 1, 1 << 40)
        below += weight[p] * sum(1 for d in demands if d.priority == p)
    return [PodClass(demands[m[0]], m, weight[demands[m[0]].priority]) for m in groups.values()]


def compat(cap: Capacity, classes: Sequence[PodClass]) -> tuple[IntArray, BoolArray, BoolArray]:
    """Per pod class: bytes a pod takes on each device (`need`), the devices one of its GPUs fits
    now (`fit`), and the nodes that could host a whole pod now (`usable`: CPU, memory, enough
    fitting devices)."""
    a = cap.arrays
    P = len(classes)
    free = a.capacity - a.used
    rep = a.replicas - a.used_replicas
    need_all = np.zeros((P, len(a.capacity)), np.int64)
    fit = np.zeros((P, len(a.capacity)), bool)
    host = np.zeros((P, len(a.node_names)), bool)
    for p, pc in enumerate(classes):
        d = pc.demand
        need = (
            a.per_pod_cap
            if d.bytes_per_gpu is None
            else np.full(len(a.capacity), d.bytes_per_gpu, np.int64)
        )
        need_all[p] = need
        fit[p] = (
            device_matches(a, d.resource, d.allowed_products)
            & (a.per_pod_cap >= need)
            & (free >= need)
            & (rep > 0)
        )
        host[p] = cap.fits_host(d)
    okcount = np.zeros((P, len(a.node_names)), np.int64)
    for p in range(P):
        okcount[p] = np.bincount(a.node_of[fit[p]], minlength=len(a.node_names))
    usable = host & (okcount >= np.asarray([pc.k for pc in classes])[:, None])
    return need_all, fit, usable


def device_key(a: DeviceArrays, g: int) -> DeviceKey:
    return (
        int(a.resource_id[g]),
        int(a.product_id[g]),
        int(a.capacity[g]),
        int(a.per_pod_cap[g]),
        int(a.replicas[g]),
        int(a.used[g]),
        int(a.used_replicas[g]),
    )


def layout(
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex,
    greedy: dict[int, Choice],
    max_copies: int | None = None,
    *,
    node_subset: set[int] | None = None,
) -> BatchLayout:
    """The layout of `demands` on `cap` now, over `node_subset` when given. With `max_copies`,
    a cluster needing more copies keeps per node class only the `greedy` plan's nodes and some
    slack (`restricted`: the model is then a neighbourhood of that plan)."""
    a = cap.arrays
    classes = pod_classes(demands)
    need, fit, usable = compat(cap, classes)
    cand_nodes = np.flatnonzero(usable.any(axis=0))
    if node_subset is not None:
        cand_nodes = np.asarray(sorted(set(cand_nodes.tolist()) & node_subset), np.int64)
    # workload types for the stranded term
    w = frag.w
    top = np.argsort(-w.weight, kind="stable")[:MODEL_TYPES]
    tw = np.maximum(1, np.rint(w.weight[top] / w.weight[top].sum() * _WEIGHT_RES)).astype(np.int64)
    # node classes
    groups: dict[tuple[object, ...], list[int]] = defaultdict(list)
    dev_order: dict[int, list[int]] = {}
    for n in cand_nodes.tolist():
        lo, hi = int(a.node_start[n]), int(a.node_start[n + 1])
        keys = [device_key(a, g) for g in range(lo, hi)]
        order = sorted(range(lo, hi), key=lambda g: keys[g - lo])
        dev_order[n] = order
        key = (
            int(cap.cpu_free[n]),
            int(cap.mem_free[n]),
            tuple(keys[g - lo] for g in order),
            tuple(usable[:, n]),
        )
        groups[key].append(n)
    greedy_nodes: dict[int, int] = defaultdict(int)
    for ch in greedy.values():
        greedy_nodes[ch[1]] += 1
    copies: list[NodeCopy] = []
    restricted = 0
    full: list[int] = []
    for nodes in groups.values():
        n_compat = sum(len(pc.members) for p, pc in enumerate(classes) if usable[p, nodes[0]])
        full.append(min(len(nodes), n_compat))
    restrict = max_copies is not None and sum(full) > max_copies
    for c, nodes in enumerate(groups.values()):
        u = full[c]
        if restrict:
            # neighbourhood of the greedy plan: the nodes it used of this class plus some slack
            used = sum(1 for n in nodes if n in greedy_nodes)
            cap_c = used + max(2, used // 2)
            if cap_c < u:
                u = cap_c
                restricted += 1
        # the greedy plan's nodes first, so copies can be mapped back to them
        nodes = sorted(nodes, key=lambda n: (-greedy_nodes.get(n, 0), n))
        for j in range(u):
            copies.append(NodeCopy(c, nodes, dev_order[nodes[0]], j))
    stats = {
        "podClasses": len(classes),
        "candidateNodes": len(cand_nodes),
        "nodeClasses": len(groups),
        "nodeCopies": len(copies),
        "types": len(top),
        "restrictedClasses": restricted,
    }
    return BatchLayout(
        cap=cap,
        demands=demands,
        frag=frag,
        greedy=greedy,
        classes=classes,
        need=need,
        fit=fit,
        usable=usable,
        cand_nodes=cand_nodes,
        types=top,
        tw=tw,
        dev_order=dev_order,
        groups=list(groups.items()),
        copies=copies,
        full_copies=sum(full),
        restricted=restricted > 0,
        stats=stats,
    )


def stranded_unit(lay: BatchLayout) -> int:
    """Stranded VRAM is counted in units of the gcd of all sizes involved (exact), unless that
    makes a GPU more than 20,000 units; then 1/1000 of the largest GPU (rounded)."""
    a = lay.a
    rows = np.concatenate(
        [np.arange(int(a.node_start[n]), int(a.node_start[n + 1])) for n in lay.cand_nodes.tolist()]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)
    if len(rows) == 0:
        return 1
    vals = [
        int(v)
        for v in np.unique(
            np.concatenate(
                [
                    a.capacity[rows],
                    a.used[rows],
                    lay.frag.need[rows].ravel(),
                    lay.need[:, rows].ravel(),
                ]
            )
        )
        if v > 0
    ]
    g = 0
    for v in vals:
        g = math.gcd(g, v)
    gmax = int(a.capacity[rows].max())
    if g <= 0 or gmax // g > 20000:
        return max(1, gmax // _STRANDED_UNITS)
    return g
