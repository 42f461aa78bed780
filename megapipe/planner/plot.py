"""A picture of the plan: the best predicted throughput for each (data-parallel size d, pipeline depth p)."""

from __future__ import annotations

from pathlib import Path

from megapipe.optional import require

matplotlib = require("matplotlib", "--plot-out")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from megapipe.planner.plan import PlanResult  # noqa: E402


def plot_throughput(result: PlanResult, path: str | Path, title: str = "") -> None:
    """Heat map of samples/s over (d, p), each cell the best fitting candidate there (t = N / (d p))."""
    cells = result.best_by_data_pipeline
    ds = sorted({d for d, _ in cells})
    ps = sorted({p for _, p in cells})
    grid = np.full((len(ps), len(ds)), np.nan)
    for (d, p), estimate in cells.items():
        grid[ps.index(p), ds.index(d)] = estimate.samples_per_second
    figure, axes = plt.subplots(figsize=(1.3 * len(ds) + 3, 0.9 * len(ps) + 2))
    image = axes.imshow(np.ma.masked_invalid(grid), cmap="viridis", origin="lower", aspect="auto")
    brightest = np.nanmax(grid)
    for (d, p), estimate in cells.items():
        candidate = estimate.candidate
        label = f"{estimate.samples_per_second:.3g}\nt={candidate.tensor} b={candidate.micro_batch_size}\n{candidate.schedule}"
        color = "black" if estimate.samples_per_second > 0.6 * brightest else "white"
        axes.text(ds.index(d), ps.index(p), label, ha="center", va="center", fontsize=7, color=color)
    best = result.best.candidate
    axes.add_patch(plt.Rectangle((ds.index(best.data) - 0.5, ps.index(best.pipeline) - 0.5), 1, 1, fill=False,
                                 edgecolor="red", linewidth=2))
    axes.set_xticks(range(len(ds)), [str(d) for d in ds])
    axes.set_yticks(range(len(ps)), [str(p) for p in ps])
    axes.set_xlabel("data-parallel size d")
    axes.set_ylabel("pipeline depth p")
    axes.set_title(title or "predicted throughput (samples/s); empty: nothing fits")
    figure.colorbar(image, ax=axes, label="samples/s")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
