"""What each action waits for, and a replay of all ranks' lists that respects it.

One engine serves three users: the communication pass (it needs an order in which the
compute actions could really happen), the validator (a replay that gets stuck is a
deadlock) and the simulator (the same replay with costs gives start and end times).

Waiting rules, under the executor contract of ``actions.py``:

* ``F s.i`` waits for the input of stage s; ``B s.i`` waits for its own ``F s.i`` and for the
  output gradient of stage s. An input made on the same rank is ready when its producer
  ends. An input from another rank is a *message* (``F``/``B``, producing stage,
  microbatch): it arrives ``transfer`` after both ends are posted, i.e. after the
  ``SEND_*`` on the producer's rank and the ``RECV_*`` on this rank. In a compute-only
  schedule (no SEND/RECV yet) the message is implied: sent when the producer ends,
  always posted.
* ``SEND_* s.i`` waits for the compute that makes the tensor; ``RECV_*`` waits for nothing
  (posting a receive never blocks); ``STEP`` waits for every ``B`` of the rank.
* ``UPDATE s.i`` waits for the backwards it applies: on a replicated stage it is a
  collective, so it waits for each replica's last ``B s.j`` with j <= i (on this rank list
  order already guarantees it).

Actions of one rank run in list order; sends and receives take no compute time.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Callable, NamedTuple, Optional

from megapipe.errors import ScheduleError
from megapipe.pipeline.ir.actions import Action, ActionKind, Schedule
from megapipe.pipeline.ir.grid import format_grid

Message = tuple[ActionKind, int, int]
"""Identity of a tensor sent between ranks: (F or B, stage that made it, microbatch)."""

_PRODUCER_OF_SEND = {ActionKind.SEND_F: ActionKind.F, ActionKind.SEND_B: ActionKind.B}


def message_of(action: Action) -> Message:
    """The tensor a SEND or RECV action carries."""
    if action.kind is ActionKind.SEND_F:
        return (ActionKind.F, action.stage, action.microbatch)
    if action.kind is ActionKind.RECV_F:
        return (ActionKind.F, action.stage - 1, action.microbatch)
    if action.kind is ActionKind.SEND_B:
        return (ActionKind.B, action.stage, action.microbatch)
    if action.kind is ActionKind.RECV_B:
        return (ActionKind.B, action.stage + 1, action.microbatch)
    raise ValueError(f"{action} carries no message")


def input_producer(schedule: Schedule, action: Action) -> Optional[Action]:
    """The compute action whose output F or B consumes: F s-1.i or B s+1.i (None at the pipeline ends)."""
    if action.kind is ActionKind.F and action.stage > 0:
        return Action(ActionKind.F, action.stage - 1, action.microbatch)
    if action.kind is ActionKind.B and action.stage < schedule.num_stages - 1:
        return Action(ActionKind.B, action.stage + 1, action.microbatch)
    return None


def outgoing_messages(schedule: Schedule, action: Action) -> Optional[tuple[Action, Action]]:
    """For a compute action whose output another rank consumes: (its SEND, the consumer's RECV)."""
    if action.kind is ActionKind.F and action.stage < schedule.num_stages - 1:
        send_kind, recv_kind, consumer_stage = ActionKind.SEND_F, ActionKind.RECV_F, action.stage + 1
    elif action.kind is ActionKind.B and action.stage > 0:
        send_kind, recv_kind, consumer_stage = ActionKind.SEND_B, ActionKind.RECV_B, action.stage - 1
    else:
        return None
    sender = schedule.rank_of(action.stage, action.microbatch)
    receiver = schedule.rank_of(consumer_stage, action.microbatch)
    if sender == receiver:
        return None
    return (Action(send_kind, action.stage, action.microbatch, peer=receiver, version=action.version),
            Action(recv_kind, consumer_stage, action.microbatch, peer=sender, version=action.version))


def _key(action: Action) -> Message:
    """Identity of a compute action's result (and of the message carrying it), ignoring its version."""
    return (action.kind, action.stage, action.microbatch)


class Wait(NamedTuple):
    """One thing an action waits for: compute action ``key`` ending on this rank, or (``message``)
    the arrival of the tensor it made on another rank."""

    key: Message
    message: bool

    def describe(self) -> str:
        kind, stage, microbatch = self.key
        made_by = f"{kind.value}{stage}.{microbatch}"
        if not self.message:
            return made_by
        return f"the {'activation' if kind is ActionKind.F else 'gradient'} sent by {made_by}"


def waits_of(schedule: Schedule, rank: int, action: Action) -> list[Wait]:
    """Everything ``action`` on ``rank`` waits for (see the module docstring)."""
    kind, stage, microbatch = action.kind, action.stage, action.microbatch
    if kind is ActionKind.F or kind is ActionKind.B:
        waits = [Wait((ActionKind.F, stage, microbatch), False)] if kind is ActionKind.B else []
        producer_stage = stage - 1 if kind is ActionKind.F else stage + 1
        if 0 <= producer_stage < schedule.num_stages:
            waits.append(Wait((kind, producer_stage, microbatch),
                              schedule.rank_of(producer_stage, microbatch) != rank))
        return waits
    if kind.is_send:
        return [Wait((_PRODUCER_OF_SEND[kind], stage, microbatch), False)]
    if kind is ActionKind.STEP:
        return [Wait((ActionKind.B, s, i), False) for s in schedule.stages_on_rank(rank)
                for i in schedule.microbatches_on(rank, s)]
    if kind is ActionKind.UPDATE:
        return [Wait((ActionKind.B, stage, last), False) for last in _last_backwards(schedule, stage, microbatch)]
    return []


def _last_backwards(schedule: Schedule, stage: int, microbatch: int) -> list[int]:
    """Per replica of ``stage``, the last microbatch j <= ``microbatch`` it runs (none if it has none)."""
    replicas = schedule.stage_replicas(stage)
    return [j for j in range(max(microbatch - replicas + 1, 0), microbatch + 1)]


@dataclass(frozen=True)
class ReplayedAction:
    """One action of a replay with its times: compute runs [start, end); a send or receive is
    posted at ``start`` and its message arrives at ``end``."""

    rank: int
    index: int
    action: Action
    start: Real
    end: Real


Duration = Callable[[int, Action], Real]
Transfer = Callable[[Message], Real]


def _no_time(*_) -> int:
    return 0


def replay(schedule: Schedule, duration: Duration = _no_time, transfer: Transfer = _no_time) -> list[ReplayedAction]:
    """Run all ranks' lists in lock-step rounds and return every action with its times.

    Each round, every rank whose next action's waits were met before the round runs that one
    action, so the result is in an order a real run could produce. ``duration(rank, action)``
    is the compute time of F, B and STEP; ``transfer(message)`` the time a message takes once
    both ends are posted. Raises ScheduleError naming the blocked actions on a deadlock.
    """
    explicit = schedule.has_communication
    clock = [0] * schedule.p
    position = [0] * schedule.p
    ended: dict[tuple, Real] = {}
    sent: dict[Message, Real] = {}
    posted: dict[Message, Real] = {}
    replayed: list[ReplayedAction] = []

    def arrival(message: Message) -> Optional[Real]:
        if explicit:
            if message not in sent or message not in posted:
                return None
            return max(sent[message], posted[message]) + transfer(message)
        producer_end = ended.get(message)
        return None if producer_end is None else producer_end + transfer(message)

    def wait_end(wait: Wait) -> Optional[Real]:
        return arrival(wait.key) if wait.message else ended.get(wait.key)

    waits = [[waits_of(schedule, rank, action) for action in actions] for rank, actions in enumerate(schedule.actions)]

    def ready_time(rank: int) -> Optional[Real]:
        """When rank's next action can start, or None while it must wait."""
        start = clock[rank]
        for wait in waits[rank][position[rank]]:
            end = wait_end(wait)
            if end is None:
                return None
            start = max(start, end)
        return start

    while any(position[r] < len(schedule.actions[r]) for r in range(schedule.p)):
        runnable = []
        for rank in range(schedule.p):
            if position[rank] < len(schedule.actions[rank]):
                action = schedule.actions[rank][position[rank]]
                start = ready_time(rank)
                if start is not None:
                    runnable.append((rank, action, start))
        if not runnable:
            raise _deadlock(schedule, position, wait_end)
        for rank, action, start in runnable:
            end = start + (duration(rank, action) if not action.kind.is_communication else 0)
            clock[rank] = end
            if action.kind.is_send:
                sent[message_of(action)] = start
            elif action.kind.is_recv:
                posted[message_of(action)] = start
            else:
                ended[_key(action)] = end
            replayed.append(ReplayedAction(rank, position[rank], action, start, end))
            position[rank] += 1
    return [_with_arrival(step, arrival) if step.action.kind.is_communication else step for step in replayed]


def _with_arrival(step: ReplayedAction, arrival: Callable[[Message], Optional[Real]]) -> ReplayedAction:
    """A send or receive ends when its message arrives (never, if its partner is missing)."""
    arrived = arrival(message_of(step.action))
    return ReplayedAction(step.rank, step.index, step.action, step.start, step.start if arrived is None else arrived)


def _deadlock(schedule: Schedule, position: list[int], wait_end: Callable[[Wait], Optional[Real]]) -> ScheduleError:
    blocked = [(r, position[r]) for r in range(schedule.p) if position[r] < len(schedule.actions[r])]
    rank, index = blocked[0]
    action = schedule.actions[rank][index]
    missing = [w.describe() for w in waits_of(schedule, rank, action) if wait_end(w) is None]
    return ScheduleError(
        f"deadlock: every unfinished rank is blocked, first rank {rank} at {action} (position {index}), which waits "
        f"for {' and '.join(missing)}; reorder the lists so every input is produced and posted before it is "
        f"needed.\n{format_grid(schedule, marks=blocked)}")
