"""Side-by-side bar charts of the simulator's metrics (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from extender.simulate.engine import PolicyResult

__all__ = ["plot_results"]

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
            ax.annotate(f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=7)
    fig.suptitle(title or "vramsched simulate", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
