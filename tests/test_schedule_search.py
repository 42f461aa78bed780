"""The schedule search (``schedules/analysis/schedule_search.py``) on the simulator.

References: the named schedules simulated with the same costs, the closed forms of the
zero-bubble schedules at unit costs, a lower bound for one slow rank (it cannot start before
the first forward of the ranks ahead of it reaches it, and then has m (F + BI + BW) of its own
work to do), which the searched schedule meets, and brute force: every order of every rank's
passes for small sizes, the fastest one within the memory limit. Memory is counted by the simulator's
``peak_activations`` (a split backward holds its forward's activations until BW).
"""

import itertools
import random
from fractions import Fraction

import pytest

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.analysis.schedule_search import search_schedule
from megapipe.schedules.analysis.simulate import CostModel, peak_activations, simulate
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.replay import replay
from megapipe.schedules.catalog import build_schedule, schedule_names, schedule_descriptor
from megapipe.schedules.transport import ALL_TRANSPORTS
from megapipe.schedules.validate import validate_schedule

pytestmark = pytest.mark.unit


def costs(p, v, slow_rank=None, factor=Fraction(3, 2)):
    """F = BI = BW = 1 per whole stage (1/v per chunk), ``slow_rank``'s stages ``factor`` times slower."""
    per_stage = [(factor if s % p == slow_rank else 1) / Fraction(v) for s in range(p * v)]
    return CostModel(forward=per_stage, backward=[2 * c for c in per_stage], input_backward=per_stage,
                     weight_backward=per_stage)


def named_makespans(p, m, v):
    """Every named flush schedule on the looped placement (stage s on rank s % p) that runs (p, m):
    chunked ones with v >= 2 chunks, the others with one."""
    times = {}
    for name in schedule_names():
        spec = schedule_descriptor(name)
        if spec.asynchronous or (spec.chunked and v == 1):
            continue
        chunks = v if spec.chunked else 1
        schedule = build_schedule(name, p, m, chunks).compute_only()
        if any(a.stage % p != rank for rank, actions in enumerate(schedule.actions) for a in actions
               if a.kind.is_compute):
            continue
        result = simulate(schedule, costs(p, chunks, slow_rank=1))
        times[name] = (result.makespan, max(result.peak_activations))
    return times


@pytest.mark.parametrize("v", [1, 2])
def test_search_beats_every_named_schedule_with_one_stage_slower(v):
    p, m, limit = 4, 8, 4  # limit: 1F1B's peak
    found = search_schedule(p, m, costs(p, v, slow_rank=1), memory_limit=limit, v=v)
    validate_schedule(found.schedule, transports=ALL_TRANSPORTS)
    assert max(found.simulation.peak_activations) <= limit
    named = named_makespans(p, m, v)
    assert {"gpipe", "1f1b", "zb-h1", "zb-h2"} | ({"interleaved", "interleaved-zb"} if v == 2 else set()) <= set(named)
    # the slow rank starts once stage 0's first forward is done, then works 8 x 3 x 1.5 without rest
    assert found.simulation.makespan == Fraction(1, v) + 36
    for name, (makespan, peak) in named.items():
        if v == 2 or peak <= limit:  # with one chunk nothing within 1F1B's memory reaches the bound
            assert found.simulation.makespan < makespan, name
        else:
            assert found.simulation.makespan <= makespan, name


@pytest.mark.parametrize("limit", [1, 2, Fraction(5, 2), 4, 7])
def test_memory_limit_is_respected(limit):
    p, m, v = 4, 8, 2
    found = search_schedule(p, m, costs(p, v, slow_rank=1), memory_limit=limit, v=v)
    assert max(found.simulation.peak_activations) <= limit
    assert found.schedule.name == "auto" and found.candidates >= 16


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 7)])
def test_equal_unit_costs_reach_the_zero_bubble_closed_forms(p, m):
    unit = costs(p, 1)
    assert search_schedule(p, m, unit, memory_limit=p).simulation.makespan <= 3 * m + p - 1  # ZB-H1's
    if m >= 2 * p - 1:
        found = search_schedule(p, m, unit, memory_limit=2 * p - 1)
        assert found.simulation.idle_in_span == (0,) * p  # ZB-H2's parallelogram


def test_infeasible_memory_limit_names_the_flag_and_least_value():
    with pytest.raises(ConfigError, match=r"--schedule-memory-limit 1/2 is below .*the least value that works is 1\."):
        search_schedule(4, 8, costs(4, 1), memory_limit=Fraction(1, 2))


def every_order(rank, m):
    """Every list of rank ``rank``'s passes (one stage) keeping F before BI before BW of each microbatch."""
    kinds = (ActionKind.F, ActionKind.BI, ActionKind.BW)
    for slots in set(itertools.permutations([i for i in range(m) for _ in kinds])):  # microbatch of each slot
        done, order = [0] * m, []
        for i in slots:
            order.append(Action(kinds[done[i]], rank, i))
            done[i] += 1
        yield order


def fastest_by_brute_force(p, m, costs, limit):
    lists = [list(every_order(rank, m)) for rank in range(p)]
    best = None
    for combination in itertools.product(*lists):
        schedule = Schedule("every", p, m, 1, [list(order) + [Action(ActionKind.STEP)] for order in combination])
        if max(peak_activations(schedule)) > limit:
            continue
        try:
            makespan = max(step.end for step in replay(schedule, costs.compute_time, costs.transfer_time))
        except ScheduleError:  # a rank waits for a pass another rank runs only later
            continue
        best = makespan if best is None else min(best, makespan)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_search_finds_the_fastest_order_of_all_for_two_ranks_and_two_microbatches(seed):
    """Random unequal F, BI, BW per rank and latency; all 20 x 20 pairs of orders, memory limits 1 and 2."""
    rng = random.Random(seed)
    times = [[Fraction(rng.randint(1, 6), 4) for _ in range(2)] for _ in range(3)]
    costs = CostModel.per_rank(2, 1, *times, latency=Fraction(rng.randint(0, 2), 4))
    for limit in (1, 2):
        assert search_schedule(2, 2, costs, limit).simulation.makespan == fastest_by_brute_force(2, 2, costs, limit)
