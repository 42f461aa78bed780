"""Closed forms for each pipeline schedule: batch time, bubble, in-flight activations, weight versions.

Seed 002 Table 7.1 gives the bubble and the (weight versions, activation stashes) of each
scheme: GPipe (p-1)/m and (1, m); PipeDream 0 and (p, p); 2BW 0 and (2, p); Flush (1f1b)
(p-1)/m and (1, p); interleaved (p-1)/(v m) and (1, p). Here they are per pipeline rank r,
as megapipe's schedules run them: 1F1B holds p - r microbatches on rank r (its warm-up plus
one), interleaved 1F1B holds (2 (p - r - 1) + (v - 1) p + 1) / v stages' worth on rank r
(all m when m = p), which Table 7.1 rounds to p. The batch time generalises
(m + (p-1)/v)(t_f + t_b) to ranks of unequal speed as m * max_r t_r + (sum_r t_r - max_r t_r) / v:
for GPipe with t = t_f and t = t_b in turn (two flow shops, exact), for 1F1B with t = t_f + t_b
(exact when the middle ranks are equal and the last rank's step is not shorter than the
first's, as when the head outweighs the embedding; otherwise within two steps), and for
interleaving the same (exact for equal ranks; unequal chunks cause stalls it does not see). 2BW and PipeDream never flush, so in steady state a microbatch leaves every
max_r (t_f + t_b)_r. ZB-H1 and ZB-H2 (split backward, weight gradients half the backward)
hold p and min(2p - 1, m) microbatches on every rank and take m max_r (t_f + t_b)_r plus the
forwards of all ranks but the slowest: p - 1 forwards for equal ranks (exact there, as
``tests/test_zero_bubble_schedules.py`` simulates); interleaved zero bubble the same with the
forwards' share divided by v, holding 1F1B's p when p divides m. ``auto`` (the schedule search)
has no closed form: ``searched`` runs the search for the ranks' times (BI and BW half the
backward each) within 1F1B's memory (p microbatches per rank) and reads the batch time and
each rank's peak off its simulation; the planner searches up to ``SEARCHED_PASSES`` passes per
rank (beyond that it leaves ``auto`` out), on its ``SEARCHED_LAYOUTS`` fastest layouts.
On the V placement (two chunks per rank): ZBV holds p and takes interleaved zero bubble's time
with v = 2; DualPipeV, whose overlapped pairs megapipe's executor runs one pass after the other,
holds p + 1/2 (p on rank 0 at m = 2p - 1) and takes ZB-H1's time (both exact for equal ranks,
``tests/test_planner_schedule_costs.py``). V-Half and V-Min are not planned: their end bubble
has no closed form (the simulator gives it per p).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

from megapipe.layout.placement import Placement

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "dualpipev", "auto", "2bw",
             "pipedream")
FLUSHING = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "dualpipev", "auto")
ZERO_BUBBLE = ("zb-h1", "zb-h2", "interleaved-zb")
CHUNKED = ("interleaved", "interleaved-zb")
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank in a V (layout/placement.py)
LEAST_V_MICROBATCHES = {"zbv": lambda p: 2 * p - 1, "dualpipev": lambda p: 2 * p - 1}
SEARCHED = "auto"  # the schedule search, which the planner runs on its fastest layouts only (plan.py)
SEARCHED_PASSES = 96  # 3 m v: the planner runs the search for up to 32 microbatches on one chunk
SEARCHED_LAYOUTS = 8


@dataclass(frozen=True)
class Searched:
    """What the schedule search predicts for one layout: batch time and each rank's peak microbatches."""

    batch_time: float
    in_flight: tuple[Fraction, ...]


def searched(forward: Sequence[float], backward: Sequence[float], m: int, v: int = 1) -> Searched:
    """Run the schedule search for ranks taking ``forward[r]``/``backward[r]`` per microbatch."""
    return _searched(tuple(float(f) for f in forward), tuple(float(b) for b in backward), m, v)


@functools.lru_cache(maxsize=1024)
def _searched(forward: tuple[float, ...], backward: tuple[float, ...], m: int, v: int) -> Searched:
    from megapipe.pipeline.analysis.schedule_search import search_schedule
    from megapipe.pipeline.analysis.simulate import CostModel

    p, halves = len(forward), [b / 2 for b in backward]
    costs = CostModel.per_rank(p, v, forward, halves, halves, exact=False)
    found = search_schedule(p, m, costs, memory_limit=p, v=v, max_evaluations=0)
    return Searched(float(found.simulation.makespan), found.simulation.peak_activations)


def placement_of(schedule: str) -> Placement:
    return Placement.V if schedule in V_SHAPED else Placement.LOOPED


def unties_embeddings(schedule: str, p: int) -> bool:
    """Without flushes the first and last stage update at different times, so megapipe's asynchronous
    schedules give a pipelined model its own output embedding instead of a tied copy to keep equal."""
    return schedule not in FLUSHING and p > 1


def microbatch_problem(schedule: str, p: int, m: int, v: int) -> Optional[str]:
    """Why ``schedule`` cannot run m microbatches on p ranks with v chunks each, or None if it can."""
    if schedule not in SCHEDULES:
        return f"unknown schedule {schedule}"
    if schedule in V_SHAPED:
        least = LEAST_V_MICROBATCHES[schedule](p)
        if v != 2 or p < 2 or m < least:
            return f"{schedule} needs two chunks per rank, p >= 2 and at least {least} microbatches (v={v}, m={m})"
        return None
    if (v > 1) != (schedule in CHUNKED):
        return "only the interleaved schedules have several chunks per rank, and they need at least two"
    if schedule == "interleaved" and (p < 2 or m % p):
        return f"interleaving needs p >= 2 and m a multiple of p (p={p}, m={m})"
    if schedule == "interleaved-zb" and (p < 2 or m % p):  # the rounds of p it runs (it takes more, unplanned)
        return f"interleaved zero bubble is planned with p >= 2 and m a multiple of p (p={p}, m={m})"
    if schedule == "auto" and 3 * m > SEARCHED_PASSES:
        return f"the planner searches schedules of at most {SEARCHED_PASSES // 3} microbatches, not {m}"
    if schedule in ("1f1b", "2bw") + ZERO_BUBBLE and m < p:
        return f"{schedule} needs at least p={p} microbatches per batch, not {m}"
    if schedule == "pipedream" and m != 1:
        return "PipeDream updates the weights after every microbatch, so a batch is one microbatch per pipeline"
    return None


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> Fraction:
    """Peak microbatches whose activations rank ``rank`` holds, in units of the whole rank's (all chunks)."""
    if schedule == "gpipe":
        return Fraction(m)
    if schedule == "interleaved":
        if m == p:
            return Fraction(m)
        return Fraction(min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v), v)
    if schedule == "zb-h1":  # every rank holds p: the delayed weight gradients fill what 1F1B frees
        return Fraction(p)
    if schedule == "zb-h2":
        return Fraction(min(2 * p - 1, m))
    if schedule == "zbv":  # 2p chunks of half a rank each, 1F1B's first rank
        return Fraction(p)
    if schedule == "dualpipev":  # rank 0 runs no overlapped round at the least m, so one chunk fewer
        return Fraction(2 * p + (0 if rank == 0 and m == 2 * p - 1 else 1), 2)
    if schedule == "interleaved-zb":  # rounds of p microbatches: (v - 1) p + p chunk-microbatches
        return Fraction(p)
    if schedule in FLUSHING:  # 1f1b: p - rank before the first backward, fewer if the batch is smaller
        return Fraction(min(p - rank, m))
    return Fraction(p - rank)  # 2bw and pipedream never flush: microbatches of the next batch keep coming


def weight_versions(schedule: str, p: int, rank: int) -> int:
    """Copies of the weights rank ``rank`` keeps: one per in-flight input with stashing, two with 2BW."""
    if schedule == "pipedream":
        return p - rank
    if schedule == "2bw":
        return 2
    return 1


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> Fraction:
    """Idle time over ideal time for equal ranks: (p-1)/(v m) with a flush, 0 without; the
    zero-bubble schedules idle only p-1 forwards, (p-1)/(3m) with a backward of two forwards."""
    if schedule not in FLUSHING:
        return Fraction(0)
    if schedule in ZERO_BUBBLE or schedule in ("auto", "zbv"):  # p - 1 chunks' forwards (the search: at most)
        return Fraction(p - 1, 3 * v * m)
    if schedule == "dualpipev":  # its pairs run one pass after the other: ZB-H1's idle
        return Fraction(p - 1, 3 * m)
    return Fraction(p - 1, v * m)


def _phase_time(times: Sequence[float], m: int, v: int) -> float:
    slowest = max(times)
    return m * slowest + (sum(times) - slowest) / v


def pipeline_time(schedule: str, forward: Sequence[float], backward: Sequence[float], m: int, v: int = 1) -> float:
    """Seconds for one batch of m microbatches; ``forward[r]``/``backward[r]`` are rank r's per microbatch (all chunks)."""
    if schedule == "gpipe":  # all forwards, then all backwards: two flow shops
        return _phase_time(forward, m, v) + _phase_time(backward, m, v)
    both = [f + b for f, b in zip(forward, backward)]
    if schedule == "dualpipev":  # the weight gradients fill the rest of fill and drain, as in ZB-H1
        return m * max(both) + sum(forward) - max(forward)
    if schedule in ZERO_BUBBLE or schedule == "zbv":  # the weight gradients fill the backward's share of fill, drain
        return m * max(both) + (sum(forward) - max(forward)) / v
    if schedule in FLUSHING:  # 1F1B alternates, so a rank's forward and backward form one step
        return _phase_time(both, m, v)
    return m * max(both)
