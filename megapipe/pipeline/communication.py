"""The one pass that turns compute-only lists into lists with SEND_* and RECV_* actions.

Rule: replay the compute-only lists in lock-step rounds (``replay.replay``). When a compute
action whose output another rank consumes is replayed, append it and then its ``SEND`` to
its own rank's list, and at the same moment append the matching ``RECV`` to the consumer's
rank list. A rank never places its own receives: the sender decides where they go.

Why this cannot deadlock (under the executor contract in ``actions.py``: sends and
receives are posted without blocking, a compute waits only for the receive it consumes):

* Every receive lands before the compute that consumes it, because the consumer could not
  be replayed before its producer, and the receive was appended when the producer was.
* Between any ordered pair of ranks, sends and receives are appended in the same global
  order, so the k-th send matches the k-th receive: no tags, no crossed messages.
* The replay itself is an execution of the new lists in which every wait is met by an
  action replayed earlier, so the earliest blocked action of any real run would be waiting
  for something that already happened, which is impossible.

With p = 1 every neighbour is on the same rank and no message is added. With
interleaving the edge from stage p-1 (last rank) to stage p (rank 0) becomes a message from
the last rank to rank 0, and the gradient goes back the same way.
"""

from __future__ import annotations

from megapipe.errors import ScheduleError
from megapipe.pipeline.actions import Action, Schedule
from megapipe.pipeline.replay import outgoing_messages, replay


def add_communication(schedule: Schedule) -> Schedule:
    """Return ``schedule`` (compute-only) with its sends and receives inserted by the rule above."""
    if schedule.has_communication:
        raise ScheduleError(f"schedule {schedule.name!r} already has SEND/RECV actions; pass its compute_only() "
                            "form to add_communication.")
    lists: list[list[Action]] = [[] for _ in range(schedule.p)]
    for step in replay(schedule):
        lists[step.rank].append(step.action)
        messages = outgoing_messages(schedule, step.action)
        if messages is not None:
            send, recv = messages
            lists[step.rank].append(send)
            lists[schedule.rank_of_stage(recv.stage)].append(recv)
    return Schedule(schedule.name, schedule.p, schedule.m, schedule.v, lists)
