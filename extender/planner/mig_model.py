"""The MIG geometry planner's CP-SAT model: GPU classes, demand types, variables and goals.

GPUs that are interchangeable for planning (same model and profile memory, same current layout,
same occupied slices) are merged into *classes*; for a class of n GPUs the solver picks how many
GPUs get each candidate geometry (``y``), how many of those actually host new pods (``u``), and
how many pods of each demand type go to each profile (``x``). A pod fits a slice if the slice's
memory is at least the pod's model memory and the profile is allowed for the pod; one pod per
slice. The goals (`GeometryModel.goals`) are solved by `mig_geometry` as `staged` stages.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ortools.sat.python import cp_model

from extender.mig import (
    MIB,
    Geometry,
    MigModel,
    enumerate_geometries,
    enumerate_geometries_containing,
    format_geometry,
    geometry,
    is_valid_geometry,
)
from extender.planner.mig_plan import Reconfigure

__all__ = [
    "CandidateFn",
    "DemandType",
    "GeometryModel",
    "GpuClass",
    "MigGpuState",
    "MigSliceState",
    "PendingPod",
    "build_classes",
    "build_model",
    "demand_types",
    "eligible",
    "node_freeze_reasons",
]


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
class GpuClass:
    """GPUs interchangeable for planning: same model and profile memory, same layout, same
    occupied slices (and pins), same freeze reason and candidate geometries."""

    key: tuple[object, ...]
    model: MigModel | None
    members: list[MigGpuState]
    candidates: list[Geometry]
    current: Geometry
    occupied: Counter[str]
    already_used: bool
    profile_bytes: dict[str, int]
    frozen_reason: str | None

    def free_cap(self, g: Geometry) -> dict[str, int]:
        return {n: k - self.occupied.get(n, 0) for n, k in g if k - self.occupied.get(n, 0) > 0}


@dataclass(frozen=True)
class DemandType:
    """Pending pods with the same model memory and allowed profiles."""

    bytes: int
    allowed: frozenset[str] | None
    pods: tuple[PendingPod, ...]


CandidateFn = Callable[[MigGpuState, MigModel], list[Geometry]]


def node_freeze_reasons(gpus: Sequence[MigGpuState], reconfigure: Reconfigure) -> dict[str, str]:
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


def build_classes(
    gpus: Sequence[MigGpuState],
    reconfigure: Reconfigure,
    candidates_for_free: CandidateFn,
    frozen: Mapping[str, str],
    warnings: list[str],
) -> list[GpuClass]:
    classes: dict[tuple[object, ...], GpuClass] = {}
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
            c = classes[key] = GpuClass(
                key, g.model, [], cands, current, occupied, g.is_occupied, pbytes, reason
            )
        c.members.append(g)
    for c in classes.values():
        c.members.sort(key=lambda m: (m.node, m.gpu_index))
    return sorted(classes.values(), key=lambda c: (c.members[0].node, c.members[0].gpu_index))


def demand_types(pending: Sequence[PendingPod]) -> list[DemandType]:
    groups: dict[tuple[int, frozenset[str] | None], list[PendingPod]] = defaultdict(list)
    for p in pending:
        groups[(int(p.model_memory_bytes), p.allowed_profiles)].append(p)
    # biggest first: those are the pods that are hardest to place
    keys = sorted(groups, key=lambda k: (-k[0], sorted(k[1]) if k[1] is not None else []))
    return [DemandType(k[0], k[1], tuple(groups[k])) for k in keys]


def eligible(c: GpuClass, profile: str, d: DemandType) -> bool:
    b = c.profile_bytes.get(profile)
    if b is None or b < d.bytes:
        return False
    return d.allowed is None or profile in d.allowed


@dataclass(frozen=True)
class GeometryModel:
    """The model as built. ``y[c][k]``: GPUs of class c given candidate geometry k (an int when the
    class has one candidate); ``u[c][k]``: of those, GPUs that host new pods (None: the class
    already runs pods, so its GPUs count as used anyway); ``x[c, profile, t]``: pods of demand
    type t on that profile. ``goals``: "pods" (maximised), "gpus", "reconfig", "waste" (minimised),
    each an expression or a constant int."""

    model: cp_model.CpModel
    classes: list[GpuClass]
    types: list[DemandType]
    y: list[list[cp_model.IntVar | int]]
    u: list[list[cp_model.IntVar] | None]
    x: dict[tuple[int, str, int], cp_model.IntVar]
    goals: dict[str, cp_model.LinearExprT]

    @property
    def variables(self) -> list[cp_model.IntVar]:
        """Every decision variable: the plan is read back from them and hinted in them."""
        out = [v for row in self.y for v in row if not isinstance(v, int)]
        out += [v for row in self.u if row for v in row]
        return out + list(self.x.values())


def build_model(
    classes: list[GpuClass], types: list[DemandType], reconfigure: Reconfigure
) -> GeometryModel:
    """Variables, capacity constraints and the four goals over ``classes`` and ``types``."""
    m = cp_model.CpModel()
    y: list[list[cp_model.IntVar | int]] = []
    u: list[list[cp_model.IntVar] | None] = []
    x: dict[tuple[int, str, int], cp_model.IntVar] = {}
    used_terms: list[cp_model.IntVar] = []
    reconf_terms: list[cp_model.LinearExprT] = []
    for ci, c in enumerate(classes):
        n = len(c.members)
        if len(c.candidates) == 1:
            yc: list[cp_model.IntVar | int] = [n]
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
        hosts: Sequence[cp_model.IntVar | int] = yc if (uci := u[ci]) is None else uci
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
                if eligible(c, p, d):
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
    return GeometryModel(
        m,
        classes,
        types,
        y,
        u,
        x,
        {"pods": pods_expr, "gpus": used_expr, "reconfig": reconf_expr, "waste": waste_expr},
    )
