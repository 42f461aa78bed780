"""The planner's data-parallel sharding levels against closed forms: bytes per rank of weights,
gradients and optimizer state at each level, the reduce-scatter / all-gather volumes, the
overlap, and a plan that needs a sharded optimizer to fit."""

import pytest

from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.launch import torchrun_command
from megapipe.planner.plan import PlanRequest, plan
from test_planner_costs import E, GRAD, L, OPTIMIZER, PARAMS, cluster, synthetic_profile

D = 4
W = L * PARAMS  # parameters of the whole model (embedding and head hold none here)


def estimate(sharding: str, overlap: bool = False, machines=None, m: int = 2):
    model = PlanCostModel(synthetic_profile(stash=0.0), machines or cluster(), Training(D * m, overlap=overlap))
    return model.estimate(Candidate(1, 1, D, 1, "1f1b", sharding=sharding))


@pytest.mark.unit
def test_memory_per_rank_counts_each_level():
    # stash 0: the estimate is the weights, gradients and optimizer state alone
    shard = W / D
    assert estimate("no_shard").memory == pytest.approx(W * (E + GRAD + OPTIMIZER))
    assert estimate("optim").memory == pytest.approx(E * (W + shard) + GRAD * (W + shard) + OPTIMIZER * shard)
    assert estimate("optim_grads").memory == estimate("optim").memory  # backward refills the whole buffer
    assert estimate("optim_grads_params").memory == pytest.approx(E * (shard + W) + GRAD * (W + shard)
                                                                  + OPTIMIZER * shard)


@pytest.mark.unit
def test_sharded_levels_reduce_scatter_gradients_and_all_gather_weights():
    bandwidth = 1e9
    ring = (D - 1) / D / bandwidth
    assert estimate("no_shard").data_comm_time == pytest.approx(2 * ring * W * GRAD)
    assert estimate("optim").data_comm_time == pytest.approx(ring * W * GRAD + ring * W * E)
    m = 2  # optim_grads_params gathers before every forward and backward of every microbatch, not after the
    #        step (what benchmarks/bench_traffic.py counts on the wire)
    assert estimate("optim_grads_params", m=m).data_comm_time == pytest.approx(ring * W * GRAD + 2 * m * ring * W * E)


@pytest.mark.unit
def test_overlap_hides_the_reduction_behind_the_last_backward():
    slow = cluster(intra=1e6)  # a reduction longer than a backward: only the backward's share is hidden
    plain, overlapped = estimate("no_shard", machines=slow), estimate("no_shard", overlap=True, machines=slow)
    backward = 2 * 1e-3 * L  # per microbatch of 1 sample (the synthetic profile's 2 x forward per block)
    assert plain.data_comm_time - overlapped.data_comm_time == pytest.approx(backward)
    assert overlapped.batch_time == pytest.approx(plain.batch_time - backward)


@pytest.mark.system
def test_plan_chooses_a_sharded_optimizer_when_replicas_do_not_fit_and_prints_it():
    profile = synthetic_profile(stash=0.0)
    no_shard = W * (E + GRAD + OPTIMIZER)
    machines = cluster(memory=0.8 * no_shard / 0.9)  # usable memory (90 %) below a replica's bytes
    request = PlanRequest(8, schedules=("1f1b",), recompute=(False,))
    result = plan(profile, machines, request)
    replicas = [e.candidate.sharding for e in result.ranked if e.candidate.pipeline == 1 and e.candidate.tensor == 1]
    assert replicas and "no_shard" not in replicas  # d = 8 replicas fit only with a sharded optimizer
    best = result.best
    command = torchrun_command(best, profile.shape, machines, 8, overlap=True)
    assert f"--data-parallel-sharding-strategy {best.candidate.sharding}" in command
    assert "--overlap-grad-reduce" in command
    assert ("--overlap-param-gather" in command) == (best.candidate.sharding != "no_shard")
