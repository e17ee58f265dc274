"""Live repacking along random histories on the scripted API: fragmented clusters of three
time-sliced nodes of one or two GPUs, pods blocked for want of one GPU's room, and in any order the
repacker's steps with the clock moving, kube-scheduler's filter and bind of any pending pod to
any node filter offers, controllers re-creating evicted pods, terminating pods finishing, users
deleting pods, creating new ones, editing a waiting pod's model-memory and withdrawing a running
pod's consent (also while a plan evicts, with the watch delivering it at once or later),
with `--preempt` too: pods of random priorities, and a running pod's priority raised above every
waiting one (at once, or while a preemption evicts),
PodDisruptionBudgets refusing evictions now and then (also after the dry run passed), and this
replica losing and winning the leader election.

After every action the ledger's invariant holds with the plan's holds counted as the pods they
stand for; only consenting pods of a controller are moved, never more than the per-minute cap
within a minute, and a pod is preempted only for a pod of higher priority than it has then; every bind books what the pod asks at that moment; and once the history is played out (every evicted pod re-created, every pod
that can be placed bound, the clock past every hold's deadline), no hold is left and the cluster
passes every check."""

from __future__ import annotations

import random
from typing import Any

import pytest
from builders import pod
from test_live_repack import World, bound, owned, world  # noqa: F401 (the fixture)

from extender.cluster import check_cluster
from extender.quantity import parse_bytes
from extender.repack_holds import HOLD_SUFFIX
from extender.repack_policy import MOVABLE

NODES = ["a", "b", "c"]
GIB_FREE = 24  # each GPU: 24Gi in 4 replicas
PER_MINUTE = 3


def placed(name: str, gib: int, node: str, device: int, movable: bool) -> dict[str, Any]:
    """A running pod on one GPU; a movable one belongs to the ReplicaSet of its size (the pods of
    one ReplicaSet share a template)."""
    p = bound(name, gib, node, device=str(device))
    return owned_by_size(p, gib) if movable else p


def owned_by_size(p: dict[str, Any], gib: int) -> dict[str, Any]:
    p["metadata"]["annotations"][MOVABLE] = "true"
    return owned(p, "ReplicaSet", f"web{gib}-abc", f"rs-web{gib}", "abc")


#: priorities of running pods and of pods that wait, with `--preempt` on
RUNNING_PRIORITIES = (0, 10, 100)
WAITING_PRIORITIES = (10, 100, 1000)


def prioritised(p: dict[str, Any], rng: random.Random, choices: tuple[int, ...]) -> dict[str, Any]:
    p["spec"]["priority"] = rng.choice(choices)
    return p


def random_cluster(rng: random.Random, gpus: int, preempt: bool = False) -> list[dict[str, Any]]:
    """Each GPU filled with 2-3 pods, some of them movable; one or two pods that fit on no GPU
    while the free memory summed would hold them. With `preempt`, of random priorities."""
    pods: list[dict[str, Any]] = []
    top = 0
    for node in NODES:
        for device in range(gpus):
            left = GIB_FREE
            for j in range(rng.randint(2, 3)):
                gib = rng.randint(2, min(10, left - 1))
                left -= gib
                pods.append(placed(f"{node}{device}{j}", gib, node, device, rng.random() < 0.6))
            top = max(top, left)
    for j in range(rng.randint(1, 2)):
        gib = rng.randint(top + 1, min(top + 8, 22))
        pods.append(pod(f"p{j}", f"{gib}Gi", uid=f"p{j}"))
    if preempt:
        for p in pods:
            waiting = not p["spec"].get("nodeName")
            prioritised(p, rng, WAITING_PRIORITIES if waiting else RUNNING_PRIORITIES)
    for p in pods:  # as the API server hands them out
        p["metadata"]["resourceVersion"] = "1"
    return pods


class Walk:
    def __init__(self, world: Any, seed: int, gpus: int = 1, preempt: bool = False) -> None:
        self.rng = random.Random(seed)
        self.leading = True
        self.preempt = preempt
        self.w: World = world(
            random_cluster(self.rng, gpus, preempt),
            nodes=NODES,
            per_minute=PER_MINUTE,
            node_gpus=gpus,
            leader=lambda: self.leading,
            preempt=preempt,
        )
        #: pods evicted by a preemption (not moves: no consent, no per-minute cap)
        self.preempted: set[str] = set()
        self.raised = 0
        self.made = 0
        self.recreated: set[str] = set()
        self.evicted_at: list[float] = []
        self.binds = 0
        self.edits = 0
        self.accepted: list[str] = []  # real evictions the API accepted, in order
        self.withdrawals = 0
        #: consent withdrawn while the next eviction is on its way, and edits the watch has
        #: not delivered yet
        self.at_next_eviction: list[Any] = []
        self.undelivered: set[str] = set()
        evict = self.w.repacker.evict

        def recording(namespace: str, name: str, body: Any, dry_run: bool) -> None:
            if not dry_run:
                for hook in self.at_next_eviction:
                    hook()
                self.at_next_eviction.clear()
            evict(namespace, name, body, dry_run)  # raises when refused
            if not dry_run:
                self.accepted.append(name)
                run = self.w.repacker.run
                if run is not None and run.victims and run.victims[-1].name == name:
                    # a preemption: only a pod of lower priority than the pod it is for, as
                    # the API holds it when its eviction is accepted
                    stored = self.w.api.pods[f"{namespace}/{name}"]
                    assert stored["spec"].get("priority", 0) < run.blocked.priority, name
                    self.preempted.add(name)

        self.w.repacker.evict = recording

    def pending(self) -> list[str]:
        return sorted(
            k
            for k, p in self.w.api.pods.items()
            if not p["spec"].get("nodeName") and "deletionTimestamp" not in p["metadata"]
        )

    def terminating(self) -> list[str]:
        return sorted(k for k, p in self.w.api.pods.items() if "deletionTimestamp" in p["metadata"])

    async def schedule(self, key: str) -> None:
        """kube-scheduler's cycle for one pod: filter, then a bind to any node it offers."""
        nodes, _ = self.w.filter(key)
        if nodes:
            if await self.w.bind(key, self.rng.choice(nodes)) == "":
                self.binds += 1
                # booked at what the pod asks now, whatever the plan sized for it
                p = self.w.cluster.pod(key)
                held = self.w.cluster.ledger.reservation(key)
                assert p is not None and held is not None, key
                asks = p["metadata"]["annotations"]["vramsched.io/model-memory"]
                assert held.bytes_per_device == (parse_bytes(asks),) * len(held.device_ids)
        self.w.assert_sound()

    def recreate_one(self) -> None:
        todo = [k for k in self.terminating() if k not in self.recreated]
        todo = [k for k in todo if self.w.api.pods[k]["metadata"].get("ownerReferences")]
        if todo:
            key = self.rng.choice(todo)
            self.recreated.add(key)
            self.made += 1
            self.w.recreate(key, f"web-new{self.made}")
            self.w.assert_sound()

    def finish_one(self) -> None:
        if done := self.terminating():
            self.w.gone(self.rng.choice(done))
            self.w.assert_sound()

    def user_action(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.3:
            running = [k for k, p in self.w.api.pods.items() if p["spec"].get("nodeName")]
            if running:  # a user deletes a running pod
                key = rng.choice(running)
                self.undelivered.discard(key)
                self.w.gone(key)
        elif roll < 0.45:
            consenting = [
                k
                for k, p in self.w.api.pods.items()
                if p["metadata"]["annotations"].get(MOVABLE) == "true"
            ]
            if consenting:  # its owner withdraws a pod's consent, now or during an eviction
                hook = self.withdraw(rng.choice(consenting), delivered=rng.random() < 0.5)
                if rng.random() < 0.5:
                    hook()
                else:
                    self.at_next_eviction.append(hook)
        elif roll < 0.5 and self.preempt:
            running = [k for k, p in self.w.api.pods.items() if p["spec"].get("nodeName")]
            if running:  # a running pod's priority goes up (created again in a higher class)
                hook = self.raise_priority(rng.choice(running), delivered=rng.random() < 0.5)
                if rng.random() < 0.5:
                    hook()
                else:
                    self.at_next_eviction.append(hook)
        elif roll < 0.6:
            if pending := self.pending():  # a user edits a waiting pod's model-memory
                key = rng.choice(pending)
                self.w.api.pods[key]["metadata"]["annotations"]["vramsched.io/model-memory"] = (
                    f"{rng.randint(2, 20)}Gi"
                )
                self.edits += 1
                self.w.watch(key)
        else:  # a user creates a pod
            self.made += 1
            name = f"u{self.made}"
            gib = rng.randint(2, 20)
            p = pod(name, f"{gib}Gi", uid=name)
            p["metadata"]["resourceVersion"] = "1"
            if self.preempt:
                prioritised(p, rng, WAITING_PRIORITIES)
            if rng.random() < 0.5:
                owned_by_size(p, gib)
            self.w.api.add_pod(p)
            self.w.source.apply("pods", "ADDED", p)
        self.w.assert_sound()

    def withdraw(self, key: str, delivered: bool) -> Any:
        """A hook removing the pod's `movable` annotation in the API (a new resourceVersion);
        the watch delivers it at once or at a later action."""

        def hook() -> None:
            stored = self.w.api.pods.get(key)
            if stored is None or stored["metadata"]["annotations"].pop(MOVABLE, None) is None:
                return
            meta = stored["metadata"]
            meta["resourceVersion"] = str(int(meta.get("resourceVersion") or "1") + 1)
            self.withdrawals += 1
            if delivered:
                self.w.watch(key)
            else:
                self.undelivered.add(key)

        return hook

    def raise_priority(self, key: str, delivered: bool) -> Any:
        """A hook raising the pod's priority in the API above any pod that waits (a new
        resourceVersion); the watch delivers it at once or at a later action."""

        def hook() -> None:
            stored = self.w.api.pods.get(key)
            if stored is None:
                return
            stored["spec"]["priority"] = 10_000
            meta = stored["metadata"]
            meta["resourceVersion"] = str(int(meta.get("resourceVersion") or "1") + 1)
            self.raised += 1
            if delivered:
                self.w.watch(key)
            else:
                self.undelivered.add(key)

        return hook

    def deliver(self) -> None:
        """The watch catches up with the withdrawals it has not delivered."""
        for key in sorted(self.undelivered):
            if key in self.w.api.pods:
                self.w.watch(key)
        self.undelivered.clear()

    def note_evictions(self, before: int) -> None:
        for name in self.accepted[before:]:
            if name in self.preempted:
                continue  # checked when its eviction was accepted
            key = f"default/{name}"
            meta = self.w.api.pods[key]["metadata"]
            assert meta["annotations"].get("vramsched.io/movable") == "true", name
            assert meta.get("ownerReferences"), name
            self.evicted_at.append(self.w.clock())
        for t in self.evicted_at:
            window = [u for u in self.evicted_at if t <= u < t + 60]
            assert len(window) <= PER_MINUTE, self.evicted_at

    async def act(self) -> None:
        rng = self.rng
        before = len(self.accepted)
        if rng.random() < 0.2:
            self.deliver()
        roll = rng.random()
        if roll < 0.3:
            await self.w.step(advance=rng.choice([0.0, 0.5, 1.5, 5.0, 11.0, 31.0]))
        elif roll < 0.6:
            if pending := self.pending():
                await self.schedule(rng.choice(pending))
        elif roll < 0.72:
            self.recreate_one()
        elif roll < 0.84:
            self.finish_one()
        elif roll < 0.92:
            self.user_action()
        elif roll < 0.97:
            # a PodDisruptionBudget starts or stops refusing a pod's eviction: every call, or
            # the real one only (its dry run passed: the plan is abandoned part way)
            names = [k.split("/")[1] for k in self.w.api.pods]
            if names:
                name = rng.choice(names)
                refuse = rng.choice([self.w.evictions.refuse, self.w.evictions.refuse_real])
                if refuse.pop(name, None) is None:
                    refuse[name] = 429
        else:  # this replica loses or wins the leader election
            self.leading = not self.leading
        self.note_evictions(before)

    async def settle(self) -> None:
        """Play the history out: controllers and kubelets finish, the scheduler retries."""
        self.w.evictions.refuse.clear()
        self.w.evictions.refuse_real.clear()
        self.at_next_eviction.clear()
        self.deliver()
        self.leading = True
        for rounds in range(40):  # a plan started in one round ends in the next ones
            before = len(self.accepted)
            for _ in range(len(self.terminating())):
                self.recreate_one()
            while self.terminating():
                self.finish_one()
            for key in self.pending():
                await self.schedule(key)
            await self.w.step(advance=45.0)
            self.note_evictions(before)
            if rounds >= 11 and self.w.repacker.run is None:
                break


@pytest.mark.parametrize("preempt", [False, True], ids=["repack", "repack+preempt"])
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("seed", range(16))
async def test_random_histories_keep_the_books_and_leave_no_hold(
    world: Any, seed: int, gpus: int, preempt: bool
) -> None:
    walk = Walk(world, seed, gpus, preempt)
    for _ in range(80):
        await walk.act()
    await walk.settle()
    w = walk.w
    assert w.repacker.run is None
    assert [r.key for r in w.cluster.ledger.reservations() if HOLD_SUFFIX in r.key] == []
    live = w.cluster.live_pod_keys()
    assert {r.key for r in w.cluster.ledger.reservations()} <= live
    assert check_cluster(w.cluster) == []
