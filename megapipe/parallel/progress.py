"""Where this rank is: the collective it is in, the pipeline action it runs, when either last changed, and the
main thread's CPU time by phase.

The hang watchdog (``training/hang_watchdog.py``) reads it from its own thread; the code it describes
writes it, cheaply, as it goes: ``collective(name, group)`` around every blocking collective of
``collectives.py`` and every wait for an asynchronous one or a pipeline message, ``action(text)`` for each
schedule action. Each such wait is also a span of exposed communication (``exposure.py``), of the kind
``name_group`` gave the group.
Each group's collectives are numbered in the order this rank enters them, the same on every member,
so a rank stuck in collective n of a group can tell which members never reached n. The straggler check
(``training/stragglers.py``) reads the main thread's CPU seconds per phase (passes, optimizer step,
the loop), which ``action`` attributes as the rank moves from one to the next. ``name_group`` gives a
group the name its role has (``ParallelState``), for reports a user reads.

The watchdog's thread reads single attributes, each assigned whole (a frozen ``Waiting``): no lock.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from megapipe.parallel import exposure


@dataclass(frozen=True)
class Waiting:
    """A blocking collective or message wait this rank is in."""

    name: str  # "all_reduce", "RECV_F 3.1 from rank 2", ...
    group: str  # the group's axis name, or its ranks
    ranks: tuple[int, ...]  # the group's global ranks
    number: int  # of this group's collectives, counted from 1 on this rank
    since: float  # time.monotonic() at entry


@dataclass
class Progress:
    waiting: Optional[Waiting] = None
    action: str = "starting"
    changed: float = field(default_factory=time.monotonic)
    entered: dict = field(default_factory=dict)  # group ranks -> collectives entered so far
    phase: str = "the loop"  # what the main thread's CPU time counts towards now
    cpu: dict = field(default_factory=dict)  # phase -> the main thread's CPU seconds in it so far
    cpu_mark: float = field(default_factory=time.thread_time)

    def snapshot(self) -> dict:
        """A JSON-ready copy for a hang report."""
        waiting = self.waiting
        return {"action": self.action, "idle_seconds": round(time.monotonic() - self.changed, 1),
                "waiting": None if waiting is None else {
                    "name": waiting.name, "group": waiting.group, "ranks": list(waiting.ranks),
                    "number": waiting.number, "seconds": round(time.monotonic() - waiting.since, 1)},
                "entered": {",".join(map(str, ranks)): count for ranks, count in self.entered.items()}}


PROGRESS = Progress()
_GROUP_NAMES: dict[int, str] = {}
_GROUP_KINDS: dict[int, str] = {}


def name_group(group, name: str, kind: str = "other") -> None:
    """Name ``group`` (a process group of ``ParallelState``) for reports, and say what its communication is
    (tensor, context, expert, pipeline, data, other) for the exposed-communication counts."""
    if group is not None:
        _GROUP_NAMES[id(group)] = name
        _GROUP_KINDS[id(group)] = kind


_RANKS: dict[int, tuple] = {}  # id(group) -> (a weak reference to it, its ranks): asked once per group, not per
# message; weak, so that a group the state forgets is freed (its gloo threads with it)


def group_ranks(group) -> tuple[int, ...]:
    if not dist.is_initialized():
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    known = _RANKS.get(id(group))
    if known is None or known[0]() is not group:
        known = _RANKS[id(group)] = (weakref.ref(group), tuple(dist.get_process_group_ranks(group)))
    return known[1]


def issued(group) -> tuple[tuple[int, ...], int]:
    """Count a collective over ``group`` as entered (an asynchronous one when it is issued): its ranks and number."""
    ranks = group_ranks(group)
    number = PROGRESS.entered.get(ranks, 0) + 1
    PROGRESS.entered[ranks] = number
    return ranks, number


@contextlib.contextmanager
def collective(name: str, group, counted: bool = True):
    """This rank is in ``name`` over ``group`` while the block runs (``counted``: a collective every
    member enters, numbered; a message wait between two ranks is not)."""
    ranks, number = issued(group) if counted else (group_ranks(group), 0)
    label = _GROUP_NAMES.get(id(group), "the world" if group is None else f"ranks {','.join(map(str, ranks))}")
    now = time.monotonic()
    PROGRESS.waiting, PROGRESS.changed = Waiting(name, label, ranks, number, now), now
    try:
        with exposure.waiting(_GROUP_KINDS.get(id(group), "other")):
            yield
    finally:
        PROGRESS.waiting, PROGRESS.changed = None, time.monotonic()


def action(text: str, phase: str = "the loop") -> None:
    """This rank starts ``text`` (a schedule action, an iteration's phase), whose CPU time counts towards
    ``phase``; the CPU time since the previous call goes to that call's phase. Called on the main thread."""
    cpu = time.thread_time()
    PROGRESS.cpu[PROGRESS.phase] = PROGRESS.cpu.get(PROGRESS.phase, 0.0) + cpu - PROGRESS.cpu_mark
    PROGRESS.action, PROGRESS.changed, PROGRESS.phase, PROGRESS.cpu_mark = text, time.monotonic(), phase, cpu

