"""vramsched's device plugin without a kubelet: the pure matcher and device specs, the generated
stubs, the NVML source against a fake NVML module, and the gRPC service against SimKubelet (the
kubelet's device-manager protocol in-process). tests/e2e/test_device_plugin_e2e.py runs it under
a real kubelet."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from extender.commands.device_plugin import replicas_to_serve
from extender.demand import pod_demand
from extender.device_plugin.api import deviceplugin_v1beta1_pb2 as dp
from extender.device_plugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from extender.device_plugin.api.generate import API_DIR, PROTOS, clean, generate
from extender.device_plugin.gpus import FakeGpus, GpuSourceError, NvmlGpus, fake_uuid
from extender.device_plugin.matcher import (
    KubeletPod,
    Match,
    Refusal,
    container_slots,
    gpu_of,
    identify,
    preferred_devices,
    replica_id,
)
from extender.device_plugin.server import DevicePluginService, PluginRunner
from extender.device_plugin.simkubelet import AdmissionError, SimKubelet
from extender.device_plugin.specs import container_spec, parse_strategies
from extender.plugin_state import PluginState, StateError, decode_state, encode_state

NODE = "gpu-a"
GPU = "nvidia.com/gpu"


def pod(
    name: str,
    gpus: list[int] | None,
    *,
    node: str = NODE,
    containers: list[tuple[str, int]] | None = None,
    inits: list[tuple[str, int, bool]] = (),
    uid: str | None = None,
) -> dict[str, Any]:
    """A bound pod; `gpus` its assignment (None: no vramsched assignment)."""
    ann = {}
    if gpus is not None:
        ann["vramsched.io/assignment"] = orjson.dumps(
            {"node": node, "devices": [str(g) for g in gpus], "bytesPerDevice": 1 << 30}
        ).decode()
    containers = containers if containers is not None else [("main", len(gpus or [1]))]

    def c(n: str, k: int, **kw: Any) -> dict[str, Any]:
        return {"name": n, "resources": {"limits": {GPU: str(k)}} if k else {}, **kw}

    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid or f"uid-{name}",
            "annotations": ann,
        },
        "spec": {
            "nodeName": node,
            "containers": [c(n, k) for n, k in containers],
            "initContainers": [
                c(n, k, **({"restartPolicy": "Always"} if side else {})) for n, k, side in inits
            ],
        },
    }


def kp(name: str, **devices: tuple[str, ...]) -> KubeletPod:
    return KubeletPod("ns", name, devices)


def index(*pods: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"ns/{p['metadata']['name']}": p for p in pods}


# ----- matcher ------------------------------------------------------------------------------------


def test_the_pod_without_devices_is_the_one_allocated():
    running, waiting = pod("running", [1]), pod("waiting", [3])
    got = identify(
        1, [kp("running", main=("x::0",)), kp("waiting")], index(running, waiting), {}, GPU, NODE
    )
    assert isinstance(got, Match) and got.pod == "ns/waiting" and got.slot.gpus == (3,)


def test_two_waiting_pods_with_different_gpus_are_refused_never_guessed():
    a, b = pod("a", [1]), pod("b", [2])
    got = identify(1, [kp("a"), kp("b")], index(a, b), {}, GPU, NODE)
    assert isinstance(got, Refusal) and got.ambiguous
    assert "ns/a (GPU 1)" in got.reason and "ns/b (GPU 2)" in got.reason


def test_two_waiting_pods_with_the_same_gpus_get_that_gpu():
    a, b = pod("a", [4]), pod("b", [4])
    got = identify(1, [kp("a"), kp("b")], index(a, b), {}, GPU, NODE)
    assert isinstance(got, Match) and got.slot.gpus == (4,)


def test_the_count_tells_waiting_pods_apart():
    one, two = pod("one", [1]), pod("two", [2, 5])
    got = identify(2, [kp("one"), kp("two")], index(one, two), {}, GPU, NODE)
    assert isinstance(got, Match) and got.pod == "ns/two" and got.slot.gpus == (2, 5)


def test_no_waiting_pod_is_refused_with_what_waits():
    one = pod("one", [1])
    got = identify(2, [kp("one")], index(one), {}, GPU, NODE)
    assert isinstance(got, Refusal) and not got.ambiguous
    assert "no pod on gpu-a is waiting for 2 nvidia.com/gpu (waiting: ns/one (1))" == got.reason


@pytest.mark.parametrize(
    "bad, says",
    [
        (pod("other", None), "has no vramsched.io/assignment"),
        (pod("elsewhere", [1], node="gpu-b"), "assigned GPUs on gpu-b, not on this node"),
    ],
)
def test_pods_vramsched_did_not_place_here_are_refused(bad, says):
    bad["spec"]["nodeName"] = NODE
    got = identify(1, [kp(bad["metadata"]["name"])], index(bad), {}, GPU, NODE)
    assert isinstance(got, Refusal) and says in got.reason


def test_an_unplaced_gpu_pod_waiting_beside_ours_makes_it_ambiguous():
    ours, other = pod("ours", [1]), pod("other", None)
    got = identify(1, [kp("ours"), kp("other")], index(ours, other), {}, GPU, NODE)
    assert isinstance(got, Refusal) and got.ambiguous


@pytest.mark.parametrize("device", ["03", "+3", " 3", "3_0", "\u0663", "\uff13", "-1", ""])
def test_a_gpu_index_written_loosely_is_refused_not_read_as_another_gpu(device: str) -> None:
    """int() reads `03`, `+3` and Arabic-Indic `3` as GPU 3, while the extender's ledger, which
    knows GPU `3` only, counted such a pod on no GPU: the plugin handed out GPU 3 and the ledger
    kept its memory free for the next pod."""
    p = pod("loose", [0])
    p["metadata"]["annotations"]["vramsched.io/assignment"] = orjson.dumps(
        {"node": NODE, "devices": [device], "bytesPerDevice": 1}
    ).decode()
    got = identify(1, [kp("loose")], index(p), {}, GPU, NODE)
    assert isinstance(got, Refusal) and "is not a GPU index or a MIG slice's ID" in got.reason


def test_mig_assignments_are_refused():
    p = pod("mig", [0])
    p["metadata"]["annotations"]["vramsched.io/assignment"] = orjson.dumps(
        {"node": NODE, "devices": ["0:1g.10gb:0"], "bytesPerDevice": 1}
    ).decode()
    got = identify(1, [kp("mig")], index(p), {}, GPU, NODE)
    assert isinstance(got, Refusal) and "whole GPUs, not MIG slices" in got.reason


def test_containers_take_consecutive_slices_and_init_containers_the_first_gpus():
    p = pod(
        "multi",
        [2, 6, 7],
        containers=[("a", 1), ("sidecar-free", 0), ("b", 2)],
        inits=[("warmup", 1, False)],
    )
    slots = container_slots(p, GPU, NODE)
    assert [(s.container, s.gpus, s.init) for s in slots] == [
        ("warmup", (2,), True),
        ("a", (2,), False),
        ("b", (6, 7), False),
    ]
    # the kubelet allocates in that order: init first (not listed by PodResources), then a, then b
    first = identify(1, [kp("multi")], index(p), {}, GPU, NODE)
    assert first.slot.container == "warmup"
    second = identify(1, [kp("multi")], index(p), {"uid-multi": frozenset({"warmup"})}, GPU, NODE)
    assert second.slot.container == "a"
    third = identify(
        2, [kp("multi", a=("x::1",))], index(p), {"uid-multi": frozenset({"warmup"})}, GPU, NODE
    )
    assert third.slot.container == "b" and third.slot.gpus == (6, 7)


def test_a_pod_asking_more_than_its_assignment_is_refused():
    p = pod("greedy", [1], containers=[("main", 2)])
    assert isinstance(container_slots(p, GPU, NODE), Refusal)


def test_sidecars_keep_their_gpus_and_plain_init_containers_run_beside_them():
    """The kubelet keeps a sidecar's devices while the app containers run and reuses only plain
    init containers' devices; a plain init container runs beside the sidecars before it. Slots
    that gave a plain init container the sidecar's GPU ran two containers on one booked GPU."""
    p = pod(
        "sides",
        [4, 1, 6],
        containers=[("main", 1)],
        inits=[("proxy", 1, True), ("warmup", 2, False), ("agent", 1, True)],
    )
    slots = container_slots(p, GPU, NODE)
    assert [(s.container, s.gpus, s.init) for s in slots] == [
        ("proxy", (4,), False),
        ("warmup", (1, 6), True),  # beside proxy: the GPUs after its GPU 4
        ("agent", (1,), False),  # starts once warmup ended
        ("main", (6,), False),
    ]
    # the extender books the same count: proxy + agent + main at once, proxy + warmup before
    assert pod_demand(p).gpu_count == 3
    inits = [("proxy", 1, True), ("warmup", 2, False)]
    got = container_slots(pod("short", [4, 1], containers=[("main", 1)], inits=inits), GPU, NODE)
    assert isinstance(got, Refusal) and "holds (2): 3 at once" in got.reason


def test_preferred_devices_are_replicas_of_the_assigned_gpus():
    ids = [replica_id(u, r, 4) for u in ("GPU-a", "GPU-b", "GPU-c") for r in range(4)]
    available = [i for i in ids if i not in ("GPU-c::0", "GPU-c::1")]
    assert preferred_devices(available, [], 2, ["GPU-c", "GPU-a"]) == ["GPU-c::2", "GPU-a::0"]
    # unknown pod: lowest IDs, must_include first
    assert preferred_devices(available, ["GPU-b::3"], 2, None) == ["GPU-b::3", "GPU-a::0"]
    # the assigned GPU has no free replica: still `size` IDs
    assert preferred_devices(["GPU-a::0", "GPU-b::0"], [], 1, ["GPU-c"]) == ["GPU-a::0"]
    # a replica suffix that is a digit but not a decimal one ("²") once raised ValueError
    assert preferred_devices(["GPU-a::²", "GPU-a::1"], [], 1, None) == ["GPU-a::²"]


# ----- device specs ---------------------------------------------------------------------------------


def test_device_list_strategies_match_nvidias_plugin():
    uuids = ["GPU-1", "GPU-2"]
    env = container_spec(["envvar"], uuids, [1, 2], "r")
    assert env.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-2", "VRAMSCHED_GPU_INDEX": "1,2"}
    assert not env.mounts and not env.annotations and not env.cdi_devices
    vol = container_spec(["volume-mounts"], uuids, [1, 2], "r")
    assert vol.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert vol.mounts == [
        ("/var/run/nvidia-container-devices/GPU-1", "/dev/null"),
        ("/var/run/nvidia-container-devices/GPU-2", "/dev/null"),
    ]
    cdi = container_spec(["cdi-annotations", "cdi-cri"], uuids, [1, 2], "req-1")
    assert "NVIDIA_VISIBLE_DEVICES" not in cdi.envs
    assert cdi.annotations == {
        "cdi.k8s.io/vramsched-device-plugin_req-1": "nvidia.com/gpu=GPU-1,nvidia.com/gpu=GPU-2"
    }
    assert cdi.cdi_devices == ["nvidia.com/gpu=GPU-1", "nvidia.com/gpu=GPU-2"]
    both = container_spec(["envvar", "cdi-cri"], uuids, [1, 2], "r")
    assert both.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1,GPU-2" and both.cdi_devices


def test_strategies_are_checked():
    assert parse_strategies("cdi-cri, envvar") == ("envvar", "cdi-cri")
    with pytest.raises(ValueError, match="each must be one of"):
        parse_strategies("env")


def test_plugin_state_round_trips_and_bad_input_is_named():
    state = PluginState(True, 8, 4, (3, 1), strategy=("envvar",))
    assert decode_state(encode_state(state)) == PluginState(True, 8, 4, (1, 3))
    for raw in ("{", '{"gpus": 1}', '{"registered": true, "gpus": 1, "replicas": 0}'):
        with pytest.raises(StateError, match="vramsched.io/device-plugin-state"):
            decode_state(raw)
    # read as the plugin writes it, not coerced: "false" was once true, 1.5 one GPU
    good = {"registered": True, "gpus": 2, "replicas": 4}
    for key, value, says in (
        ("registered", "false", "registered 'false' is not true or false"),
        ("gpus", 1.5, "gpus 1.5 is not a whole number >= 0"),
        ("gpus", True, "gpus True is not a whole number"),
        ("replicas", "4", "replicas '4' is not a whole number >= 1"),
        ("unhealthy", [0.5], "unhealthy [0.5] is not a list of GPU indices"),
        ("unhealthy", "1", "unhealthy '1' is not a list"),
        ("strategy", "envvar", "strategy 'envvar' is not a list of names"),
        ("resource", 5, "resource 5 is not a resource name"),
    ):
        with pytest.raises(StateError, match=re.escape(says)):
            decode_state(json.dumps({**good, key: value}))
    with pytest.raises(StateError, match="is not a JSON object"):
        decode_state("[1]")


# ----- the generated stubs ---------------------------------------------------------------------------


def test_committed_stubs_are_what_the_protos_generate(tmp_path):
    for path in generate(tmp_path):
        committed = API_DIR / path.name
        assert committed.read_text() == path.read_text(), f"{path.name} is stale: make protos"
    assert len(list(tmp_path.rglob("*_pb2*.py*"))) == 3 * len(PROTOS)


def test_clean_drops_gogo_and_keeps_the_wire():
    upstream = (
        'syntax = "proto3";\npackage v1;\nimport "github.com/gogo/protobuf/gogoproto/gogo.proto";\n'
        'option (gogoproto.marshaler_all) = true;\noption go_package = "x";\n'
        'message M {\n  string id = 1 [(gogoproto.customname) = "ID", json_name = "id"];\n'
        "  int64 n = 2 [(gogoproto.nullable) = false];\n}\n"
    )
    out = clean(upstream)
    assert "gogo" not in out
    assert 'string id = 1 [json_name = "id"];' in out and "int64 n = 2;" in out
    assert 'option go_package = "x";' in out


# ----- NVML, against a fake NVML module ------------------------------------------------------------


class FakeNvml:
    """The few pynvml functions the source calls, with failures to order."""

    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_DEVICE_MIG_ENABLE = 1
    nvmlEventTypeXidCriticalError = 8
    nvmlEventTypeDoubleBitEccError = 2
    nvmlEventTypeSingleBitEccError = 1

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    class Event:
        def __init__(self, device: Any, kind: int, data: int) -> None:
            self.device, self.eventType, self.eventData = device, kind, data

    def __init__(self, count: int = 3, mig: int = -1, no_handle: int = -1) -> None:
        self.count, self.mig, self.no_handle = count, mig, no_handle
        self.events: list[Any] = []
        self.freed = False

    class Mem:
        total = 80 * 1024**3

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        i = int(uuid.rsplit("-", 1)[1])
        if i == self.no_handle:
            raise self.NVMLError(999)
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-fake-{h}".encode()

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA A100-SXM4-80GB"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return self.Mem()

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        if h == self.mig:
            return [1, 1]
        raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return 0xFF

    def nvmlDeviceRegisterEvents(self, h: int, mask: int, events: str) -> None:
        assert mask & self.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait(self, events: str, ms: int) -> Any:
        if not self.events:
            time.sleep(0.01)
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        item = self.events.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def nvmlEventSetFree(self, events: str) -> None:
        self.freed = True


def _health(nvml: FakeNvml, until: int) -> dict[int, str]:
    found: dict[int, str] = {}
    stop = threading.Event()

    def mark(i: int, why: str) -> None:
        found.setdefault(i, why)
        if len(found) >= until:
            stop.set()

    t = threading.Thread(target=NvmlGpus(nvml).watch_health, args=(mark, stop), daemon=True)
    t.start()
    t.join(5)
    stop.set()
    t.join(5)
    assert not t.is_alive() and nvml.freed
    return found


def test_nvml_lists_gpus_by_index_and_refuses_mig():
    gpus = NvmlGpus(FakeNvml()).gpus()
    assert [(g.index, g.uuid, g.memory_bytes) for g in gpus] == [
        (i, f"GPU-fake-{i}", 80 * 1024**3) for i in range(3)
    ]
    with pytest.raises(GpuSourceError, match="GPU 1 has MIG enabled"):
        NvmlGpus(FakeNvml(mig=1)).gpus()


def test_nvml_health_follows_nvidias_rules():
    nvml = FakeNvml(no_handle=0)
    xid = nvml.nvmlEventTypeXidCriticalError
    nvml.events = [
        nvml.Event(1, xid, 31),  # application error: ignored
        nvml.Event(1, nvml.nvmlEventTypeSingleBitEccError, 0),  # not an XID: ignored
        nvml.Event(2, xid, 79),  # fell off the bus: unhealthy
    ]
    found = _health(nvml, until=2)
    assert set(found) == {0, 2}
    assert "cannot watch its events" in found[0] and "XID 79" in found[2]


def test_a_failing_event_wait_marks_every_gpu_unhealthy():
    nvml = FakeNvml()
    nvml.events = [nvml.NVMLError(999)]
    assert set(_health(nvml, until=3)) == {0, 1, 2}


def test_fake_uuids_are_stable_per_node():
    assert fake_uuid("a", 0) == fake_uuid("a", 0) != fake_uuid("b", 0) != fake_uuid("a", 1)
    assert [g.uuid for g in FakeGpus("a", 2, 10).gpus()] == [fake_uuid("a", 0), fake_uuid("a", 1)]


def test_fake_unhealthy_indices_must_name_fake_gpus():
    with pytest.raises(GpuSourceError, match=r"--fake-unhealthy -1,4: not a GPU index \(0 to 3\)"):
        FakeGpus("a", 4, 10, fail=[4, -1, 2])
    assert FakeGpus("a", 4, 10, fail=[3, 0]).gpus()[3].index == 3


# ----- the gRPC service under SimKubelet -------------------------------------------------------------


class Node:
    """One plugin (fake GPUs) registered with a SimKubelet, pods looked up from a dict."""

    def __init__(
        self, root: Path, gpus: int = 4, replicas: int = 2, strategy: str = "envvar"
    ) -> None:
        self.root = root
        self.pods: dict[str, dict[str, Any]] = {}
        self.published: list[PluginState] = []
        self.source = FakeGpus(NODE, gpus, 1000)
        self.kubelet = SimKubelet(root / "dp", root / "pr" / "kubelet.sock", GPU).start()
        self.replicas, self.strategies = replicas, parse_strategies(strategy)
        self._plugin()

    def admit(self, p: dict[str, Any]) -> Any:
        self.pods[f"ns/{p['metadata']['name']}"] = p
        return self.kubelet.admit(p)

    def _plugin(self) -> None:
        from extender.device_plugin.kubelet import PodResources

        self.service = DevicePluginService(
            node=NODE,
            gpus=self.source.gpus(),
            replicas=self.replicas,
            strategies=self.strategies,
            kubelet_pods=PodResources(self.root / "pr" / "kubelet.sock", GPU).list,
            lookup=lambda keys: {k: self.pods[k] for k in keys if k in self.pods},
        )
        self.runner = PluginRunner(
            self.service,
            plugin_dir=self.root / "dp",
            socket_name="vramsched.sock",
            source=self.source,
            publish=self.published.append,
            poll=0.05,
        )
        self.thread = threading.Thread(target=self.runner.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.runner.registrations and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.runner.registrations, "the plugin did not register"
        self.kubelet.wait_devices(len(self.source.gpus()) * self.replicas)

    def restart_plugin(self) -> None:
        """A new plugin process: a fresh service registers with the same kubelet."""
        self.runner.stop()
        self.thread.join(5)
        self._plugin()

    def close(self) -> None:
        self.runner.stop()
        self.thread.join(5)
        self.kubelet.stop()


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def test_each_container_gets_exactly_its_assigned_gpu(node):
    uuids = [g.uuid for g in node.source.gpus()]
    for name, gpus in (("p0", [2]), ("p1", [2]), ("p2", [0, 3])):
        got = node.admit(pod(name, gpus))
        env = got.responses["main"].envs
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids[g] for g in gpus)
        assert env["VRAMSCHED_GPU_INDEX"] == ",".join(map(str, gpus))
        # GetPreferredAllocation steered the kubelet's own record onto the same GPUs
        assert sorted(d.split("::")[0] for d in got.devices["main"]) == sorted(
            uuids[g] for g in gpus
        )
    assert node.published[-1] == PluginState(True, 4, 2, (), strategy=("envvar",))
    served = node.service.metrics.allocations.labels("served")._value.get()
    assert served == 3


def test_a_refusal_reaches_the_kubelet_and_frees_nothing_else(node):
    node.admit(pod("ours", [1]))
    with pytest.raises(AdmissionError, match="has no vramsched.io/assignment"):
        node.admit(pod("stranger", None))
    # two pods the kubelet holds without devices, different GPUs: Allocate refuses, never guesses
    a, b = pod("a", [0]), pod("b", [3])
    node.pods.update(index(a, b))
    node.kubelet.active.update({"ns/a": ["main"], "ns/b": ["main"]})
    stub = dp_grpc.DevicePluginStub(grpc.insecure_channel(f"unix:{node.runner.socket}"))
    with pytest.raises(grpc.RpcError) as err:
        stub.Allocate(
            dp.AllocateRequest(
                container_requests=[
                    dp.ContainerAllocateRequest(
                        devices_ids=[replica_id(node.source.gpus()[0].uuid, 1, 2)]
                    )
                ]
            )
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "refusing rather than guessing" in err.value.details()
    assert node.service.metrics.allocations.labels("ambiguous")._value.get() == 1


def test_unhealthy_gpu_is_withdrawn_published_and_never_handed_out(node):
    node.service.mark_unhealthy(1, "XID 79")
    deadline = time.monotonic() + 5
    while sum(node.kubelet.devices.values()) != 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sum(node.kubelet.devices.values()) == 6  # 3 healthy GPUs x 2 replicas
    deadline = time.monotonic() + 5
    while node.published[-1].unhealthy != (1,) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.published[-1].unhealthy == (1,)
    with pytest.raises(
        AdmissionError, match=r"assigned GPU 1, which this node cannot serve \(GPU 1: XID 79\)"
    ):
        node.admit(pod("unlucky", [1]))


def test_plugin_registers_again_after_a_kubelet_restart(node):
    node.admit(pod("before", [2]))
    held = dict(node.kubelet.allocated)
    active = dict(node.kubelet.active)
    node.kubelet.stop()
    # a new kubelet: it removed every socket in the folder and keeps what it had allocated
    (node.root / "dp" / "vramsched.sock").unlink(missing_ok=True)
    node.kubelet = SimKubelet(node.root / "dp", node.root / "pr" / "kubelet.sock", GPU).start()
    node.kubelet.allocated.update(held)
    node.kubelet.active.update(active)
    node.kubelet.wait_devices(8)
    # the kubelet may list the devices before the plugin's Register call has returned to it
    deadline = time.monotonic() + 5
    while node.runner.registrations < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.runner.registrations == 2
    got = node.admit(pod("after", [2]))
    assert got.responses["main"].envs["VRAMSCHED_GPU_INDEX"] == "2"


def test_stopping_unpublishes(tmp_path):
    n = Node(tmp_path, strategy="volume-mounts")
    got = n.admit(pod("vm", [3]))
    assert [m.container_path for m in got.responses["main"].mounts] == [
        f"/var/run/nvidia-container-devices/{n.source.gpus()[3].uuid}"
    ]
    n.close()
    assert n.published[-1].registered is False
    assert not (tmp_path / "dp" / "vramsched.sock").exists()


# ----- pods that ended, init containers, restarts ------------------------------------------------------


def ended_pod(name: str, gpus: list[int] | None, phase: str) -> dict[str, Any]:
    p = pod(name, gpus)
    p["status"] = {"phase": phase}
    return p


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_pods_that_ended_are_never_candidates(phase):
    """Kubelets before 1.34 still list ended pods (KubeletPodResourcesListUseActivePods)."""
    refused, stranger = ended_pod("refused", [5], phase), ended_pod("stranger", None, phase)
    waiting = pod("waiting", [2])
    listed = [kp("refused"), kp("stranger"), kp("waiting")]
    got = identify(1, listed, index(refused, stranger, waiting), {}, GPU, NODE)
    assert isinstance(got, Match) and got.pod == "ns/waiting" and got.slot.gpus == (2,)
    # the same pods still Pending in the API: the plugin cannot tell, and says so
    refused["status"]["phase"] = "Pending"
    got = identify(1, listed[::2], index(refused, waiting), {}, GPU, NODE)
    assert isinstance(got, Refusal) and got.ambiguous


def test_after_a_kubelet_restart_init_containers_the_plugin_never_saw_are_not_waiting():
    """A restarted kubelet lists the pods it admitted before; the plugin may have registered
    before they were listed, so its record of served init containers can miss them."""
    inits = [("warmup", 1, False)]
    init_app = pod("init-app", [0], containers=[("main", 1)], inits=inits)
    init_only = admitted_status(pod("init-only", [1], containers=[("main", 0)], inits=inits))
    waiting = pod("waiting", [3])
    listed = [kp("init-app", main=("x::0",)), kp("init-only", main=()), kp("waiting")]
    got = identify(1, listed, index(init_app, init_only, waiting), {}, GPU, NODE)
    assert isinstance(got, Match) and got.pod == "ns/waiting" and got.slot.gpus == (3,)
    # a plain init container after a sidecar that holds devices is still to come
    side = pod(
        "side", [2, 5], containers=[("main", 1)], inits=[("sidecar", 1, True), ("warmup", 1, False)]
    )
    got = identify(1, [kp("side", sidecar=("x::2",), main=())], index(side), {}, GPU, NODE)
    # it runs beside the sidecar, so not on the sidecar's GPU 2 (the pod is booked on 2 and 5)
    assert isinstance(got, Match) and got.slot.container == "warmup" and got.slot.gpus == (5,)


def admitted_status(p: dict[str, Any]) -> dict[str, Any]:
    """What the kubelet writes once it admitted the pod and started its init container."""
    init = [c["name"] for c in p["spec"]["initContainers"]]
    p["status"] = {
        "phase": "Pending",
        "initContainerStatuses": [{"name": n, "state": {"running": {}}} for n in init],
    }
    return p


def service_over(listed: list[KubeletPod], pods: dict[str, dict[str, Any]]) -> DevicePluginService:
    return DevicePluginService(
        node=NODE,
        gpus=FakeGpus(NODE, 4, 1000).gpus(),
        replicas=2,
        strategies=("envvar",),
        kubelet_pods=lambda: listed,
        lookup=lambda keys: {k: pods[k] for k in keys if k in pods},
    )


def test_rebuild_knows_which_init_containers_were_served():
    inits = [("warmup", 1, False)]
    # admitted, GPU only in its init container: PodResources shows no device for it
    only_init = admitted_status(pod("only-init", [1], containers=[("main", 0)], inits=inits))
    # admitted, its app container holds devices
    with_app = pod("with-app", [2], containers=[("main", 1)], inits=inits)
    # listed, not admitted yet (no status): its Allocate calls are still to come
    waiting = pod("waiting", [3], containers=[("main", 0)], inits=inits)
    # refused earlier, still listed by an older kubelet
    failed = ended_pod("failed", [0], "Failed")
    failed["spec"]["initContainers"] = with_app["spec"]["initContainers"]
    listed = [
        kp("only-init", main=()),
        kp("with-app", main=("x::0",)),
        kp("waiting", main=()),
        kp("failed", main=()),
    ]
    service = service_over(listed, index(only_init, with_app, waiting, failed))
    assert service.rebuild() == 2
    assert service.served_init == {
        "uid-only-init": frozenset({"warmup"}),
        "uid-with-app": frozenset({"warmup"}),
    }
    # so the next Allocate of one device is for the pod that waits, on its GPU
    got = service._identify(1, {})
    assert isinstance(got, Match) and got.pod == "ns/waiting" and got.slot.gpus == (3,)


def test_a_registration_again_keeps_what_this_process_served():
    """A kubelet restart makes the plugin register again and rebuild its record. A pod admitted
    with its GPU in its init container only, whose status the kubelet has not written yet, lost
    its record there and looked as if it still waited: the next pod was refused as ambiguous."""
    inits = [("warmup", 1, False)]
    first = pod("first", [1], containers=[("main", 0)], inits=inits)
    listed = [kp("first", main=())]
    pods = index(first)
    service = service_over(listed, pods)
    ids = [i for i, _ in service.device_ids()]
    assert not isinstance(service._allocate_one(ids[:1], {}), Refusal)
    assert service.rebuild() == 0  # nothing shows it admitted but this process's record
    assert service.served_init == {"uid-first": {"warmup"}}
    second = pod("second", [3])
    listed.append(kp("second"))
    pods.update(index(second))
    got = service._allocate_one(ids[:1], {})
    assert not isinstance(got, Refusal) and got.envs["VRAMSCHED_GPU_INDEX"] == "3", got


def test_a_pod_tied_with_one_a_restart_left_waiting_keeps_its_own_record():
    """After a restart, a pod whose GPUs are only in init containers looks waiting until the
    kubelet writes its status. A new pod whose first init container shares its GPU was served
    (same GPUs), but the record went to the stale pod: the new pod's sidecar then matched the
    stale pod's second init container, the only candidate, and got its GPUs 1 and 7."""
    inits = [("i0", 1, False), ("i1", 2, False)]
    stale = pod("stale", [1, 7], containers=[("main", 0)], inits=inits)
    new = pod(
        "new", [1, 0, 3], containers=[("main", 1)], inits=[("i0", 1, False), ("side", 2, True)]
    )
    service = service_over([kp("stale", main=()), kp("new", side=(), main=())], index(stale, new))
    service.rebuild()  # the stale pod's status is not written: nothing says it was admitted
    ids = [i for i, _ in service.device_ids()]
    first = service._allocate_one(ids[:1], {})
    assert not isinstance(first, Refusal) and first.envs["VRAMSCHED_GPU_INDEX"] == "1"
    assert service.served_init == {"uid-stale": {"i0"}, "uid-new": {"i0"}}
    # the sidecar: the stale pod's i1 looks as if it waits for 2 GPUs too, on other GPUs
    second = service._allocate_one(ids[:2], {})
    assert isinstance(second, Refusal) and second.ambiguous, second


@pytest.mark.parametrize(
    "containers",
    [[("main", 0)], [("main", 1)]],
    ids=["gpu-only-in-init-container", "gpu-in-init-and-app-container"],
)
def test_after_a_plugin_restart_a_served_init_container_is_not_served_again(node, containers):
    first = pod("first", [1], containers=containers, inits=[("warmup", 1, False)])
    got = node.admit(first)
    assert got.responses["warmup"].envs["VRAMSCHED_GPU_INDEX"] == "1"
    admitted_status(first)  # the kubelet started it
    node.restart_plugin()  # a new process: nothing remembered but what rebuild finds
    assert node.service.served_init == {"uid-first": frozenset({"warmup"})}
    # another pod on another GPU: without the rebuild, `first` would look like it waits for
    # one device too, and the plugin would refuse both as ambiguous
    got = node.admit(pod("second", [3]))
    assert got.responses["main"].envs["VRAMSCHED_GPU_INDEX"] == "3"
    assert node.service.metrics.allocations.labels("ambiguous")._value.get() == 0


def test_served_init_containers_are_forgotten_when_the_kubelet_drops_the_pod(node):
    first = pod("first", [1], containers=[("main", 0)], inits=[("warmup", 1, False)])
    node.admit(first)
    assert "uid-first" in node.service.served_init
    node.admit(pod("second", [2]))
    assert "uid-first" in node.service.served_init  # still listed: kept
    node.kubelet.remove("ns/first")
    node.admit(pod("third", [0]))
    assert node.service.served_init == {}
    # a new pod under the same name is a new pod
    again = pod("first", [2], containers=[("main", 0)], inits=[("warmup", 1, False)], uid="u2")
    got = node.admit(again)
    assert got.responses["warmup"].envs["VRAMSCHED_GPU_INDEX"] == "2"
    assert node.service.served_init == {"u2": frozenset({"warmup"})}


# ----- the API client's paging and watch, as the plugin's pod informer uses them ----------------------


class FakeApiServer:
    """Answers GET /api/v1/pods in two pages, and a watch with two events; records queries."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlparse

        self.queries: list[dict[str, list[str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                outer.queries.append(query)
                if url.path != "/api/v1/pods":
                    body: Any = {"kind": "Status", "reason": "NotFound", "message": "no"}
                    code = 404
                elif query.get("watch") == ["true"]:
                    lines = b"".join(
                        orjson.dumps({"type": t, "object": {"metadata": {"name": n}}}) + b"\n"
                        for t, n in (("ADDED", "c"), ("DELETED", "a"))
                    )
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(lines)))
                    self.end_headers()
                    self.wfile.write(lines)
                    return
                elif "continue" not in query:
                    body = {"metadata": {"continue": "page2", "resourceVersion": "5"}}
                    body["items"] = [{"metadata": {"name": "a"}}]
                    code = 200
                else:
                    body = {"metadata": {"resourceVersion": "7"}}
                    body["items"] = [{"metadata": {"name": "b"}}]
                    code = 200
                raw = orjson.dumps(body)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path) -> Path:
        port = self.server.server_address[1]
        path.write_text(
            orjson.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            ).decode()
        )
        return path

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_node_informer_lists_in_pages_and_watches_its_node_only(tmp_path):
    from extender.device_plugin.pods import NodeApi
    from extender.live.api_client import ApiError, ClientApi

    server = FakeApiServer()
    try:
        client = ClientApi(str(server.kubeconfig(tmp_path / "kc")))
        api = NodeApi(client, NODE)
        items, version = api.list("pods")
        assert [i["metadata"]["name"] for i in items] == ["a", "b"] and version == "7"
        first, second = server.queries
        assert first["fieldSelector"] == second["fieldSelector"] == [f"spec.nodeName={NODE}"]
        assert "continue" not in first and second["continue"] == ["page2"]
        assert first["limit"] == ["500"]
        events = list(api.watch("pods", version, 5))
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("ADDED", "c"),
            ("DELETED", "a"),
        ]
        watch = server.queries[-1]
        assert watch["watch"] == ["true"] and watch["resourceVersion"] == ["7"]
        assert watch["fieldSelector"] == [f"spec.nodeName={NODE}"]
        # the extender's own informers: the same calls, without a selector
        assert client.list("pods")[1] == "7" and "fieldSelector" not in server.queries[-1]
        with pytest.raises(ApiError) as err:
            list(client.watch_stream("/api/v1/nodes", "1", 5))
        assert err.value.status == 404
    finally:
        server.close()


def _count(histogram: Any) -> float:
    return next(s.value for s in histogram.collect()[0].samples if s.name.endswith("_count"))


def test_identification_time_is_measured_in_parts(node):
    node.admit(pod("timed", [2]))
    m = node.service.metrics
    # GetPreferredAllocation lists PodResources, Allocate reuses that list; each looks pods up
    assert m.pod_resources_seconds._sum.get() > 0
    assert _count(m.pod_resources_seconds) == 1 and m.list_reused._value.get() == 1
    assert _count(m.lookup_seconds) == 2
    assert _count(m.preferred_seconds) == _count(m.allocate_seconds) == 1


# ----- one PodResources List per admission -------------------------------------------------------------


def counting_lists(service: DevicePluginService) -> list[int]:
    """Wrap the service's PodResources List; the returned list grows by one per call."""
    calls: list[int] = []
    inner = service.kubelet_pods

    def listed() -> list[KubeletPod]:
        calls.append(1)
        return inner()

    service.kubelet_pods = listed
    return calls


def waiting(node: Node, p: dict[str, Any], *, gone: str | None = None) -> str:
    """`p` held by the kubelet without devices (as while it is admitted), `gone` dropped."""
    key = f"ns/{p['metadata']['name']}"
    node.pods[key] = p
    with node.kubelet._lock:
        node.kubelet.active[key] = [c["name"] for c in p["spec"]["containers"]]
        node.kubelet.allocated[key] = {}
        if gone:
            node.kubelet.active.pop(gone, None)
            node.kubelet.allocated.pop(gone, None)
        node.kubelet._listing = None  # SimKubelet's List answers afresh
    return key


class Plugin:
    """The kubelet's side of GetPreferredAllocation and Allocate, called one by one."""

    def __init__(self, node: Node) -> None:
        self.channel = grpc.insecure_channel(f"unix:{node.runner.socket}")
        self.stub = dp_grpc.DevicePluginStub(self.channel)
        self.ids = [d for d, _ in node.service.device_ids()]

    def prefer(self, size: int) -> list[str]:
        got = self.stub.GetPreferredAllocation(
            dp.PreferredAllocationRequest(
                container_requests=[
                    dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=self.ids, allocation_size=size
                    )
                ]
            ),
            timeout=10,
        )
        return list(got.container_responses[0].deviceIDs)

    def allocate(self, size: int, ids: list[str] | None = None) -> dict[str, str]:
        """Allocate `ids`, by default the first `size` devices."""
        got = self.stub.Allocate(
            dp.AllocateRequest(
                container_requests=[dp.ContainerAllocateRequest(devices_ids=ids or self.ids[:size])]
            ),
            timeout=10,
        )
        return dict(got.container_responses[0].envs)


@pytest.fixture
def plugin(node):
    p = Plugin(node)
    yield p
    p.channel.close()


def test_an_admission_lists_the_kubelets_pods_once(node):
    """SimKubelet calls GetPreferredAllocation then Allocate per container, as the kubelet does:
    Allocate uses the list GetPreferredAllocation read."""
    calls = counting_lists(node.service)
    uuids = [g.uuid for g in node.source.gpus()]
    for n, (name, gpus) in enumerate((("one", [2]), ("two", [0, 3]), ("three", [2])), 1):
        got = node.admit(pod(name, gpus))
        assert got.responses["main"].envs["VRAMSCHED_GPU_INDEX"] == ",".join(map(str, gpus))
        assert sorted(gpu_of(d) for d in got.devices["main"]) == sorted(uuids[g] for g in gpus)
        assert len(calls) == n  # one List per admission, not two
    assert node.service.metrics.list_reused._value.get() == 3
    assert _count(node.service.metrics.pod_resources_seconds) == 3


def test_an_allocate_without_get_preferred_allocation_lists_the_pods(node, plugin):
    """The kubelet skips GetPreferredAllocation when it has no choice to make (as many devices
    free as needed): Allocate lists the pods itself. The list the admission before read served
    its own Allocate only."""
    node.admit(pod("before", [1]))  # GetPreferredAllocation, then Allocate took its list
    calls = counting_lists(node.service)
    waiting(node, pod("direct", [3]))
    assert plugin.allocate(1)["VRAMSCHED_GPU_INDEX"] == "3"
    assert len(calls) == 1 and node.service.metrics.list_reused._value.get() == 1


def test_a_list_older_than_the_limit_is_not_reused(node, plugin):
    """A GetPreferredAllocation whose Allocate never came: its list is not trusted for a later
    Allocate, which would see `a` waiting and not `b`."""
    from dataclasses import replace

    from extender.device_plugin import server

    calls = counting_lists(node.service)
    a = waiting(node, pod("a", [1]))
    plugin.prefer(1)
    assert len(calls) == 1
    listing = node.service._listing
    assert listing is not None and [kp.key for kp in listing.pods] == [a]
    node.service._listing = replace(listing, at=listing.at - server.LIST_REUSE_SECONDS - 0.1)
    waiting(node, pod("b", [3]), gone=a)
    assert plugin.allocate(1)["VRAMSCHED_GPU_INDEX"] == "3"
    assert len(calls) == 2 and node.service.metrics.list_reused._value.get() == 0
    assert node.service._listing is None


def test_a_list_is_not_reused_for_another_request_size(node, plugin):
    calls = counting_lists(node.service)
    a = waiting(node, pod("a", [1]))
    plugin.prefer(1)
    waiting(node, pod("b", [0, 3]), gone=a)
    # with `a`'s list no pod would wait for 2 devices: refused
    assert plugin.allocate(2)["VRAMSCHED_GPU_INDEX"] == "0,3"
    assert len(calls) == 2 and node.service.metrics.list_reused._value.get() == 0


def test_a_list_serves_one_allocate_and_the_latest_get_preferred_allocation_decides(node, plugin):
    calls = counting_lists(node.service)
    waiting(node, pod("a", [1]))
    plugin.prefer(1)
    plugin.prefer(2)  # replaces the list of the first: its size is 2
    assert plugin.allocate(1)["VRAMSCHED_GPU_INDEX"] == "1"
    assert len(calls) == 3 and node.service.metrics.list_reused._value.get() == 0
    plugin.prefer(2)
    preferred = plugin.prefer(1)
    assert plugin.allocate(1, preferred)["VRAMSCHED_GPU_INDEX"] == "1"
    assert len(calls) == 5 and node.service.metrics.list_reused._value.get() == 1
    # the list was taken: List again
    assert plugin.allocate(1, preferred)["VRAMSCHED_GPU_INDEX"] == "1"
    assert len(calls) == 6 and node.service.metrics.list_reused._value.get() == 1


def test_a_list_is_not_reused_for_devices_it_did_not_prefer(node, plugin):
    """A GetPreferredAllocation whose Allocate never came, and within the time limit an Allocate
    of as many devices, but not the ones preferred: the kubelet allocates what it was told to
    prefer, so this one is for another container (here one with no choice to make, for which
    the kubelet asks no preference). With `a`'s list it got `a`'s GPU 1."""
    calls = counting_lists(node.service)
    a = waiting(node, pod("a", [1]))
    preferred = plugin.prefer(1)
    waiting(node, pod("b", [3]), gone=a)
    other = [d for d in plugin.ids if d not in preferred][:1]
    assert plugin.allocate(1, other)["VRAMSCHED_GPU_INDEX"] == "3"
    assert len(calls) == 2 and node.service.metrics.list_reused._value.get() == 0


def test_pods_the_watch_has_not_delivered_are_read_from_the_api_and_counted():
    from extender.device_plugin.pods import NodePods

    class Api:
        node = NODE

        def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
            return pod(name, [1])

    pods = NodePods(Api())  # type: ignore[arg-type]
    reads: list[int] = []
    pods.on_api_read = lambda: reads.append(1)
    assert set(pods.snapshot(["ns/late"])) == {"ns/late"}
    assert set(pods.snapshot(["ns/late"])) == {"ns/late"}  # now in the cache
    assert reads == [1]


def test_a_pod_created_again_under_its_name_is_read_afresh_not_from_a_lagging_watch():
    """A StatefulSet pod deleted and created again on the same node while the plugin's pod watch
    lags: the cache still holds the old object, admitted (Running), assigned GPU 1, while the
    kubelet holds a new pod under that name, without devices, assigned GPU 3. From the cache
    the new pod got GPU 1, which the ledger books for nobody now."""
    old = pod("web-0", [1], uid="old")
    old["status"] = {"phase": "Running", "containerStatuses": [{"name": "main"}]}
    new = pod("web-0", [3], uid="new")
    reads: list[list[str]] = []

    def reread(keys: list[str]) -> dict[str, dict[str, Any]]:
        reads.append(keys)
        return {"ns/web-0": new}

    listed = [kp("web-0")]
    service = service_over(listed, index(old))
    got = service._allocate_one([i for i, _ in service.device_ids()][:1], {})
    assert not isinstance(got, Refusal) and got.envs["VRAMSCHED_GPU_INDEX"] == "1"  # the hazard
    service.reread = reread
    got = service._allocate_one([i for i, _ in service.device_ids()][:1], {})
    assert not isinstance(got, Refusal) and got.envs["VRAMSCHED_GPU_INDEX"] == "3"
    assert reads == [["ns/web-0"]]
    # the old object being deleted, the API without a pod of that name yet: refused, not GPU 1
    old["metadata"]["deletionTimestamp"] = "now"
    old["status"] = {"phase": "Pending"}
    service.reread = lambda keys: {}
    got = service._allocate_one([i for i, _ in service.device_ids()][:1], {})
    assert isinstance(got, Refusal) and "no pod on gpu-a is waiting" in got.reason


def test_pods_the_kubelet_agrees_with_are_not_read_again():
    """Admitted pods holding their devices, an admitted pod whose GPU is in its init container
    only (PodResources lists no device for it), and a pod that ended (older kubelets list them
    without devices) cost no API read."""
    running = pod("running", [0])
    running["status"] = {"phase": "Running"}
    init_only = admitted_status(
        pod("init-only", [1], containers=[("main", 0)], inits=[("warmup", 1, False)])
    )
    done = ended_pod("done", [2], "Succeeded")
    waiting_pod = pod("waiting", [3])
    listed = [kp("running", main=("x",)), kp("init-only", main=()), kp("done"), kp("waiting")]
    service = service_over(listed, index(running, init_only, done, waiting_pod))
    reads: list[list[str]] = []
    service.reread = lambda keys: reads.append(keys) or {}
    got = service._allocate_one([i for i, _ in service.device_ids()][:1], {})
    assert not isinstance(got, Refusal) and got.envs["VRAMSCHED_GPU_INDEX"] == "3"
    assert reads == []


def test_node_pods_read_asks_the_api_whatever_the_cache_holds():
    from extender.device_plugin.pods import NodePods
    from extender.live.api_client import ApiError

    now = {"ns/a": pod("a", [3], uid="new"), "ns/far": pod("far", [0], node="gpu-b")}

    class Api:
        node = NODE

        def read_pod(self, namespace: str, name: str) -> dict[str, Any]:
            if f"{namespace}/{name}" not in now:
                raise ApiError(404, "NotFound", "gone")
            return now[f"{namespace}/{name}"]

    pods = NodePods(Api())  # type: ignore[arg-type]
    pods._deliver("replace", [pod("a", [1], uid="old"), pod("b", [2])])
    reads: list[int] = []
    pods.on_api_read = lambda: reads.append(1)
    got = pods.read(["ns/a", "ns/b", "ns/far"])
    assert list(got) == ["ns/a"] and got["ns/a"]["metadata"]["uid"] == "new"
    assert len(reads) == 3
    # the cache is the watch's: still the old object
    assert pods.snapshot(["ns/a"])["ns/a"]["metadata"]["uid"] == "old"


@pytest.mark.parametrize(
    ("label", "replicas"), [(None, 1), ("", 1), ("0", 1), ("4", 4), ("1024", 1024)]
)
def test_replicas_come_from_the_label_as_the_scheduler_reads_it(
    label: str | None, replicas: int
) -> None:
    labels = {} if label is None else {"nvidia.com/gpu.replicas": label}
    assert replicas_to_serve(0, {"metadata": {"labels": labels}}) == replicas
    assert replicas_to_serve(3, {"metadata": {"labels": labels}}) == 3  # --replicas wins


@pytest.mark.parametrize(
    ("label", "why"),
    [
        ("1_6", "is not an integer"),  # int() took it as 16
        ("\u0664", "is not an integer"),  # and other scripts' digits
        ("four", "is not an integer"),
        ("1000000", r"is out of range \(0 to 1024\)"),  # advertised as a million devices per GPU
        ("-2", "is out of range"),
    ],
)
def test_a_replicas_label_the_scheduler_would_refuse_stops_the_plugin(label: str, why: str) -> None:
    with pytest.raises(
        ValueError, match=f"^node label nvidia.com/gpu.replicas=.* {why}.*pass --rep"
    ):
        replicas_to_serve(0, {"metadata": {"labels": {"nvidia.com/gpu.replicas": label}}})
