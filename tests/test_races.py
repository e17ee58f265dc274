"""Races: many concurrent binds competing for the same GPUs, interleaved with filters, pod
deletes, re-creations and node label changes. The invariant must hold at every step and each
pod must be bound at most once.

Two ways in:

- over HTTP, embedded mode: hundreds of concurrent requests against the real aiohttp app;
- at the service, with an API-like binder whose round trip is an `await` (as in live mode):
  the reservation is taken, the loop runs other requests meanwhile, then the "API" answers
  with success, a conflict (409), a vanished pod (404), a failure, or a timeout after which
  the Binding did land. Watch events reach the cluster later, as informers deliver them.

A checker task runs `check_invariant` on every turn of the event loop while a round runs.
Delays are counted in turns of the event loop, not in seconds, so every round is
deterministic: a failure names its seed and replays exactly.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import orjson
import pytest
from builders import cluster as make_cluster
from builders import gpu_node, mig_mixed_node, pod

from extender.assignment import encode_assignment
from extender.cluster import ClusterState, check_cluster
from extender.demand import pod_ref
from extender.embedded import EmbeddedBinder
from extender.ledger import Reservation, check_invariant
from extender.live.source import WatchedPods
from extender.server import create_app
from extender.service import BindError, ExtenderService
from extender.wire import ExtenderArgs, ExtenderBindingArgs

SEEDS = range(30)
# a regression here may hang a gated bind forever: fail fast instead
pytestmark = pytest.mark.timeout(120)


async def ticks(n: int) -> None:
    """Let the event loop run `n` turns: a delay that replays identically, unlike a clock."""
    for _ in range(n):
        await asyncio.sleep(0)


# ----- the cluster under fire --------------------------------------------------------------------
class Nodes:
    """The GPU nodes, regenerated with new labels (never fewer devices or less memory)."""

    def __init__(self) -> None:
        self.params: dict[str, dict[str, Any]] = {
            "excl-0": dict(count=2, replicas=1),
            "ts-0": dict(count=2, replicas=4),
            "mps-0": dict(count=1, replicas=4, strategy="mps"),
        }
        self.version = 0

    def objects(self) -> list[dict[str, Any]]:
        return [self.node(n) for n in self.params] + [self.mig()]

    def node(self, name: str) -> dict[str, Any]:
        obj = gpu_node(
            name, **self.params[name], extra_labels={"test/generation": str(self.version)}
        )
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def mig(self) -> dict[str, Any]:
        obj = mig_mixed_node("mig-0", {"1g.10gb": (7, 9728)})
        obj["metadata"]["labels"]["test/generation"] = str(self.version)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def relabel(self, rng: random.Random) -> dict[str, Any]:
        """A label change: sometimes a GPU more, sometimes more replicas, always a new generation."""
        self.version += 1
        name = rng.choice([*self.params, "mig-0"])
        if name == "mig-0":
            return self.mig()
        p = self.params[name]
        change = rng.random()
        if change < 0.2 and p["count"] < 4:
            p["count"] += 1
        elif change < 0.3 and p["replicas"] > 1 and p["replicas"] < 8:
            p["replicas"] += 1
        return self.node(name)

    @property
    def names(self) -> list[str]:
        return [*self.params, "mig-0"]


def random_pod(rng: random.Random, name: str, uid: str) -> dict[str, Any]:
    kind = rng.random()
    if kind < 0.45:
        p = pod(name, rng.choice(["8Gi", "16Gi", "20Gi", "24Gi", "40Gi", "60Gi"]), uid=uid)
    elif kind < 0.6:
        p = pod(name, rng.choice(["100Gi", "140Gi"]), gpus=2, uid=uid)
    elif kind < 0.8:
        p = pod(name, None, uid=uid)  # whole GPU
    else:
        p = pod(name, rng.choice(["4Gi", "8Gi"]), resource="nvidia.com/mig-1g.10gb", uid=uid)
    p.pop("kind")
    return p


class Watcher:
    """Runs check_invariant on every turn of the loop until stopped; remembers the first violation."""

    def __init__(self, ledger_of) -> None:
        self.ledger_of = ledger_of
        self.violations: list[str] = []
        self.checks = 0
        self._stop = False

    async def run(self) -> None:
        while not self._stop:
            found = check_invariant(self.ledger_of())
            self.checks += 1
            if found and not self.violations:
                self.violations = [str(v) for v in found]
            await asyncio.sleep(0)

    def stop(self) -> None:
        self._stop = True


# ----- an API server stand-in for the service-level rounds -----------------------------------------
class FakeApi:
    """Pods as the API server keeps them, with its answers to a Binding, and a watch that
    delivers every change in order, each some turns of the loop late."""

    def __init__(self, rng: random.Random, deliver) -> None:
        self.rng = rng
        self.deliver = deliver  # (op, object) -> None
        self.pods: dict[str, dict[str, Any]] = {}
        self.bindings: dict[str, list[str]] = defaultdict(list)  # uid -> nodes it was bound to
        self.last_uid: dict[str, str] = {}  # key -> the UID of the last pod created under it
        self.events: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

    async def watch(self) -> None:
        while True:
            op, obj = await self.events.get()
            await ticks(self.rng.randint(0, 6))
            self.deliver(op, obj)
            self.events.task_done()

    def _emit(self, op: str, obj: Mapping[str, Any]) -> None:
        self.events.put_nowait((op, copy.deepcopy(obj)))

    def create(self, obj: dict[str, Any]) -> None:
        ref = pod_ref(obj)
        self.pods[ref.key] = obj
        self.last_uid[ref.key] = ref.uid
        self._emit("upsert", obj)

    def delete(self, key: str) -> None:
        obj = self.pods.pop(key, None)
        if obj is not None:
            self._emit("delete", obj)

    def bind(self, key: str, uid: str, node: str, annotations: dict[str, str]) -> None:
        """The Binding subresource: 404 for a gone or re-created pod, 409 when already bound."""
        current = self.pods.get(key)
        if current is None or current["metadata"].get("uid") != uid:
            raise ApiAnswer(404)
        bound = current["spec"].get("nodeName")
        if bound:
            raise ApiAnswer(409, bound)
        updated = copy.deepcopy(current)
        updated["metadata"]["annotations"].update(annotations)
        updated["spec"]["nodeName"] = node
        updated["status"] = {"phase": "Running"}
        self.pods[key] = updated
        self.bindings[uid].append(node)
        self._emit("upsert", updated)


class ApiAnswer(Exception):
    def __init__(self, status: int, bound: str = "") -> None:
        super().__init__(status)
        self.status, self.bound = status, bound


class Uncertain(BindError):
    """Timed out: the Binding may have landed. The service keeps the assumed reservation."""

    keep_reservation = True


class ApiBinder:
    """Binds through FakeApi with a round trip on each side, like KubeBinder with its thread pool."""

    def __init__(self, api: FakeApi, rng: random.Random) -> None:
        self.api, self.rng = api, rng

    async def bind(
        self, the_pod: Mapping[str, Any], node: str, reservation: Reservation | None
    ) -> None:
        ref = pod_ref(the_pod)
        await ticks(self.rng.randint(0, 8))  # request on the wire
        fate = self.rng.random()
        if fate < 0.08:
            raise BindError("API server unreachable")  # definite: nothing was written
        try:
            self.api.bind(
                ref.key, ref.uid, node, encode_assignment(reservation) if reservation else {}
            )
        except ApiAnswer as exc:
            if exc.status == 409 and exc.bound == node:
                return  # a retried bind whose first Binding landed
            raise BindError(f"{exc.status} {exc.bound}") from None
        await ticks(self.rng.randint(0, 8))  # answer on the wire
        if fate > 0.93:
            raise Uncertain("timed out after the Binding landed")


# ----- service-level rounds (live-like: assumed reservations, delayed watch) -------------------------
async def live_round(seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    nodes = Nodes()
    state = ClusterState()

    def deliver(op: str, obj: dict[str, Any]) -> None:
        if op == "delete":
            known = state.pods.get(pod_ref(obj).key)
            if known is not None and known["metadata"].get("uid") != obj["metadata"].get("uid"):
                return  # the deletion of an older pod with the same name
            state.delete_pod(pod_ref(obj).key)
        else:
            state.upsert_pod(obj)

    api = FakeApi(rng, deliver)
    watch = asyncio.ensure_future(api.watch())
    for n in nodes.objects():
        state.upsert_node(n)
    service = ExtenderService(state, ApiBinder(api, rng), pods=WatchedPods(state), assume_ttl=3600)
    watcher = Watcher(lambda: state.ledger)
    uids = iter(f"{seed}-uid-{i}" for i in range(10**6))
    names = [f"p{i}" for i in range(60)]
    for name in names:
        api.create(random_pod(rng, name, next(uids)))
    await api.events.join()  # the informers catch up
    won: dict[str, set[str]] = defaultdict(set)  # uid -> nodes a bind answered success for
    counts = defaultdict(int)

    async def bind(name: str, node: str) -> None:
        await ticks(rng.randint(0, 30))
        # kube-scheduler binds a pod it has seen: the one of that name now, or the last one
        # before it was deleted (never an empty UID, which would match no pod)
        obj = api.pods.get(f"default/{name}")
        uid = obj["metadata"]["uid"] if obj else api.last_uid[f"default/{name}"]
        result = await service.bind(
            ExtenderBindingArgs(PodName=name, PodNamespace="default", PodUID=uid, Node=node)
        )
        counts["binds"] += 1
        if not result.Error:
            won[uid].add(node)

    async def other() -> None:
        await ticks(rng.randint(0, 30))
        op = rng.random()
        name = rng.choice(names)
        if op < 0.5:
            obj = state.pods.get(f"default/{name}") or random_pod(rng, name, "x")
            service.filter(ExtenderArgs(Pod=obj, NodeNames=nodes.names))
            service.prioritize(ExtenderArgs(Pod=obj, NodeNames=nodes.names))
            counts["filters"] += 1
        elif op < 0.7:
            api.delete(f"default/{name}")
            counts["deletes"] += 1
            if rng.random() < 0.5:  # re-created under the same name: a new UID
                await ticks(rng.randint(0, 5))
                if f"default/{name}" not in api.pods:
                    api.create(random_pod(rng, name, next(uids)))
        else:
            state.upsert_node(nodes.relabel(rng))
            counts["relabels"] += 1

    tasks = []
    for name in names:  # every pod raced by 1-3 binds, often to the same node as another
        for _ in range(rng.randint(1, 3)):
            tasks.append(bind(name, rng.choice(nodes.names)))
    tasks += [other() for _ in range(80)]
    rng.shuffle(tasks)
    checker = asyncio.ensure_future(watcher.run())
    await asyncio.gather(*tasks)
    await api.events.join()  # the last watch events arrive
    watch.cancel()
    watcher.stop()
    await checker
    assert watcher.violations == [], f"seed {seed}: {watcher.violations}"
    assert watcher.checks > 50  # the checker ran all through the round

    # each pod bound at most once, where the API says, and the ledger agrees with the API
    for uid, nodes_won in won.items():
        assert len(nodes_won) <= 1, f"seed {seed}: pod {uid} answered bound to {nodes_won}"
    for uid, bound in api.bindings.items():
        assert len(bound) == 1, f"seed {seed}: the API bound pod {uid} {len(bound)} times"
    for uid, nodes_won in won.items():
        landed = api.bindings.get(uid, [])
        assert not nodes_won or landed == sorted(nodes_won), (
            f"seed {seed}: {uid} won {nodes_won}, API has {landed}"
        )
    assert {k: p["spec"].get("nodeName") for k, p in state.pods.items()} == {
        k: p["spec"].get("nodeName") for k, p in api.pods.items()
    }
    violations = check_cluster(state)
    assert violations == [], f"seed {seed}: {[str(v) for v in violations]}"
    # The ledger is a function of the API: a fresh extender reading the same objects agrees.
    fresh = ClusterState()
    fresh.load(
        [
            *({**n, "kind": "Node"} for n in state.nodes.values()),
            *({**p, "kind": "Pod"} for p in api.pods.values()),
        ]
    )
    confirmed = {
        r.key: (r.node, r.device_ids, r.bytes_per_device)
        for r in state.ledger.reservations()
        if not r.assumed
    }
    assert confirmed == {
        r.key: (r.node, r.device_ids, r.bytes_per_device) for r in fresh.ledger.reservations()
    }
    counts["bound"] = len(api.bindings)
    counts["checks"] = watcher.checks
    return counts


@pytest.mark.parametrize("seed", SEEDS)
async def test_live_like_binds_race_filters_deletes_and_relabels(seed: int) -> None:
    counts = await live_round(seed)
    assert counts["bound"] > 5 and counts["deletes"] > 0 and counts["relabels"] > 0


# ----- over HTTP, embedded mode ---------------------------------------------------------------------
async def test_http_embedded_concurrent_binds_for_the_same_gpus(aiohttp_client) -> None:
    """200 pods want 2 exclusive GPUs and 8 time-sliced replicas: 300 binds at once over HTTP,
    mixed with filters and full-Node filters that relabel the nodes."""
    rng = random.Random(7)
    nodes = Nodes()
    nodes.params = {"excl-0": dict(count=2, replicas=1), "ts-0": dict(count=2, replicas=4)}
    state = make_cluster(*nodes.objects())
    app = create_app(ExtenderService(state, EmbeddedBinder(state)))
    client = await aiohttp_client(app)
    pods = [random_pod(rng, f"h{i}", f"huid-{i}") for i in range(200)]
    for p in pods:  # embedded mode learns pending pods from filter
        r = await client.post("/filter", data=orjson.dumps({"Pod": p, "NodeNames": nodes.names}))
        assert r.status == 200
    watcher = Watcher(lambda: state.ledger)
    won: dict[str, set[str]] = defaultdict(set)

    async def bind(p: dict[str, Any]) -> None:
        node = rng.choice(["excl-0", "ts-0"])
        body = {
            "PodName": p["metadata"]["name"],
            "PodNamespace": "default",
            "PodUID": p["metadata"]["uid"],
            "Node": node,
        }
        r = await client.post("/bind", data=orjson.dumps(body))
        assert r.status == 200
        if not (await r.json())["Error"]:
            won[p["metadata"]["uid"]].add(node)

    async def relabel() -> None:
        node = nodes.relabel(rng)
        p = rng.choice(pods)
        r = await client.post("/filter", data=orjson.dumps({"Pod": p, "Nodes": {"items": [node]}}))
        assert r.status == 200

    tasks = (
        [bind(p) for p in pods]
        + [bind(p) for p in rng.sample(pods, 100)]
        + [relabel() for _ in range(40)]
    )
    rng.shuffle(tasks)
    checker = asyncio.ensure_future(watcher.run())
    await asyncio.gather(*tasks)
    watcher.stop()
    await checker
    assert watcher.violations == []
    assert all(len(n) == 1 for n in won.values())
    bound = {k: p["spec"]["nodeName"] for k, p in state.pods.items() if p["spec"].get("nodeName")}
    assert len(bound) == len(won) > 0
    assert check_cluster(state) == []
    # far more pods than room: the GPUs are full, and not one beyond
    a = state.ledger.arrays
    assert (a.used_replicas <= a.replicas).all() and (a.used <= a.capacity).all()
    assert len(won) < 200 and int(a.used_replicas.sum()) == sum(
        len(r.device_ids) for r in state.ledger.reservations()
    )


# ----- the races above, one at a time (regressions for the fixes they found) -------------------------
class GatedBinder:
    """Holds every bind until the test opens its gate, then answers as told."""

    def __init__(self) -> None:
        self.gates: list[tuple[asyncio.Event, list]] = []
        self.answers: list[BaseException | None] = []

    async def bind(
        self, the_pod: Mapping[str, Any], node: str, reservation: Reservation | None
    ) -> None:
        gate = asyncio.Event()
        self.gates.append((gate, [pod_ref(the_pod).key, node]))
        await gate.wait()
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer


def gated_service() -> tuple[ExtenderService, GatedBinder, ClusterState]:
    state = make_cluster(gpu_node("a", count=1), gpu_node("b", count=1))
    state.upsert_pod(pod("p", "60Gi", uid="u1"))
    state.upsert_pod(pod("q", "60Gi", uid="u2"))
    binder = GatedBinder()
    return ExtenderService(state, binder, pods=WatchedPods(state), assume_ttl=3600), binder, state


def bind_args(name: str, node: str, uid: str = "") -> ExtenderBindingArgs:
    return ExtenderBindingArgs(PodName=name, PodNamespace="default", PodUID=uid, Node=node)


@pytest.mark.parametrize("watch_first", [False, True])
async def test_a_pod_edited_between_filter_and_bind_is_not_booked_at_either_size(
    watch_first: bool,
) -> None:
    """kube-scheduler filters with its copy of the pod, bind reads the watch's: an edit of the
    pod's model-memory can reach one before the other. Booked at the watch's size, the pod
    could land on a node filter chose for the other; booked at the old one, the ledger would
    count less than the pod uses. The bind is refused, changes nothing, and the next cycle,
    with both copies edited, binds."""
    state = make_cluster(gpu_node("a", count=1, memory_mib=80 * 1024, replicas=4))
    old, new = pod("p", "20Gi", uid="u1"), pod("p", "70Gi", uid="u1")
    state.upsert_pod(new if watch_first else old)
    service = ExtenderService(state, EmbeddedBinder(state), pods=WatchedPods(state))
    out = service.filter(ExtenderArgs(Pod=old if watch_first else new, NodeNames=["a"]))
    assert out.NodeNames == ["a"]
    refused = await service.bind(bind_args("p", "a", "u1"))
    assert "changed while being scheduled" in refused.Error
    assert "(20Gi each)" in refused.Error and "(70Gi each)" in refused.Error, refused.Error
    assert state.ledger.reservation("default/p") is None
    state.upsert_pod(new)  # the watch catches up (or kube-scheduler's copy does)
    assert service.filter(ExtenderArgs(Pod=new, NodeNames=["a"])).NodeNames == ["a"]
    assert (await service.bind(bind_args("p", "a", "u1"))).Error == ""
    assert state.ledger.reservation("default/p").bytes_per_device == (70 << 30,)
    assert check_cluster(state) == []


async def test_a_second_bind_to_another_node_while_one_is_in_flight_is_refused() -> None:
    service, binder, state = gated_service()
    first = asyncio.ensure_future(service.bind(bind_args("p", "a")))
    await ticks(2)
    second = await service.bind(bind_args("p", "b"))
    assert "is being bound to a" in second.Error
    assert state.ledger.reservation("default/p").node == "a" and len(binder.gates) == 1
    binder.gates[0][0].set()
    assert (await first).Error == ""
    assert check_invariant(state.ledger) == []


async def test_a_retry_to_the_same_node_shares_the_outcome_of_the_bind_in_flight() -> None:
    service, binder, state = gated_service()
    first = asyncio.ensure_future(service.bind(bind_args("p", "a", "u1")))
    await ticks(2)
    retry = asyncio.ensure_future(service.bind(bind_args("p", "a", "u1")))
    await ticks(2)
    assert len(binder.gates) == 1  # one Binding, not two
    binder.answers.append(BindError("API server unreachable"))
    binder.gates[0][0].set()
    assert (await first).Error == (await retry).Error != ""
    assert state.ledger.reservation("default/p") is None  # released once, by the call that took it


async def test_an_unconfirmed_hold_elsewhere_is_not_given_away() -> None:
    """A bind that timed out may have landed: a bind of the same pod to another node must not
    free its devices (its watch event would then double-book them)."""
    service, binder, state = gated_service()
    first = asyncio.ensure_future(service.bind(bind_args("p", "a")))
    await ticks(2)
    binder.answers.append(Uncertain("timed out"))
    binder.gates[0][0].set()
    assert "failed" in (await first).Error
    held = state.ledger.reservation("default/p")
    assert held is not None and held.node == "a" and held.assumed
    refused = await service.bind(bind_args("p", "b"))
    assert "may already be bound to a" in refused.Error
    assert state.ledger.reservation("default/p") is held
    # q cannot take p's GPU on a, whatever happens to p's retries
    q = asyncio.ensure_future(service.bind(bind_args("q", "a")))
    assert "does not fit" in (await q).Error


async def test_a_failed_retry_keeps_the_hold_of_the_bind_that_landed() -> None:
    """Bound (assumed), then the pod is deleted and a stale retry gets 404: the hold stays until
    the watch says the pod is gone, so the landed Binding's event cannot double-book."""
    service, binder, state = gated_service()
    first = asyncio.ensure_future(service.bind(bind_args("p", "a")))
    await ticks(2)
    binder.gates[0][0].set()
    assert (await first).Error == ""
    held = state.ledger.reservation("default/p")
    retry = asyncio.ensure_future(service.bind(bind_args("p", "a")))
    await ticks(2)
    binder.answers.append(BindError("pod no longer exists"))
    binder.gates[1][0].set()
    assert "no longer exists" in (await retry).Error
    assert state.ledger.reservation("default/p") is held
    state.delete_pod("default/p")  # the watch's DELETED event
    assert state.ledger.reservation("default/p") is None


async def test_an_in_flight_bind_of_an_older_pod_with_the_same_name_is_not_shared() -> None:
    service, binder, state = gated_service()
    first = asyncio.ensure_future(service.bind(bind_args("p", "a", "u1")))
    await ticks(2)
    state.upsert_pod(pod("p", "60Gi", uid="u1-new"))  # deleted and re-created; the watch saw it
    second = await service.bind(bind_args("p", "a", "u1-new"))
    assert "is being bound" in second.Error
    binder.answers.append(BindError("pod no longer exists"))
    binder.gates[0][0].set()
    assert (await first).Error


# ----- the checker every test above relies on can fail -------------------------------------------------
def test_check_cluster_reports_each_kind_of_corruption() -> None:
    def fresh() -> ClusterState:
        return make_cluster(
            gpu_node("a", count=2),
            gpu_node("b", count=2),
            pod("p", "60Gi", node="a", phase="Running", uid="up"),
            pod("q", "60Gi", node="a", phase="Running", uid="uq"),
        )

    state = fresh()
    assert check_cluster(state) == [] and len(list(state.ledger.reservations())) == 2
    p = state.ledger.reservation("default/p")

    state.ledger.record(
        Reservation(
            pod=pod_ref(pod("x", "1Gi", uid="ux")),
            node="a",
            device_ids=p.device_ids,
            bytes_per_device=(80 * 2**30,),
        )
    )
    found = " ".join(map(str, check_cluster(state)))
    assert "VRAM oversubscribed" in found and "held by a pod that no longer exists" in found

    state = fresh()
    state.ledger.release("default/q")
    assert "bound to a but missing from the ledger" in " ".join(map(str, check_cluster(state)))

    state = fresh()
    held = state.ledger.release("default/p")
    state.ledger.record(
        Reservation(
            pod=held.pod, node="b", device_ids=("0",), bytes_per_device=held.bytes_per_device
        )
    )
    assert "held on b but bound to a" in " ".join(map(str, check_cluster(state)))

    state = fresh()
    p = state.ledger.reservation("default/p")
    annotated = pod(
        "p",
        "60Gi",
        node="a",
        phase="Running",
        uid="up",
        annotations={
            "vramsched.io/assignment": orjson.dumps(
                {
                    "node": "a",
                    "devices": list(p.device_ids),
                    "bytesPerDevice": list(p.bytes_per_device),
                }
            ).decode()
        },
    )
    state.pods["default/p"] = annotated  # the API says one thing ...
    other = "1" if p.device_ids == ("0",) else "0"
    state.ledger.release("default/p")  # ... the ledger another
    state.ledger.record(
        Reservation(pod=p.pod, node="a", device_ids=(other,), bytes_per_device=p.bytes_per_device)
    )
    assert "assignment says" in " ".join(map(str, check_cluster(state)))
