"""One-pod-at-a-time placement rules: the published baselines the simulator compares with and
vramsched's own (`fgd-packed` is the planner's reference plan and its answer for a single pod).

Every rule picks among `capacity.candidates` (real, fitting placements), so none can break the
ledger's invariant except `spread`, which models the device plugin's time-slicing that does not
know memory and is therefore *recorded*, overcommit included, to show what it would do.

- first-fit: first node in list order, lowest-index GPUs that fit.
- best-fit: gpushare's per-GPU rule: the GPU(s) left with the least free memory.
- spread: kube-scheduler's default NodeResourcesFit LeastAllocated on CPU and memory, counting
  only `nvidia.com/gpu` replicas; the device plugin hands out replicas of the least shared GPUs.
- fgd: fragmentation gradient descent: the placement that least increases expected stranded VRAM.
- fgd-packed: FGD's choice for a GPU pod (the lowest node among equal ones), except that a pod
  with a choice of GPU models goes to the models that pods limited to some models need least; a
  GPU-less pod goes to the node with the least free GPU memory: the planner's one-pod rule.
- hot-path: what the server answers a pod placed at once (prioritize's 10, bind's devices).
- vramsched: least increase of stranded VRAM (FGD's measure), then fewest empty GPUs opened, then
  lowest index: the model's stage 2 goals restricted to one pod (the planner tries its largest-first
  plan of a batch, and FGD's smallest first, against FGD's in queue order).

Why the planner's one-pod rule is `fgd-packed` and not FGD's own (docs/packing.md, "Why the
planner's rule differs from FGD's"): FGD's measure is flat for a GPU-less pod while every node has
CPU to spare, so FGD stacks GPU-less pods on the lowest nodes, whose GPUs are still free, and the
CPU they hold strands those GPUs later; the rule sends them where the GPUs are already taken. Pods
that may use any model stay off the models that limited pods will need (`pressure.py`), which
FGD's measure fills first. For the rest of the GPU pods FGD's measure is kept as it is: packing
its near-equal choices onto the lowest node made the planner trail FGD on several trace lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from extender.demand import Demand
from extender.ledger import LedgerError, Reservation
from extender.placement import MAX_SCORE, choose_devices, score_rows
from extender.planner.capacity import Candidates, Capacity, FragIndex, candidates

__all__ = [
    "Choice",
    "POLICIES",
    "choose",
    "place_one",
    "greedy_batch",
    "batch_order",
    "packed_pick",
]

# (reservation or None for a GPU-less pod, node row, overcommit?)
Choice = tuple[Reservation | None, int, bool]


def _pick(
    cands: Candidates,
    keys: Sequence[np.ndarray],
    demand: Demand,
    cap: Capacity,
    overcommit: bool = False,
) -> Choice | None:
    if len(cands) == 0:
        return None
    order = np.lexsort(tuple(reversed(list(keys))))
    c = int(order[0])
    return cands.reservation(cap.arrays, c, demand), int(cands.node[c]), overcommit


def first_fit(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    c = candidates(cap, demand, order="index", dedupe=False)
    first_dev = c.devices[:, 0] if c.devices.shape[1] else c.node
    return _pick(c, [c.node, first_dev], demand, cap)


def best_fit(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    c = candidates(cap, demand, order="tight")
    a = cap.arrays
    if demand.gpu_count == 0:
        left = cap.cpu_free[c.node]
        return _pick(c, [left, c.node], demand, cap)
    return _pick(c, [c.leftover(a), c.node, c.devices[:, 0]], demand, cap)


def least_allocated(cap: Capacity, demand: Demand, nodes: np.ndarray) -> np.ndarray:
    """kube-scheduler's default NodeResourcesFit score (LeastAllocated, integer 0..100) of `nodes`
    for the pod: the share of CPU and of memory left free after it, averaged."""
    cpu = (cap.cpu_free[nodes] - demand.cpu_milli) / np.maximum(cap.cpu_total[nodes], 1)
    mem = (cap.mem_free[nodes] - demand.memory_bytes) / np.maximum(cap.mem_total[nodes], 1)
    score: np.ndarray = np.floor(50 * (cpu + mem))
    return score


def spread(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    """LeastAllocated node by CPU/memory, then the least shared GPU replicas (memory ignored)."""
    a = cap.arrays
    c = candidates(cap, demand, order="spread", dedupe=False, overcommit=True)
    if len(c) == 0:
        return None
    n = c.node
    score = least_allocated(cap, demand, n)
    if demand.gpu_count == 1:
        # one candidate per device: within the best node, the GPU with the fewest pods.
        reps = a.used_replicas[c.devices[:, 0]]
        return _pick(c, [-score, n, reps, c.devices[:, 0]], demand, cap, overcommit=True)
    return _pick(c, [-score, n], demand, cap, overcommit=True)


def fgd(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    assert frag is not None, "fgd needs a workload profile"
    c = candidates(cap, demand)
    if len(c) == 0:
        return None
    d = np.round(frag.delta(c, demand), 6)
    return _pick(c, [d, c.node], demand, cap)


#: placements whose change of expected stranded VRAM is within this share of a GPU's memory of the
#: best one count as equally good to `fgd_packed`, which then takes the lowest node among them.
#: 0: FGD's own choice (bands of 0.1% to 2% trailed FGD on more of the 24 trace lists than none).
FGD_TOLERANCE = 0.0

#: the band for a GPU-less pod, whose near-ties `fgd_packed` sends to the node with the least free
#: GPU memory instead of the lowest one: FGD's measure, where it is not flat, still vetoes a node
#: whose CPU would strand more than a tenth of a GPU.
GPULESS_TOLERANCE = 0.1


#: a pod that may use several GPU models skips the models whose pressure (`pressure.py`) exceeds
#: the least pressed one's by more than this, when any other fits
PRESSURE_SLACK = 0.5

#: and among its equal choices, prefers the models within this pressure of the least pressed one
PRESSURE_TIE = 0.05


def fgd_packed(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    """FGD's measure, then the lowest node: among the placements whose increase of expected
    stranded VRAM is within `FGD_TOLERANCE` of a GPU's memory (the cluster's mean device memory)
    of the least (0: the least), the lowest node; on that node, the least increase. A GPU-less
    pod: among those within `GPULESS_TOLERANCE`, the node with the least free GPU memory, then
    the lowest. Where some pods of the workload are limited to some GPU models, a GPU pod with a
    choice of models first leaves the models those pods will need (`PRESSURE_SLACK`,
    `PRESSURE_TIE`).

    Why GPU-less pods differ: FGD's measure is flat for them while every node has CPU to spare,
    so FGD and first fit both stack them on the lowest nodes, whose GPUs are still free; the CPU
    they take there later strands those GPUs. On a node whose GPUs are taken they strand nothing.
    Why models: FGD's measure draws pods that may go anywhere onto the models few pods may use
    (`pressure.py`), and the pods limited to those models then fail. The planner builds `frag`
    with `count_foreign=False`. Why no band for GPU pods: once GPU-less pods are out of the way,
    FGD's fine distinctions pay; bands of 0.1% to 2% of a GPU won on some lists and trailed FGD
    on others. docs/packing.md has the measurements."""
    assert frag is not None, "fgd-packed needs a workload profile"
    c = candidates(cap, demand)
    if len(c) == 0:
        return None
    a = cap.arrays
    if demand.gpu_count == 0:
        d = np.round(frag.delta(c, demand), 6)
        cap_mean = float(a.capacity.mean()) if len(a.capacity) else 0.0
        near = d <= d.min() + GPULESS_TOLERANCE * cap_mean
        gpu_free = a.per_node_sum(a.free)[c.node]
        return _pick(c, [~near, gpu_free, c.node, d], demand, cap)
    c, pressed = by_pressure(c, cap, frag, slack=PRESSURE_SLACK, tie=PRESSURE_TIE)
    return packed_pick(c, pressed, cap, demand, frag)


def packed_pick(
    c: Candidates, pressed: np.ndarray, cap: Capacity, demand: Demand, frag: FragIndex
) -> Choice | None:
    """`fgd_packed`'s choice among GPU placements `c` left after its model filter: FGD's measure
    (plus `frag.open_cost` per idle device opened, `opened_memory`) within `FGD_TOLERANCE`, then
    the models not `pressed`, the lowest node, the measure (kept apart so that variants of the
    filter, benchmarks/planner_rules.py, share the rest)."""
    d = frag.delta(c, demand)
    if frag.open_cost:
        d = d + frag.open_cost * opened_memory(c, cap)
    d = np.round(d, 6)
    near = d <= d.min() + FGD_TOLERANCE * float(cap.arrays.capacity.mean())
    return _pick(c, [~near, pressed, c.node, d], demand, cap)


def opened_memory(c: Candidates, cap: Capacity) -> np.ndarray:
    """Per candidate, the idle devices it would open, each counted as the cluster's mean device
    memory: the planner's charge for opening a GPU (`FragIndex.open_cost`).

    Why a count and not the devices' own memory: charging memory makes a 16 GB T4 cheaper to
    open than an 80 GB A100, so small models would take a T4 each instead of sharing a GPU that
    is already in use, the opposite of using as few GPUs as possible."""
    a = cap.arrays
    idle = a.used_replicas[c.devices] == 0
    out: np.ndarray = idle.sum(axis=1) * float(a.capacity.mean())
    return out


def by_pressure(
    c: Candidates,
    cap: Capacity,
    frag: FragIndex,
    *,
    slack: float | None,
    tie: float | None,
    full: float | None = None,
) -> tuple[Candidates, np.ndarray]:
    """GPU placements `c` without the models pressed more than `slack` above the least pressed
    one, or `full` or more (None: no such limit), when any other remains; and which of those left
    are pressed more than `tie` above the least pressed (all False without limited pods or `tie`).
    The placements' first device names the model."""
    if not frag.pressure.active:
        return c, np.zeros(len(c), bool)
    rho = frag.pressure.per_product()[cap.arrays.product_id[c.devices[:, 0]]]
    keep = np.ones(len(c), bool)
    if slack is not None:
        keep &= rho <= rho.min() + slack
    if full is not None:
        keep &= rho < full
    if keep.any() and not keep.all():
        c, rho = c.take(np.flatnonzero(keep)), rho[keep]
    return c, (np.zeros(len(c), bool) if tie is None else rho > rho.min() + tie)


def vramsched(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    c = candidates(cap, demand)
    if len(c) == 0:
        return None
    a = cap.arrays
    d = np.round(frag.delta(c, demand), 6) if frag is not None else c.leftover(a).astype(np.float64)
    return _pick(c, [d, c.opened(a), c.node], demand, cap)


def hot_path(cap: Capacity, demand: Demand, frag: FragIndex | None = None) -> Choice | None:
    """What `vramsched serve` does to a pod kube-scheduler places at once (no plan: the background
    planner only plans pods that wait): prioritize over the nodes with room for the pod's CPU and
    memory, the node it scores 10 (`placement.score_rows`), and bind's devices there
    (`placement.choose_devices`). kube-scheduler's own scorers are left out: adding its default
    LeastAllocated score as it sums them moved the trace's result by +0.6 to +23 GPUs of memory
    (benchmarks/kube_scoring.py). A GPU-less pod, which the extender scores 0 everywhere, goes to
    the first node with room."""
    rows = np.flatnonzero(cap.fits_host(demand))
    if not len(rows):
        return None
    if not demand.wants_gpu:
        return (None, int(rows[0]), False) if demand.gpu_count == 0 else None
    names = cap.arrays.node_names
    _, asked, scores = score_rows(cap.ledger, demand, [names[r] for r in rows.tolist()])
    top = asked[scores == MAX_SCORE]
    if not len(top):
        return None
    res = choose_devices(cap.ledger, demand, names[int(top[0])])
    return None if isinstance(res, str) else (res, int(top[0]), False)


POLICIES: dict[str, Callable[[Capacity, Demand, FragIndex | None], Choice | None]] = {
    "first-fit": first_fit,
    "best-fit": best_fit,
    "spread": spread,
    "fgd": fgd,
    "fgd-packed": fgd_packed,
    "vramsched": vramsched,
    "hot-path": hot_path,
}


def place_one(cap: Capacity, demand: Demand, choice: Choice, frag: FragIndex | None = None) -> None:
    res, node_row, overcommit = choice
    cap.apply(demand, res, node_row, overcommit=overcommit)
    if frag is not None:
        frag.refresh([node_row])


def choose(
    policy: str, cap: Capacity, demand: Demand, frag: FragIndex | None = None
) -> Choice | None:
    return POLICIES[policy](cap, demand, frag)


def _size(d: Demand) -> int:
    return d.gpu_count * (d.bytes_per_gpu if d.bytes_per_gpu is not None else 1 << 50)


def batch_order(demands: Sequence[Demand], *, smallest_first: bool = False) -> list[int]:
    """Greedy order for a batch: highest priority, then most GPUs, then largest memory first;
    `smallest_first`: highest priority, then fewest GPUs, then least memory (the order that places
    the most pods when not all fit: 481 of 500 where largest first placed 426, `make bench-planner`)."""
    sign = 1 if smallest_first else -1
    return sorted(
        range(len(demands)),
        key=lambda i: (
            -demands[i].priority,
            sign * demands[i].gpu_count,
            sign * _size(demands[i]),
            demands[i].pod.key,
        ),
    )


def greedy_batch(
    cap: Capacity,
    demands: Sequence[Demand],
    frag: FragIndex | None = None,
    *,
    apply: bool = False,
    order: str = "size",
    rule: str = "vramsched",
) -> dict[int, Choice]:
    """A one-pod `rule` (vramsched's by default) pod by pod, largest first (`order="size"`),
    smallest first ("small"), in queue order ("arrival": priority, then as given) or exactly as
    given ("given").
    Without `apply` the capacity is restored after."""
    placed: dict[int, Choice] = {}
    done: list[tuple[Demand, int]] = []
    try:
        if order in ("size", "small"):
            queue = batch_order(demands, smallest_first=order == "small")
        elif order == "given":
            queue = list(range(len(demands)))
        else:
            queue = sorted(
                range(len(demands)), key=lambda i: -demands[i].priority
            )  # stable: arrival within a priority
        pick = POLICIES[rule]
        for i in queue:
            ch = pick(cap, demands[i], frag)
            if ch is None:
                continue
            try:
                place_one(cap, demands[i], ch, frag)
            except LedgerError:
                continue
            placed[i] = ch
            done.append((demands[i], ch[1]))
    finally:
        if not apply:
            for d, n in reversed(done):
                cap.remove(d, n)
            if frag is not None and done:
                frag.refresh(sorted({n for _, n in done}))
    return placed
