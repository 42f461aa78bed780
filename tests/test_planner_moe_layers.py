"""The planner on models that mix dense and MoE blocks (``--moe-layer-freq``): the closed-form profile's blocks
against the built model's layers and the family's FLOPs, each pipeline rank's time and expert all-to-alls
following the blocks it holds, and tools/plan.py carrying the flag into a command the training scripts accept."""

import dataclasses
import json
import shlex

import pytest
from test_planner_cli import run, write_cluster
from test_planner_plan import SMALL, small_cluster

from megapipe.cli.parse import parse_config
from megapipe.models import build_model_chunks
from megapipe.models.flops import moe_flops_per_iteration
from megapipe.parallel.state import ParallelState
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cost_model import Candidate, PlanCostModel, Training, all_to_all_time, model_flops_per_sample
from megapipe.planner.profile import ModelProfile

pytestmark = pytest.mark.unit

FRONT, BACK = (1, 1, 1, 1, 0, 0, 0, 0), (0, 0, 0, 0, 1, 1, 1, 1)  # experts in the first or last half of SMALL


def moe(freq, **shape):
    return dataclasses.replace(SMALL, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=freq,
                               **shape)


@pytest.mark.parametrize("freq", [2, (1, 0, 0, 1)])
def test_the_closed_form_blocks_are_the_models_layers_and_flops(freq):
    shape = moe(freq, num_layers=4)
    config = shape.to_config()
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    profile = analytic_gpt_profile(shape, 1e12, micro_batch_sizes=(1,))
    blocks = profile.layers[1:-1]
    assert [block.params for block in blocks] == [sum(p.numel() for p in layer.parameters())
                                                  for layer in model.layers.values()]
    assert sum(layer.params for layer in profile.layers) == sum(p.numel() for p in model.parameters())
    moe_blocks = {block.forward_s for i, block in enumerate(blocks) if config.is_moe_layer(i)}
    dense_blocks = {block.forward_s for i, block in enumerate(blocks) if not config.is_moe_layer(i)}
    assert len(moe_blocks) == len(dense_blocks) == 1 and moe_blocks != dense_blocks
    assert ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile  # the tuple as a JSON list
    for recompute in (False, True):  # SMALL's vocabulary of 128 needs no padding
        assert model_flops_per_sample(profile, recompute) == moe_flops_per_iteration(config, 1, recompute)


def test_a_ranks_time_and_all_to_alls_follow_the_blocks_it_holds():
    """Moving the experts from the second pipeline rank's blocks to the first's moves their compute and their
    all-to-alls with them; the embedding, the head and the messages stay where they are."""
    cluster, b = small_cluster(), 2
    front, back = (PlanCostModel(analytic_gpt_profile(moe(freq), 1e12, micro_batch_sizes=(1, 2, 4)), cluster,
                                 Training(8)) for freq in (FRONT, BACK))
    candidate = Candidate(1, 2, 2, b, "1f1b", expert=2)
    one = all_to_all_time(b * SMALL.seq_length * 2 * SMALL.hidden_size * 2, 2, cluster.link([0, 1]))
    block = front.profile.layers
    moe_forward, dense_forward = block[1].forward_s[1], block[8].forward_s[1]  # at b = 2
    extra = 4 * (moe_forward - dense_forward) / cluster.compute_speed + 4 * 2 * one  # four blocks, two exchanges
    (forward_f, backward_f), (forward_b, backward_b) = (model.estimate(candidate).rank_times for model in (front, back))
    assert forward_f[0] - forward_b[0] == pytest.approx(extra) and forward_b[1] - forward_f[1] == pytest.approx(extra)
    backward_extra = 2 * extra - 4 * 2 * one  # compute twice the forward's, the two exchanges once more
    assert backward_f[0] - backward_b[0] == pytest.approx(backward_extra)
    m = 8 // (2 * b)
    assert front.estimate(dataclasses.replace(candidate, expert=1)).expert_comm_time == 0.0
    estimate = front.estimate(candidate)
    forward, backward = estimate.rank_times
    slowest = max(range(2), key=lambda r: forward[r] + backward[r])
    assert estimate.expert_comm_time == pytest.approx(m * 4 * 4 * one if slowest == 0 else 0.0)  # the slowest rank's


def test_plan_takes_the_layer_frequency_and_its_command_trains(tmp_path, capsys):
    shape = ["--num-layers", 4, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32,
             "--vocab-size", 128, "--num-experts", 4, "--moe-ffn-hidden-size", 32]
    cluster = write_cluster(tmp_path / "cluster.json", memory_per_gpu=2 ** 34)
    code, out, err = run(shape + ["--moe-layer-freq", "1,0,0,1", "--cluster", cluster, "--global-batch-size", 8,
                                  "--schedules", "1f1b"], capsys)
    assert code == 0, err
    command = next(line for line in out.splitlines() if line.startswith("torchrun"))
    assert "--moe-layer-freq 1,0,0,1" in command
    words = shlex.split(command)
    config = parse_config("gpt", words[words.index("pretrain_gpt.py") + 1:], world_size=4)
    assert [config.model.is_moe_layer(i) for i in range(4)] == [True, False, False, True]
    code, _, err = run(shape[:-4] + ["--moe-layer-freq", 2, "--cluster", cluster, "--global-batch-size", 8], capsys)
    assert code == 2 and "--moe-layer-freq says which blocks hold experts; add --num-experts" in err
    code, _, err = run(shape + ["--moe-layer-freq", "1,0", "--cluster", cluster, "--global-batch-size", 8], capsys)
    assert code == 2 and "--moe-layer-freq lists 2 entries but --num-layers is 4" in err
