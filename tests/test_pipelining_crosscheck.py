"""megapipe's flush schedules against ``torch.distributed.pipelining``'s own schedule generators.

PyTorch builds, for every schedule class, a per-rank ``pipeline_order`` of actions (``None`` for an
idle time step). Its constructors need pipeline stages only for a few facts (the number of stages,
the pipeline group's size and this rank), so a stand-in stage object is enough and no process group
is made: the whole file runs in one process. Both sides are reduced to the per-rank sequence of
compute actions ``(kind, microbatch, stage)`` with kinds F, B, BI, BW (torch's ``I`` and ``W``
are megapipe's ``BI`` and ``BW``); idle steps and torch's ``REDUCE_GRAD`` / megapipe's ``STEP``
are dropped.

Pairs compared (where both sides accept ``p`` and ``m``):

* ``gpipe`` and ``ScheduleGPipe``, ``interleaved-zb`` and ``ScheduleInterleavedZeroBubble``,
  ``zb-h1`` and ``ScheduleInterleavedZeroBubble`` with one stage per rank (its one-chunk form), and
  ``zbv`` and ``ScheduleZBVZeroBubble``: equal on every rank.
* ``1f1b`` and ``Schedule1F1B``: equal on every rank but the last, where torch's order numbers the
  forwards from 1 instead of 0 (``F1 B0 F2 B1 ... Fm B(m-1)``: its steady state increments the
  microbatch before the first forward when there is no warm-up). That order only feeds torch's
  schedule visualizer; its runtime runs ``_step_microbatches``. The test pins that exact relation
  (or equality, should torch correct it).
* ``interleaved`` and ``ScheduleInterleaved1F1B``: equal whenever m is a multiple of p and m > p.
  At m = p megapipe follows Megatron-LM (all m v forwards first, then all backwards) while torch
  keeps its usual warm-up of ``(v - 1) p + 2 (p - 1 - r)`` forwards on rank r; both are valid.
  There the test asserts the precise relation: per rank the same multiset of actions, the same
  order of the forwards and the same order of the backwards, torch's order satisfying every
  dependency (megapipe's validator accepts it, communication inserted), megapipe's per-rank peak
  of microbatches in flight m v and torch's ``min(warm-up + 1, m v)``.

Where megapipe refuses sizes that torch accepts (interleaved with m not a multiple of p, zb-h1 with
m < p, ZBV with m < 2p - 1 or p = 1) nothing is compared, nor where torch refuses what megapipe
accepts (zb-h1 with m not a multiple of torch's rounds, ``max(1, m // p)``: a test of its own
asserts that torch refuses exactly those).
The same file runs on the GPU machines' torch (``tools/gpu_stack_check.sh``), so a change in either
side's orders shows up on both stacks.
"""

from __future__ import annotations

from collections import Counter

import pytest

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.schedules.catalog import build_schedule, lower_schedule, schedule_descriptor

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

pytestmark = pytest.mark.unit

_KIND = {"F": "F", "B": "B", "I": "BI", "W": "BW"}
_TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                "interleaved-zb": "ScheduleInterleavedZeroBubble", "zb-h1": "ScheduleInterleavedZeroBubble",
                "zbv": "ScheduleZBVZeroBubble"}


class _StandInStage:
    """What torch's schedule constructors read of a pipeline stage; no module, no process group."""

    def __init__(self, index: int, num_stages: int, rank: int, group_size: int):
        self.stage_index, self.num_stages = index, num_stages
        self.group_rank, self.group_size = rank, group_size
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = None  # not a module: torch's torch.compile check passes over it
        self.stage_index_to_group_rank: dict = {}


def torch_order(name: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, torch's compute actions as (kind, microbatch, stage); None where torch refuses the sizes."""
    cls = getattr(schedules, _TORCH_CLASS[name])
    try:
        if name in ("gpipe", "1f1b"):
            built = cls(_StandInStage(0, p, 0, p), m)
        elif name == "zbv":
            built = cls([_StandInStage(0, 2 * p, 0, p), _StandInStage(2 * p - 1, 2 * p, 0, p)], m)
        else:  # looped chunks: rank 0 holds stages 0, p, 2p, ...
            built = cls([_StandInStage(chunk * p, p * v, 0, p) for chunk in range(v)], m)
    except ValueError:
        return None
    order = built.pipeline_order
    return [[(_KIND[a.computation_type.value], a.microbatch_index, a.stage_index)
             for a in order[rank] if a is not None and a.computation_type.value in _KIND] for rank in sorted(order)]


def megapipe_order(name: str, p: int, m: int, v: int):
    """Per rank, megapipe's compute actions as (kind, microbatch, stage); None where megapipe refuses the sizes."""
    try:
        built = build_schedule(name, p, m, v)
    except ConfigError:
        return None
    return [[(a.kind.value, a.microbatch, a.stage) for a in actions if a.kind.is_compute] for actions in built.actions]


def peak_in_flight(actions: list[tuple[str, int, int]]) -> int:
    """Most (stage, microbatch) forwards a rank holds at once before their weight gradients are done."""
    held = peak = 0
    for kind, _, _ in actions:
        held += 1 if kind == "F" else -1 if kind in ("B", "BW") else 0
        peak = max(peak, held)
    return peak


def as_megapipe_schedule(name: str, p: int, m: int, v: int, order) -> Schedule:
    """torch's compute order as a megapipe schedule, validated and with its messages inserted
    (``lower_schedule`` rejects an order whose dependencies cannot all be met)."""
    lists = [[Action(ActionKind(kind), stage, microbatch) for kind, microbatch, stage in rank] + [Action(ActionKind.STEP)]
             for rank in order]
    return lower_schedule(Schedule(name, p, m, v, lists, placement=schedule_descriptor(name).placement))


def _cases(name: str, chunks: tuple[int, ...], ranks=(1, 2, 3, 4), microbatches=range(1, 13)):
    """The sizes megapipe accepts, over a grid."""
    return [(name, p, m, v) for p in ranks for m in microbatches for v in chunks
            if megapipe_order(name, p, m, v) is not None]


def torch_refuses(name: str, p: int, m: int) -> bool:
    """torch's interleaved zero bubble runs rounds of ``max(1, m // p)`` microbatches and refuses an m
    that is not a multiple of them; megapipe's ZB-H1 takes any m >= p."""
    return _TORCH_CLASS[name] == "ScheduleInterleavedZeroBubble" and m % max(1, m // p) != 0


COMPARED = (_cases("gpipe", (1,)) + _cases("zb-h1", (1,)) + _cases("interleaved-zb", (2, 3))
            + _cases("zbv", (2,), ranks=(2, 3, 4)))
EQUAL = [case for case in COMPARED if not torch_refuses(*case[:3])]


@pytest.mark.parametrize("name,p,m,v", EQUAL)
def test_same_order_as_torch(name, p, m, v):
    assert megapipe_order(name, p, m, v) == torch_order(name, p, m, v)


def test_torch_refuses_exactly_the_sizes_said():
    refused = [case for case in COMPARED if torch_order(*case) is None]
    assert refused == [case for case in COMPARED if torch_refuses(*case[:3])] and refused


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [4, 5, 8, 12])
def test_1f1b_as_torch_but_its_last_rank_numbering(p, m):
    mine, theirs = megapipe_order("1f1b", p, m, 1), torch_order("1f1b", p, m, 1)
    assert mine[:-1] == theirs[:-1]
    shifted = [(kind, microbatch + (kind == "F"), stage) for kind, microbatch, stage in mine[-1]]
    assert theirs[-1] in (mine[-1], shifted)


@pytest.mark.parametrize("p,m", [(p, m) for p in (1, 2, 3, 4) for m in range(p + 1, 13) if m % p == 0])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_same_as_torch_beyond_one_round(p, m, v):
    assert megapipe_order("interleaved", p, m, v) == torch_order("interleaved", p, m, v)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_one_round_megatron_warmup_against_torch(p, v):
    m = p
    mine, theirs = megapipe_order("interleaved", p, m, v), torch_order("interleaved", p, m, v)
    as_megapipe_schedule("interleaved", p, m, v, theirs)  # every dependency of torch's order can be met
    for rank in range(p):
        assert Counter(mine[rank]) == Counter(theirs[rank])
        for kinds in ({"F"}, {"B"}):
            assert [a for a in mine[rank] if a[0] in kinds] == [a for a in theirs[rank] if a[0] in kinds]
        assert mine[rank] == [a for a in mine[rank] if a[0] == "F"] + [a for a in mine[rank] if a[0] == "B"]
        torch_warmup = (v - 1) * p + 2 * (p - 1 - rank)
        assert peak_in_flight(mine[rank]) == m * v
        assert peak_in_flight(theirs[rank]) == min(torch_warmup + 1, m * v)
        # a warm-up one short of all forwards leaves a single F-B pair, the same order as megapipe's
        assert (mine[rank] == theirs[rank]) == (torch_warmup >= m * v - 1)
