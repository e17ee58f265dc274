"""Why pods wait: each pending pod's class from the last answer filter gave kube-scheduler.

The service notes one class per filtered pod (a dict assignment; the reasons are looked at only
when no node passed, and then only their distinct texts), and `counts()` sums the classes of the
pods still pending at scrape time for `vramsched_pods_pending{reason}`. kube-scheduler retries an
unschedulable pod at least every few minutes, so the class follows the cluster as filter sees it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

__all__ = ["PendingReasons", "reason_kind", "outcome_class", "CLASSES"]

#: `reason` label values: a node passed filter (the pod waits on kube-scheduler: its own filters,
#: the bind, a retry); no node has the free VRAM / a free replica now (eviction or a finished
#: pod would help); no node ever can as labelled (unschedulable); the pod's GPU demand cannot be
#: read (invalid); or filter has not been asked about it yet (unfiltered)
CLASSES = ("fits", "vram", "replicas", "other", "unschedulable", "invalid", "unfiltered")

#: the pods kept beyond the pending ones before they are pruned (pods bound since are dropped then)
SLACK = 4096


def reason_kind(reason: str) -> str:
    """`vram` | `replicas` | `other` for one of filter's reasons for a node it refused now
    (extender.placement words them: `_mem_reason`, `_stack_reasons`, the slot reason)."""
    if (
        reason.startswith("no GPU with ")
        or (reason.startswith("only ") and " GPUs with " in reason)
        or reason.startswith("device plugin (")
    ):
        return "vram"
    if reason.startswith("all GPU replicas in use"):
        return "replicas"
    return "other"


def outcome_class(feasible: bool, failed: Iterable[str]) -> str:
    """A pod's class from one filter answer: whether a node passed, else the reasons of the
    nodes refused for now (`failed`, before the unresolvable ones are merged in for old
    schedulers); with none of those every node was refused for good."""
    if feasible:
        return "fits"
    kinds = {reason_kind(r) for r in set(failed)}
    for kind in ("vram", "replicas", "other"):
        if kind in kinds:
            return kind
    return "unschedulable"  # every node refused for good (or none asked about)


class PendingReasons:
    """Last filter class per pod key; owned by the service's event loop."""

    def __init__(self, pending: Collection[str]) -> None:
        #: the cluster's pending pod keys (a live set, read at scrape and when pruning)
        self.pending = pending
        self._last: dict[str, str] = {}

    def note(self, key: str, cls: str) -> None:
        self._last[key] = cls
        if len(self._last) > len(self.pending) + SLACK:
            self._prune()

    def _prune(self) -> None:
        pending = self.pending
        self._last = {k: v for k, v in self._last.items() if k in pending}

    def counts(self) -> dict[str, int]:
        """Pending pods per class, every class present (0s included: series stay continuous)."""
        self._prune()
        out = dict.fromkeys(CLASSES, 0)
        last = self._last
        for key in self.pending:
            out[last.get(key, "unfiltered")] += 1
        return out
