"""Pictures of pipeline timelines in the style of the papers' schedule figures.

One row per rank (rank 0 on top), forward boxes blue and backward boxes green, each
numbered by its microbatch; with interleaving the first chunk is dark and later chunks are
lighter. The grey band behind each row is idle time (the bubble), and the right margin
gives each rank's idle share. Works for simulated and recorded timelines alike. Figures
are built without pyplot, so drawing needs no display and leaves no global state.
"""

from __future__ import annotations

from typing import Optional

from megapipe.optional import require

require("matplotlib", "Pictures of schedules and timelines")

from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from megapipe.schedules.actions import ActionKind
from megapipe.schedules.analysis.simulate import SimulationResult
from megapipe.schedules.analysis.timeline import Event, Timeline

FORWARD_COLOR = "#2f6db5"
BACKWARD_COLOR = "#3a9a4a"
WEIGHT_COLOR = "#e0a030"  # a split backward's BW (its BI is drawn as a backward)
IDLE_COLOR = "#e4e4e4"
STEP_COLOR = "#555555"
_DPI = 150


def chunk_color(base: str, chunk: int, v: int) -> tuple[float, float, float]:
    """``base`` for chunk 0, mixed towards white for later chunks (at most 60% white)."""
    mix = 0.6 * chunk / (v - 1) if v > 1 else 0.0
    return tuple(c + (1 - c) * mix for c in to_rgb(base))


def _layout(timeline: Timeline) -> tuple[int, int]:
    """(p, v) from the timeline's metadata, or inferred from its events."""
    p = timeline.meta.get("p") or max(timeline.ranks) + 1
    stages = [e.action.stage for e in timeline.events if e.action.kind.is_compute]
    v = timeline.meta.get("v") or (max(stages) // p + 1 if stages else 1)
    return p, v


def draw_timeline(timeline: Timeline, path=None, title: Optional[str] = None, time_label: str = "time (s)") -> Figure:
    """Draw ``timeline``; save it as a PNG when ``path`` is given. Returns the figure."""
    p, v = _layout(timeline)
    compute = [e for e in timeline.events if e.is_compute]
    if not compute:
        raise ValueError("the timeline has no compute events to draw")
    t0, t1 = min(e.start for e in compute), max(e.end for e in compute)
    span = float(t1 - t0)
    shortest = min((float(e.end - e.start) for e in compute if e.end > e.start), default=span)
    width = min(max(2.5 + 0.32 * span / shortest, 8.0), 26.0)
    height = 0.55 * p + 1.5
    figure = Figure(figsize=(width, height), dpi=_DPI)  # not pyplot: no global state, renders with Agg
    axes = figure.subplots()
    pixels_per_unit = 0.8 * width * _DPI / span
    idle = timeline.idle_fraction(window=(t0, t1))
    for rank in range(p):
        axes.broken_barh([(0, span)], (rank - 0.4, 0.8), color=IDLE_COLOR, zorder=0)
        if rank in idle:
            axes.text(span * 1.01, rank, f"idle {float(idle[rank]):.0%}", va="center", ha="left", fontsize=8)
    for event in compute:
        _draw_event(axes, event, float(event.start - t0), p, v, pixels_per_unit)
    axes.set_xlim(0, span)
    axes.set_ylim(p - 0.5, -0.5)
    axes.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    axes.set_xlabel(time_label)
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    axes.tick_params(axis="y", length=0)
    axes.set_title(title or _default_title(timeline, idle), loc="left", fontsize=11)
    split = any(event.action.kind is ActionKind.BW for event in compute)
    figure.legend(handles=_legend(v, split), loc="lower center", ncol=2 * v + 2, frameon=False, fontsize=8)
    figure.tight_layout(rect=(0, 0.35 / height, 1, 1))
    if path is not None:
        figure.savefig(path, dpi=_DPI)
    return figure


def draw_simulation(result: SimulationResult, path=None) -> Figure:
    """Draw a simulated schedule with its bubble, makespan and peak activations in the title."""
    schedule = result.schedule
    title = (f"{schedule.name}: p={schedule.p}, m={schedule.m}" + (f", v={schedule.v}" if schedule.v > 1 else "")
             + f"  |  bubble {float(result.bubble_fraction):.1%}, makespan {float(result.makespan):g}, "
             f"peak activations {float(max(result.peak_activations)):g} stages")
    return draw_timeline(result.timeline, path, title=title, time_label="time (one stage's forward = 1)")


def _draw_event(axes, event: Event, start: float, p: int, v: int, pixels_per_unit: float) -> None:
    duration = float(event.end - event.start)
    action = event.action
    if action.kind is ActionKind.STEP:
        axes.plot([start, start], [event.rank - 0.45, event.rank + 0.45], color=STEP_COLOR, linewidth=1.5, zorder=3,
                  clip_on=False)
        if duration > 0:
            axes.broken_barh([(start, duration)], (event.rank - 0.4, 0.8), color=STEP_COLOR, zorder=2)
        return
    base = {ActionKind.F: FORWARD_COLOR, ActionKind.BW: WEIGHT_COLOR}.get(action.kind, BACKWARD_COLOR)
    color = chunk_color(base, action.stage // p, v)
    axes.broken_barh([(start, duration)], (event.rank - 0.4, 0.8), facecolor=color, edgecolor="white",
                     linewidth=0.8, zorder=2)
    label = str(action.microbatch)
    fontsize = min(9.0, duration * pixels_per_unit * 0.85 * 72 / (_DPI * 0.62 * len(label)))
    if fontsize >= 4.5:
        dark = sum(color) / 3 < 0.6
        axes.text(start + duration / 2, event.rank, label, ha="center", va="center", fontsize=fontsize,
                  color="white" if dark else "black", zorder=4)


def _legend(v: int, split: bool = False) -> list[Patch]:
    """``split``: the backward is split, drawn as input gradients (BI) and weight gradients (BW)."""
    handles = []
    kinds = [("forward", FORWARD_COLOR)]
    kinds += [("input gradients", BACKWARD_COLOR), ("weight gradients", WEIGHT_COLOR)] if split else [
        ("backward", BACKWARD_COLOR)]
    for name, base in kinds:
        for chunk in range(v):
            label = name if v == 1 else f"{name}, chunk {chunk}"
            handles.append(Patch(facecolor=chunk_color(base, chunk, v), label=label))
    handles.append(Patch(facecolor=IDLE_COLOR, label="idle (bubble)"))
    handles.append(Patch(facecolor=STEP_COLOR, label="optimizer step"))
    return handles


def _default_title(timeline: Timeline, idle: dict) -> str:
    name = timeline.meta.get("schedule", "recorded run")
    bubble = sum(float(f) for f in idle.values()) / max(len(idle), 1)
    return f"{name}  |  idle {bubble:.1%} of the run"
