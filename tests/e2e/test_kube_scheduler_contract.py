"""What a real kube-scheduler does with an extender's answers, on every version the suite runs.

Each test scripts one answer with a FakeExtender (or records vramsched's through it) and observes
the scheduler: which map of the filter result it reads, the FailedScheduling event's text, the
preempt verb's body with nodeCacheCapable, how long a pod waits after a filter or bind error,
how many node names percentageOfNodesToScore lets through, and what httpTimeout does. The code
behind each behaviour is named in docs/live.md ("What kube-scheduler does with the answers").
Where the versions differ the expected value is per version (``by_version``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kubernetes.client
import pytest
from controlplane import ControlPlane
from fake_extender import FakeExtender, scripted
from test_control_plane import pod_body
from test_extender_e2e import (  # noqa: F401 - fixtures are used by name
    NS,
    Extender,
    _grant_extender_rbac,
    add_node,
    assert_sound,
    core,
    extender_args,
    gpu_pod,
    proxied_vramsched,
    stack,
    start_shipped_scheduler,
    wait_bound,
)

from extender.inventory import ReplicaPolicy

GPU = "nvidia.com/gpu"


def by_version(cp: ControlPlane, **values: Any) -> Any:
    """``by_version(cp, k8s_1_20=a, k8s_1_36=b)``: the value for this control plane's minor."""
    key = "k8s_" + "_".join(cp.version.split(".")[:2])
    return values[key]


def failed_scheduling(api: kubernetes.client.CoreV1Api, pod: str) -> list[str]:
    """This pod's FailedScheduling messages (by UID: events outlive a deleted pod of that name)."""
    uid = api.read_namespaced_pod(pod, NS).metadata.uid
    selector = f"involvedObject.name={pod},involvedObject.uid={uid}"
    events = api.list_namespaced_event(NS, field_selector=selector).items
    return [e.message or "" for e in events if e.reason == "FailedScheduling"]


def gaps(calls: list[Any]) -> list[float]:
    """Seconds between consecutive calls."""
    return [round(b.at - a.at, 2) for a, b in zip(calls, calls[1:])]


@pytest.fixture
def fake(cluster: ControlPlane) -> Iterator[FakeExtender]:
    ext = FakeExtender(cluster)
    yield ext
    ext.close()


def names_only(**kwargs: Any) -> str:
    """A one-extender config sending node names, as the shipped one does."""
    return ControlPlane.scheduler_config("vramsched", node_cache_capable=True, **kwargs)


# ----- the filter result's two maps, and the event text -------------------------------------------


@pytest.mark.e2e
def test_failed_and_unresolvable_nodes_reach_the_event_only_from_1_21(
    cluster: ControlPlane, fake: FakeExtender
) -> None:
    """One node refused in FailedNodes, one in FailedAndUnresolvableNodes, none passes. 1.20
    knows only the first map: the second node's reason is lost (why vramsched copies unresolvable
    nodes into FailedNodes there). 1.36 reads both, and its preemption skips the unresolvable one."""
    for name in ("n-full", "n-small"):
        cluster.create_gpu_node(name, {}, {GPU: 1})
    fake.handlers["filter"] = lambda body: (
        200,
        {
            "NodeNames": [],
            "FailedNodes": {"n-full": "no GPU with 30Gi free"},
            "FailedAndUnresolvableNodes": {"n-small": "need 200Gi per GPU, GPUs have 80Gi"},
            "Error": "",
        },
    )
    cluster.start_scheduler(names_only(extender_url=fake.url, prioritize_verb=None))
    api = core(cluster)
    api.create_namespaced_pod(NS, pod_body("refused", "vramsched", gpus=1))
    events = cluster.wait_for(lambda: failed_scheduling(api, "refused"), timeout=60)
    assert events[0] == by_version(
        cluster,
        k8s_1_20="0/2 nodes are available: 1 no GPU with 30Gi free.",
        # PostFilter plugins add their messages: DynamicResources', then DefaultPreemption's.
        k8s_1_36="0/2 nodes are available: 1 need 200Gi per GPU, GPUs have 80Gi, "
        "1 no GPU with 30Gi free. no new claims to deallocate, preemption: 0/2 nodes are available: "
        "1 No preemption victims found for incoming pod, "
        "1 Preemption is not helpful for scheduling.",
    )
    (call,) = fake.calls_for("refused", "filter")[:1]
    assert call.body["Nodes"] is None and sorted(call.body["NodeNames"]) == ["n-full", "n-small"]


@pytest.mark.e2e
def test_vramsched_copies_unresolvable_nodes_into_failed_nodes_only_below_1_21(
    stack: tuple[ControlPlane, Extender],
) -> None:
    """vramsched reads /version at start: on 1.20 an unresolvable node is also in FailedNodes,
    on 1.36 only in FailedAndUnresolvableNodes; either way the pod's event names the reason."""
    cp, ext = stack
    add_node(cp, "a100", "NVIDIA-A100-SXM4-80GB", count=1, memory_mib=81920)
    legacy = by_version(cp, k8s_1_20=True, k8s_1_36=False)
    minor = cp.version.split(".")[1]
    assert any(
        line.get("msg") == f"control plane 1.{minor}: unresolvable nodes "
        f"{'also' if legacy else 'not'} in FailedNodes"
        for line in ext.log_lines()
    ), ext.describe()
    api = core(cp)
    api.create_namespaced_pod(NS, gpu_pod("huge", "200Gi"))
    events = cp.wait_for(lambda: failed_scheduling(api, "huge"), timeout=60)
    assert any("1 need 200Gi per GPU, GPUs have 80Gi" in m for m in events), events
    pod = api.api_client.sanitize_for_serialization(api.read_namespaced_pod("huge", NS))
    answer = ext.post("/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["a100"]})
    assert answer["FailedAndUnresolvableNodes"] == {"a100": "need 200Gi per GPU, GPUs have 80Gi"}
    assert answer["FailedNodes"] == (answer["FailedAndUnresolvableNodes"] if legacy else {})


# ----- preemption through the extender's preempt verb ---------------------------------------------


@pytest.mark.e2e
def test_preemption_asks_vramsched_for_the_victims_by_uid(
    proxied_vramsched: tuple[ControlPlane, Extender, FakeExtender],
) -> None:
    """A higher-priority GPU pod finds the only GPU taken: kube-scheduler's dry run (in-tree
    filters only) proposes the lower-priority pod; 1.36 sends it to vramsched's preempt verb as a
    UID (nodeCacheCapable: true) and evicts what vramsched confirms, 1.20.2 evicts without asking.
    The preemptor is bound once the victim is gone."""
    cp, ext, proxy = proxied_vramsched
    add_node(cp, "one-gpu", "NVIDIA-A100-SXM4-80GB", count=1, memory_mib=81920)
    api = core(cp)
    try:
        kubernetes.client.SchedulingV1Api(api.api_client).create_priority_class(
            {"metadata": {"name": "e2e-high"}, "value": 1000}
        )
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
    api.create_namespaced_pod(NS, gpu_pod("victim", "40Gi"))
    wait_bound(cp, api, ["victim"])
    victim_uid = api.read_namespaced_pod("victim", NS).metadata.uid
    preemptor = gpu_pod("preemptor", "40Gi")
    preemptor["spec"]["priorityClassName"] = "e2e-high"
    api.create_namespaced_pod(NS, preemptor)

    def evicted() -> Any:
        pod = api.read_namespaced_pod("victim", NS)
        return pod if pod.metadata.deletion_timestamp else None

    victim = cp.wait_for(evicted, timeout=60, message="kube-scheduler evicts the victim")
    calls = proxy.calls_for("preemptor", "preempt")
    if cp.release.minor < (1, 21):
        # 1.20.2 never passes its extenders to the framework's preemption (kubernetes issue
        # 102971, fixed by PR 103019 and its 1.20 backport): the in-tree dry run alone evicts.
        assert calls == []
    else:
        (call,) = calls
        wanted = {"one-gpu": {"Pods": [{"UID": victim_uid}], "NumPDBViolations": 0}}
        assert call.body["NodeNameToVictims"] is None  # nodeCacheCapable: UIDs only
        assert call.body["NodeNameToMetaVictims"] == wanted
        assert (call.status, call.answer) == (200, {"NodeNameToMetaVictims": wanted})
    conditions = {c.type: c for c in victim.status.conditions or []}
    if cp.release.minor >= (1, 26):  # the DisruptionTarget condition exists from 1.26
        assert conditions["DisruptionTarget"].reason == "PreemptionByScheduler"
    api.delete_namespaced_pod("victim", NS, grace_period_seconds=0)  # what kubelet would confirm
    assert wait_bound(cp, api, ["preemptor"], timeout=90) == {"preemptor": "one-gpu"}
    # by UID: events outlive a deleted pod of that name (another test's victim)
    selector = f"involvedObject.name=victim,involvedObject.uid={victim_uid}"
    events = api.list_namespaced_event(NS, field_selector=selector).items
    (preempted,) = [e.message for e in events if e.reason == "Preempted"]
    preemptor_uid = api.read_namespaced_pod("preemptor", NS).metadata.uid
    assert preempted == by_version(
        cp,
        k8s_1_20="Preempted by default/preemptor on node one-gpu",
        k8s_1_36=f"Preempted by pod {preemptor_uid} on node one-gpu",
    )
    assert_sound(api, ReplicaPolicy.DISTRIBUTED)


# ----- errors and how long the pod waits before kube-scheduler retries it --------------------------


def _pass(fake: FakeExtender, verb: str) -> Any:
    return lambda body: (200, fake.default(verb, body))


def assert_retry_waits(cp: ControlPlane, waits: list[float]) -> None:
    """1.36: a failed attempt goes to the backoff queue for 1, 2, 4... s (podInitialBackoffSeconds
    doubling up to podMaxBackoffSeconds, 10) plus up to 1 s (the queue's 1 s windows). 1.20: one
    retry at once, then the unschedulable queue, flushed after 60 s, checked every 30 s."""
    if cp.release.minor < (1, 21):
        assert len(waits) == 2 and waits[0] < 1.0 and 59.0 <= waits[1] <= 95.0, waits
    else:
        backoff = [min(2.0**i, 10.0) for i in range(len(waits))]
        assert all(b <= w <= b + 3.0 for b, w in zip(backoff, waits)), (backoff, waits)


@pytest.mark.e2e
def test_filter_errors_are_retried_after_a_backoff(
    cluster: ControlPlane, fake: FakeExtender
) -> None:
    """Filter answers HTTP 500 (three times on 1.36, twice on 1.20 whose second wait is a
    minute and more), then passes. The FailedScheduling event quotes the scheduler's error."""
    errors = by_version(cluster, k8s_1_20=2, k8s_1_36=3)
    cluster.create_gpu_node("n", {}, {GPU: 1})
    fake.handlers["filter"], _ = scripted(*[(500, {})] * errors, then=_pass(fake, "filter"))
    cluster.start_scheduler(
        names_only(extender_url=fake.url, prioritize_verb=None, bind_verb="bind")
    )
    api = core(cluster)
    api.create_namespaced_pod(NS, pod_body("flaky", "vramsched", gpus=1))
    wait_bound(cluster, api, ["flaky"], timeout=240)
    filters = fake.calls_for("flaky", "filter")
    assert [c.status for c in filters] == [500] * errors + [200]
    events = failed_scheduling(api, "flaky")
    assert events[0] == f"failed filter with extender at URL {fake.url}/filter, code 500"
    assert_retry_waits(cluster, gaps(filters))


@pytest.mark.e2e
def test_bind_errors_are_retried_after_a_backoff(cluster: ControlPlane, fake: FakeExtender) -> None:
    """Bind answers an Error (three times on 1.36, twice on 1.20), then binds: the event text
    (1.20 prefixes "binding rejected: "), and the same waits as after a filter error."""
    errors = by_version(cluster, k8s_1_20=2, k8s_1_36=3)
    cluster.create_gpu_node("n", {}, {GPU: 1})
    fake.handlers["bind"], _ = scripted(
        *[(200, {"Error": "bind refused by the test"})] * errors, then=_pass(fake, "bind")
    )
    cluster.start_scheduler(
        names_only(extender_url=fake.url, prioritize_verb=None, bind_verb="bind")
    )
    api = core(cluster)
    api.create_namespaced_pod(NS, pod_body("rebind", "vramsched", gpus=1))
    wait_bound(cluster, api, ["rebind"], timeout=240)
    binds = fake.calls_for("rebind", "bind")
    assert len(binds) == errors + 1
    assert all(c.body["Node"] == "n" and c.body["PodName"] == "rebind" for c in binds)
    events = failed_scheduling(api, "rebind")
    assert events[0] == by_version(
        cluster,
        k8s_1_20="binding rejected: bind refused by the test",
        k8s_1_36="bind refused by the test",
    )
    assert_retry_waits(cluster, gaps(binds))


# ----- httpTimeout ----------------------------------------------------------------------------------


@pytest.mark.e2e
def test_http_timeout_fails_a_slow_filter_and_ignores_a_slow_prioritize(
    cluster: ControlPlane, fake: FakeExtender
) -> None:
    """httpTimeout 1s: a filter answering after 2.5 s fails the attempt (event says so); a
    prioritize answering after 2.5 s is given up after 1 s and the pod is bound all the same."""
    for name in ("a", "b"):
        cluster.create_gpu_node(name, {}, {GPU: 1})

    def slow(then: Any) -> Any:
        return lambda body: (time.sleep(2.5), then(body))[1]

    slow_filters = [1]  # only the first filter is slow

    def filter_(body: dict[str, Any]) -> tuple[int, Any]:
        if slow_filters[0]:
            slow_filters[0] -= 1
            time.sleep(2.5)
        return 200, fake.default("filter", body)

    fake.handlers["filter"] = filter_
    fake.handlers["prioritize"] = slow(_pass(fake, "prioritize"))
    cluster.start_scheduler(names_only(extender_url=fake.url, bind_verb="bind", http_timeout="1s"))
    api = core(cluster)
    api.create_namespaced_pod(NS, pod_body("slow", "vramsched", gpus=1))
    wait_bound(cluster, api, ["slow"], timeout=120)
    events = failed_scheduling(api, "slow")
    calls = fake.calls_for("slow")
    assert events[0] == (
        f'Post "{fake.url}/filter": context deadline exceeded '
        "(Client.Timeout exceeded while awaiting headers)"
    )
    assert [c.verb for c in calls] == ["filter", "filter", "prioritize", "bind"]
    (prioritize,) = [c for c in calls if c.verb == "prioritize"]
    (bind,) = [c for c in calls if c.verb == "bind"]
    # waited its timeout (1 s, counted from before the request reached us), not the answer
    assert 0.9 <= bind.at - prioritize.at < 2.5


# ----- percentageOfNodesToScore ---------------------------------------------------------------------


def _many_nodes(cp: ControlPlane, count: int) -> None:
    """``count`` Ready GPU nodes in one POST each (their not-ready taint stays: pods tolerate it)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    alloc = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU: "8"}

    def create(i: int) -> None:
        with cp.api_client() as client:
            kubernetes.client.CoreV1Api(client).create_node(
                {
                    "metadata": {"name": f"many-{i:03d}"},
                    "status": {
                        "capacity": alloc,
                        "allocatable": alloc,
                        "conditions": [
                            {
                                "type": "Ready",
                                "status": "True",
                                "reason": "KubeletReady",
                                "lastHeartbeatTime": now,
                                "lastTransitionTime": now,
                            }
                        ],
                    },
                }
            )

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(create, range(count)))


@pytest.mark.e2e
@pytest.mark.parametrize("percentage, sent", [(None, 100), (100, 150)])
def test_percentage_of_nodes_to_score_decides_how_many_names_filter_gets(
    cluster: ControlPlane, fake: FakeExtender, percentage: int | None, sent: int
) -> None:
    """150 feasible nodes: unset (adaptive: 50% - 150/125 = 49%, at least 100) the extender sees
    100 of them; the shipped 100 sends all 150."""
    _many_nodes(cluster, 150)
    cluster.start_scheduler(
        names_only(
            extender_url=fake.url,
            prioritize_verb=None,
            bind_verb="bind",
            percentage_of_nodes_to_score=percentage,
        )
    )
    api = core(cluster)
    pod = pod_body("counted", "vramsched", gpus=1)
    pod["spec"]["tolerations"] = [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]
    api.create_namespaced_pod(NS, pod)
    wait_bound(cluster, api, ["counted"], timeout=60)
    (call,) = fake.calls_for("counted", "filter")
    assert len(call.body["NodeNames"]) == sent
    if cluster.release.minor >= (1, 35):  # opportunistic batching: off for a profile with extenders
        log = cluster.scheduler.log_path.read_text()
        assert "Disabling signatures for profile because it has extenders configured" in log
