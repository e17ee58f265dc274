"""MIG knowledge: profile tables, placement rules, geometries (pure, no I/O).

A *geometry* is the multiset of MIG profiles carved out of one physical GPU. Whether a
multiset is possible is decided by the placement rules of ``nvidia-smi mig -lgipp``: the
GPU has 8 memory slots and 7 compute slices, each profile may only start at listed slots
and covers a fixed number of them, and placed instances must not overlap. Everything
here works on those rules so the planner and the inventory agree on what is valid.

Memory figures are bytes. Where a real ``nvidia-smi mig -lgip`` figure is known it is
used (``memory_measured=True``); otherwise the figure is a deliberately conservative
estimate (see ``_ESTIMATE_RATIO``) and the node label ``nvidia.com/mig-<p>.memory``
should override it (``MigModel.with_memory``).

Why one module of about 700 lines: the per-GPU profile tables, the slot placement rules and the
geometry enumeration are one piece of knowledge (each table is built by the rules, each rule
reads the tables), and every caller needs all three; split apart they would only import each
other's private structures.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

GIB = 1 << 30
MIB = 1 << 20
MEMORY_SLOTS = 8
COMPUTE_SLICES = 7

# A geometry: canonical, hashable multiset of profile names -> ((name, count), ...), sorted by name.
Geometry = tuple[tuple[str, int], ...]
# A placement: ((profile name, start memory slot), ...), sorted by start.
Placement = tuple[tuple[str, int], ...]

_PROFILE_RE = re.compile(r"^(?P<g>\d+)g\.(?P<gb>\d+)gb(?:\+(?P<attr>[a-z]+))?$", re.ASCII)
_RESOURCE_PREFIX = "nvidia.com/mig-"


@dataclass(frozen=True)
class ProfileName:
    """The parts of a profile name such as ``1g.10gb+me``."""

    compute_slices: int
    nominal_gb: int
    attribute: str | None  # "me" (media extensions), "gfx", ... or None

    def __str__(self) -> str:
        base = f"{self.compute_slices}g.{self.nominal_gb}gb"
        return f"{base}+{self.attribute}" if self.attribute else base


def parse_profile_name(name: str) -> ProfileName:
    """Parse ``<g>g.<mem>gb[+attr]``; raise ValueError on anything else."""
    m = _PROFILE_RE.match(name.strip())
    if not m:
        raise ValueError(
            f"not a MIG profile name: {name!r} (expected like '1g.10gb' or '1g.10gb+me')"
        )
    g = int(m["g"])
    if not 1 <= g <= COMPUTE_SLICES:
        raise ValueError(
            f"MIG profile {name!r}: compute slices must be 1..{COMPUTE_SLICES}, got {g}"
        )
    return ProfileName(g, int(m["gb"]), m["attr"])


def resource_name(profile: str) -> str:
    """Extended-resource name of a profile under the mixed strategy (``+`` becomes ``.``)."""
    parse_profile_name(profile)
    return _RESOURCE_PREFIX + profile.replace("+", ".")


def profile_from_resource(resource: str) -> str | None:
    """Inverse of ``resource_name``: ``nvidia.com/mig-1g.10gb.me`` -> ``1g.10gb+me``; None if not MIG."""
    if not resource.startswith(_RESOURCE_PREFIX):
        return None
    rest = resource[len(_RESOURCE_PREFIX) :]
    m = re.match(r"^(\d+g\.\d+gb)(?:\.([a-z]+))?$", rest)
    if not m:
        return None
    return f"{m[1]}+{m[2]}" if m[2] else m[1]


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU model."""

    name: str
    compute_slices: int
    memory_slots: int  # width on the 8-slot memory axis
    placements: tuple[int, ...]  # allowed start slots
    memory_bytes: int
    max_count: int
    memory_measured: bool  # True: nvidia-smi / label figure; False: conservative estimate

    @property
    def resource(self) -> str:
        return resource_name(self.name)

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me")


@dataclass(frozen=True)
class MigModel:
    """Profile table of one MIG-capable GPU model."""

    name: str
    profiles: tuple[MigProfile, ...]
    balanced: Geometry
    notes: str = ""
    _by_name: dict[str, MigProfile] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        self._by_name.update({p.name: p for p in self.profiles})

    def profile(self, name: str) -> MigProfile:
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(p.name for p in self.profiles)
            raise KeyError(f"{self.name} has no MIG profile {name!r} (known: {known})") from None

    def has_profile(self, name: str) -> bool:
        return name in self._by_name

    def with_memory(self, memory_bytes: Mapping[str, int]) -> MigModel:
        """Copy with measured memory (e.g. from ``nvidia.com/mig-<p>.memory`` labels) overriding the table."""
        changed = False
        profiles = []
        for p in self.profiles:
            b = memory_bytes.get(p.name)
            if b is not None and (b != p.memory_bytes or not p.memory_measured):
                profiles.append(replace(p, memory_bytes=int(b), memory_measured=True))
                changed = True
            else:
                profiles.append(p)
        if not changed:
            return self
        return MigModel(self.name, tuple(profiles), self.balanced, self.notes)

    @property
    def largest_memory_bytes(self) -> int:
        return max(p.memory_bytes for p in self.profiles)


# ---------------------------------------------------------------------------------------------
# Geometry helpers


def geometry(counts: Mapping[str, int] | Iterable[str]) -> Geometry:
    """Canonical geometry from a name->count mapping or an iterable of profile names."""
    c = Counter(counts) if not isinstance(counts, Mapping) else Counter(dict(counts))
    return tuple(sorted((n, int(k)) for n, k in c.items() if k > 0))


def geometry_counts(g: Geometry) -> dict[str, int]:
    return dict(g)


def geometry_size(g: Geometry) -> int:
    return sum(k for _, k in g)


def format_geometry(g: Geometry, model: MigModel | None = None) -> str:
    """Human form, biggest profile first: ``3g.40gb + 2g.20gb + 2x1g.10gb``; ``(empty)`` if none."""
    if not g:
        return "(empty)"

    def key(item: tuple[str, int]) -> tuple[int, int, str]:
        pn = parse_profile_name(item[0])
        return (-pn.compute_slices, -pn.nominal_gb, item[0])

    return " + ".join(n if k == 1 else f"{k}x{n}" for n, k in sorted(g, key=key))


def geometry_is_subset(small: Geometry, big: Geometry) -> bool:
    b = dict(big)
    return all(b.get(n, 0) >= k for n, k in small)


# ---------------------------------------------------------------------------------------------
# Placement rules


def _limits_ok(model: MigModel, counts: Mapping[str, int]) -> bool:
    compute = 0
    for name, k in counts.items():
        p = model.profile(name)
        if k > p.max_count:
            return False
        compute += p.compute_slices * k
    return compute <= COMPUTE_SLICES


def place(
    model: MigModel,
    profiles: Mapping[str, int] | Iterable[str] | Geometry,
    pinned: Iterable[tuple[str, int]] = (),
) -> Placement | None:
    """A non-overlapping placement of ``profiles`` on one GPU, or None if impossible.

    ``pinned`` instances (profile, start) are already in place (e.g. occupied slices) and are
    part of the result; ``profiles`` are the *additional* instances to place. Unknown profile
    names raise KeyError.
    """
    if isinstance(profiles, tuple) and profiles and isinstance(profiles[0], tuple):
        extra = Counter(dict(profiles))  # a Geometry
    elif isinstance(profiles, Mapping):
        extra = Counter(dict(profiles))
    else:
        extra = Counter(profiles)
    extra = Counter({n: k for n, k in extra.items() if k > 0})
    pinned = list(pinned)
    total = Counter(extra)
    for n, _ in pinned:
        total[n] += 1
    if not _limits_ok(model, total):
        return None
    used = [False] * MEMORY_SLOTS
    for n, s in pinned:
        p = model.profile(n)
        if s not in p.placements:
            return None
        for i in range(s, s + p.memory_slots):
            if used[i]:
                return None
            used[i] = True
    # Widest / most constrained first keeps the search tiny.
    todo = sorted(
        (model.profile(n) for n, k in extra.items() for _ in range(k)),
        key=lambda p: (-p.memory_slots, len(p.placements), p.name),
    )
    chosen: list[tuple[str, int]] = []

    def rec(i: int, min_start: int) -> bool:
        if i == len(todo):
            return True
        p = todo[i]
        # identical consecutive profiles: enforce increasing starts to skip symmetric branches
        for s in p.placements:
            if s < min_start:
                continue
            if any(used[j] for j in range(s, s + p.memory_slots)):
                continue
            for j in range(s, s + p.memory_slots):
                used[j] = True
            chosen.append((p.name, s))
            nxt = todo[i + 1] if i + 1 < len(todo) else None
            if rec(i + 1, s + 1 if nxt is not None and nxt.name == p.name else 0):
                return True
            chosen.pop()
            for j in range(s, s + p.memory_slots):
                used[j] = False
        return False

    if not rec(0, 0):
        return None
    return tuple(sorted(list(pinned) + chosen, key=lambda x: (x[1], x[0])))


def is_valid_geometry(model: MigModel, g: Geometry | Mapping[str, int] | Iterable[str]) -> bool:
    """True if the multiset can be carved out of one GPU of ``model``."""
    try:
        return place(model, g) is not None
    except KeyError:
        return False


def placement_is_valid(model: MigModel, placement: Iterable[tuple[str, int]]) -> bool:
    """Check an explicit placement (profile, start) against the rules."""
    try:
        return place(model, {}, pinned=placement) is not None
    except KeyError:
        return False


def _all_tilings(
    model: MigModel, names: tuple[str, ...], pinned: tuple[tuple[str, int], ...]
) -> set[Geometry]:
    """Every multiset reachable by adding non-overlapping instances of ``names`` around ``pinned``."""
    profs = [model.profile(n) for n in names]
    used = [False] * MEMORY_SLOTS
    base: Counter[str] = Counter()
    for n, s in pinned:
        p = model.profile(n)
        for j in range(s, s + p.memory_slots):
            used[j] = True
        base[n] += 1
    out: set[Geometry] = set()
    cur = Counter(base)

    def rec(slot: int) -> None:
        if slot == MEMORY_SLOTS:
            if _limits_ok(model, cur):
                out.add(geometry(cur))
            return
        rec(slot + 1)  # leave this slot empty (or it is taken)
        if used[slot]:
            return
        for p in profs:
            if slot not in p.placements or slot + p.memory_slots > MEMORY_SLOTS:
                continue
            if any(used[j] for j in range(slot, slot + p.memory_slots)):
                continue
            for j in range(slot, slot + p.memory_slots):
                used[j] = True
            cur[p.name] += 1
            rec(slot + p.memory_slots)
            cur[p.name] -= 1
            for j in range(slot, slot + p.memory_slots):
                used[j] = False

    rec(0)
    return out


@lru_cache(maxsize=256)
def _enumerate_cached(
    model: MigModel,
    pinned: tuple[tuple[str, int], ...],
    include_media_extensions: bool,
    maximal_only: bool,
) -> tuple[Geometry, ...]:
    names = tuple(
        p.name for p in model.profiles if include_media_extensions or not p.media_extensions
    )
    valid = _all_tilings(model, names, pinned)
    if maximal_only:
        valid = {
            g
            for g in valid
            if not any(geometry(Counter(dict(g)) + Counter({n: 1})) in valid for n in names)
        }
    return tuple(sorted(valid, key=lambda g: (-geometry_size(g), g)))


def enumerate_geometries(
    model: MigModel,
    *,
    pinned: Iterable[tuple[str, int]] = (),
    include_media_extensions: bool = False,
    maximal_only: bool = True,
) -> list[Geometry]:
    """All valid geometries of ``model`` (maximal ones by default) that keep ``pinned`` instances.

    Maximal: no further instance of a considered profile can be added. ``+me`` profiles are left
    out unless asked for: they have the same memory and slots as their plain 1g sibling, so for
    packing pods they only multiply the candidates.
    """
    pins = tuple(sorted(pinned, key=lambda x: (x[1], x[0])))
    if pins and place(model, {}, pinned=pins) is None:
        raise ValueError(
            f"{model.name}: pinned instances {pins} overlap or break the placement rules"
        )
    return list(_enumerate_cached(model, pins, include_media_extensions, maximal_only))


def enumerate_geometries_containing(
    model: MigModel, required: Geometry, *, include_media_extensions: bool = False
) -> list[Geometry]:
    """Maximal valid geometries that contain the multiset ``required`` wherever it is placed."""
    me = include_media_extensions or any(model.profile(n).media_extensions for n, _ in required)
    names = tuple(p.name for p in model.profiles if me or not p.media_extensions)
    valid = {g for g in _enumerate_cached(model, (), True, False) if all(n in names for n, _ in g)}
    inside = {g for g in valid if geometry_is_subset(required, g)}
    maximal = {
        g
        for g in inside
        if not any(geometry(Counter(dict(g)) + Counter({n: 1})) in inside for n in names)
    }
    return sorted(maximal, key=lambda g: (-geometry_size(g), g))


# ---------------------------------------------------------------------------------------------
# Profile tables

# Lowest measured ratio of a 1-slot profile's real GiB to the GB in its name (H200: 16.00/18).
# Used only where no real figure is known; k-slot profiles are estimated as k x the 1-slot
# figure, which is below every measured k-slot figure (A100-40GB, A100-80GB, H100-80GB).
_ESTIMATE_RATIO = 0.88

_SHAPES = (
    # (suffix kind, compute slices, memory slots, placements, max count)
    ("1g", 1, 1, (0, 1, 2, 3, 4, 5, 6), 7),
    ("1g+me", 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    ("1g.2x", 1, 2, (0, 2, 4, 6), 4),
    ("2g", 2, 2, (0, 2, 4), 3),
    ("3g", 3, 4, (0, 4), 2),
    ("4g", 4, 4, (0,), 1),
    ("7g", 7, 8, (0,), 1),
)


def _build(
    name: str,
    nominal_gb: dict[str, int],
    measured_gib: dict[str, float],
    notes: str,
) -> MigModel:
    """Build a model from nominal GB per shape and the measured GiB we have.

    nominal_gb keys: "1g", "1g.2x", "2g", "3g", "4g", "7g" -> the GB in the profile name.
    measured_gib keys: profile kinds as above -> GiB from real nvidia-smi output.
    """
    if "1g" in measured_gib:
        per_slot_gib = measured_gib["1g"]
    else:
        per_slot_gib = int(nominal_gb["1g"] * _ESTIMATE_RATIO * 4) / 4  # round down to 0.25 GiB
    profiles = []
    for kind, g, slots, starts, max_count in _SHAPES:
        base_kind = "1g" if kind == "1g+me" else kind
        pname = f"{g}g.{nominal_gb[base_kind]}gb" + ("+me" if kind == "1g+me" else "")
        if base_kind in measured_gib:
            gib, measured = measured_gib[base_kind], True
        else:
            gib, measured = per_slot_gib * slots, False
        profiles.append(MigProfile(pname, g, slots, starts, int(gib * GIB), max_count, measured))
    # all-balanced as in mig-parted config-default.yaml: 2 x 1g + 1 x 2g + 1 x 3g
    balanced = geometry(
        {
            f"1g.{nominal_gb['1g']}gb": 2,
            f"2g.{nominal_gb['2g']}gb": 1,
            f"3g.{nominal_gb['3g']}gb": 1,
        }
    )
    return MigModel(name, tuple(profiles), balanced, notes)


A100_40GB = _build(
    "A100-40GB",
    {"1g": 5, "1g.2x": 10, "2g": 10, "3g": 20, "4g": 20, "7g": 40},
    # reference mig-profiles.md; 1g.10gb uses the 2g.10gb figure (same two memory slots)
    {"1g": 4.75, "2g": 9.75, "1g.2x": 9.75, "3g": 19.62, "4g": 19.62, "7g": 39.50},
    "GiB from nvidia-smi mig -lgip (reference)",
)
A100_80GB = _build(
    "A100-80GB",
    {"1g": 10, "1g.2x": 20, "2g": 20, "3g": 40, "4g": 40, "7g": 80},
    # public nvidia-smi mig -lgip outputs of A100-SXM4-80GB (two independent ones agree)
    {"1g": 9.50, "1g.2x": 19.50, "2g": 19.50, "3g": 39.25, "4g": 39.25, "7g": 79.00},
    "GiB from public nvidia-smi mig -lgip output of A100-SXM4-80GB",
)
H100_80GB = _build(
    "H100-80GB",
    {"1g": 10, "1g.2x": 20, "2g": 20, "3g": 40, "4g": 40, "7g": 80},
    {"1g": 9.75, "1g.2x": 19.62, "2g": 19.62, "3g": 39.50, "4g": 39.50, "7g": 79.25},
    "GiB from nvidia-smi mig -lgip on H100 SXM5 (reference)",
)
H100_94GB = _build(
    "H100-94GB",
    {"1g": 12, "1g.2x": 24, "2g": 24, "3g": 47, "4g": 47, "7g": 94},
    {},
    "no measured figures: conservative estimate; all-balanced by analogy with H100-80GB",
)
H200_141GB = _build(
    "H200-141GB",
    {"1g": 18, "1g.2x": 35, "2g": 35, "3g": 71, "4g": 71, "7g": 141},
    {"1g": 16.00},  # public nvidia-smi / torch reports of 'H200 MIG 1g.18gb': 16.00 GiB
    "1g measured (16.00 GiB); larger profiles estimated as slots x 16 GiB",
)
B200 = _build(
    "B200",
    {"1g": 23, "1g.2x": 45, "2g": 45, "3g": 90, "4g": 90, "7g": 180},
    {},
    "no measured figures: conservative estimate",
)

MODELS: dict[str, MigModel] = {
    m.name: m for m in (A100_40GB, A100_80GB, H100_80GB, H100_94GB, H200_141GB, B200)
}


def model_for_product(product: str) -> MigModel | None:
    """Map a GFD ``nvidia.com/gpu.product`` value to its profile table (None if unknown).

    Accepts the single-strategy ``-MIG-<profile>`` and sharing ``-SHARED`` suffixes.
    """
    p = product.strip().upper().replace(" ", "-").replace("_", "-")
    p = re.sub(r"-SHARED$", "", p)
    p = re.sub(r"-MIG-.*$", "", p)
    tokens = set(p.split("-"))
    if "A100" in tokens:
        if "80GB" in p:
            return A100_80GB
        if "40GB" in p:
            return A100_40GB
        return None
    if "H100" in tokens or "H800" in tokens:
        if "NVL" in tokens or "94GB" in p:
            return H100_94GB
        if "H100" in tokens and (
            "80GB" in p or "PCIE" in tokens or "SXM5" in p or "HBM3" in tokens
        ):
            return H100_80GB
        return None
    if "H200" in tokens:
        return H200_141GB
    if "B200" in tokens:
        return B200
    return None


# ---------------------------------------------------------------------------------------------
# Named geometries


def named_geometries(model: MigModel) -> dict[str, Geometry]:
    """mig-parted style names for ``model``: ``all-<profile>`` at max count, ``all-<1g>.me``, ``all-balanced``."""
    out: dict[str, Geometry] = {}
    for p in model.profiles:
        if p.media_extensions:  # config-default.yaml: "all-1g.10gb.me" is a single 1g.10gb+me
            out[f"all-{p.name.replace('+', '.')}"] = geometry({p.name: 1})
            continue
        out[f"all-{p.name}"] = geometry({p.name: _max_uniform(model, p)})
    out["all-balanced"] = model.balanced
    return out


def max_uniform_count(model: MigModel, profile: str) -> int:
    """How many instances of ``profile`` one GPU holds when it holds nothing else."""
    return _max_uniform(model, model.profile(profile))


def _max_uniform(model: MigModel, p: MigProfile) -> int:
    k = p.max_count
    while k > 0 and not is_valid_geometry(model, {p.name: k}):
        k -= 1
    return k


# Model-independent shape families, so one "uniform geometry" can be applied to a mixed cluster.
UNIFORM_FAMILIES: tuple[str, ...] = (
    "all-1g",
    "all-1g.2x",
    "all-2g",
    "all-3g",
    "all-4g",
    "all-7g",
    "all-balanced",
)
_FAMILY_SHAPE = {"all-1g": 0, "all-1g.2x": 2, "all-2g": 3, "all-3g": 4, "all-4g": 5, "all-7g": 6}


def uniform_geometry(model: MigModel, family: str) -> Geometry:
    """The geometry of ``family`` (see UNIFORM_FAMILIES) on ``model``."""
    if family == "all-balanced":
        return model.balanced
    try:
        idx = _FAMILY_SHAPE[family]
    except KeyError:
        raise ValueError(
            f"unknown uniform geometry {family!r}; known: {', '.join(UNIFORM_FAMILIES)}"
        ) from None
    p = model.profiles[idx]
    return geometry({p.name: _max_uniform(model, p)})


def geometry_for_config_name(model: MigModel, name: str) -> Geometry | None:
    """Decode a ``nvidia.com/mig.config`` value we understand: mig-parted ``all-*`` names and our
    own descriptive ``vramsched-...`` names. None if the name does not say what is on each GPU."""
    named = named_geometries(model)
    if name in named:
        return named[name]
    if name == "all-disabled":
        return None
    if name.startswith("vramsched-") and not name.startswith("vramsched-mixed-"):
        from_desc = parse_geometry_descriptor(model, name[len("vramsched-") :])
        return from_desc
    return None


def geometry_descriptor(g: Geometry) -> str:
    """Label-value-safe text for a geometry: ``1g.10gbx2_2g.20gb_3g.40gb`` (``+me`` -> ``-me``)."""
    if not g:
        return "empty"
    return "_".join((n.replace("+", "-") + (f"x{k}" if k > 1 else "")) for n, k in g)


def parse_geometry_descriptor(model: MigModel, text: str) -> Geometry | None:
    if text == "empty":
        return ()
    counts: dict[str, int] = {}
    for part in text.split("_"):
        m = re.match(r"^(\d+g\.\d+gb(?:-[a-z]+)?)(?:x(\d+))?$", part)
        if not m:
            return None
        pname = m[1].replace("-", "+")
        if not model.has_profile(pname):
            return None
        counts[pname] = counts.get(pname, 0) + int(m[2] or 1)
    g = geometry(counts)
    return g if is_valid_geometry(model, g) else None


# ---------------------------------------------------------------------------------------------
# Mixed-strategy label inference


class LayoutInferenceError(ValueError):
    """Node-level slice counts cannot be split into valid per-GPU geometries."""


def infer_gpu_layouts(
    model: MigModel,
    gpu_count: int,
    profile_counts: Mapping[str, int],
    required: Mapping[int, Mapping[str, int]] | None = None,
) -> list[list[str]]:
    """Split node-level slice counts (mixed-strategy labels) over the node's physical GPUs.

    Returns one list of profile names per GPU (index order), each a valid geometry, together
    using exactly ``profile_counts``. ``required[i]`` lists profiles GPU ``i`` must hold (e.g.
    slices a bound pod is known to use). Prefers identical GPUs when the counts allow it. Raises
    LayoutInferenceError with the reason when no split exists.
    """
    if gpu_count < 0:
        raise LayoutInferenceError(f"gpu count must be >= 0, got {gpu_count}")
    counts = {n: int(k) for n, k in profile_counts.items() if int(k) > 0}
    for n in counts:
        if not model.has_profile(n):
            raise LayoutInferenceError(f"{model.name} has no MIG profile {n!r}")
    if gpu_count == 0:
        if counts:
            raise LayoutInferenceError(
                f"{sum(counts.values())} MIG slices labelled but gpu.count is 0"
            )
        return []
    req = {i: geometry(r) for i, r in (required or {}).items()}
    for i in req:
        if not 0 <= i < gpu_count:
            raise LayoutInferenceError(f"required GPU index {i} outside 0..{gpu_count - 1}")
    names = tuple(sorted(counts))
    target = tuple(counts[n] for n in names)
    cands = [g for g in _enumerate_cached(model, (), True, False) if all(n in counts for n, _ in g)]
    vec = {g: tuple(dict(g).get(n, 0) for n in names) for g in cands}
    # Even split first (identical GPUs), then bigger geometries.
    even = (
        tuple(t // gpu_count for t in target) if all(t % gpu_count == 0 for t in target) else None
    )
    cands.sort(key=lambda g: (vec[g] != even, -geometry_size(g), g))
    failed: set[tuple[int, tuple[int, ...]]] = set()
    chosen: list[Geometry] = []

    def rec(i: int, remaining: tuple[int, ...]) -> bool:
        if i == gpu_count:
            return not any(remaining)
        if (i, remaining) in failed:
            return False
        left = gpu_count - i
        for g in cands:
            v = vec[g]
            if any(a > b for a, b in zip(v, remaining)):
                continue
            if i in req and not geometry_is_subset(req[i], g):
                continue
            rest = tuple(b - a for a, b in zip(v, remaining))
            # prune: the remaining GPUs can hold at most 7 slices each
            if sum(rest) > (left - 1) * COMPUTE_SLICES:
                continue
            chosen.append(g)
            if rec(i + 1, rest):
                return True
            chosen.pop()
        failed.add((i, remaining))
        return False

    if not rec(0, target):
        want = format_geometry(geometry(counts))
        raise LayoutInferenceError(
            f"cannot split {want} over {gpu_count} {model.name} GPU(s) as valid MIG geometries"
            + (
                f" with required slices {dict((i, format_geometry(g)) for i, g in req.items())}"
                if req
                else ""
            )
        )
    return [[n for n, k in g for _ in range(k)] for g in chosen]
