"""``--pipeline-schedule auto`` with no cost flags: the stages' costs are their model FLOPs, and the search
then picks a zero-bubble schedule (split backward) predicted faster than 1F1B."""

from __future__ import annotations

import functools

import pytest

from megapipe.cli.parse import parse_run
from megapipe.cli.resolve import with_vocabulary
from megapipe.cli.selection import flop_costs, stage_costs
from megapipe.models.flops import head_forward_flops, layer_forward_flops
from megapipe.schedules.actions import ActionKind
from megapipe.schedules.analysis.simulate import simulate
from megapipe.schedules.catalog import build_schedule

pytestmark = pytest.mark.unit

FLAGS = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--vocab-size", "1000", "--mock-data", "--pipeline-schedule", "auto"]


def plan(p: int, v: int = 1):
    """The run's plan once the tokenizer gave its vocabulary (the mock data's ids and its end-of-document id),
    which the last stage's costs need: the search runs then."""
    chunks = [] if v == 1 else ["--num-layers-per-virtual-pipeline-stage", str(8 // (p * v))]
    return with_vocabulary(parse_run("gpt", FLAGS + ["--pipeline-model-parallel-size", str(p), *chunks],
                                     world_size=p), 1001)


def test_the_search_waits_for_the_vocabulary():
    run = parse_run("gpt", FLAGS + ["--pipeline-model-parallel-size", "2"], world_size=2)
    assert run.search is None and run.schedule == "auto"


def test_each_stage_costs_its_layers_and_the_last_its_head_too():
    config = plan(2).config
    costs = flop_costs(config, 2, 1, 0)
    model, tokens = config.model, 2 * 128
    layers = sum(layer_forward_flops(tokens, model, layer) for layer in range(4))
    head = head_forward_flops(tokens, 256, model.padded_vocab_size(1))
    assert float(costs.forward[0]) == pytest.approx(layers / 1e9, rel=1e-6)
    assert float(costs.forward[1]) == pytest.approx((layers + head) / 1e9, rel=1e-6)
    attention = 4 * 4 * tokens * 128 * 256  # four layers' scores and values: in BI, not in BW
    assert float(costs.input_backward[0] - costs.weight_backward[0]) == pytest.approx(2 * attention / 1e9, rel=1e-5)
    for stage in range(2):  # BI + BW is a whole backward: twice the forward
        assert float(costs.backward[stage]) == pytest.approx(2 * float(costs.forward[stage]), rel=1e-5)


def test_costs_for_another_chunk_count_split_the_layers_equally():
    config = plan(2, v=2).config  # the run has 4 virtual stages; the comparison also prices v = 1
    one_chunk = flop_costs(config, 2, 1, 0)
    assert len(one_chunk.forward) == 2
    assert float(one_chunk.forward[0]) == pytest.approx(2 * float(flop_costs(config, 2, 2, 0).forward[0]), rel=1e-5)


@pytest.mark.parametrize("p,v", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_auto_without_cost_flags_picks_a_split_backward_faster_than_1f1b(p, v):
    run = plan(p, v)
    assert run.search is not None
    kinds = {action.kind for actions in run.search.schedule.actions for action in actions}
    assert {ActionKind.BI, ActionKind.BW} <= kinds
    costs = functools.partial(stage_costs, "gpt", run.config, p)
    one_f_one_b = simulate(build_schedule("1f1b", p, 8), costs(1)).makespan
    assert run.search.simulation.makespan < one_f_one_b
