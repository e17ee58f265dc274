"""MIG tables and placement rules (extender.mig)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from extender import mig
from extender.mig import GIB

ALL_MODELS = list(mig.MODELS.values())

# The placement rules as written in the reference (nvidia-smi mig -lgipp), by shape:
# (compute slices, memory width, allowed starts). Used by an independent checker below.
REFERENCE_RULES = {
    "1g": (1, 1, {0, 1, 2, 3, 4, 5, 6}),
    "1g+me": (1, 1, {0, 1, 2, 3, 4, 5, 6}),
    "1g.2x": (1, 2, {0, 2, 4, 6}),
    "2g": (2, 2, {0, 2, 4}),
    "3g": (3, 4, {0, 4}),
    "4g": (4, 4, {0}),
    "7g": (7, 8, {0}),
}


def _shape(model: mig.MigModel, name: str) -> str:
    """Which reference row a profile of `model` belongs to."""
    pn = mig.parse_profile_name(name)
    if pn.attribute == "me":
        return "1g+me"
    if pn.compute_slices == 1:
        smallest = min(mig.parse_profile_name(p.name).nominal_gb for p in model.profiles)
        return "1g" if pn.nominal_gb == smallest else "1g.2x"
    return f"{pn.compute_slices}g"


def reference_valid(model: mig.MigModel, counts: Counter) -> bool:
    """Independent validity check: set-of-occupancy-masks search over the reference rules."""
    compute = 0
    for name, k in counts.items():
        c, _, _ = REFERENCE_RULES[_shape(model, name)]
        compute += c * k
    if compute > 7 or counts.get(next(p.name for p in model.profiles if p.media_extensions), 0) > 1:
        return False
    masks = {0}
    for name in sorted(counts.elements()):
        _, width, starts = REFERENCE_RULES[_shape(model, name)]
        new = set()
        for m in masks:
            for s in starts:
                if s + width > 8:
                    continue
                bits = ((1 << width) - 1) << s
                if not m & bits:
                    new.add(m | bits)
        masks = new
        if not masks:
            return False
    return True


# --------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name, g, gb, attr",
    [
        ("1g.10gb", 1, 10, None),
        ("1g.10gb+me", 1, 10, "me"),
        ("7g.141gb", 7, 141, None),
        ("3g.71gb", 3, 71, None),
    ],
)
def test_parse_profile_name(name: str, g: int, gb: int, attr: str | None) -> None:
    pn = mig.parse_profile_name(name)
    assert (pn.compute_slices, pn.nominal_gb, pn.attribute) == (g, gb, attr)
    assert str(pn) == name


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "1g",
        "10gb",
        "1g.10GB",
        "8g.80gb",
        "0g.5gb",
        "1g.10gb+",
        "mig-1g.10gb",
        "1g.10gb.me",
        "١g.١٠gb",
    ],
)
def test_parse_profile_name_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError):
        mig.parse_profile_name(bad)


def test_resource_names() -> None:
    assert mig.resource_name("1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert mig.resource_name("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    assert mig.profile_from_resource("nvidia.com/mig-1g.10gb.me") == "1g.10gb+me"
    assert mig.profile_from_resource("nvidia.com/mig-3g.40gb") == "3g.40gb"
    assert mig.profile_from_resource("nvidia.com/gpu") is None
    for m in ALL_MODELS:
        for p in m.profiles:
            assert mig.profile_from_resource(p.resource) == p.name


# --------------------------------------------------------------------------------------------- tables


def test_tables_have_the_reference_profiles() -> None:
    names = {m.name: [p.name for p in m.profiles] for m in ALL_MODELS}
    assert names["A100-40GB"] == [
        "1g.5gb",
        "1g.5gb+me",
        "1g.10gb",
        "2g.10gb",
        "3g.20gb",
        "4g.20gb",
        "7g.40gb",
    ]
    assert names["H100-94GB"] == [
        "1g.12gb",
        "1g.12gb+me",
        "1g.24gb",
        "2g.24gb",
        "3g.47gb",
        "4g.47gb",
        "7g.94gb",
    ]
    assert names["H200-141GB"][-1] == "7g.141gb"
    assert names["B200"][-1] == "7g.180gb"
    assert mig.H100_80GB.profile("1g.10gb").memory_bytes == int(9.75 * GIB)
    assert mig.A100_40GB.profile("1g.5gb").memory_bytes == int(4.75 * GIB)
    assert mig.H100_80GB.profile("7g.80gb").memory_bytes == int(79.25 * GIB)
    for m in ALL_MODELS:
        for p in m.profiles:
            # real figures sit just below the number in the name (read as GiB); estimates lower still
            assert p.memory_bytes <= mig.parse_profile_name(p.name).nominal_gb * GIB
            assert (
                p.max_count
                == {"1g": 7, "1g+me": 1, "1g.2x": 4, "2g": 3, "3g": 2, "4g": 1, "7g": 1}[
                    _shape(m, p.name)
                ]
            )
            c, w, starts = REFERENCE_RULES[_shape(m, p.name)]
            assert (p.compute_slices, p.memory_slots, set(p.placements)) == (c, w, starts)


def test_estimated_memory_is_below_measured_ratio_everywhere() -> None:
    # k-slot estimate = k x 1-slot figure; on the measured tables that is never above reality
    for m in (mig.A100_40GB, mig.A100_80GB, mig.H100_80GB):
        one = next(p for p in m.profiles if p.memory_slots == 1).memory_bytes
        for p in m.profiles:
            assert one * p.memory_slots <= p.memory_bytes


def test_with_memory_overrides_table() -> None:
    m = mig.H200_141GB.with_memory({"3g.71gb": 70 * GIB})
    assert m.profile("3g.71gb").memory_bytes == 70 * GIB and m.profile("3g.71gb").memory_measured
    assert m.profile("1g.18gb").memory_bytes == mig.H200_141GB.profile("1g.18gb").memory_bytes
    assert mig.H200_141GB.profile("3g.71gb").memory_bytes != 70 * GIB  # original untouched
    assert mig.H100_80GB.with_memory({}) is mig.H100_80GB


@pytest.mark.parametrize(
    "product, model",
    [
        ("NVIDIA-A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA-A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA-A100-80GB-PCIe", "A100-80GB"),
        ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-40GB"),
        ("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb+me", "A100-80GB"),
        ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
        ("NVIDIA-H100-80GB-HBM3-MIG-3g.40gb", "H100-80GB"),
        ("NVIDIA-H100-80GB-HBM3-SHARED", "H100-80GB"),
        ("NVIDIA-H100-PCIe", "H100-80GB"),
        ("NVIDIA-H100-NVL", "H100-94GB"),
        ("NVIDIA-H100-NVL-MIG-1g.12gb", "H100-94GB"),
        ("NVIDIA-H200", "H200-141GB"),
        ("NVIDIA-H200-NVL", "H200-141GB"),
        ("NVIDIA-H200-MIG-INVALID", "H200-141GB"),
        ("NVIDIA-B200", "B200"),
        ("NVIDIA-B200-MIG-1g.23gb", "B200"),
    ],
)
def test_model_for_product(product: str, model: str) -> None:
    m = mig.model_for_product(product)
    assert m is not None and m.name == model


@pytest.mark.parametrize(
    "product",
    [
        "NVIDIA-L4",
        "NVIDIA-GB200",
        "NVIDIA-GH200-480GB",
        "NVIDIA-A10",
        "NVIDIA-A100X",
        "",
        "Tesla-T4-SHARED",
    ],
)
def test_unknown_products_have_no_table(product: str) -> None:
    assert mig.model_for_product(product) is None


# --------------------------------------------------------------------------------------------- rules


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.name)
def test_every_listed_geometry_is_valid(model: mig.MigModel) -> None:
    named = mig.named_geometries(model)
    assert set(named) >= {"all-balanced"} and len(named) == 8
    me = next(p.name for p in model.profiles if p.media_extensions)
    assert named["all-" + me.replace("+", ".")] == ((me, 1),)
    for name, g in named.items():
        assert mig.is_valid_geometry(model, g), name
        assert reference_valid(model, Counter(dict(g))), name
    for fam in mig.UNIFORM_FAMILIES:
        g = mig.uniform_geometry(model, fam)
        assert g and reference_valid(model, Counter(dict(g))), fam
    for g in mig.enumerate_geometries(model, include_media_extensions=True, maximal_only=False):
        pl = mig.place(model, g)
        assert pl is not None and mig.placement_is_valid(model, pl)
        assert Counter(n for n, _ in pl) == Counter(dict(g))
        assert reference_valid(model, Counter(dict(g)))


def test_balanced_matches_reference() -> None:
    assert mig.A100_40GB.balanced == mig.geometry({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})
    assert mig.H100_80GB.balanced == mig.geometry({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})
    assert mig.A100_80GB.balanced == mig.H100_80GB.balanced
    assert mig.H200_141GB.balanced == mig.geometry({"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1})
    assert mig.B200.balanced == mig.geometry({"1g.23gb": 2, "2g.45gb": 1, "3g.90gb": 1})


@pytest.mark.parametrize(
    "mix",
    [
        {"4g.40gb": 2},
        {"7g.80gb": 1, "1g.10gb": 1},
        {"3g.40gb": 3},
        {"1g.10gb": 8},
        {"1g.10gb+me": 2},
        {"2g.20gb": 4},
        {"4g.40gb": 1, "3g.40gb": 1, "1g.10gb": 1},
        {"3g.40gb": 2, "1g.10gb": 1},
        {"1g.20gb": 5},
        {"2g.20gb": 3, "1g.20gb": 1, "1g.10gb": 1},
    ],
)
def test_invalid_mixes_rejected(mix: dict[str, int]) -> None:
    assert not mig.is_valid_geometry(mig.H100_80GB, mix)
    assert mig.place(mig.H100_80GB, mix) is None


@pytest.mark.parametrize(
    "mix",
    [
        {"4g.40gb": 1, "3g.40gb": 1},
        {"3g.40gb": 2},
        {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2},
        {"2g.20gb": 3, "1g.10gb": 1},
        {"1g.10gb": 7},
        {"1g.20gb": 4},
        {"1g.10gb+me": 1, "1g.10gb": 6},
        {"4g.40gb": 1, "2g.20gb": 1, "1g.10gb": 1},
    ],
)
def test_valid_mixes_accepted(mix: dict[str, int]) -> None:
    assert mig.is_valid_geometry(mig.H100_80GB, mix)


def test_max_uniform_count() -> None:
    assert mig.max_uniform_count(mig.A100_40GB, "1g.10gb") == 4
    assert mig.max_uniform_count(mig.H100_80GB, "1g.10gb") == 7
    assert mig.max_uniform_count(mig.H100_80GB, "1g.10gb+me") == 1
    assert mig.max_uniform_count(mig.H100_80GB, "3g.40gb") == 2


def test_explicit_placements() -> None:
    m = mig.H100_80GB
    assert not mig.placement_is_valid(m, [("2g.20gb", 6)])  # 2g cannot start at 6
    assert not mig.placement_is_valid(m, [("3g.40gb", 2)])
    assert not mig.placement_is_valid(m, [("4g.40gb", 4)])
    assert not mig.placement_is_valid(m, [("1g.10gb", 7)])
    assert not mig.placement_is_valid(m, [("3g.40gb", 0), ("1g.10gb", 3)])  # overlap
    assert mig.placement_is_valid(
        m, [("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)]
    )
    # reference: one 3g.40gb (at slot 0) leaves room for only 3 of the 7 1g.10gb
    assert mig.place(m, {"1g.10gb": 3}, pinned=[("3g.40gb", 0)]) is not None
    assert mig.place(m, {"1g.10gb": 4}, pinned=[("3g.40gb", 0)]) is None
    assert mig.place(m, {"1g.10gb": 4}, pinned=[("3g.40gb", 4)]) is not None
    with pytest.raises(KeyError):
        mig.place(m, {"1g.5gb": 1})


def test_place_agrees_with_reference_on_every_multiset() -> None:
    m = mig.H100_80GB
    names = [p.name for p in m.profiles if not p.media_extensions]
    ranges = [range(m.profile(n).max_count + 1) for n in names]
    n_valid = 0
    for ks in itertools.product(*ranges):
        counts = Counter({n: k for n, k in zip(names, ks) if k})
        ours = mig.is_valid_geometry(m, counts)
        assert ours == reference_valid(m, counts), dict(counts)
        n_valid += ours
    all_valid = set(mig.enumerate_geometries(m, maximal_only=False))
    assert len(all_valid) == n_valid


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.name)
def test_maximal_geometries(model: mig.MigModel) -> None:
    maximal = mig.enumerate_geometries(model)
    names = [p.name for p in model.profiles if not p.media_extensions]
    for g in maximal:
        for n in names:
            assert not mig.is_valid_geometry(model, Counter(dict(g)) + Counter({n: 1})), (g, n)
    # every valid geometry fits inside some maximal one
    for g in mig.enumerate_geometries(model, maximal_only=False):
        assert any(mig.geometry_is_subset(g, big) for big in maximal), g
    assert model.balanced in maximal
    assert mig.uniform_geometry(model, "all-1g") in maximal
    assert mig.uniform_geometry(model, "all-3g") in maximal
    assert mig.uniform_geometry(model, "all-2g") not in maximal  # a 1g fits at slot 6


def test_enumerate_with_pinned_instances_keeps_them() -> None:
    m = mig.H100_80GB
    out = mig.enumerate_geometries(m, pinned=[("3g.40gb", 4)])
    assert out and all(dict(g).get("3g.40gb", 0) >= 1 for g in out)
    assert mig.geometry({"7g.80gb": 1}) not in out
    assert mig.geometry({"4g.40gb": 1, "3g.40gb": 1}) in out
    with pytest.raises(ValueError):
        mig.enumerate_geometries(m, pinned=[("3g.40gb", 0), ("4g.40gb", 0)])


def test_config_names_round_trip() -> None:
    m = mig.H100_80GB
    assert mig.geometry_for_config_name(m, "all-balanced") == m.balanced
    assert mig.geometry_for_config_name(m, "all-1g.10gb") == mig.geometry({"1g.10gb": 7})
    assert mig.geometry_for_config_name(m, "all-1g.10gb.me") == mig.geometry({"1g.10gb+me": 1})
    g = mig.geometry({"1g.10gb+me": 1, "1g.10gb": 2, "4g.40gb": 1})
    name = "vramsched-" + mig.geometry_descriptor(g)
    assert "+" not in name
    assert mig.geometry_for_config_name(m, name) == g
    assert mig.geometry_for_config_name(m, "vramsched-mixed-0123456789") is None
    assert mig.geometry_for_config_name(m, "custom-config") is None
    assert mig.geometry_for_config_name(m, "vramsched-4g.40gbx2") is None  # invalid geometry


# --------------------------------------------------------------------------------------------- inference


def _check_layouts(model: mig.MigModel, layouts: list[list[str]], counts: dict[str, int]) -> None:
    assert all(mig.is_valid_geometry(model, ls) for ls in layouts)
    total = Counter()
    for ls in layouts:
        total.update(ls)
    assert total == Counter(counts)


def test_infer_even_split() -> None:
    m = mig.H100_80GB
    counts = {"1g.10gb": 16, "2g.20gb": 8, "3g.40gb": 8}
    layouts = mig.infer_gpu_layouts(m, 8, counts)
    assert len(layouts) == 8
    assert all(Counter(ls) == Counter({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}) for ls in layouts)
    _check_layouts(m, layouts, counts)


def test_infer_uneven_split() -> None:
    m = mig.A100_80GB
    counts = {"7g.80gb": 1, "1g.10gb": 9, "3g.40gb": 3, "2g.20gb": 1}
    layouts = mig.infer_gpu_layouts(m, 4, counts)
    _check_layouts(m, layouts, counts)


def test_infer_respects_required_slices() -> None:
    m = mig.H100_80GB
    counts = {"7g.80gb": 1, "1g.10gb": 7}
    layouts = mig.infer_gpu_layouts(m, 2, counts, required={0: {"1g.10gb": 1}})
    assert Counter(layouts[0]) == Counter({"1g.10gb": 7}) and layouts[1] == ["7g.80gb"]
    layouts = mig.infer_gpu_layouts(m, 2, counts, required={1: {"1g.10gb": 2}})
    assert layouts[0] == ["7g.80gb"]


def test_infer_allows_empty_gpus() -> None:
    layouts = mig.infer_gpu_layouts(mig.H100_80GB, 3, {"3g.40gb": 2})
    _check_layouts(mig.H100_80GB, layouts, {"3g.40gb": 2})
    assert len(layouts) == 3


@pytest.mark.parametrize(
    "gpus, counts",
    [
        (1, {"4g.40gb": 2}),
        (2, {"7g.80gb": 3}),
        (2, {"1g.10gb": 15}),
        (0, {"1g.10gb": 1}),
        (1, {"1g.5gb": 1}),
    ],
)
def test_infer_impossible_raises(gpus: int, counts: dict[str, int]) -> None:
    with pytest.raises(mig.LayoutInferenceError):
        mig.infer_gpu_layouts(mig.H100_80GB, gpus, counts)


@pytest.mark.parametrize(
    ("product", "profile", "slots"),
    [
        ("NVIDIA-A100-SXM4-80GB", "3g.40gb", 2),
        ("NVIDIA-Unknown-GPU", "2g.20gb", 3),
        ("NVIDIA-Unknown-GPU", "1x.5gb", 7),  # no leading "<n>g": one compute slice
        ("NVIDIA-Unknown-GPU", "²g.10gb", 7),  # "²" is a digit, not a number int() reads
    ],
)
def test_slices_per_gpu_for_numbering_never_raise(product: str, profile: str, slots: int) -> None:
    from extender.inventory import _mig_gpu_slots

    assert _mig_gpu_slots(product, profile) == slots
