"""Check a schedule before anything runs it; explain the first problem with a marked grid.

The checks, in order: every action names a stage its rank holds and a microbatch in range,
and a send or receive names the right peer; every (stage, microbatch) has exactly one F and
one B, and (or one BI and one BW), every rank one STEP (flush schedules) or UPDATEs of its stages (asynchronous
schedules, whose UPDATE and weight-version rules ``validate_updates`` checks); on each rank
F comes before its B or BI, BI before its BW, a send after the compute that makes its tensor, STEP after all the
rank's B and BW; if the schedule has SEND/RECV actions,
every tensor crossing ranks has exactly one send and one receive, the receive comes before
its consumer (or the forward an overlapped consumer runs with), and between two ranks
receives are posted in the order the sender sends;
finally a replay of all lists (``replay.replay``) finds no deadlock under each transport model
(``transport.py``: gloo and NCCL), which also covers F of stage s+1 running before F of stage s
could have arrived.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable, NoReturn, Optional, Sequence

from megapipe.errors import ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.grid import format_grid
from megapipe.schedules.transport import ALL_TRANSPORTS, Transport
from megapipe.schedules.replay import input_producer, message_of, outgoing_messages, overlap_partners, replay
from megapipe.schedules.validate_updates import check_updates_and_versions, is_asynchronous

__all__ = ["validate_schedule", "format_grid"]


def validate_schedule(schedule: Schedule, transports: Iterable[Transport] = ALL_TRANSPORTS,
                      barriers: Optional[Sequence[Sequence[int]]] = None) -> None:
    """Raise ScheduleError naming the first bad action of ``schedule``; return if it is sound.

    ``barriers``: per rank, list positions where a collective sits between two calls (the
    segments of an asynchronous schedule); the lists must be deadlock-free with them too.
    """
    _check_placement(schedule)
    _check_counts(schedule)
    _check_rank_order(schedule)
    if is_asynchronous(schedule):
        check_updates_and_versions(schedule, _fail)
    if schedule.has_communication:
        _check_messages(schedule)
    for transport in transports:
        replay(schedule, transport=transport)
        if barriers is not None:
            replay(schedule, transport=transport, barriers=[list(b) for b in barriers])


def _fail(schedule: Schedule, rank: Optional[int], index: Optional[int], sentence: str) -> NoReturn:
    marks = [] if rank is None else [(rank, index)]
    raise ScheduleError(f"{sentence}\n{format_grid(schedule, marks)}")


def _expected_peer(schedule: Schedule, action: Action) -> Optional[int]:
    """The rank a send or receive must name, or None if its stage has no such neighbour."""
    offset = 1 if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B) else -1
    neighbour = action.stage + offset
    if not 0 <= neighbour < schedule.num_stages:
        return None
    return schedule.rank_of(neighbour, action.microbatch)


def _check_placement(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            problem = _placement_problem(schedule, rank, action)
            if problem:
                _fail(schedule, rank, index, f"rank {rank} position {index}: {action} {problem}.")


def _placement_problem(schedule: Schedule, rank: int, action: Action) -> str:
    """What is wrong with where ``action`` sits, or '' if nothing."""
    if action.kind is ActionKind.STEP:
        return ""
    if action.stage >= schedule.num_stages:
        return (f"names stage {action.stage}, but the schedule has only {schedule.num_stages} stages "
                f"(p={schedule.p} x v={schedule.v})")
    if action.microbatch >= schedule.num_microbatches:
        batches = "" if schedule.batches == 1 else f" per batch x {schedule.batches} batches"
        return f"names microbatch {action.microbatch}, but there are only m={schedule.m}{batches}"
    if action.kind is ActionKind.UPDATE:
        holders = schedule.ranks_of_stage(action.stage)
        return "" if rank in holders else f"updates stage {action.stage}, which lives on rank(s) {holders}"
    owner = schedule.rank_of(action.stage, action.microbatch)
    if owner != rank:
        which = "" if schedule.stage_replicas(action.stage) == 1 else f" for microbatch {action.microbatch}"
        return f"names stage {action.stage}{which}, which lives on rank {owner}; move it there"
    if action.kind.is_communication:
        expected = _expected_peer(schedule, action)
        if expected is None or expected == rank:
            return "is not a valid message: its stage has no neighbour on another rank in that direction"
        if action.peer != expected:
            return f"is not a valid message: its peer must be rank {expected}"
    return ""


def _check_counts(schedule: Schedule) -> None:
    seen: Counter = Counter()
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            key = (rank, action.kind, action.stage, action.microbatch)
            seen[key] += 1
            if seen[key] > 1:
                _fail(schedule, rank, index, f"rank {rank} runs {action} twice (again at position {index}); "
                                             "keep exactly one.")
    asynchronous = is_asynchronous(schedule)
    for rank in range(schedule.p):
        if asynchronous and seen[(rank, ActionKind.STEP, None, None)]:
            _fail(schedule, None, None, f"rank {rank} mixes STEP with UPDATE; an asynchronous schedule updates each "
                                        "stage with UPDATE actions and has no flush STEP.")
        if not asynchronous and not seen[(rank, ActionKind.STEP, None, None)]:
            _fail(schedule, None, None, f"rank {rank} has no STEP; end its list with STEP after its last backward.")
        for stage in schedule.stages_on_rank(rank):
            for microbatch in schedule.microbatches_on(rank, stage):
                runs = {kind for kind in (ActionKind.F, ActionKind.B, ActionKind.BI, ActionKind.BW)
                        if seen[(rank, kind, stage, microbatch)]}
                backward = runs - {ActionKind.F}
                missing = [kind.value for kind in (ActionKind.F, ActionKind.B)
                           if kind not in runs and (kind is ActionKind.F or not backward)]
                if missing:
                    _fail(schedule, None, None, f"rank {rank} never runs {missing[0]}{stage}.{microbatch}; every stage "
                                                "needs one F and one B (or one BI and one BW) per microbatch.")
                if backward not in ({ActionKind.B}, {ActionKind.BI, ActionKind.BW}):
                    _fail(schedule, None, None, f"rank {rank} runs {'/'.join(sorted(k.value for k in backward))} for "
                                                f"stage {stage} microbatch {microbatch}; a stage needs either one B or "
                                                "one BI and one BW per microbatch.")


def _check_rank_order(schedule: Schedule) -> None:
    for rank, actions in enumerate(schedule.actions):
        done: set[tuple] = set()
        partners = overlap_partners(actions)
        for index, action in enumerate(actions):
            if action.overlapped:
                forward = actions[partners[index]] if index in partners else None
                if forward is None or forward.kind is not ActionKind.F or forward.microbatch == action.microbatch:
                    _fail(schedule, rank, index, f"rank {rank} overlaps {action} with "
                                                 f"{forward or 'nothing'}; an overlapped backward follows the "
                                                 "forward of another microbatch it runs with.")
            if action.kind.makes_input_grad and (ActionKind.F, action.stage, action.microbatch) not in done:
                _fail(schedule, rank, index, f"rank {rank} runs {action} before F{action.stage}.{action.microbatch}; "
                                             "a backward needs its forward first.")
            if action.kind is ActionKind.BW and (ActionKind.BI, action.stage, action.microbatch) not in done:
                _fail(schedule, rank, index, f"rank {rank} runs {action} before BI{action.stage}.{action.microbatch}; "
                                             "the weight gradients need the input gradient's pass first.")
            if action.kind.is_send:
                makers = [ActionKind.F] if action.kind is ActionKind.SEND_F else [ActionKind.B, ActionKind.BI]
                if not any((kind, action.stage, action.microbatch) in done for kind in makers):
                    producer = "/".join(kind.value for kind in makers)
                    _fail(schedule, rank, index, f"rank {rank} runs {action} before the "
                                                 f"{producer}{action.stage}.{action.microbatch} that makes its "
                                                 "tensor; put the send after it.")
            if action.kind is ActionKind.STEP:
                backwards = sum(1 for key in done if key[0].makes_weight_grads)
                expected = sum(len(schedule.microbatches_on(rank, s)) for s in schedule.stages_on_rank(rank))
                if backwards < expected:
                    _fail(schedule, rank, index, f"rank {rank} runs STEP after only {backwards} of its "
                                                 f"{expected} backwards; move STEP after the last one.")
            done.add((action.kind, action.stage, action.microbatch))


def _positions(schedule: Schedule) -> list[dict[tuple, int]]:
    """Per rank, where each (kind, stage, microbatch) sits in its list (counts are already checked)."""
    return [{(a.kind, a.stage, a.microbatch): index for index, a in enumerate(actions)}
            for actions in schedule.actions]


def _key(action: Action) -> tuple:
    return (action.kind, action.stage, action.microbatch)


def _check_messages(schedule: Schedule) -> None:
    positions = _positions(schedule)
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            messages = outgoing_messages(schedule, action)
            if messages is None:
                continue
            send, recv = messages
            receiver = send.peer
            send_at, recv_at = positions[rank].get(_key(send)), positions[receiver].get(_key(recv))
            if send_at is None and recv_at is None:
                _fail(schedule, rank, index, f"rank {rank}'s {action} feeds rank {receiver} but has no {send} and "
                                             f"rank {receiver} no {recv}; run add_communication on the compute-only "
                                             "lists.")
            if recv_at is None:
                _fail(schedule, rank, send_at, f"rank {rank}'s {send} has no matching {recv} on rank {receiver}; "
                                               "add the receive before the compute that consumes it.")
            if send_at is None:
                _fail(schedule, receiver, recv_at, f"rank {receiver}'s {recv} has no matching {send} on rank "
                                                   f"{rank}; add the send after {action}.")
    for rank, actions in enumerate(schedule.actions):
        starts = overlap_partners(actions)  # an overlapped backward starts with its forward
        for index, action in enumerate(actions):
            producer = input_producer(schedule, action) if action.kind.is_compute else None
            if producer is None or schedule.rank_of(producer.stage, producer.microbatch) == rank:
                continue
            _, recv = outgoing_messages(schedule, producer)
            start = starts.get(index, index)
            if positions[rank][_key(recv)] > start:
                _fail(schedule, rank, start, f"rank {rank} runs {actions[start]} before posting the {recv} "
                                             f"{'its pair ' if start != index else ''}consumes; post the receive "
                                             "earlier.")
    _check_message_order(schedule)


def _check_message_order(schedule: Schedule) -> None:
    """Between two ranks the k-th receive must expect the k-th message sent."""
    sends: defaultdict[tuple[int, int], list[Action]] = defaultdict(list)
    for sender, actions in enumerate(schedule.actions):
        for action in actions:
            if action.kind.is_send:
                sends[(sender, action.peer)].append(action)
    for receiver, actions in enumerate(schedule.actions):
        received: Counter = Counter()
        for index, action in enumerate(actions):
            if not action.kind.is_recv:
                continue
            sender, k = action.peer, received[action.peer]
            received[sender] += 1
            sent = sends[(sender, receiver)][k]
            if message_of(sent) != message_of(action):
                _fail(schedule, receiver, index, f"rank {receiver}'s receive number {k} from rank {sender} is "
                                                 f"{action}, but rank {sender}'s send number {k} to it is {sent}; "
                                                 "post receives in the order the sender sends.")
