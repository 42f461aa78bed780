"""What each action waits for, and a replay of all ranks' lists that respects it.

One engine serves three users: the communication pass (it needs an order in which the
compute actions could really happen), the validator (a replay that gets stuck is a
deadlock) and the simulator (the same replay with costs gives start and end times).

Waiting rules, under the executor contract of ``actions.py``:

* ``F s.i`` waits for the input of stage s; ``B s.i`` and ``BI s.i`` wait for their own
  ``F s.i`` and for the output gradient of stage s (made by B or BI of stage s+1); ``BW s.i``
  waits for its own ``BI s.i``. An input made on the same rank is ready when its producer
  ends. An input from another rank is a *message* (``F``/``B``, producing stage,
  microbatch): it arrives ``transfer`` after both ends are posted, i.e. after the
  ``SEND_*`` on the producer's rank and the ``RECV_*`` on this rank. In a compute-only
  schedule (no SEND/RECV yet) the message is implied: sent when the producer ends,
  always posted.
* ``SEND_* s.i`` waits for the compute that makes the tensor; ``RECV_*`` waits for nothing
  (posting a receive never blocks); ``STEP`` waits for every ``B`` or ``BW`` of the rank
  (the weight gradients).
* ``UPDATE s.i`` waits for the backwards it applies: on a replicated stage it is a
  collective, so it waits for each replica's last ``B``/``BW s.j`` with j <= i (on this rank list
  order already guarantees it).

Actions of one rank run in list order; sends and receives take no compute time.

Overlapped pairs. A backward marked ``overlapped`` and the forward before it among its rank's
computes run as one unit: the forward waits for the backward's inputs too, the pair takes
``overlap(forward time, backward time)`` (charged to the forward; the backward then takes no
time of its own) and both results exist at its end.

Transport (``transport.py``). Under ``Transport.GLOO`` a message arrives ``transfer`` after
both of its ends are posted, and a compute waits for that arrival. Under ``Transport.NCCL`` a
rank's consecutive sends and receives form one group; a group becomes active when it is
posted and the rank's previous group has completed, a message moves once the groups holding
both ends are active, a group completes when all its messages have arrived, and a compute
waits for the completion of the whole group holding its receive. Every group must complete
by the end of the lists.

Barriers. ``barriers[r]`` lists positions of rank r's list before which a collective sits
(the training loop's agreements between two calls of an asynchronous schedule): it completes
once every rank has run everything before its own barrier position, and nothing after it
starts earlier. Such a collective runs on another communicator than the pipeline messages,
so it never waits for a pending group, only for the computes before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Callable, NamedTuple, Optional

from megapipe.errors import ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.grid import format_grid
from megapipe.schedules.transport import Transport, group_ids

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
    if action.kind.makes_input_grad and action.stage < schedule.num_stages - 1:
        return Action(ActionKind.B, action.stage + 1, action.microbatch)  # or BI: the same tensor
    return None


def outgoing_messages(schedule: Schedule, action: Action) -> Optional[tuple[Action, Action]]:
    """For a compute action whose output another rank consumes: (its SEND, the consumer's RECV)."""
    if action.kind is ActionKind.F and action.stage < schedule.num_stages - 1:
        send_kind, recv_kind, consumer_stage = ActionKind.SEND_F, ActionKind.RECV_F, action.stage + 1
    elif action.kind.makes_input_grad and action.stage > 0:
        send_kind, recv_kind, consumer_stage = ActionKind.SEND_B, ActionKind.RECV_B, action.stage - 1
    else:
        return None
    sender = schedule.rank_of(action.stage, action.microbatch)
    receiver = schedule.rank_of(consumer_stage, action.microbatch)
    if sender == receiver:
        return None
    return (Action(send_kind, action.stage, action.microbatch, peer=receiver, version=action.version),
            Action(recv_kind, consumer_stage, action.microbatch, peer=sender, version=action.version))


def overlap_partners(actions) -> dict[int, int]:
    """Positions in one rank's list: each overlapped backward -> the compute before it (its forward)."""
    partners, previous = {}, None
    for index, action in enumerate(actions):
        if not action.kind.is_compute:
            continue
        if action.overlapped and previous is not None:
            partners[index] = previous
        previous = index
    return partners


def _key(action: Action) -> Message:
    """Identity of a compute action's result (and of the message carrying it), ignoring its version."""
    return (action.kind, action.stage, action.microbatch)


def results_of(action: Action) -> list[Message]:
    """What a compute action makes, as the keys others wait for: ``(B, s, i)`` is the input
    gradient (made by B or BI), ``(BW, s, i)`` the weight gradients (made by B or BW)."""
    if action.kind.is_backward:
        made = [ActionKind.B] if action.kind.makes_input_grad else []
        made += [ActionKind.BW] if action.kind.makes_weight_grads else []
        return [(kind, action.stage, action.microbatch) for kind in made]
    return [_key(action)]


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
    if kind is ActionKind.BW:
        return [Wait((ActionKind.B, stage, microbatch), False)]  # its BI
    if kind is ActionKind.F or kind.makes_input_grad:
        made = ActionKind.F if kind is ActionKind.F else ActionKind.B
        waits = [Wait((ActionKind.F, stage, microbatch), False)] if made is ActionKind.B else []
        producer_stage = stage - 1 if made is ActionKind.F else stage + 1
        if 0 <= producer_stage < schedule.num_stages:
            waits.append(Wait((made, producer_stage, microbatch),
                              schedule.rank_of(producer_stage, microbatch) != rank))
        return waits
    if kind.is_send:
        return [Wait((_PRODUCER_OF_SEND[kind], stage, microbatch), False)]
    if kind is ActionKind.STEP:
        return [Wait((ActionKind.BW, s, i), False) for s in schedule.stages_on_rank(rank)
                for i in schedule.microbatches_on(rank, s)]
    if kind is ActionKind.UPDATE:
        return [Wait((ActionKind.BW, stage, last), False) for last in _last_backwards(schedule, stage, microbatch)]
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


Barriers = Optional[list[list[int]]]


Overlap = Callable[[Real, Real], Real]
Pair = Callable[[int, Action, Action], Real]


def replay(schedule: Schedule, duration: Duration = _no_time, transfer: Transfer = _no_time,
           transport: Transport = Transport.GLOO, barriers: Barriers = None,
           overlap: Overlap = max, pair: Optional[Pair] = None) -> list[ReplayedAction]:
    """Run all ranks' lists in lock-step rounds and return every action with its times.

    Each round, every rank whose next action's waits were met before the round runs that one
    action, so the result is in an order a real run could produce. ``duration(rank, action)``
    is the compute time of F, B, STEP and UPDATE; ``transfer(message)`` the time a message
    takes once it can move (module docstring, for each ``transport``); ``overlap(f, b)`` the
    time of an overlapped pair, or ``pair(rank, forward, backward)`` when given (a cost model that sees
    inside the passes: ``CostModel.pair_time``). Raises ScheduleError with the marked grid and the cycle of
    waits on a deadlock.
    """
    return _Replay(schedule, duration, transfer, Transport(transport), barriers, overlap, pair).run()


class _Replay:
    """The state of one replay; see ``replay``."""

    def __init__(self, schedule: Schedule, duration: Duration, transfer: Transfer, transport: Transport,
                 barriers: Barriers, overlap: Overlap, pair: Optional[Pair] = None):
        self.schedule, self.duration, self.transfer, self.transport = schedule, duration, transfer, transport
        self.overlap, self.pair = overlap, pair
        self.explicit = schedule.has_communication
        p = schedule.p
        self.clock, self.position = [0] * p, [0] * p
        self.ended: dict[tuple, Real] = {}
        self.sent: dict[Message, Real] = {}
        self.posted: dict[Message, Real] = {}
        self.waits = [[waits_of(schedule, rank, a) for a in actions] for rank, actions in enumerate(schedule.actions)]
        self.partner_of: list[dict[int, int]] = []  # per rank: forward position -> its overlapped backward's
        for rank, actions in enumerate(schedule.actions):
            pairs = {forward: backward for backward, forward in overlap_partners(actions).items()}
            for forward, backward in pairs.items():  # the pair starts when both parts can
                self.waits[rank][forward] = self.waits[rank][forward] + self.waits[rank][backward]
            self.partner_of.append(pairs)
        self.barriers = [list(b) for b in barriers] if barriers else [[] for _ in range(p)]
        if len({len(b) for b in self.barriers}) > 1 or len(self.barriers) != p:
            raise ValueError("every rank needs the same number of barrier positions")
        self.barrier_arrival: list[Optional[Real]] = [None] * p
        self.barriers_passed = 0
        # NCCL groups: per rank, group id of every action, members, post times and the head group
        self.groups = [group_ids(actions, tuple(b)) for actions, b in zip(schedule.actions, self.barriers)]
        self.members: list[dict[int, list[Message]]] = [{} for _ in range(p)]
        self.group_posted: list[dict[int, Real]] = [{} for _ in range(p)]
        self.group_size = [self._sizes(ids) for ids in self.groups]
        self.group_done: list[dict[int, Real]] = [{} for _ in range(p)]
        self.head = [0] * p  # first group of the rank that has not completed
        self.end_of: dict[tuple[int, Message], int] = {}  # (rank, message) -> group holding that end
        self.moved: dict[Message, Real] = {}

    @staticmethod
    def _sizes(ids: list[int]) -> dict[int, int]:
        sizes: dict[int, int] = {}
        for gid in ids:
            if gid >= 0:
                sizes[gid] = sizes.get(gid, 0) + 1
        return sizes

    # ---- when things happen ---------------------------------------------------------------------
    def arrival(self, message: Message) -> Optional[Real]:
        """When ``message`` has arrived at its receiver (None: not yet)."""
        if not self.explicit:
            producer_end = self.ended.get(message)
            return None if producer_end is None else producer_end + self.transfer(message)
        if self.transport is Transport.NCCL:
            return self.moved.get(message)
        if message not in self.sent or message not in self.posted:
            return None
        return max(self.sent[message], self.posted[message]) + self.transfer(message)

    def wait_end(self, rank: int, wait: Wait) -> Optional[Real]:
        if not wait.message:
            return self.ended.get(wait.key)
        if self.transport is Transport.NCCL and self.explicit:
            group = self.end_of.get((rank, wait.key))
            return None if group is None else self.group_done[rank].get(group)
        return self.arrival(wait.key)

    def ready_time(self, rank: int) -> Optional[Real]:
        """When rank's next action can start, or None while it must wait."""
        start = self.clock[rank]
        for wait in self.waits[rank][self.position[rank]]:
            end = self.wait_end(rank, wait)
            if end is None:
                return None
            start = max(start, end)
        return start

    def _active(self, rank: int, group: int) -> Optional[Real]:
        """When ``group`` of ``rank`` became active, if it is the rank's head group and fully posted."""
        size = self.group_size[rank].get(group)
        if group != self.head[rank] or size is None or len(self.members[rank].get(group, ())) != size:
            return None
        previous = self.group_done[rank].get(group - 1, 0)
        return max(self.group_posted[rank][group], previous)

    def settle(self) -> None:
        """NCCL: move every message whose two groups are active; complete groups whose messages all moved."""
        changed = True
        while changed:
            changed = False
            for rank in range(self.schedule.p):
                group = self.head[rank]
                active = self._active(rank, group)
                if active is None:
                    continue
                for message in self.members[rank][group]:
                    if message in self.moved:
                        continue
                    peer = self._peer(rank, message)
                    peer_group = self.end_of.get((peer, message))
                    peer_active = None if peer_group is None else self._active(peer, peer_group)
                    if peer_active is not None:
                        self.moved[message] = max(active, peer_active) + self.transfer(message)
                if all(message in self.moved for message in self.members[rank][group]):
                    self.group_done[rank][group] = max(self.moved[m] for m in self.members[rank][group])
                    self.head[rank] += 1
                    changed = True

    def _peer(self, rank: int, message: Message) -> int:
        kind, stage, microbatch = message
        consumer_stage = stage + 1 if kind is ActionKind.F else stage - 1
        producer = self.schedule.rank_of(stage, microbatch)
        return self.schedule.rank_of(consumer_stage, microbatch) if producer == rank else producer

    # ---- the lock-step loop ---------------------------------------------------------------------
    def at_barrier(self, rank: int) -> bool:
        barriers = self.barriers[rank]
        return self.barriers_passed < len(barriers) and self.position[rank] == barriers[self.barriers_passed]

    def run(self) -> list[ReplayedAction]:
        schedule, replayed = self.schedule, []
        while any(self.position[r] < len(schedule.actions[r]) or self.at_barrier(r) for r in range(schedule.p)):
            if self.transport is Transport.NCCL:
                self.settle()
            if self._pass_barrier():
                continue
            runnable = []
            for rank in range(schedule.p):
                if self.position[rank] < len(schedule.actions[rank]) and not self.at_barrier(rank):
                    start = self.ready_time(rank)
                    if start is not None:
                        runnable.append((rank, schedule.actions[rank][self.position[rank]], start))
            if not runnable:
                raise self._deadlock()
            for rank, action, start in runnable:
                replayed.append(self._run(rank, action, start))
        if self.transport is Transport.NCCL and self.explicit:
            self.settle()
            pending = [r for r in range(schedule.p) if self.head[r] < len(self.group_size[r])]
            if pending:
                raise self._deadlock(finished=True)
        return [self._with_arrival(step) if step.action.kind.is_communication else step for step in replayed]

    def _pass_barrier(self) -> bool:
        """Record ranks arriving at the current barrier; pass it once all have. True if it passed."""
        p = self.schedule.p
        for rank in range(p):
            if self.at_barrier(rank) and self.barrier_arrival[rank] is None:
                self.barrier_arrival[rank] = self.clock[rank]
        if any(arrived is None for arrived in self.barrier_arrival):
            return False
        done = max(self.barrier_arrival)
        self.clock = [max(c, done) for c in self.clock]
        self.barrier_arrival = [None] * p
        self.barriers_passed += 1
        return True

    def _run(self, rank: int, action: Action, start: Real) -> ReplayedAction:
        index = self.position[rank]
        end = start + self._compute_time(rank, index, action)
        self.clock[rank] = end
        if action.kind.is_communication:
            message = message_of(action)
            (self.sent if action.kind.is_send else self.posted)[message] = start
            group = self.groups[rank][index]
            self.group_posted[rank].setdefault(group, start)
            self.members[rank].setdefault(group, []).append(message)
            self.end_of[(rank, message)] = group
        else:
            for made in results_of(action):
                self.ended[made] = end
        self.position[rank] += 1
        return ReplayedAction(rank, index, action, start, end)

    def _compute_time(self, rank: int, index: int, action: Action) -> Real:
        if action.kind.is_communication or action.overlapped:
            return 0  # an overlapped backward's time is in its pair's, charged to the forward
        partner = self.partner_of[rank].get(index)
        if partner is None:
            return self.duration(rank, action)
        if self.pair is not None:
            return self.pair(rank, action, self.schedule.actions[rank][partner])
        return self.overlap(self.duration(rank, action), self.duration(rank, self.schedule.actions[rank][partner]))

    def _with_arrival(self, step: ReplayedAction) -> ReplayedAction:
        """A send or receive ends when its message arrives (never, if its partner is missing)."""
        arrived = self.arrival(message_of(step.action))
        return ReplayedAction(step.rank, step.index, step.action, step.start,
                              step.start if arrived is None else arrived)

    # ---- explaining a deadlock ------------------------------------------------------------------
    def _deadlock(self, finished: bool = False) -> ScheduleError:
        schedule = self.schedule
        stuck = [r for r in range(schedule.p) if self.position[r] < len(schedule.actions[r]) or self.at_barrier(r)
                 or (finished and self.head[r] < len(self.group_size[r]))]
        marks = [(r, min(self.position[r], len(schedule.actions[r]) - 1)) for r in stuck]
        edges = {r: self._blocker(r) for r in stuck}
        cycle = _cycle(stuck[0], edges)
        lines = [f"  rank {r} {edges[r][1]}" for r in cycle] if cycle else [f"  rank {r} {edges[r][1]}" for r in stuck]
        rank = stuck[0]
        where = ("after its last action" if self.position[rank] >= len(schedule.actions[rank])
                 else f"at {schedule.actions[rank][self.position[rank]]} (position {self.position[rank]})")
        return ScheduleError(
            f"deadlock under the {self.transport.value} transport: every unfinished rank is blocked, first rank "
            f"{rank} {where}; {'the cycle of waits' if cycle else 'the waits'}:\n" + "\n".join(lines) +
            "\nreorder the lists (or their sends and receives) so every input is produced and posted before it is "
            f"needed.\n{format_grid(schedule, marks=marks)}")

    def _blocker(self, rank: int) -> tuple[Optional[int], str]:
        """(the rank that ``rank`` waits for, a sentence saying why)."""
        schedule = self.schedule
        if self.at_barrier(rank):
            missing = [r for r in range(schedule.p) if self.barrier_arrival[r] is None and not self.at_barrier(r)]
            return (missing[0] if missing else None,
                    f"waits at a collective between calls for ranks {missing} to reach it")
        if self.position[rank] < len(schedule.actions[rank]):
            action = schedule.actions[rank][self.position[rank]]
            for wait in self.waits[rank][self.position[rank]]:
                if self.wait_end(rank, wait) is not None:
                    continue
                if not wait.message:
                    producer = self._rank_of_key(wait.key)
                    return producer, f"at {action} waits for {wait.describe()} on rank {producer}"
                if self.transport is Transport.NCCL and self.explicit:
                    group = self.end_of.get((rank, wait.key))
                    if group is not None:
                        return self._group_blocker(rank, self.head[rank], f"at {action} waits for its receive's group")
                sender = self._rank_of_key(wait.key)
                return sender, f"at {action} waits for {wait.describe()} on rank {sender}, not yet sent"
        return self._group_blocker(rank, self.head[rank], "has finished its list")

    def _group_blocker(self, rank: int, group: int, prefix: str) -> tuple[Optional[int], str]:
        """Why head ``group`` of ``rank`` has not completed: the first of its messages that cannot move."""
        for message in self.members[rank].get(group, ()):
            if message in self.moved:
                continue
            peer = self._peer(rank, message)
            peer_group = self.end_of.get((peer, message))
            what = f"{message[0].value}{message[1]}.{message[2]}"
            if peer_group is None:
                return peer, (f"{prefix}; its pending group holds the message of {what}, whose other end rank "
                              f"{peer} has not posted")
            return peer, (f"{prefix}; its pending group holds the message of {what}, whose other end on rank "
                          f"{peer} sits in a group queued behind that rank's unfinished group")
        return None, f"{prefix}; its group is not fully posted"

    def _rank_of_key(self, key: Message) -> int:
        kind, stage, microbatch = key
        return self.schedule.rank_of(stage, microbatch)


def _cycle(start: int, edges: dict[int, tuple[Optional[int], str]]) -> list[int]:
    """The ranks of the cycle reached by following each rank's blocker from ``start`` (empty if none)."""
    seen, rank = [], start
    while rank is not None and rank in edges and rank not in seen:
        seen.append(rank)
        rank = edges[rank][0]
    return seen[seen.index(rank):] if rank in seen else []
