"""Zero-bubble schedules (split backward: BI then BW) train exactly like gradient accumulation.

The V schedules (``zbv``, ``v-half``, ``v-min``, ``dualpipev``: two chunks per rank in a V, the
first rank holding both the embedding and the loss, hence both copies of the tied embedding)
meet the same reference with m = 2p microbatches per replica (ZBV's least): in the default
suite each runs on the three layouts, GPT and BERT alternating and recomputation on every other
run; MEGAPIPE_FULL_ZB_MATRIX=1 runs every schedule on every layout of t, d in {1, 2} and
p in {2, 4} within 8 processes, for both models, with and without recomputation (minutes).

ZB-H1 and ZB-H2 at pipeline sizes 2 and 4, tensor sizes 1 and 2, data sizes 1 and 2 (the
three layouts of one world of 8 processes), GPT and BERT, with and without full
recomputation (on in alternate runs, so every schedule and model meets both): per-microbatch losses and every parameter after 3 SGD-with-momentum steps
equal one process accumulating gradients over the same microbatches, within the 1e-5
relative of ``test_pipeline_training`` (same reasoning: fp32 summation-order differences of
~1e-7 over 3 linear updates). Recomputation is bit-for-bit the same maths, so its runs are
compared with the same reference. The BW passes go through the data-parallel gradient
syncs' hooks and the tied embedding's sum, so a gradient lost or counted twice would show.
"""

import os
from collections import defaultdict

import pytest

from megapipe.testing import run_distributed
from test_pipeline_training import M, STEPS, assert_close, pipelined_run, reference_run

SCHEDULES = ("zb-h1", "zb-h2")
LAYOUTS = [(2, 4, 1), (2, 2, 2), (1, 4, 2)]  # (t, p, d)


def check_layouts(rank, world_size, layouts, kinds):
    checked = []
    for kind in kinds:
        references = {d: reference_run(kind, d) for d in sorted({d for _, _, d in layouts})}
        for layout_index, (t, p, d) in enumerate(layouts):
            initial, ref_losses, ref_final = references[d]
            for schedule_index, schedule in enumerate(SCHEDULES):
                # recomputation on for half the runs: each schedule and model sees both, on alternate layouts
                recompute = (kinds.index(kind) + layout_index + schedule_index) % 2 == 1
                what = f"{kind} {schedule} t={t} p={p} d={d} recompute={recompute}"
                ps, losses, final = pipelined_run(kind, t, p, d, schedule, 1, initial, recompute)
                if ps.is_last_stage:
                    for step in range(STEPS):
                        expected = ref_losses[step][ps.dp_rank * M:(ps.dp_rank + 1) * M]
                        assert_close(losses[step], expected, f"{what} losses of step {step}")
                for name, value in final.items():
                    assert_close(value, ref_final[name], f"{what} parameter {name}")
                checked.append(what)
    return checked


def test_zero_bubble_schedules_match_gradient_accumulation():
    kinds = ("gpt", "bert")
    results = run_distributed(8, check_layouts, LAYOUTS, kinds, timeout=900)
    assert len(results[0]) == len(kinds) * len(LAYOUTS) * len(SCHEDULES)


V_SCHEDULES = ("zbv", "v-half", "v-min", "dualpipev")


def v_cases():
    """(t, p, d, kind, schedule, recompute) runs, grouped by world size."""
    full = os.environ.get("MEGAPIPE_FULL_ZB_MATRIX") == "1"
    layouts = [(t, p, d) for t in (1, 2) for p in (2, 4) for d in (1, 2) if t * p * d <= 8] if full else LAYOUTS
    cases = defaultdict(list)
    for layout_index, (t, p, d) in enumerate(layouts):
        for schedule_index, schedule in enumerate(V_SCHEDULES):
            if full:
                runs = [(kind, recompute) for kind in ("gpt", "bert") for recompute in (False, True)]
            else:  # every schedule meets both models and both recomputation settings across the layouts
                turn = layout_index + schedule_index
                runs = [(("gpt", "bert")[turn % 2], (turn // 2) % 2 == 1)]
            cases[t * p * d] += [(t, p, d, kind, schedule, recompute) for kind, recompute in runs]
    return sorted(cases.items())


def check_v_runs(rank, world_size, cases):
    references, checked = {}, []
    for t, p, d, kind, schedule, recompute in cases:
        m = 2 * p
        if (kind, d, m) not in references:
            references[(kind, d, m)] = reference_run(kind, d, m)
        initial, ref_losses, ref_final = references[(kind, d, m)]
        what = f"{kind} {schedule} t={t} p={p} d={d} m={m} recompute={recompute}"
        ps, losses, final = pipelined_run(kind, t, p, d, schedule, 2, initial, recompute, m=m)
        if ps.is_last_stage:
            assert ps.pp_rank == 0  # the V brings the last stage back to the first rank
            for step in range(STEPS):
                assert_close(losses[step], ref_losses[step][ps.dp_rank * m:(ps.dp_rank + 1) * m],
                             f"{what} losses of step {step}")
        for name, value in final.items():
            assert_close(value, ref_final[name], f"{what} parameter {name}")
        checked.append(what)
    return checked


@pytest.mark.parametrize("world, cases", v_cases())
def test_v_schedules_match_gradient_accumulation(world, cases):
    results = run_distributed(world, check_v_runs, cases, timeout=1800)
    assert len(results[0]) == len(cases)
