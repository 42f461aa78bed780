"""What megapipe knows about one pipeline schedule, in one place: its ``ScheduleDescriptor``.

Each generator's file defines the descriptor of the schedules it generates, and the registry
(``schedules/__init__.py``) lists them. The executor, the simulator's seeds, the planner, the
command-line checks and the docs' table all read the descriptor, so a fact about a schedule
(its placement, how many chunks and microbatches it takes, its weight policy, its closed forms)
is written once.

Sizes (``Sizes``) say which (p, m, v) the generator runs; the closed forms (``ClosedForms``)
give per-rank in-flight microbatches, the bubble fraction and the batch time, with the sizes
where they hold when those are narrower (the planner plans only there). A schedule without a
closed form carries a marker instead: ``SIMULATE`` (its times come from simulating its lists,
as for V-Half and V-Min) or ``SEARCH`` (``auto``: the search makes the lists for the ranks' times).
The weight versions a rank keeps follow from the weight policy (``ir/weight_policy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Optional, Sequence, Union

from megapipe.schedules.actions import Action
from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.layout.placement import Placement

Generator = Callable[..., list[list[Action]]]
InFlight = Callable[[int, int, int, int], Fraction]  # (p, m, v, rank) -> microbatches' worth of a rank's activations
Bubble = Callable[[int, int, int], Fraction]  # (p, m, v) -> idle time over ideal time, equal ranks
BatchTime = Callable[[Sequence[float], Sequence[float], int, int], float]  # (forward, backward per rank, m, v)


def _one(*_) -> int:
    return 1


@dataclass(frozen=True)
class Sizes:
    """The (p, m, v) a schedule takes: v chunks per rank from ``least_chunks`` to ``most_chunks``
    (None: no bound), p >= ``least_pipeline``, m >= ``least_microbatches(p, v)``, m a multiple of
    ``microbatch_step(p, m, v)`` and at most ``most_microbatches``."""

    least_chunks: int = 1
    most_chunks: Optional[int] = 1
    least_pipeline: int = 1
    least_microbatches: Callable[[int, int], int] = _one
    microbatch_step: Callable[[int, int, int], int] = _one
    most_microbatches: Optional[int] = None

    def takes_chunks(self, v: int) -> bool:
        return v >= self.least_chunks and (self.most_chunks is None or v <= self.most_chunks)

    def problem(self, name: str, p: int, m: int, v: int) -> Optional[str]:
        """Why ``name`` cannot run m microbatches on p ranks with v chunks each, or None if it can."""
        if not self.takes_chunks(v):
            return f"{name} runs {self.chunks_text()} chunks per rank, not v={v}"
        if p < self.least_pipeline:
            return f"{name} needs p >= {self.least_pipeline} pipeline ranks, not p={p}"
        least = self.least_microbatches(p, v)
        if m < least:
            return f"{name} needs at least {least} microbatches per batch at p={p}, v={v}, not m={m}"
        if self.most_microbatches is not None and m > self.most_microbatches:
            return f"{name} runs at most {self.most_microbatches} microbatches per batch, not m={m}"
        step = self.microbatch_step(p, m, v)
        if m % step:
            return f"{name} needs m a multiple of {step} at p={p}, v={v}, not m={m}"
        return None

    def chunks_text(self) -> str:
        if self.most_chunks == self.least_chunks:
            return str(self.least_chunks)
        return f"{self.least_chunks} or more" if self.most_chunks is None else \
            f"{self.least_chunks} to {self.most_chunks}"


ONE_CHUNK = Sizes()


def v_sizes(least_microbatches: Callable[[int, int], int] = _one) -> Sizes:
    """The V placement: two chunks per rank, a V over at least two ranks."""
    return Sizes(least_chunks=2, most_chunks=2, least_pipeline=2, least_microbatches=least_microbatches)


@dataclass(frozen=True)
class ClosedForms:
    """A schedule's closed forms (per pipeline rank; seed 002 Table 7.1 and its successors), where
    they hold: ``sizes`` when narrower than the generator's. ``exact``: in-flight counts, bubble and
    batch time equal the simulator's for equal ranks (F = 1, B = 2 per rank, BI = BW = 1, free messages)."""

    in_flight: InFlight
    bubble: Bubble
    batch_time: BatchTime
    exact: bool = True
    sizes: Optional[Sizes] = None


@dataclass(frozen=True)
class NoClosedForm:
    """The marker of a schedule without closed forms: ``simulate`` (its lists are simulated) or
    ``search`` (the schedule search makes the lists for the ranks' times, and predicts with them).
    ``bubble_at_most`` bounds the bubble fraction for equal ranks, where such a bound is known."""

    how: str
    bubble_at_most: Optional[Bubble] = None


SIMULATE = NoClosedForm("simulate")


def search_marker(bubble_at_most: Bubble) -> NoClosedForm:
    return NoClosedForm("search", bubble_at_most)


@dataclass(frozen=True)
class ScheduleDescriptor:
    """One pipeline schedule: its generator and every fact the rest of megapipe reads about it.

    ``generate`` takes (p, m) when the schedule has one chunk per rank, (p, m, v) when it takes
    chunks, and keywords ``(p, m, v, batches, replicas, vertical_sync)`` when it is asynchronous
    (weight policy other than single); None for ``auto``, which the search makes. ``split_backward``:
    its lists split backwards into BI and BW. ``alternates``: a rank runs forwards after backwards of the
    same batch (all but GPipe). ``unequal_replicas``: it runs a stage plan that replicates its stages
    unequally (1F1B-RR). ``vertical_sync``: ``--pipedream-vertical-sync`` chooses its weight versions.
    ``summary`` is its line in the docs' table."""

    name: str
    generate: Optional[Generator]
    summary: str
    placement: Placement = Placement.LOOPED
    sizes: Sizes = ONE_CHUNK
    weight_policy: WeightPolicy = WeightPolicy.SINGLE
    split_backward: bool = False
    alternates: bool = True
    unequal_replicas: bool = False
    vertical_sync: bool = False
    costs: Union[ClosedForms, NoClosedForm] = field(default=SIMULATE)

    @property
    def chunked(self) -> bool:
        """Whether the generator takes v (and may be given more than one chunk per rank)."""
        return self.sizes.most_chunks != 1

    @property
    def asynchronous(self) -> bool:
        return self.weight_policy is not WeightPolicy.SINGLE

    @property
    def flushes(self) -> bool:
        """Flush schedules finish every batch before the weights change; asynchronous ones never flush."""
        return not self.asynchronous

    @property
    def closed_forms(self) -> Optional[ClosedForms]:
        return self.costs if isinstance(self.costs, ClosedForms) else None

    @property
    def planned_sizes(self) -> Sizes:
        """Where the closed forms hold: their own sizes, else the generator's."""
        forms = self.closed_forms
        return forms.sizes if forms is not None and forms.sizes is not None else self.sizes

    def weight_versions(self, p: int, rank: int) -> int:
        return self.weight_policy.versions(p, rank)

    def compute_lists(self, p: int, m: int, v: int = 1) -> list[list[Action]]:
        """The generator's compute-only lists of a flush schedule."""
        return self.generate(p, m, v) if self.chunked else self.generate(p, m)


# Closed forms several schedules share. The batch time generalises (m + (p-1)/v)(t_f + t_b) to
# ranks of unequal speed as m * max_r t_r + (sum_r t_r - max_r t_r) / v (seed 002 Table 7.1's
# bubble (p-1)/m, divided by v with interleaving).

def phase_time(times: Sequence[float], m: int, v: int) -> float:
    slowest = max(times)
    return m * slowest + (sum(times) - slowest) / v


def flush_bubble(p: int, m: int, v: int) -> Fraction:
    """(p-1)/(v m): GPipe, 1F1B and interleaved 1F1B (seed 002 Table 7.1)."""
    return Fraction(p - 1, v * m)


def alternating_time(forward: Sequence[float], backward: Sequence[float], m: int, v: int) -> float:
    """1F1B alternates, so a rank's forward and backward form one step."""
    return phase_time([f + b for f, b in zip(forward, backward)], m, v)


def zero_bubble_bubble(p: int, m: int, v: int) -> Fraction:
    """p - 1 chunks' forwards idle: (p-1)/(3 v m) with a backward of two forwards."""
    return Fraction(p - 1, 3 * v * m)


def zero_bubble_time(forward: Sequence[float], backward: Sequence[float], m: int, v: int) -> float:
    """The weight gradients fill the backward's share of fill and drain: m max_r (t_f + t_b)_r plus
    the forwards of all ranks but the slowest, divided by v."""
    both = [f + b for f, b in zip(forward, backward)]
    return m * max(both) + (sum(forward) - max(forward)) / v


def no_bubble(p: int, m: int, v: int) -> Fraction:
    return Fraction(0)


def steady_time(forward: Sequence[float], backward: Sequence[float], m: int, v: int) -> float:
    """Without flushes a microbatch leaves every max_r (t_f + t_b)_r in steady state."""
    return m * max(f + b for f, b in zip(forward, backward))


def rank_warmup_in_flight(p: int, m: int, v: int, rank: int) -> Fraction:
    """p - rank microbatches (1F1B's warm-up plus one): 2BW and PipeDream, whose next batch keeps coming."""
    return Fraction(p - rank)
