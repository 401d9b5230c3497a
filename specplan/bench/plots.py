"""One figure shared by the reports: per workload, each arm's tokens/s over a baseline against B."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence


def ratio_panels(curves: Mapping[str, Mapping[str, tuple[Sequence[int], Sequence[float]]]], path: Path, *,
                 ylabel: str, title: str | None = None,
                 style: Callable[[str], dict] = lambda arm: {"marker": "o"}, legend_size: int = 7) -> Path:
    """``curves[workload][arm] = (batch sizes, ratios)``: one panel per workload, a line per arm
    (``style(arm)``: matplotlib keyword arguments), log2 B axis, a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(3.8 * len(curves), 3.5), squeeze=False)
    for ax, (workload, arms) in zip(axes[0], curves.items()):
        for arm, (batch_sizes, ratios) in arms.items():
            ax.plot(batch_sizes, ratios, label=arm, **style(arm))
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(workload)
        ax.set_xlabel("B (concurrent requests)")
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=legend_size)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
