from builders import gpu_node, mig_mixed_node, mig_single_node

from extender.inventory import Gpu, MigSlice, Sharing, node_inventory
from extender.quantity import MIB


def test_exclusive_gpus_from_labels():
    inv = node_inventory(gpu_node("n", count=8, memory_mib=81559, product="NVIDIA-H100-80GB-HBM3"))
    assert inv.problem is None
    assert len(inv.devices) == 8
    d = inv.devices[3]
    assert isinstance(d, Gpu) and d.index == 3 and d.memory_bytes == 81559 * MIB
    assert (
        d.sharing is Sharing.EXCLUSIVE and d.replicas == 1 and d.per_pod_cap_bytes == d.memory_bytes
    )


def test_time_slicing_uses_per_gpu_replicas_and_shared_suffix():
    inv = node_inventory(gpu_node("n", count=4, replicas=4))
    assert inv.product.endswith("-SHARED")
    assert [d.replicas for d in inv.devices] == [4, 4, 4, 4]
    assert all(d.sharing is Sharing.TIME_SLICING for d in inv.devices)
    # gpu.memory is per physical GPU, never divided by replicas
    assert inv.devices[0].memory_bytes == 81920 * MIB


def test_renamed_shared_resource():
    inv = node_inventory(gpu_node("n", count=2, replicas=3, resource="nvidia.com/gpu.shared"))
    assert {d.resource for d in inv.devices} == {"nvidia.com/gpu.shared"}
    assert not inv.product.endswith("-SHARED")


def test_mps_caps_each_replica():
    inv = node_inventory(gpu_node("n", count=2, replicas=4, strategy="mps", memory_mib=81920))
    d = inv.devices[0]
    assert d.sharing is Sharing.MPS
    assert d.per_pod_cap_bytes == 81920 * MIB // 4


def test_allocatable_below_labels_drops_unhealthy_gpus():
    inv = node_inventory(gpu_node("n", count=4, replicas=4, allocatable=12))
    assert len(inv.devices) == 3


def test_gpus_no_device_plugin_advertises_are_not_offered():
    """A node whose allocatable lists resources but not the GPU resource has no device plugin
    serving its GPUs: kube-scheduler refuses GPU pods there, unless DRA fills the request
    (DRAExtendedResource, on by default in 1.36), and DRA's GPUs are not in vramsched's books. A
    node with no allocatable at all (a hand-written cluster file) keeps its labels' GPUs."""
    for node in (
        gpu_node("n", count=2, replicas=4),
        mig_single_node("s", "1g.10gb", slices=14, memory_mib=9984),
    ):
        alloc = node["status"]["allocatable"]
        del alloc["nvidia.com/gpu"]
        node["status"]["capacity"] = dict(alloc)
        assert node_inventory(node).problem == "node allocatable has no nvidia.com/gpu"
        del node["status"]
        assert node_inventory(node).problem is None and node_inventory(node).devices
    mixed = mig_mixed_node("m", {"1g.10gb": (2, 9984), "3g.40gb": (1, 40192)})
    del mixed["status"]["allocatable"]["nvidia.com/mig-3g.40gb"]
    assert {d.profile for d in node_inventory(mixed).devices} == {"1g.10gb"}


def test_fixture_node_from_real_scheduler():
    from builders import fixture_nodes

    inv = node_inventory(fixture_nodes()[0])
    assert inv.problem is None and len(inv.devices) == 4 and inv.devices[0].replicas == 4


def test_missing_labels_name_the_label():
    node = gpu_node("n")
    del node["metadata"]["labels"]["nvidia.com/gpu.memory"]
    assert node_inventory(node).problem == "missing label nvidia.com/gpu.memory"
    plain = {"metadata": {"name": "cpu", "labels": {}}, "status": {"allocatable": {"cpu": "4"}}}
    assert node_inventory(plain).problem == "missing label nvidia.com/gpu.product"
    bad = gpu_node("n")
    bad["metadata"]["labels"]["nvidia.com/gpu.count"] = "many"
    assert "nvidia.com/gpu.count='many' is not an integer" in node_inventory(bad).problem
    for odd in ("1_6", "١٦", "８"):  # int() takes each of these; a Kubernetes label value cannot
        bad["metadata"]["labels"]["nvidia.com/gpu.count"] = odd
        assert f"nvidia.com/gpu.count={odd!r} is not an integer" in node_inventory(bad).problem
    no_alloc = gpu_node("n", allocatable=0)
    assert node_inventory(no_alloc).problem == "node allocatable has no nvidia.com/gpu"


def test_mig_single_strategy_slices():
    inv = node_inventory(mig_single_node("n", "1g.10gb", slices=14, memory_mib=9984))
    assert inv.problem is None and len(inv.devices) == 14
    assert all(
        isinstance(d, MigSlice) and d.profile == "1g.10gb" and d.memory_bytes == 9984 * MIB
        for d in inv.devices
    )
    assert {d.gpu_index for d in inv.devices} == {0, 1}
    assert len({d.device_id for d in inv.devices}) == 14


def test_mig_mixed_strategy_uses_labelled_memory():
    inv = node_inventory(
        mig_mixed_node("n", {"1g.10gb": (2, 9984), "2g.20gb": (1, 20096), "3g.40gb": (1, 40192)})
    )
    assert inv.problem is None
    by_profile = {}
    for d in inv.devices:
        by_profile.setdefault(d.profile, []).append(d)
    assert len(by_profile["1g.10gb"]) == 2 and by_profile["1g.10gb"][0].memory_bytes == 9984 * MIB
    assert by_profile["3g.40gb"][0].resource == "nvidia.com/mig-3g.40gb"
    assert len({d.device_id for d in inv.devices}) == 4


def test_bad_mig_strategy():
    node = gpu_node("n", extra_labels={"nvidia.com/mig.strategy": "weird"})
    assert "mig.strategy='weird'" in node_inventory(node).problem


def test_mig_labels_are_read_as_they_are_for_planning():
    """`read_mig_labels` (plan-mig's reader) keeps what `node_inventory` would refuse: a profile
    without its memory label still counts, the planner takes its memory from the MIG tables."""
    import pytest

    from extender.inventory import read_mig_labels

    assert (
        read_mig_labels({"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.count": "1"})
        is None
    )
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig-1g.10gb.count": "7",
        "nvidia.com/mig-1g.10gb.me.count": "1",
        "nvidia.com/mig-3g.40gb.count": "2",
        "nvidia.com/mig-3g.40gb.memory": "40448",
        "nvidia.com/mig.config": "all-balanced",
    }
    found = read_mig_labels(labels)
    assert found is not None and found.strategy == "mixed" and found.gpu_count == 2
    assert found.counts == {"1g.10gb": 7, "1g.10gb+me": 1, "3g.40gb": 2}
    assert found.memory == {"3g.40gb": 40448 * MIB}
    assert (found.config, found.config_state, found.single_profile) == (
        "all-balanced",
        "success",
        None,
    )
    assert "memory" in (node_inventory({"metadata": {"name": "n", "labels": labels}}).problem or "")
    single = read_mig_labels(
        {
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
            "nvidia.com/gpu.count": "14",
            "nvidia.com/gpu.memory": "4864",
            "nvidia.com/mig.strategy": "single",
        }
    )
    assert single is not None and single.single_profile == "1g.5gb"
    assert single.gpu_count == 14 and single.memory == {"1g.5gb": 4864 * MIB}
    unknown = read_mig_labels(
        {"nvidia.com/gpu.product": "X-MIG-1g.5gb", "nvidia.com/mig.strategy": "single"}
    )
    assert unknown is not None and unknown.single_profile is None  # no MIG table for product X
    with pytest.raises(
        ValueError, match=r"label nvidia.com/mig-1g.10gb.count='seven' is not an integer"
    ):
        read_mig_labels({**labels, "nvidia.com/mig-1g.10gb.count": "seven"})
    # a negative count, or memory no GPU has, would reach the MIG model as a coefficient
    for key, value, limit in (
        ("nvidia.com/mig-1g.10gb.count", "-1", 512),
        ("nvidia.com/mig-1g.10gb.memory", "99999999999999999999", 1 << 24),
        ("nvidia.com/gpu.count", "100000", 512),
    ):
        with pytest.raises(
            ValueError, match=rf"label {key}='{value}' is out of range \(0 to {limit}\)"
        ):
            read_mig_labels({**labels, key: value})
    with pytest.raises(
        ValueError, match=r"label nvidia.com/mig-9g.90gb.count: MIG profile '9g.90gb'"
    ):
        read_mig_labels({**labels, "nvidia.com/mig-9g.90gb.count": "5"})
    with pytest.raises(ValueError, match=r"label nvidia.com/mig.config=\['a'\] is not a string"):
        read_mig_labels({**labels, "nvidia.com/mig.config": ["a"]})


def test_host_allocatable_beyond_any_node_reads_as_not_stated():
    """The planner keeps CPU and memory in int64 arrays; a node stating more than 2^62 of either
    (a broken file) is read like one stating neither, as an unparseable quantity is."""
    node = gpu_node("n")
    node["status"]["allocatable"].update(cpu="64", memory="512Gi")
    inv = node_inventory(node)
    assert (inv.cpu_milli, inv.memory_bytes) == (64_000, 512 * 1024 * MIB)
    node["status"]["allocatable"]["cpu"] = "99999999999999999999"
    inv = node_inventory(node)
    assert (inv.cpu_milli, inv.memory_bytes) == (0, 0) and len(inv.devices) == 4
