"""The device plugin's answers along random admissions, as the kubelet makes them: pods of plain
init containers, sidecars and app containers, allocated one container at a time; pods ending
(listed on without devices by kubelets before 1.34, or dropped), names re-used under new UIDs,
statuses written late, and plugin restarts. Every Allocate must hand the container exactly the
GPUs its spec order gives it from the pod's assignment. With restarts only while every admitted
pod's status is written, none may be refused (the kubelet admits one pod at a time); with
restarts at any moment, refusals are allowed, other GPUs never."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from extender.device_plugin.gpus import FakeGpus
from extender.device_plugin.matcher import KubeletPod, Refusal
from extender.device_plugin.server import DevicePluginService

NODE = "gpu-a"
GPU = "nvidia.com/gpu"
GPUS = 8


@dataclass
class Container:
    name: str
    count: int
    kind: str  # "init" (plain), "sidecar" or "app"


@dataclass
class Listed:
    """What the kubelet's PodResources List shows of one pod."""

    key: str
    containers: list[str]  # sidecars and app containers (plain init containers are not listed)
    devices: dict[str, tuple[str, ...]] = field(default_factory=dict)


def expected_gpus(containers: list[Container], gpus: list[int]) -> dict[str, tuple[int, ...]]:
    """The documented rule: sidecars and app containers take consecutive GPUs in spec order; a
    plain init container runs beside the sidecars started before it, so it takes the GPUs after
    theirs, which the app containers take on after it ends."""
    out: dict[str, tuple[int, ...]] = {}
    at = 0
    for c in containers:
        if c.count:
            out[c.name] = tuple(gpus[at : at + c.count])
        if c.kind != "init":
            at += c.count
    return out


def gpus_needed(containers: list[Container]) -> int:
    at = top = 0
    for c in containers:
        top = max(top, at + c.count)
        if c.kind != "init":
            at += c.count
    return top


def random_containers(rng: random.Random) -> list[Container]:
    while True:
        inits = [
            Container(f"i{j}", rng.choice([0, 0, 1, 1, 2]), rng.choice(["init", "sidecar"]))
            for j in range(rng.choice([0, 0, 1, 2, 3]))
        ]
        apps = [
            Container(f"a{j}", rng.choice([0, 1, 1, 2, 3]), "app") for j in range(rng.randint(1, 3))
        ]
        containers = inits + apps
        if 0 < gpus_needed(containers) <= GPUS:
            return containers


def api_pod(name: str, uid: str, containers: list[Container], gpus: list[int]) -> dict[str, Any]:
    def spec(c: Container) -> dict[str, Any]:
        out: dict[str, Any] = {"name": c.name}
        if c.count:
            out["resources"] = {"limits": {GPU: str(c.count)}}
        if c.kind == "sidecar":
            out["restartPolicy"] = "Always"
        return out

    assignment = {"node": NODE, "devices": [str(g) for g in gpus], "bytesPerDevice": 1 << 30}
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid,
            "annotations": {"vramsched.io/assignment": orjson.dumps(assignment).decode()},
        },
        "spec": {
            "nodeName": NODE,
            "initContainers": [spec(c) for c in containers if c.kind != "app"],
            "containers": [spec(c) for c in containers if c.kind == "app"],
        },
        "status": {"phase": "Pending"},
    }


class Walk:
    """`restarts_anywhere`: the plugin may also die between two Allocate calls of one pod (the
    kubelet then fails that pod's admission), or restart while an admitted pod's status is not
    written yet."""

    def __init__(self, seed: int, restarts_anywhere: bool = False) -> None:
        self.rng = random.Random(seed)
        self.restarts_anywhere = restarts_anywhere
        self.refused = 0
        self.gpus = FakeGpus(NODE, GPUS, 1000).gpus()
        self.listed: list[Listed] = []
        self.api: dict[str, dict[str, Any]] = {}
        self.uids = 0
        self.allocations = 0
        self.restart()

    def restart(self) -> None:
        """A new plugin process: it knows only what the kubelet and the API show."""
        self.service = DevicePluginService(
            node=NODE,
            gpus=self.gpus,
            replicas=2,
            strategies=("envvar",),
            kubelet_pods=lambda: [
                KubeletPod(p.key.split("/")[0], p.key.split("/")[1], dict(p.devices))
                for p in self.listed
            ],
            lookup=lambda keys: {k: self.api[k] for k in keys if k in self.api},
        )
        self.service.rebuild()

    def admit(self, name: str) -> None:
        rng = self.rng
        containers = random_containers(rng)
        gpus = rng.sample(range(GPUS), gpus_needed(containers))
        self.uids += 1
        key = f"ns/{name}"
        pod = api_pod(name, f"uid-{self.uids}", containers, gpus)
        self.api[key] = pod
        entry = Listed(key, [c.name for c in containers if c.kind != "init"])
        self.listed = [p for p in self.listed if p.key != key] + [entry]
        want = expected_gpus(containers, gpus)
        known = sorted(self.service._known)
        for c in containers:  # init containers, then app containers, each in spec order
            if not c.count:
                continue
            if self.restarts_anywhere and rng.random() < 0.15:
                # the plugin dies before this container's Allocate: the kubelet's call fails,
                # and so does the pod's admission (a new plugin cannot register within it)
                self.restart()
                pod["status"] = {"phase": "Failed"}
                entry.devices = {}
                return
            ids = rng.sample(known, c.count)
            got = self.service._allocate_one(ids, {})
            if isinstance(got, Refusal):
                assert self.restarts_anywhere, f"{key} {c.name}: {got.reason}"
                self.refused += 1
                pod["status"] = {"phase": "Failed"}  # UnexpectedAdmissionError
                entry.devices = {}
                return
            handed = tuple(int(i) for i in got.envs["VRAMSCHED_GPU_INDEX"].split(","))
            assert handed == want[c.name], f"{key} {c.name} ({c.kind}) of {containers}, {gpus}"
            self.allocations += 1
            if c.kind != "init":
                entry.devices[c.name] = tuple(ids)
        if rng.random() < 0.6:
            self.write_status(key)

    def write_status(self, key: str) -> None:
        pod = self.api[key]
        pod["status"] = {
            "phase": "Running",
            "initContainerStatuses": [{"name": c["name"]} for c in pod["spec"]["initContainers"]],
            "containerStatuses": [{"name": c["name"]} for c in pod["spec"]["containers"]],
        }

    def end(self) -> None:
        live = [
            p for p in self.listed if self.api[p.key]["status"]["phase"] in ("Pending", "Running")
        ]
        if not live:
            return
        entry = self.rng.choice(live)
        self.api[entry.key]["status"] = {"phase": self.rng.choice(["Succeeded", "Failed"])}
        if self.rng.random() < 0.5:
            self.listed.remove(entry)  # kubelets from 1.34 list active pods only
        else:
            entry.devices = {}  # older ones list it on, its devices freed

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.55:
            # a name used before comes back under a new UID now and then
            name = (
                f"p{self.rng.randint(0, self.uids)}"
                if self.rng.random() < 0.2
                else f"p{self.uids + 1}"
            )
            if any(p.key == f"ns/{name}" for p in self.listed) and self.api[f"ns/{name}"]["status"][
                "phase"
            ] in ("Pending", "Running"):
                return  # the kubelet holds a live pod of that name
            self.admit(name)
        elif roll < 0.75:
            self.end()
        elif roll < 0.9:
            pending = [
                p.key for p in self.listed if self.api[p.key]["status"]["phase"] == "Pending"
            ]
            if pending:
                self.write_status(self.rng.choice(pending))
        elif roll < 0.95:
            # the kubelet restarted: this plugin registers again and rebuilds its record
            self.service.rebuild()
        elif self.restarts_anywhere or all(
            self.api[p.key]["status"]["phase"] != "Pending" for p in self.listed
        ):
            self.restart()


@pytest.mark.parametrize("seed", range(100))
def test_every_allocate_hands_the_container_its_gpus(seed: int) -> None:
    walk = Walk(seed)
    for _ in range(100):
        walk.step()
    assert walk.allocations > 0


@pytest.mark.parametrize("seed", range(100))
def test_a_restart_at_any_moment_refuses_or_hands_the_right_gpus(seed: int) -> None:
    """A plugin process restarted before the kubelet wrote an admitted pod's status may not know
    which plain init containers it served: it may then refuse (the pod fails admission and its
    controller makes a new one), never hand a container other GPUs than its own. One that dies
    between two Allocate calls of one pod fails that pod's admission (the kubelet's next call
    reaches no plugin)."""
    walk = Walk(seed, restarts_anywhere=True)
    for _ in range(100):
        walk.step()
    assert walk.allocations > 0


# ----- the same through gRPC, GetPreferredAllocation then Allocate, as the kubelet calls them -----


@pytest.mark.parametrize("seed", range(6))
def test_admissions_through_grpc_hand_each_container_its_gpus(tmp_path: Any, seed: int) -> None:
    """SimKubelet admits pods through the plugin's socket: per container GetPreferredAllocation
    (whose list the Allocate after it reuses), then Allocate; pods leave, names come back, the
    plugin process restarts. Every container gets exactly its GPUs, and the kubelet's own record
    holds replicas of them whenever they had free ones."""
    from test_device_plugin import Node

    rng = random.Random(seed)
    node = Node(tmp_path, gpus=GPUS, replicas=4)
    try:
        uuids = [g.uuid for g in node.source.gpus()]
        held: dict[str, list[str]] = {}  # pod key -> the kubelet's device IDs it holds
        admitted = recorded = 0
        for n in range(40):
            roll = rng.random()
            if roll < 0.25 and held:
                key = rng.choice(sorted(held))
                node.kubelet.remove(key)
                del held[key]
                continue
            if roll < 0.3:
                node.restart_plugin()
                continue
            name = f"p{rng.randint(0, n)}"
            if f"ns/{name}" in held:
                continue
            containers = random_containers(rng)
            in_use = {d for ids in held.values() for d in ids}
            if sum(c.count for c in containers) > GPUS * 4 - len(in_use):
                continue  # SimKubelet has too few device IDs left (it reuses no init's)
            gpus = rng.sample(range(GPUS), gpus_needed(containers))
            p = api_pod(name, f"uid-{n}", containers, gpus)
            want = expected_gpus(containers, gpus)
            got = node.admit(p)
            p["status"] = {"phase": "Running"}  # the kubelet writes it once admitted
            held[f"ns/{name}"] = [d for ids in got.devices.values() for d in ids]
            admitted += 1
            for c in containers:
                if not c.count:
                    continue
                env = got.responses[c.name].envs
                assert env["VRAMSCHED_GPU_INDEX"] == ",".join(map(str, want[c.name])), c
                free = {
                    g: sum(1 for r in range(4) if f"{uuids[g]}::{r}" not in in_use)
                    for g in want[c.name]
                }
                if all(free.values()):
                    kubelet_gpus = sorted(d.split("::")[0] for d in got.devices[c.name])
                    assert kubelet_gpus == sorted(uuids[g] for g in want[c.name]), c
                    recorded += 1
                in_use |= set(got.devices[c.name])
        assert admitted > 10 and recorded > 10
    finally:
        node.close()
