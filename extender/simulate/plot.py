"""Side-by-side bar charts of the simulator's metrics (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from extender.simulate.engine import PolicyResult

__all__ = ["plot_results", "plot_free_curve"]

_PANELS = [
    ("placed", "pods placed", 1),
    ("allocatedMemoryBytes", "GPU memory allocated (GiB)", 1024**3),
    ("gpusInUse", "GPUs in use", 1),
    ("gpusFree", "GPUs fully free", 1),
    ("fragmentationRate", "fragmentation (share of free VRAM)", 1),
    ("overcommittedGpus", "GPUs with VRAM overcommitted", 1),
]


def plot_results(results: Sequence[PolicyResult], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    names = [r.policy for r in results]
    colors = ["#2b6cb0" if n in ("planner", "vramsched") else "#a0aec0" for n in names]
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
