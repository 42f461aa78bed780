"""Zero-bubble schedules (split backward: BI then BW) train exactly like gradient accumulation.

ZB-H1, ZB-H2 and interleaved zero bubble (two chunks per rank) at pipeline sizes 2 and 4,
tensor sizes 1 and 2, data sizes 1 and 2 (by default the three layouts of one world of 8
processes, which cover each size; ``MEGAPIPE_FULL_ZB_MATRIX=1`` runs every layout within 8
processes, in worlds of 2, 4 and 8), GPT and BERT, with and without full recomputation (by
default on in alternate runs, so every schedule and model meets both; the full matrix runs
both everywhere): per-microbatch losses and every parameter after 3 SGD-with-momentum steps
equal one process accumulating gradients over the same microbatches, within the 1e-5
relative of ``test_pipeline_training`` (same reasoning: fp32 summation-order differences of
~1e-7 over 3 linear updates). Recomputation is bit-for-bit the same maths, so its runs are
compared with the same reference. The BW passes go through the data-parallel gradient
syncs' hooks and the tied embedding's sum, so a gradient lost or counted twice would show.
A schedule searched for unequal stage costs (``--pipeline-schedule auto``; rank 1 taking 1.5x
as long) is held to the same reference on the first layout, with two chunks per rank.

The V schedules (``zbv``, ``v-half``, ``v-min``, ``dualpipev``: two chunks per rank in a V, the
first rank holding both the embedding and the loss, hence both copies of the tied embedding)
meet the same reference with m = 2p microbatches per replica (above their least, 2p - 1): by default each runs
on the three layouts, GPT and BERT alternating and recomputation on every other run; the full
matrix runs every schedule on every layout, for both models, with and without recomputation.
"""

import itertools
import os
from collections import defaultdict
from fractions import Fraction

import pytest

from megapipe.schedules.analysis.schedule_search import search_schedule
from megapipe.schedules.analysis.simulate import CostModel
from megapipe.testing.worlds import run_distributed
from test_pipeline_training import M, assert_matches_reference, pipelined_run, shared_references

pytestmark = pytest.mark.distributed

SCHEDULES = (("zb-h1", 1), ("zb-h2", 1), ("interleaved-zb", 2))  # name, chunks per rank
LAYOUTS = [(2, 4, 1), (2, 2, 2), (1, 4, 2)]  # (t, p, d)
FULL = os.environ.get("MEGAPIPE_FULL_ZB_MATRIX") == "1"


def full_matrix() -> dict[int, list[tuple[int, int, int]]]:
    """Every (t, p, d) with t, d in {1, 2}, p in {2, 4} and t p d <= 8, grouped by world size."""
    cases: dict[int, list[tuple[int, int, int]]] = {}
    for t, p, d in itertools.product((1, 2), (2, 4), (1, 2)):
        if t * p * d <= 8:
            cases.setdefault(t * p * d, []).append((t, p, d))
    return cases


CASES = full_matrix() if FULL else {8: LAYOUTS}


def check_layouts(rank, world_size, layouts, kinds, both_recomputations=False):
    checked = []
    references = shared_references([(kind, d) for kind in kinds for d in sorted({d for _, _, d in layouts})])
    for kind in kinds:
        for layout_index, (t, p, d) in enumerate(layouts):
            for (schedule_index, (schedule, v)), recompute in itertools.product(enumerate(SCHEDULES), (False, True)):
                # recomputation on for half the runs: each schedule and model sees both, on alternate layouts
                alternate = (kinds.index(kind) + layout_index + schedule_index) % 2 == 1
                if not both_recomputations and recompute != alternate:
                    continue
                what = f"{kind} {schedule} v={v} t={t} p={p} d={d} recompute={recompute}"
                ps, losses, final = pipelined_run(kind, t, p, d, schedule, v, references[kind, d][0], recompute)
                assert_matches_reference(ps, losses, final, references[kind, d], what)
                checked.append(what)
        t, p, d = layouts[0]
        times = [Fraction(3, 2) if rank == 1 else 1 for rank in range(p)]
        searched = search_schedule(p, M, CostModel.per_rank(p, 2, times, times, times), memory_limit=p, v=2).schedule
        what = f"{kind} searched t={t} p={p} d={d}"
        ps, losses, final = pipelined_run(kind, t, p, d, searched, 2, references[kind, d][0])
        assert_matches_reference(ps, losses, final, references[kind, d], what)
        checked.append(what)
    return checked


@pytest.mark.timeout(3600 if FULL else 900)
@pytest.mark.parametrize("world", sorted(CASES))
def test_zero_bubble_schedules_match_gradient_accumulation(world):
    kinds, layouts = ("gpt", "bert"), CASES[world]
    results = run_distributed(world, check_layouts, layouts, kinds, FULL, timeout=3600 if FULL else 900)
    assert len(results[0]) == len(kinds) * (len(layouts) * len(SCHEDULES) * (2 if FULL else 1) + 1)


V_SCHEDULES = ("zbv", "v-half", "v-min", "dualpipev")


def v_cases():
    """(t, p, d, kind, schedule, recompute) runs, grouped by world size."""
    cases = defaultdict(list)
    for world, layouts in CASES.items():
        for layout_index, (t, p, d) in enumerate(layouts):
            for schedule_index, schedule in enumerate(V_SCHEDULES):
                if FULL:
                    runs = list(itertools.product(("gpt", "bert"), (False, True)))
                else:  # every schedule meets both models and both recomputation settings across the layouts
                    turn = layout_index + schedule_index
                    runs = [(("gpt", "bert")[turn % 2], (turn // 2) % 2 == 1)]
                cases[world] += [(t, p, d, kind, schedule, recompute) for kind, recompute in runs]
    return sorted(cases.items())


def check_v_runs(rank, world_size, cases):
    references = shared_references(sorted({(kind, d, 2 * p) for t, p, d, kind, _, _ in cases}))
    checked = []
    for t, p, d, kind, schedule, recompute in cases:
        m = 2 * p
        reference = references[(kind, d, m)]
        what = f"{kind} {schedule} t={t} p={p} d={d} m={m} recompute={recompute}"
        ps, losses, final = pipelined_run(kind, t, p, d, schedule, 2, reference[0], recompute, m=m)
        assert not ps.is_last_stage or ps.pp_rank == 0  # the V brings the last stage back to the first rank
        assert_matches_reference(ps, losses, final, reference, what, m)
        checked.append(what)
    return checked


@pytest.mark.timeout(3600 if FULL else 900)
@pytest.mark.parametrize("world, cases", v_cases())
def test_v_schedules_match_gradient_accumulation(world, cases):
    results = run_distributed(world, check_v_runs, cases, timeout=3600 if FULL else 900)
    assert len(results[0]) == len(cases)
