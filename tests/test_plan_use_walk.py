"""Whatever was chosen for a pod earlier, bind books what the pod asks when it is bound.

Choices outlive the pod object they were made for: the background planner's entries (made on a
snapshot, installed after the solver ran), the plan-ahead round's entries and the inline rule's
pick at prioritize. Meanwhile a pending pod's `model-memory` can be edited under the same UID,
and a pod can be deleted and created again under its name. Random histories of those, with
plans made at any point (also while a pod changes during the solve), filter, prioritize and
binds as kube-scheduler sends them (a bind without a prioritize when one node was feasible; the
bind of a cycle whose filter saw the pod before an edit, refused when it asks other GPUs now;
the next cycle's filter and bind), must keep:

- after every step, the ledger's invariant and its agreement with the pods (`check_cluster`);
- after every bind that succeeds, the pod held on as many GPUs as it asks, each at the bytes it
  asks now, under its own UID.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from builders import gpu_node, pod

from extender.cluster import ClusterState, check_cluster
from extender.demand import pod_demand
from extender.embedded import EmbeddedBinder
from extender.inventory import ReplicaPolicy
from extender.ledger import check_invariant
from extender.planner import background
from extender.planner.background import BackgroundPlanner
from extender.service import ExtenderService
from extender.wire import ExtenderArgs, ExtenderBindingArgs

NODES = ["a", "b", "c"]
NAMES = [f"p{i}" for i in range(7)]
SIZES = {1: ["10Gi", "20Gi", "30Gi", "40Gi", "60Gi"], 2: ["20Gi", "40Gi"]}


class Walk:
    def __init__(self, rng: random.Random, policy: ReplicaPolicy | None, ahead: int) -> None:
        self.rng = rng
        self.c = ClusterState(replica_policy=policy)
        self.c.load(
            [
                gpu_node("a", count=2, memory_mib=80 * 1024, replicas=4),
                gpu_node("b", count=2, memory_mib=80 * 1024, replicas=2),
                gpu_node("c", count=1, memory_mib=80 * 1024, replicas=1),
            ]
        )
        self.planner = BackgroundPlanner(self.c, time_limit=0.2, num_workers=1, plan_ahead=ahead)
        self.svc = ExtenderService(self.c, EmbeddedBinder(self.c), planner=self.planner)
        self.uids = 0
        self.binds = 0
        #: binds of a pod whose size changed after something was chosen for it
        self.stale_binds = 0
        #: binds refused because filter saw the pod before an edit the bind reads
        self.torn = 0
        #: pod key -> the size (model-memory) when prioritize or a plan last chose for it
        self.chosen_at: dict[str, str] = {}

    # ----- the pods ---------------------------------------------------------------------------
    def pending(self) -> list[str]:
        return sorted(self.c.pending)

    def create(self) -> None:
        name = self.rng.choice(NAMES)
        self.c.delete_pod(f"default/{name}")  # a pod created again under its name: a new UID
        self.uids += 1
        gpus = self.rng.choice([1, 1, 1, 2])
        self.c.upsert_pod(
            pod(name, self.rng.choice(SIZES[gpus]), gpus=gpus, uid=f"{name}-{self.uids}")
        )

    def edit(self) -> None:
        keys = self.pending()
        if not keys:
            return
        key = self.rng.choice(keys)
        p = self.c.pod(key)
        assert p is not None
        gpus = int(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        size = self.rng.choice(SIZES[gpus])
        meta = p["metadata"]
        self.c.upsert_pod(pod(meta["name"], size, gpus=gpus, uid=meta["uid"]))

    def delete(self) -> None:
        if self.c.pods:
            self.c.delete_pod(self.rng.choice(sorted(self.c.pods)))

    def change(self) -> None:
        self.rng.choice([self.create, self.edit, self.edit, self.delete])()

    # ----- plans ------------------------------------------------------------------------------
    def note_plans(self) -> None:
        for key in self.planner.entries:
            p = self.c.pod(key)
            if p is not None:
                self.chosen_at[key] = p["metadata"]["annotations"]["vramsched.io/model-memory"]

    def plan(self) -> None:
        self.planner.plan_once()
        self.note_plans()

    def plan_while_changing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A plan whose solve runs while the pods change (the worker thread's window)."""
        solve = background._solve

        def racing(*args: Any, **kwargs: Any) -> Any:
            for _ in range(self.rng.randint(1, 3)):
                self.change()
            return solve(*args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(background, "_solve", racing)
            asyncio.run(self.planner.replan())
        self.note_plans()

    def plan_ahead(self) -> None:
        if self.planner.ahead is not None:
            self.planner.plan_ahead_once()

    # ----- kube-scheduler -----------------------------------------------------------------------
    def feasible(self, key: str) -> list[str]:
        out = self.svc.filter(ExtenderArgs(Pod=self.c.pod(key), NodeNames=NODES))
        return list(out.NodeNames or [])

    def top(self, key: str, names: list[str]) -> str:
        p = self.c.pod(key)
        assert p is not None
        self.chosen_at[key] = p["metadata"]["annotations"]["vramsched.io/model-memory"]
        hosts = self.svc.prioritize(ExtenderArgs(Pod=p, NodeNames=names))
        best = max(h.Score for h in hosts)
        return next(h.Host for h in hosts if h.Score == best)

    def bind(self, key: str, node: str, uid: str) -> str:
        """kube-scheduler's bind; on success, checks what was booked. Returns the error."""
        ns, name = key.split("/")
        args = ExtenderBindingArgs(PodName=name, PodNamespace=ns, PodUID=uid, Node=node)
        result = asyncio.run(self.svc.bind(args))
        if result.Error:
            return result.Error
        self.binds += 1
        p = self.c.pod(key)
        assert p is not None and p["spec"]["nodeName"] == node
        demand = pod_demand(p)
        held = self.c.ledger.reservation(key)
        assert held is not None, f"{key} bound to {node} but holds nothing"
        assert held.pod.uid == p["metadata"]["uid"], (held, p["metadata"]["uid"])
        assert len(held.device_ids) == demand.gpu_count, held
        assert held.bytes_per_device == (demand.bytes_per_gpu,) * demand.gpu_count, (
            f"{key} asks {demand.bytes_per_gpu} per GPU, booked {held.bytes_per_device}"
        )
        size = p["metadata"]["annotations"]["vramsched.io/model-memory"]
        if self.chosen_at.get(key, size) != size:
            self.stale_binds += 1
        return ""

    def filtered_pod(self) -> tuple[str, list[str]] | None:
        """A random pending pod and the nodes filter finds for it; None when there is none."""
        keys = self.pending()
        if not keys:
            return None
        key = self.rng.choice(keys)
        names = self.feasible(key)
        return (key, names) if names else None

    def schedule(self) -> None:
        """One scheduling cycle for a pending pod: filter, prioritize when more than one node is
        feasible, bind to the top node."""
        if (found := self.filtered_pod()) is None:
            return
        key, names = found
        node = names[0] if len(names) == 1 else self.top(key, names)
        uid = self.c.pod(key)["metadata"]["uid"]  # type: ignore[index]
        self.bind(key, node, uid)

    def schedule_across_a_change(self) -> None:
        """Prioritize sees the pod, then it is edited or replaced before the bind comes: the bind
        of that cycle, or kube-scheduler's next cycle with its copy of the pod updated (filter,
        then a bind without a prioritize, as with one feasible node)."""
        if (found := self.filtered_pod()) is None:
            return
        key, names = found
        node = self.top(key, names)
        uid = self.c.pod(key)["metadata"]["uid"]  # type: ignore[index]
        before = pod_demand(self.c.pod(key))  # type: ignore[arg-type]
        self.change()
        if key not in self.c.pending:
            return
        if self.rng.random() < 0.5:
            error = self.bind(key, node, uid)
            now = pod_demand(self.c.pod(key))  # type: ignore[arg-type]
            if now.pod.uid == uid and now.bytes_per_gpu != before.bytes_per_gpu:
                assert "changed while being scheduled" in error, error
                self.torn += 1
            return
        names = self.feasible(key)
        if names:
            self.bind(key, names[0], self.c.pod(key)["metadata"]["uid"])  # type: ignore[index]

    # ----- checks -----------------------------------------------------------------------------
    def check(self) -> None:
        assert check_invariant(self.c.ledger, self.c.live_pod_keys()) == []
        assert check_cluster(self.c) == []


def walk(seed: int, monkeypatch: pytest.MonkeyPatch, steps: int = 80) -> Walk:
    rng = random.Random(seed)
    w = Walk(
        rng,
        policy=rng.choice([None, ReplicaPolicy.DISTRIBUTED]),
        ahead=rng.choice([0, 4]),
    )
    actions = [
        (w.create, 4),
        (w.edit, 2),
        (w.delete, 1),
        (w.plan, 2),
        (lambda: w.plan_while_changing(monkeypatch), 2),
        (w.plan_ahead, 1),
        (w.schedule, 4),
        (w.schedule_across_a_change, 3),
    ]
    funcs, weights = zip(*actions)
    for _ in range(steps):
        rng.choices(funcs, weights)[0]()
        w.check()
    return w


@pytest.mark.parametrize("seed", range(12))
def test_every_bind_books_what_the_pod_asks_whatever_was_chosen_before(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    walk(seed, monkeypatch)


def test_the_walks_bind_pods_whose_size_changed_after_a_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    walks = [walk(seed, monkeypatch) for seed in range(12)]
    assert sum(w.binds for w in walks) >= 100
    assert sum(w.stale_binds for w in walks) >= 10
    assert sum(w.torn for w in walks) >= 5
    assert sum(w.svc.plan_refused_at_bind for w in walks) >= 1
