"""The cluster as vramsched knows it: nodes, pods, and the ledger derived from them.

Both sources feed it the same events: the embedded cluster file at start-up and the
Kubernetes informers in live mode. Every reservation is derived from a pod (its
assignment annotations, or a conservative guess for pods bound by someone else), so
replaying the same objects always rebuilds the same ledger.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from extender.assignment import AssignmentError, decode_assignment
from extender.demand import (
    ASSIGNMENT,
    MODEL_MEMORY,
    TERMINAL_PHASES,
    Demand,
    DemandError,
    PodRef,
    pod_demand,
    pod_ref,
    pod_requests,
    well_formed_pod,
)
from extender.inventory import ReplicaPolicy, is_gpu_resource, node_inventory
from extender.ledger import Ledger, Reservation, Violation, check_invariant
from extender.object_fields import uid_of, version_of
from extender.placement import choose_devices, device_need
from extender.planner.capacity import Kind, demand_kind
from extender.planner.mix import DemandMix
from extender.quantity import QuantityError

__all__ = [
    "ClusterState",
    "TERMINAL_PHASES",
    "DEFAULT_SCHEDULER_NAME",
    "check_cluster",
    "guessed_demands",
]

log = logging.getLogger(__name__)
DEFAULT_SCHEDULER_NAME = "vramsched"


class ClusterState:
    """Nodes and pods by name, plus the ledger; one event loop owns it (no locks needed)."""

    def __init__(
        self,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        headroom: float = 0.0,
        replica_policy: ReplicaPolicy | str | None = None,
    ) -> None:
        #: `replica_policy`: how the nodes' device plugin picks time-sliced GPUs (live mode always
        #: has one); None for a cluster file or the simulator, whose per-GPU books are exact
        self.ledger = Ledger(replica_policy)
        self.nodes: dict[str, Mapping[str, Any]] = {}
        self.pods: dict[str, Mapping[str, Any]] = {}
        self.pending: set[str] = set()
        #: pending pods of ours kube-scheduler nominated to a node after preempting for them
        #: (`status.nominatedNodeName`): pod key -> node (`placement.nominated`)
        self.nominated: dict[str, str] = {}
        self.scheduler_name = scheduler_name
        self.headroom = headroom
        #: pods bound before we saw an assignment for them, placed by a conservative guess.
        self.guessed: set[str] = set()
        #: CPU (millicores) and memory (bytes) each live bound pod requests, and their sums per node,
        #: kept as pods come and go: the planner's snapshot reads the sums instead of parsing every pod.
        self._usage: dict[str, tuple[str, int, int]] = {}
        self.cpu_used: dict[str, int] = {}
        self.memory_used: dict[str, int] = {}
        #: our pods (pending or bound, not finished) by `demand_kind`: the workload a plan keeps
        #: free capacity useful for (`Workload.from_counts`), kept as pods come and go because
        #: parsing every pod per plan would stall the event loop. A pending pod is parsed when the
        #: mix is read (`_unparsed`), not on each upsert: filter learns pods on the hot path, and
        #: most are bound (and parsed as such) before a plan reads the mix.
        self._mix = DemandMix()
        #: (a dict: counted in arrival order, so types with equal counts keep one order)
        self._unparsed: dict[str, None] = {}

    # ----- nodes ---------------------------------------------------------------------------
    def upsert_node(self, node: Mapping[str, Any]) -> None:
        meta = node.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if not isinstance(name, str) or not name:
            return
        old = self.nodes.get(name)
        if old is not None and version_of(old) and version_of(old) == version_of(node):
            return
        self.nodes[name] = node
        self.ledger.upsert_node(node_inventory(node))

    def delete_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        self.ledger.remove_node(name)

    # ----- pods ----------------------------------------------------------------------------
    def upsert_pod(self, pod: Mapping[str, Any]) -> None:
        try:
            ref = pod_ref(pod)
        except DemandError:
            return
        if not well_formed_pod(pod):
            return
        key = ref.key
        old = self.pods.get(key)
        if old is not None and uid_of(old) and uid_of(pod) and uid_of(old) != uid_of(pod):
            self.delete_pod(key)  # same name, new pod: the old one's VRAM is free
        self.pods[key] = pod
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        if status.get("phase") in TERMINAL_PHASES:
            self._forget(key)
            return
        node = spec.get("nodeName")
        ours = spec.get("schedulerName") == self.scheduler_name
        if not node:
            self._drop_usage(key)
            # An assumed reservation from our own bind stays until the watch shows the binding.
            if ours:
                # A pod with scheduling gates (Kueue's admission gate, say) waits for whoever
                # removes them, not for a scheduler: kube-scheduler does not try it, so neither
                # the planner nor repacking works for it yet. It is still workload to come.
                if spec.get("schedulingGates"):
                    self.pending.discard(key)
                else:
                    self.pending.add(key)
                self._unparsed[key] = None
                target = status.get("nominatedNodeName")
                if target and isinstance(target, str):
                    self.nominated[key] = target
                else:
                    self.nominated.pop(key, None)
            else:  # the pod of this key is another scheduler's now: none of ours is left here
                self._forget(key)
            return
        self.pending.discard(key)
        self.nominated.pop(key, None)
        self._unparsed.pop(key, None)
        demand = self._account_bound(ref, pod, node)
        self._mix.set(key, demand if ours else None)

    def delete_pod(self, key: str) -> None:
        self.pods.pop(key, None)
        self._forget(key)

    def _forget(self, key: str) -> None:
        self.nominated.pop(key, None)
        self._mix.set(key, None)
        self._unparsed.pop(key, None)
        self.pending.discard(key)
        self.guessed.discard(key)
        self._drop_usage(key)
        self.ledger.release(key)

    @property
    def mix(self) -> DemandMix:
        """Our pods by demand type, pending pods upserted since the last read parsed now (an
        unreadable one is left out: filter names what is wrong with it)."""
        for key in self._unparsed:
            pod = self.pods.get(key)
            try:
                demand = pod_demand(pod, headroom=self.headroom) if pod is not None else None
            except DemandError:
                demand = None
            self._mix.set(key, demand)
        self._unparsed.clear()
        return self._mix

    @property
    def demand_mix(self) -> Counter[Kind]:
        """`mix.counts`: how many of our pods have each demand type."""
        return self.mix.counts

    def _set_usage(self, key: str, node: str, cpu: int, memory: int) -> None:
        self._drop_usage(key)
        self._usage[key] = (node, cpu, memory)
        self.cpu_used[node] = self.cpu_used.get(node, 0) + cpu
        self.memory_used[node] = self.memory_used.get(node, 0) + memory

    def _drop_usage(self, key: str) -> None:
        old = self._usage.pop(key, None)
        if old is None:
            return
        node, cpu, memory = old
        cpu_left = self.cpu_used.pop(node, 0) - cpu
        memory_left = self.memory_used.pop(node, 0) - memory
        if cpu_left or memory_left:  # else dropped: a pod requesting neither leaves no entry behind
            self.cpu_used[node], self.memory_used[node] = cpu_left, memory_left

    def _account_bound(self, ref: PodRef, pod: Mapping[str, Any], node: str) -> Demand | None:
        """Count a bound pod against the devices it holds; its demand, None if unreadable.

        A pod that runs whatever its annotation says (edited after bind, or bound by another
        scheduler without our webhook's check) is counted on whole GPUs when the annotation is
        what cannot be read: its GPUs are in use, and how much of them is unknown."""
        try:
            demand = pod_demand(pod, headroom=self.headroom)
        except DemandError as exc:
            parts = guessed_demands(pod, self.headroom)
            # The reason quotes the annotation; annotations are only ever logged at debug.
            log.warning(
                "bound pod %s has an unreadable GPU demand; %s (reason at debug level)",
                ref,
                "counted on whole GPUs" if parts else "not counted",
            )
            log.debug("bound pod %s: %s", ref, exc)
            if parts:
                self._count_bound(ref, pod, node, parts)
            else:
                self._drop_usage(ref.key)
                self.ledger.release(ref.key)  # it holds no GPU we can count
            return None
        self._count_bound(ref, pod, node, (demand,))
        return demand

    def _count_bound(
        self, ref: PodRef, pod: Mapping[str, Any], node: str, parts: tuple[Demand, ...]
    ) -> None:
        """Hold what the bound pod holds: its assignment when readable, else a guess. `parts` is
        its demand, or one per GPU resource for a pod asking several (`guessed_demands`; vramsched
        never places such a pod, so no assignment is read for it: whole devices of each, as one
        reservation)."""
        meta = pod.get("metadata") or {}
        first = parts[0]
        self._set_usage(ref.key, node, first.cpu_milli, first.memory_bytes)
        if not any(p.wants_gpu for p in parts):
            self.ledger.release(ref.key)  # no GPU asked: nothing held (vramsched binds none)
            return
        if len(parts) == 1:
            try:
                res = decode_assignment(ref, meta.get("annotations") or {}, first.priority)
            except AssignmentError as exc:
                log.warning(
                    "bound pod %s has an unreadable %s annotation; counted by a guess (reason at debug level)",
                    ref,
                    ASSIGNMENT,
                )
                log.debug("%s", exc)
                res = None
            if res is not None and res.node == node:
                self.guessed.discard(ref.key)
                self.ledger.record(res)
                return
        existing = self.ledger.reservation(ref.key)
        if existing is not None and existing.node == node:
            return  # already counted (our own bind, or an earlier guess)
        self.ledger.release(ref.key)
        guesses = [g for g in (self._guess(p, node) for p in parts) if g is not None]
        if not guesses:
            log.warning("bound pod %s on %s: no GPU devices to count it against", ref, node)
            return
        self.guessed.add(ref.key)
        self.ledger.record(guesses[0] if len(guesses) == 1 else _joined(guesses))

    def _guess(self, demand: Demand, node: str) -> Reservation | None:
        """Where a bound pod with no readable assignment is counted: where bind would put it, or
        where it does not fit by our books (`_worst_case`)."""
        chosen = choose_devices(self.ledger, demand, node)
        return self._worst_case(demand, node) if isinstance(chosen, str) else chosen

    def _worst_case(self, demand, node: str) -> Reservation | None:
        """A pod running where it does not fit by our books: count it on the least used devices,
        so the node shows as full rather than pretending the memory is free."""
        a = self.ledger.arrays
        r = self.ledger.node_row(node)
        if r is None:
            return None
        lo, hi = int(a.node_start[r]), int(a.node_start[r + 1])
        rows = [i for i in range(lo, hi) if a.devices[i].resource == demand.resource] or list(
            range(lo, hi)
        )
        if not rows:
            return None
        rows.sort(key=lambda i: (int(a.used[i]), i))
        rows = rows[: demand.gpu_count] or rows[:1]
        need = device_need(a, demand)
        return Reservation(
            pod=demand.pod,
            node=node,
            device_ids=tuple(a.devices[i].device_id for i in rows),
            bytes_per_device=tuple(int(need[i]) for i in rows),
            priority=demand.priority,
            declared=demand.bytes_per_gpu is not None,
        )

    # ----- bulk ----------------------------------------------------------------------------
    def load(self, objects: Iterable[Mapping[str, Any]]) -> None:
        """Nodes first, then pods, so every bound pod finds its node."""
        objects = list(objects)
        for obj in objects:
            if obj.get("kind") == "Node":
                self.upsert_node(obj)
        for obj in objects:
            if obj.get("kind") == "Pod":
                self.upsert_pod(obj)

    def pod(self, key: str) -> Mapping[str, Any] | None:
        return self.pods.get(key)

    def live_pod_keys(self) -> set[str]:
        return {
            k
            for k, p in self.pods.items()
            if (p.get("status") or {}).get("phase") not in TERMINAL_PHASES
        }


def _joined(guesses: list[Reservation]) -> Reservation:
    """One reservation holding every device of `guesses` (one pod's, one per GPU resource) once:
    a worst case falls back to any device of the node, so two may name the same one."""
    held: dict[str, int] = {}
    for g in guesses:
        for device, size in zip(g.device_ids, g.bytes_per_device):
            held.setdefault(device, size)
    first = guesses[0]
    return Reservation(
        pod=first.pod,
        node=first.node,
        device_ids=tuple(held),
        bytes_per_device=tuple(held.values()),
        priority=first.priority,
        declared=False,
    )


def guessed_demands(pod: Mapping[str, Any], headroom: float = 0.0) -> tuple[Demand, ...]:
    """A running pod `pod_demand` cannot read, as the ledger counts it: as one asking whole
    devices, with no `model-memory` (when that annotation is what does not parse), one `Demand`
    per GPU resource when it asks several; () when nothing of it can be read. The callers have
    already tried `pod_demand` on the pod as it is, so that is not tried again."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if isinstance(annotations, Mapping) and MODEL_MEMORY in annotations:
        rest = {k: v for k, v in annotations.items() if k != MODEL_MEMORY}
        pod = {**pod, "metadata": {**meta, "annotations": rest}}
        try:
            return (pod_demand(pod, headroom=headroom),)
        except DemandError:
            pass  # more than the annotation is unreadable: several GPU resources, say
    try:
        spec = pod.get("spec") or {}
        asked = sorted(
            k
            for k, v in pod_requests(spec).items()
            if isinstance(k, str) and is_gpu_resource(k) and v
        )
        if len(asked) < 2:
            return ()
        return tuple(pod_demand(pod, headroom=headroom, gpu_resource=r) for r in asked)
    except (DemandError, QuantityError):
        return ()


def check_cluster(cluster: ClusterState) -> list[Violation]:
    """`check_invariant` plus the ledger's agreement with the pods it was derived from.

    - the device invariant (bytes <= memory, pods <= replicas) and nothing held by a gone pod;
    - a reservation of a bound pod is on the node the pod is bound to;
    - every live bound pod with a readable assignment for its node holds exactly that placement,
      and every other live bound GPU pod on a node with devices is counted there (a guess);
    - the CPU and memory sums per node and the demand mix count exactly the live pods.
    """
    out = check_invariant(cluster.ledger, cluster.live_pod_keys())
    cpu: dict[str, int] = {}
    memory: dict[str, int] = {}
    mix: Counter[Kind] = Counter()
    for key, pod in cluster.pods.items():
        if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
            continue
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        res = cluster.ledger.reservation(key)
        try:
            demand: Demand | None = pod_demand(pod, headroom=cluster.headroom)
        except DemandError:
            demand = None
        if demand is not None and spec.get("schedulerName") == cluster.scheduler_name:
            mix[demand_kind(demand)] += 1
        if not node:
            continue
        # as `_account_bound` counts it
        parts = (demand,) if demand is not None else guessed_demands(pod, cluster.headroom)
        if parts:
            cpu[node] = cpu.get(node, 0) + parts[0].cpu_milli
            memory[node] = memory.get(node, 0) + parts[0].memory_bytes
        if res is not None and res.node != node:
            out.append(Violation(f"held on {res.node} but bound to {node}", key))
            continue
        if not parts:
            continue  # unreadable: logged when it was accounted, nothing to hold
        if not any(p.wants_gpu for p in parts):
            if res is not None:
                out.append(Violation("holds GPUs but requests none", key))
            continue
        inv = cluster.ledger.node(node)
        if inv is None or not inv.devices:
            continue  # bound where we know of no GPUs: nothing to count it against
        if res is None:
            out.append(Violation(f"bound to {node} but missing from the ledger", key))
            continue
        if len(parts) > 1:
            continue  # no assignment is read for it: vramsched never places such a pod
        try:
            recorded = decode_assignment(
                pod_ref(pod), (pod.get("metadata") or {}).get("annotations") or {}
            )
        except AssignmentError:
            recorded = None
        if recorded is not None and recorded.node == node and not recorded.same_placement(res):
            out.append(
                Violation(
                    f"ledger holds {res.device_ids} on {res.node}, assignment says {recorded.device_ids}",
                    key,
                )
            )
    for name in cpu.keys() | memory.keys() | cluster.cpu_used.keys() | cluster.memory_used.keys():
        want = (cpu.get(name, 0), memory.get(name, 0))
        got = (cluster.cpu_used.get(name, 0), cluster.memory_used.get(name, 0))
        if want != got:
            out.append(
                Violation(f"CPU/memory requested on the node is {want}, counted {got}", name)
            )
    if mix != cluster.demand_mix or cluster.mix.examples.keys() != mix.keys():
        out.append(
            Violation(
                f"demand mix counts {cluster.demand_mix.total()} pods of "
                f"{len(cluster.demand_mix)} kinds, the pods have {mix.total()} of {len(mix)}",
                cluster.scheduler_name,
            )
        )
    return out
