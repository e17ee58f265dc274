"""The background planner: keeps a batch plan for the pods pending for vramsched.

It implements `PlanSource` for `ExtenderService`: prioritize gives the planned node the top
score and bind reserves the planned GPUs when they are still free (and the device plugin's bound
allows them: `placement.plugin_allows`). The solve runs in a worker
thread on a *copy* of the ledger, with a time limit, so the event loop (and every filter,
prioritize and bind) never waits for it; until a plan exists the greedy best-fit path answers.

Invalidation is per node: an entry is used while its node's `ledger.node_generation` is the one
the plan was made from, or, after that node changed, while its reservation still fits (so binding
one planned pod does not discard the plan of its neighbours). A pod that is bound, deleted or
re-created (new UID) loses its entry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from extender.background_task import BackgroundTask
from extender.cluster import ClusterState
from extender.demand import Demand, DemandError, pod_demand
from extender.ledger import Reservation
from extender.object_fields import uid_of
from extender.planner.ahead import PlanAhead, plan_ahead_round, same_shape
from extender.planner.capacity import MAX_TYPES, Capacity, FragIndex, Workload
from extender.planner.model import Plan, solve_batch

__all__ = ["BackgroundPlanner", "PlanEntry", "snapshot"]

#: plans of fewer pods score every candidate instead of collapsing identical nodes first
DEDUPE_FROM = 16
#: at most this share of the time goes to planning ahead (`--plan-ahead`): the next round waits
#: until the last one's duration is this share of the time since it started
AHEAD_SHARE = 0.25

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PlanEntry:
    node: str
    reservation: Reservation | None
    generation: int
    uid: str
    #: what the pod needs (a later plan for newly waiting pods holds this entry's CPU and memory too)
    demand: Demand | None = None


@dataclass
class PlannerStats:
    plans: int = 0
    last_seconds: float = 0.0
    last_status: str = ""
    last_gap: float = 0.0
    last_batch: int = 0
    last_placed: int = 0
    errors: int = 0
    hits: int = 0
    stale: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def snapshot(cluster: ClusterState) -> tuple[Capacity, dict[str, int]]:
    """A private copy of the cluster's capacity (ledger, CPU, memory) the worker may read freely,
    and the per-node generations it reflects. Milliseconds at 5,000 nodes and 100,000 pods: the
    ledger's capacity is cloned (`Ledger.clone(reservations=False)`: plans reserve only their own
    trial placements) and CPU/memory come from the sums the cluster keeps."""
    return Capacity.from_ledger(
        cluster.ledger.clone(reservations=False), cluster.cpu_used, cluster.memory_used
    ), dict(cluster.ledger.node_generation)


class BackgroundPlanner:
    """`PlanSource` backed by CP-SAT batch plans computed off the event loop."""

    def __init__(
        self,
        cluster: ClusterState,
        *,
        time_limit: float = 1.0,
        num_workers: int = 2,
        debounce: float = 0.05,
        max_batch: int = 500,
        poll: float = 1.0,
        min_age: float = 0.5,
        refresh: float = 10.0,
        refresh_all: float = 30.0,
        min_interval: float = 1.0,
        open_cost: float = 0.0,
        plan_ahead: int = 0,
        ahead_interval: float = 0.2,
    ) -> None:
        self.cluster = cluster
        self.time_limit = time_limit
        #: the one-pod rule's charge per idle GPU a placement opens (`FragIndex.open_cost`)
        self.open_cost = open_cost
        self.num_workers = num_workers
        self.debounce = debounce
        self.max_batch = max_batch
        self.poll = poll
        #: a pod kube-scheduler places within this many seconds of the planner first seeing it
        #: pending never waits for a plan: planning it would only cost CPU. A backlog (a burst, pods
        #: that fit nowhere yet) is what the planner is for.
        self.min_age = min_age
        #: after a plan, changes elsewhere in the cluster replan at most this often (entries stay
        #: valid per node meanwhile); new waiting pods replan as soon as `min_interval` allows.
        self.refresh = refresh
        #: how often pods that fit nowhere (last plan, or filter) are tried again in a full plan
        self.refresh_all = refresh_all
        #: plans start at most this often, whatever asks for one: pods that start waiting one by one
        #: (say, each after losing a bind race) share a plan instead of paying a snapshot each
        self.min_interval = min_interval
        self.entries: dict[str, PlanEntry] = {}
        self.stats = PlannerStats()
        self._wake: asyncio.Event | None = None
        self._task = BackgroundTask("vramsched-planner", self.run)
        #: (ledger generation, pods the plans since answer for, when) of the last full plan
        self._planned_from: tuple[int, frozenset[str], float] | None = None
        #: when the last plan, full or only for newly waiting pods, was installed
        self._last_plan_at = float("-inf")
        #: when the planner first saw each pending pod
        self._seen: dict[str, float] = {}
        #: pods the last plan could not place (retried in a full plan every `refresh_all`)
        self._unplaced: frozenset[str] = frozenset()
        #: pods filter found no node for (left out until filter finds one: see notify_filtered)
        self._unschedulable: set[str] = set()
        #: the one-pod rule's choice kept ready for the `plan_ahead` most common pod types
        #: (`ahead.PlanAhead`), redone after a change at most every `ahead_interval` seconds
        self.ahead = PlanAhead(cluster, plan_ahead, open_cost=open_cost) if plan_ahead > 0 else None
        self.ahead_interval = ahead_interval
        #: when the next round may start: `ahead_interval` after the last one started, or later
        #: so that rounds take at most `AHEAD_SHARE` of the time (a round of 8 types costs 70 ms
        #: of the worker's CPU at 1,000 nodes, and the worker shares the GIL with the event loop)
        self._ahead_next = float("-inf")
        if self.ahead is not None:
            self.poll = min(self.poll, ahead_interval)

    # ----- PlanSource ---------------------------------------------------------------------------
    def planned_node(
        self, pod_key: str, nodes: Sequence[str] | None = None, demand: Demand | None = None
    ) -> str | None:
        e = self._valid(pod_key, demand)
        if e is not None:
            return e.node
        if self.ahead is None:
            return None
        return self.ahead.planned_node(pod_key, nodes, demand)

    def planned_reservation(self, pod_key: str, node: str) -> Reservation | None:
        e = self._valid(pod_key)
        if e is None:
            if self.ahead is None:
                return None
            r = self.ahead.reservation(pod_key, node)
            return r if r is not None else self.ahead.inline_reservation(pod_key, node)
        if e.node != node or e.reservation is None:
            return None
        r = e.reservation
        self.stats.hits += 1
        return Reservation(
            r.pod, r.node, r.device_ids, r.bytes_per_device, r.priority, declared=r.declared
        )

    def notify_pending(self, pod_key: str) -> None:
        if self._wake is not None:
            self._wake.set()

    def notify_filtered(self, pod_key: str, fits: bool) -> None:
        """What filter found for this pod among the candidate nodes: no plan can place a pod that
        fits on none of them, until filter (kube-scheduler retries it) finds one where it does."""
        if not fits:
            self._unschedulable.add(pod_key)
        else:
            self._unschedulable.discard(pod_key)

    def _valid(self, pod_key: str, demand: Demand | None = None) -> PlanEntry | None:
        """The pod's entry while it still holds: the same pod, pending, asking what it asked when
        planned (`demand`, when the caller has it), on a node that has not changed since or
        where the entry's GPUs are still free."""
        e = self.entries.get(pod_key)
        if e is None:
            return None
        if demand is not None and e.demand is not None and not same_shape(e.demand, demand):
            self.entries.pop(pod_key, None)
            return None
        pod = self.cluster.pod(pod_key)
        if pod is None or pod_key not in self.cluster.pending:
            self.entries.pop(pod_key, None)
            return None
        if uid_of(pod) != e.uid:
            self.entries.pop(pod_key, None)
            return None
        ledger = self.cluster.ledger
        if ledger.node_generation.get(e.node, 0) == e.generation:
            return e
        if ledger.node(e.node) is not None and (
            e.reservation is None or ledger.fits(e.reservation) is None
        ):
            return e  # the node changed, but what the plan holds for this pod is still free
        self.stats.stale += 1
        self.entries.pop(pod_key, None)
        return None

    # ----- planning -------------------------------------------------------------------------------
    def _aged(self, now: float) -> frozenset[str]:
        """Pending pods the planner has seen pending for at least `min_age` seconds."""
        pending = self.cluster.pending
        for key in [k for k in self._seen if k not in pending]:
            del self._seen[key]
            self._unschedulable.discard(key)
        for key in pending:
            self._seen.setdefault(key, now)
        return frozenset(k for k in pending if now - self._seen[k] >= self.min_age)

    def pending_demands(self, keys: frozenset[str] | None = None) -> list[Demand]:
        """Demands of the pending pods (of `keys` only, when given), in a stable order."""
        out = []
        for key in sorted(self.cluster.pending if keys is None else keys):
            pod = self.cluster.pod(key)
            if pod is None:
                continue
            try:
                d = pod_demand(pod, headroom=self.cluster.headroom)
            except DemandError:
                continue
            out.append(d)
        return out[: self.max_batch]

    def workload(self, demands: list[Demand]) -> Workload:
        """What the plan keeps free capacity useful for: every pod of ours the cluster holds,
        pending or running (`ClusterState.demand_mix`; `simulate --profile live` replays it). The
        plan's own pods alone would make a pod planned by itself weigh only its own type."""
        if self.cluster.demand_mix:
            return Workload.from_counts(self.cluster.demand_mix)
        return Workload.from_demands(demands)

    def profile(self) -> list[dict[str, Any]]:
        """The pod types plans keep free capacity useful for, most common first (the types
        `workload` weighs; none while the cluster holds no pod of ours): what `/state` shows."""
        top = self.cluster.demand_mix.most_common(MAX_TYPES)
        total = sum(c for _, c in top)
        return [
            {
                "gpus": gpus,
                "memoryPerGpuBytes": None if need < 0 else need,
                "resource": resource,
                "gpuModels": None if allowed is None else sorted(allowed),
                "cpuMilli": cpu,
                "memoryBytes": mem,
                "pods": count,
                "share": round(count / total, 4),
            }
            for (gpus, need, cpu, mem, resource, allowed), count in top
        ]

    def plan_once(self) -> Plan | None:
        """Plan synchronously (tests and the simulator use this; the loop calls `replan`)."""
        demands = self.pending_demands()
        if not demands:
            self.entries.clear()
            return None
        cap, gens = snapshot(self.cluster)
        plan = _solve(
            cap,
            demands,
            self.workload(demands),
            self.time_limit,
            self.num_workers,
            open_cost=self.open_cost,
        )
        self._install(demands, plan, gens, cap)
        return plan

    async def replan(
        self,
        keys: frozenset[str] | None = None,
        covers: frozenset[str] | None = None,
        keep: dict[str, PlanEntry] | None = None,
    ) -> Plan | None:
        """Plan the pending pods `keys` (all when None); `covers`: the waiting pods this plan answers
        for (default `keys`), so that those left out on purpose do not ask for another plan.

        `keep`: entries that still hold, kept as they are; `keys` are planned around them (the
        snapshot holds their GPUs, CPU and memory). A pod that starts waiting then costs a plan of
        that pod, not of the whole backlog again: in the load test, where pods that lose a bind
        race wait for good, planning every waiting pod each time was what the planner cost."""
        covers = keys if covers is None else covers
        demands = self.pending_demands(keys)
        if not demands:
            if keep is None:
                self.entries.clear()
            if covers is not None:
                self._record(covers, full=keep is None)
            return None
        cap, gens = snapshot(self.cluster)  # on the loop: a consistent copy
        workload = self.workload(demands)
        hold = [
            (e.demand, e.reservation, e.node) for e in (keep or {}).values() if e.demand is not None
        ]
        started = time.perf_counter()
        try:
            plan = await asyncio.to_thread(
                _solve,
                cap,
                demands,
                workload,
                self.time_limit,
                self.num_workers,
                hold,
                self.open_cost,
            )
        except Exception:  # planning is an optimisation; the greedy path still answers
            self.stats.errors += 1
            log.exception("background plan failed")
            return None
        # `covers`: what was asked for, even beyond max_batch: not asked again until it grows
        self._install(demands, plan, gens, cap, covers, keep)
        planned = {d.pod.key for d in demands}
        pending = self.cluster.pending
        # this plan's verdict for its pods; earlier ones kept for the pods it left out
        self._unplaced = frozenset(
            k for k in self._unplaced if k not in planned and k in pending
        ) | frozenset(k for k in planned if k not in self.entries)
        self.stats.last_seconds = time.perf_counter() - started
        return plan

    def _install(
        self,
        demands: list[Demand],
        plan: Plan,
        gens: dict[str, int],
        cap: Capacity,
        covers: frozenset[str] | None = None,
        keep: dict[str, PlanEntry] | None = None,
    ) -> None:
        a = cap.arrays
        entries: dict[str, PlanEntry] = dict(keep) if keep else {}
        for i, (res, node_row, _) in plan.choices.items():
            d = demands[i]
            node = a.node_names[node_row]
            # the UID the plan was made for: a pod re-created while the solver ran is not it
            entries[d.pod.key] = PlanEntry(node, res, gens.get(node, 0), d.pod.uid, d)
        self.entries = entries
        self.stats.plans += 1
        self.stats.last_status = plan.status
        self.stats.last_gap = plan.gap
        self.stats.last_batch = len(demands)
        self.stats.last_placed = plan.placed
        covers = frozenset(d.pod.key for d in demands) if covers is None else covers
        self._record(covers, full=keep is None)

    def _record(self, covers: frozenset[str], *, full: bool) -> None:
        """A plan was made: what it answers for, and when. Only a full plan restarts the clocks of
        `refresh` and `refresh_all` (and the generation they compare with)."""
        now = time.monotonic()
        self._last_plan_at = now
        if full or self._planned_from is None:
            self._planned_from = (self.cluster.ledger.generation, covers, now)
        else:
            gen, _, at = self._planned_from
            self._planned_from = (gen, covers, at)

    def _needs_plan(self, aged: frozenset[str], now: float) -> bool:
        """A new plan when pods started waiting that the last one did not cover, or, at most every
        `refresh` seconds, when the cluster changed since. Pods that left need none: the remaining
        entries are checked per node when used."""
        if not aged:
            return bool(self.entries)
        if self._planned_from is None:
            return True
        gen, keys, at = self._planned_from
        if now - self._last_plan_at < self.min_interval:
            return False
        waiting = aged - self._unschedulable
        if not (waiting - self._unplaced) <= keys:
            return True
        if gen == self.cluster.ledger.generation:
            return False
        if now - at >= self.refresh_all:
            return bool(waiting)
        return now - at >= self.refresh and bool(waiting - self._unplaced)

    async def run(self) -> None:
        self._wake = asyncio.Event()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll)
            except TimeoutError:
                pass
            self._wake.clear()
            await asyncio.sleep(self.debounce)  # let a burst of pending pods arrive together
            await self.step(time.monotonic())

    async def step(self, now: float) -> Plan | None:
        """One turn of the loop: plan if `_needs_plan` says so; plan ahead if the cluster changed
        since the last round and `ahead_interval` has passed."""
        plan = await self._plan_step(now)
        if self.ahead is not None and self.ahead.stale() and now >= self._ahead_next:
            started = time.perf_counter()
            await self.replan_ahead()
            spent = time.perf_counter() - started
            self._ahead_next = now + max(self.ahead_interval, spent / AHEAD_SHARE)
        return plan

    def _ahead_inputs(
        self,
    ) -> tuple[Capacity, list[Demand], int, dict[str, frozenset[str]]] | None:
        """What a round of planning ahead reads: a snapshot holding what valid plan entries hold,
        a pod of each type to plan for, the ledger generation and who holds each node's GPUs;
        None (and no entries) when the cluster holds no GPU pod of ours."""
        assert self.ahead is not None
        generation = self.cluster.ledger.generation
        examples = self.ahead.examples()
        if not examples:
            self.ahead.install({}, generation, {})
            return None
        cap, _ = snapshot(self.cluster)
        cap.hold(
            (e.demand, e.reservation, e.node)
            for e in map(self._valid, list(self.entries))
            if e is not None and e.demand is not None
        )
        return cap, examples, generation, self.cluster.ledger.holders()

    async def replan_ahead(self) -> None:
        """A round of `ahead.plan_ahead` in the worker thread, on a snapshot taken on the loop."""
        assert self.ahead is not None
        inputs = self._ahead_inputs()
        if inputs is None:
            return
        cap, examples, generation, holders = inputs
        mix = dict(self.cluster.demand_mix)
        workload = self.workload([])
        try:
            entries = await asyncio.to_thread(
                plan_ahead_round, cap, examples, workload, self.ahead.depth, self.open_cost
            )
        except Exception:  # an optimisation: the hot path still answers
            self.stats.errors += 1
            log.exception("planning ahead failed")
            return
        self.ahead.install(entries, generation, holders, mix)

    def plan_ahead_once(self) -> None:
        """`replan_ahead` synchronously (tests)."""
        assert self.ahead is not None
        inputs = self._ahead_inputs()
        if inputs is not None:
            cap, examples, generation, holders = inputs
            mix = dict(self.cluster.demand_mix)
            workload = self.workload([])
            entries = plan_ahead_round(cap, examples, workload, self.ahead.depth, self.open_cost)
            self.ahead.install(entries, generation, holders, mix)

    async def _plan_step(self, now: float) -> Plan | None:
        aged = self._aged(now)
        if not self._needs_plan(aged, now):
            return None
        # Pods the last plan (or filter) could not place fit nowhere until the cluster changes:
        # plans leave them out, except a full one every `refresh_all` seconds.
        last = self._planned_from
        full = last is None or now - last[2] >= self.refresh_all
        waiting = aged - self._unschedulable
        keys = waiting if full else waiting - self._unplaced
        if full or (last is not None and now - last[2] >= self.refresh):
            return await self.replan(keys, covers=waiting)
        # Only pods that started waiting since (or whose entry went stale) ask for this plan: it
        # plans them around the entries that still hold.
        keep = {k: e for k in keys if (e := self._valid(k)) is not None}
        return await self.replan(keys - keep.keys(), covers=waiting, keep=keep)

    async def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    def state(self) -> dict[str, Any]:
        s = self.stats
        gap = s.last_gap if math.isfinite(s.last_gap) else None  # JSON has no infinity
        return {
            "plans": s.plans,
            "entries": len(self.entries),
            "lastStatus": s.last_status,
            "lastGap": gap,
            "lastBatch": s.last_batch,
            "lastPlaced": s.last_placed,
            "lastSeconds": round(s.last_seconds, 4),
            "hits": s.hits,
            "stale": s.stale,
            "errors": s.errors,
            "profile": self.profile(),
            "aheadTypes": len(self.ahead.entries) if self.ahead is not None else 0,
            "aheadRounds": self.ahead.rounds if self.ahead is not None else 0,
            # whether the last round was made on the cluster as it is now (its mix included)
            "aheadCurrent": self.ahead is not None and not self.ahead.stale(),
            "aheadHits": self.ahead.hits if self.ahead is not None else 0,
            "aheadInline": self.ahead.inline_choices if self.ahead is not None else 0,
        }


def _solve(
    cap: Capacity,
    demands: list[Demand],
    workload: Workload,
    time_limit: float,
    num_workers: int,
    hold: Sequence[tuple[Demand, Reservation | None, str]] = (),
    open_cost: float = 0.0,
) -> Plan:
    """Plan `demands` on `cap` (a private snapshot) after holding what kept entries hold there."""
    cap.hold(hold)
    cap.dedupe = len(demands) >= DEDUPE_FROM  # see Capacity.dedupe
    frag = FragIndex(cap, workload, count_foreign=False, open_cost=open_cost)
    return solve_batch(cap, demands, frag, time_limit=time_limit, num_workers=num_workers)
