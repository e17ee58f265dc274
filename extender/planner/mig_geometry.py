"""MIG geometry planner: choose per-GPU MIG layouts so the most pending pods fit (CP-SAT, pure).

The model (`mig_model`): GPU classes, how many GPUs of a class get each candidate geometry, how
many pods of each demand type go to each profile. Objectives, strictly in this order (solved as
successive CP-SAT stages, each stage fixing the previous optimum): most pods placed; fewest GPUs used (GPUs that already run a
pod are free); fewest GPUs touched, i.e. reconfigured; least memory wasted (slice memory minus pod
memory, proven within 1%). Reconfiguration comes before waste because every relabel makes the
mig-manager pause the node's GPU operands, while spare slice memory still serves as KV cache;
``tie_breakers`` changes the order.

Occupied slices are never destroyed. ``reconfigure="whole-gpu"`` (default) keeps every GPU with
an occupied slice exactly as it is, because mig-parted clears *all* instances of a device whose
config changes (``SetMigConfig`` clears before creating) — the only safe reading for a plan that
is realised through ``nvidia.com/mig.config``. ``reconfigure="free-slices"`` lets the free part
of a partly occupied GPU be re-carved around the occupied instances; that needs a per-instance
tool (``nvidia-smi mig -cgi/-dgi``), and the plan says so in its warnings.

The steps live apart, as OR-Tools' examples keep them: building the model (`mig_model`), solving
its goals in order (the `staged` harness), reading the plan back (`mig_readback`) and the plan
itself (`mig_plan`); this module checks the input and runs them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from ortools.sat.python.cp_model import IntVar

from extender.mig import (
    Geometry,
    MigModel,
    enumerate_geometries,
    is_valid_geometry,
    uniform_geometry,
)
from extender.planner.mig_model import (
    CandidateFn,
    MigGpuState,
    MigSliceState,
    PendingPod,
    build_classes,
    build_model,
    demand_types,
    node_freeze_reasons,
)
from extender.planner.mig_plan import (
    MIG_CONFIG_LABEL,
    GpuPlan,
    MigPlan,
    NodePlan,
    PodPlacement,
    Reconfigure,
    config_name,
    plan_summary_rows,
)
from extender.planner.mig_readback import read_back
from extender.planner.staged import Settings, Stage, staged_solve

__all__ = [
    "GpuPlan",
    "MIG_CONFIG_LABEL",
    "MigGpuState",
    "MigPlan",
    "MigSliceState",
    "NodePlan",
    "PendingPod",
    "PodPlacement",
    "Reconfigure",
    "config_name",
    "evaluate_uniform",
    "plan_mig_geometry",
    "plan_summary_rows",
]

#: the goals that break ties between plans placing as many pods, in their default order
TIE_BREAKERS = ("gpus", "reconfig", "waste")


def _solve(
    gpus: Sequence[MigGpuState],
    pending: Sequence[PendingPod],
    *,
    source: str,
    candidates_for_free: CandidateFn,
    reconfigure: Reconfigure,
    time_limit_s: float,
    num_workers: int,
    seed: int,
    tie_breakers: Sequence[str] = TIE_BREAKERS,
    gap: float = 0.01,
) -> MigPlan:
    t0 = time.perf_counter()
    if reconfigure not in ("whole-gpu", "free-slices"):
        raise ValueError(f"reconfigure must be 'whole-gpu' or 'free-slices', got {reconfigure!r}")
    keys = [p.key for p in pending]
    if len(set(keys)) != len(keys):
        dup = sorted(k for k, n in Counter(keys).items() if n > 1)[:3]
        raise ValueError(f"pending pod keys must be unique; repeated: {', '.join(dup)}")
    seen = set()
    for g in gpus:
        if (g.node, g.gpu_index) in seen:
            raise ValueError(f"GPU {g.node}/{g.gpu_index} listed twice")
        seen.add((g.node, g.gpu_index))
    if sorted(tie_breakers) != sorted(TIE_BREAKERS):
        raise ValueError(
            f"tie_breakers must order {sorted(TIE_BREAKERS)}, got {list(tie_breakers)}"
        )

    # build
    warnings: list[str] = []
    frozen = node_freeze_reasons(gpus, reconfigure)
    classes = build_classes(gpus, reconfigure, candidates_for_free, frozen, warnings)
    types = demand_types(pending)
    gm = build_model(classes, types, reconfigure)

    # solve: the "most pods" stage gets 60% of the time, each later one an equal share of the rest;
    # pods and GPUs are exact, waste and reconfiguration are tie-breakers: close enough is fine
    order = ["pods", *tie_breakers]
    stages = [
        Stage(
            name,
            gm.goals[name],
            maximize=name == "pods",
            share=0.6 if si == 0 else 1 / (len(order) - si),
            skip_below=0.01,
            relative_gap=gap if name in ("waste", "reconfig") else 0.0,
        )
        for si, name in enumerate(order)
    ]
    result = staged_solve(
        gm.model,
        stages,
        t0 + max(0.05, time_limit_s),
        variables=gm.variables,
        settings=Settings(max(1, min(2, num_workers)), random_seed=seed),
    )
    if result.values is None:
        failed = result.stages[-1] if result.stages else None
        if failed is not None and failed.status != "CONSTANT":
            raise RuntimeError(
                f"CP-SAT found no solution in the '{failed.name}' stage: {failed.status}"
            )
        raise RuntimeError(f"CP-SAT found no feasible layout: {result.status}")
    values = result.values

    def val(v: IntVar | int) -> int:
        return v if isinstance(v, int) else values[v.index]

    # read back
    rb = read_back(gm, val, frozen, reconfigure)
    pods = result.outcome("pods")
    bound = int(pods.bound + 1e-6) if pods is not None and pods.solved else 0
    return MigPlan(
        source=source,
        reconfigure=reconfigure,
        gpus=rb.gpus,
        nodes=rb.nodes,
        placements=rb.placements,
        unplaced=rb.unplaced,
        stages=result.stages,
        pods_bound=max(bound, len(rb.placements)),
        wall_seconds=time.perf_counter() - t0,
        warnings=warnings + rb.warnings,
        model_size={
            "classes": len(classes),
            "demand_types": len(types),
            "variables": len(gm.model.proto.variables),
            "constraints": len(gm.model.proto.constraints),
        },
    )


# ---------------------------------------------------------------------------------------------
# Public entry points


def _planner_candidates(gpu: MigGpuState, model: MigModel) -> list[Geometry]:
    cands = enumerate_geometries(model)
    cur = gpu.current
    if cur not in cands and is_valid_geometry(model, cur):
        cands = cands + [cur]
    return cands


def plan_mig_geometry(
    gpus: Sequence[MigGpuState],
    pending: Sequence[PendingPod],
    *,
    reconfigure: Reconfigure = "whole-gpu",
    time_limit_s: float = 10.0,
    num_workers: int = 2,
    seed: int = 0,
    tie_breakers: Sequence[str] = TIE_BREAKERS,
) -> MigPlan:
    """Choose a geometry per GPU (maximal valid geometries, or the current one) for ``pending``.

    ``time_limit_s`` bounds the whole run; the "most pods" stage gets 60% of it. A stage that
    runs out of time keeps its best solution (status FEASIBLE) and later stages build on it.
    """
    return _solve(
        gpus,
        pending,
        source="planner",
        candidates_for_free=_planner_candidates,
        reconfigure=reconfigure,
        time_limit_s=time_limit_s,
        num_workers=num_workers,
        seed=seed,
        tie_breakers=tie_breakers,
    )


def evaluate_uniform(
    gpus: Sequence[MigGpuState],
    pending: Sequence[PendingPod],
    family: str,
    *,
    reconfigure: Reconfigure = "whole-gpu",
    time_limit_s: float = 10.0,
    num_workers: int = 2,
    seed: int = 0,
) -> MigPlan:
    """Same demand and rules, but every reconfigurable GPU gets ``family`` (e.g. ``all-balanced``).

    GPUs with occupied slices keep their layout (as the planner would); pods are then placed
    optimally, so the comparison isolates the choice of geometry.
    """

    def cands(gpu: MigGpuState, model: MigModel) -> list[Geometry]:
        return [uniform_geometry(model, family)]

    # In free-slices mode a uniform baseline still may not touch partly used GPUs.
    return _solve(
        gpus,
        pending,
        source=f"uniform:{family}",
        candidates_for_free=cands,
        reconfigure="whole-gpu" if reconfigure == "free-slices" else reconfigure,
        time_limit_s=time_limit_s,
        num_workers=num_workers,
        seed=seed,
    )
