"""Reading a MIG geometry plan back from the model's solution.

The model counts GPUs per geometry and pods per profile and demand type; here the counts become
one geometry per GPU, the free instances (with their start slots) it offers, and one slice per
pod. Occupied instances are kept where they are (pinned); a pod that gets nothing is given a
reason.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from extender.mig import GIB, Geometry, Placement, format_geometry, place
from extender.planner.mig_model import (
    DemandType,
    GeometryModel,
    GpuClass,
    MigGpuState,
    eligible,
)
from extender.planner.mig_plan import GpuPlan, NodePlan, PodPlacement, Reconfigure, node_plans

__all__ = ["Readback", "read_back"]


@dataclass(frozen=True)
class Readback:
    """The plan's parts: per GPU and per node (sorted), pods placed (by pod key), pods left out
    with a reason (sorted), and warnings about how to apply it."""

    gpus: list[GpuPlan]
    nodes: list[NodePlan]
    placements: list[PodPlacement]
    unplaced: list[tuple[str, str]]
    warnings: list[str]


def read_back(
    gm: GeometryModel,
    val: Callable[[cp_model.IntVar | int], int],
    frozen: Mapping[str, str],
    reconfigure: Reconfigure,
) -> Readback:
    """The plan in the solution ``val`` gives: geometries per GPU (hosting GPUs first within a
    geometry, members in (node, index) order), pods handed out in input order per demand type."""
    classes, types, y, u, x = gm.classes, gm.types, gm.y, gm.u, gm.x
    gpu_plans: list[GpuPlan] = []
    placements: list[PodPlacement] = []
    remaining = [list(reversed(d.pods)) for d in types]  # pop() hands out pods in input order
    warnings: list[str] = []
    for ci, c in enumerate(classes):
        # geometry per member: used GPUs first within each geometry, members in (node, index) order
        slots: list[tuple[Geometry, bool]] = []
        for k, g in enumerate(c.candidates):
            yk = val(y[ci][k])
            uc = u[ci]
            uk = yk if uc is None else val(uc[k])
            slots += [(g, True)] * uk + [(g, False)] * (yk - uk)
        assert len(slots) == len(c.members), (len(slots), len(c.members))
        member_geo = list(zip(c.members, slots))
        # free slices per member with their start slots
        free_slices: list[dict[str, list[int | None]]] = []
        member_place: list[Placement | None] = []
        for gpu, (g, _) in member_geo:
            fs, pl = _free_slices(gpu, g, c)
            free_slices.append(fs)
            member_place.append(pl)
        pods_on: list[list[PodPlacement]] = [[] for _ in c.members]
        for p in sorted({p for (cj, p, _) in x if cj == ci}):
            for di, d in enumerate(types):
                v = x.get((ci, p, di))
                if v is None:
                    continue
                count = val(v)
                for mi, (gpu, (_g, host)) in enumerate(member_geo):
                    if count == 0:
                        break
                    if not host:
                        continue
                    starts = free_slices[mi].get(p, [])
                    while count and starts:
                        pod = remaining[di].pop()
                        s = starts.pop(0)
                        pp = PodPlacement(
                            pod.key, gpu.node, gpu.gpu_index, p, s, c.profile_bytes[p], d.bytes
                        )
                        pods_on[mi].append(pp)
                        placements.append(pp)
                        count -= 1
                if count:
                    raise AssertionError(
                        f"read-back could not place {count} pods of {p} in class {ci}"
                    )
        for mi, (gpu, (g, _)) in enumerate(member_geo):
            gpu_plans.append(
                GpuPlan(
                    gpu.node,
                    gpu.gpu_index,
                    gpu.model.name if gpu.model else gpu.product,
                    c.current,
                    g,
                    gpu.occupied,
                    member_place[mi],
                    tuple(pods_on[mi]),
                    frozen.get(gpu.node),
                )
            )
    gpu_plans.sort(key=lambda gp: (gp.node, gp.gpu_index))
    unplaced = []
    for di, d in enumerate(types):
        for pod in remaining[di]:
            unplaced.append((pod.key, _unplaced_reason(d, classes)))
    unplaced.sort()
    if reconfigure == "free-slices" and any(gp.changed and gp.occupied for gp in gpu_plans):
        warnings.append(
            "free-slices mode re-carves partly used GPUs; mig-parted clears every instance of a device whose "
            "config changes, so apply those GPUs with per-instance nvidia-smi mig -cgi/-dgi, not mig-parted"
        )
    return Readback(
        gpu_plans,
        node_plans(gpu_plans, frozen),
        sorted(placements, key=lambda p: p.pod),
        unplaced,
        warnings,
    )


def _free_slices(
    gpu: MigGpuState, g: Geometry, c: GpuClass
) -> tuple[dict[str, list[int | None]], Placement | None]:
    """Free instances (profile -> start slots) of ``gpu`` once it has geometry ``g``."""
    out: dict[str, list[int | None]] = defaultdict(list)
    if g == gpu.current:
        for s in gpu.slices:
            if s.occupied_bytes is None:
                out[s.profile].append(s.start)
        pl: Placement | None = None
        starts = [(s.profile, s.start) for s in gpu.slices if s.start is not None]
        if gpu.model is not None and len(starts) == len(gpu.slices):
            pl = tuple(sorted(starts, key=lambda t: (t[1], t[0])))
        elif gpu.model is not None:
            pl = place(gpu.model, g)
        return dict(out), pl
    assert gpu.model is not None
    pins = [
        (s.profile, s.start)
        for s in gpu.slices
        if s.occupied_bytes is not None and s.start is not None
    ]
    unpinned_occ = Counter(
        s.profile for s in gpu.slices if s.occupied_bytes is not None and s.start is None
    )
    extra = Counter(dict(g))
    for n, _ in pins:
        extra[n] -= 1
    pl = place(gpu.model, +extra, pinned=pins)
    if pl is None:
        raise AssertionError(
            f"planned geometry {format_geometry(g)} cannot be placed on {gpu.node}/{gpu.gpu_index}"
        )
    pinned_set = Counter(pins)
    for n, start in pl:
        if pinned_set[(n, start)]:
            pinned_set[(n, start)] -= 1
            continue
        if unpinned_occ[n]:
            unpinned_occ[n] -= 1
            continue
        out[n].append(start)
    return dict(out), pl


def _unplaced_reason(d: DemandType, classes: Sequence[GpuClass]) -> str:
    need = f"{d.bytes / GIB:.1f} GiB"
    fits = False
    largest = 0
    for c in classes:
        for g in c.candidates:
            for p in c.free_cap(g):
                largest = max(largest, c.profile_bytes.get(p, 0))
                if eligible(c, p, d):
                    fits = True
    if not fits:
        allowed = (
            f" among allowed profiles {', '.join(sorted(d.allowed))}"
            if d.allowed is not None
            else ""
        )
        return f"needs {need}: no MIG slice that can be planned is large enough{allowed} (largest {largest / GIB:.1f} GiB)"
    return f"needs {need}: not enough suitable MIG slices left"
