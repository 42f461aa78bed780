"""The planner's expert-tensor size etp below t (``--expert-tensor-parallel-size``): the all-to-alls carry a
t / etp-th of the tokens over the expert groups ``layout/experts.py`` folds, each rank holds 1/(etp e) of the
experts and reduces their gradients over t d / (etp e) ranks, and the command carries etp to a config the
training scripts accept. (The search over etp is checked against the rules in test_planner_experts.py.)"""

import dataclasses
import shlex

import pytest
from test_planner_experts import MOE, moe_profile
from test_planner_plan import small_cluster

from megapipe.cli.parse import parse_config
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import Candidate, PlanCostModel, Training, all_to_all_time, collective_time
from megapipe.planner.launch import torchrun_command

pytestmark = pytest.mark.unit

B = 2
WHOLE = Candidate(2, 1, 2, B, "1f1b", expert=2)  # etp = t = 2: expert groups {0, 2}, {1, 3}
SPLIT = dataclasses.replace(WHOLE, expert_tensor=1)  # etp = 1: expert groups {0, 1}, {2, 3}, expert-data {0, 2}, {1, 3}


def test_the_exchange_state_and_reduction_follow_the_expert_tensor_size():
    profile, cluster, training = moe_profile(), small_cluster(), Training(8)
    model = PlanCostModel(profile, cluster, training)
    whole, split = model.estimate(WHOLE), model.estimate(SPLIT)
    m, link = whole.microbatches, cluster.link([0, 1])  # one node: every group's link
    routed = B * MOE.seq_length * MOE.moe_router_topk * MOE.hidden_size * profile.element_bytes
    for estimate, share in ((whole, 1), (split, 2)):  # etp = 1: each tensor rank dispatches half the tokens
        assert estimate.expert_comm_time == pytest.approx(m * MOE.num_layers * 4 * all_to_all_time(routed / share, 2,
                                                                                                   link))
    experts = MOE.expert_params_per_block * MOE.num_layers
    per_param = profile.element_bytes + training.grad_bytes_per_param + training.optimizer_bytes(2)
    assert split.memory - whole.memory == pytest.approx((experts / 2 - experts / 4) * per_param)  # 1/(etp e)
    reduced = collective_time("all_reduce", experts / 2 * training.grad_bytes_per_param, 2, link)  # over {0, 2}
    assert split.data_comm_time - whole.data_comm_time == pytest.approx(reduced)  # at etp = t: each expert once
    assert whole.compute_time == split.compute_time and whole.tensor_comm_time == split.tensor_comm_time


def test_experts_kept_on_a_node_exchange_less_across_nodes():
    """Two nodes of two devices: at etp = t the expert group pairs data replicas on different nodes, at etp = 1
    it is the two tensor ranks of one node."""
    cluster = Cluster(nodes=2, gpus_per_node=2, memory_per_gpu=2 ** 36, intra_node_bandwidth=5e10,
                      inter_node_bandwidth=2e8, intra_node_latency=5e-6, inter_node_latency=2e-5)
    model = PlanCostModel(moe_profile(), cluster, Training(8))
    whole, split = model.estimate(WHOLE), model.estimate(SPLIT)
    assert split.expert_comm_time < whole.expert_comm_time / 10
    assert split.traffic.expert == 0 < whole.traffic.expert


def test_the_command_carries_the_expert_tensor_size():
    estimate = PlanCostModel(moe_profile(), small_cluster(), Training(8)).estimate(SPLIT)
    command = torchrun_command(estimate, MOE, small_cluster(nodes=1), 8)
    assert "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1" in command
    words = shlex.split(command)
    parallel = parse_config("gpt", words[words.index("pretrain_gpt.py") + 1:], world_size=4).parallel
    assert (parallel.tensor, parallel.expert, parallel.expert_tensor) == (2, 2, 1)
    assert "--expert-tensor-parallel-size" not in torchrun_command(dataclasses.replace(estimate, candidate=WHOLE), MOE,
                                                                   small_cluster(nodes=1), 8)


def test_below_t_without_expert_parallelism_each_tensor_share_holds_whole_experts():
    """t = 2, etp = 1, e = 1: no all-to-all, every rank holds all of every expert (twice etp = t's half), and
    the experts' gradients are all-reduced over the four ranks t x d that hold them, after the rest over d (one
    more collective's latency)."""
    profile, cluster, training = moe_profile(), small_cluster(), Training(8)
    model = PlanCostModel(profile, cluster, training)
    dense_like = Candidate(2, 1, 2, B, "1f1b")
    whole, split = model.estimate(dense_like), model.estimate(dataclasses.replace(dense_like, expert_tensor=1))
    assert whole.expert_comm_time == split.expert_comm_time == 0
    experts = MOE.expert_params_per_block * MOE.num_layers
    per_param = profile.element_bytes + training.grad_bytes_per_param + training.optimizer_bytes(2)
    assert split.memory - whole.memory == pytest.approx((experts - experts / 2) * per_param)
    link, grad = cluster.link([0, 1]), training.grad_bytes_per_param
    moved = (collective_time("all_reduce", experts * grad, 4, link)
             - collective_time("all_reduce", experts / 2 * grad, 2, link) + 2 * link.reduce_latency)
    assert split.data_comm_time - whole.data_comm_time == pytest.approx(moved)
    command = torchrun_command(split, MOE, small_cluster(nodes=1), 8)
    words = shlex.split(command)
    parallel = parse_config("gpt", words[words.index("pretrain_gpt.py") + 1:], world_size=4).parallel
    assert (parallel.tensor, parallel.expert, parallel.expert_tensor) == (2, 1, 1)
