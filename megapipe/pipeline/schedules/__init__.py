"""Registry of schedule generators and the one way to turn a generator's output into a Schedule.

A generator is a pure function returning, per pipeline rank, the compute-only list
(F, B, STEP). ``build_schedule`` checks the sizes, calls it, inserts the sends and receives
(``communication.add_communication``) and validates the result. Adding a schedule::

    def my_order(p: int, m: int) -> list[list[Action]]: ...
    register_schedule("mine", my_order)                   # chunked=True: takes (p, m, v)

Schedules with weight versions (PipeDream, 2BW) register the same way; their generators
set ``Action.version`` on F and B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megapipe.errors import ConfigError
from megapipe.pipeline.actions import Action, Schedule
from megapipe.pipeline.communication import add_communication
from megapipe.pipeline.schedules.gpipe import gpipe
from megapipe.pipeline.schedules.interleaved import interleaved
from megapipe.pipeline.schedules.one_f_one_b import one_f_one_b
from megapipe.pipeline.validate import validate_schedule

Generator = Callable[..., list[list[Action]]]


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered generator; ``chunked`` generators take (p, m, v), the others (p, m) and need v = 1."""

    name: str
    generate: Generator
    chunked: bool = False


_REGISTRY: dict[str, ScheduleSpec] = {}


def register_schedule(name: str, generate: Generator, chunked: bool = False) -> None:
    if name in _REGISTRY:
        raise ValueError(f"a schedule named {name!r} is already registered")
    _REGISTRY[name] = ScheduleSpec(name, generate, chunked)


def schedule_names() -> list[str]:
    return sorted(_REGISTRY)


def lower_schedule(compute_only: Schedule) -> Schedule:
    """Validate compute-only lists, insert communication, validate the result."""
    validate_schedule(compute_only)
    schedule = add_communication(compute_only)
    validate_schedule(schedule)
    return schedule


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The validated schedule ``name`` for p pipeline ranks, m microbatches and v chunks per rank."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigError(f"--pipeline-schedule {name} is unknown; choose one of {', '.join(schedule_names())}.")
    if p < 1:
        raise ConfigError(f"--pipeline-model-parallel-size {p} must be at least 1.")
    if m < 1:
        raise ConfigError(f"the number of microbatches m={m} must be at least 1; raise --global-batch-size.")
    if v < 1:
        raise ConfigError(f"the number of model chunks per rank v={v} must be at least 1; check "
                          "--num-layers-per-virtual-pipeline-stage.")
    if v > 1 and not spec.chunked:
        chunked = [n for n in schedule_names() if _REGISTRY[n].chunked]
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage gives v={v} model chunks per rank, but "
                          f"--pipeline-schedule {name} has none; use {' or '.join(chunked)} or drop the flag.")
    lists = spec.generate(p, m, v) if spec.chunked else spec.generate(p, m)
    return lower_schedule(Schedule(name, p, m, v, lists))


register_schedule("gpipe", gpipe)
register_schedule("1f1b", one_f_one_b)
register_schedule("interleaved", interleaved, chunked=True)
