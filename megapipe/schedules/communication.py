"""The one pass that turns compute-only lists into lists with SEND_* and RECV_* actions.

Rule. Replay the compute-only lists with compute times (``replay.replay``; by default F = 1
and B = 2 per stage, messages free). A compute action whose output another rank consumes is
followed, on its own rank, by its ``SEND`` (``SEND_B`` follows B or BI, never BW; the forward
of an overlapped pair sends after the pair, when the replay says its output exists). The
sender also decides where the matching ``RECV`` goes: on the consumer's rank, right before
the compute that is running (or next to start) when the send is posted, and never after the
consumer. Receives from one sender are
then moved earlier where needed so that they keep the sender's order. A rank never places
its own receives.

Why this cannot deadlock, under the executor contract of ``actions.py`` (sends and receives
are posted without blocking; a compute waits only for the receive it consumes): posting
never blocks, so the only waits are those of computes for their inputs, which are exactly
the waits of the compute-only lists; every receive sits before its consumer, and between
two ranks the k-th receive expects the k-th send (no tags, no crossed messages). A replay of
the compute-only lists that finishes is therefore a proof that the new lists finish too;
``replay`` raises if it does not.

Why the timing. Transfers start once both ends are posted (NCCL and gloo behave so for
tensors), so a receive posted late delays its message, and one posted too early holds a
buffer for long. Posting it when the sender sends is neither.

With p = 1 every neighbour is on the same rank and no message is added. With the looped
placement the edge from stage p-1 (last rank) to stage p (rank 0) becomes a message from the
last rank to rank 0, and the gradient goes back the same way; with the V placement stages p-1
and p share the last rank, so that edge carries no message, and stage p sends to rank p-2.
An overlapped backward's receives go before the forward it runs with (its pair starts there).
"""

from __future__ import annotations

from bisect import bisect_right
from fractions import Fraction
from collections import defaultdict
from numbers import Real
from typing import Optional

from megapipe.errors import ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.segments import Cuts
from megapipe.schedules.replay import Duration, Message, Transfer, outgoing_messages, overlap_partners, replay


def unit_duration(rank: int, action: Action) -> Real:
    """Placement costs: F = 1 and B = 2 per stage (the ratio of the papers' figures), BI = BW = 1; STEP and
    UPDATE a small positive time, so no two actions of a rank end at once (``transport.py``)."""
    return {ActionKind.F: 1, ActionKind.B: 2, ActionKind.BI: 1, ActionKind.BW: 1}.get(action.kind, Fraction(1, 64))


def _free(message: Message) -> Real:
    return 0


def add_communication(schedule: Schedule, duration: Duration = unit_duration, transfer: Transfer = _free,
                      calls: Optional[Cuts] = None) -> Schedule:
    """Return compute-only ``schedule`` with its sends and receives inserted by the rule above.

    ``duration`` and ``transfer`` are the costs the placement of receives is tuned for (see
    ``simulate.CostModel``); any costs give a correct, deadlock-free schedule. ``calls`` (per
    rank, the compute indices where calls 1, 2, ... start) lowers an asynchronous schedule
    call by call: see ``lower_calls``.
    """
    return lower_calls(schedule, calls, duration, transfer)[0]


def lower_calls(schedule: Schedule, calls: Optional[Cuts], duration: Duration = unit_duration,
                transfer: Transfer = _free) -> tuple[Schedule, tuple[tuple[int, ...], ...]]:
    """Insert communication into compute-only ``schedule`` whose lists are cut into calls.

    The placement replay puts a collective between calls (``replay``'s barriers, which the
    training loop's agreements are), so a call of one rank never overlaps another rank's
    other calls, and every message is received in the call it is sent in: before the
    receiver's compute running when it is sent, or at the end of the receiver's call when
    that rank has finished it. Nothing is ever in transit between two calls. Returns the
    lowered schedule and, per rank, the list positions where calls 1, 2, ... start.
    """
    if schedule.has_communication:
        raise ScheduleError(f"schedule {schedule.name!r} already has SEND/RECV actions; pass its compute_only() "
                            "form to add_communication.")
    cuts = tuple(tuple(c) for c in calls) if calls is not None else tuple(() for _ in range(schedule.p))
    steps = replay(schedule, duration, transfer, barriers=[list(c) for c in cuts])
    compute_ends = [[step.end for step in sorted((s for s in steps if s.rank == rank), key=lambda s: s.index)]
                    for rank in range(schedule.p)]
    bounds = [(0,) + rank_cuts + (len(actions),) for rank_cuts, actions in zip(cuts, schedule.actions)]
    position, pair_end = {}, {}  # an overlapped pair starts at its forward and ends after its backward
    for rank, actions in enumerate(schedule.actions):
        starts = overlap_partners(actions)
        for index, action in enumerate(actions):
            position[(rank, _identity(action))] = starts.get(index, index)
        pair_end.update({(rank, forward): backward for backward, forward in starts.items()})
    sends: defaultdict[tuple[int, int], list[Action]] = defaultdict(list)  # (rank, index of the compute before)
    receives: defaultdict[tuple[int, int], list[tuple[tuple[int, int], Action]]] = defaultdict(list)
    for step in sorted(steps, key=lambda s: (s.rank, s.index)):
        messages = outgoing_messages(schedule, step.action)
        if messages is None:
            continue
        send, recv = messages
        receiver = send.peer
        sends[(step.rank, pair_end.get((step.rank, step.index), step.index))].append(send)
        call = _call_of(bounds[step.rank], step.index)
        low, high = bounds[receiver][call], bounds[receiver][call + 1]
        consumer = position[(receiver, _identity(_consumer(recv)))]
        slot = min(bisect_right(compute_ends[receiver], step.end), consumer, high)
        if slot < low or consumer < low:
            raise ScheduleError(f"schedule {schedule.name!r}: {recv} on rank {receiver} falls before that rank's "
                                f"call {call}, in which its sender sends it; the calls are not aligned.")
        receives[(step.rank, receiver)].append(((call, slot), recv))
    before: defaultdict[tuple[int, int, int], list[Action]] = defaultdict(list)  # (rank, call, slot)
    for (_, receiver), queue in sorted(receives.items()):
        for (call, slot), recv in _keep_sender_order(queue):
            before[(receiver, call, slot)].append(recv)
    lists, starts = [], []
    for rank, actions in enumerate(schedule.actions):
        lowered, rank_starts = [], []
        for call in range(len(bounds[rank]) - 1):
            if call:
                rank_starts.append(len(lowered))
            low, high = bounds[rank][call], bounds[rank][call + 1]
            for index in range(low, high):
                lowered += before[(rank, call, index)] + [actions[index]]
                lowered += sends.get((rank, index), [])
            lowered += before[(rank, call, high)]  # received after this rank's last compute of the call
        lists.append(lowered)
        starts.append(tuple(rank_starts))
    return schedule.with_actions(lists), tuple(starts)  # keeps the placement (replicas) and batches


def _call_of(bounds: tuple[int, ...], index: int) -> int:
    return bisect_right(bounds, index) - 1


def _identity(action: Action) -> tuple:
    """Where a compute sits in its list; B and BI share one identity (a stage and microbatch has
    only one of them), the one that consumes a gradient and makes the next."""
    kind = ActionKind.B if action.kind is ActionKind.BI else action.kind
    return (kind, action.stage, action.microbatch)


def _consumer(recv: Action) -> Action:
    kind = ActionKind.F if recv.kind is ActionKind.RECV_F else ActionKind.B  # B or BI, see _identity
    return Action(kind, recv.stage, recv.microbatch)


def _keep_sender_order(queue: list[tuple[tuple, Action]]) -> list[tuple[tuple, Action]]:
    """Slots of one sender's receives, in send order, lowered where needed to be non-decreasing."""
    kept, lowest = [], None
    for slot, recv in reversed(queue):
        lowest = slot if lowest is None else min(slot, lowest)
        kept.append((lowest, recv))
    return kept[::-1]
