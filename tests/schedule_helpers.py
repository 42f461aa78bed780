"""Comparing a schedule's closed forms with the simulator, and counting the weight versions its lists
hold: shared by the planner's and the registry's tests."""

import operator
from fractions import Fraction

from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.actions import ActionKind
from megapipe.schedules.catalog import build_schedule
from megapipe.planner.schedule_costs import bubble_fraction, in_flight, pipeline_time


def equal_rank_costs(v: int) -> CostModel:
    """F = 1, B = 2 per rank, split evenly over its v chunks, BI = BW = half a B; an overlapped pair
    (DualPipeV's F & B) runs one pass after the other, as megapipe's executor runs it."""
    return CostModel.per_chunk(v, overlap=operator.add)


def assert_closed_forms_match_the_simulator(name: str, p: int, m: int, v: int) -> None:
    """Batch time, bubble and per-rank peak in-flight microbatches of the closed forms equal the simulator's
    for equal ranks (exact arithmetic)."""
    result = simulate(build_schedule(name, p, m, v), equal_rank_costs(v))
    predicted = pipeline_time(name, [Fraction(1)] * p, [Fraction(2)] * p, m, v)
    assert predicted == result.makespan, (name, p, m, v)
    bubble = bubble_fraction(name, p, m, v)
    assert predicted == 3 * m * (1 + bubble), (name, p, m, v)
    assert result.bubble_fraction == bubble / (1 + bubble)  # the simulator divides idle time by the makespan
    assert tuple(in_flight(name, p, m, v, r) for r in range(p)) == result.peak_activations, (name, p, m, v)


def versions_held(actions) -> dict[int, int]:
    """Per stage, the most weight versions needed at once: those of microbatches in flight, the live
    one (updates so far), and an older one the next forward will use (kept for it, as
    WeightVersionStore pins it)."""
    peaks = {}
    stages = {a.stage for a in actions if a.kind is ActionKind.F}
    for stage in stages:
        mine = [a for a in actions if a.stage == stage and a.kind in (ActionKind.F, ActionKind.B, ActionKind.UPDATE)]
        live, in_flight_versions, peak = 0, {}, 1
        for index, action in enumerate(mine):
            if action.kind is ActionKind.F:
                in_flight_versions[action.microbatch] = action.version
            elif action.kind is ActionKind.B:
                in_flight_versions.pop(action.microbatch)
            else:
                live += 1
            upcoming = next((a.version for a in mine[index + 1:] if a.kind is ActionKind.F), live)
            peak = max(peak, len(set(in_flight_versions.values()) | {live, min(upcoming, live)}))
        peaks[stage] = peak
    return peaks
