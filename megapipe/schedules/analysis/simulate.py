"""Discrete-event simulation of a Schedule with per-action costs.

Model: each rank runs its list in order; a compute action starts when the rank is free and
its inputs are there (``replay.replay``); sends and receives are non-blocking and overlap
compute; a message arrives ``latency + bytes / bandwidth`` after both its send and its
receive are posted (links have no contention). With integer or Fraction costs every number
reported is exact, so tests can compare with the closed forms, e.g. unit costs (F=1, B=2,
free messages) give a bubble of (p-1)/(m+p-1) for GPipe and 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from numbers import Real
from typing import Callable, Optional, Sequence, Union

from megapipe.layout.placement import Placement, rank_of_stage
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.communication import add_communication
from megapipe.schedules.overlap import PAIR, PairPlan
from megapipe.schedules.replay import Message, message_of, overlap_partners, replay
from megapipe.schedules.analysis.timeline import Timeline, ratio

StageCost = Union[Real, Sequence[Real], Callable[[int], Real]]
"""A time per virtual stage: one number for all, a sequence indexed by stage, or stage -> time."""


def _stage_cost(cost: StageCost, stage: int) -> Real:
    if callable(cost):
        return cost(stage)
    if isinstance(cost, Sequence):
        return cost[stage]
    return cost


def _exact(time: Real) -> Fraction:
    """A measured time as a Fraction of microsecond resolution (floats' binary fractions slow the replay)."""
    return Fraction(time).limit_denominator(10 ** 6) if isinstance(time, float) else Fraction(time)


@dataclass(frozen=True)
class CostModel:
    """Times of forward, backward and optimizer step, and of messages (latency + bytes / bandwidth).

    A split backward's parts cost ``input_backward`` (BI) and ``weight_backward`` (BW); left
    out, each is half of ``backward``. ``overlap(f, b)`` is the time of a forward and a
    backward run overlapped (DualPipe's F&B): ``max`` when one hides the other entirely,
    ``operator.add`` when they gain nothing (what a single CPU thread does).

    Expert parallelism: every F, B and BI of a stage also runs ``expert_comm`` of all-to-alls (its
    ``moe_layers`` MoE layers' dispatches and combines; a BW none). With ``hide_expert_comm``
    (``--overlap-moe-expert-parallel-comm``) an overlapped pair costs ``overlapped_pair_time``: the two
    computes one after the other, each all-to-all hidden up to the other pass's compute beside it.
    """

    forward: StageCost = 1
    backward: StageCost = 2
    input_backward: Optional[StageCost] = None
    weight_backward: Optional[StageCost] = None
    step: Real = 0
    latency: Real = 0
    message_bytes: Union[Real, Callable[[Message], Real]] = 0
    bandwidth: Optional[Real] = None  # bytes per time unit; None means infinitely fast
    overlap: Callable[[Real, Real], Real] = max
    expert_comm: StageCost = 0
    moe_layers: StageCost = 0
    hide_expert_comm: bool = False

    @classmethod
    def per_chunk(cls, v: int, forward: Real = 1, backward: Real = 2, **kwargs) -> "CostModel":
        """Costs for v chunks per rank that split a whole stage's forward and backward evenly."""
        return cls(forward=Fraction(forward) / v, backward=Fraction(backward) / v, **kwargs)

    @classmethod
    def per_rank(cls, p: int, v: int, forward: Sequence[Real], input_backward: Sequence[Real],
                 weight_backward: Sequence[Real], exact: bool = True, placement: Placement = Placement.LOOPED,
                 **kwargs) -> "CostModel":
        """Costs from each pipeline rank's times for one microbatch through all its chunks (lists
        indexed by rank, or one time for all), split evenly over its v chunks, which ``placement`` says
        (the schedule's: looped, or the V's); a whole B costs BI + BW.
        ``exact``: as Fractions (floats rounded to a millionth), else as floats (faster to replay)."""
        def per_stage(times: Sequence[Real]) -> tuple[Real, ...]:
            if len(times) not in (1, p):
                raise ValueError(f"{len(times)} times given for {p} pipeline ranks; give one per rank or one for all")
            convert = _exact if exact else float
            return tuple(convert(times[rank_of_stage(placement, p, s) % len(times)]) / v for s in range(p * v))

        return cls(forward=per_stage(forward), input_backward=per_stage(input_backward),
                   weight_backward=per_stage(weight_backward),
                   backward=tuple(a + b for a, b in zip(per_stage(input_backward), per_stage(weight_backward))),
                   **kwargs)

    def compute_time(self, rank: int, action: Action) -> Real:
        if not action.kind.is_compute:
            return self.step
        return self._compute_only(action) + self.exchange(action)

    def _compute_only(self, action: Action) -> Real:
        if action.kind is ActionKind.F:
            return _stage_cost(self.forward, action.stage)
        if action.kind is ActionKind.B:
            return _stage_cost(self.backward, action.stage)
        part = self.input_backward if action.kind is ActionKind.BI else self.weight_backward
        if part is None:
            return Fraction(_stage_cost(self.backward, action.stage)) / 2
        return _stage_cost(part, action.stage)

    def exchange(self, action: Action) -> Real:
        """The expert all-to-alls a pass runs (a BW runs none)."""
        return 0 if action.kind is ActionKind.BW else _stage_cost(self.expert_comm, action.stage)

    def pair_time(self, rank: int, forward: Action, backward: Action) -> Real:
        """The time of an overlapped pair (see the class docstring)."""
        if not self.hide_expert_comm:
            return self.overlap(self.compute_time(rank, forward), self.compute_time(rank, backward))
        return overlapped_pair_time(PAIR, (self._compute_only(forward), self.exchange(forward)),
                                    (self._compute_only(backward), self.exchange(backward)),
                                    _stage_cost(self.moe_layers, forward.stage),
                                    _stage_cost(self.moe_layers, backward.stage))

    def message_size(self, message: Message) -> Real:
        return self.message_bytes(message) if callable(self.message_bytes) else self.message_bytes

    def transfer_time(self, message: Message) -> Real:
        if self.bandwidth is None:
            return self.latency
        return self.latency + ratio(self.message_size(message), self.bandwidth)


@dataclass(frozen=True)
class SimulationResult:
    """What a simulated batch costs; per-rank tuples are indexed by pipeline rank."""

    schedule: Schedule
    makespan: Real
    busy_time: tuple[Real, ...]
    idle_fraction: tuple[Real, ...]  # of the makespan, per rank
    bubble_fraction: Real  # idle share of all ranks' time: mean of idle_fraction
    idle_in_span: tuple[Real, ...]  # per rank, idle time between its own first and last compute
    peak_activations: tuple[Fraction, ...]  # in units of one full stage's microbatch
    messages_sent: tuple[int, ...]
    bytes_sent: tuple[Real, ...]
    timeline: Timeline


def overlapped_pair_time(plan: PairPlan, forward: tuple[Real, Real], backward: tuple[Real, Real], moe_layers: int,
                         backward_moe_layers: Optional[int] = None) -> Real:
    """Time of an overlapped pair whose passes take (compute, all-to-all) each through ``moe_layers`` MoE
    layers (the backward's through ``backward_moe_layers``, default the same), each pass's compute spread
    evenly over its 2 L + 1 compute segments and its all-to-all over its 2 L exchanges: per slot the longer
    of what runs in it, so an all-to-all is hidden up to the other pass's compute beside it."""
    layers = (moe_layers, moe_layers if backward_moe_layers is None else backward_moe_layers)
    total = 0
    for segments in plan.slots(*layers):
        longest = 0
        for (compute, comm), segment, n in zip((forward, backward), segments, layers):
            if segment is not None:
                longest = max(longest, ratio(comm, 2 * n) if segment.communicates else ratio(compute, 2 * n + 1))
        total += longest
    return total


def exposed_expert_comm(schedule: Schedule, costs: CostModel) -> tuple[Real, ...]:
    """Per rank, the expert all-to-all time its passes run (``CostModel.expert_comm``) less what its overlapped
    pairs hide with ``hide_expert_comm``: a pair's passes alone take their computes and all-to-alls, the pair
    ``CostModel.pair_time`` (``overlapped_pair_time``), and the difference is all-to-all time spent beside the
    other pass's compute."""
    exposed = []
    for rank, actions in enumerate(schedule.actions):
        total = sum((costs.exchange(action) for action in actions if action.kind.is_compute), 0)
        for backward, forward in (overlap_partners(actions).items() if costs.hide_expert_comm else ()):
            alone = costs.compute_time(rank, actions[forward]) + costs.compute_time(rank, actions[backward])
            total -= alone - costs.pair_time(rank, actions[forward], actions[backward])
        exposed.append(total)
    return tuple(exposed)


def peak_activations(schedule: Schedule) -> list[Fraction]:
    """Per rank, the most microbatches forwarded but not yet backwarded at once, counted per
    chunk and divided by v so that a number is in units of one whole stage's activations. A
    split backward holds its forward's activations until BW (what the weight gradients need
    is most of them: the inputs of every matrix product)."""
    peaks = []
    for rank_actions in schedule.actions:
        in_flight = peak = 0
        for action in rank_actions:
            in_flight += (action.kind is ActionKind.F) - action.kind.makes_weight_grads
            peak = max(peak, in_flight)
        peaks.append(Fraction(peak, schedule.v))
    return peaks


def simulate(schedule: Schedule, costs: CostModel = CostModel()) -> SimulationResult:
    """Simulate one batch of ``schedule``.

    Compute-only lists first get their messages, with receives placed for these costs;
    lists that have them are simulated as they are (``build_schedule`` places receives for
    F = 1, B = 2 and free messages, so with slow messages re-lowering its compute_only()
    form may be faster).
    """
    if not schedule.has_communication:
        schedule = add_communication(schedule, costs.compute_time, costs.transfer_time)
    steps = replay(schedule, costs.compute_time, costs.transfer_time, pair=costs.pair_time)
    timeline = Timeline(meta={"schedule": schedule.name, "p": schedule.p, "m": schedule.m, "v": schedule.v})
    messages, sent_bytes = [0] * schedule.p, [0] * schedule.p
    for rank, start, end, action in _drawn(steps, costs):
        timeline.record(rank, action, start, end)
    for step in steps:
        if step.action.kind.is_send:
            messages[step.rank] += 1
            sent_bytes[step.rank] += costs.message_size(message_of(step.action))
    makespan = max(step.end for step in steps)  # every rank's clock starts at 0
    busy = timeline.busy_time()
    idle = timeline.idle_fraction(window=(0, makespan))
    return SimulationResult(
        schedule=schedule,
        makespan=makespan,
        busy_time=tuple(busy[r] for r in range(schedule.p)),
        idle_fraction=tuple(idle[r] for r in range(schedule.p)),
        bubble_fraction=ratio(sum(idle.values()), schedule.p),
        idle_in_span=tuple(_span(steps, r) - busy[r] for r in range(schedule.p)),
        peak_activations=tuple(peak_activations(schedule)),
        messages_sent=tuple(messages),
        bytes_sent=tuple(sent_bytes),
        timeline=timeline,
    )


def _drawn(steps, costs: CostModel):
    """(rank, start, end, action) to record: an overlapped pair's time, which the replay gives its forward,
    shared between its forward and backward in proportion to their own times, so both show."""
    by_position = {(step.rank, step.index): step for step in steps}
    drawn = {}
    for step in steps:
        drawn[(step.rank, step.index)] = (step.rank, step.start, step.end, step.action)
        if not step.action.overlapped:
            continue
        index = step.index - 1
        while not by_position[(step.rank, index)].action.kind.is_compute:
            index -= 1
        forward = by_position[(step.rank, index)]
        f, b = costs.compute_time(step.rank, forward.action), costs.compute_time(step.rank, step.action)
        split = forward.start + (forward.end - forward.start) * ratio(f, f + b) if f + b else forward.end
        drawn[(step.rank, index)] = (step.rank, forward.start, split, forward.action)
        drawn[(step.rank, step.index)] = (step.rank, split, forward.end, step.action)
    return [drawn[(step.rank, step.index)] for step in steps]


def _span(steps, rank: int) -> Real:
    """From a rank's first compute start to its last compute end."""
    computes = [step for step in steps if step.rank == rank and not step.action.kind.is_communication]
    return max(step.end for step in computes) - min(step.start for step in computes)
