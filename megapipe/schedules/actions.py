"""The schedule IR: a pipeline schedule is, per pipeline rank, an ordered list of ``Action``\\ s.

Stages. ``stage`` is always a *virtual* stage index ``0 .. p*v-1``. With v chunks per rank,
the schedule's ``placement`` (``layout/placement.py``) says where each lives: looped (Megatron's
interleaving, stage ``s`` on rank ``s % p`` as its chunk ``s // p``) or V (v = 2, rank r holds
stages r and 2p-1-r). Without chunks v = 1 and stage = rank. An action always names a stage
held by the rank whose list it is in.

Kinds and what an executor does for each, in list order:

* ``F s.i`` -- forward of microbatch i through stage s. Its input is the data (s = 0), the
  output of F s-1.i on this rank (same rank, p = 1), or the tensor of the ``RECV_F s.i``
  posted earlier in this list.
* ``B s.i`` -- backward of microbatch i through stage s, using what F s.i saved. Its output
  gradient comes from the loss (last stage), from B s+1.i on this rank, or from the
  ``RECV_B s.i`` posted earlier in this list.
* ``BI s.i`` and ``BW s.i`` -- the backward of microbatch i through stage s split in two
  (zero-bubble schedules): ``BI`` computes the gradient with respect to the stage input (what
  ``SEND_B`` sends, what B s-1.i waits for), leaving the weight-gradient products of its
  linear layers for later; ``BW`` computes those and accumulates them (``tensor_parallel/split_backward.py``).
  A plain ``B`` is both at once. A stage and microbatch has either one ``B`` or one ``BI``
  followed by one ``BW`` on its rank; what the products need is held until ``BW``.
* ``&B s.i`` (or ``&BI s.i``) -- a backward *overlapped* with the forward just before it among
  its rank's computes (DualPipe's F&B pair, of another microbatch and usually the other
  chunk): the pair starts once both have their inputs and, on an accelerator, the two hide
  each other's communication and idle units; the simulator charges the pair
  ``CostModel.overlap`` of the two times. The executor runs the forward, then the backward, or
  with ``--overlap-moe-expert-parallel-comm`` both together, interleaved by ``overlap.PAIR``
  (``overlapped`` changes no result, only when the pair's inputs must be there: both
  receives are posted before the forward).
* ``SEND_F s.i>r`` -- send the output of F s.i to pipeline rank r (which holds stage s+1).
* ``RECV_F s.i<r`` -- receive the input of stage s, microbatch i, from pipeline rank r.
* ``SEND_B s.i>r`` -- send the input gradient of B s.i to rank r (which holds stage s-1).
* ``RECV_B s.i<r`` -- receive the output gradient of stage s, microbatch i, from rank r.
* ``STEP`` -- optimizer step of all this rank's chunks after the flush: all-reduce the
  gradients over the data-parallel group, then update.
* ``UPDATE s.i`` -- asynchronous schedules (PipeDream, 2BW) only: stage s applies, on its own,
  the gradients of its microbatches up to i that no earlier UPDATE applied, creating the next
  weight version of stage s. When stage s is replicated, i is the last microbatch of the
  update on any replica; every replica runs the same UPDATE, which all-reduces the gradients
  among them first (a collective).

Executor contract (what makes the lists deadlock-free, see ``communication.py``): sends and
receives are *posted* without blocking at their place in the list; a compute action waits
only for the receive it consumes; a rank waits for its own sends to complete no later than
the end of its list. Between one ordered pair of ranks the k-th send matches the k-th
receive, so no tags are needed.

Weight versions. ``version`` is ``None`` for the flush schedules (one weight version).
PipeDream (weight stashing) and 2BW set it on F and B to name the weight version of the
stage the pass must use: version k of stage s is its weights after its first k UPDATEs. Its
text form is a ``v`` suffix, e.g. ``F3.1v2``.

Placement. Without replication stage s lives where ``Schedule.placement`` puts it. A schedule over a stage
plan with replicated stages (PipeDream's "2-1") has one list per worker, workers numbered
stage by stage, and replica ``i % R`` of a stage with R replicas runs microbatch i (1F1B-RR);
``Schedule.rank_of(stage, microbatch)`` answers both cases.

Batches. A flush schedule's lists cover one batch of m microbatches. An asynchronous
schedule has no flush; its lists are its *unrolled form* over ``batches`` consecutive
batches (microbatches ``0 .. batches*m - 1``): warm-up, steady state, drain. The executor
runs it as a periodic program, one batch per call (see ``program.py``).

Text form, used in grids and schedule files: ``F3.1`` (forward, stage 3, microbatch 1),
``B0.7``, ``BI2.3``, ``BW2.3``, ``&B5.0``, ``SEND_F3.1>0``, ``RECV_B2.5<3``, ``STEP``,
``UPDATE2.7``. ``parse_action`` reads it back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional

from megapipe.errors import ScheduleError
from megapipe.layout.placement import Placement, chunk_of_stage, rank_of_stage, stages_of_rank
from megapipe.layout.placement import first_worker, stage_of_worker


class ActionKind(str, Enum):
    """What an action does; the value is its text form."""

    F = "F"
    B = "B"
    BI = "BI"
    BW = "BW"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    STEP = "STEP"
    UPDATE = "UPDATE"

    # The predicates below run millions of times in replays and searches: each tests the kind's
    # text against a set of texts (hashing a str is cached; an Enum's own hash runs Python).

    @property
    def is_compute(self) -> bool:
        return self._value_ in _COMPUTE

    @property
    def is_backward(self) -> bool:
        return self._value_ in _BACKWARD

    @property
    def makes_input_grad(self) -> bool:
        """B or BI: the action whose result SEND_B sends and B/BI of the previous stage consumes."""
        return self is ActionKind.B or self is ActionKind.BI

    @property
    def makes_weight_grads(self) -> bool:
        """B or BW: the action after which the stage's weight gradients of the microbatch are complete."""
        return self is ActionKind.B or self is ActionKind.BW

    @property
    def is_optimizer_step(self) -> bool:
        return self._value_ in _OPTIMIZER_STEP

    @property
    def is_send(self) -> bool:
        return self is ActionKind.SEND_F or self is ActionKind.SEND_B

    @property
    def is_recv(self) -> bool:
        return self is ActionKind.RECV_F or self is ActionKind.RECV_B

    @property
    def is_communication(self) -> bool:
        return self._value_ in _COMMUNICATION


_COMPUTE = frozenset({"F", "B", "BI", "BW"})
_BACKWARD = frozenset({"B", "BI", "BW"})
_OPTIMIZER_STEP = frozenset({"STEP", "UPDATE"})
_COMMUNICATION = frozenset(kind.value for kind in ActionKind) - _COMPUTE - _OPTIMIZER_STEP


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank; see the module docstring for each kind's meaning.

    ``stage`` and ``microbatch`` are ``None`` only for ``STEP``; ``peer`` is the pipeline rank
    at the other end and is set exactly for communication kinds; ``version`` only on F and B
    (and the messages they cause) of asynchronous schedules; ``overlapped`` only on B or BI
    that runs overlapped with the forward before it.
    """

    kind: ActionKind
    stage: Optional[int] = None
    microbatch: Optional[int] = None
    peer: Optional[int] = None
    version: Optional[int] = None
    overlapped: bool = False

    def __post_init__(self):
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.kind is ActionKind.STEP:
            if self.stage is not None or self.microbatch is not None or self.peer is not None:
                raise ScheduleError("a STEP action takes no stage, microbatch or peer; write it as plain STEP.")
            return
        if self.stage is None or self.microbatch is None or self.stage < 0 or self.microbatch < 0:
            raise ScheduleError(f"{self.kind.value} needs a stage and a microbatch that are non-negative integers, "
                                f"got stage {self.stage} and microbatch {self.microbatch}.")
        if self.kind.is_communication != (self.peer is not None):
            raise ScheduleError(f"{self.kind.value} {self.stage}.{self.microbatch}: communication actions need a peer "
                                "rank and compute actions must not have one.")
        if self.overlapped and not self.kind.makes_input_grad:
            raise ScheduleError(f"{self.kind.value}{self.stage}.{self.microbatch}: only a B or BI can be overlapped "
                                "with the forward before it; drop the &.")
        if self.kind is ActionKind.UPDATE and self.version is not None:
            raise ScheduleError(f"UPDATE{self.stage}.{self.microbatch} takes no version: it creates the next one.")

    def __str__(self) -> str:
        if self.kind is ActionKind.STEP:
            return "STEP"
        text = ("&" if self.overlapped else "") + f"{self.kind.value}{self.stage}.{self.microbatch}"
        if self.version is not None:
            text += f"v{self.version}"
        if self.peer is not None:
            text += (">" if self.kind.is_send else "<") + str(self.peer)
        return text


_ACTION_PATTERN = re.compile(
    r"(&?)(SEND_F|RECV_F|SEND_B|RECV_B|UPDATE|F|BI|BW|B)(\d+)\.(\d+)(?:v(\d+))?(?:([<>])(\d+))?")


def parse_action(text: str) -> Action:
    """Read one action from its text form (the inverse of ``str(action)``)."""
    token = text.strip()
    if token == "STEP":
        return Action(ActionKind.STEP)
    match = _ACTION_PATTERN.fullmatch(token)
    if match is None:
        raise ScheduleError(f"cannot read action {token!r}; write e.g. F3.1, B0.2, BI0.2, BW0.2, &B0.2, SEND_F3.1>0, "
                            "RECV_B2.5<3, UPDATE1.3 or STEP.")
    overlapped, kind, stage, microbatch, version, arrow, peer = match.groups()
    kind = ActionKind(kind)
    if kind.is_communication and arrow != (">" if kind.is_send else "<"):
        expected = ">peer" if kind.is_send else "<peer"
        raise ScheduleError(f"action {token!r} needs its peer rank written as {expected}.")
    return Action(kind, int(stage), int(microbatch),
                  peer=None if peer is None else int(peer),
                  version=None if version is None else int(version), overlapped=bool(overlapped))


@dataclass(frozen=True)
class Schedule:
    """A whole pipeline schedule: per pipeline rank, the ordered actions it runs.

    ``p`` pipeline ranks (workers), ``m`` microbatches per batch, ``v`` model chunks per rank,
    ``batches`` consecutive batches covered (1 for flush schedules, see the module
    docstring), ``replicas`` the number of workers of each stage when stages are replicated
    (None: one per stage), ``placement`` where the chunks of unreplicated stages live.
    ``actions[r]`` is rank r's list. Build one with ``build_schedule``
    or ``load_schedule`` (both validate); the constructor only checks the shape.
    """

    name: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[Action, ...], ...]
    batches: int = 1
    replicas: Optional[tuple[int, ...]] = None
    placement: Placement = Placement.LOOPED

    def __post_init__(self):
        object.__setattr__(self, "actions", tuple(tuple(rank_actions) for rank_actions in self.actions))
        object.__setattr__(self, "placement", Placement(self.placement))
        if self.placement is Placement.V and (self.v != 2 or self.replicas is not None):
            raise ScheduleError(f"schedule {self.name!r}: the V placement holds two chunks per rank (v=2) and no "
                                f"replicated stages, got v={self.v}.")
        if self.p < 1 or self.m < 1 or self.v < 1 or self.batches < 1:
            raise ScheduleError(f"schedule {self.name!r} needs p, m, v and batches of at least 1, got p={self.p}, "
                                f"m={self.m}, v={self.v}, batches={self.batches}.")
        if len(self.actions) != self.p:
            raise ScheduleError(f"schedule {self.name!r} has {len(self.actions)} action lists for p={self.p} "
                                "pipeline ranks; give exactly one list per rank.")
        if self.replicas is not None:
            object.__setattr__(self, "replicas", tuple(self.replicas))
            if self.v != 1 or min(self.replicas, default=0) < 1 or sum(self.replicas) != self.p:
                raise ScheduleError(f"schedule {self.name!r}: stage replicas {list(self.replicas)} must be positive "
                                    f"and add up to p={self.p} workers, with v=1.")

    @property
    def num_stages(self) -> int:
        return len(self.replicas) if self.replicas is not None else self.p * self.v

    @property
    def num_microbatches(self) -> int:
        """Microbatch ids the lists use: 0 .. batches * m - 1."""
        return self.m * self.batches

    def stage_replicas(self, stage: int) -> int:
        return 1 if self.replicas is None else self.replicas[stage]

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``stage`` for ``microbatch`` (round robin over a replicated stage)."""
        if self.replicas is None:
            return rank_of_stage(self.placement, self.p, stage)
        return first_worker(self.replicas, stage) + microbatch % self.replicas[stage]

    def ranks_of_stage(self, stage: int) -> list[int]:
        """Every rank that holds ``stage`` (its replicas, in replica order)."""
        if self.replicas is None:
            return [rank_of_stage(self.placement, self.p, stage)]
        first = first_worker(self.replicas, stage)
        return list(range(first, first + self.replicas[stage]))

    def rank_of_stage(self, stage: int) -> int:
        """The rank of an unreplicated stage."""
        ranks = self.ranks_of_stage(stage)
        if len(ranks) != 1:
            raise ValueError(f"stage {stage} is replicated on ranks {ranks}; use rank_of(stage, microbatch)")
        return ranks[0]

    def chunk_of_stage(self, stage: int) -> int:
        return 0 if self.replicas is not None else chunk_of_stage(self.p, stage)

    def stages_on_rank(self, rank: int) -> list[int]:
        """The virtual stages rank ``rank`` holds, in chunk order."""
        if self.replicas is not None:
            return [stage_of_worker(self.replicas, rank)]
        return stages_of_rank(self.placement, self.p, self.v, rank)

    def microbatches_on(self, rank: int, stage: int) -> range:
        """The microbatches ``rank`` runs ``stage`` for (all of them unless the stage is replicated)."""
        replicas = self.stage_replicas(stage)
        return range(self.ranks_of_stage(stage).index(rank) if replicas > 1 else 0, self.num_microbatches, replicas)

    @property
    def splits_backward(self) -> bool:
        """Whether some backward is split into BI and BW (its weight gradients deferred to BW)."""
        return any(action.kind is ActionKind.BI for actions in self.actions for action in actions)

    @property
    def has_communication(self) -> bool:
        return any(action.kind.is_communication for rank_actions in self.actions for action in rank_actions)

    def with_actions(self, actions) -> "Schedule":
        """The same schedule (name, sizes, placement) with other lists."""
        return replace(self, actions=actions)

    def compute_only(self) -> "Schedule":
        """The same schedule without SEND/RECV actions (what generators and files hold)."""
        return self.with_actions([[a for a in rank_actions if not a.kind.is_communication]
                                  for rank_actions in self.actions])

    def to_text(self) -> str:
        """One line per rank, actions separated by spaces (the schedule file format)."""
        return "\n".join(" ".join(str(a) for a in rank_actions) for rank_actions in self.actions) + "\n"
