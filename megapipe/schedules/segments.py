"""Cut the unrolled form of an asynchronous schedule into what each call of the executor runs.

A rank's list over n batches is cut into n *segments* and a *drain*. Segment w starts at the
rank's first forward of batch w (segment 0 at the start, with the warm-up) and ends where
the first forward of batch w + 1 is, or would be if the run went on: that position is taken
from the generator's list for n + 1 batches, whose prefix must equal this one. Everything
after segment n - 1 is the drain. Call w of the executor runs segment w, so it needs the data
of batch w only; the drain runs the backwards still in flight when training stops.

The communication pass lowers the unrolled form call by call (``communication.lower_calls``):
every message is sent and received in the same call, so nothing is in transit between two
calls and the lists are deadlock-free with a collective between every two calls, under every
transport (``transport.py``). ``check_calls_are_independent`` proves that a rank never waits,
in call w, for something another rank does in a later call: every message's sender runs it
in a segment no later than its consumer, and the replicas of a stage run each UPDATE (a
collective) in the same segment. A training loop may therefore put any collective between
calls.
"""

from __future__ import annotations

from collections import defaultdict

from megapipe.errors import ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule

Cuts = tuple[tuple[int, ...], ...]
"""Per rank, compute indices (positions among non-communication actions) where segments
1 .. n - 1 and the drain start."""


def segment_cuts(compute: Schedule, longer: Schedule) -> Cuts:
    """The cuts of compute-only ``compute`` (n batches), using ``longer`` (n + 1 batches) for the drain."""
    n, m = compute.batches, compute.m
    cuts = []
    for rank, (actions, more) in enumerate(zip(compute.actions, longer.actions)):
        starts = [_first_forward_at_or_after(actions, w * m) for w in range(1, n)]
        end = _first_forward_at_or_after(more, n * m)
        if None in starts or end is None or tuple(more[:end]) != tuple(actions[:end]):
            raise ScheduleError(f"schedule {compute.name!r}: rank {rank}'s list for {n} batches is not the start of "
                                f"its list for {n + 1}, so it cannot run one batch per call.")
        cuts.append(tuple(starts) + (end,))
    return tuple(cuts)


def _first_forward_at_or_after(actions, microbatch: int):
    return next((k for k, a in enumerate(actions) if a.kind is ActionKind.F and a.microbatch >= microbatch), None)


def segment_of(cuts: tuple[int, ...], compute_index: int) -> int:
    """The segment (0 .. n, n = drain) a compute index falls in."""
    return sum(1 for cut in cuts if cut <= compute_index)


Starts = tuple[tuple[int, ...], ...]
"""Per rank, list positions of the lowered form where calls 1 .. n - 1 and the drain start."""


def split_segments(schedule: Schedule, starts: Starts) -> list[tuple[list[tuple[Action, ...]], tuple[Action, ...]]]:
    """Per rank, (its n segments, its drain)."""
    out = []
    for actions, rank_starts in zip(schedule.actions, starts):
        bounds = (0,) + tuple(rank_starts) + (len(actions),)
        pieces = [tuple(actions[bounds[k]:bounds[k + 1]]) for k in range(len(bounds) - 1)]
        out.append((pieces[:-1], pieces[-1]))
    return out


def check_calls_are_independent(schedule: Schedule, cuts: Cuts) -> None:
    """Raise if some rank would wait, in one call, for another rank's later call (module docstring)."""
    made_in = {}
    update_segments: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for rank, actions in enumerate(schedule.actions):
        computes = [a for a in actions if not a.kind.is_communication]
        for c, action in enumerate(computes):
            segment = segment_of(cuts[rank], c)
            if action.kind is ActionKind.UPDATE:
                update_segments[(action.stage, action.microbatch)].add(segment)
            else:
                made_in[(action.kind, action.stage, action.microbatch)] = (rank, segment)
    for (kind, stage, microbatch), (rank, segment) in made_in.items():
        producer_stage = stage - 1 if kind is ActionKind.F else stage + 1
        producer = made_in.get((kind, producer_stage, microbatch))
        if producer is not None and producer[0] != rank and producer[1] > segment:
            raise ScheduleError(f"schedule {schedule.name!r}: rank {rank} needs {kind.value}{producer_stage}."
                                f"{microbatch} of rank {producer[0]} in call {segment}, which that rank runs only in "
                                f"call {producer[1]}.")
    for (stage, microbatch), segments in update_segments.items():
        if len(segments) > 1:
            raise ScheduleError(f"schedule {schedule.name!r}: the replicas of stage {stage} run UPDATE{stage}."
                                f"{microbatch} in different calls {sorted(segments)}.")
