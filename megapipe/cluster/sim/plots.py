"""PNG pictures of simulations: average JCT against load, the JCT CDF, utilisation over time."""

from __future__ import annotations

from pathlib import Path

from megapipe.optional import require

matplotlib = require("matplotlib", "--plots-dir")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_jct_cdf(jcts_by_policy: dict, path: str | Path) -> None:
    """jcts_by_policy: policy -> list of JCTs in seconds."""
    figure, axes = plt.subplots(figsize=(6, 4))
    for policy, jcts in jcts_by_policy.items():
        hours = np.sort(np.asarray(jcts)) / 3600
        axes.plot(hours, np.arange(1, len(hours) + 1) / len(hours), label=policy)
    axes.set_xscale("log")
    axes.set_xlabel("job completion time (h)")
    axes.set_ylabel("fraction of jobs")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_jct_vs_load(curves: dict, path: str | Path) -> None:
    """curves: policy -> list of (jobs per hour, average JCT hours)."""
    figure, axes = plt.subplots(figsize=(6, 4))
    for policy, points in curves.items():
        load, jct = zip(*sorted(points))
        axes.plot(load, jct, marker="o", label=policy)
    axes.set_xlabel("input job rate (jobs/h)")
    axes.set_ylabel("average JCT (h)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_utilisation(rounds: list[tuple], total_workers: int, path: str | Path) -> None:
    """rounds: (start s, end s, busy accelerators) per round."""
    figure, axes = plt.subplots(figsize=(6, 3))
    for start, end, busy in rounds:
        axes.hlines(busy / total_workers, start / 3600, end / 3600)
    axes.set_xlabel("time (h)")
    axes.set_ylabel("busy accelerators")
    axes.set_ylim(0, 1.05)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
