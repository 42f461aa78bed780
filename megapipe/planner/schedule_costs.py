"""The planner's reading of the schedule descriptors (``schedules/catalog``): which schedules it
plans, and their batch time, bubble, in-flight activations and weight versions.

Each schedule's closed forms, and the seed 002 Table 7.1 rows and tests that justify them, live
in its descriptor, next to its generator; this module only reads them. The planner plans the
schedules that have closed forms, where they hold (``ScheduleDescriptor.planned_sizes``), and
refuses those marked ``simulate`` (V-Half, V-Min: their end bubble has no closed form; the
simulator gives it per p). ``auto`` (the schedule search) is marked ``search``: ``searched`` runs
the search for the ranks' times (BI and BW half the backward each) within 1F1B's memory (p
microbatches per rank) and reads the batch time and each rank's peak off its simulation; the
planner searches one-chunk layouts of up to ``SEARCHED_PASSES`` passes per rank (beyond that it
leaves ``auto`` out), on its ``SEARCHED_LAYOUTS`` fastest layouts. A layout with
``--overlap-moe-expert-parallel-comm`` is simulated too (``overlapped_time``): its pairs hide expert
all-to-alls as the simulator charges them, and its lists hold other microbatches in flight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Schedule
from megapipe.schedules.catalog import (DESCRIPTORS, SEARCHED as SEARCHED_SCHEDULE, build_schedule,
                                            overlapped_schedule, schedule_descriptor)
from megapipe.schedules.catalog.descriptor import ClosedForms, ScheduleDescriptor
from megapipe.layout.placement import Placement

SEARCHED = SEARCHED_SCHEDULE.name  # the schedule search, which the planner runs on its fastest layouts only (plan.py)
SEARCHED_PASSES = 96  # 3 m v: the planner runs the search for up to 32 microbatches on one chunk
SEARCHED_LAYOUTS = 8
_PLANNED = [d for d in DESCRIPTORS if d.closed_forms is not None]
FLUSHING = tuple(d.name for d in _PLANNED if d.flushes) + (SEARCHED,)  # the planned schedules with flushes
SCHEDULES = FLUSHING + tuple(d.name for d in _PLANNED if not d.flushes)  # every schedule the planner plans


@dataclass(frozen=True)
class Searched:
    """What the schedule search predicts for one layout: batch time and each rank's peak microbatches."""

    batch_time: float
    in_flight: tuple[Fraction, ...]
    exposed_expert_comm: tuple[float, ...] = ()  # per rank and batch: all-to-all time no pair hides (overlapped)


def searched(forward: Sequence[float], backward: Sequence[float], m: int, v: int = 1) -> Searched:
    """Run the schedule search for ranks taking ``forward[r]``/``backward[r]`` per microbatch."""
    return _searched(tuple(float(f) for f in forward), tuple(float(b) for b in backward), m, v)


@functools.lru_cache(maxsize=1024)
def _searched(forward: tuple[float, ...], backward: tuple[float, ...], m: int, v: int) -> Searched:
    from megapipe.schedules.analysis.schedule_search import search_schedule
    from megapipe.schedules.analysis.simulate import CostModel

    p, halves = len(forward), [b / 2 for b in backward]
    costs = CostModel.per_rank(p, v, forward, halves, halves, exact=False)
    found = search_schedule(p, m, costs, memory_limit=p, v=v, max_evaluations=0)
    return Searched(float(found.simulation.makespan), found.simulation.peak_activations)


@functools.lru_cache(maxsize=256)
def overlapped(schedule: str, p: int, m: int, v: int) -> Optional[Schedule]:
    """The lowered lists ``--overlap-moe-expert-parallel-comm`` runs for ``schedule`` (``overlapped_schedule``),
    or None where the flag refuses it (no pairs, pairs that wait on one another, no flush, ``auto``)."""
    if schedule == SEARCHED or not flushes(schedule):
        return None
    try:
        return overlapped_schedule(build_schedule(schedule, p, m, v))
    except ConfigError:
        return None


def overlapped_time(schedule: str, p: int, forward: Sequence[float], backward: Sequence[float],
                    exchange: Sequence[float], moe_layers: Sequence[int], m: int, v: int = 1) -> Searched:
    """Batch time and each rank's peak microbatches of ``schedule``'s overlapped lists on p ranks, simulated
    for virtual stages taking ``forward[s]``/``backward[s]`` per microbatch, all-to-alls included, of which
    ``exchange[s]`` per pass are the expert all-to-alls of the stage's ``moe_layers[s]`` MoE layers; each pair
    hides them as ``simulate.overlapped_pair_time`` says (BI and BW half the backward's compute each, the BI
    all of its all-to-alls); with each rank's all-to-all time that no pair hides."""
    from megapipe.schedules.analysis.simulate import CostModel, exposed_expert_comm, simulate

    lists = overlapped(schedule, p, m, v)
    if lists is None:
        raise ValueError(f"{schedule} has no overlapped pairs at p={p}, m={m}, v={v}")
    compute_backward = tuple(float(b - x) for b, x in zip(backward, exchange))
    halves = tuple(b / 2 for b in compute_backward)
    costs = CostModel(forward=tuple(float(f - x) for f, x in zip(forward, exchange)), backward=compute_backward,
                      input_backward=halves, weight_backward=halves, expert_comm=tuple(map(float, exchange)),
                      moe_layers=tuple(moe_layers), hide_expert_comm=True)
    simulation = simulate(lists, costs)
    return Searched(float(simulation.makespan), simulation.peak_activations,
                    tuple(map(float, exposed_expert_comm(lists, costs))))


def placement_of(schedule: str) -> Placement:
    return schedule_descriptor(schedule).placement


def flushes(schedule: str) -> bool:
    return schedule_descriptor(schedule).flushes


def unties_embeddings(schedule: str, p: int) -> bool:
    """Without flushes the first and last stage update at different times, so megapipe's asynchronous
    schedules give a pipelined model its own output embedding instead of a tied copy to keep equal."""
    return not flushes(schedule) and p > 1


def microbatch_problem(schedule: str, p: int, m: int, v: int) -> Optional[str]:
    """Why the planner cannot plan ``schedule`` with m microbatches on p ranks with v chunks each, or None if it can."""
    try:
        descriptor = schedule_descriptor(schedule)
    except ConfigError:
        return f"unknown schedule {schedule}"
    if descriptor is SEARCHED_SCHEDULE:
        if v != 1:
            return "the planner searches schedules of one chunk per rank"
        if 3 * m * v > SEARCHED_PASSES:
            return f"the planner searches schedules of at most {SEARCHED_PASSES // 3} microbatches, not {m}"
        return None
    if descriptor.closed_forms is None:
        return f"{schedule} has no closed form ({descriptor.costs.how}); the planner leaves it out"
    return descriptor.planned_sizes.problem(schedule, p, m, v)


def planned_chunks(schedule: str, most: int) -> list[int]:
    """The chunks per rank, up to ``most``, the planner tries for ``schedule`` (none for one it does not plan)."""
    try:
        sizes = schedule_descriptor(schedule).planned_sizes
    except ConfigError:
        return []
    top = most if sizes.most_chunks is None else min(most, sizes.most_chunks)
    return list(range(sizes.least_chunks, top + 1))


def _closed_forms(descriptor: ScheduleDescriptor) -> ClosedForms:
    if descriptor.closed_forms is None:
        raise ValueError(f"schedule {descriptor.name!r} has no closed form ({descriptor.costs.how})")
    return descriptor.closed_forms


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> Fraction:
    """Peak microbatches whose activations rank ``rank`` holds, in units of the whole rank's (all chunks)."""
    return _closed_forms(schedule_descriptor(schedule)).in_flight(p, m, v, rank)


def weight_versions(schedule: str, p: int, rank: int) -> int:
    """Copies of the weights rank ``rank`` keeps: one per in-flight input with stashing, two with 2BW."""
    return schedule_descriptor(schedule).weight_versions(p, rank)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> Fraction:
    """Idle time over ideal time for equal ranks (for ``auto``, the bound its search guarantees)."""
    descriptor = schedule_descriptor(schedule)
    if descriptor.closed_forms is None and descriptor.costs.bubble_at_most is not None:
        return descriptor.costs.bubble_at_most(p, m, v)
    return _closed_forms(descriptor).bubble(p, m, v)


def pipeline_time(schedule: str, forward: Sequence[float], backward: Sequence[float], m: int, v: int = 1) -> float:
    """Seconds for one batch of m microbatches; ``forward[r]``/``backward[r]`` are rank r's per microbatch (all chunks)."""
    return _closed_forms(schedule_descriptor(schedule)).batch_time(forward, backward, m, v)
