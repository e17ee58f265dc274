"""One repack plan while it runs: the GPUs it frees are held in the ledger for the pods it places.
A preemption (`serve --preempt`) runs as a plan whose evicted pods (`victims`) go nowhere.

Pure (no I/O, no await); `extender.live.repack` evicts and posts, this module decides what the
ledger holds at each moment. The plan's final state was checked on the live ledger before the
first eviction (`repack_policy.final_state_problem`); here it is reached without overcommitting
and without letting anyone else take the room it needs:

- A *hold* is an assumed reservation (with a deadline, so it can never outlive the plan) of a
  placement of the final state: the blocked pod's, and each moved pod's target. It is taken as
  soon as that placement fits the ledger as it is (`Ledger.reserve` and the device plugin's
  bound). Targets on room that was free from the start are held before any eviction; the rest
  once the moved pods whose GPUs they need are gone from the API (their reservations released).
  Every state on the way holds a subset of the final one, so every hold fits when its turn comes.
- `settle` takes the holds that fit now. It runs before filter, prioritize and bind decide
  anything (the live plan source calls it from each verb), all on the event loop: nothing can
  take a freed GPU between the watch releasing it and the hold taking it.
- The blocked pod's hold is under its own key: filter offers it that node alone and bind reuses
  the hold (`ExtenderService.bind`). A re-created pod is recognised by its controller
  (`repack_policy.replaces`); until it exists its target is held under a key no pod can have
  (`<namespace>/<moved pod>~repack`: `~` is not allowed in pod names), and moved to the new pod's
  key the moment it shows up.
- A hold the bind did not take lapses with the ledger's own `expire`; abandoning a plan releases
  the holds nobody took.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from extender.cluster import ClusterState
from extender.demand import Demand, DemandError, PodRef, asks_same_gpus, pod_demand, pod_ref
from extender.ledger import LedgerError, Reservation
from extender.object_fields import uid_of
from extender.placement import plugin_allows
from extender.repack_policy import PlannedMove, replaces

__all__ = ["HOLD_SUFFIX", "RepackRun", "TargetState", "hold_key"]

#: suffix of the key a target is held under until its re-created pod exists
HOLD_SUFFIX = "~repack"
#: seconds a hold of a real pod outlives an abandoned plan: longer than any bind takes, so a bind
#: that already reserved it settles first (binds give up after 4 s)
ABANDON_GRACE = 5.0


def hold_key(moved: PodRef) -> PodRef:
    """Where a target is held while no re-created pod exists: a key no pod can have."""
    return PodRef(moved.namespace, moved.name + HOLD_SUFFIX)


@dataclass(slots=True)
class TargetState:
    """One move while the plan runs."""

    move: PlannedMove
    #: the eviction was asked for (set before the call: its re-created pod may show up first)
    evicted: bool = False
    #: the pod the controller created in its place, once seen pending
    replacement: PodRef | None = None
    #: the reservation this plan holds for the target (None: not yet, or taken by a bind)
    hold: Reservation | None = None
    #: how the target ended: "" while open, "placed" (a bind took the hold), "elsewhere" (the
    #: new pod holds other GPUs), "lapsed" (the hold expired unused), "dropped" (plan ended first),
    #: "gone" (the new pod was deleted), "changed" (its model-memory edited before its bind)
    outcome: str = ""


@dataclass
class RepackRun:
    """The plan `moves` that places `blocked` at `placement`, while it runs (one at a time).

    `phase`: "evicting" (the adapter is evicting), "releasing" (every eviction accepted; waiting
    for the pods to be gone and the holds taken), "held" (every placement held or taken: waiting
    for the binds), then "done" or "abandoned"."""

    cluster: ClusterState
    blocked: Demand
    placement: Reservation
    targets: list[TargetState]
    #: when every moved pod must be gone (evictions, grace periods, slack); see `_expiry`
    deadline: float
    ttl: float
    #: pods pending before the plan started: never taken for a re-created pod
    known_pending: frozenset[str] = frozenset()
    phase: str = "evicting"
    #: the blocked pod's hold, or None
    hold: Reservation | None = None
    #: how the blocked pod ended: "" while open, "placed" (bound to its placement), "elsewhere",
    #: "lapsed" (its hold expired unused), "gone" (deleted or re-created), "changed" (its
    #: model-memory edited before its bind: the placement no longer fits what it asks)
    blocked_outcome: str = ""
    outcome: str = ""
    #: real pods whose hold was just taken, for the adapter to annotate (kube-scheduler retries a
    #: pod at once when it changes)
    pokes: list[PodRef] = field(default_factory=list)
    #: a preemption (`serve --preempt`): the pods it is to evict; they go nowhere, so they
    #: have no target
    preempting: tuple[PodRef, ...] = ()
    #: of those, the ones evicted so far (each added before its eviction is asked)
    victims: list[PodRef] = field(default_factory=list)
    _scanned: set[str] = field(default_factory=set)

    @property
    def active(self) -> bool:
        return self.phase not in ("done", "abandoned")

    def hold_keys(self) -> set[str]:
        """Keys the ledger holds for this plan right now (for `check_invariant`'s live set)."""
        keys = {t.hold.key for t in self.targets if t.hold is not None}
        if self.hold is not None:
            keys.add(self.hold.key)
        return {k for k in keys if self._holds(k)}

    # ----- what filter, prioritize and bind ask ------------------------------------------------
    def nominated(self, pod_key: str, now: float) -> Reservation | None:
        """The placement held (or to be held) for this pod, after settling; None if none."""
        if not self.active:
            return None
        self.settle(now)
        if pod_key == self.blocked.pod.key:
            # not for a pod re-created under its name, nor one that asks something else now
            return None if self.blocked_outcome in ("gone", "changed") else self.placement
        for t in self.targets:
            if t.replacement is not None and t.replacement.key == pod_key and not t.outcome:
                return t.move.target
        return None

    # ----- the one step everything goes through ------------------------------------------------
    def settle(self, now: float) -> None:
        """Match new pods to targets, take every hold that fits now, note what ended."""
        if not self.active:
            return
        self._match()
        for t in self.targets:
            self._settle_target(t, now)
        self._settle_blocked(now)
        if self.phase == "releasing" and self.all_held():
            self.phase = "held"
        if self.phase == "held" and self._finished():
            self.phase, self.outcome = "done", self._summary()

    def leaving(self) -> list[str]:
        """The moved or preempted pods the ledger still counts (terminating, or not evicted
        yet)."""
        ledger = self.cluster.ledger
        out = []
        for pod in [t.move.pod for t in self.targets] + list(self.preempting):
            res = ledger.reservation(pod.key)
            if res is not None and res.pod.uid == pod.uid:
                out.append(pod.key)
        return out

    def all_held(self) -> bool:
        """Every placement of the final state is held by this plan or taken by its pod."""
        blocked_ok = self.hold is not None or bool(self.blocked_outcome)
        return blocked_ok and all(t.hold is not None or t.outcome for t in self.targets)

    def abandon(self, now: float) -> list[PodRef]:
        """Stop: release the holds nobody took. A real pod's hold lapses `ABANDON_GRACE` seconds
        later instead, so a bind that already reserved it settles first. Returns the pods
        evicted so far."""
        ledger = self.cluster.ledger
        for t in self.targets:
            if t.hold is not None and self._holds(t.hold.key):
                if t.hold.key.endswith(HOLD_SUFFIX):
                    ledger.release(t.hold.key)
                elif t.hold.expires_at is not None:
                    t.hold.expires_at = min(t.hold.expires_at, now + ABANDON_GRACE)
            t.outcome = t.outcome or "dropped"
        if self.hold is not None and self._holds(self.hold.key) and self.hold.expires_at:
            self.hold.expires_at = min(self.hold.expires_at, now + ABANDON_GRACE)
        self.blocked_outcome = self.blocked_outcome or "dropped"
        self.phase = "abandoned"
        return [t.move.pod for t in self.targets if t.evicted] + list(self.victims)

    def summary(self) -> dict[str, object]:
        """For /state and the logs."""
        return {
            "pod": self.blocked.pod.key,
            "phase": self.phase,
            "placement": _where(self.placement),
            "moves": [
                {
                    "pod": t.move.pod.key,
                    "from": _where(t.move.source),
                    "to": _where(t.move.target),
                    "evicted": t.evicted,
                    "replacement": t.replacement.key if t.replacement else None,
                    "held": t.hold is not None and self._holds(t.hold.key),
                    "outcome": t.outcome or None,
                }
                for t in self.targets
            ],
            "preempted": [p.key for p in self.victims],
            "blockedOutcome": self.blocked_outcome or None,
            "outcome": self.outcome or None,
        }

    # ----- internals ---------------------------------------------------------------------------------
    def _holds(self, key: str) -> bool:
        """The ledger still has this plan's hold under `key` (not lapsed, not replaced)."""
        res = self.cluster.ledger.reservation(key)
        if res is None:
            return False
        return any(res is h for h in self._all_holds())

    def _all_holds(self) -> list[Reservation]:
        out = [t.hold for t in self.targets if t.hold is not None]
        if self.hold is not None:
            out.append(self.hold)
        return out

    def _bound(self, key: str) -> bool:
        pod = self.cluster.pod(key)
        return bool(pod is not None and (pod.get("spec") or {}).get("nodeName"))

    def _match(self) -> None:
        """Pods the controllers created in place of evicted ones, each to the first open target
        of its controller whose pod was evicted (they come from one template: interchangeable)."""
        open_ = [t for t in self.targets if t.evicted and t.replacement is None and not t.outcome]
        if not open_:
            return
        for key in self.cluster.pending:
            if key in self._scanned or key in self.known_pending or key == self.blocked.pod.key:
                continue
            pod = self.cluster.pod(key)
            if pod is None:
                continue
            self._scanned.add(key)
            for t in open_:
                if t.replacement is None and replaces(t.move.controller, t.move.pod, pod):
                    # the re-created pod needs what the moved one held (a template change
                    # would break the plan)
                    if self._asks_the_same(pod, t.move.demand):
                        t.replacement = pod_ref(pod)
                    break

    def _reserve(self, res: Reservation, demand: Demand, expires: float) -> Reservation | None:
        ledger = self.cluster.ledger
        if ledger.fits(res) is not None or not plugin_allows(ledger, demand, res):
            return None
        res.assumed, res.expires_at = True, expires
        try:
            return ledger.reserve(res)
        except LedgerError:
            return None

    def _expiry(self, now: float) -> float:
        """A hold waits for its pod's bind `ttl` seconds after the moved pods had to be gone."""
        return max(self.deadline, now) + self.ttl

    def _settle_target(self, t: TargetState, now: float) -> None:
        if t.outcome:
            return
        ledger = self.cluster.ledger
        target = t.move.target
        if t.hold is not None and not self._holds(t.hold.key):
            # gone from the ledger under our key: taken by a bind (the pod's own reservation
            # now), or lapsed
            own = ledger.reservation(t.hold.key)
            if own is not None and own.same_placement(target):
                t.outcome = "placed"
            elif own is not None:
                t.outcome = "elsewhere"
            else:
                t.outcome = "lapsed" if not self._bound(t.hold.key) else "placed"
            t.hold = None
            return
        if t.hold is not None and t.hold.expires_at is None:
            t.outcome, t.hold = "placed", None  # the bind's Binding landed
            return
        if t.replacement is not None:
            own = ledger.reservation(t.replacement.key)
            if own is not None and (t.hold is None or own is not t.hold):
                t.outcome = "placed" if own.same_placement(target) else "elsewhere"
                if t.hold is not None and self._holds(t.hold.key):
                    ledger.release(t.hold.key)
                t.hold = None
                return
            pod = self.cluster.pod(t.replacement.key)
            gone = uid_of(pod) != t.replacement.uid
            if gone or not self._asks_the_same(pod, t.move.demand):
                # deleted, or its model-memory edited before its bind (the target was sized
                # for what it asked before)
                t.outcome = "gone" if gone else "changed"
                if t.hold is not None and self._holds(t.hold.key):
                    ledger.release(t.hold.key)
                t.hold = None
                return
            if t.hold is not None and t.hold.key != t.replacement.key:
                # the re-created pod showed up: the hold moves to its key, in one step
                ledger.release(t.hold.key)
                res = replace(t.hold, pod=t.replacement)
                t.hold = ledger.reserve(res)
                self.pokes.append(t.replacement)
                return
        if t.hold is None:
            who = t.replacement if t.replacement is not None else hold_key(t.move.pod)
            res = replace(target, pod=who)
            t.hold = self._reserve(res, t.move.demand, self._expiry(now))
            if t.hold is not None and t.replacement is not None:
                self.pokes.append(t.replacement)

    def _settle_blocked(self, now: float) -> None:
        if self.blocked_outcome:
            return
        ledger = self.cluster.ledger
        key = self.blocked.pod.key
        pod = self.cluster.pod(key)
        if pod is None or uid_of(pod) != self.blocked.pod.uid:
            self.blocked_outcome = "gone"
        elif self._bound(key):
            own = ledger.reservation(key)
            placed = own is not None and own.same_placement(self.placement)
            self.blocked_outcome = "placed" if placed else "elsewhere"
        elif not self._asks_the_same(pod, self.blocked):
            # its model-memory was edited: the placement was sized for what it asked before
            self.blocked_outcome = "changed"
            if self.hold is not None and self._holds(key):
                ledger.release(key)
        elif self.hold is not None:
            if not self._holds(key):
                self.blocked_outcome = "lapsed"
        elif ledger.reservation(key) is None:
            res = replace(self.placement, pod=self.blocked.pod)
            self.hold = self._reserve(res, self.blocked, self._expiry(now))
            if self.hold is not None:
                self.pokes.append(self.blocked.pod)

    def _asks_the_same(self, pod: Mapping[str, Any] | None, planned: Demand) -> bool:
        """Whether `pod`, as the cluster holds it now, asks what the plan placed for `planned`."""
        if pod is None:
            return False
        try:
            demand = pod_demand(pod, headroom=self.cluster.headroom)
        except DemandError:
            return False
        return asks_same_gpus(demand, planned)

    def _finished(self) -> bool:
        return bool(self.blocked_outcome) and all(t.outcome for t in self.targets)

    def _summary(self) -> str:
        if self.preempting:
            return f"blocked pod {self.blocked_outcome}; {len(self.victims)} pod(s) preempted"
        placed = sum(t.outcome == "placed" for t in self.targets)
        return (
            f"blocked pod {self.blocked_outcome}; {placed} of {len(self.targets)} re-created "
            f"pods placed as planned"
        )


def _where(res: Reservation) -> str:
    return f"{res.node}/{','.join(res.device_ids)}"
