"""The extender's use cases: filter, prioritize, bind, preempt, state.

Adapters hand in decoded wire objects and get wire objects back; this layer turns them
into calls on the pure core (demand, placement, ledger). What differs between the embedded
cluster and a live one is composed in, never a flag: the `Binder` that makes a placement real
and the `PodFeed` that tells the cluster about pods (`extender.embedded` by default;
`extender.live.binder` and `extender.live.source.WatchedPods` in live mode, which also wraps
the service in its sync gate, `extender.live.gate`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import orjson
from prometheus_client.registry import Collector

from extender.cluster import ClusterState
from extender.demand import Demand, DemandError, asks_same_gpus, pod_demand, pod_ref
from extender.embedded import LearnedPods
from extender.ledger import Ledger, LedgerError, Reservation
from extender.observe.pending import PendingReasons, outcome_class
from extender.observe.usage import state_nodes, usage_from_ledger
from extender.placement import (
    MAX_SCORE,
    FilterOutcome,
    books_demand,
    choose_devices,
    filter_nodes,
    held_for_nominated,
    plugin_allows,
    preempt_victims,
    score_rows,
)
from extender.plugin_state import is_plugin_served
from extender.repack_policy import nominated_outcome
from extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    HostPriority,
    MetaPod,
    MetaVictims,
    NodeList,
    ScoredHosts,
)

__all__ = [
    "Binder",
    "BindError",
    "Nominations",
    "PlanSource",
    "PodFeed",
    "Extender",
    "ExtenderService",
]

log = logging.getLogger(__name__)


class BindError(Exception):
    """The binding could not be written; the reservation is rolled back."""


class Binder(Protocol):
    """Makes a placement real: in-memory for the embedded cluster, API calls for a live one."""

    async def bind(
        self, pod: Mapping[str, Any], node: str, reservation: Reservation | None
    ) -> None: ...


class PlanSource(Protocol):
    """What the background planner offers the hot path: a node, and devices, per pending pod."""

    def planned_node(
        self, pod_key: str, nodes: Sequence[str] | None = None, demand: Demand | None = None
    ) -> str | None:
        """The pod's planned node; `nodes`: the ones kube-scheduler found feasible, which a
        choice made now (not one planned before) keeps to; `demand`: the pod's as the request
        carries it, for a pod the cluster has not seen yet (kube-scheduler can be faster than
        live mode's pod watch)."""
        ...

    def planned_reservation(self, pod_key: str, node: str) -> Reservation | None: ...

    def notify_pending(self, pod_key: str) -> None: ...

    def notify_filtered(self, pod_key: str, fits: bool) -> None: ...

    def state(self) -> dict[str, Any]: ...


class Nominations(Protocol):
    """Pods a running repack freed GPUs for (`extender.live.repack`): filter offers each its
    nominated node alone (`repack_policy.nominated_outcome`), so nobody else takes that room."""

    def nominated(self, pod_key: str) -> Reservation | None: ...


class PodFeed(Protocol):
    """How the cluster hears of pods: from the API server's watch (live mode), or, with no API to
    list them, from the bodies kube-scheduler sends to filter (embedded mode, `extender.embedded.LearnedPods`)."""

    def learn(self, pod: Mapping[str, Any]) -> None:
        """A pod sent to filter, with a demand that parsed."""

    async def fetch(self, namespace: str, name: str) -> str | None:
        """Bind of a pod the cluster does not know: read it into the cluster if this feed can.
        The error to answer with when that failed, else None."""

    def delete(self, namespace: str, name: str) -> tuple[str, str] | None:
        """`DELETE /pods/...`: None when done, else (why: "live" | "unknown" | "binding", message)."""


class Extender(Protocol):
    """What the HTTP adapter (`extender.server`) serves: `ExtenderService`, or a wrapper of it."""

    @property
    def ledger(self) -> Ledger: ...

    @property
    def pending_reasons(self) -> PendingReasons: ...

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult: ...

    def prioritize(self, args: ExtenderArgs) -> Sequence[HostPriority]: ...

    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult: ...

    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult: ...

    def delete_pod(self, namespace: str, name: str) -> tuple[str, str] | None: ...

    def state(self) -> dict[str, Any]: ...

    def planner_state(self) -> dict[str, Any] | None: ...

    def metric_collectors(self) -> list[Collector]: ...


def _node_name(node: Mapping[str, Any]) -> str:
    """A sent Node's name; "" for a malformed one (it is then reported as unknown, not a 500)."""
    meta = node.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) else ""


def _pod_uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) else ""


#: pods whose parsed demand is kept (kube-scheduler sends each pod to filter, prioritize and bind
#: in a row; a few thousand cover any burst), emptied when full so odd pods cannot grow it
DEMANDS_CACHED = 4096
#: seconds a node given 10 stays avoided for other pods while the pod it was chosen for is not
#: bound: a bind normally follows within milliseconds (live mode: one API round trip)
CHOSEN_TTL = 2.0


class ExtenderService:
    """One instance per server; every method runs on the event loop that owns the cluster.

    A reservation bind takes is held as assumed (it lapses after `assume_ttl` seconds) until the
    cluster sees the pod bound: at once with the embedded binder, which updates the cluster
    itself; from the watch in live mode, whose binder also keeps a hold from lapsing once the API
    accepted its Binding (`extender.live.binder`).
    """

    def __init__(
        self,
        cluster: ClusterState,
        binder: Binder,
        *,
        planner: PlanSource | None = None,
        pods: PodFeed | None = None,
        assume_ttl: float = 60.0,
        legacy_failed_nodes: bool = True,
        explain_all: bool = False,
        nominations: Nominations | None = None,
    ) -> None:
        self.cluster = cluster
        self.nominations = nominations
        self.binder = binder
        self.planner = planner
        #: planned reservations bind was handed but did not take (no longer free, or refused by the
        #: device plugin's bound): with the planner's own counts, how often plans are of use
        self.plan_refused_at_bind = 0
        self.assume_ttl = assume_ttl
        #: also list unresolvable nodes in FailedNodes: kube-scheduler < 1.21 has no
        #: FailedAndUnresolvableNodes and would drop those reasons from the pod's event. Newer ones
        #: read both maps (the unresolvable entry wins), so there it only doubles the answer.
        self.legacy_failed_nodes = legacy_failed_nodes
        #: give a reason for every refused node even when some node passes. Off by default:
        #: kube-scheduler reads an extender's reasons only when no node is left (the pod's
        #: FitError event, preemption), and drops them unread otherwise. On for a scheduler with
        #: another filtering extender after this one, which could empty the list itself.
        self.explain_all = explain_all
        #: prioritize's node at 10 per pod not yet bound: (node, when). kube-scheduler may run the
        #: next pods' filter and prioritize before this pod's bind reaches us; they are pointed at
        #: another node of the same best band, so concurrent cycles do not all bind to one node
        #: and lose the race (see `_recent_choices`).
        self._chosen: dict[str, tuple[str, float]] = {}
        #: binds waiting on the binder, by pod key: (node, outcome). Another bind of the same pod
        #: meanwhile shares that outcome (same node) or is refused (another node), so a pod never
        #: has two Bindings racing, nor one call releasing what a concurrent one is confirming.
        self._in_flight: dict[str, tuple[str, str, asyncio.Future[ExtenderBindingResult]]] = {}
        self.pods: PodFeed = (
            pods
            if pods is not None
            else LearnedPods(
                cluster,
                planner.notify_pending if planner is not None else None,
                binding=lambda key: key in self._in_flight,
            )
        )
        #: demands by the pod's JSON (see _demand)
        self._demands: dict[bytes, tuple[float, Demand]] = {}
        #: what each pod asked in kube-scheduler's last filter of it, by key (bind compares)
        self._filtered: dict[str, Demand] = {}
        #: each pending pod's class from its last filter answer (`vramsched_pods_pending`)
        self.pending_reasons = PendingReasons(cluster.pending)

    @property
    def ledger(self) -> Ledger:
        return self.cluster.ledger

    # ----- filter ------------------------------------------------------------------------------
    def _demand(self, pod: Mapping[str, Any]) -> Demand:
        """The pod's demand, parsed once for filter, prioritize and bind of the same pod: keyed by
        the pod's exact JSON (the demand is a function of it and the headroom), which costs a few
        microseconds against tens for parsing the quantities again."""
        try:
            key = orjson.dumps(pod)
        except TypeError:  # not JSON (only a caller in-process can send that): no cache
            return pod_demand(pod, headroom=self.cluster.headroom)
        hit = self._demands.get(key)
        if hit is not None and hit[0] == self.cluster.headroom:
            return hit[1]
        demand = pod_demand(pod, headroom=self.cluster.headroom)
        if len(self._demands) >= DEMANDS_CACHED:
            self._demands.clear()
        self._demands[key] = (self.cluster.headroom, demand)
        return demand

    def _note_invalid(self, pod: Mapping[str, Any]) -> None:
        try:
            self.pending_reasons.note(pod_ref(pod).key, "invalid")
        except DemandError:
            pass

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        try:
            demand = self._demand(args.Pod)
        except DemandError as exc:
            self._note_invalid(args.Pod)
            return ExtenderFilterResult(
                Error=str(exc)
            )  # before any change: an Error changes nothing
        sent = args.Nodes.items if args.Nodes is not None else None
        if sent is not None:
            for node in sent:
                self.cluster.upsert_node(node)
            names = [_node_name(n) for n in sent]
        else:
            names = args.NodeNames or []
        self.pods.learn(args.Pod)
        self._note_filtered(demand)
        self.ledger.expire()
        nominated = (
            self.nominations.nominated(demand.pod.key)
            if self.nominations is not None and demand.wants_gpu
            else None
        )
        if nominated is not None:
            outcome = nominated_outcome(self.ledger, demand, names, nominated)
        else:
            outcome = filter_nodes(self.ledger, demand, names, explain_all=self.explain_all)
        if self.cluster.nominated and demand.wants_gpu and outcome.feasible:
            outcome = self._keep_nominated_room(demand, outcome)
        self.pending_reasons.note(
            demand.pod.key,
            "fits" if outcome.feasible else outcome_class(False, outcome.failed.values()),
        )
        if self.planner is not None and names:
            self.planner.notify_filtered(demand.pod.key, bool(outcome.feasible))
        failed = outcome.failed
        if self.legacy_failed_nodes:  # see __init__; this call's own dict: merged in place
            failed.update(outcome.unresolvable)
        if sent is not None:
            keep = set(outcome.feasible)
            items = [n for n in sent if _node_name(n) in keep]
            return ExtenderFilterResult(
                Nodes=NodeList(items=items),
                FailedNodes=failed,
                FailedAndUnresolvableNodes=outcome.unresolvable,
            )
        # Built from the core's own lists of str: validating thousands of names again costs a lot.
        return ExtenderFilterResult.model_construct(
            NodeNames=outcome.feasible,
            FailedNodes=failed,
            FailedAndUnresolvableNodes=outcome.unresolvable,
        )

    def _note_filtered(self, demand: Demand) -> None:
        """Keep what kube-scheduler's copy of the pod asked, for its bind (at most DEMANDS_CACHED
        pods, oldest dropped first)."""
        filtered = self._filtered
        filtered.pop(demand.pod.key, None)
        filtered[demand.pod.key] = demand
        while len(filtered) > DEMANDS_CACHED:
            del filtered[next(iter(filtered))]

    def _keep_nominated_room(self, demand: Demand, outcome: FilterOutcome) -> FilterOutcome:
        """Refuse the feasible nodes where pods kube-scheduler nominated there after preempting
        for them would no longer fit beside this pod (`placement.nominated`): only those nodes
        are looked at."""
        by_node: dict[str, list[Demand]] = {}
        feasible = set(outcome.feasible)
        for key, node in self.cluster.nominated.items():
            pod = self.cluster.pod(key) if node in feasible else None
            if pod is None:
                continue
            try:
                by_node.setdefault(node, []).append(self._demand(pod))
            except DemandError:
                continue
        held = held_for_nominated(self.ledger, demand, by_node)
        if not held:
            return outcome
        return FilterOutcome(
            [n for n in outcome.feasible if n not in held],
            {**outcome.failed, **held},
            outcome.unresolvable,
            outcome.explain_all,
        )

    # ----- prioritize --------------------------------------------------------------------------
    def prioritize(self, args: ExtenderArgs) -> Sequence[HostPriority]:
        sent = args.Nodes.items if args.Nodes is not None else None
        names = [_node_name(n) for n in sent] if sent is not None else (args.NodeNames or [])
        try:
            demand = self._demand(args.Pod)
        except DemandError:
            return [HostPriority(Host=n, Score=0) for n in names]
        for node in sent or ():
            self.cluster.upsert_node(node)
        if not demand.wants_gpu:
            return [HostPriority(Host=n, Score=0) for n in names]
        key = demand.pod.key
        planned = (
            self.planner.planned_node(key, names, demand) if self.planner is not None else None
        )
        now = time.monotonic()
        node_names, rows, scores = score_rows(
            self.ledger, demand, names, planned, avoid=self._recent_choices(key, now)
        )
        top = np.flatnonzero(scores == MAX_SCORE)
        self._chosen.pop(key, None)  # re-inserted last: the dict stays in time order
        if len(top):
            self._chosen[key] = (str(node_names[rows[top[0]]]), now)
        return ScoredHosts(node_names, rows, scores)

    def _recent_choices(self, key: str, now: float) -> set[str]:
        """Nodes given 10 in the last CHOSEN_TTL seconds to other pods whose bind has not come yet.
        Older entries (a pod kube-scheduler did not bind after all) are dropped from the front."""
        chosen = self._chosen
        while chosen:
            first, (_, when) = next(iter(chosen.items()))
            if now - when <= CHOSEN_TTL:
                break
            del chosen[first]
        return {node for k, (node, _) in chosen.items() if k != key}

    # ----- bind ----------------------------------------------------------------------------------
    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        key = f"{args.PodNamespace}/{args.PodName}"
        if self.cluster.pod(key) is None:
            # live mode: kube-scheduler can be faster than the pod watch
            error = await self.pods.fetch(args.PodNamespace, args.PodName)
            if error is not None:
                return ExtenderBindingResult(Error=error)
        self._chosen.pop(key, None)
        pod = self.cluster.pod(key)
        if pod is None:
            return ExtenderBindingResult(Error=f"pod {key} is unknown to vramsched")
        scheduler = (pod.get("spec") or {}).get("schedulerName") or "default-scheduler"
        if (
            scheduler != self.cluster.scheduler_name
        ):  # kube-scheduler only sends its own pods; anyone else is refused
            return ExtenderBindingResult(
                Error=f"pod {key} belongs to scheduler {scheduler!r}, not {self.cluster.scheduler_name!r}"
            )
        ref = pod_ref(pod)
        if args.PodUID and ref.uid and args.PodUID != ref.uid:
            return ExtenderBindingResult(
                Error=f"pod {key} has UID {ref.uid}, not {args.PodUID} (re-created?)"
            )
        if self.ledger.node(args.Node) is None:
            return ExtenderBindingResult(Error=f"node {args.Node} is unknown to vramsched")
        flight = self._in_flight.get(key)
        if flight is not None:
            node, uid, outcome = flight
            if node == args.Node and uid == ref.uid:
                return await asyncio.shield(outcome)  # kube-scheduler's retry of a slow bind
            return ExtenderBindingResult(
                Error=f"pod {key} (UID {uid or '?'}) is being bound to {node}"
            )
        bound_to = (pod.get("spec") or {}).get("nodeName")
        if bound_to:
            if bound_to == args.Node:
                return ExtenderBindingResult()  # a retried bind that already landed
            return ExtenderBindingResult(Error=f"pod {key} is already bound to {bound_to}")
        try:
            demand = self._demand(pod)
        except DemandError as exc:
            return ExtenderBindingResult(Error=str(exc))
        filtered = self._filtered.get(key)
        if filtered is not None and filtered.pod == ref and not asks_same_gpus(filtered, demand):
            # The pod was edited (its model-memory) and kube-scheduler's copy and the one bind
            # reads are on either side of the edit: neither booking nor the nodes filter chose
            # can be trusted. Once both copies have the edit, the next cycle agrees.
            return ExtenderBindingResult(
                Error=f"pod {key} changed while being scheduled: filter saw it ask"
                f" {filtered.describe()}, it now asks {demand.describe()}; retry"
            )
        reservation: Reservation | None = None
        created = (
            False  # a hold this call took; one reused from an earlier bind outlives our failure
        )
        inv = self.ledger.node(args.Node)
        if demand.wants_gpu and inv is not None and inv.problem and is_plugin_served(inv.labels):
            # Nothing on that node would hand the pod its GPUs (plugin down, unregistered, GPU
            # gone): never report a bind that the kubelet would then fail.
            return ExtenderBindingResult(Error=f"node {args.Node} cannot serve GPUs: {inv.problem}")
        if demand.wants_gpu:
            self.ledger.expire()
            held = self.ledger.reservation(key)
            if (
                held is not None
                and held.node == args.Node
                and books_demand(self.ledger, demand, held)
            ):
                reservation = held  # retry of a bind still in flight or assumed
            else:
                if held is not None:
                    if held.assumed:
                        # An earlier bind whose outcome is unknown (a timeout) may have landed there:
                        # freeing its devices now could double-book them when its watch event arrives.
                        # So may one made before the pod's model-memory was edited.
                        return ExtenderBindingResult(
                            Error=f"pod {key} may already be bound to {held.node} (unconfirmed); retry later"
                        )
                    self.ledger.release(key)
                try:
                    reservation = self._reserve(demand, args.Node)
                except LedgerError as exc:
                    return ExtenderBindingResult(
                        Error=f"pod {key} does not fit on {args.Node}: {exc}"
                    )
                created = True
        settled: asyncio.Future[ExtenderBindingResult] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = (args.Node, ref.uid, settled)
        result = ExtenderBindingResult(Error=f"binding {key} to {args.Node} was interrupted")
        try:
            await self.binder.bind(pod, args.Node, reservation)
            result = ExtenderBindingResult()
        except BindError as exc:
            # An uncertain outcome (timeout) keeps the assumed hold: the Binding may have landed.
            # A hold reused from an earlier bind (which may have landed) waits for its watch event or TTL.
            if created and not getattr(exc, "keep_reservation", False):
                current = self.ledger.reservation(key)
                if current is reservation:
                    self.ledger.release(key)
            result = ExtenderBindingResult(Error=f"binding {key} to {args.Node} failed: {exc}")
        finally:
            del self._in_flight[key]
            settled.set_result(result)
        return result

    def _reserve(self, demand: Demand, node: str) -> Reservation:
        """Reserve the planned devices when they are still free, the device plugin's bound allows
        them (plans are made on per-device books alone) and they book what the pod asks now (a
        plan made before its `model-memory` was edited does not), else best fit on that node."""
        planned = (
            self.planner.planned_reservation(demand.pod.key, node)
            if self.planner is not None
            else None
        )
        if (
            planned is not None
            and books_demand(self.ledger, demand, planned)
            and self.ledger.fits(planned) is None
            and plugin_allows(self.ledger, demand, planned)
        ):
            candidate: Reservation | str = planned
        else:
            if planned is not None:
                self.plan_refused_at_bind += 1
            candidate = choose_devices(self.ledger, demand, node)
        if isinstance(candidate, str):
            raise LedgerError(candidate)
        candidate.assumed = True
        candidate.expires_at = time.monotonic() + self.assume_ttl
        return self.ledger.reserve(candidate)

    # ----- delete --------------------------------------------------------------------------------
    def delete_pod(self, namespace: str, name: str) -> tuple[str, str] | None:
        """`kubectl delete pod` for the embedded cluster (`PodFeed.delete`): None when done, else
        (why: "live" | "unknown" | "binding", message)."""
        return self.pods.delete(namespace, name)

    # ----- preempt ---------------------------------------------------------------------------------
    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        demand = self._demand(
            args.Pod
        )  # DemandError -> 400 in the adapter: preempt has no Error field
        candidates: dict[str, list[str]] = {}
        pdb: dict[str, int] = {}
        if args.NodeNameToMetaVictims is not None:
            for node, meta in args.NodeNameToMetaVictims.items():
                candidates[node] = [p.UID for p in meta.Pods]
                pdb[node] = meta.NumPDBViolations
        elif args.NodeNameToVictims is not None:
            for node, full in args.NodeNameToVictims.items():
                candidates[node] = [_pod_uid(p) for p in full.Pods]
                pdb[node] = full.NumPDBViolations
        chosen = preempt_victims(self.ledger, demand, candidates)
        return ExtenderPreemptionResult(
            NodeNameToMetaVictims={
                node: MetaVictims(
                    Pods=[MetaPod(UID=u) for u in uids], NumPDBViolations=pdb.get(node, 0)
                )
                for node, uids in chosen.items()
                # a placeholder that needs nobody gone passes through (kubernetes PR 135486)
                if uids or not candidates.get(node)
            }
        )

    # ----- state -----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The ledger for people and tools: per node, per GPU (and per MIG slice) who holds what."""
        ledger = self.ledger
        nodes = state_nodes(usage_from_ledger(ledger, self.cluster.pods))
        allocated, capacity = ledger.totals()
        return {
            "nodes": nodes,
            "allocatedBytes": allocated,
            "capacityBytes": capacity,
            "pending": sorted(self.cluster.pending),
            "nominated": dict(sorted(self.cluster.nominated.items())),
            "planner": self.planner_state(),
        }

    def metric_collectors(self) -> list[Collector]:
        """Extra /metrics collectors; a wrapper adds its own (live mode: bind events)."""
        return []

    def planner_state(self) -> dict[str, Any] | None:
        """The background planner's counters (None when it is off): plans made, entries held,
        the last plan's status, gap, size and seconds, `hits` (binds handed a planned
        reservation), `refusedAtBind` (of those, not taken), `stale` entries and `errors`."""
        if self.planner is None:
            return None
        return {**self.planner.state(), "refusedAtBind": self.plan_refused_at_bind}
