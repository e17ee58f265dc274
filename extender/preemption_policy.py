"""vramsched's own preemption by VRAM (`vramsched serve --preempt`): which pending pod may preempt,
which running pod may be its victim, and what each is told.

kube-scheduler preempts only for what its in-tree filters see: GPU counts, not VRAM. A pod of
high priority that fits no GPU's free VRAM, on a time-sliced or MPS node with replicas left,
finds no victims in its dry run and waits forever behind pods of lower priority. vramsched then
evicts the fewest of them itself (`extender.placement.plan_preemption`), through the Eviction
API so that PodDisruptionBudgets hold, and holds the GPUs they free for the pod, as a repack plan
holds them (`extender.live.repack`). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extender.demand import Demand, PodRef
from extender.ledger import Reservation
from extender.object_fields import meta, uid_of
from extender.repack_policy import abandoned_message, needs_text, where_text

__all__ = [
    "PREEMPTED_REASON",
    "may_preempt",
    "pod_priority",
    "preempted_message",
    "preempting_message",
    "preemption_abandoned_message",
    "victim_problem",
]

#: the Event reason on each pod vramsched preempts
PREEMPTED_REASON = "VramschedPreempted"


def pod_priority(pod: Mapping[str, Any]) -> int:
    """`spec.priority`, as the priority admission plugin resolved it (0 when unset)."""
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def may_preempt(pod: Mapping[str, Any] | None) -> str | None:
    """Why this pending pod may not preempt anyone, or None. As kube-scheduler: not with
    `preemptionPolicy: Never`; and not while kube-scheduler preempts for it itself
    (`status.nominatedNodeName`): two preemptions for one pod would evict twice."""
    if pod is None:
        return "it is gone"
    if (pod.get("spec") or {}).get("preemptionPolicy") == "Never":
        return "its preemptionPolicy is Never"
    nominated = (pod.get("status") or {}).get("nominatedNodeName")
    if nominated:
        return f"kube-scheduler preempts for it on {nominated}"
    return None


def victim_problem(res: Reservation, pod: Mapping[str, Any] | None, priority: int) -> str | None:
    """Why the pod behind `res` may not be evicted for a pod of `priority`, or None: only a
    running pod of the API (not a hold, not one created again under its name) of lower
    priority, not leaving already (its GPUs come free anyway)."""
    if res.assumed:
        return "a hold, not a running pod"
    if pod is None:
        return "gone"
    if res.pod.uid and uid_of(pod) != res.pod.uid:
        return "created again under its name"
    if meta(pod).get("deletionTimestamp"):
        return "terminating"
    if not (pod.get("spec") or {}).get("nodeName"):
        return "not bound"
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return "finished"
    if pod_priority(pod) >= priority:
        return f"priority {pod_priority(pod)} is not below {priority}"
    return None


def preempted_message(
    preemptor: Demand, placement: Reservation, priority: int, index: int, total: int
) -> str:
    """The victim's Event: for whom and why."""
    return (
        f"preempted by vramsched ({index} of {total}) for pod {preemptor.pod.key} of priority "
        f"{preemptor.priority} (this pod: {priority}), which needs {needs_text(preemptor)} and fits "
        f"no GPU's free VRAM; it gets {where_text(placement)}"
    )


def preempting_message(placement: Reservation, victims: Sequence[PodRef]) -> str:
    """The preemptor's Event once its GPUs are held."""
    names = ", ".join(v.key for v in victims)
    return (
        f"vramsched preempted {len(victims)} pod(s) of lower priority ({names}) and holds "
        f"{where_text(placement)} for this pod"
    )


def preemption_abandoned_message(evicted: Sequence[PodRef], total: int, why: str) -> str:
    """The preemptor's Warning when a started preemption stops part way."""
    return abandoned_message(evicted, total, why, what="preemption", then="")
