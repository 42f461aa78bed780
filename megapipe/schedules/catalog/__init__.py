"""The registry of pipeline schedules, and the one way to turn a generator's output into a Schedule.

Every schedule is one ``ScheduleDescriptor`` (``descriptor.py``), defined next to its generator;
``DESCRIPTORS`` below lists them, so adding a schedule is one file and one line there::

    def my_order(p: int, m: int) -> list[list[Action]]: ...
    DESCRIPTOR = ScheduleDescriptor("mine", my_order, "what it does")   # in my_order's file

A generator is a pure function returning, per pipeline rank, the compute-only list
(F, B, STEP). ``build_schedule`` checks the sizes, calls it, inserts the sends and receives
(``communication.add_communication``) and validates the result.

Asynchronous schedules (PipeDream, 2BW) have a weight policy other than single; their generators
take keywords ``(p, m, v, batches, replicas, vertical_sync)``, return the unrolled lists over
``batches`` batches, set ``Action.version`` on F and B and update stages with ``UPDATE``.
``build_segmented`` also cuts them into one segment per executor call (``segments.py``).

``auto`` (``searched.py``) is described here too, but has no generator: the search makes it.
"""

from __future__ import annotations

import difflib
import operator
from dataclasses import dataclass
from typing import Iterable, Optional

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.actions import ActionKind, Schedule
from megapipe.schedules.replay import replay
from megapipe.schedules.overlap import overlapped_pairs, with_overlapped_pairs
from megapipe.schedules.communication import add_communication, lower_calls
from megapipe.schedules.catalog import (dualpipev, gpipe, interleaved, one_f_one_b, pipedream, searched, two_bw,
                                            v_shape, zbv, zero_bubble)
from megapipe.schedules.catalog.descriptor import ScheduleDescriptor
from megapipe.schedules.segments import Cuts, Starts, check_calls_are_independent, segment_cuts
from megapipe.schedules.validate import validate_schedule
from megapipe.layout.placement import Placement

DESCRIPTORS = (
    one_f_one_b.DESCRIPTOR,
    gpipe.DESCRIPTOR,
    interleaved.DESCRIPTOR,
    zero_bubble.ZB_H1,
    zero_bubble.ZB_H2,
    zero_bubble.INTERLEAVED_ZB,
    zbv.DESCRIPTOR,
    v_shape.V_HALF,
    v_shape.V_MIN,
    dualpipev.DESCRIPTOR,
    two_bw.DESCRIPTOR,
    pipedream.DESCRIPTOR,
)
SEARCHED = searched.DESCRIPTOR
"""``auto``: accepted wherever a schedule is named, run by the search, never built here."""

UNROLLED_BATCHES = 4
"""Batches in the unrolled form ``build_schedule`` returns for an asynchronous schedule."""

@dataclass(frozen=True)
class SegmentedSchedule:
    """An asynchronous schedule's unrolled, lowered form and where each call's segment starts
    (``cuts``: compute indices; ``starts``: positions in the lowered lists)."""

    schedule: Schedule
    cuts: Cuts
    starts: Starts


_REGISTRY: dict[str, ScheduleDescriptor] = {}


def register_schedule(descriptor: ScheduleDescriptor) -> None:
    if descriptor.name in _REGISTRY or descriptor.name == SEARCHED.name:
        raise ValueError(f"a schedule named {descriptor.name!r} is already registered")
    if descriptor.generate is None:
        raise ValueError(f"schedule {descriptor.name!r} has no generator")
    _REGISTRY[descriptor.name] = descriptor


def default_schedule(virtual_pipeline: int) -> str:
    """The schedule a run gets without ``--pipeline-schedule``: 1F1B, or Megatron's interleaved 1F1B when each
    rank holds more than one model chunk."""
    return (interleaved.DESCRIPTOR if virtual_pipeline > 1 else one_f_one_b.DESCRIPTOR).name


def names_where(fact: str) -> str:
    """The registered schedules whose descriptor has ``fact`` (a true property), for a sentence: ``pipedream``
    or ``2bw or pipedream``."""
    return " or ".join(name for name in schedule_names() if getattr(_REGISTRY[name], fact))


def schedule_names() -> list[str]:
    """The registered schedules (those with a generator), sorted."""
    return sorted(_REGISTRY)


def accepted_names() -> list[str]:
    """What ``--pipeline-schedule`` takes: the registered schedules, the flush ones first, then ``auto``."""
    return _flush_first() + [SEARCHED.name]


def schedule_descriptor(name: str) -> ScheduleDescriptor:
    """The descriptor of a registered schedule or of ``auto``; an unknown name is a ConfigError."""
    if name == SEARCHED.name:
        return SEARCHED
    descriptor = _REGISTRY.get(name)
    if descriptor is None:
        names = accepted_names()
        close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)  # 1F1B -> 1f1b
        case = " the names are lower case" if name != name.lower() else ""
        hint = f" (did you mean {close[0]}?{case})" if close else ""
        raise ConfigError(f"--pipeline-schedule {name} is unknown{hint}; choose one of {', '.join(names)}.")
    return descriptor


def pipeline_schedule_help() -> str:
    """The help of ``--pipeline-schedule``, from the registry."""
    names = ", ".join(f"{n} (V placement)" if _REGISTRY[n].placement is Placement.V else n for n in _flush_first())
    return f"{names}, or {SEARCHED.name} (searched for the stage costs below); 1f1b by default, interleaved with " \
           "virtual stages"


def _flush_first(names: Optional[Iterable[str]] = None) -> list[str]:
    """Schedule names, the flush schedules first (each group sorted)."""
    return sorted(schedule_names() if names is None else names, key=lambda n: (_REGISTRY[n].asynchronous, n))


def lower_schedule(compute_only: Schedule) -> Schedule:
    """Validate compute-only lists, insert communication, validate the result."""
    validate_schedule(compute_only)
    schedule = add_communication(compute_only)
    validate_schedule(schedule)
    return schedule


def overlapped_schedule(schedule: Schedule) -> Schedule:
    """``schedule`` lowered with its forward/backward pairs overlapped (``overlap.with_overlapped_pairs``), for
    ``--overlap-moe-expert-parallel-comm``. One sentence when it has no pair to overlap, or when its pairs
    would wait on one another across pipeline ranks (1F1B beyond one rank: a pair sends its forward's output
    only at its end), which the lists replayed with unit costs and pairs run one pass after the other show
    as a longer batch than the plain lists'."""
    try:
        marked = lower_schedule(with_overlapped_pairs(schedule.compute_only()))
    except ScheduleError:  # overlapping its pairs would deadlock it (GPipe)
        marked = None
    if marked is None or not overlapped_pairs(marked) or _unit_makespan(marked) > _unit_makespan(schedule):
        raise ConfigError(f"--overlap-moe-expert-parallel-comm needs forward/backward pairs that need not wait for "
                          f"each other, and --pipeline-schedule {schedule.name} has none at p={schedule.p}, "
                          f"m={schedule.m}; use dualpipev, interleaved, or 1f1b at --pipeline-model-parallel-size 1 "
                          "(as Megatron's combined 1F1B), or drop the flag.")
    return marked


def _unit_makespan(schedule: Schedule):
    """The batch time of ``schedule`` with F = BI = BW = 1, B = 2, free messages and pairs one pass after the
    other."""
    def duration(rank, action):
        return 2 if action.kind is ActionKind.B else int(action.kind.is_compute)

    return max(step.end for step in replay(schedule, duration, overlap=operator.add))


def build_schedule(name: str, p: int, m: int, v: int = 1, *, batches: Optional[int] = None,
                   replicas: Optional[tuple[int, ...]] = None, vertical_sync: bool = False) -> Schedule:
    """The validated schedule ``name`` for p pipeline ranks, m microbatches per batch and v chunks per rank.

    Asynchronous schedules come unrolled over ``batches`` batches (default ``UNROLLED_BATCHES``);
    ``replicas`` (workers per stage, adding up to p) and ``vertical_sync`` apply to them only.
    """
    descriptor = _buildable(name)
    _check_sizes(descriptor, p, m, v)
    if not descriptor.asynchronous:
        _check_flush_options(descriptor, batches, replicas, vertical_sync)
        lists = descriptor.compute_lists(p, m, v)
        return lower_schedule(Schedule(name, p, m, v, lists, placement=descriptor.placement))
    return build_segmented(name, p, m, v, batches or UNROLLED_BATCHES, replicas, vertical_sync).schedule


def build_segmented(name: str, p: int, m: int, v: int, batches: int, replicas: Optional[tuple[int, ...]] = None,
                    vertical_sync: bool = False) -> SegmentedSchedule:
    """An asynchronous schedule over ``batches`` batches, lowered, validated and cut into segments."""
    descriptor = _buildable(name)
    if not descriptor.asynchronous:
        raise ValueError(f"schedule {name!r} has flushes; only asynchronous schedules are cut into segments")
    _check_sizes(descriptor, p, m, v)
    if replicas is not None:
        replicas = tuple(replicas)
        if sum(replicas) != p:
            raise ConfigError(f"the stage replicas {list(replicas)} add up to {sum(replicas)} workers, not the "
                              f"{p} pipeline ranks; fix --pipeline-stages.")
        if all(count == 1 for count in replicas):
            replicas = None

    def unrolled(count: int) -> Schedule:
        lists = descriptor.generate(p=p, m=m, v=v, batches=count, replicas=replicas, vertical_sync=vertical_sync)
        return Schedule(name, p, m, v, lists, batches=count, replicas=replicas)

    compute = unrolled(batches)
    cuts = segment_cuts(compute, unrolled(batches + 1))
    validate_schedule(compute)
    lowered, starts = lower_calls(compute, cuts)
    validate_schedule(lowered, barriers=starts)
    check_calls_are_independent(lowered, cuts)
    return SegmentedSchedule(lowered, cuts, starts)


def _buildable(name: str) -> ScheduleDescriptor:
    descriptor = schedule_descriptor(name)
    if descriptor.generate is None:
        raise ConfigError(f"--pipeline-schedule {name} is made by the schedule search for the run's stage costs, "
                          "not built by name; give the --schedule-* cost flags or --schedule-profile.")
    return descriptor


def _check_sizes(descriptor: ScheduleDescriptor, p: int, m: int, v: int) -> None:
    name = descriptor.name
    if p < 1:
        raise ConfigError(f"--pipeline-model-parallel-size {p} must be at least 1.")
    if m < 1:
        raise ConfigError(f"the number of microbatches m={m} must be at least 1; raise --global-batch-size.")
    if v < 1:
        raise ConfigError(f"the number of model chunks per rank v={v} must be at least 1; check "
                          "--num-layers-per-virtual-pipeline-stage.")
    if v > 1 and not descriptor.chunked:
        chunked = _flush_first(n for n in schedule_names() if _REGISTRY[n].chunked)
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage gives v={v} model chunks per rank, but "
                          f"--pipeline-schedule {name} has none; use one of {', '.join(chunked)} or drop the flag.")


def _check_flush_options(descriptor: ScheduleDescriptor, batches, replicas, vertical_sync: bool) -> None:
    if vertical_sync:
        raise ConfigError(f"--pipedream-vertical-sync has no meaning with --pipeline-schedule {descriptor.name}, which "
                          "flushes and keeps one weight version; drop the flag or use --pipeline-schedule pipedream.")
    if replicas is not None and any(count != 1 for count in replicas):
        raise ConfigError(f"--pipeline-schedule {descriptor.name} does not replicate single stages; give every stage in "
                          "--pipeline-stages the same replication (parallel pipelines) or use --pipeline-schedule "
                          "pipedream.")
    if batches not in (None, 1):
        raise ValueError(f"schedule {descriptor.name!r} flushes after every batch; it has no unrolled form over {batches}")


for _descriptor in DESCRIPTORS:
    register_schedule(_descriptor)
