"""MIG geometry planner: choose per-GPU MIG layouts so the most pending pods fit (CP-SAT, pure).

Model. GPUs that are interchangeable for planning (same model and profile memory, same current
layout, same occupied slices) are merged into *classes*; for a class of n GPUs the solver picks
how many GPUs get each candidate geometry (``y``), how many of those actually host new pods
(``u``), and how many pods of each demand type go to each profile (``x``). A pod fits a slice if
the slice's memory is at least the pod's model memory and the profile is allowed for the pod;
one pod per slice. Objectives, strictly in this order (solved as successive CP-SAT stages, each
stage fixing the previous optimum): most pods placed; fewest GPUs used (GPUs that already run a
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
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import yaml
from ortools.sat.python import cp_model

from extender.mig import (
    GIB,
    MIB,
    Geometry,
    MigModel,
    Placement,
    enumerate_geometries,
    enumerate_geometries_containing,
    format_geometry,
    geometry,
    geometry_descriptor,
    is_valid_geometry,
    place,
    uniform_geometry,
)

Reconfigure = Literal["whole-gpu", "free-slices"]
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
_LABEL_VALUE_MAX = 63


class MigSliceState(NamedTuple):
    """One existing MIG instance. ``occupied_bytes`` None means free."""

    profile: str
    occupied_bytes: int | None = None
    start: int | None = None  # memory slot it starts at, when known
    pod: str | None = None


@dataclass(frozen=True)
class MigGpuState:
    """What one physical MIG GPU looks like now."""

    node: str
    gpu_index: int
    model: MigModel | None  # None: GPU without a profile table; left alone
    slices: tuple[MigSliceState, ...] = ()
    product: str = ""
    layout_known: bool = True  # False: per-GPU layout was inferred from node-level counts
    frozen_reason: str | None = None  # caller-imposed: do not touch this GPU's node
    profile_memory: tuple[tuple[str, int], ...] = ()  # measured bytes per profile (labels)

    def __post_init__(self) -> None:
        object.__setattr__(self, "slices", tuple(MigSliceState(*s) for s in self.slices))
        if isinstance(self.profile_memory, Mapping):
            object.__setattr__(self, "profile_memory", tuple(sorted(self.profile_memory.items())))

    @property
    def current(self) -> Geometry:
        return geometry(s.profile for s in self.slices)

    @property
    def occupied(self) -> Geometry:
        return geometry(s.profile for s in self.slices if s.occupied_bytes is not None)

    @property
    def is_occupied(self) -> bool:
        return any(s.occupied_bytes is not None for s in self.slices)


@dataclass(frozen=True)
class PendingPod:
    """A pod waiting for one MIG slice with at least ``model_memory_bytes``."""

    key: str
    model_memory_bytes: int
    allowed_profiles: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.allowed_profiles is not None and not isinstance(self.allowed_profiles, frozenset):
            object.__setattr__(self, "allowed_profiles", frozenset(self.allowed_profiles))


@dataclass(frozen=True)
class PodPlacement:
    pod: str
    node: str
    gpu_index: int
    profile: str
    start: int | None
    slice_bytes: int
    pod_bytes: int


@dataclass(frozen=True)
class GpuPlan:
    node: str
    gpu_index: int
    model: str  # model name, or the product for GPUs without a table
    current: Geometry
    planned: Geometry
    occupied: Geometry
    placement: Placement | None
    pods: tuple[PodPlacement, ...]
    frozen_reason: str | None

    @property
    def changed(self) -> bool:
        return self.planned != self.current


@dataclass(frozen=True)
class NodePlan:
    node: str
    changed: bool
    mig_config: str | None  # value for nvidia.com/mig.config when changed
    devices: tuple[tuple[int, Geometry], ...]
    frozen_reason: str | None


@dataclass
class MigPlan:
    """Result of a planning run (also used for uniform-geometry baselines)."""

    source: str  # "planner" or "uniform:<family>"
    reconfigure: Reconfigure
    gpus: list[GpuPlan]
    nodes: list[NodePlan]
    placements: list[PodPlacement]
    unplaced: list[tuple[str, str]]  # (pod key, reason)
    status: str  # CP-SAT status of the "most pods" stage
    stage_status: dict[str, str]
    pods_placed: int
    pods_bound: int  # proven upper bound on pods placeable
    gpus_used: int  # GPUs running any pod after the plan (existing or new)
    new_gpus_used: int  # GPUs that had no pod and get one
    wasted_bytes: int
    reconfigured_gpus: int
    wall_seconds: float
    warnings: list[str] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stage_bounds: dict[str, tuple[int, int]] = field(default_factory=dict)  # (value, bound)
    model_size: dict[str, int] = field(default_factory=dict)

    @property
    def objective(self) -> dict[str, int]:
        return {
            "pods_placed": self.pods_placed,
            "new_gpus_used": self.new_gpus_used,
            "wasted_mib": self.wasted_bytes // MIB,
            "reconfigured_gpus": self.reconfigured_gpus,
        }

    def node_labels(self) -> dict[str, str]:
        """``nvidia.com/mig.config`` value per node that must change."""
        return {n.node: n.mig_config for n in self.nodes if n.changed and n.mig_config}

    def mig_parted_config(self) -> dict:
        configs: dict[str, list[dict]] = {}
        for n in self.nodes:
            if not (n.changed and n.mig_config):
                continue
            configs.setdefault(n.mig_config, _config_entries(n.devices))
        return {"version": "v1", "mig-configs": configs}

    def mig_parted_yaml(self) -> str:
        return yaml.safe_dump(self.mig_parted_config(), sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------


@dataclass
class _Class:
    key: tuple
    model: MigModel | None
    members: list[MigGpuState]
    candidates: list[Geometry]
    current: Geometry
    occupied: Counter
    already_used: bool
    profile_bytes: dict[str, int]
    frozen_reason: str | None

    def free_cap(self, g: Geometry) -> dict[str, int]:
        return {n: k - self.occupied.get(n, 0) for n, k in g if k - self.occupied.get(n, 0) > 0}


@dataclass(frozen=True)
class _DemandType:
    bytes: int
    allowed: frozenset[str] | None
    pods: tuple[PendingPod, ...]


CandidateFn = Callable[[MigGpuState, MigModel], list[Geometry]]


def _node_freeze_reasons(gpus: Sequence[MigGpuState], reconfigure: Reconfigure) -> dict[str, str]:
    reasons: dict[str, str] = {}
    for g in gpus:
        r = None
        if g.frozen_reason:
            r = g.frozen_reason
        elif g.model is None:
            r = f"no MIG profile table for {g.product or 'this GPU'}: labelled slices are fixed capacity"
        elif g.is_occupied and not g.layout_known:
            r = "per-GPU layout inferred from node-level labels and a slice is in use: relabelling could destroy it"
        elif (
            g.model is not None
            and g.slices
            and not is_valid_geometry(g.model, g.current)
            and g.is_occupied
        ):
            r = f"GPU {g.gpu_index} reports an invalid layout ({format_geometry(g.current)}) with a slice in use"
        if r and g.node not in reasons:
            reasons[g.node] = r
    return reasons


def _profile_bytes(g: MigGpuState) -> dict[str, int]:
    out: dict[str, int] = {}
    if g.model is not None:
        out.update({p.name: p.memory_bytes for p in g.model.profiles})
    out.update(dict(g.profile_memory))
    return out


def _build_classes(
    gpus: Sequence[MigGpuState],
    reconfigure: Reconfigure,
    candidates_for_free: CandidateFn,
    frozen: Mapping[str, str],
    warnings: list[str],
) -> list[_Class]:
    classes: dict[tuple, _Class] = {}
    for g in gpus:
        pbytes = _profile_bytes(g)
        current = g.current
        occupied = Counter(dict(g.occupied))
        reason = frozen.get(g.node)
        pins = tuple(
            sorted(
                (s.profile, s.start)
                for s in g.slices
                if s.occupied_bytes is not None and s.start is not None
            )
        )
        if reason is not None or (g.is_occupied and reconfigure == "whole-gpu"):
            cands = [current]
        elif g.is_occupied:  # free-slices mode
            assert g.model is not None
            if len(pins) == sum(occupied.values()):
                cands = enumerate_geometries(g.model, pinned=pins)
            else:
                cands = enumerate_geometries_containing(g.model, g.occupied)
            if current not in cands and is_valid_geometry(g.model, current):
                cands = cands + [current]
        else:
            assert g.model is not None
            cands = list(candidates_for_free(g, g.model))
            if not cands:
                cands = [current]
        if g.slices and any(n not in pbytes for n, _ in current):
            missing = sorted(n for n, _ in current if n not in pbytes)
            warnings.append(
                f"{g.node} GPU {g.gpu_index}: no memory figure for {', '.join(missing)}; those slices get no pods"
            )
        key = (
            g.model.name if g.model else f"product:{g.product}",
            tuple(sorted(pbytes.items())),
            current,
            tuple(sorted(occupied.items())),
            pins if reconfigure == "free-slices" else (),
            reason,
            tuple(cands),
        )
        c = classes.get(key)
        if c is None:
            c = classes[key] = _Class(
                key, g.model, [], cands, current, occupied, g.is_occupied, pbytes, reason
            )
        c.members.append(g)
    for c in classes.values():
        c.members.sort(key=lambda m: (m.node, m.gpu_index))
    return sorted(classes.values(), key=lambda c: (c.members[0].node, c.members[0].gpu_index))


def _demand_types(pending: Sequence[PendingPod]) -> list[_DemandType]:
    groups: dict[tuple, list[PendingPod]] = defaultdict(list)
    for p in pending:
        groups[(int(p.model_memory_bytes), p.allowed_profiles)].append(p)
    # biggest first: those are the pods that are hardest to place
    keys = sorted(groups, key=lambda k: (-k[0], sorted(k[1]) if k[1] is not None else []))
    return [_DemandType(k[0], k[1], tuple(groups[k])) for k in keys]


def _eligible(c: _Class, profile: str, d: _DemandType) -> bool:
    b = c.profile_bytes.get(profile)
    if b is None or b < d.bytes:
        return False
    return d.allowed is None or profile in d.allowed


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
    tie_breakers: Sequence[str] = ("gpus", "reconfig", "waste"),
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

    warnings: list[str] = []
    frozen = _node_freeze_reasons(gpus, reconfigure)
    classes = _build_classes(gpus, reconfigure, candidates_for_free, frozen, warnings)
    types = _demand_types(pending)

    m = cp_model.CpModel()
    y: list[list[cp_model.IntVar | int]] = []
    u: list[list[cp_model.IntVar | int] | None] = []
    x: dict[tuple[int, str, int], cp_model.IntVar] = {}
    used_terms: list = []
    reconf_terms: list = []
    for ci, c in enumerate(classes):
        n = len(c.members)
        if len(c.candidates) == 1:
            yc: list = [n]
        else:
            yc = [m.new_int_var(0, n, f"y{ci}_{k}") for k in range(len(c.candidates))]
            m.add(sum(yc) == n)
        y.append(yc)
        if c.already_used:
            u.append(None)
        else:
            uc = []
            for k, yk in enumerate(yc):
                uk = m.new_int_var(0, n, f"u{ci}_{k}")
                m.add(uk <= yk)
                uc.append(uk)
            u.append(uc)
            used_terms.extend(uc)
        if c.frozen_reason is None and not (c.already_used and reconfigure == "whole-gpu"):
            if c.current in c.candidates:  # otherwise every GPU of the class changes: a constant
                k = c.candidates.index(c.current)
                reconf_terms.append(n - yc[k])
        # capacity per profile
        hosts = u[ci] if u[ci] is not None else yc
        profiles = sorted({p for g in c.candidates for p in c.free_cap(g)})
        for p in profiles:
            xs = []
            cap_terms = []
            max_cap = 0
            for k, g in enumerate(c.candidates):
                f = c.free_cap(g).get(p, 0)
                if f:
                    cap_terms.append(f * hosts[k])
                    max_cap = max(max_cap, f * n)
            for di, d in enumerate(types):
                if _eligible(c, p, d):
                    v = m.new_int_var(0, min(len(d.pods), max_cap), f"x{ci}_{p}_{di}")
                    x[(ci, p, di)] = v
                    xs.append(v)
            if xs:
                m.add(sum(xs) <= sum(cap_terms))
    for di, d in enumerate(types):
        vs = [v for (ci, p, dj), v in x.items() if dj == di]
        if vs:
            m.add(sum(vs) <= len(d.pods))

    pods_expr = sum(x.values()) if x else 0
    used_expr = sum(used_terms) if used_terms else 0
    waste_expr = (
        sum(
            v * ((classes[ci].profile_bytes[p] - types[di].bytes) // MIB)
            for (ci, p, di), v in x.items()
        )
        if x
        else 0
    )
    reconf_expr = sum(reconf_terms) if reconf_terms else 0

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = max(1, min(2, num_workers))
    solver.parameters.random_seed = seed
    stage_status: dict[str, str] = {}
    stage_seconds: dict[str, float] = {}
    stage_bounds: dict[str, tuple[int, int]] = {}
    deadline = t0 + max(0.05, time_limit_s)
    bound = 0
    exprs = {"gpus": used_expr, "reconfig": reconf_expr, "waste": waste_expr}
    if sorted(tie_breakers) != sorted(exprs):
        raise ValueError(f"tie_breakers must order {sorted(exprs)}, got {list(tie_breakers)}")
    stages = [("pods", pods_expr, True)] + [(n, exprs[n], False) for n in tie_breakers]
    all_vars = [v for row in y for v in row if not isinstance(v, int)]
    all_vars += [v for row in u if row for v in row]
    all_vars += list(x.values())
    solved = False
    values: dict[int, int] = {}
    for si, (name, expr, maximize) in enumerate(stages):
        if isinstance(expr, int):
            stage_status[name] = "CONSTANT"
            continue
        left = deadline - time.perf_counter()
        if left <= 0.01 and solved:
            stage_status[name] = "SKIPPED (time limit)"
            break
        share = left / (len(stages) - si) if si > 0 else left * 0.6
        solver.parameters.max_time_in_seconds = max(0.05, share)
        # pods and GPUs are exact; waste and reconfiguration are tie-breakers, close enough is fine
        solver.parameters.relative_gap_limit = gap if name in ("waste", "reconfig") else 0.0
        (m.maximize if maximize else m.minimize)(expr)
        ts = time.perf_counter()
        st = solver.solve(m)
        stage_seconds[name] = round(time.perf_counter() - ts, 3)
        if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            stage_bounds[name] = (
                int(round(solver.objective_value)),
                int(round(solver.best_objective_bound)),
            )
        stage_status[name] = solver.status_name(st)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            if not solved:
                raise RuntimeError(
                    f"CP-SAT found no solution in the '{name}' stage: {solver.status_name(st)}"
                )
            break
        solved = True
        best = int(round(solver.objective_value))
        if name == "pods":
            bound = int(solver.best_objective_bound + 1e-6)
        m.add(expr >= best if maximize else expr <= best)
        m.clear_hints()
        for v in all_vars:
            m.add_hint(v, solver.value(v))
        values = {v.index: solver.value(v) for v in all_vars}

    if not solved:  # every objective was constant: any feasible assignment will do
        solver.parameters.max_time_in_seconds = max(0.05, deadline - time.perf_counter())
        st = solver.solve(m)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise RuntimeError(f"CP-SAT found no feasible layout: {solver.status_name(st)}")
        values = {v.index: solver.value(v) for v in all_vars}

    def val(v: cp_model.IntVar | int) -> int:
        return v if isinstance(v, int) else values[v.index]

    plan = _read_back(classes, types, y, u, x, val, frozen, reconfigure)
    plan.source = source
    plan.status = stage_status.get("pods", "CONSTANT")
    plan.stage_status = stage_status
    plan.stage_seconds = stage_seconds
    plan.stage_bounds = stage_bounds
    plan.model_size = {
        "classes": len(classes),
        "demand_types": len(types),
        "variables": len(m.proto.variables),
        "constraints": len(m.proto.constraints),
    }
    plan.pods_bound = max(bound, plan.pods_placed)
    plan.warnings = warnings + plan.warnings
    plan.wall_seconds = time.perf_counter() - t0
    return plan


def _read_back(classes, types, y, u, x, val, frozen, reconfigure: Reconfigure) -> MigPlan:
    gpu_plans: list[GpuPlan] = []
    placements: list[PodPlacement] = []
    remaining = [list(reversed(d.pods)) for d in types]  # pop() hands out pods in input order
    warnings: list[str] = []
    for ci, c in enumerate(classes):
        # geometry per member: used GPUs first within each geometry, members in (node, index) order
        slots: list[tuple[Geometry, bool]] = []
        for k, g in enumerate(c.candidates):
            yk = val(y[ci][k])
            uk = yk if u[ci] is None else val(u[ci][k])
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
    nodes = _node_plans(gpu_plans, frozen)
    pre_used = {(gp.node, gp.gpu_index) for gp in gpu_plans if gp.occupied}
    now_used = pre_used | {(gp.node, gp.gpu_index) for gp in gpu_plans if gp.pods}
    if reconfigure == "free-slices" and any(gp.changed and gp.occupied for gp in gpu_plans):
        warnings.append(
            "free-slices mode re-carves partly used GPUs; mig-parted clears every instance of a device whose "
            "config changes, so apply those GPUs with per-instance nvidia-smi mig -cgi/-dgi, not mig-parted"
        )
    return MigPlan(
        source="",
        reconfigure=reconfigure,
        gpus=gpu_plans,
        nodes=nodes,
        placements=sorted(placements, key=lambda p: p.pod),
        unplaced=unplaced,
        status="",
        stage_status={},
        pods_placed=len(placements),
        pods_bound=0,
        gpus_used=len(now_used),
        new_gpus_used=len(now_used - pre_used),
        wasted_bytes=sum(p.slice_bytes - p.pod_bytes for p in placements),
        reconfigured_gpus=sum(1 for gp in gpu_plans if gp.changed),
        wall_seconds=0.0,
        warnings=warnings,
    )


def _free_slices(
    gpu: MigGpuState, g: Geometry, c: _Class
) -> tuple[dict[str, list[int | None]], Placement | None]:
    """Free instances (profile -> start slots) of ``gpu`` once it has geometry ``g``."""
    out: dict[str, list[int | None]] = defaultdict(list)
    if g == gpu.current:
        for s in gpu.slices:
            if s.occupied_bytes is None:
                out[s.profile].append(s.start)
        pl = None
        if gpu.model is not None and all(s.start is not None for s in gpu.slices):
            pl = tuple(
                sorted(((s.profile, s.start) for s in gpu.slices), key=lambda t: (t[1], t[0]))
            )
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
    for n, s in pl:
        if pinned_set[(n, s)]:
            pinned_set[(n, s)] -= 1
            continue
        if unpinned_occ[n]:
            unpinned_occ[n] -= 1
            continue
        out[n].append(s)
    return dict(out), pl


def _unplaced_reason(d: _DemandType, classes: Sequence[_Class]) -> str:
    need = f"{d.bytes / GIB:.1f} GiB"
    fits = False
    largest = 0
    for c in classes:
        for g in c.candidates:
            for p in c.free_cap(g):
                largest = max(largest, c.profile_bytes.get(p, 0))
                if _eligible(c, p, d):
                    fits = True
    if not fits:
        allowed = (
            f" among allowed profiles {', '.join(sorted(d.allowed))}"
            if d.allowed is not None
            else ""
        )
        return f"needs {need}: no MIG slice that can be planned is large enough{allowed} (largest {largest / GIB:.1f} GiB)"
    return f"needs {need}: not enough suitable MIG slices left"


def _label_safe(name: str) -> bool:
    import re

    return (
        len(name) <= _LABEL_VALUE_MAX
        and re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", name) is not None
    )


def config_name(devices: Sequence[tuple[int, Geometry]]) -> str:
    """mig-parted config name for a node: descriptive when all GPUs share a geometry, hashed otherwise."""
    geos = {g for _, g in devices}
    if len(geos) == 1:
        name = "vramsched-" + geometry_descriptor(next(iter(geos)))
        if _label_safe(name):
            return name
        digest = hashlib.sha1(repr(sorted(geos)).encode()).hexdigest()[:10]
        return f"vramsched-uniform-{digest}"
    digest = hashlib.sha1(repr(sorted(devices)).encode()).hexdigest()[:10]
    return f"vramsched-mixed-{digest}"


def _config_entries(devices: Sequence[tuple[int, Geometry]]) -> list[dict]:
    by_geo: dict[Geometry, list[int]] = defaultdict(list)
    for i, g in devices:
        by_geo[g].append(i)
    if len(by_geo) == 1:
        g = next(iter(by_geo))
        return [{"devices": "all", "mig-enabled": True, "mig-devices": dict(g)}]
    entries = []
    for g, idx in sorted(by_geo.items(), key=lambda kv: min(kv[1])):
        entries.append({"devices": sorted(idx), "mig-enabled": True, "mig-devices": dict(g)})
    return entries


def _node_plans(gpu_plans: Sequence[GpuPlan], frozen: Mapping[str, str]) -> list[NodePlan]:
    by_node: dict[str, list[GpuPlan]] = defaultdict(list)
    for gp in gpu_plans:
        by_node[gp.node].append(gp)
    out = []
    for node in sorted(by_node):
        gps = sorted(by_node[node], key=lambda gp: gp.gpu_index)
        devices = tuple((gp.gpu_index, gp.planned) for gp in gps)
        changed = any(gp.changed for gp in gps)
        out.append(
            NodePlan(
                node, changed, config_name(devices) if changed else None, devices, frozen.get(node)
            )
        )
    return out


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
    tie_breakers: Sequence[str] = ("gpus", "reconfig", "waste"),
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


def plan_summary_rows(plan: MigPlan) -> list[dict[str, str]]:
    """One row per node for tables: node, model, change, per-GPU geometries, pods placed."""
    by_node: dict[str, list[GpuPlan]] = defaultdict(list)
    for gp in plan.gpus:
        by_node[gp.node].append(gp)
    rows = []
    for n in plan.nodes:
        gps = by_node[n.node]
        geos = Counter(gp.planned for gp in gps)
        layout = "; ".join(
            (f"{k}x[{format_geometry(g)}]" if k > 1 else f"[{format_geometry(g)}]")
            for g, k in sorted(geos.items(), key=lambda kv: -kv[1])
        )
        rows.append(
            {
                "node": n.node,
                "model": gps[0].model if gps else "",
                "action": "frozen" if n.frozen_reason else ("relabel" if n.changed else "keep"),
                "mig.config": n.mig_config or "-",
                "reconfigured": str(sum(1 for gp in gps if gp.changed)),
                "new pods": str(sum(len(gp.pods) for gp in gps)),
                "geometry": layout,
                "note": n.frozen_reason or "",
            }
        )
    return rows


__all__ = [
    "GpuPlan",
    "MIG_CONFIG_LABEL",
    "MigGpuState",
    "MigPlan",
    "MigSliceState",
    "NodePlan",
    "PendingPod",
    "PodPlacement",
    "config_name",
    "evaluate_uniform",
    "plan_mig_geometry",
    "plan_summary_rows",
]
