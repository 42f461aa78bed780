"""What the executor runs on each call: a flush schedule's list, or one segment of an
asynchronous schedule.

``FlushProgram``: every call runs the whole list over the m microbatches it is given;
nothing carries over between calls, and there is nothing to drain.

``PeriodicProgram``: an asynchronous schedule (PipeDream, 2BW) never flushes. One *batch* is
one call: call w runs segment w of the unrolled form (``segments.py``), whose forwards are
those of microbatches w*m .. w*m + m - 1, the ones the call is given; activations, weight
versions and posted sends carry over to the next call; ``drain(rank, n)``, after n calls,
runs the backwards still in flight, after which the pipeline is empty and a new run may
start. Only a few unrolled forms are built: after w0 warm-up segments every segment is the
previous one *shifted* (microbatch ids + m, each stage's version tags and UPDATE labels moved
on by its updates per batch), and the drain after n >= n0 calls is the drain after K calls
shifted. Both are checked when the program is built, so the calls of a run of n batches
followed by its drain are exactly the validated unrolled form over n batches; a drain after
fewer than n0 calls is built from the unrolled form over n batches on demand.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from megapipe.errors import ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.replay import message_of
from megapipe.schedules.catalog import build_segmented
from megapipe.schedules.segments import split_segments

Actions = tuple[Action, ...]


class FlushProgram:
    """Runs the same list every call (GPipe, 1F1B, interleaved)."""

    asynchronous = False
    fill_calls = 0  # calls before the program repeats itself
    horizon = 1  # calls a microbatch can stay in flight, at most

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.loss_divisor = schedule.m  # one STEP applies all m microbatches

    def segment(self, rank: int, call: int) -> Actions:
        return self.schedule.actions[rank]

    def drain(self, rank: int, calls: int) -> Actions:
        return ()

    def first_microbatch(self, call: int) -> int:
        """Id of the first microbatch a call's forwards use (ids restart every call)."""
        return 0


class PeriodicProgram:
    """One segment of an asynchronous schedule per call (see the module docstring)."""

    asynchronous = True

    def __init__(self, name: str, p: int, m: int, v: int = 1, replicas: Optional[tuple[int, ...]] = None,
                 vertical_sync: bool = False):
        self._options = (name, p, m, v, replicas, vertical_sync)
        self._built_forms: dict = {}
        self.m = m
        # Enough batches for the warm-up, two repeats and the drain to show; also more calls
        # than any microbatch stays in flight (at most p v / m + 1).
        horizon = self.horizon = 3 + 2 * math.ceil(p * v / m)
        self.schedule = self._unrolled(horizon)
        pieces = split_segments(self.schedule, self._starts(horizon))
        self._warmup, self._steps = _find_period(self.schedule, pieces, m)
        self._segments = [segments[:self._warmup + 1] for segments, _ in pieces]
        self._late_drains = [drain for _, drain in pieces]
        self._stable_drains_from = horizon - 2
        for n in (horizon - 2, horizon - 1):
            self._check_run(n)
        self.loss_divisor = _backwards_per_update(self.schedule, self._segments)

    @property
    def fill_calls(self) -> int:
        """Calls before every call is the previous one shifted (the pipeline has filled)."""
        return self._warmup + 1

    def segment(self, rank: int, call: int) -> Actions:
        if call <= self._warmup:
            return self._segments[rank][call]
        return self._shifted(self._segments[rank][self._warmup], call - self._warmup)

    def drain(self, rank: int, calls: int) -> Actions:
        if calls >= self._stable_drains_from:
            return self._shifted(self._late_drains[rank], calls - self.horizon)
        return self._check_run(calls)[rank]

    def first_microbatch(self, call: int) -> int:
        return call * self.m

    # ---- construction -------------------------------------------------------------------------
    def _built(self, batches: int):
        if batches not in self._built_forms:
            name, p, m, v, replicas, vertical_sync = self._options
            self._built_forms[batches] = build_segmented(name, p, m, v, batches, replicas, vertical_sync)
        return self._built_forms[batches]

    def _unrolled(self, batches: int) -> Schedule:
        return self._built(batches).schedule

    def _starts(self, batches: int):
        return self._built(batches).starts

    def _check_run(self, batches: int) -> list[Actions]:
        """The drains of the unrolled form over ``batches`` batches, after checking that its
        segments are the ones this program runs."""
        pieces = split_segments(self._unrolled(batches), self._starts(batches))
        for rank, (segments, _) in enumerate(pieces):
            for call, segment in enumerate(segments):
                if segment != self.segment(rank, call):
                    raise ScheduleError(f"schedule {self._options[0]!r}: call {call} of rank {rank} differs from "
                                        f"the unrolled form over {batches} batches; it cannot run periodically.")
        drains = [drain for _, drain in pieces]
        if batches >= self._stable_drains_from and any(
                drain != self._shifted(late, batches - self.horizon)
                for drain, late in zip(drains, self._late_drains)):
            raise ScheduleError(f"schedule {self._options[0]!r}: its drain after {batches} batches is not the "
                                "later drain shifted; raise the horizon.")
        return drains

    def _shifted(self, actions: Actions, batches: int) -> Actions:
        return tuple(_shift(a, batches, self.m, self._steps) for a in actions)


def _shift(action: Action, batches: int, m: int, steps: dict[int, int]) -> Action:
    """``action`` ``batches`` batches later: ids + batches*m, versions + batches*(updates per batch)."""
    if action.kind is ActionKind.STEP:
        return action
    version = action.version
    if version is not None:
        stage = message_of(action)[1] if action.kind.is_communication else action.stage  # tags are the producer's
        version += batches * steps[stage]
    return replace(action, microbatch=action.microbatch + batches * m, version=version)


def _find_period(schedule: Schedule, pieces, m: int) -> tuple[int, dict[int, int]]:
    """The first segment w0 after which every segment is the previous one shifted, and the
    updates per batch of each stage."""
    horizon = schedule.batches
    for warmup in range(horizon - 2):
        steps = _updates_per_segment(schedule, pieces, warmup)
        if all(_shift_all(segments[warmup], later - warmup, m, steps) == segments[later]
               for segments, _ in pieces for later in range(warmup + 1, horizon)):
            return warmup, steps
    raise ScheduleError(f"schedule {schedule.name!r} (p={schedule.p}, m={m}, v={schedule.v}) does not settle into a "
                        f"repeating batch within {horizon} batches.")


def _shift_all(actions: Actions, batches: int, m: int, steps: dict[int, int]) -> Actions:
    return tuple(_shift(a, batches, m, steps) for a in actions)


def _updates_per_segment(schedule: Schedule, pieces, segment: int) -> dict[int, int]:
    steps = {}
    for stage in range(schedule.num_stages):
        rank = schedule.ranks_of_stage(stage)[0]
        steps[stage] = sum(1 for a in pieces[rank][0][segment] if a.kind is ActionKind.UPDATE and a.stage == stage)
    return steps


def _backwards_per_update(schedule: Schedule, segments: list[list[Actions]]) -> int:
    """How many microbatch gradients each rank's UPDATE applies: the loss is divided by it so an
    update applies the mean gradient (the same on every rank, or the losses could not be scaled once)."""
    counts = set()
    for rank_segments in segments:
        backwards = updates = 0
        for action in rank_segments[-1]:
            backwards += action.kind is ActionKind.B
            updates += action.kind is ActionKind.UPDATE
        counts.add(backwards // updates if updates else 0)
    if len(counts) != 1 or 0 in counts:
        raise ScheduleError(f"schedule {schedule.name!r}: ranks apply different numbers of microbatches per update "
                            f"({sorted(counts)}), so no single loss scale gives every update the mean gradient.")
    return counts.pop()
