"""The simulator: trace reading, inflation, policies, metrics, CLI output, and plan-defrag."""

from __future__ import annotations

import json

import pytest
import yaml
from builders import gpu_node, pod

from extender.assignment import encode_assignment
from extender.cli import main
from extender.demand import PodRef
from extender.ledger import Reservation
from extender.planner import model
from extender.quantity import GIB, MIB
from extender.simulate.engine import (
    ALL_POLICIES,
    MOVES_PER_GPU,
    PolicyResult,
    run_policy,
    while_all_fit,
)
from extender.simulate.repack_replay import RepackLimits
from extender.simulate.trace import inflate, read_inputs, read_trace_nodes, read_trace_pods

NODE_HEAD = "sn,cpu_milli,memory_mib,gpu,model\n"
POD_HEAD = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def write(tmp_path, nodes: list[str], pods: list[str]):
    n = tmp_path / "nodes.csv"
    p = tmp_path / "pods.csv"
    n.write_text(NODE_HEAD + "".join(r + "\n" for r in nodes))
    p.write_text(POD_HEAD + "".join(r + "\n" for r in pods))
    return n, p


def task(name, gpus, milli, t, *, cpu=1000, spec="", dele="", qos="LS"):
    return f"{name},{cpu},1024,{gpus},{milli},{spec},{qos},Running,{t},{dele},{t}"


def test_trace_reader_follows_the_trace_convention(tmp_path):
    n, p = write(
        tmp_path,
        ["node-a,8000,65536,2,T4"],
        [
            task("b", 1, 300, 5),
            task("a", 1, 300, 5, spec="T4|P100"),
            task("m", 2, 0, 1),
            task("cpu", 0, 0, 0),
        ],
    )
    nodes = read_trace_nodes(n)
    assert nodes[0]["metadata"]["labels"]["nvidia.com/gpu.memory"] == "1000"
    tasks = read_trace_pods(p)
    assert [t.demand.pod.name for t in tasks] == ["cpu", "m", "a", "b"]  # creation time, then name
    a = tasks[2].demand
    assert a.bytes_per_gpu == 300 * MIB and a.allowed_products == frozenset({"T4", "P100"})
    assert tasks[1].demand.gpu_count == 2 and tasks[1].demand.bytes_per_gpu is None  # whole GPUs
    assert len(read_trace_pods(p, skip_cpu_only=True)) == 3


def test_inflate_reaches_the_target_with_fresh_names(tmp_path):
    _, p = write(tmp_path, [], [task(f"t{i}", 1, 500, i) for i in range(4)])
    tasks = inflate(read_trace_pods(p), gpu_capacity=3, factor=1.5)
    demand = sum(t.demand.bytes_per_gpu for t in tasks) / (1000 * MIB)
    assert demand >= 4.5 and demand - 0.5 < 4.5
    assert len({t.key for t in tasks}) == len(tasks)
    assert [t.arrival for t in tasks] == sorted(t.arrival for t in tasks)


def test_spread_overcommits_vram_and_vramsched_policies_never_do(tmp_path):
    # one node, one GPU; two 600-MiB tasks: the device plugin's time-slicing puts both on it
    n, p = write(tmp_path, ["n0,64000,262144,1,T4"], [task("x", 1, 600, 0), task("y", 1, 600, 1)])
    nodes, tasks, bound = read_inputs(n, p)
    spread = run_policy("spread", nodes, tasks, bound)
    assert (
        spread.placed == 2 and spread.overcommittedGpus == 1 and spread.overcommittedGpusPeak == 1
    )
    for policy in ("planner", "best-fit", "first-fit", "fgd"):
        r = run_policy(policy, nodes, tasks, bound)
        assert (r.placed, r.failed, r.overcommittedGpus, r.invariantViolations) == (1, 1, 0, 0)


def test_an_overcommit_that_churn_ends_before_the_replay_does_still_counts(tmp_path):
    n, p = write(
        tmp_path,
        ["n0,64000,262144,1,T4"],
        [task("x", 1, 600, 0, dele="5"), task("y", 1, 600, 1, dele="5"), task("z", 1, 100, 9)],
    )
    nodes, tasks, bound = read_inputs(n, p)
    spread = run_policy("spread", nodes, tasks, bound, churn=True)
    assert (spread.placed, spread.overcommittedGpus, spread.overcommittedGpusPeak) == (3, 0, 1)
    assert run_policy("planner", nodes, tasks, bound, churn=True).overcommittedGpusPeak == 0


def test_pods_arriving_together_are_planned_as_one_batch(tmp_path):
    # two GPUs; six tasks at the same time: greedy strands memory, the batch plan fits all six
    sizes = [450, 450, 300, 300, 250, 250]
    n, p = write(
        tmp_path, ["n0,64000,262144,2,T4"], [task(f"p{i}", 1, s, 7) for i, s in enumerate(sizes)]
    )
    nodes, tasks, bound = read_inputs(n, p)
    planner = run_policy("planner", nodes, tasks, bound, time_limit=5, num_workers=1)
    best = run_policy("best-fit", nodes, tasks, bound)
    assert planner.solverBatches == 1 and planner.placed == 6 and planner.overcommittedGpus == 0
    assert best.placed == 5
    assert planner.allocatedMemoryBytes == 2000 * MIB


def test_planner_follows_its_rule_when_no_batch_plan_places_more(tmp_path):
    # pods alone and in pairs on four nodes, everything fits: the planner's plan of each batch is
    # its one-pod rule's sequential plan, so the replay ends in exactly that rule's state
    rows = [
        task(
            f"p{i}", 1 if i % 5 else 2, (150 * i) % 900 + 50 if i % 5 else 0, i // 2 if i % 3 else i
        )
        for i in range(24)
    ]
    n, p = write(
        tmp_path,
        [
            "n0,64000,262144,4,T4",
            "n1,64000,262144,2,T4",
            "n2,32000,131072,4,P100",
            "n3,64000,262144,8,T4",
            "n4,64000,262144,4,P100",
        ],
        rows,
    )
    nodes, tasks, bound = read_inputs(n, p)
    planner = run_policy("planner", nodes, tasks, bound, time_limit=2, num_workers=1)
    fgd = run_policy(model.SEQUENTIAL_RULE, nodes, tasks, bound)
    assert planner.solverBatches > 0 and planner.solverImproved == 0 and planner.failed == 0
    for key in (
        "placed",
        "allocatedMemoryBytes",
        "gpusFree",
        "fragmentationBytes",
        "gpusFreeMean",
        "gpusInUsePeak",
    ):
        assert getattr(planner, key) == getattr(fgd, key), key


def test_churn_frees_capacity_for_later_pods(tmp_path):
    rows = [task("first", 1, 1000, 0, dele="10"), task("second", 1, 1000, 20)]
    n, p = write(tmp_path, ["n0,64000,262144,1,T4"], rows)
    nodes, tasks, bound = read_inputs(n, p)
    assert run_policy("planner", nodes, tasks, bound).placed == 1
    assert run_policy("planner", nodes, tasks, bound, churn=True).placed == 2


def test_cpu_bounds_placement_like_kube_scheduler(tmp_path):
    n, p = write(
        tmp_path,
        ["n0,4000,262144,2,T4"],
        [task("a", 1, 100, 0, cpu=3000), task("b", 1, 100, 1, cpu=3000)],
    )
    nodes, tasks, bound = read_inputs(n, p)
    for policy in ALL_POLICIES:
        assert run_policy(policy, nodes, tasks, bound).placed == 1


def test_the_regime_where_every_pod_fits_ends_at_the_first_pod_that_could_have_fit(tmp_path):
    # two 1000-MiB GPUs; x asks for a P100 the cluster lacks (it fits nowhere, for any policy), c
    # finds no room left: the regime ends before c, and d placed afterwards does not reopen it
    n, p = write(
        tmp_path,
        ["n0,64000,262144,2,T4"],
        [
            task("a", 1, 300, 0),
            task("x", 1, 100, 1, spec="P100"),
            task("b", 1, 800, 2),
            task("c", 1, 800, 3),
            task("d", 1, 100, 4),
        ],
    )
    nodes, tasks, bound = read_inputs(n, p)
    r = run_policy("best-fit", nodes, tasks, bound)
    assert (r.placed, r.failed) == (3, 2)
    assert (r.allFitBatches, r.allFitArrivals) == (3, 3)
    assert r.freeSeries == [
        (1, 1),
        (2, 1),
        (3, 0),
        (4, 0),
        (5, 0),
    ]  # (pods arrived, GPUs fully free) per batch
    assert "freeSeries" not in r.to_json() and r.to_json()["allFitArrivals"] == 3


def test_while_all_fit_compares_policies_where_none_has_failed_yet():
    early = PolicyResult("best-fit", allFitBatches=2, freeSeries=[(1, 5), (3, 4), (4, 4)])
    late = PolicyResult("planner", allFitBatches=3, freeSeries=[(1, 5), (3, 3), (4, 2)])
    assert while_all_fit([late, early]) == {
        "batches": 2,
        "arrivals": 3,
        "gpusFree": {"planner": 3, "best-fit": 4},
    }
    assert (
        while_all_fit([late, PolicyResult("first-fit", allFitBatches=0, freeSeries=[(1, 5)])])
        is None
    )
    over = PolicyResult(
        "spread", allFitBatches=1, freeSeries=[(1, 6), (3, 6)], overcommittedGpusPeak=2
    )
    assert while_all_fit([late, over]) == {"batches": 3, "arrivals": 4, "gpusFree": {"planner": 2}}


def test_free_curve_plot(tmp_path):
    from extender.simulate.plot import plot_free_curve

    png = tmp_path / "curve.png"
    plot_free_curve(
        {
            "arrivals": [1, 5, 9],
            "gpusFree": {"planner": [7, 5, 4], "best-fit": [8, 5, 2], "fgd": [7, 5, 4]},
        },
        png,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_simulate_json_output(tmp_path, capsys):
    n, p = write(
        tmp_path,
        ["n0,64000,262144,2,T4", "n1,64000,262144,2,P100"],
        [task(f"p{i}", 1, 200 * (i % 5 + 1), i // 2) for i in range(12)],
    )
    assert (
        main(["simulate", "--nodes", str(n), "--pods", str(p), "--json", "--inflate", "1.2"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == set(ALL_POLICIES)
    for name, r in out["policies"].items():
        for key, typ in [
            ("placed", int),
            ("failed", int),
            ("allocatedMemoryBytes", int),
            ("gpusInUse", int),
            ("gpusFree", int),
            ("overcommittedGpus", int),
            ("seconds", float),
        ]:
            assert isinstance(r[key], typ), (name, key)
        assert r["gpusInUse"] + r["gpusFree"] == 4
    assert out["policies"]["planner"]["overcommittedGpus"] == 0
    fit = out["whileAllFit"]  # 12 pods of 6 GPUs of demand at 1.2 x 4 GPUs: some policy fails some
    fair = {p: r for p, r in out["policies"].items() if not r["overcommittedGpusPeak"]}
    assert (
        0 < fit["arrivals"] < out["input"]["tasks"]
        and set(fit["gpusFree"]) == set(fair)
        and "planner" in fair
    )
    assert fit["arrivals"] == min(r["allFitArrivals"] for r in fair.values())


def test_simulate_reads_cluster_yaml_and_plots(tmp_path, capsys):
    objs = [
        gpu_node("g0", count=2, memory_mib=80 * 1024, replicas=4),
        pod("a", "30Gi"),
        pod("b", "50Gi"),
        pod("c", "60Gi", gpus=2),
    ]
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs}))
    png = tmp_path / "out.png"
    assert (
        main(
            [
                "simulate",
                "--nodes",
                str(f),
                "--pods",
                str(f),
                "--policy",
                "planner",
                "--policy",
                "spread",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "planner" in table and "spread" in table
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("creationTimestamp", "yesterday", "creationTimestamp 'yesterday' is not an RFC 3339"),
        ("departure", "soon", "vramsched.io/sim-departure 'soon' is not a number of seconds"),
        ("departure", "nan", "vramsched.io/sim-departure 'nan' is not a number of seconds"),
    ],
)
def test_simulate_names_the_pod_whose_time_is_bad(tmp_path, capsys, field, value, message):
    """A pod's arrival or departure that is not a time stops the replay with the pod's name,
    instead of replaying it at the start of time (or comparing NaN with every other time)."""
    bad = pod("b", "20Gi")
    if field == "creationTimestamp":
        bad["metadata"]["creationTimestamp"] = value
    else:
        bad["metadata"].setdefault("annotations", {})["vramsched.io/sim-departure"] = value
    objs = [gpu_node("g0", count=1, memory_mib=80 * 1024), pod("a", "20Gi"), bad]
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs}))
    assert main(["simulate", "--nodes", str(f), "--pods", str(f), "--churn"]) == 2
    err = capsys.readouterr().err
    assert "cannot read inputs: pod default/b: " in err and message in err, err


def bound_pod(name, node, dev, gib, namespace="default"):
    res = Reservation(PodRef(namespace, name), node, (dev,), (gib * GIB,))
    p = pod(
        name,
        f"{gib}Gi",
        node=node,
        namespace=namespace,
        phase="Running",
        annotations=encode_assignment(res),
    )
    return p


def test_plan_defrag_frees_gpus_with_fewest_moves_and_respects_limits(tmp_path, capsys):
    objs = [
        gpu_node("g0", count=2, memory_mib=80 * 1024, replicas=4),
        gpu_node("g1", count=1, memory_mib=80 * 1024, replicas=4),
        bound_pod("a", "g0", "0", 20),
        bound_pod("b", "g0", "1", 20),
        bound_pod("c", "g1", "0", 30, namespace="prod"),
    ]
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objs}))
    assert main(["plan-defrag", "--cluster", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["gpusFreed"] == 2 and len(out["moves"]) == 2
    )  # two moves free two GPUs; three would free no more
    assert main(["plan-defrag", "--cluster", str(f), "--json", "--max-moves", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpusFreed"] == 1 and len(out["moves"]) == 1
    assert (
        main(["plan-defrag", "--cluster", str(f), "--json", "--exclude-namespace", "default"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["gpusFreed"] == 1 and [m["pod"] for m in out["moves"]] == ["prod/c"]
    assert main(["plan-defrag", "--cluster", str(f)]) == 0
    assert "Nothing was evicted" in capsys.readouterr().out


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_on_a_slice_of_the_real_trace(policy):
    # first 40 nodes and 150 tasks of the Alibaba trace (tests/fixtures/traces, unchanged rows)
    from pathlib import Path

    trace = Path(__file__).parent / "fixtures" / "traces"
    nodes, tasks, bound = read_inputs(
        trace / "openb_node_list_gpu_node.csv", trace / "openb_pod_list_gpushare40.csv"
    )
    assert (len(nodes), len(tasks)) == (40, 150)
    for churn in (False, True):
        r = run_policy(policy, nodes, tasks, bound, churn=churn)
        assert r.placed + r.failed == 150
        if policy != "spread":
            assert r.overcommittedGpusPeak == 0 and r.invariantViolations == 0


def test_usable_free_gpus_leaves_out_a_free_gpu_whose_node_has_no_cpu_left(tmp_path):
    """ "GPUs fully free" counts n0's second GPU; no GPU pod of the workload could start there (its
    node's CPU is gone), so the usable count, weighted by the workload's GPU pod types, does not.
    A CPU-only type does not dilute it."""
    from extender.planner.capacity import Workload

    n, p = write(
        tmp_path,
        ["n0,4000,262144,2,T4", "n1,64000,262144,2,T4"],
        [task("hog", 1, 100, 0, cpu=3500), task("small", 1, 200, 1), task("cpu", 0, 0, 2, cpu=100)],
    )
    nodes, tasks, bound = read_inputs(n, p)
    workload = Workload.from_demands(t.demand for t in tasks)
    r = run_policy("first-fit", nodes, tasks[:1], bound, workload=workload)  # the hog alone, on n0
    assert r.gpusFree == 3
    assert r.gpusFreeUsable == pytest.approx(2.0)
    r = run_policy(
        "first-fit", nodes, tasks[:2], bound, workload=workload
    )  # and "small" next to it? no CPU: on n1
    assert r.gpusFree == 2 and r.gpusFreeUsable == pytest.approx(1.0)


async def test_hot_path_policy_places_each_pod_where_the_server_binds_it():
    """`hot-path` claims to be what `vramsched serve` does to a pod placed at once: replay the same
    pods through the service's filter, prioritize (kube-scheduler takes the top score) and bind."""
    from builders import cluster, service

    from extender.demand import pod_demand
    from extender.planner.greedy import choose, place_one
    from extender.simulate.engine import build_capacity
    from extender.wire import ExtenderArgs, ExtenderBindingArgs

    nodes = [gpu_node(f"n{i}", count=2, replicas=4) for i in range(4)] + [
        gpu_node("big", count=4, replicas=2)
    ]
    sizes = [30, 60, 10, 40, 20, 70, 16, 50, 8, 30, 75, 12, 45, 5, 64, 33]
    pods = [pod(f"p{i}", f"{s}Gi", gpus=2 if i % 7 == 3 else 1) for i, s in enumerate(sizes * 2)]
    names = [n["metadata"]["name"] for n in nodes]

    state = cluster(*nodes)
    s = service(state)
    served: dict[str, tuple[str, tuple[str, ...]] | None] = {}
    for p in pods:
        feasible = s.filter(ExtenderArgs(Pod=p, NodeNames=names)).NodeNames or []
        if not feasible:
            served[p["metadata"]["name"]] = None
            continue
        scores = {h.Host: h.Score for h in s.prioritize(ExtenderArgs(Pod=p, NodeNames=feasible))}
        best = max(scores.values())
        (node,) = [
            n for n in feasible if scores[n] == best
        ]  # one top score: no random pick to make
        assert (
            await s.bind(
                ExtenderBindingArgs(
                    PodName=p["metadata"]["name"], PodNamespace="default", Node=node
                )
            )
        ).Error == ""
        res = state.ledger.reservation(f"default/{p['metadata']['name']}")
        served[p["metadata"]["name"]] = (node, res.device_ids)

    _, cap = build_capacity(nodes)
    simulated: dict[str, tuple[str, tuple[str, ...]] | None] = {}
    for p in pods:
        d = pod_demand(p)
        ch = choose("hot-path", cap, d)
        if ch is None:
            simulated[p["metadata"]["name"]] = None
            continue
        place_one(cap, d, ch)
        simulated[p["metadata"]["name"]] = (ch[0].node, ch[0].device_ids)
    assert simulated == served
    assert (
        sum(v is None for v in served.values()) >= 1
    )  # the cluster fills: refusals are compared too
    assert {served[f"p{i}"][0] for i in range(3)} == {
        "n0"
    }  # and it packs: 30 + 60 + 10Gi on the first node


# ----- planner+repack and the allocation bound ------------------------------------------------

# two nodes of two 1000-MiB GPUs and 16 cores; the 2-GPU pod p3 finds no node with both GPUs
# free after the planner spread p0-p2 by CPU, and one move makes one (found by a seeded search)
REPACK_NODES = ["n0,16000,65536,2,T4", "n1,16000,65536,2,T4"]
REPACK_PODS = [
    task("p0", 1, 200, 0, cpu=8000),
    task("p1", 1, 300, 1, cpu=4000),
    task("p2", 1, 200, 2, cpu=4000),
    task("p3", 2, 0, 3, cpu=8000),
    task("p4", 1, 700, 4, cpu=4000),
]


def test_planner_repack_moves_a_pod_to_place_one_that_fits_nowhere(tmp_path):
    nodes, tasks, bound = read_inputs(*write(tmp_path, REPACK_NODES, REPACK_PODS))
    planner = run_policy("planner", nodes, tasks, bound)
    assert planner.failed == 1 and planner.moves == 0  # p3
    r = run_policy("planner+repack", nodes, tasks, bound, move_budget=0.5)
    assert r.repackPlaced == 1 and r.moves == 1 and r.repackSearches >= 1
    assert r.allocatedMemoryBytes == planner.allocatedMemoryBytes - 700 * MIB + 2000 * MIB
    assert r.overcommittedGpusPeak == 0 and r.invariantViolations == 0
    assert r.to_json()["moves"] == 1 and r.to_json()["moveBudget"] == 0.5
    assert run_policy("fgd", nodes, tasks, bound).to_json()["moves"] == 0


def test_the_move_budget_is_a_fraction_of_the_pods_placed(tmp_path):
    # 3 pods are placed when p3 arrives: 0.3 x 3 allows no move, 0.34 x 3 allows one
    nodes, tasks, bound = read_inputs(*write(tmp_path, REPACK_NODES, REPACK_PODS))
    planner = run_policy("planner", nodes, tasks, bound)
    for budget, moves in ((0.0, 0), (0.3, 0), (0.34, 1)):
        r = run_policy("planner+repack", nodes, tasks, bound, move_budget=budget)
        assert r.moves == moves, budget
        if not moves:
            assert r.repackSearches == 0 and r.repackSkipped >= 1
            assert (r.placed, r.allocatedMemoryBytes) == (
                planner.placed,
                planner.allocatedMemoryBytes,
            )


def test_the_repack_tally_names_the_request_and_adds_up(tmp_path):
    """`repackByRequest` says what became of each blocked pod, by GPU request: with no budget
    p3 (two whole GPUs) finds none to spend; with one move it is searched and placed by one.
    Its rows add up to the replay's totals."""
    from extender.simulate.repack_replay import request_label

    nodes, tasks, bound = read_inputs(*write(tmp_path, REPACK_NODES, REPACK_PODS))
    p3 = next(t.demand for t in tasks if t.key == "trace/p3")
    assert request_label(p3) == "2 x whole"
    for budget in (0.0, 0.5):
        r = run_policy("planner+repack", nodes, tasks, bound, move_budget=budget)
        rows = r.to_json()["repackByRequest"]
        if budget:
            assert rows["2 x whole"] == {
                "blocked": 1,
                "budgetSpent": 0,
                "skipped": 0,
                "searched": 1,
                "placed": 1,
                "moves": 1,
            }
        else:
            assert rows["2 x whole"]["budgetSpent"] == 1 and rows["2 x whole"]["searched"] == 0
        for row in rows.values():
            assert row["blocked"] == row["budgetSpent"] + row["skipped"] + row["searched"]
        total = {k: sum(row[k] for row in rows.values()) for k in next(iter(rows.values()))}
        assert total["searched"] == r.repackSearches and total["placed"] == r.repackPlaced
        assert total["budgetSpent"] + total["skipped"] == r.repackSkipped
        assert total["moves"] == r.moves


def test_a_search_may_spend_at_most_the_moves_per_gpu_and_per_pod(tmp_path, monkeypatch):
    """A budget of 5 x 3 placed pods allows 15 moves; the search for p3, of two GPUs, is asked
    for at most 2 with a cap of 1 per GPU, or of 5 per GPU and 2 per pod (live mode's caps; one
    search must not spend the budget)."""
    import extender.planner.repack as repack

    asked: list[int] = []
    search = repack.search_repack

    def spy(*args, **kw):
        asked.append(kw["max_moves"])
        return search(*args, **kw)

    monkeypatch.setattr(repack, "search_repack", spy)
    nodes, tasks, bound = read_inputs(*write(tmp_path, REPACK_NODES, REPACK_PODS))
    for caps in ({"moves_per_gpu": 1}, {"moves_per_gpu": 5, "moves_per_pod": 2}):
        asked.clear()
        r = run_policy("planner+repack", nodes, tasks, bound, move_budget=5.0, **caps)
        assert asked and max(asked) == 2 and r.moves == 1
        out = r.to_json()
        assert (out["movesPerGpu"], out["movesPerPod"]) == (
            caps["moves_per_gpu"],
            caps.get("moves_per_pod"),
        )
    asked.clear()
    run_policy("planner+repack", nodes, tasks, bound, move_budget=0.5)  # budget left: 1
    assert asked and max(asked) == 1


def test_the_move_cap_scales_with_the_gpus_a_pod_asks():
    from extender.demand import Demand, PodRef

    def d(gpus: int) -> Demand:
        return Demand(PodRef("t", f"g{gpus}"), gpus, None if gpus > 1 else GIB)

    assert RepackLimits(budget=5.0).allowed(d(1), placed=3, moved=0) == MOVES_PER_GPU
    assert RepackLimits(budget=5.0).allowed(d(4), placed=3, moved=0) == 4 * MOVES_PER_GPU
    assert RepackLimits(budget=5.0, per_pod=5).allowed(d(4), placed=3, moved=0) == 5
    assert RepackLimits(budget=1.0).allowed(d(8), placed=10, moved=3) == 7  # the budget's rest
    assert RepackLimits(budget=0.5, per_gpu=3).allowed(d(1), placed=3, moved=1) == 0


def test_a_failed_repack_search_is_not_repeated_for_a_pod_asking_as_much():
    from extender.demand import Demand, PodRef
    from extender.simulate.repack_replay import RepackSkips

    def d(name, gib, cpu, allowed=None):
        return Demand(PodRef("t", name), 1, gib * GIB, cpu_milli=cpu, allowed_products=allowed)

    skips = RepackSkips()
    skips.add(d("a", 40, 4000), 5)
    assert skips.skip(d("b", 40, 4000), 5) and skips.skip(d("c", 50, 8000), 3)
    assert not skips.skip(d("e", 30, 4000), 5)  # asks less memory: may fit
    assert not skips.skip(d("f", 50, 8000), 6)  # more moves allowed than the failed search had
    assert skips.skip(d("g", 50, 8000, frozenset({"T4"})), 5)  # fewer products: no better
    skips.forget()  # a pod left or pods moved: everything may fit again
    assert not skips.skip(d("b", 40, 4000), 5)


def test_a_failed_search_is_tried_again_after_a_plan_moved_pods(tmp_path, monkeypatch):
    """The skip list starts with a failed search that covers p4 (1 GPU, 700 MiB, 4 cores, 2 GiB)
    and not p3 (2 GPUs, 1 GiB). p3's plan moves a pod; a plan for p4 may exist from the layout the move
    made, so p4 is searched, not skipped."""
    import extender.simulate.engine as engine

    pods = [*REPACK_PODS[:4], task("p4", 1, 700, 4, cpu=4000).replace(",1024,", ",2048,")]
    nodes, tasks, bound = read_inputs(*write(tmp_path, REPACK_NODES, pods))
    p4 = next(t.demand for t in tasks if t.key == "trace/p4")  # more host memory than p3

    skips_class = engine.RepackSkips

    def seeded() -> engine.RepackSkips:
        skips = skips_class()
        skips.add(p4, 3)
        return skips

    monkeypatch.setattr(engine, "RepackSkips", seeded)
    r = run_policy("planner+repack", nodes, tasks, bound, move_budget=5.0)
    assert r.moves == 1 and r.repackPlaced >= 1  # p3, by one move
    assert r.repackSearches == 2 and r.repackSkipped == 0  # p3, then p4


def _best_packing(cap, demands, must=()) -> int:
    """The most GPU memory a set of `demands` placed at once holds, every one of `must` among
    them (exhaustive; -1: the `must` ones never fit together)."""
    from test_planner_repack import placements

    from extender.planner.move_model import reservation_for

    best = -1

    def go(i: int, held: int) -> None:
        nonlocal best
        if i == len(demands):
            best = max(best, held)
            return
        d = demands[i]
        if i not in must:
            go(i + 1, held)
        for n, rows in placements(cap, d):
            res = reservation_for(cap, d, n, rows) if rows else None
            cap.apply(d, res, n)
            go(i + 1, held + (sum(res.bytes_per_device) if res else 0))
            cap.remove(d, n)

    go(0, 0)
    return best


def _trace_nodes(tmp_path, rows):
    path = tmp_path / "nodes.csv"
    path.write_text(NODE_HEAD + "".join(r + "\n" for r in rows))
    return read_trace_nodes(path)


@pytest.mark.parametrize("seed", range(16))
def test_the_allocation_bound_is_never_below_the_best_packing(tmp_path, seed):
    """Small clusters (GPUs of 1000 MiB, few cores) and pods of the trace's shapes: the LP bound
    is at least the most GPU memory any set of the pods holds at once, and with two pods forced
    in, at least the most any set holding them does (and no more than without)."""
    import random

    from extender.demand import Demand, PodRef
    from extender.simulate.bound import allocation_bound
    from extender.simulate.engine import build_capacity

    rng = random.Random(seed)
    rows = [
        f"n{i},{rng.choice([4000, 8000, 16000])},65536,{rng.choice([1, 2, 2])},T4" for i in range(2)
    ]
    _, cap = build_capacity(_trace_nodes(tmp_path, rows))
    demands = [
        Demand(
            PodRef("t", f"p{i}"),
            g,
            None if g > 1 else rng.choice([200, 300, 500, 700, 1000]) * MIB,
            cpu_milli=rng.choice([1000, 2000, 4000, 6000]),
        )
        for i, g in enumerate(rng.choice([1, 1, 1, 2]) for _ in range(6))
    ]
    best = _best_packing(cap, demands)
    b = allocation_bound(cap, demands)
    assert b.status == "OPTIMAL"
    assert best - 1 <= b.bytes <= min(b.capacity_bytes, b.demand_bytes) + 1
    keep = _best_packing(cap, demands, must={0, 1})
    if keep >= 0:
        forced = allocation_bound(cap, demands, placed=demands[:2])
        assert keep - 1 <= forced.bytes <= b.bytes + 1


def test_the_allocation_bound_packs_each_gpu_whole_and_sums_cpu(tmp_path):
    from extender.demand import Demand, PodRef
    from extender.simulate.bound import allocation_bound
    from extender.simulate.engine import build_capacity

    _, cap = build_capacity(_trace_nodes(tmp_path, ["n0,64000,65536,2,T4"]))
    sizes = [600, 600, 300, 300, 300]  # 2100 MiB asked of 2000: 600+300 per GPU at most
    demands = [Demand(PodRef("t", f"p{i}"), 1, m * MIB) for i, m in enumerate(sizes)]
    assert allocation_bound(cap, demands).bytes == pytest.approx(1800 * MIB)
    # 5 cores bound the GPU memory: 5/4 of a 4-core pod (the LP takes fractions of pods)
    _, cap = build_capacity(_trace_nodes(tmp_path, ["n0,5000,65536,2,T4"]))
    demands = [Demand(PodRef("t", f"q{i}"), 1, 500 * MIB, cpu_milli=4000) for i in range(3)]
    assert allocation_bound(cap, demands).bytes == pytest.approx(625 * MIB)


def test_simulate_reports_moves_bound_and_budget_curve(tmp_path, capsys):
    n, p = write(tmp_path, REPACK_NODES, REPACK_PODS)
    png = tmp_path / "budget.png"
    args = ["simulate", "--nodes", str(n), "--pods", str(p), "--move-budget", "0.5"]
    assert main([*args, "--json", "--bound", "--budget-curve", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == set(ALL_POLICIES)
    assert out["policies"]["planner+repack"]["moves"] == 1
    assert all(r["moves"] == 0 for name, r in out["policies"].items() if name != "planner+repack")
    bound = out["bound"]
    assert bound["fromFirstFailure"]["placedThen"] == 3
    mine = out["policies"]["planner+repack"]["allocatedMemoryBytes"]
    budgeted = bound["fromFirstFailureWithBudget"]  # the same state, at most 0.5 x pods moved
    assert budgeted["moveBudget"] == 0.5 and budgeted["status"] == "OPTIMAL"
    assert mine - 1 <= budgeted["bytes"] <= bound["anyPolicyBytes"] + 1
    fits = bound["fromFirstFailurePlacingFits"]  # the same state, no moves, every fit placed
    assert fits["status"] == "OPTIMAL"
    planner = out["policies"]["planner"]["allocatedMemoryBytes"]
    assert planner - 1 <= fits["bytes"] <= budgeted["bytes"] + 1
    for r in out["policies"].values():
        assert r["allocatedMemoryBytes"] <= bound["anyPolicyBytes"] + 1
    for policy in ("fgd", "planner+repack"):  # its own end state, moves allowed: no less
        mine = out["policies"][policy]["allocatedMemoryBytes"]
        assert mine - 1 <= bound["fromEnd"][policy]["bytes"] <= bound["anyPolicyBytes"] + 1
    assert [c["moveBudget"] for c in out["budgetCurve"]] == [0.0, 0.005, 0.01, 0.02, 0.05]
    for c in out["budgetCurve"]:  # each budget's bound holds what that budget reached
        assert c["allocatedPct"] - 0.01 <= c["boundPct"] <= 100
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*args, "--policy", "planner+repack", "--bound"]) == 0
    table = capsys.readouterr().out
    assert "moves" in table.splitlines()[1] and "bound on GPU memory allocated" in table
    assert "and then moving at most 50% of the pods" in table
    assert "and then placing every pod that fits, no moves" in table
    tally = table[table.index("planner+repack, GPU pods that found no place, by request:") :]
    head, *rows = (line.split() for line in tally.splitlines()[1:4])
    assert head[:2] == ["request", "blocked"] and head[-3:] == ["searched", "placed", "moves"]
    by_request = {" ".join(row[:3]): row[3:] for row in rows}
    assert by_request["2 x whole"] == ["1", "0", "0", "1", "1", "1"]  # p3: placed by one move
    assert by_request["1 x 700Mi"] == ["1", "0", "0", "1", "0", "0"]  # p4: searched, no plan
    assert main([*args, "--churn", "--bound"]) == 2
    for flag in ("--max-moves-per-gpu", "--max-moves-per-pod"):
        with pytest.raises(SystemExit) as stop:
            main([*args, flag, "0"])
        assert stop.value.code == 2
        assert f"argument {flag}: must be a whole number >= 1" in capsys.readouterr().err


def test_simulate_open_gpu_cost_packs_the_planner_onto_fewer_gpus(tmp_path, capsys):
    """Four pods of 290 milli-GPU, then one of 610, on three GPUs. FGD's measure keeps a 610 hole
    on every GPU while it can (three GPUs); with --open-gpu-cost 0.2 the planner shares the first
    GPU three times and opens the second for the rest (two GPUs), and every pod is placed."""
    n, p = write(
        tmp_path,
        ["n0,64000,262144,3,V100"],
        [*(task(f"s{i}", 1, 290, i) for i in range(4)), task("big", 1, 610, 4)],
    )
    args = ["simulate", "--nodes", str(n), "--pods", str(p), "--json"]
    got = {}
    for cost in ("0", "0.2"):
        assert main([*args, "--policy", "planner", "--policy", "fgd", "--open-gpu-cost", cost]) == 0
        got[cost] = json.loads(capsys.readouterr().out)["policies"]
    assert got["0"]["planner"]["gpusInUse"] == got["0"]["fgd"]["gpusInUse"] == 3
    assert got["0.2"]["planner"]["gpusInUse"] == 2 and got["0.2"]["planner"]["openGpuCost"] == 0.2
    assert got["0.2"]["fgd"]["gpusInUse"] == 3  # the baselines ignore the option
    assert all(
        r["failed"] == 0 and r["overcommittedGpus"] == 0 for g in got.values() for r in g.values()
    )
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit) as stop:
            main([*args, "--open-gpu-cost", bad])
        assert stop.value.code == 2
        assert "argument --open-gpu-cost: must be a finite number >= 0" in capsys.readouterr().err


def test_the_bound_within_a_budget_is_solved_once_per_budget(tmp_path, monkeypatch):
    """The bounds' JSON and the budget curve's point at the run's budget read one LP solve."""
    import extender.simulate.bound_report as report

    nodes, tasks, bound = read_inputs(*write(tmp_path, REPACK_NODES, REPACK_PODS))
    r = run_policy("planner+repack", nodes, tasks, bound, move_budget=0.5)
    solves: list[float] = []
    solve = report.budget_bound

    def spy(state, later, **kw):
        if "arrivals" not in kw:  # the bound that places every fit has no budget
            solves.append(kw["fraction"])
        return solve(state, later, **kw)

    monkeypatch.setattr(report, "budget_bound", spy)
    within = report.allocation_bounds(nodes, bound, tasks, [r])["fromFirstFailureWithBudget"]
    point = report.budget_curve_point(0.5, r, tasks)
    assert solves == [0.5] and within["status"] == "OPTIMAL"
    assert point["boundPct"] == within["pct"]
    report.budget_curve_point(0.0, r, tasks)
    assert solves == [0.5, 0.0]


def test_a_failed_search_says_whether_it_proved_there_is_no_plan(tmp_path):
    """Every GPU holds a 600 MiB pod, so no GPU has room for another and the 1000 MiB pod has no
    plan: each of its one-move plans strands a 600 MiB pod. On 3 nodes the whole cluster is
    modelled and CP-SAT proves it; on 26 (more than `Neighbourhood.exact_nodes`) only
    neighbourhoods are, so the search ends without a proof, and the replay counts it."""
    for n, unproven in ((3, 0), (26, 1)):
        nodes = [f"n{i:02},8000,65536,1,T4" for i in range(n)]
        pods = [task(f"a{i:02}", 1, 600, i) for i in range(n)] + [task("big", 1, 1000, n)]
        inputs = read_inputs(*write(tmp_path, nodes, pods))
        r = run_policy("planner+repack", *inputs, move_budget=0.5)
        assert (r.failed, r.moves, r.repackSearches) == (1, 0, 1), n
        assert r.repackUnproven == unproven and r.to_json()["repackUnproven"] == unproven, n


def _profile_case():
    """a holds 40 GiB of its 80 GiB GPU, b 20 GiB; a 20 GiB pod arrives, then 40 GiB pods."""
    from builders import assigned

    from extender.demand import pod_demand
    from extender.simulate.trace import Task

    nodes = [gpu_node(n, count=1, memory_mib=80 * 1024, replicas=4) for n in "ab"]
    bound = [
        pod("r40", "40Gi", node="a", phase="Running", annotations=assigned("a", "0", 40)),
        pod("r20", "20Gi", node="b", phase="Running", annotations=assigned("b", "0", 20)),
    ]
    sizes = ["20Gi", "40Gi", "40Gi", "40Gi"]
    tasks = [Task(pod_demand(pod(f"p{i}", s)), arrival=i) for i, s in enumerate(sizes)]
    return nodes, tasks, bound


def test_the_live_profile_knows_only_the_pods_arrived_so_far():
    # With the whole mix (FGD's protocol) the 20 GiB pod goes where it leaves a 40 GiB gap (b);
    # a live cluster has seen only that pod, so either GPU looks as good and it takes a, after
    # which only one 40 GiB pod fits.
    nodes, tasks, bound = _profile_case()
    for policy in ("fgd", "planner"):
        whole = run_policy(policy, nodes, tasks, bound)
        live = run_policy(policy, nodes, tasks, bound, profile="live")
        assert (whole.placed, live.placed) == (3, 2), policy
        assert live.invariantViolations == 0 and live.overcommittedGpusPeak == 0
    # policies without FGD's measure do not change
    assert (
        run_policy("best-fit", nodes, tasks, bound, profile="live").placed
        == run_policy("best-fit", nodes, tasks, bound).placed
    )
    with pytest.raises(ValueError, match="profile must be one of whole, live, got 'arrived'"):
        run_policy("fgd", nodes, tasks, bound, profile="arrived")


def test_live_profile_counts_arrivals_and_departures_and_rebuilds_on_drift():
    from extender.demand import pod_demand
    from extender.simulate.profile import LiveProfile

    lp = LiveProfile(drift=0.5)
    assert not lp.stale()
    d20, d40 = pod_demand(pod("x", "20Gi")), pod_demand(pod("y", "40Gi"))
    lp.arrive("p1", d20)
    assert lp.stale()
    w = lp.workload()
    assert w.need.tolist() == [20 * GIB] and not lp.stale()
    lp.arrive("p2", d40)  # one change against one pod counted: 100% >= 50%
    assert lp.stale()
    w = lp.workload()
    assert sorted(w.need.tolist()) == [20 * GIB, 40 * GIB]
    for i in range(3, 7):
        lp.arrive(f"p{i}", d40)
    lp.workload()  # 6 pods counted: the next rebuild after 3 changes
    lp.leave("p1")
    lp.leave("gone")  # never counted: no change
    lp.arrive("p3", d20)  # p3 again, now 20 GiB: leaves and arrives
    assert lp.stale()
    assert lp.mix.counts.total() == 5
    assert sorted(lp.workload().need.tolist()) == [20 * GIB, 40 * GIB]


def test_workload_from_counts_is_from_demands():
    import random

    from extender.demand import pod_demand
    from extender.planner.capacity import Workload, demand_kind

    rng = random.Random(3)
    demands = []
    for i in range(200):
        gpus = rng.choice([0, 1, 2])
        p = pod(
            f"p{i}",
            rng.choice(["8Gi", "20Gi", None]) if gpus else None,
            gpus=gpus,
            annotations=rng.choice([{}, {"vramsched.io/gpu-products": "A100|H100"}]),
        )
        demands.append(pod_demand(p))
    assert any(d.allowed_products for d in demands)
    from collections import Counter

    a = Workload.from_demands(demands, max_types=4)
    b = Workload.from_counts(Counter(demand_kind(d) for d in demands), max_types=4)
    for f in ("gpu_count", "need", "cpu", "mem", "weight"):
        assert getattr(a, f).tolist() == getattr(b, f).tolist(), f
    assert (a.resource, a.allowed, a.limited, a.gpu_demand) == (
        b.resource,
        b.allowed,
        b.limited,
        b.gpu_demand,
    )
    assert a.gpu_demand[0] > 0 and a.gpu_demand[1] > 0 and a.limited


def test_simulate_profile_flag_replays_what_serve_knows(tmp_path, capsys):
    nodes, tasks, bound = _profile_case()
    pods = []
    for t in tasks:
        p = pod(t.demand.pod.name, f"{t.demand.bytes_per_gpu // GIB}Gi")
        p["metadata"]["creationTimestamp"] = f"2025-01-01T00:00:0{int(t.arrival)}Z"
        pods.append(p)
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump({"kind": "List", "items": [*nodes, *bound, *pods]}))
    placed = {}
    for profile in ("whole", "live"):
        argv = ["simulate", "--nodes", str(f), "--pods", str(f), "--policy", "fgd", "--json"]
        assert main([*argv, "--profile", profile]) == 0
        body = json.loads(capsys.readouterr().out)
        assert body["input"]["profile"] == profile
        placed[profile] = body["policies"]["fgd"]["placed"]
    assert placed == {"whole": 3, "live": 2}
    with pytest.raises(SystemExit):
        main([*argv, "--profile", "arrived"])
    assert "invalid choice: 'arrived'" in capsys.readouterr().err
