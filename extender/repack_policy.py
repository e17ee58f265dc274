"""Live repacking's rules, pure (no I/O, no await): which running pods may be moved, how many
moves the budget allows, whether a plan still holds on the live ledger, whether kube-scheduler
would let each pod where the plan sends it, what filter answers for a pod a repack holds GPUs for,
and what the Events say.

`extender.live.repack` makes the API calls (evictions, events) and `extender.repack_holds` keeps a
plan's GPUs held while it runs; what either of them decides is decided here, so it is tested on
plain objects.

A pod is *movable* only when its owner asked for it and something will bring it back: the
annotation `vramsched.io/movable: "true"` and a controller that re-creates an evicted pod from
the same template. A ReplicaSet (a Deployment's too) does, under a new name; a StatefulSet does
under the same name, once the old pod is gone, with the same PersistentVolumeClaims (a pod with
claims moves only where their volumes reach: `volume_rules`, checked with the targets). Bare pods,
Jobs (an evicted pod counts as a failure against `backoffLimit`), DaemonSets (one pod per node,
nowhere else to go) and anything else are never moved.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from extender.bind_event import bind_event
from extender.demand import ANNOTATION_PREFIX, TERMINAL_PHASES, Demand, PodRef
from extender.ledger import Ledger, LedgerError, Reservation
from extender.object_fields import meta, uid_of
from extender.placement import FilterOutcome, plugin_allows
from extender.placement.pin_rule import unpinnable
from extender.quantity import format_bytes
from extender.scheduler_profile import SchedulerProfile
from extender.spread_defaults import SpreadDefaults
from extender.target_rules import target_problem
from extender.volume_rules import Storage

__all__ = [
    "MOVABLE",
    "NOMINATED",
    "REASON",
    "ABANDONED_REASON",
    "Controller",
    "PlannedMove",
    "MoveBudget",
    "MOVES_PER_GPU",
    "moves_to_place",
    "movable",
    "replaces",
    "plan_target_problem",
    "final_state_problem",
    "nominated_outcome",
    "eviction_body",
    "withdrawn",
    "eviction_api_version",
    "eviction_message",
    "nominated_message",
    "abandoned_message",
    "repack_event",
    "needs_text",
    "where_text",
]

#: the owner's consent: only pods annotated exactly "true" are ever moved
MOVABLE = ANNOTATION_PREFIX + "movable"
#: written on a pod once the GPUs a repack freed for it are held: the node, for people, and an
#: update of the pod, which makes kube-scheduler try it again at once instead of waiting for its
#: next cluster event
NOMINATED = ANNOTATION_PREFIX + "nominated-node"
#: Events on every evicted pod and on the pod the room is made for
REASON = "VramschedRepack"
#: Warning Event on the blocked pod when a started plan cannot be finished
ABANDONED_REASON = "VramschedRepackAbandoned"

_TEMPLATE_HASH = "pod-template-hash"
_RECREATING = frozenset({"ReplicaSet", "StatefulSet"})


@dataclass(frozen=True, slots=True)
class Controller:
    """The controller that re-creates a moved pod, and how its new pod is recognised."""

    kind: str  # "ReplicaSet" | "StatefulSet"
    name: str
    uid: str
    #: a Deployment's ReplicaSet labels its pods with their template's hash ("" for others)
    template_hash: str = ""


@dataclass(frozen=True, slots=True)
class PlannedMove:
    """One move of a plan as the live side carries it out: evict `pod` from `source`; its
    re-created pod takes `target`."""

    pod: PodRef
    demand: Demand
    source: Reservation
    target: Reservation
    controller: Controller


def _controller_ref(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for ref in meta(pod).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


#: why `movable` refuses a consenting pod that is leaving already
TERMINATING = "terminating"
NOT_RUNNING = "not running"


def movable(pod: Mapping[str, Any]) -> Controller | str:
    """The controller that will re-create this running pod if it is evicted, or why it may not
    be moved (a short phrase for logs)."""
    pod_meta = meta(pod)
    annotations = pod_meta.get("annotations") or {}
    if not isinstance(annotations, Mapping) or annotations.get(MOVABLE) != "true":
        return f"not annotated {MOVABLE}: true"
    if pod_meta.get("deletionTimestamp"):
        return TERMINATING
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    if not spec.get("nodeName") or status.get("phase") in TERMINAL_PHASES:
        return NOT_RUNNING
    ref = _controller_ref(pod)
    if ref is None:
        return "no controller re-creates it (bare pod)"
    kind = str(ref.get("kind") or "")
    if kind not in _RECREATING or not str(ref.get("apiVersion") or "").startswith("apps/"):
        return f"its controller ({kind or '?'}) does not re-create it elsewhere"
    labels = pod_meta.get("labels") or {}
    return Controller(
        kind,
        str(ref.get("name") or ""),
        str(ref.get("uid") or ""),
        str(labels.get(_TEMPLATE_HASH) or "") if kind == "ReplicaSet" else "",
    )


def replaces(controller: Controller, moved: PodRef, pod: Mapping[str, Any]) -> bool:
    """Whether `pod` is what `controller` created to replace `moved`: same controller (by UID)
    and template (a Deployment's hash label); a StatefulSet's pod also keeps its name, under a
    new UID."""
    ref = _controller_ref(pod)
    if ref is None or str(ref.get("uid") or "") != controller.uid or not controller.uid:
        return False
    pod_meta = meta(pod)
    if controller.kind == "StatefulSet":
        return (
            pod_meta.get("name") == moved.name
            and (pod_meta.get("namespace") or "default") == moved.namespace
            and str(pod_meta.get("uid") or "") != moved.uid
        )
    labels = pod_meta.get("labels") or {}
    return str(labels.get(_TEMPLATE_HASH) or "") == controller.template_hash


# ----- will kube-scheduler let each pod where the plan sends it? ---------------------------------


def plan_target_problem(
    nodes: Mapping[str, Mapping[str, Any]],
    pods: Mapping[str, Mapping[str, Any]],
    blocked: Mapping[str, Any],
    placement: Reservation,
    moves: Sequence[PlannedMove],
    storage: Storage | None = None,
    *,
    profile: SchedulerProfile | None = None,
    spread: SpreadDefaults | None = None,
) -> tuple[str, str | None] | None:
    """`target_problem` for a repack plan: the blocked pod and every moved pod sent where the plan
    says, the moved pods gone from where they were (with `storage`, attach limits checked too;
    with `profile` and `spread`, the scheduler profile's arguments).
    None, or (why, the moved pod to leave out of the next plan; None when only the blocked pod is
    at fault)."""
    sent: list[tuple[str | None, Mapping[str, Any], str]] = [(None, blocked, placement.node)]
    for m in moves:
        moved = pods.get(m.pod.key)
        if moved is not None:
            sent.append((m.pod.key, moved, m.target.node))
    leaving = {m.pod.key for m in moves}
    return target_problem(nodes, pods, sent, leaving, storage, profile=profile, spread=spread)


# ----- the budget ----------------------------------------------------------------------------------


#: the default cap on moves to place one pod, per GPU it asks: `serve --repack-max-moves-per-gpu`
#: and the simulator's `planner+repack` (`simulate --max-moves-per-gpu`). Per GPU, not per pod: a
#: pod that asks a whole node of GPUs may need a pod moved off each of them (on the trace, an
#: 8-GPU pod needed 4 moves where a flat cap of 3 left it unplaced).
MOVES_PER_GPU = 3


def moves_to_place(gpus: int, per_gpu: int, per_pod: int | None = None) -> int:
    """The most moves a plan may make to place a pod that asks `gpus` GPUs: `per_gpu` per GPU (a
    pod with a share of one GPU counts as one), never more than `per_pod` when it is set."""
    cap = per_gpu * max(1, gpus)
    return cap if per_pod is None else min(cap, per_pod)


class MoveBudget:
    """Caps evictions: at most `per_gpu` moves per GPU the pod asks to place one pod (and at most
    `per_pod` in all, when set), and at most `per_minute` in any 60 seconds. `clock` is injectable
    (tests); moves are counted when the eviction is accepted."""

    def __init__(
        self,
        per_gpu: int,
        per_minute: int,
        *,
        per_pod: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        window: float = 60.0,
    ) -> None:
        if per_gpu < 0 or per_minute < 0 or (per_pod is not None and per_pod < 0):
            raise ValueError("move budgets cannot be negative")
        self.per_gpu = per_gpu
        self.per_pod = per_pod
        self.per_minute = per_minute
        self.window = window
        self.clock = clock
        self.spent = 0
        self._times: deque[float] = deque()

    def recent(self) -> int:
        """Moves in the last `window` seconds."""
        now = self.clock()
        while self._times and now - self._times[0] >= self.window:
            self._times.popleft()
        return len(self._times)

    def allowance(self, gpus: int = 1) -> int:
        """How many moves the next plan for a pod of `gpus` GPUs may make (0: no plan now)."""
        per_pod = moves_to_place(gpus, self.per_gpu, self.per_pod)
        return max(0, min(per_pod, self.per_minute - self.recent()))

    def next_move_in(self) -> float:
        """Seconds until the per-minute cap lets one more move (0 when it does now)."""
        if self.recent() < self.per_minute or not self._times:
            return 0.0
        return max(0.0, self._times[0] + self.window - self.clock())

    def spend(self, moves: int = 1) -> None:
        now = self.clock()
        self._times.extend([now] * moves)
        self.spent += moves


# ----- does a plan still hold on the live ledger? ------------------------------------------------


def final_state_problem(
    ledger: Ledger,
    blocked: Demand,
    placement: Reservation,
    moves: Sequence[PlannedMove],
) -> str | None:
    """Why the plan's final state does not hold on `ledger` as it is now, or None.

    Played on a copy with the live rules: every moved pod still holds exactly its source, then
    (all of them gone) the targets and the blocked pod's placement are reserved one by one, each
    checked by `Ledger.reserve` and the device plugin's bound (`plugin_allows`: plans are made on
    per-GPU books) and, for a pod that reads its GPU from the annotation, the pin rule. Every
    intermediate state of the execution holds a subset of this final one, and every rule only
    tightens as pods are added, so none of them can overcommit either."""
    copy = ledger.clone()
    for move in moves:
        held = copy.reservation(move.pod.key)
        if held is None or not held.same_placement(move.source):
            return f"pod {move.pod.key} no longer holds what the plan moves"
        if move.pod.uid and held.pod.uid and held.pod.uid != move.pod.uid:
            return f"pod {move.pod.key} was re-created since the plan"
        copy.release(move.pod.key)
    if copy.reservation(blocked.pod.key) is not None:
        return f"pod {blocked.pod.key} already holds GPUs"
    wanted = [(m.demand, m.target) for m in moves] + [(blocked, placement)]
    for i, (demand, res) in enumerate(wanted):
        # under a key no pod has, so a target may sit where its own pod was
        trial = replace(res, pod=PodRef(res.pod.namespace, f"{res.pod.name}~plan{i}"))
        if not plugin_allows(copy, demand, trial):
            return f"device plugin's bound refuses {res.pod.key} on {res.node}"
        pin = unpinnable(copy, demand, [res.node])
        if pin:
            return f"{res.pod.key} on {res.node}: {pin[res.node]}"
        try:
            copy.reserve(trial)
        except LedgerError as exc:
            return f"{res.pod.key} does not fit on {res.node}: {exc}"
    return None


# ----- filter for a pod a repack holds GPUs for ------------------------------------------------------


def nominated_outcome(
    ledger: Ledger, demand: Demand, names: Sequence[str], nominated: Reservation
) -> FilterOutcome:
    """Filter's answer for a pod a running repack freed GPUs for: the nominated node alone, once
    the pod holds that placement or it is free (the bind then reserves exactly it), else no node
    while the moved pods are still leaving. Never another node: anywhere else it would take room
    the plan counts on. Refusals are unresolvable, so kube-scheduler does not preempt for it."""
    node = nominated.node
    held = ledger.reservation(demand.pod.key)
    if held is not None:
        ready = held.same_placement(nominated)
    else:
        trial = replace(nominated, pod=demand.pod)
        ready = ledger.fits(trial) is None and plugin_allows(ledger, demand, trial)
    out = FilterOutcome(explain_all=True)
    if ready and node in names:
        out.feasible = [node]
    waiting = f"vramsched repack: waiting for GPUs being freed on {node}"
    elsewhere = f"vramsched repack: GPUs are held for this pod on {node}"
    out.unresolvable = {
        n: (waiting if n == node else elsewhere) for n in names if n not in out.feasible
    }
    return out


# ----- the API's Eviction and the Events ------------------------------------------------------------


def eviction_api_version(version: Mapping[str, Any] | None) -> str:
    """policy/v1 Eviction from Kubernetes 1.22; policy/v1beta1 before (1.20, 1.21)."""
    try:
        major = int(str((version or {}).get("major") or "1").rstrip("+"))
        minor = int(str((version or {}).get("minor") or "99").rstrip("+"))
    except ValueError:
        return "policy/v1"
    return "policy/v1" if (major, minor) >= (1, 22) else "policy/v1beta1"


def eviction_body(
    pod: PodRef, api_version: str = "policy/v1", resource_version: str = ""
) -> dict[str, Any]:
    """An Eviction of exactly this pod (UID precondition: never a re-created one of the same
    name), and with `resource_version`, of the version whose consent was read (a pod whose
    `movable` annotation was removed since is refused with a 409). The pod's own grace period
    applies: its VRAM is counted until it is gone."""
    body: dict[str, Any] = {
        "apiVersion": api_version,
        "kind": "Eviction",
        "metadata": {"name": pod.name, "namespace": pod.namespace},
    }
    preconditions = {
        k: v for k, v in (("uid", pod.uid), ("resourceVersion", resource_version)) if v
    }
    if preconditions:
        body["deleteOptions"] = {"preconditions": preconditions}
    return body


def withdrawn(planned: PodRef, pod: Mapping[str, Any] | None) -> str | None:
    """Why a pod planned to move may no longer be evicted, or None: it was created again under
    its name, or no longer consents (its `movable` annotation removed, its controller gone).
    A pod gone is not withdrawn, nor one still consenting that is terminating or finished: it
    is leaving already, and its eviction changes nothing."""
    if pod is None:
        return None
    uid = uid_of(pod)
    if planned.uid and uid and uid != planned.uid:
        return f"pod {planned.key} was created again under its name"
    why = movable(pod)
    if isinstance(why, Controller) or why in (TERMINATING, NOT_RUNNING):
        return None
    return f"pod {planned.key} may no longer move: {why}"


def where_text(res: Reservation) -> str:
    """`device 0 of gpu-b`, `devices 0, 1 of gpu-b` (device ids as the assignment names them)."""
    plural = "devices" if len(res.device_ids) > 1 else "device"
    return f"{plural} {', '.join(res.device_ids)} of {res.node}"


def needs_text(demand: Demand) -> str:
    """`16Gi on 1 GPU`, `40Gi on each of 2 GPUs`, `2 GPUs, whole`."""
    gpus = "1 GPU" if demand.gpu_count == 1 else f"each of {demand.gpu_count} GPUs"
    if demand.bytes_per_gpu is None:
        return f"{demand.gpu_count} whole GPU(s)"
    return f"{format_bytes(demand.bytes_per_gpu)} on {gpus}"


def eviction_message(
    blocked: Demand, placement: Reservation, move: PlannedMove, index: int, total: int
) -> str:
    """The evicted pod's Event: for whom, why, and where its re-created pod goes."""
    again = "under the same name" if move.controller.kind == "StatefulSet" else "from its template"
    return (
        f"evicted by vramsched (move {index} of {total}) to make room for pod {blocked.pod.key} "
        f"({needs_text(blocked)}), which fits on no node while free VRAM is split; it gets "
        f"{where_text(placement)}. {move.controller.kind} {move.controller.name} re-creates this pod "
        f"{again}, and vramsched holds {where_text(move.target)} for the new one"
    )


def nominated_message(placement: Reservation, moves: Sequence[PlannedMove]) -> str:
    """The blocked pod's Event once its GPUs are held."""
    moved = ", ".join(m.pod.key for m in moves)
    return (
        f"vramsched moved {len(moves)} pod(s) ({moved}) to free room for this pod and holds "
        f"{where_text(placement)} for it"
    )


def abandoned_message(
    moves_done: Sequence[PodRef],
    total: int,
    why: str,
    *,
    what: str = "repack",
    then: str = "the evicted pods' controllers re-create them, placed as usual",
) -> str:
    """The blocked pod's Warning when a started plan (`what`: a repack, a preemption) stops
    part way; `then`: what becomes of the pods evicted so far, if anything is to be said."""
    done = ", ".join(p.key for p in moves_done) or "none"
    text = (
        f"vramsched {what} abandoned after evicting {len(moves_done)} of {total} pod(s) "
        f"({done}): {why}; this pod still does not fit"
    )
    return f"{text}, and {then}" if then else text


def repack_event(
    pod: PodRef,
    message: str,
    now: float,
    instance: str = "",
    *,
    reason: str = REASON,
    warning: bool = False,
) -> dict[str, Any]:
    """A core/v1 Event on `pod`, shaped like the bind's (`extender.bind_event`)."""
    body = bind_event(pod, message, now, instance)
    body["reason"] = reason
    body["type"] = "Warning" if warning else "Normal"
    return body
