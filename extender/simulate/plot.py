"""Side-by-side bar charts of the simulator's metrics (matplotlib, headless)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from extender.simulate.result import PolicyResult

__all__ = ["plot_results", "plot_free_curve", "plot_budget_curves"]

_PANELS = [
    ("placed", "pods placed", 1),
    ("allocatedMemoryBytes", "GPU memory allocated (GiB)", 1024**3),
    ("gpusInUse", "GPUs in use", 1),
    ("gpusFree", "GPUs fully free", 1),
    ("fragmentationRate", "fragmentation (share of free VRAM)", 1),
    ("overcommittedGpus", "GPUs with VRAM overcommitted", 1),
    ("failed", "pods failed", 1),
    ("moves", "pods moved (repacking)", 1),
]
_OURS = ("planner", "planner+repack", "vramsched")


def plot_results(results: Sequence[PolicyResult], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    names = [r.policy for r in results]
    colors = ["#2b6cb0" if n in _OURS else "#a0aec0" for n in names]
    for ax, (key, label, scale) in zip(axes.flat, _PANELS):
        values = [getattr(r, key) / scale for r in results]
        bars = ax.bar(names, values, color=colors)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        for b, v in zip(bars, values):
            ax.annotate(
                f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}",
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    fig.suptitle(title or "vramsched simulate", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_free_curve(
    curve: dict, path: str | Path, title: str = "", baseline: str = "best-fit"
) -> None:
    """GPUs fully free along a replay, each policy minus `baseline`: where one policy leaves more
    whole GPUs free and where it stops doing so (the end of a replay hides the crossing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = curve["arrivals"]
    base = curve["gpusFree"][baseline]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ours = ("planner", "vramsched")
    # ours last and translucent, so a baseline that coincides with it (FGD) still shows
    for name in sorted(curve["gpusFree"], key=lambda n: n in ours):
        if name == baseline:
            continue
        ys = curve["gpusFree"][name]
        ax.plot(
            x,
            [y - b for y, b in zip(ys, base)],
            label=name,
            lw=3.5 if name in ours else 1.3,
            alpha=0.55 if name in ours else 1.0,
        )
    ax.axhline(0, color="#4a5568", lw=0.8)
    ax.set_xlabel("pods arrived")
    ax.set_ylabel(f"GPUs fully free minus {baseline}'s")
    ax.legend(fontsize=8)
    ax.set_title(title or "GPUs fully free while every pod fits", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_budget_curves(
    runs: dict[str, dict], path: str | Path, title: str = "", cols: int = 4
) -> None:
    """GPU memory allocated (% of capacity) by `planner+repack` against its move budget, one
    panel per pod list: FGD's allocation and the bounds as horizontal lines.

    `runs` maps a panel title to {"budgetCurve": [{"moveBudget", "allocatedPct", "moves",
    "boundPct" (optional: `bound_report.bound_within_budget`)}...],
    "fgdPct": float | None, "bound": `bound_report.allocation_bounds` | None}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(runs))
    cols = min(cols, n)
    rows = -(-n // cols)
    # the legend under the panels: one row under many, a row per entry (at most 5) under few
    ncol = 3 if cols >= 3 else 1
    legend = 0.2 * -(-5 // ncol) + 0.15  # inches
    height = 3.4 * rows + legend
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, height), squeeze=False)
    for ax, (name, run) in zip(axes.flat, runs.items()):
        curve = run["budgetCurve"]
        x = [100 * c["moveBudget"] for c in curve]
        y = [c["allocatedPct"] for c in curve]
        ax.plot(x, y, "o-", color="#2b6cb0", lw=2, label="planner+repack")
        for xi, yi, c in zip(x, y, curve):
            ax.annotate(
                f"{c['moves']}",
                (xi, yi),
                textcoords="offset points",
                xytext=(0, 5),
                ha="center",
                fontsize=7,
                color="#2b6cb0",
            )
        if run.get("fgdPct") is not None:
            ax.axhline(run["fgdPct"], color="#718096", lw=1.2, label="FGD")
            ax.axhline(run["fgdPct"] + 3, color="#718096", lw=0.8, ls=":", label="FGD + 3 points")
        within = [(xi, c["boundPct"]) for xi, c in zip(x, curve) if "boundPct" in c]
        if within:
            ax.plot(
                [p[0] for p in within],
                [p[1] for p in within],
                "s:",
                color="#c53030",
                lw=1.2,
                ms=3,
                label="bound within the budget, from the same failure",
            )
        b = run.get("bound") or {}
        first = b.get("fromFirstFailure")
        if first:
            ax.axhline(
                first["pct"],
                color="#c53030",
                lw=1.2,
                ls="--",
                label="bound: placing like the planner until a pod fits nowhere",
            )
        ax.set_title(name or "planner+repack by move budget", fontsize=9)
        ax.set_xlabel("move budget (% of pods placed)", fontsize=8)
        ax.set_ylabel("GPU memory allocated (%)", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    heading = (title + ": " if title else "") + (
        "GPU memory allocated against the move budget (labels: pods moved)"
    )
    fig.suptitle("\n".join(textwrap.wrap(heading, 50 * cols)), fontsize=10)
    fig.tight_layout(rect=(0, legend / height, 1, 0.93 if cols == 1 else 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
