"""A MIG geometry plan: per GPU its layout and new pods, per node its `nvidia.com/mig.config`.

The result of `mig_geometry.plan_mig_geometry` (and of the uniform-geometry baselines), built
complete in one step by `mig_geometry`, and how it is written out: node labels, a mig-parted
config and a table.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from extender.mig import MIB, Geometry, Placement, format_geometry, geometry_descriptor
from extender.planner.staged import CONSTANT, SKIPPED, StageOutcome

__all__ = [
    "MIG_CONFIG_LABEL",
    "GpuPlan",
    "MigPlan",
    "NodePlan",
    "PodPlacement",
    "Reconfigure",
    "config_name",
    "node_plans",
    "plan_summary_rows",
]

Reconfigure = Literal["whole-gpu", "free-slices"]
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
_LABEL_VALUE_MAX = 63


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


@dataclass(frozen=True)
class MigPlan:
    """Result of a planning run (also used for uniform-geometry baselines). `stages`: what each
    goal's solve found and proved, in order ("pods", then the tie-breakers)."""

    source: str  # "planner" or "uniform:<family>"
    reconfigure: Reconfigure
    gpus: list[GpuPlan]
    nodes: list[NodePlan]
    placements: list[PodPlacement]
    unplaced: list[tuple[str, str]]  # (pod key, reason)
    stages: tuple[StageOutcome, ...]
    pods_bound: int  # proven upper bound on pods placeable
    wall_seconds: float
    warnings: list[str] = field(default_factory=list)
    model_size: dict[str, int] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """CP-SAT status of the "most pods" stage."""
        return self.stage_status.get("pods", CONSTANT)

    @property
    def stage_status(self) -> dict[str, str]:
        return {s.name: s.status for s in self.stages}

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Wall seconds of each stage that ran a solve."""
        return {
            s.name: round(s.seconds, 3) for s in self.stages if s.status not in (CONSTANT, SKIPPED)
        }

    @property
    def stage_bounds(self) -> dict[str, tuple[int, int]]:
        """(value, proven bound) of each stage that found a solution."""
        return {
            s.name: (int(round(s.objective)), int(round(s.bound))) for s in self.stages if s.solved
        }

    @property
    def pods_placed(self) -> int:
        return len(self.placements)

    @property
    def gpus_used(self) -> int:
        """GPUs running any pod after the plan (existing or new)."""
        return len(self._used()[1])

    @property
    def new_gpus_used(self) -> int:
        """GPUs that had no pod and get one."""
        before, after = self._used()
        return len(after - before)

    @property
    def wasted_bytes(self) -> int:
        return sum(p.slice_bytes - p.pod_bytes for p in self.placements)

    @property
    def reconfigured_gpus(self) -> int:
        return sum(1 for gp in self.gpus if gp.changed)

    def _used(self) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
        before = {(gp.node, gp.gpu_index) for gp in self.gpus if gp.occupied}
        return before, before | {(gp.node, gp.gpu_index) for gp in self.gpus if gp.pods}

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

    def mig_parted_config(self) -> dict[str, Any]:
        configs: dict[str, list[dict[str, Any]]] = {}
        for n in self.nodes:
            if not (n.changed and n.mig_config):
                continue
            configs.setdefault(n.mig_config, _config_entries(n.devices))
        return {"version": "v1", "mig-configs": configs}

    def mig_parted_yaml(self) -> str:
        return yaml.safe_dump(self.mig_parted_config(), sort_keys=False, default_flow_style=False)


def _label_safe(name: str) -> bool:
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


def _config_entries(devices: Sequence[tuple[int, Geometry]]) -> list[dict[str, Any]]:
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


def node_plans(gpu_plans: Sequence[GpuPlan], frozen: Mapping[str, str]) -> list[NodePlan]:
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
