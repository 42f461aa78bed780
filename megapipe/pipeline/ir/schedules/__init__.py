"""Registry of schedule generators and the one way to turn a generator's output into a Schedule.

A generator is a pure function returning, per pipeline rank, the compute-only list
(F, B, STEP). ``build_schedule`` checks the sizes, calls it, inserts the sends and receives
(``communication.add_communication``) and validates the result. Adding a schedule::

    def my_order(p: int, m: int) -> list[list[Action]]: ...
    register_schedule("mine", my_order)                   # chunked=True: takes (p, m, v)

Asynchronous schedules (PipeDream, 2BW) register with their weight policy; their generators
take keywords ``(p, m, v, batches, replicas, vertical_sync)``, return the unrolled lists over
``batches`` batches, set ``Action.version`` on F and B and update stages with ``UPDATE``.
``build_segmented`` also cuts them into one segment per executor call (``segments.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megapipe.errors import ConfigError
from megapipe.pipeline.ir.actions import Action, Schedule
from megapipe.pipeline.ir.communication import add_communication, lower_calls
from megapipe.pipeline.ir.schedules.dualpipev import dualpipev
from megapipe.pipeline.ir.schedules.gpipe import gpipe
from megapipe.pipeline.ir.schedules.interleaved import interleaved
from megapipe.pipeline.ir.schedules.one_f_one_b import one_f_one_b
from megapipe.pipeline.ir.schedules.pipedream import pipedream
from megapipe.pipeline.ir.schedules.two_bw import two_bw
from megapipe.pipeline.ir.schedules.v_shape import v_half, v_min
from megapipe.pipeline.ir.schedules.zbv import zbv
from megapipe.pipeline.ir.schedules.zero_bubble import interleaved_zb, zb_h1, zb_h2
from megapipe.pipeline.ir.segments import Cuts, Starts, check_calls_are_independent, segment_cuts
from megapipe.pipeline.ir.validate import validate_schedule
from megapipe.pipeline.runtime.weights import WeightPolicy
from megapipe.layout.placement import Placement

UNROLLED_BATCHES = 4
"""Batches in the unrolled form ``build_schedule`` returns for an asynchronous schedule."""

Generator = Callable[..., list[list[Action]]]


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered generator; ``chunked`` generators take (p, m, v), the others (p, m) and need v = 1;
    asynchronous ones (weight policy other than single) take keywords and may allow chunks.
    ``placement`` says where its chunks live (``layout/placement.py``)."""

    name: str
    generate: Generator
    chunked: bool = False
    weight_policy: WeightPolicy = WeightPolicy.SINGLE
    placement: Placement = Placement.LOOPED

    @property
    def asynchronous(self) -> bool:
        return self.weight_policy is not WeightPolicy.SINGLE


@dataclass(frozen=True)
class SegmentedSchedule:
    """An asynchronous schedule's unrolled, lowered form and where each call's segment starts
    (``cuts``: compute indices; ``starts``: positions in the lowered lists)."""

    schedule: Schedule
    cuts: Cuts
    starts: Starts


_REGISTRY: dict[str, ScheduleSpec] = {}


def register_schedule(name: str, generate: Generator, chunked: bool = False,
                      weight_policy: WeightPolicy = WeightPolicy.SINGLE,
                      placement: Placement = Placement.LOOPED) -> None:
    if name in _REGISTRY:
        raise ValueError(f"a schedule named {name!r} is already registered")
    _REGISTRY[name] = ScheduleSpec(name, generate, chunked, weight_policy, placement)


def schedule_names() -> list[str]:
    return sorted(_REGISTRY)


def schedule_spec(name: str) -> ScheduleSpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"--pipeline-schedule {name} is unknown; choose one of {', '.join(_flush_first())}.")
    return spec


def _flush_first(names=None) -> list[str]:
    """Schedule names, the flush schedules first (each group sorted)."""
    return sorted(schedule_names() if names is None else names, key=lambda n: (_REGISTRY[n].asynchronous, n))


def lower_schedule(compute_only: Schedule) -> Schedule:
    """Validate compute-only lists, insert communication, validate the result."""
    validate_schedule(compute_only)
    schedule = add_communication(compute_only)
    validate_schedule(schedule)
    return schedule


def build_schedule(name: str, p: int, m: int, v: int = 1, *, batches: Optional[int] = None,
                   replicas: Optional[tuple[int, ...]] = None, vertical_sync: bool = False) -> Schedule:
    """The validated schedule ``name`` for p pipeline ranks, m microbatches per batch and v chunks per rank.

    Asynchronous schedules come unrolled over ``batches`` batches (default ``UNROLLED_BATCHES``);
    ``replicas`` (workers per stage, adding up to p) and ``vertical_sync`` apply to them only.
    """
    spec = schedule_spec(name)
    _check_sizes(spec, p, m, v)
    if not spec.asynchronous:
        _check_flush_options(spec, batches, replicas, vertical_sync)
        lists = spec.generate(p, m, v) if spec.chunked else spec.generate(p, m)
        return lower_schedule(Schedule(name, p, m, v, lists, placement=spec.placement))
    return build_segmented(name, p, m, v, batches or UNROLLED_BATCHES, replicas, vertical_sync).schedule


def build_segmented(name: str, p: int, m: int, v: int, batches: int, replicas: Optional[tuple[int, ...]] = None,
                    vertical_sync: bool = False) -> SegmentedSchedule:
    """An asynchronous schedule over ``batches`` batches, lowered, validated and cut into segments."""
    spec = schedule_spec(name)
    if not spec.asynchronous:
        raise ValueError(f"schedule {name!r} has flushes; only asynchronous schedules are cut into segments")
    _check_sizes(spec, p, m, v)
    if replicas is not None:
        replicas = tuple(replicas)
        if sum(replicas) != p:
            raise ConfigError(f"the stage replicas {list(replicas)} add up to {sum(replicas)} workers, not the "
                              f"{p} pipeline ranks; fix --pipeline-stages.")
        if all(count == 1 for count in replicas):
            replicas = None

    def unrolled(count: int) -> Schedule:
        lists = spec.generate(p=p, m=m, v=v, batches=count, replicas=replicas, vertical_sync=vertical_sync)
        return Schedule(name, p, m, v, lists, batches=count, replicas=replicas)

    compute = unrolled(batches)
    cuts = segment_cuts(compute, unrolled(batches + 1))
    validate_schedule(compute)
    lowered, starts = lower_calls(compute, cuts)
    validate_schedule(lowered, barriers=starts)
    check_calls_are_independent(lowered, cuts)
    return SegmentedSchedule(lowered, cuts, starts)


def _check_sizes(spec: ScheduleSpec, p: int, m: int, v: int) -> None:
    name = spec.name
    if p < 1:
        raise ConfigError(f"--pipeline-model-parallel-size {p} must be at least 1.")
    if m < 1:
        raise ConfigError(f"the number of microbatches m={m} must be at least 1; raise --global-batch-size.")
    if v < 1:
        raise ConfigError(f"the number of model chunks per rank v={v} must be at least 1; check "
                          "--num-layers-per-virtual-pipeline-stage.")
    if v > 1 and not spec.chunked:
        chunked = _flush_first(n for n in schedule_names() if _REGISTRY[n].chunked)
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage gives v={v} model chunks per rank, but "
                          f"--pipeline-schedule {name} has none; use one of {', '.join(chunked)} or drop the flag.")


def _check_flush_options(spec: ScheduleSpec, batches, replicas, vertical_sync: bool) -> None:
    if vertical_sync:
        raise ConfigError(f"--pipedream-vertical-sync has no meaning with --pipeline-schedule {spec.name}, which "
                          "flushes and keeps one weight version; drop the flag or use --pipeline-schedule pipedream.")
    if replicas is not None and any(count != 1 for count in replicas):
        raise ConfigError(f"--pipeline-schedule {spec.name} does not replicate single stages; give every stage in "
                          "--pipeline-stages the same replication (parallel pipelines) or use --pipeline-schedule "
                          "pipedream.")
    if batches not in (None, 1):
        raise ValueError(f"schedule {spec.name!r} flushes after every batch; it has no unrolled form over {batches}")


register_schedule("gpipe", gpipe)
register_schedule("1f1b", one_f_one_b)
register_schedule("interleaved", interleaved, chunked=True)
register_schedule("pipedream", pipedream, weight_policy=WeightPolicy.STASH)
register_schedule("zb-h1", zb_h1)
register_schedule("zb-h2", zb_h2)
register_schedule("interleaved-zb", interleaved_zb, chunked=True)
register_schedule("2bw", two_bw, chunked=True, weight_policy=WeightPolicy.DOUBLE_BUFFER)
register_schedule("zbv", zbv, chunked=True, placement=Placement.V)
register_schedule("v-half", v_half, chunked=True, placement=Placement.V)
register_schedule("v-min", v_min, chunked=True, placement=Placement.V)
register_schedule("dualpipev", dualpipev, chunked=True, placement=Placement.V)
