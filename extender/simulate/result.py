"""What one policy's replay measured (`engine.run_policy`), as `vramsched simulate --json` prints
it; the fields the bounds read afterwards stay out of the JSON."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from extender.demand import Demand
from extender.simulate.budget_bound import BudgetBound, StateSnapshot

__all__ = ["PolicyResult"]


@dataclass
class PolicyResult:
    policy: str
    placed: int = 0
    failed: int = 0
    allocatedMemoryBytes: int = 0
    requestedMemoryBytes: int = 0
    capacityMemoryBytes: int = 0
    gpusInUse: int = 0
    gpusFree: int = 0
    gpusTotal: int = 0
    overcommittedGpus: int = 0
    #: the most GPUs overcommitted at once after any batch (with churn, pods that overcommitted
    #: a GPU may have left by the end)
    overcommittedGpusPeak: int = 0
    overcommittedBytes: int = 0
    fragmentationBytes: float = 0.0
    fragmentationRate: float = 0.0
    #: memory nobody can use at the end: on every GPU, the free memory its free replicas cannot
    #: reach, each taking at most the per-pod cap (the rest of an exclusive GPU or MIG slice in
    #: use, a time-sliced GPU's memory behind its last replica, the unused rest of MPS shares)
    strandedBytes: int = 0
    failedGpuPods: int = 0
    seconds: float = 0.0
    batches: int = 0
    solverBatches: int = 0
    solverRuns: int = 0
    solverOptimal: int = 0
    solverImproved: int = 0
    invariantViolations: int = 0
    gpusFreeMean: float = 0.0
    #: fully free GPUs weighted by the share of the workload's GPU pods that could start on each
    #: now (`usable_free_gpus`), at the end of the replay
    gpusFreeUsable: float = 0.0
    gpusInUsePeak: int = 0
    #: batches placed in full before the first one in which a pod that fits the starting cluster
    #: found no place (all of them if none), and the pods that arrived in those batches: how far
    #: the replay stays in the regime where every pod fits
    allFitBatches: int = 0
    allFitArrivals: int = 0
    #: pods moved by repacking (`planner+repack`; 0 for the others), the budget they were spent
    #: from (a fraction of the pods placed), the caps per GPU and per pod placed (None: no cap
    #: beyond the one per GPU), repack searches run,
    #: pods they placed, pods that failed without a search (`RepackSkips`), searches that found
    #: no plan without proving that none exists (they stopped at their neighbourhood or time
    #: limit: a wider search might find one), and the searches' wall time
    moves: int = 0
    moveBudget: float = 0.0
    movesPerGpu: int = 0
    movesPerPod: int | None = None
    repackSearches: int = 0
    repackPlaced: int = 0
    repackSkipped: int = 0
    repackUnproven: int = 0
    repackSeconds: float = 0.0
    #: per GPU request ("1 x 810Mi", "8 x whole", `request_label`), what became of the GPU
    #: pods that found no place: `blocked` in all, `budgetSpent` (no move left to spend),
    #: `skipped` (`RepackSkips`, or it fits no node of the empty cluster), `searched`, `placed`
    #: by a plan, the `moves` those plans made
    repackByRequest: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the planner's charge per idle GPU a placement opens (`--open-gpu-cost`; 0 for the others)
    openGpuCost: float = 0.0
    #: (pods arrived, GPUs fully free) after each batch; not in the JSON (one pair per batch)
    freeSeries: list[tuple[int, int]] = field(default_factory=list, repr=False)
    #: the pods placed when a GPU pod first found no place (before any repack), without churn;
    #: they stay to the end, so `bound.allocation_bound(..., placed=...)` bounds this policy's
    #: result and any policy's that agrees with it up to there (`planner+repack` at every
    #: budget agrees with `planner`). Not in the JSON.
    placedAtFirstFailure: list[Demand] | None = field(default=None, repr=False)
    #: the state then, pod for pod (`budget_bound.snapshot`): what `budget_bound` starts from.
    #: Not in the JSON.
    stateAtFirstFailure: StateSnapshot | None = field(default=None, repr=False)
    #: `bound_within_budget` of that state, by move budget, once each (the bounds' JSON and a
    #: budget curve ask for the same one). Not in the JSON.
    budgetBounds: dict[float, BudgetBound] = field(default_factory=dict, repr=False)
    #: the pods placed at the end (without churn): `allocation_bound(..., placed=...)` is then
    #: the most any number of moves could make of this end state. Not in the JSON.
    placedAtEnd: list[Demand] | None = field(default=None, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        skip = (
            "policy",
            "freeSeries",
            "placedAtFirstFailure",
            "stateAtFirstFailure",
            "budgetBounds",
            "placedAtEnd",
            "extra",
        )
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        d.update(self.extra)
        return d
