"""vramsched's device plugin without a kubelet: the pure matcher and device specs, the generated
stubs, the NVML source against a fake NVML module, and the gRPC service against SimKubelet (the
kubelet's device-manager protocol in-process). tests/e2e/test_device_plugin_e2e.py runs it under
a real kubelet."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from extender.device_plugin.api import deviceplugin_v1beta1_pb2 as dp
from extender.device_plugin.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from extender.device_plugin.api.generate import API_DIR, PROTOS, clean, generate
from extender.device_plugin.gpus import FakeGpus, GpuSourceError, NvmlGpus, fake_uuid
from extender.device_plugin.matcher import (
    KubeletPod,
    Match,
    Refusal,
    container_slots,
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


def test_preferred_devices_are_replicas_of_the_assigned_gpus():
    ids = [replica_id(u, r, 4) for u in ("GPU-a", "GPU-b", "GPU-c") for r in range(4)]
    available = [i for i in ids if i not in ("GPU-c::0", "GPU-c::1")]
    assert preferred_devices(available, [], 2, ["GPU-c", "GPU-a"]) == ["GPU-c::2", "GPU-a::0"]
    # unknown pod: lowest IDs, must_include first
    assert preferred_devices(available, ["GPU-b::3"], 2, None) == ["GPU-b::3", "GPU-a::0"]
    # the assigned GPU has no free replica: still `size` IDs
    assert preferred_devices(["GPU-a::0", "GPU-b::0"], [], 1, ["GPU-c"]) == ["GPU-a::0"]


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
        from extender.device_plugin.kubelet import PodResources

        self.service = DevicePluginService(
            node=NODE,
            gpus=self.source.gpus(),
            replicas=replicas,
            strategies=parse_strategies(strategy),
            kubelet_pods=PodResources(root / "pr" / "kubelet.sock", GPU).list,
            lookup=lambda keys: {k: self.pods[k] for k in keys if k in self.pods},
        )
        self.runner = PluginRunner(
            self.service,
            plugin_dir=root / "dp",
            socket_name="vramsched.sock",
            source=self.source,
            publish=self.published.append,
            poll=0.05,
        )
        self.thread = threading.Thread(target=self.runner.run, daemon=True)
        self.thread.start()
        self.kubelet.wait_devices(gpus * replicas)

    def admit(self, p: dict[str, Any]) -> Any:
        self.pods[f"ns/{p['metadata']['name']}"] = p
        return self.kubelet.admit(p)

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
