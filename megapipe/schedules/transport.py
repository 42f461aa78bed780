"""Transport models: the rules under which posted sends and receives make progress.

A lowered list is correct only if it finishes under every transport it may run on, so the
lowering (``communication.py``), the replay (``replay.py``) and the validator take the model
as a parameter instead of assuming one.

* ``GLOO``: every send and receive progresses on its own once both ends are posted; a compute
  waits for the one receive it consumes.
* ``NCCL``: a maximal run of consecutive SEND/RECV actions of a list is posted as one
  ``batch_isend_irecv`` group, which completes as one unit (one Work for the whole group). The
  groups a rank issues on one communicator run in issue order: a group becomes *active* only
  when the rank's previous group has completed, and a message moves only while the groups
  holding both of its ends are active. A compute that consumes a receive waits for the whole
  group holding it. A collective on the same communicator would queue behind every pending
  group; megapipe issues none there (pipeline messages have a communicator of their own, see
  ``ParallelState.pp_group``), so the collectives a training loop runs between calls only
  need every rank's earlier computes to be done (``replay``'s *barriers*).

How the lowering satisfies both (the choice, and why). Receives are posted when their sender
sends (the compute-only replay gives each message a time ``t``, the end of the compute that
makes it): on the receiver, right before the compute still running at ``t``. Every compute
and optimizer action is given a positive duration in that replay, so on each rank the sends
made at ``t`` and the receives of messages sent at ``t`` are adjacent and fall into one
group, and a rank's groups hold messages of increasing times. Under NCCL every wait then
points to an event of smaller time: a compute ending at ``T`` waits for groups whose messages
were all sent before ``T``; a group becomes active after the compute that precedes it (which
ended no later than its messages' times) and after earlier groups (earlier times); messages
of one group never wait for each other. No cycle of waits can form, which is the argument
Megatron's paired ``send_forward_recv_backward`` makes for 1F1B, generalised to any order.
Splitting groups or one communicator per direction would also work, but the first costs
more kernel launches and the second doubles the communicators a pipeline holds; pairing by
time needs neither. The property test replays every registered schedule under both models.
"""

from __future__ import annotations

from enum import Enum

from megapipe.schedules.actions import Action


class Transport(str, Enum):
    """How posted messages progress; the value is the ``torch.distributed`` backend name."""

    GLOO = "gloo"
    NCCL = "nccl"

    @classmethod
    def of_backend(cls, backend: str) -> "Transport":
        """The model a process-group backend follows (any backend but gloo is held to NCCL's rules)."""
        return cls.GLOO if str(backend).lower() == "gloo" else cls.NCCL


ALL_TRANSPORTS = (Transport.GLOO, Transport.NCCL)


def group_ids(actions: tuple[Action, ...], breaks: tuple[int, ...] = ()) -> list[int]:
    """Per action, the index of the ``batch_isend_irecv`` group it is posted in (-1 for compute).

    A group is a maximal run of consecutive SEND/RECV actions, exactly as the executor posts
    them; ``breaks`` are positions where a call starts, which no group spans.
    """
    ids, group, previous_was_communication = [], -1, False
    for index, action in enumerate(actions):
        if action.kind.is_communication:
            if not previous_was_communication or index in breaks:
                group += 1
            ids.append(group)
            previous_was_communication = True
        else:
            ids.append(-1)
            previous_was_communication = False
    return ids
