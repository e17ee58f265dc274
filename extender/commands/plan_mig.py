"""``vramsched plan-mig``: plan MIG geometries for a cluster snapshot (dry-run; prints table + YAML).

The cluster file is what ``kubectl get nodes,pods -A -o yaml`` (or ``-o json``) prints, read by
``extender.source_file`` as ``vramsched serve --cluster`` reads it; each node's MIG labels are read
by ``extender.inventory.read_mig_labels`` and the pods' annotations are ``extender.demand``'s.
What is left here is the planner's view: per-GPU layouts and their occupancy, pending MIG demand.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, TextIO

import yaml

from extender import mig
from extender.assignment import AssignmentError, decode_assignment
from extender.commands.argtypes import number, output_file, whole
from extender.demand import (
    ASSIGNMENT,
    MODEL_MEMORY,
    DemandError,
    container_requests,
    pod_ref,
    pod_requests,
)
from extender.inventory import GPU_RESOURCE, read_mig_labels
from extender.planner.mig_geometry import (
    MIG_CONFIG_LABEL,
    MigGpuState,
    MigPlan,
    MigSliceState,
    PendingPod,
    evaluate_uniform,
    plan_mig_geometry,
    plan_summary_rows,
)
from extender.quantity import QuantityError, parse_quantity
from extender.quantity import parse_bytes as _parse_bytes
from extender.source_file import ClusterFileError, read_cluster_file

# ---------------------------------------------------------------------------------------------
# the cluster as the MIG planner sees it


def parse_bytes(q: object) -> int:
    """Kubernetes quantity (``16Gi``) -> bytes, rounded up (zero allowed: "no memory stated")."""
    return _parse_bytes(q, allow_zero=True)


@dataclass
class ClusterSnapshot:
    gpus: list[MigGpuState]
    pending: list[PendingPod]
    notes: list[str] = field(default_factory=list)  # nodes left out, and why


def _pod_key(pod: dict) -> str:
    md = pod.get("metadata") or {}
    return f"{md.get('namespace', 'default')}/{md.get('name', '?')}"


def _device_count(resource: str, value: Any) -> int:
    """A device request read as a Kubernetes quantity, as the scheduler's demand reads it (so
    `1.0` and `1e1` count, `1_6` and other scripts' digits do not), whole and not negative."""
    try:
        q = parse_quantity(value)
    except QuantityError:
        q = Fraction(-1)
    if q.denominator != 1 or q < 0:
        raise ValueError(f"{resource} request {value!r} is not a device count")
    return int(q)


def _device_requests(pod: dict) -> dict[str, int]:
    """The pod's GPU and MIG device requests as the scheduler's demand counts them
    (`demand.pod_requests`: sidecars summed with the app containers, plain init containers
    beside the sidecars before them); each container's value is checked first, so a bad one
    is named as written."""
    spec = pod.get("spec") or {}
    for group in ("initContainers", "containers"):
        for c in spec.get(group) or []:
            for r, v in container_requests(c).items():
                if r == GPU_RESOURCE or mig.profile_from_resource(r) is not None:
                    _device_count(r, v)
    try:
        total = pod_requests(spec)
    except (QuantityError, DemandError) as exc:
        raise ValueError(str(exc)) from None
    return {
        r: int(v)
        for r, v in total.items()
        if r == GPU_RESOURCE or mig.profile_from_resource(r) is not None
    }


def _mig_requests(pod: dict) -> Counter:
    c: Counter = Counter()
    for r, n in _device_requests(pod).items():
        p = mig.profile_from_resource(r)
        if p is not None and n:
            c[p] += n
    return c


def _gpu_requests(pod: dict) -> int:
    return _device_requests(pod).get(GPU_RESOURCE, 0)


def _pending_pod(pod: dict) -> PendingPod | None:
    """A pending pod as MIG demand: one slice with its model memory.

    A pod that requests ``nvidia.com/mig-<profile>`` may only use that profile; one that
    requests ``nvidia.com/gpu`` (or nothing) may use any profile that is large enough.
    Raises ValueError for pods a single MIG slice cannot serve.
    """
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    reqs = _mig_requests(pod)
    mem = ann.get(MODEL_MEMORY)
    if mem is None and not reqs:
        return None
    if sum(reqs.values()) > 1 or len(reqs) > 1 or _gpu_requests(pod) > 1:
        raise ValueError(
            "asks for several GPUs or MIG devices; a MIG slice serves one pod on one device"
        )
    allowed = frozenset(reqs) if reqs else None
    return PendingPod(_pod_key(pod), parse_bytes(mem) if mem is not None else 0, allowed)


def _is_pending(pod: dict) -> bool:
    spec = pod.get("spec") or {}
    phase = (pod.get("status") or {}).get("phase", "Pending")
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    return not spec.get("nodeName") and phase == "Pending" and ASSIGNMENT not in ann


def _node_states(node: dict, pods: list[dict], notes: list[str]) -> list[MigGpuState]:
    md = node.get("metadata") or {}
    name = md.get("name", "?")
    try:
        found = read_mig_labels(md.get("labels") or {})
    except ValueError as e:
        raise ValueError(f"node {name}: {e}") from None
    if found is None:
        return []  # not a MIG node
    product, strategy = found.product, found.strategy
    counts, mem = dict(found.counts), dict(found.memory)
    model = mig.model_for_product(product)
    frozen: str | None = None
    if strategy == "single":
        # gpu.count counts MIG devices; one profile everywhere. Layout changes would have to
        # stay single-profile per node, so the planner leaves these nodes alone.
        prof = found.single_profile
        if model is None or prof is None:
            notes.append(
                f"{name}: mig.strategy=single with product {product!r}: not understood, skipped"
            )
            return []
        per_gpu = mig.max_uniform_count(model, prof)
        counts = {prof: found.gpu_count}
        gpu_count = -(-found.gpu_count // per_gpu)
        frozen = "mig.strategy=single: layouts must stay single-profile; switch the node to mixed to plan it"
    else:
        gpu_count = found.gpu_count
    if not counts:
        notes.append(
            f"{name}: MIG strategy {strategy} but no MIG slices labelled (MIG disabled or empty), skipped"
        )
        return []

    # occupancy from vramsched assignments; pods holding MIG slices without one make the node opaque
    occupied: dict[int, list[tuple[str, int, str]]] = defaultdict(list)
    seen_devices: set[str] = set()  # a time-sliced MIG device may be named by several pods
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        ann = (pod.get("metadata") or {}).get("annotations") or {}
        raw = ann.get(ASSIGNMENT)
        on_node = (pod.get("spec") or {}).get("nodeName") == name
        if raw is None:
            try:
                holds_slices = on_node and bool(_mig_requests(pod))
            except ValueError as e:
                raise ValueError(f"pod {_pod_key(pod)}: {e}") from None
            if holds_slices:
                frozen = (
                    frozen or f"pod {_pod_key(pod)} holds MIG slices without a vramsched assignment"
                )
            continue
        try:
            res = decode_assignment(pod_ref(pod), ann)
        except (AssignmentError, ValueError) as e:
            if on_node:
                frozen = frozen or f"pod {_pod_key(pod)}: {e}"
            continue
        if res is None or res.node != name:
            continue
        for dev, per in zip(res.device_ids, res.bytes_per_device):
            parts = str(dev).split(":")
            if len(parts) != 3 or not parts[0].isdecimal() or parts[1] not in counts:
                frozen = (
                    frozen
                    or f"pod {_pod_key(pod)} assignment device {dev!r} does not match the node's MIG slices"
                )
                continue
            if dev in seen_devices:
                continue
            seen_devices.add(dev)
            occupied[int(parts[0])].append((parts[1], per, _pod_key(pod)))

    if model is None:
        model_ok = False
    else:
        unknown = [p for p in counts if not model.has_profile(p)]
        model_ok = not unknown
        if unknown:
            notes.append(
                f"{name}: profiles {unknown} are not in the {model.name} table; treated as an unknown GPU"
            )
    if model_ok:
        assert model is not None
        model = model.with_memory({p: b for p, b in mem.items() if model.has_profile(p)})

    # per-GPU layouts
    layouts: list[list[str]] | None = None
    layout_known = gpu_count == 1
    if model_ok and model is not None:  # (model_ok says it is not None)
        cfg, state = found.config, found.config_state
        g = mig.geometry_for_config_name(model, cfg) if cfg and state == "success" else None
        if (
            g is not None
            and all(k * gpu_count == counts.get(n, 0) for n, k in g)
            and sum(k for _, k in g) * gpu_count == sum(counts.values())
        ):
            layouts = [[n for n, k in g for _ in range(k)] for _ in range(gpu_count)]
            layout_known = True
        else:
            required = {i: Counter(p for p, _, _ in occ) for i, occ in occupied.items()}
            try:
                layouts = mig.infer_gpu_layouts(model, gpu_count, counts, required)
            except mig.LayoutInferenceError as e:
                notes.append(f"{name}: {e}; skipped")
                return []
    else:
        # unknown GPU: spread the labelled slices round-robin just to account capacity
        layouts = [[] for _ in range(max(gpu_count, 1))]
        i = 0
        for p in sorted(counts):
            for _ in range(counts[p]):
                layouts[i % len(layouts)].append(p)
                i += 1
        required_ok = all(
            Counter(p for p, _, _ in occupied.get(j, [])) <= Counter(layouts[j])
            for j in range(len(layouts))
        )
        if not required_ok:
            # keep the capacity accounting honest: move assigned slices where the pods say they are
            layouts = [[p for p, _, _ in occupied.get(j, [])] for j in range(len(layouts))]
            rest = Counter(counts) - sum((Counter(ls) for ls in layouts), Counter())
            for j, p in enumerate(sorted(rest.elements())):
                layouts[j % len(layouts)].append(p)

    states = []
    for i, names in enumerate(layouts):
        occ = list(occupied.get(i, []))
        slices = []
        for p in names:
            hit = next((o for o in occ if o[0] == p), None)
            if hit is not None:
                occ.remove(hit)
                slices.append(MigSliceState(p, hit[1], None, hit[2]))
            else:
                slices.append(MigSliceState(p))
        if occ:
            frozen = frozen or f"GPU {i}: assignments name slices the labels do not show"
        states.append(
            MigGpuState(
                node=name,
                gpu_index=i,
                model=model if model_ok else None,
                slices=tuple(slices),
                product=product,
                layout_known=layout_known,
                frozen_reason=frozen,
                profile_memory=tuple(sorted(mem.items())) if not model_ok else (),
            )
        )
    if frozen:
        states = [replace(s, frozen_reason=frozen) for s in states]
    return states


def read_cluster(cluster: Path, pending: Path | None = None) -> ClusterSnapshot:
    objs = [dict(o) for o in read_cluster_file(cluster)]
    nodes = [o for o in objs if o.get("kind") == "Node"]
    pods = [o for o in objs if o.get("kind") == "Pod"]
    notes: list[str] = []
    gpus: list[MigGpuState] = []
    for n in sorted(nodes, key=lambda n: (n.get("metadata") or {}).get("name", "")):
        gpus.extend(_node_states(n, pods, notes))
    if pending is not None:
        src = [dict(o) for o in read_cluster_file(pending) if o.get("kind") == "Pod"]
    else:
        src = [p for p in pods if _is_pending(p)]
    pend = []
    for p in src:
        try:
            pp = _pending_pod(p)
        except (ValueError, QuantityError) as e:
            notes.append(f"pod {_pod_key(p)}: {e}; ignored")
            continue
        if pp is not None:
            pend.append(pp)
    return ClusterSnapshot(gpus, pend, notes)


# ---------------------------------------------------------------------------------------------
# output


def format_table(rows: list[dict[str, str]], columns: list[str]) -> str:
    widths = {c: max([len(c)] + [len(r.get(c, "")) for r in rows]) for c in columns}
    line = lambda r: "  ".join(r.get(c, "").ljust(widths[c]) for c in columns).rstrip()  # noqa: E731
    return "\n".join([line({c: c.upper() for c in columns}), *(line(r) for r in rows)])


def _gib(b: int) -> str:
    return f"{b / mig.GIB:.1f} GiB"


def print_plan(
    plan: MigPlan, snap: ClusterSnapshot, out: TextIO, uniform: list[MigPlan] | None = None
) -> None:
    rows = plan_summary_rows(plan)
    out.write(
        format_table(
            rows,
            [
                "node",
                "model",
                "action",
                "mig.config",
                "reconfigured",
                "new pods",
                "geometry",
                "note",
            ],
        )
    )
    out.write("\n\n")
    total = len(snap.pending)
    out.write(
        f"pods placed: {plan.pods_placed}/{total} (upper bound {plan.pods_bound}, {plan.status}); "
        f"MIG GPUs: {len(plan.gpus)}, in use after plan: {plan.gpus_used} (+{plan.new_gpus_used}); "
        f"reconfigured GPUs: {plan.reconfigured_gpus}; wasted: {_gib(plan.wasted_bytes)}; "
        f"solve: {plan.wall_seconds:.2f}s\n"
    )
    if uniform:
        urows = [
            {
                "geometry": u.source,
                "pods placed": str(u.pods_placed),
                "GPUs in use": str(u.gpus_used),
                "reconfigured": str(u.reconfigured_gpus),
                "wasted": _gib(u.wasted_bytes),
            }
            for u in [plan, *uniform]
        ]
        out.write(
            "\n"
            + format_table(
                urows, ["geometry", "pods placed", "GPUs in use", "reconfigured", "wasted"]
            )
            + "\n"
        )
    if plan.unplaced:
        out.write(f"\nunplaced pods ({len(plan.unplaced)}):\n")
        for key, reason in plan.unplaced[:20]:
            out.write(f"  {key}: {reason}\n")
        if len(plan.unplaced) > 20:
            out.write(f"  ... and {len(plan.unplaced) - 20} more\n")
    for w in [*snap.notes, *plan.warnings]:
        out.write(f"note: {w}\n")
    labels = plan.node_labels()
    out.write("\n# mig-parted config (nvidia-mig-parted / GPU operator mig-manager)\n")
    out.write(plan.mig_parted_yaml())
    out.write("\n# node labels (dry-run: not applied)\n")
    out.write(
        yaml.safe_dump(
            {"nodeLabels": {n: {MIG_CONFIG_LABEL: v} for n, v in labels.items()}}, sort_keys=False
        )
    )


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan-mig",
        help="plan MIG geometries for pending pods (dry-run)",
        description="Choose per-GPU MIG geometries (CP-SAT) so the most pending pods fit on the fewest "
        "GPUs without destroying occupied slices; print a table, the nvidia.com/mig.config labels and "
        "the mig-parted config that realises them.",
    )
    p.add_argument(
        "--cluster", required=True, type=Path, help="kubectl get nodes,pods -A -o yaml output"
    )
    p.add_argument(
        "--pending", type=Path, help="List of pending Pods (default: unbound pods in --cluster)"
    )
    p.add_argument(
        "--time-limit",
        type=number(above=0),
        default=10.0,
        help="solver time limit in seconds (default 10)",
    )
    p.add_argument(
        "--workers",
        type=whole(at_least=1, at_most=2),
        default=2,
        help="CP-SAT workers, at most 2 (default 2)",
    )
    p.add_argument(
        "--reconfigure",
        choices=["whole-gpu", "free-slices"],
        default="whole-gpu",
        help="whole-gpu (default): GPUs with a used slice keep their layout, as mig-parted requires; "
        "free-slices: re-carve free parts of used GPUs (needs per-instance tooling)",
    )
    p.add_argument(
        "--compare-uniform", action="store_true", help="also evaluate every uniform geometry"
    )
    p.add_argument(
        "--output-yaml", type=output_file, help="write the mig-parted config to this file"
    )
    p.add_argument(
        "--apply-labels",
        action="store_true",
        help="label nodes in a live cluster (not implemented)",
    )
    p.add_argument("--kubeconfig", type=Path, help="kubeconfig for --apply-labels")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    try:
        snap = read_cluster(args.cluster, args.pending)
    except OSError as e:  # as plan-defrag and simulate say it: the file, then why
        print(f"vramsched plan-mig: cannot read {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ClusterFileError as e:  # names the file
        print(f"vramsched plan-mig: cannot read {e}", file=sys.stderr)
        return 2
    except (ValueError, yaml.YAMLError) as e:  # a pod or node the plan cannot stand on
        print(f"vramsched plan-mig: {e}", file=sys.stderr)
        return 1
    if not snap.gpus:
        out.write("no MIG GPUs found in the cluster file\n")
        for n in snap.notes:
            out.write(f"note: {n}\n")
        return 1
    workers = max(1, min(2, args.workers))
    plan = plan_mig_geometry(
        snap.gpus,
        snap.pending,
        reconfigure=args.reconfigure,
        time_limit_s=args.time_limit,
        num_workers=workers,
    )
    uniform = None
    if args.compare_uniform:
        uniform = [
            evaluate_uniform(
                snap.gpus,
                snap.pending,
                fam,
                reconfigure=args.reconfigure,
                time_limit_s=args.time_limit,
                num_workers=workers,
            )
            for fam in mig.UNIFORM_FAMILIES
        ]
    print_plan(plan, snap, out, uniform)
    if args.output_yaml:
        args.output_yaml.write_text(plan.mig_parted_yaml(), encoding="utf-8")
    if args.apply_labels:
        out.write(
            "\n--apply-labels: labelling a live cluster is not implemented; nothing was changed.\n"
            "To apply by hand: install the config above as the mig-manager config (GPU operator "
            "migManager.config.name ConfigMap, key config.yaml), then:\n"
        )
        for node, value in plan.node_labels().items():
            out.write(f"  kubectl label node {node} {MIG_CONFIG_LABEL}={value} --overwrite\n")
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point until ``extender.cli`` registers the subcommand."""
    parser = argparse.ArgumentParser(prog="vramsched")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
