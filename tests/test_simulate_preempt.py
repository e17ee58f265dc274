"""Preemption in the simulator: the trace's `qos` column as priorities (`--priorities qos`) and
`planner+preempt`, the planner with what `serve --preempt` plans when a GPU pod fits nowhere."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from test_simulate import task, write

from extender.cli import main
from extender.quantity import MIB
from extender.simulate import preempt_replay
from extender.simulate.engine import PREEMPT_POLICY, run_policy
from extender.simulate.trace import (
    QOS_PRIORITIES,
    TraceError,
    inflate,
    read_inputs,
    read_trace_pods,
    with_qos_priorities,
)


def one_gpu(name: str, milli: int, t: int, qos: str, **kw: Any) -> str:
    """A trace row of a one-GPU pod of class `qos` (test_simulate's `task`)."""
    return task(name, 1, milli, t, qos=qos, **kw)


def test_the_qos_column_gives_priorities_only_when_asked(tmp_path) -> None:
    _, p = write(
        tmp_path,
        [],
        [
            one_gpu("ls", 100, 0, "LS"),
            one_gpu("be", 100, 1, "BE"),
            one_gpu("bu", 100, 2, "Burstable"),
            one_gpu("gu", 100, 3, "Guaranteed"),
            one_gpu("none", 100, 4, ""),
        ],
    )
    tasks = read_trace_pods(p)
    assert [t.demand.priority for t in tasks] == [0] * 5  # as every replay before reads them
    assert [t.qos for t in tasks] == ["LS", "BE", "Burstable", "Guaranteed", ""]
    assert [t.demand.priority for t in with_qos_priorities(tasks)] == [1000, 0, 500, 1000, 0]
    # inflated copies keep their class
    copies = inflate(with_qos_priorities(tasks), 0.25, 2.0)
    assert {t.qos for t in copies} == {"LS", "BE", "Burstable", "Guaranteed", ""}
    assert all(t.demand.priority == QOS_PRIORITIES[t.qos] for t in copies)


def test_an_unknown_qos_names_its_row(tmp_path) -> None:
    _, p = write(tmp_path, [], [one_gpu("a", 100, 0, "LS"), one_gpu("b", 100, 1, "Gold")])
    with pytest.raises(
        TraceError, match=r"line 3: qos 'Gold' is not one of LS, Guaranteed, Burstable, BE"
    ):
        read_trace_pods(p)


def test_a_list_without_the_qos_column_reads_as_no_class(tmp_path) -> None:
    p = tmp_path / "pods.csv"
    p.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,1024,1,500\n")
    (t,) = with_qos_priorities(read_trace_pods(p))
    assert (t.qos, t.demand.priority) == ("", 0)


#: node-a and node-b (T4) take the BE pods; node-c (P100) is full until its LS pod leaves at 25;
#: `ls` (T4 only, 700 milli) then fits no GPU (400 free on each T4)
NODES = ["node-a,32000,65536,1,T4", "node-b,32000,65536,1,T4", "node-c,32000,65536,1,P100"]
PODS = [
    one_gpu("full", 1000, 0, "LS", spec="P100", dele="25"),
    one_gpu("be1", 600, 10, "BE"),
    one_gpu("be2", 600, 20, "BE"),
    one_gpu("ls", 700, 30, "LS", spec="T4"),
]


def test_a_pod_of_higher_priority_evicts_one_pod_and_the_victim_is_placed_again(
    tmp_path,
) -> None:
    nodes, tasks, bound = read_inputs(*write(tmp_path, NODES, PODS))
    tasks = with_qos_priorities(tasks)
    planner = run_policy("planner", nodes, tasks, bound, churn=True)
    assert (planner.placed, planner.failed) == (3, 1)
    assert planner.extra["failedGpuPodsByPriority"] == {"1000": 1, "0": 0}
    r = run_policy(PREEMPT_POLICY, nodes, tasks, bound, churn=True)
    assert (r.placed, r.failed) == (4, 0)
    assert (r.extra["preemptions"], r.extra["preempted"], r.extra["preemptedPlacedAgain"]) == (
        1,
        1,
        1,
    )
    # the victim went to the P100 its LS pod left; `ls` took the T4
    assert r.extra["allocatedByPriority"] == {"1000": 700 * MIB, "0": 1200 * MIB}
    assert r.invariantViolations == 0 and r.overcommittedGpusPeak == 0


def test_a_victim_with_nowhere_to_go_counts_as_failed(tmp_path) -> None:
    """Without churn node-c stays full: the BE pod evicted for `ls` finds no GPU again."""
    nodes, tasks, bound = read_inputs(*write(tmp_path, NODES, PODS))
    r = run_policy(PREEMPT_POLICY, nodes, with_qos_priorities(tasks), bound)
    assert (r.placed, r.failed, r.failedGpuPods) == (3, 1, 1)
    assert (r.extra["preempted"], r.extra["preemptedPlacedAgain"]) == (1, 0)
    assert r.extra["failedGpuPodsByPriority"] == {"1000": 0, "0": 1}
    assert r.extra["allocatedByPriority"] == {"1000": 1700 * MIB, "0": 600 * MIB}


def test_nobody_is_preempted_for_a_pod_of_the_same_priority(tmp_path) -> None:
    pods = [*PODS[:3], one_gpu("ls", 700, 30, "BE", spec="T4")]
    nodes, tasks, bound = read_inputs(*write(tmp_path, NODES, pods))
    r = run_policy(PREEMPT_POLICY, nodes, with_qos_priorities(tasks), bound)
    assert "preempted" not in r.extra and r.failed == 1


def test_only_a_node_with_the_cores_for_the_pod_is_preempted_on(tmp_path) -> None:
    """`ls` asks 15 cores: node-a (10 cores) cannot take it whoever leaves, node-b (16) can once
    its BE pod is gone, wherever the planner put which BE pod."""
    nodes = ["node-a,10000,65536,1,T4", "node-b,16000,65536,1,T4"]
    pods = [
        one_gpu("be1", 600, 10, "BE", cpu=2000),
        one_gpu("be2", 600, 20, "BE", cpu=2000),
        one_gpu("ls", 700, 30, "LS", cpu=15000),
    ]
    nodes_, tasks, bound = read_inputs(*write(tmp_path, nodes, pods))
    seen = []
    real = preempt_replay.plan_preemption

    def recording(ledger, demand, **kw):
        plan = real(ledger, demand, **kw)
        seen.append(plan and plan.node)
        return plan

    pytest.MonkeyPatch().setattr(preempt_replay, "plan_preemption", recording)
    r = run_policy(PREEMPT_POLICY, nodes_, with_qos_priorities(tasks), bound)
    assert seen[0] == "node-b" and r.extra["preempted"] == 1
    assert r.extra["allocatedByPriority"] == {"1000": 700 * MIB, "0": 600 * MIB}


def random_trace(rng: random.Random) -> tuple[list[str], list[str]]:
    nodes = [f"n{i},{rng.choice([8000, 32000])},65536,{rng.choice([1, 2])},T4" for i in range(3)]
    pods = []
    for i in range(rng.randint(8, 16)):
        qos = rng.choice(["LS", "BE", "Burstable", "BE"])
        gpus = rng.choice([0, 1, 1, 1, 2])
        milli = rng.choice([200, 300, 500, 700, 1000]) if gpus == 1 else 0
        cpu = rng.choice([1000, 2000, 4000])
        dele = str(i + rng.randint(1, 6)) if rng.random() < 0.3 else ""
        pods.append(task(f"p{i}", gpus, milli, i, cpu=cpu, dele=dele, qos=qos))
    return nodes, pods


@pytest.mark.parametrize("churn", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_every_preemption_evicts_only_lower_priorities_and_books_stay_exact(
    tmp_path, monkeypatch, seed: int, churn: bool
) -> None:
    rng = random.Random(seed)
    nodes, tasks, bound = read_inputs(*write(tmp_path, *random_trace(rng)))
    tasks = with_qos_priorities(tasks)
    plans = []
    real = preempt_replay.plan_preemption

    def recording(ledger, demand, **kw):
        plan = real(ledger, demand, **kw)
        if plan is not None:
            on_node = {res.key for res in ledger.pods_on(plan.node)}
            plans.append((demand, plan, on_node))
        return plan

    monkeypatch.setattr(preempt_replay, "plan_preemption", recording)
    r = run_policy(PREEMPT_POLICY, nodes, tasks, bound, churn=churn)
    for demand, plan, on_node in plans:
        assert plan.victims and all(v.priority < demand.priority for v in plan.victims)
        assert {v.key for v in plan.victims} <= on_node
    assert r.extra.get("preemptions", 0) == len(plans)
    assert r.extra.get("preempted", 0) == sum(len(p.victims) for _, p, _ in plans)
    assert r.placed + r.failed == len(tasks)
    assert r.invariantViolations == 0 and r.overcommittedGpusPeak == 0
    if len({t.demand.priority for t in tasks}) > 1:
        assert sum(r.extra["allocatedByPriority"].values()) == r.requestedMemoryBytes


def test_simulate_refuses_planner_preempt_without_priorities(tmp_path, capsys) -> None:
    n, p = write(tmp_path, NODES, PODS)
    args = ["simulate", "--nodes", str(n), "--pods", str(p), "--policy", PREEMPT_POLICY]
    assert main(args) == 2
    assert "planner+preempt needs pods of different priorities" in capsys.readouterr().err
    assert main([*args, "--priorities", "qos", "--policy", "planner"]) == 0
    out = capsys.readouterr().out
    assert "planner+preempt: 1 preemptions evicted 1 pods, 0 placed again" in out
    assert "planner, by priority: 1000: 1000Mi (1 GPU pods failed)" in out
    assert main([*args, "--priorities", "qos", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["input"]["priorities"] == "qos"
    assert body["policies"][PREEMPT_POLICY]["preempted"] == 1


def test_on_a_slice_of_the_real_trace_high_priority_pods_fail_less() -> None:
    """The first 40 nodes and 300 pods of the trace's default list (tests/fixtures/traces,
    unchanged rows), inflated to 1.3x the GPUs: the planner fails pods of every class; with
    preemption the LS and Guaranteed pods fail less and hold more, the BE pods hold less."""
    from pathlib import Path

    trace = Path(__file__).parent / "fixtures" / "traces"
    nodes, tasks, bound = read_inputs(
        trace / "openb_node_list_gpu_node.csv", trace / "openb_pod_list_default.csv"
    )
    assert (len(nodes), len(tasks)) == (40, 300)
    gpus = sum(int(n["metadata"]["labels"]["nvidia.com/gpu.count"]) for n in nodes)
    tasks = with_qos_priorities(inflate(tasks, gpus, 1.3))
    planner = run_policy("planner", nodes, tasks, bound)
    r = run_policy(PREEMPT_POLICY, nodes, tasks, bound)
    failed, held = r.extra["failedGpuPodsByPriority"], r.extra["allocatedByPriority"]
    assert 0 <= failed["1000"] < planner.extra["failedGpuPodsByPriority"]["1000"]
    assert held["1000"] > planner.extra["allocatedByPriority"]["1000"]
    assert held["0"] < planner.extra["allocatedByPriority"]["0"]
    assert r.extra["preempted"] > 0 and r.invariantViolations == 0
    assert r.placed + r.failed == len(tasks)
