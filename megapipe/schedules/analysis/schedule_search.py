"""A zero-bubble schedule searched for measured costs: the heuristic of Qi et al. (ICLR 2024, section 3.1).

Given per-stage times of F, BI and BW, the message latency and a limit on the activations a
rank may hold, the heuristic lays the passes out in time, rank by rank, as the paper does:

* a BI whose output gradient has arrived runs first (the previous stage waits for it);
* otherwise a forward, as many as the memory limit allows (the warm-up fills the time before
  the first BI), deepest chunk first so that a microbatch is never stuck between two chunks;
* otherwise the oldest pending BW, which fills a bubble or frees memory when the limit is hit;
  when all F and BI are done the rank runs its BWs left.

Four binary hyperparameters, searched over their 16 combinations as the paper's grid search
does: may a forward start when a BI will arrive before it ends (the paper's "small bubble
before the first B"); may a BW start when a known input will arrive before it ends (if not, it
still starts when idling would make this rank's cumulative bubble the largest, the paper's
rule); does a stage skip a forward when it is two or more forwards ahead of the next stage
(the paper's second hyperparameter); and is the number of forwards held before their BI
staggered by rank (ZB-H2's 2p - 1 - r) or only bounded by the memory limit.

The named flush schedules that run these sizes within the memory limit join the candidates
(their B split into BI and BW), as the paper seeds its ILP with the heuristic's solution; the
fastest candidate is then improved by hill climbing, swapping two neighbouring passes of a
rank while that shortens the replayed batch, keeps every rank within the memory limit and
finishes (a swap that deadlocks is refused by the replay).

Post-validation: the result is lowered (sends and receives placed for these costs), validated
under both transport models and simulated, and its peak activations checked against the limit.

Works on the looped placement (virtual stage s on rank s % p), v chunks per rank.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real
from typing import Callable, Optional, Union

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.analysis.simulate import CostModel, SimulationResult, peak_activations, simulate
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.communication import add_communication
from megapipe.schedules.replay import replay
from megapipe.schedules.validate import validate_schedule
from megapipe.layout.placement import Placement

MEMORY_FLAG = "--schedule-memory-limit"


@dataclass(frozen=True)
class Knobs:
    """The heuristic's binary hyperparameters (see the module docstring)."""

    forward_may_delay_input_grad: bool
    weight_may_delay_input: bool
    skip_extra_forward: bool
    staggered_forwards: bool


@dataclass(frozen=True)
class SearchResult:
    """The schedule found (lowered for the costs, validated), its simulation and where it started."""

    schedule: Schedule
    simulation: SimulationResult
    origin: Union[Knobs, str]  # the heuristic's hyperparameters, or the named schedule the climb started from
    candidates: int


def check_memory_limit(memory_limit: Real) -> None:
    if memory_limit < 1:
        raise ConfigError(f"{MEMORY_FLAG} {memory_limit} is below one microbatch's activations per rank, which "
                          "every schedule holds; the least value that works is 1.")


def search_schedule(p: int, m: int, costs: CostModel, memory_limit: Real, v: int = 1,
                    name: str = "auto", max_evaluations: Optional[int] = None) -> SearchResult:
    """The best schedule found for ``costs`` holding at most ``memory_limit`` microbatches'
    activations per rank (in units of one whole rank's, as ``simulate`` counts them).
    ``max_evaluations`` bounds the hill climbing's replays (default: about 60,000 passes replayed
    in all, a few seconds)."""
    check_memory_limit(memory_limit)
    if max_evaluations is None:
        max_evaluations = max(50, 20_000 // (p * m * v))
    candidates = [(Knobs(*values), _Greedy(p, m, v, costs, memory_limit, Knobs(*values)).lists())
                  for values in itertools.product((False, True), repeat=4)]
    candidates += [(named, _split_backwards(lists)) for named, lists in _named_lists(p, m, v, memory_limit)]
    scored = [(_makespan(Schedule(name, p, m, v, lists), costs), index) for index, (_, lists) in enumerate(candidates)]
    origin, lists = candidates[min(scored)[1]]
    lists = _hill_climb(Schedule(name, p, m, v, lists), costs, memory_limit, max_evaluations)
    compute = Schedule(name, p, m, v, lists)
    validate_schedule(compute)
    lowered = add_communication(compute, costs.compute_time, costs.transfer_time)
    validate_schedule(lowered)  # both transport models
    result = simulate(lowered, costs)
    if max(result.peak_activations) > memory_limit:
        raise AssertionError(f"the search exceeded its memory limit from {origin}")  # a bug, not bad input
    return SearchResult(lowered, result, origin, len(candidates))


def named_schedules(p: int, m: int, v: int) -> list[Schedule]:
    """The registered flush schedules that run p ranks, m microbatches and v chunks per rank, compute-only
    (straight from their generators, which ``tests/test_transport_models.py`` checks under both transports)."""
    from megapipe.schedules.catalog import schedule_descriptor, schedule_names

    found = []
    for named in schedule_names():
        descriptor = schedule_descriptor(named)
        if (descriptor.asynchronous or not descriptor.sizes.takes_chunks(v)
                or descriptor.placement is not Placement.LOOPED):
            continue  # the search works on the looped placement
        try:
            lists = descriptor.compute_lists(p, m, v)
        except ConfigError:  # sizes it does not run
            continue
        found.append(Schedule(named, p, m, v, lists))
    return found


def comparison(found: SearchResult, costs_for: Callable[[int], CostModel], memory_limit: Real) -> list[str]:
    """Lines that print the searched schedule's predicted batch time, bubble and peak activations next to
    every named schedule's, the fastest first. ``costs_for(v)`` gives the same per-rank costs split over
    v chunks: the named schedules without chunks run with one (messages placed for the costs)."""
    p, m, v = found.schedule.p, found.schedule.m, found.schedule.v
    rows = [(found.simulation, f"searched ({_origin(found.origin)})")]
    for chunks in sorted({1, v}):
        rows += [(simulate(named, costs_for(chunks)), "") for named in named_schedules(p, m, chunks)
                 if _chunked(named.name) == (chunks > 1)]
    lines = [f"{'schedule':<16}{'v':>3}{'batch time':>12}{'bubble':>9}{'peak activations':>18}  (p={p} m={m}, "
             f"memory limit {memory_limit})"]
    for result, note in sorted(rows, key=lambda row: (row[0].makespan, max(row[0].peak_activations))):
        peak = max(result.peak_activations)
        over = "  over the limit" if peak > memory_limit else ""
        lines.append(f"{result.schedule.name:<16}{result.schedule.v:>3}{float(result.makespan):>12.4g}"
                     f"{float(result.bubble_fraction):>9.2%}{str(peak):>18}  {note}{over}".rstrip())
    return lines


def _chunked(name: str) -> bool:
    from megapipe.schedules.catalog import schedule_descriptor

    return schedule_descriptor(name).chunked


def _origin(origin: Union[Knobs, str]) -> str:
    if isinstance(origin, str):
        return f"from {origin}"
    return "heuristic " + ", ".join(f"{name}={int(value)}" for name, value in vars(origin).items())


def _named_lists(p: int, m: int, v: int, memory_limit: Real):
    for schedule in named_schedules(p, m, v):
        if max(peak_activations(schedule)) <= memory_limit:
            yield schedule.name, schedule.actions


def _split_backwards(lists) -> list[list[Action]]:
    """The same order with every B written as BI then BW, so that the hill climbing can move BW."""
    return [[part for action in actions for part in (
        (Action(ActionKind.BI, action.stage, action.microbatch), Action(ActionKind.BW, action.stage, action.microbatch))
        if action.kind is ActionKind.B else (action,))] for actions in lists]


def _makespan(schedule: Schedule, costs: CostModel) -> Real:
    return max(step.end for step in replay(schedule, costs.compute_time, costs.transfer_time))


def _hill_climb(schedule: Schedule, costs: CostModel, memory_limit: Real, max_evaluations: int) -> list[list[Action]]:
    lists = [list(actions) for actions in schedule.actions]
    best, evaluations, improved = _makespan(schedule, costs), 0, True
    while improved and evaluations < max_evaluations:
        improved = False
        for rank, actions in enumerate(lists):
            for k in range(len(actions) - 2):  # the STEP stays last
                first, second = actions[k], actions[k + 1]
                if (first.stage, first.microbatch) == (second.stage, second.microbatch):
                    continue  # F before BI before BW of one pass
                actions[k], actions[k + 1] = second, first
                trial = schedule.with_actions([list(a) for a in lists])
                evaluations += 1
                time = _trial_makespan(trial, costs, memory_limit, rank)
                if time is not None and time < best:
                    best, improved = time, True
                else:
                    actions[k], actions[k + 1] = first, second
                if evaluations >= max_evaluations:
                    return lists
    return lists


def _trial_makespan(schedule: Schedule, costs: CostModel, memory_limit: Real, rank: int) -> Optional[Real]:
    if peak_activations(schedule)[rank] > memory_limit:
        return None
    try:
        return _makespan(schedule, costs)
    except ScheduleError:  # the swap made a rank wait for something it has not yet run
        return None


class _Greedy:
    """One run of the heuristic: decides, at each moment a rank is free, what it runs next."""

    def __init__(self, p: int, m: int, v: int, costs: CostModel, memory_limit: Real, knobs: Knobs):
        self.p, self.m, self.v, self.costs, self.knobs = p, m, v, costs, knobs
        self.stages = p * v
        self.capacity = int(Fraction(memory_limit) * v)  # in chunk-microbatches
        self.next_forward = [0] * self.stages
        self.next_input_grad = [0] * self.stages
        self.forward_end: dict[tuple[int, int], Real] = {}
        self.input_grad_end: dict[tuple[int, int], Real] = {}
        self.pending = [deque() for _ in range(p)]  # (stage, microbatch) after BI, before BW
        self.held = [0] * p  # chunk-microbatches forwarded, not yet through BW
        self.before_input_grad = [0] * p  # forwarded, not yet through BI
        self.owed = [0] * p  # forwards of later chunks that microbatches inside a rank still need
        self.free_at: list[Real] = [0] * p
        self.idle: list[Real] = [0] * p
        self.started = [False] * p
        self.actions: list[list[Action]] = [[] for _ in range(p)]

    def lists(self) -> list[list[Action]]:
        remaining, time = 3 * self.stages * self.m, 0
        while remaining:
            for rank in range(self.p):
                if self.free_at[rank] <= time:
                    action = self._choose(rank, time)
                    if action is not None:
                        self._run(rank, action, time)
                        remaining -= 1
            later = [t for t in self.free_at + self._known_arrivals() if t > time]
            if remaining and not later:
                raise AssertionError("the heuristic stalled")  # every rank waits on another: a bug
            time = min(later, default=time)
        return [actions + [Action(ActionKind.STEP)] for actions in self.actions]

    # ---- readiness ----------------------------------------------------------------------------
    def _transfer(self, kind: ActionKind, stage: int, consumer: int, microbatch: int) -> Real:
        same_rank = stage % self.p == consumer % self.p
        return 0 if same_rank else self.costs.transfer_time((kind, stage, microbatch))

    def _forward_ready(self, stage: int) -> Optional[Real]:
        i = self.next_forward[stage]
        if i >= self.m:
            return None
        if stage == 0:
            return 0
        end = self.forward_end.get((stage - 1, i))
        return None if end is None else end + self._transfer(ActionKind.F, stage - 1, stage, i)

    def _input_grad_ready(self, stage: int) -> Optional[Real]:
        i = self.next_input_grad[stage]
        if i >= self.next_forward[stage]:
            return None
        if stage == self.stages - 1:
            return self.forward_end[(stage, i)]
        end = self.input_grad_end.get((stage + 1, i))
        return None if end is None else end + self._transfer(ActionKind.B, stage + 1, stage, i)

    def _known_arrivals(self) -> list[Real]:
        times = [self._forward_ready(s) for s in range(self.stages)]
        times += [self._input_grad_ready(s) for s in range(self.stages)]
        return [t for t in times if t is not None]

    def _next_arrival(self, rank: int, time: Real) -> Optional[Real]:
        """When the next input of this rank that is not there yet arrives, if that is known."""
        times = [ready(s) for s in range(rank, self.stages, self.p)
                 for ready in (self._forward_ready, self._input_grad_ready)]
        return min((t for t in times if t is not None and t > time), default=None)

    # ---- the rules ----------------------------------------------------------------------------
    def _cost(self, rank: int, kind: ActionKind, stage: int, microbatch: int) -> Real:
        return self.costs.compute_time(rank, Action(kind, stage, microbatch))

    def _choose(self, rank: int, time: Real) -> Optional[Action]:
        stages = range(rank, self.stages, self.p)
        input_grads = [s for s in stages if (t := self._input_grad_ready(s)) is not None and t <= time]
        if input_grads:
            stage = min(input_grads, key=lambda s: (self.next_input_grad[s], s))
            return Action(ActionKind.BI, stage, self.next_input_grad[stage])
        forward = self._forward(rank, time, stages)
        if forward is not None:
            return forward
        if not self.pending[rank]:
            return None
        weight = Action(ActionKind.BW, *self.pending[rank][0])
        arrival = self._next_arrival(rank, time)
        if (self.knobs.weight_may_delay_input or not self._admits(rank) or arrival is None
                or arrival >= time + self._cost(rank, ActionKind.BW, weight.stage, weight.microbatch)
                or self.idle[rank] + (arrival - time) > max(self.idle)):
            return weight
        return None

    def _forward(self, rank: int, time: Real, stages: range) -> Optional[Action]:
        ready = [s for s in stages if (t := self._forward_ready(s)) is not None and t <= time]
        if not ready:
            return None
        stage = max(ready)  # deepest chunk first
        if stage < self.p and not self._admits(rank):
            return None
        i = self.next_forward[stage]
        if (self.knobs.skip_extra_forward and stage + 1 < self.stages and self.next_forward[stage + 1] < self.m
                and i >= self.next_forward[stage + 1] + 2):
            return None
        if not self.knobs.forward_may_delay_input_grad:
            arrival = min((t for s in stages if (t := self._input_grad_ready(s)) is not None), default=None)
            if arrival is not None and arrival < time + self._cost(rank, ActionKind.F, stage, i):
                return None
        return Action(ActionKind.F, stage, i)

    def _admits(self, rank: int) -> bool:
        """May a new microbatch enter this rank (its first chunk)? Only if its forwards through all
        v chunks fit next to what the rank holds and what the microbatches inside still owe."""
        if self.held[rank] + self.owed[rank] + self.v > self.capacity:
            return False
        staggered = max(self.capacity - rank, self.v) if self.knobs.staggered_forwards else self.capacity
        return self.before_input_grad[rank] + self.owed[rank] + self.v <= staggered

    def _run(self, rank: int, action: Action, time: Real) -> None:
        if self.started[rank]:
            self.idle[rank] += time - self.free_at[rank]
        self.started[rank] = True
        end = time + self._cost(rank, action.kind, action.stage, action.microbatch)
        key = (action.stage, action.microbatch)
        if action.kind is ActionKind.F:
            self.forward_end[key] = end
            self.next_forward[action.stage] += 1
            self.held[rank] += 1
            self.before_input_grad[rank] += 1
            self.owed[rank] += self.v - 1 if action.stage < self.p else -1
        elif action.kind is ActionKind.BI:
            self.input_grad_end[key] = end
            self.next_input_grad[action.stage] += 1
            self.before_input_grad[rank] -= 1
            self.pending[rank].append(key)
        else:
            self.pending[rank].popleft()
            self.held[rank] -= 1
        self.actions[rank].append(action)
        self.free_at[rank] = end
