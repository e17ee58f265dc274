"""Live repacking (`vramsched serve --repack`): evict a few movable pods so that a pod that fits
nowhere gets the GPUs they free, and their controllers' new pods go where the plan said.

The adapter of the pure pieces: `extender.planner.repack` finds the fewest moves,
`extender.repack_policy` says which pods may move, what the budget allows and whether a plan
still holds, `extender.repack_holds` keeps the freed GPUs held while the plan runs. This module
makes the API calls (Evictions, Events, one annotation) and runs one plan at a time:

1. **Trigger.** A pod filter found no node for (`notify_filtered`) that has waited `after`
   seconds, highest priority first, when the budget allows a move, this replica's
   kube-scheduler leads, and the pod was not tried in the last `retry` seconds.
2. **Plan** in a worker thread on a copy of the ledger, at most `allowance` moves, only pods
   `repack_policy.movable` accepts. Checked back on the event loop against the live ledger
   (`final_state_fits`, `final_state_problem`: the device plugin's bound, the pin rule) and
   kube-scheduler's own rules for every target (`schedulable_on`, and `plan_target_problem`: the
   pod count, host ports, the resources a plan does not book, inter-pod affinity, topology
   spread, with the scheduler profile's ignored resources, default spread constraints and added
   node affinity: the Services and controllers the defaults select by are read per plan,
   `spread_reads`). The plan itself keeps the blocked pod and the moved pods to the nodes
   `schedulable_on` allows them, volumes included: the claims of the blocked pod and of every
   pod marked movable are read first (`_storage`; one that cannot be read keeps its pod put),
   with the lists CSI attach limits need when one of them has CSI volumes, and once a plan sends
   such pods somewhere, the claims of the pods on their targets (`storage_reads.StorageReads`,
   `attach_limits`).
3. **Dry run** every eviction (`dryRun=All`: the API server checks PodDisruptionBudgets and
   changes nothing). A refusal (429: a budget allows no disruption now) plans again without that
   pod, up to `attempts` plans; nothing has been evicted yet.
4. **Evict** through the Eviction API, one pod at a time (PodDisruptionBudgets hold), with an
   Event on each evicted pod. A 429 that the dry run did not predict (two moved pods under one
   budget, or it changed meanwhile) is retried for `eviction_retry` seconds; then the plan is
   **abandoned**: the holds are released, the blocked pod gets a Warning Event and the log says
   how many pods were evicted, so a half-done plan is never silent. The evicted pods are
   re-created by their controllers and placed as usual.
5. **Hold** (`RepackRun`): the targets and the blocked pod's placement are held in the ledger as
   soon as they fit, filter offers each pod its held node alone, bind reserves exactly the held
   devices. Each pod whose hold is taken is annotated `vramsched.io/nominated-node` (an update,
   so kube-scheduler retries it at once). Holds lapse `hold_ttl` seconds after the moved pods
   had to be gone.

Only the leader's plans run (`leader`: the replica whose kube-scheduler holds the Lease). State
is in memory: a restart mid-plan drops its holds, and the re-created pods are placed as usual.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extender.background_task import BackgroundTask
from extender.cluster import ClusterState
from extender.demand import Demand, DemandError, PodRef, pod_demand, pod_ref
from extender.ledger import Ledger, Reservation
from extender.live.api_client import ApiError, KubeApi, annotation_patch
from extender.live.events import EventRecorder
from extender.live.evictions import Evict
from extender.live.spread_reads import read_spread_defaults
from extender.live.storage_reads import StorageReads
from extender.object_fields import version_of
from extender.placement import (
    HostRoom,
    PreemptionPlan,
    filter_nodes,
    plan_preemption,
    plugin_allows,
)
from extender.planner.capacity import Capacity, FragIndex, Kind, Workload
from extender.planner.model import SEQUENTIAL_RULE
from extender.planner.repack import final_state_fits
from extender.preemption_policy import (
    PREEMPTED_REASON,
    may_preempt,
    preempted_message,
    preempting_message,
    preemption_abandoned_message,
    victim_problem,
)
from extender.repack_holds import RepackRun, TargetState
from extender.repack_policy import (
    ABANDONED_REASON,
    NOMINATED,
    Controller,
    MoveBudget,
    PlannedMove,
    abandoned_message,
    eviction_body,
    eviction_message,
    final_state_problem,
    movable,
    nominated_message,
    plan_target_problem,
    repack_event,
    withdrawn,
)
from extender.scheduler_profile import SchedulerProfile
from extender.spread_defaults import SpreadDefaults
from extender.target_rules import node_masks, schedulable_on, target_problem
from extender.volume_rules import Storage

__all__ = ["Repacker", "RepackCollector"]

log = logging.getLogger(__name__)

#: movable pods named in a "no plan" message when rules keep them to their nodes
KEPT_NAMED = 5
#: evictions of one pod asked again after a 409 while it still consents (a status update
#: landed after the watch copy whose consent was read)
CONFLICTS = 3


class PlanFn(Protocol):
    """`extender.planner.repack.plan_repack`'s signature (tests hand in a scripted one)."""

    def __call__(
        self,
        cap: Capacity,
        pod: Demand,
        running: Sequence[tuple[Demand, Reservation]],
        *,
        movable: Callable[[Demand], bool] | None = None,
        max_moves: int | None = None,
        time_limit: float = 1.0,
        num_workers: int = 2,
        place_rule: str | None = None,
        frag: FragIndex | None = None,
        pod_nodes: np.ndarray | None = None,
        target_nodes: Callable[[Demand], np.ndarray | None] | None = None,
    ) -> Any: ...


@dataclass
class RepackStats:
    moves: int = 0
    started: int = 0
    done: int = 0
    abandoned: int = 0
    #: a dry run refused every plan found (PodDisruptionBudgets), or a target was unusable
    refused: int = 0
    #: no plan within the budget
    none: int = 0
    #: the plan no longer held on the live ledger when it came back
    stale: int = 0
    errors: int = 0
    #: preemptions started (`--preempt`), and the pods they evicted
    preemptions: int = 0
    preempted: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Repacker:
    """Runs live repacking; owned by the event loop (see the module docstring)."""

    def __init__(
        self,
        cluster: ClusterState,
        api: KubeApi,
        evict: Evict,
        *,
        plan: PlanFn,
        budget: MoveBudget,
        events: EventRecorder | None = None,
        leader: Callable[[], bool | None] = lambda: True,
        after: float = 5.0,
        retry: float = 15.0,
        hold_ttl: float = 120.0,
        eviction_retry: float = 30.0,
        retry_interval: float = 2.0,
        release_slack: float = 60.0,
        attempts: int = 3,
        time_limit: float = 1.0,
        num_workers: int = 2,
        open_cost: float = 0.0,
        tick: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        eviction_version: str = "policy/v1",
        profile: SchedulerProfile | None = None,
        repack: bool = True,
        preempt: bool = False,
    ) -> None:
        self.cluster = cluster
        self.api = api
        self.reads = StorageReads(api, self._call)
        self.evict = evict
        self.plan = plan
        self.budget = budget
        self.events = events if events is not None else EventRecorder(api)
        self.leader = leader
        self.after = after
        self.retry = retry
        self.hold_ttl = hold_ttl
        self.eviction_retry = eviction_retry
        self.retry_interval = retry_interval
        self.release_slack = release_slack
        self.attempts = attempts
        self.time_limit = time_limit
        self.num_workers = num_workers
        self.open_cost = open_cost
        self.tick = tick
        self.clock = clock
        self.eviction_version = eviction_version
        #: the scheduler profile's arguments the target checks read (`--scheduler-config`)
        self.profile = profile if profile is not None else SchedulerProfile()
        #: `--repack`: move movable pods; `--preempt`: evict pods of lower priority (tried when
        #: no move plan places the pod, or with repacking off)
        self.repack = repack
        self.preempt = preempt
        self.instance = socket.gethostname()
        self.stats = RepackStats()
        self.run: RepackRun | None = None
        self.last: dict[str, Any] | None = None
        #: pods filter found no node for: when first seen so
        self._blocked: dict[str, float] = {}
        #: pods not to try again before this time
        self._retry_at: dict[str, float] = {}
        #: the last "no plan now" message per pod: an Event only when it changes
        self._told: dict[str, str] = {}
        self._wake: asyncio.Event | None = None
        self._task = BackgroundTask("vramsched-repack", self._loop)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="repack")

    # ----- what the verbs tell it and ask it ------------------------------------------------------
    def notify_filtered(self, pod_key: str, fits: bool) -> None:
        if fits:
            self._blocked.pop(pod_key, None)
            return
        if pod_key not in self._blocked:
            self._blocked[pod_key] = self.clock()
            if self._wake is not None:
                self._wake.set()

    def nominated(self, pod_key: str) -> Reservation | None:
        """The placement a running plan holds (or will hold) for this pod, after settling."""
        run = self.run
        if run is None:
            return None
        res = run.nominated(pod_key, self.clock())
        if run.pokes and self._wake is not None:
            self._wake.set()
        return res

    def planned_reservation(self, pod_key: str, node: str) -> Reservation | None:
        """For bind when the pod holds nothing yet: the nominated devices, under its own key."""
        res = self.nominated(pod_key)
        pod = self.cluster.pod(pod_key)
        if res is None or res.node != node or pod is None:
            return None
        return replace(res, pod=pod_ref(pod), assumed=False, expires_at=None)

    # ----- the loop -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task.task is None:
            self._wake = asyncio.Event()
            self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.events.close()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.tick)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.step()
            except Exception:  # repacking is an optimisation: never stop the server
                self.stats.errors += 1
                log.exception("repack step failed")

    async def step(self) -> None:
        """One turn: move the running plan on, or start one."""
        now = self.clock()
        self.cluster.ledger.expire(now)
        if self.run is not None:
            await self._progress(now)
            return
        if self.leader() is not True:
            return
        key = self._candidate(now)
        if key is not None:
            await self._attempt(key, now)

    def _candidate(self, now: float) -> str | None:
        pending = self.cluster.pending
        for key in [k for k in self._blocked if k not in pending]:
            del self._blocked[key]
            self._told.pop(key, None)
        for key in [k for k, t in self._retry_at.items() if t <= now]:
            del self._retry_at[key]
        if self.budget.allowance() <= 0 and not self.preempt:
            return None
        best: tuple[int, float, str] | None = None
        for key, since in self._blocked.items():
            if now - since < self.after or key in self._retry_at:
                continue
            pod = self.cluster.pod(key)
            if pod is None:
                continue
            rank = (-int((pod.get("spec") or {}).get("priority") or 0), since, key)
            if best is None or rank < best:
                best = rank
        return best[2] if best is not None else None

    # ----- one attempt: plan, check, dry-run, evict ---------------------------------------------
    async def _attempt(self, key: str, now: float) -> None:
        pod = self.cluster.pod(key)
        self._retry_at[key] = now + self.retry
        try:
            demand = pod_demand(pod or {}, headroom=self.cluster.headroom)
        except DemandError:
            return
        if not demand.wants_gpu:
            return
        if self.repack and self.budget.allowance(demand.gpu_count) > 0:
            if await self._repack(key, demand, now):
                return
        if self.preempt:
            await self._preempt(key, demand)

    async def _repack(self, key: str, demand: Demand, now: float) -> bool:
        """Plan, check, dry-run and start a repack for the pod; True when it started one, or
        when none is needed or the plan went stale (the next turn sees), False when there is
        no plan now."""
        storage, excluded = await self._storage(dict(self.cluster.pods), key)
        spread_lists: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for _ in range(self.attempts):
            allowance = self.budget.allowance(demand.gpu_count)
            if allowance <= 0:
                return False
            cap = Capacity.from_ledger(
                self.cluster.ledger.clone(), self.cluster.cpu_used, self.cluster.memory_used
            )
            pods = dict(self.cluster.pods)
            mix = Counter(self.cluster.demand_mix)
            # per pod, the nodes kube-scheduler's labels, taints, cordon and its volumes let it
            # onto: the blocked pod's worked out here, the moved pods' in the worker, on copies
            masks = node_masks(
                dict(self.cluster.nodes), pods, cap.arrays.node_names, storage, self.profile
            )
            pod_nodes = masks(key)
            loop = asyncio.get_running_loop()
            found, controllers = await loop.run_in_executor(
                self._pool,
                self._solve,
                cap,
                demand,
                pods,
                mix,
                frozenset(excluded),
                allowance,
                pod_nodes,
                masks,
            )
            if found is None:
                # no plan at all, or none without the pods that refused (a budget, a rule)
                if excluded:
                    self.stats.refused += 1
                else:
                    self.stats.none += 1
                kept = self._kept_to_their_nodes(cap, controllers, masks)
                message = self._none_message(allowance, excluded, kept)
                if pod_nodes is not None and not pod_nodes.any():
                    nowhere = self._nowhere(pods.get(key) or {}, cap.arrays.node_names, storage)
                    message += f"; {nowhere}"
                self._tell(demand.pod, message)
                return False
            if not found.moves:
                return True  # it fits now: kube-scheduler's next try places it
            moves = [
                PlannedMove(m.pod, m.demand, m.source, m.target, controllers[m.pod.key])
                for m in found.moves
            ]
            sent = [(self.cluster.pod(key) or {}, found.placement.node)] + [
                (self.cluster.pod(m.pod.key) or {}, m.target.node) for m in moves
            ]
            # attach limits on the targets: read only when a pod sent there has volumes to count
            storage = await self.reads.for_targets(
                storage, dict(self.cluster.pods), sent, {m.pod.key for m in moves}
            )
            # the profile's default spread: read only when a pod sent somewhere gets it
            spread, unread = await read_spread_defaults(
                self.api,
                self._call,
                self.profile.default_spread,
                [p for p, _ in sent],
                spread_lists,
            )
            if unread is not None:
                self.stats.refused += 1
                self._tell(demand.pod, f"no repack now: {unread}")
                return False
            problem = self._check(demand, found, moves, storage, spread)
            if problem is not None:
                kind, what, who = problem
                if kind == "stale":
                    self.stats.stale += 1
                    self._retry_at[key] = now + min(self.retry, 2.0)
                    log.info("repack plan stale", extra={"fields": {"pod": key, "why": what}})
                    return True
                if who is None:
                    self.stats.refused += 1
                    self._tell(demand.pod, f"no repack now: {what}")
                    return False
                excluded[who] = what
                continue
            refused = await self._dry_run([m.pod for m in moves])
            if refused:
                excluded.update(refused)
                continue
            await self._execute(demand, found.placement, moves)
            return True
        self.stats.refused += 1
        self._tell(
            demand.pod, self._none_message(self.budget.allowance(demand.gpu_count), excluded)
        )
        return False

    def _solve(
        self,
        cap: Capacity,
        blocked: Demand,
        pods: Mapping[str, Mapping[str, Any]],
        mix: Counter[Kind],
        excluded: frozenset[str],
        allowance: int,
        pod_nodes: np.ndarray | None = None,
        masks: Callable[[str], np.ndarray | None] | None = None,
    ) -> tuple[Any, dict[str, Controller]]:
        """In a worker thread, on private copies: the running pods, which may move, the plan.
        Moved pods land where the planner would put them (`SEQUENTIAL_RULE` on FGD's measure,
        weighed by `mix`, the cluster's pods of ours as the planner weighs them, with
        `--open-gpu-cost`), as in the simulator's planner+repack, rather than at their best fit."""
        running: list[tuple[Demand, Reservation]] = []
        controllers: dict[str, Controller] = {}
        for res in cap.ledger.reservations():
            pod = pods.get(res.key)
            if pod is None:
                continue
            try:
                d = pod_demand(pod, headroom=self.cluster.headroom)
            except DemandError:
                continue
            running.append((d, res))
            if res.key in excluded or res.key == blocked.pod.key or not d.wants_gpu:
                continue
            c = movable(pod)
            if isinstance(c, Controller):
                controllers[res.key] = c
        found = self.plan(
            cap,
            blocked,
            running,
            movable=lambda d: d.pod.key in controllers,
            max_moves=allowance,
            time_limit=self.time_limit,
            num_workers=self.num_workers,
            place_rule=SEQUENTIAL_RULE,
            # the blocked pod is one of ours, pending, so `mix` counts it: never empty
            frag=FragIndex(
                cap, Workload.from_counts(mix), count_foreign=False, open_cost=self.open_cost
            ),
            pod_nodes=pod_nodes,
            target_nodes=(lambda d: masks(d.pod.key)) if masks is not None else None,
        )
        return found, controllers

    def _check(
        self,
        blocked: Demand,
        found: Any,
        moves: Sequence[PlannedMove],
        storage: Storage,
        spread: SpreadDefaults | None = None,
    ) -> tuple[str, str, str | None] | None:
        """Whether the plan still holds now and kube-scheduler would let every pod where it goes:
        None, or (kind, why, the moved pod to leave out next time or None)."""
        c = self.cluster
        cap = Capacity.from_ledger(c.ledger.clone(), c.cpu_used, c.memory_used)
        if not final_state_fits(cap, found):
            return "stale", "the cluster changed while planning", None
        why = final_state_problem(c.ledger, blocked, found.placement, moves)
        if why is not None:
            return "stale", why, None
        pod = c.pod(blocked.pod.key)
        node = c.nodes.get(found.placement.node)
        if pod is None or node is None:
            return "stale", "the pod or its node is gone", None
        refusal = schedulable_on(pod, node, storage, self.profile)
        if refusal is not None:
            return "refused", f"the plan puts it where it may not run ({refusal})", None
        for m in moves:
            moved, target = c.pod(m.pod.key), c.nodes.get(m.target.node)
            if moved is None or target is None:
                return "stale", f"pod {m.pod.key} or node {m.target.node} is gone", None
            refusal = schedulable_on(moved, target, storage, self.profile)
            if refusal is not None:
                return "refused", f"pod {m.pod.key} may not move there: {refusal}", m.pod.key
        problem = plan_target_problem(
            c.nodes,
            c.pods,
            pod,
            found.placement,
            moves,
            storage,
            profile=self.profile,
            spread=spread,
        )
        if problem is not None:
            why, who = problem
            what = (
                f"pod {who} may not move there" if who else "the plan puts it where it may not run"
            )
            return "refused", f"{what}: {why}", who
        return None

    async def _storage(
        self, pods: Mapping[str, Mapping[str, Any]], blocked: str
    ) -> tuple[Storage, dict[str, str]]:
        """The claims and volumes of the blocked pod and of every movable pod (`movable`) that holds
        GPUs (`StorageReads.for_pods`), and the movable pods whose claims or volumes the API did
        not answer for (no RBAC, a timeout) with why: those stay where they are, since vramsched
        cannot tell where their volumes reach."""
        holding = {r.key for r in self.cluster.ledger.reservations()}
        wanted = [
            key
            for key, pod in pods.items()
            if key == blocked or (key in holding and isinstance(movable(pod), Controller))
        ]
        return await self.reads.for_pods(pods, wanted, blocked)

    async def _dry_run(self, pods: Sequence[PodRef]) -> dict[str, str]:
        """Ask the API server whether each eviction would be accepted now; nothing changes."""
        refused: dict[str, str] = {}
        for pod in pods:
            try:
                await self._call(self._evict, pod, True)
            except ApiError as exc:
                refused[pod.key] = _refusal(exc)
        if refused:
            log.info("repack dry run refused", extra={"fields": {"pods": refused, "evicted": 0}})
        return refused

    async def _execute(
        self, blocked: Demand, placement: Reservation, moves: Sequence[PlannedMove]
    ) -> None:
        now = self.clock()
        grace = max(_grace(self.cluster.pod(m.pod.key)) for m in moves)
        run = RepackRun(
            self.cluster,
            blocked,
            placement,
            [TargetState(m) for m in moves],
            deadline=now + len(moves) * self.eviction_retry + grace + self.release_slack,
            ttl=self.hold_ttl,
            known_pending=frozenset(self.cluster.pending),
        )
        self.run = run
        self.stats.started += 1
        log.info("repack plan", extra={"fields": run.summary()})
        run.settle(now)
        for i, t in enumerate(run.targets, start=1):
            t.evicted = True  # before the call: the controller's new pod may show up first
            error = await self._evict_retrying(t.move.pod)
            if error is not None:
                t.evicted = False
                self._abandon(run, f"eviction of {t.move.pod.key} refused: {error}")
                return
            self.budget.spend(1)
            self.stats.moves += 1
            message = eviction_message(blocked, placement, t.move, i, len(run.targets))
            self.events.emit(
                t.move.pod.namespace, repack_event(t.move.pod, message, time.time(), self.instance)
            )
            log.info(
                "repack evicted",
                extra={"fields": {"pod": t.move.pod.key, "for": blocked.pod.key, "move": i}},
            )
        run.phase = "releasing"
        run.settle(self.clock())
        await self._progress(self.clock())

    # ----- preemption by VRAM (`--preempt`) ------------------------------------------------------
    async def _preempt(self, key: str, demand: Demand) -> None:
        """Evict the fewest pods of lower priority that make room for the pod on one node
        (`plan_preemption`), when it may preempt (`may_preempt`) and would not fit once the
        pods already leaving are gone. Nodes are those kube-scheduler's labels, taints, cordon
        and volumes let it onto; the victims free the pod's VRAM, CPU and memory there
        (`HostRoom`), and the node's other rules (pod count, ports, affinity, spread) are
        checked with them gone. A refused dry run (a PodDisruptionBudget) plans again without
        that pod."""
        pod = self.cluster.pod(key)
        if pod is None or may_preempt(pod) is not None:
            return
        if not any(r.priority < demand.priority for r in self.cluster.ledger.reservations()):
            return  # nobody to preempt: no Event for every pod of the lowest priority
        pods = dict(self.cluster.pods)
        storage, _ = await self.reads.for_pods(pods, [key], key)
        ledger, leaving = _without_leaving(self.cluster.ledger, pods, demand.priority)
        names = list(ledger.arrays.node_names)
        mask = node_masks(dict(self.cluster.nodes), pods, names, storage, self.profile)(key)
        allowed = [n for i, n in enumerate(names) if mask is None or bool(mask[i])]
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(self._pool, _fits_any, ledger, demand, allowed):
            return  # room once the leaving pods are gone: kube-scheduler's next try
        excluded: dict[str, str] = {}
        spread_lists: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        spread, unread = await read_spread_defaults(
            self.api, self._call, self.profile.default_spread, [pod], spread_lists
        )
        if unread is not None:
            self._tell(demand.pod, f"no preemption now: {unread}")
            return

        def eligible(res: Reservation) -> bool:
            return (
                res.key not in excluded
                and victim_problem(res, pods.get(res.key), demand.priority) is None
            )

        host = self._host_room(pods, leaving)

        for _ in range(self.attempts + len(allowed)):
            # on the worker thread (a pass over every node it may use), on the private copy
            plan = await loop.run_in_executor(
                self._pool,
                lambda: plan_preemption(
                    ledger, demand, nodes=list(allowed), eligible=eligible, host=host
                ),
            )
            if plan is None:
                break
            gone = {v.key for v in plan.victims} | set(leaving)
            problem = target_problem(
                self.cluster.nodes,
                pods,
                [(None, pod, plan.node)],
                gone,
                storage,
                profile=self.profile,
                spread=spread,
            )
            if problem is not None:
                allowed.remove(plan.node)  # the node refuses it for more than VRAM
                continue
            refused = await self._dry_run([v.pod for v in plan.victims])
            if refused:
                excluded.update(refused)
                continue
            if (why := self._preemption_stale(demand, plan)) is not None:
                self.stats.stale += 1
                log.info("preemption plan stale", extra={"fields": {"pod": key, "why": why}})
                return  # tried again after `retry`, on the cluster as it is then
            await self._execute_preemption(demand, plan)
            return
        left_out = "; ".join(f"{k}: {v}" for k, v in sorted(excluded.items()))
        self._tell(
            demand.pod,
            "no preemption now: no pods of lower priority whose eviction frees enough VRAM on "
            "a node it may use" + (f" (left out: {left_out})" if left_out else ""),
        )

    def _host_room(self, pods: Mapping[str, Mapping[str, Any]], leaving: list[str]) -> HostRoom:
        """The CPU and memory each node has free, the terminating pods' counted as free (they
        are going), and what each pod holds: the victims must free the pod's cores and memory
        too (the ledger books GPUs only; a repack plan books CPU and memory in its model)."""
        c = self.cluster
        cap = Capacity.from_ledger(c.ledger, c.cpu_used, c.memory_used)
        names = c.ledger.arrays.node_names
        free = {n: (int(cap.cpu_free[r]), int(cap.mem_free[r])) for r, n in enumerate(names)}
        parsed: dict[str, tuple[int, int]] = {}

        def held(res: Reservation) -> tuple[int, int]:
            if res.key not in parsed:
                try:
                    d = pod_demand(pods.get(res.key) or {}, headroom=c.headroom)
                    parsed[res.key] = (d.cpu_milli, d.memory_bytes)
                except DemandError:
                    parsed[res.key] = (0, 0)  # unreadable: counted as freeing nothing
            return parsed[res.key]

        for key in leaving:
            res = c.ledger.reservation(key)
            if res is not None and res.node in free:
                cpu, memory = held(res)
                free[res.node] = (free[res.node][0] + cpu, free[res.node][1] + memory)
        return HostRoom(free, held)

    def _preemption_stale(self, preemptor: Demand, plan: PreemptionPlan) -> str | None:
        """Why the plan no longer holds on the live ledger (it was made on a copy, before the
        API calls since), or None: the pod's placement must fit once the victims and the pods
        leaving already are gone, within the device plugin's bound."""
        after, _ = _without_leaving(self.cluster.ledger, self.cluster.pods, preemptor.priority)
        for v in plan.victims:
            held = after.reservation(v.key)
            if held is None or held.pod.uid != v.pod.uid:
                return f"victim {v.key} changed while planning"
            after.release(v.key)
        if (why := after.fits(plan.placement)) is not None:
            return why
        if not plugin_allows(after, preemptor, plan.placement):
            return "the device plugin's bound no longer allows the placement"
        return None

    async def _execute_preemption(self, preemptor: Demand, plan: PreemptionPlan) -> None:
        now = self.clock()
        victims = [v.pod for v in plan.victims]
        grace = max(_grace(self.cluster.pod(v.key)) for v in victims)
        run = RepackRun(
            self.cluster,
            preemptor,
            plan.placement,
            [],
            deadline=now + len(victims) * self.eviction_retry + grace + self.release_slack,
            ttl=self.hold_ttl,
            known_pending=frozenset(self.cluster.pending),
            preempting=tuple(victims),
        )
        self.run = run
        self.stats.preemptions += 1
        log.info("preemption plan", extra={"fields": {**run.summary(), "victims": victims}})
        run.settle(now)

        def still(ref: PodRef, current: Mapping[str, Any] | None) -> str | None:
            res = self.cluster.ledger.reservation(ref.key)
            if current is None or res is None or res.pod.uid != ref.uid:
                return None  # gone already: nothing to evict
            why = victim_problem(res, current, preemptor.priority)
            return None if why in (None, "terminating", "finished") else f"pod {ref.key}: {why}"

        for i, victim in enumerate(plan.victims, start=1):
            run.victims.append(victim.pod)  # before the call, as for a move
            error = await self._evict_retrying(victim.pod, still)
            if error is not None:
                run.victims.pop()
                self._abandon(run, f"eviction of {victim.key} refused: {error}")
                return
            self.stats.preempted += 1
            message = preempted_message(preemptor, plan.placement, victim.priority, i, len(victims))
            self.events.emit(
                victim.pod.namespace,
                repack_event(
                    victim.pod, message, time.time(), self.instance, reason=PREEMPTED_REASON
                ),
            )
            log.info(
                "preempted",
                extra={"fields": {"pod": victim.key, "for": preemptor.pod.key, "victim": i}},
            )
        run.phase = "releasing"
        run.settle(self.clock())
        await self._progress(self.clock())

    async def _evict_retrying(
        self,
        pod: PodRef,
        still: Callable[[PodRef, Mapping[str, Any] | None], str | None] = withdrawn,
    ) -> str | None:
        """Evict; a 429 is asked again every `retry_interval` for `eviction_retry` seconds. None
        when the pod is evicted (or already gone), else why not.

        Consent is read again before each try, and the Eviction names the version it was read
        from: the plan was made (and the dry run passed) up to minutes earlier, and an owner
        who removed `vramsched.io/movable` since must not see the pod evicted. A 409 (the pod
        changed since the watch copy) reads the pod from the API and asks again if it still
        consents. A preemption passes its own test as `still` (the victim is still of lower
        priority, running)."""
        give_up = self.clock() + self.eviction_retry
        current = self.cluster.pod(pod.key)
        conflicts = 0
        while True:
            if (why := still(pod, current)) is not None:
                return why
            try:
                await self._call(self._evict, pod, False, version_of(current or {}))
                return None
            except ApiError as exc:
                if exc.status == 404:
                    return None
                if exc.status == 409 and current is not None and conflicts < CONFLICTS:
                    conflicts += 1
                    try:
                        current = await self._call(self.api.read_pod, pod.namespace, pod.name)
                    except ApiError as read:
                        if read.status == 404:
                            return None
                        return f"pod {pod.key} changed and cannot be read: {_refusal(read)}"
                    continue
                if exc.status != 429 or self.clock() >= give_up:
                    return _refusal(exc)
            await asyncio.sleep(self.retry_interval)
            current = self.cluster.pod(pod.key)

    def _evict(self, pod: PodRef, dry_run: bool, version: str = "") -> None:
        body = eviction_body(pod, self.eviction_version, version)
        self.evict(pod.namespace, pod.name, body, dry_run)

    # ----- a running plan ---------------------------------------------------------------------------
    async def _progress(self, now: float) -> None:
        run = self.run
        if run is None:
            return
        run.settle(now)
        await self._pokes(run)
        if run.phase == "releasing" and now >= run.deadline:
            leaving = ", ".join(run.leaving()) or "none"
            which = "preempted" if run.preempting else "moved"
            self._abandon(
                run, f"the {which} pods were not all gone in time (still there: {leaving})"
            )
        if self.run is run and not run.active:
            self._finish(run)

    async def _pokes(self, run: RepackRun) -> None:
        """The blocked pod's Event once its GPUs are held, and the annotation on every pod whose
        hold was taken while it waits (kube-scheduler then tries it again at once)."""
        while run.pokes:
            ref = run.pokes.pop(0)
            if ref.key == run.blocked.pod.key:
                res = run.placement
                message = (
                    preempting_message(run.placement, run.preempting)
                    if run.preempting
                    else nominated_message(run.placement, [t.move for t in run.targets])
                )
                self.events.emit(
                    ref.namespace, repack_event(ref, message, time.time(), self.instance)
                )
            else:
                held = [t.move.target for t in run.targets if t.replacement == ref]
                if not held:
                    continue
                res = held[0]
            pod = self.cluster.pod(ref.key)
            if pod is None or (pod.get("spec") or {}).get("nodeName"):
                continue  # bound already: nothing to try again
            patch = annotation_patch(ref.uid, {NOMINATED: res.node})
            try:
                await self._call(self.api.patch_pod, ref.namespace, ref.name, patch)
            except ApiError as exc:
                log.info("cannot annotate %s: %s", ref.key, exc)

    def _abandon(self, run: RepackRun, why: str) -> None:
        evicted = run.abandon(self.clock())
        self.stats.abandoned += 1
        if run.preempting:
            message = preemption_abandoned_message(evicted, len(run.preempting), why)
        else:
            message = abandoned_message(evicted, len(run.targets), why)
        log.warning(
            "repack abandoned",
            extra={
                "fields": {
                    "pod": run.blocked.pod.key,
                    "evicted": [p.key for p in evicted],
                    "moves": len(run.targets),
                    "why": why,
                }
            },
        )
        self.events.emit(
            run.blocked.pod.namespace,
            repack_event(
                run.blocked.pod,
                message,
                time.time(),
                self.instance,
                reason=ABANDONED_REASON,
                warning=True,
            ),
        )
        run.outcome = why
        self._finish(run)

    def _finish(self, run: RepackRun) -> None:
        if run.phase == "done":
            self.stats.done += 1
            log.info("repack done", extra={"fields": run.summary()})
        self.last = run.summary()
        self.run = None

    # ----- helpers ----------------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    def _tell(self, pod: PodRef, message: str) -> None:
        """A Normal Event on the blocked pod saying why no repack runs, once per distinct reason."""
        if self._told.get(pod.key) == message:
            return
        self._told[pod.key] = message
        log.info("repack not possible", extra={"fields": {"pod": pod.key, "why": message}})
        self.events.emit(pod.namespace, repack_event(pod, message, time.time(), self.instance))

    @staticmethod
    def _none_message(allowance: int, excluded: Mapping[str, str], kept: Sequence[str] = ()) -> str:
        text = f"no repack now: no plan within {allowance} move(s) of movable pods"
        if excluded:
            left_out = "; ".join(f"{k}: {v}" for k, v in sorted(excluded.items()))
            text += f" (left out: {left_out})"
        if kept:
            named = ", ".join(kept[:KEPT_NAMED]) + (", ..." if len(kept) > KEPT_NAMED else "")
            text += (
                f"; {len(kept)} movable pod(s) may go to no other node by their node rules "
                f"or volumes: {named}"
            )
        return text

    def _nowhere(self, pod: Mapping[str, Any], names: Sequence[str], storage: Storage) -> str:
        """Why the waiting pod may go to no node of `names`: what keeps it off the first."""
        for name in names:
            why = schedulable_on(pod, self.cluster.nodes.get(name) or {}, storage, self.profile)
            if why is not None:
                return f"the waiting pod may go to no node (on {name}: {why})"
        return "the waiting pod may go to no node"

    def _kept_to_their_nodes(
        self,
        cap: Capacity,
        movers: Mapping[str, Controller],
        masks: Callable[[str], np.ndarray | None],
    ) -> list[str]:
        """The movable pods whose nodeSelector, affinity, taints or volumes allow them no node
        but their own: why a plan may be missing though pods are marked movable."""
        names = list(cap.arrays.node_names)
        if len(names) < 2:
            return []  # nowhere else to go for anyone: no rule to blame
        where = {r.key: r.node for r in cap.ledger.reservations()}
        kept = []
        for key in sorted(movers):
            mask = masks(key)
            own = where.get(key)
            if mask is None or own is None:
                continue
            if not any(bool(mask[i]) for i, n in enumerate(names) if n != own):
                kept.append(key)
        return kept

    def state(self) -> dict[str, Any]:
        """For /state (under `planner.repack`)."""
        return {
            **self.stats.as_dict(),
            "budget": {
                "perGpu": self.budget.per_gpu,
                "perPod": self.budget.per_pod,
                "perMinute": self.budget.per_minute,
                "lastMinute": self.budget.recent(),
            },
            "blocked": sorted(self._blocked),
            "running": self.run.summary() if self.run is not None else None,
            "last": self.last,
            "events": self.events.stats(),
        }


def _without_leaving(
    ledger: Ledger, pods: Mapping[str, Mapping[str, Any]], priority: int
) -> tuple[Ledger, list[str]]:
    """A copy of the ledger without the pods terminating already (their GPUs come free anyway),
    and their keys."""
    after = ledger.clone()
    leaving = []
    for res in list(after.reservations()):
        if victim_problem(res, pods.get(res.key), priority) == "terminating":
            after.release(res.key)
            leaving.append(res.key)
    return after, leaving


def _fits_any(ledger: Ledger, demand: Demand, nodes: Sequence[str]) -> bool:
    """Whether the pod fits one of `nodes` on `ledger` now (on the worker thread)."""
    return bool(filter_nodes(ledger, demand, list(nodes)).feasible)


def _refusal(exc: ApiError) -> str:
    if exc.status == 429:
        return f"a PodDisruptionBudget allows no disruption now ({exc.message or exc.reason})"
    if exc.status == 403:
        return (
            f"forbidden: the extender needs create on pods/eviction ({exc.message or exc.reason})"
        )
    return f"{exc.status} {exc.message or exc.reason or 'no answer'}"


def _grace(pod: Mapping[str, Any] | None) -> float:
    spec = (pod or {}).get("spec") or {}
    value = spec.get("terminationGracePeriodSeconds")
    return float(value) if isinstance(value, int) and value >= 0 else 30.0


class RepackCollector(Collector):
    """Live repacking's counters for /metrics, read at scrape time."""

    def __init__(self, repacker: Repacker) -> None:
        self._repacker = repacker

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._repacker.stats
        yield CounterMetricFamily(
            "vramsched_repack_moves", "Pods evicted by repack plans", value=s.moves
        )
        yield CounterMetricFamily(
            "vramsched_preempted_pods",
            "Pods of lower priority evicted by vramsched's preemption by VRAM (--preempt)",
            value=s.preempted,
        )
        plans = CounterMetricFamily(
            "vramsched_repack_plans", "Repack attempts by outcome", labels=["outcome"]
        )
        for outcome in ("started", "done", "abandoned", "refused", "none", "stale"):
            plans.add_metric([outcome], getattr(s, outcome))
        yield plans
        yield GaugeMetricFamily(
            "vramsched_repack_running",
            "1 while a repack plan runs",
            value=1 if self._repacker.run is not None else 0,
        )
