"""Cut the unrolled form of an asynchronous schedule into what each call of the executor runs.

A rank's list over n batches is cut into n *segments* and a *drain*. Segment w starts at the
rank's first forward of batch w (segment 0 at the start, with the warm-up) and ends where
the first forward of batch w + 1 is, or would be if the run went on: that position is taken
from the generator's list for n + 1 batches, whose prefix must equal this one. Everything
after segment n - 1 is the drain. Call w of the executor runs segment w, so it needs the data
of batch w only; the drain runs the backwards still in flight when training stops.

Sends stay right after the compute that makes their tensor. ``confine_receives`` moves
every receive that the communication pass posted in an earlier segment than its consumer
to the start of the consumer's segment, keeping each sender's order, so a call never posts a
receive for a later call's message. ``check_calls_are_independent`` then proves that a
rank never waits, in call w, for something another rank does in a later call: every
message's sender runs it in a segment no later than its consumer, and the replicas of a
stage run each UPDATE (a collective) in the same segment. A training loop may therefore
put any collective between calls.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megapipe.errors import ScheduleError
from megapipe.pipeline.ir.actions import Action, ActionKind, Schedule
from megapipe.pipeline.ir.replay import message_of

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


@dataclass
class _Slots:
    """A lowered rank list taken apart: receives posted before each compute, sends after it."""

    computes: list[Action]
    before: list[list[Action]]
    after: list[list[Action]]

    @classmethod
    def of(cls, actions) -> "_Slots":
        slots = cls([], [[]], [])
        for action in actions:
            if action.kind.is_recv:
                slots.before[-1].append(action)
            elif action.kind.is_send:
                slots.after[-1].append(action)
            else:
                slots.computes.append(action)
                slots.before.append([])
                slots.after.append([])
        if slots.before[-1]:
            raise ScheduleError(f"receives {slots.before[-1]} come after the last compute of their rank.")
        return slots

    def actions(self, start: int, end: int) -> tuple[Action, ...]:
        out = []
        for c in range(start, end):
            out += self.before[c] + [self.computes[c]] + self.after[c]
        return tuple(out)


def confine_receives(schedule: Schedule, cuts: Cuts) -> Schedule:
    """Move receives posted before their consumer's segment to its start, keeping sender order."""
    slots = [_Slots.of(actions) for actions in schedule.actions]
    where = [{(a.kind, a.stage, a.microbatch): c for c, a in enumerate(s.computes)} for s in slots]
    send_order = {}
    for sender, s in enumerate(slots):
        count: defaultdict[int, int] = defaultdict(int)
        for sends in s.after:
            for send in sends:
                send_order[(send.peer, message_of(send))] = (sender, count[send.peer])
                count[send.peer] += 1
    placed = []  # (receiver, slot, sender, k, recv)
    for receiver, s in enumerate(slots):
        for slot, recvs in enumerate(s.before):
            for recv in recvs:
                consumer = where[receiver][(ActionKind.F if recv.kind is ActionKind.RECV_F else ActionKind.B,
                                            recv.stage, recv.microbatch)]
                segment = segment_of(cuts[receiver], consumer)
                earliest = cuts[receiver][segment - 1] if segment > 0 else 0
                sender, k = send_order[(receiver, message_of(recv))]
                placed.append([receiver, max(slot, earliest), sender, k, recv])
    placed.sort(key=lambda item: (item[0], item[2], item[3]))
    for previous, item in zip(placed, placed[1:]):  # a sender's receives never go back in its order
        if previous[0] == item[0] and previous[2] == item[2]:
            item[1] = max(item[1], previous[1])
    for s in slots:
        s.before = [[] for _ in s.before]
    for receiver, slot, _, _, recv in sorted(placed, key=lambda item: (item[0], item[1], item[2], item[3])):
        slots[receiver].before[slot].append(recv)
    return schedule.with_actions([s.actions(0, len(s.computes)) for s in slots])


def split_segments(schedule: Schedule, cuts: Cuts) -> list[tuple[list[tuple[Action, ...]], tuple[Action, ...]]]:
    """Per rank, (its n segments, its drain)."""
    out = []
    for actions, rank_cuts in zip(schedule.actions, cuts):
        slots = _Slots.of(actions)
        bounds = (0,) + rank_cuts + (len(slots.computes),)
        pieces = [slots.actions(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]
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
