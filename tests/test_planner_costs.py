"""The cost model against closed forms computed here: seed 002's 2BW and GPipe memory footprints,
the section 4.3 communication volumes on hierarchical links, and the simulator's batch times."""

import operator
from dataclasses import replace
from fractions import Fraction

import pytest

from megapipe.schedules.actions import ActionKind
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.analysis.simulate import CostModel as SimulatorCosts, simulate
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.profile import LayerProfile, ModelProfile, ModelShape

pytestmark = pytest.mark.unit

L, S, H, HEADS, V = 8, 4, 16, 4, 32
E = 2  # bytes per element (16-bit)
FORWARD = 1e-3  # seconds per sample and block
PARAMS, SPLIT = 1000, 800
STASH, SPLIT_STASH = 4000.0, 3000.0  # bytes per sample and block
OPTIMIZER = 12  # fp32 master + two Adam moments for 16-bit weights
GRAD = 4


def synthetic_profile(head_forward=0.0, embedding_params=0, head_stash=0.0, stash=STASH, optimizer=0.0) -> ModelProfile:
    """Linear in b, two micro-batch sizes: blocks with the constants above, a nearly free embedding and head."""
    sizes = (1, 2)

    def per(value):
        return tuple(float(value * b) for b in sizes)

    output = E * S * H
    block = dict(kind="block", params=PARAMS, split_params=SPLIT, forward_s=per(FORWARD), backward_s=per(2 * FORWARD),
                 recompute_backward_s=per(3 * FORWARD), output_bytes=per(output), stash_bytes=per(stash),
                 split_stash_bytes=per(min(SPLIT_STASH, stash)))
    embedding = LayerProfile("embedding", "embedding", embedding_params, embedding_params, per(0), per(0), per(0),
                             per(output), per(0), per(0))
    head = LayerProfile("head", "head", 0, 0, per(head_forward), per(2 * head_forward), per(2 * head_forward),
                        per(4), per(head_stash), per(0))
    blocks = [LayerProfile(f"block.{i}", **block) for i in range(L)]
    return ModelProfile(ModelShape("gpt", L, H, HEADS, S, V, 4 * H), sizes, (embedding, *blocks, head),
                        "float16", "test", "analytic", optimizer)


def cluster(nodes=1, per_node=8, intra=1e9, inter=1e8, memory=1e12, latency=0.0, reduce=None) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=per_node, memory_per_gpu=memory, intra_node_bandwidth=intra,
                   inter_node_bandwidth=inter, intra_node_latency=latency, inter_node_latency=latency,
                   intra_node_reduce_bandwidth=reduce)


def estimate(layout, profile=None, machines=None, batch=32):
    return PlanCostModel(profile or synthetic_profile(), machines or cluster(), Training(batch)).estimate(layout)


def test_2bw_memory_is_the_seeds_footprint():
    # 2|W|/p + p |A_total|/p (no recomputation), plus gradients and optimizer state once.
    p = 4
    result = estimate(Candidate(1, p, 2, 2, "2bw"), batch=32)
    weights = L * PARAMS / p
    a_total = L * STASH * 2  # b = 2
    assert result.memory == 2 * weights * E + weights * (GRAD + OPTIMIZER) + p * a_total / p


def test_2bw_memory_with_recomputation_is_the_seeds_footprint():
    # 2|W|/p + |A_total|/p + p |A_input| when one checkpoint per stage uses least memory; in general
    # c checkpoints per stage cost p c A_input + (l / c) A_block (seed 002 section 4.3.5).
    p, b = 4, 2
    a_input = E * S * H * b
    blocks = L // p
    weights = L * PARAMS / p
    fixed = 2 * weights * E + weights * (GRAD + OPTIMIZER)
    for stash in (200.0, STASH):
        result = estimate(Candidate(1, p, 2, b, "2bw", recompute=True), synthetic_profile(stash=stash), batch=32)
        by_segment = {k: p * (blocks // k) * a_input + k * stash * b for k in (1, 2)}
        assert result.memory == fixed + min(by_segment.values())
        assert result.recompute_layers == min(by_segment, key=by_segment.get)
        if stash * b < p * a_input:  # recompute whole stages: the seeds' formula
            assert result.recompute_layers == blocks
            assert result.memory == fixed + L * stash * b / p + p * a_input


def test_gpipe_memory_with_recomputation_is_the_seeds_footprint():
    # |W|/p + |A_total|/p + m |A_input| (seed 002 section 3.2.3).
    p, b, batch = 2, 1, 16
    result = estimate(Candidate(1, p, 1, b, "gpipe", recompute=True), batch=batch)
    m = batch // b
    weights = L * PARAMS / p
    blocks = L // p
    best = min(blocks / k * m * E * S * H * b + k * STASH * b for k in (1, 2, 4))  # checkpoint every k blocks
    assert result.memory == weights * E + weights * (GRAD + OPTIMIZER) + best


def test_tensor_parallelism_splits_weights_and_activations_and_all_reduces_8bsh_per_layer():
    t, b, batch = 4, 2, 8
    bandwidth = 1e9
    result = estimate(Candidate(t, 1, 2, b, "1f1b"), machines=cluster(intra=bandwidth), batch=batch)
    weights = PARAMS - SPLIT + SPLIT / t
    stash = STASH * b - SPLIT_STASH * b + SPLIT_STASH * b / t
    assert result.memory == L * weights * (E + GRAD + OPTIMIZER) + stash * L
    m = batch // (2 * b)
    volume_per_layer = 8 * b * S * H * E * (t - 1) / t  # seed 002 section 4.3: 8bsh(t-1)/t
    embedding_and_head = 2 * 2 * b * S * H * E * (t - 1) / t  # one all-reduce each
    assert result.tensor_comm_time == pytest.approx(m * (L * volume_per_layer + embedding_and_head) / bandwidth)


@pytest.mark.parametrize("per_node,expected", [(4, "intra"), (2, "inter")])
def test_data_parallel_ring_all_reduce_uses_the_hierarchical_link(per_node, expected):
    d = 4
    machines = cluster(nodes=4 // per_node, per_node=per_node, intra=1e9, inter=1e7)
    result = estimate(Candidate(1, 1, d, 1, "1f1b"), machines=machines, batch=8)
    gradient_bytes = L * PARAMS * GRAD
    bandwidth = 1e9 if expected == "intra" else 1e7
    assert result.data_comm_time == pytest.approx(2 * (d - 1) / d * gradient_bytes / bandwidth)
    assert result.batch_time == pytest.approx(result.compute_time + result.data_comm_time)  # after the flush


def test_2bw_overlaps_the_all_reduce_and_flush_schedules_do_not():
    # Slow links make the gradient all-reduce (16 kB per rank) outweigh compute: 2BW hides
    # everything else under it, 1F1B pays it after (m + p - 1) steps of its equal ranks.
    p, d, m = 2, 2, 4
    machines = cluster(nodes=2, per_node=2, intra=1e5, inter=1e5)
    flush = estimate(Candidate(1, p, d, 1, "1f1b"), machines=machines, batch=d * m)
    double = estimate(Candidate(1, p, d, 1, "2bw"), machines=machines, batch=d * m)
    assert flush.data_comm_time == double.data_comm_time == pytest.approx(2 * (d - 1) / d * L * PARAMS / p * GRAD / 1e5)
    assert double.batch_time == double.data_comm_time > double.compute_time + double.pipeline_comm_time
    step = (flush.compute_time + flush.pipeline_comm_time) / m
    assert flush.batch_time == pytest.approx(flush.data_comm_time + (m + p - 1) * step)


def test_pipeline_boundaries_send_bsh_over_t_each_way_on_the_link_they_cross():
    # t = 2, p = 2, d = 1 on nodes of 2 devices: the boundary crosses nodes; scatter/gather sends bsh/t.
    t, p, b, batch, inter = 2, 2, 2, 4, 1e6
    machines = cluster(nodes=2, per_node=2, intra=1e12, inter=inter)
    result = estimate(Candidate(t, p, 1, b, "1f1b"), machines=machines, batch=batch)
    m = batch // b
    hop = E * S * H * b / t / inter
    # Sends overlap compute; each rank waits for what it receives: rank 1 the activation, rank 0 the gradient.
    assert result.pipeline_comm_time == pytest.approx(m * hop)
    # On gloo a receive's notice queues behind the tensor just sent the other way on the same connection.
    gloo = estimate(Candidate(t, p, 1, b, "1f1b"), machines=replace(machines, backend="gloo"), batch=batch)
    assert gloo.pipeline_comm_time == pytest.approx(m * 2 * hop)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_batch_time_equals_the_simulated_makespan(schedule, v):
    # Equal stages and free communication: the cost model's batch time is the simulator's makespan
    # fed with each virtual stage's forward and backward time from the profile.
    p, b, batch = 4, 1, 8
    machines = cluster(intra=1e30, inter=1e30)
    result = estimate(Candidate(1, p, 1, b, schedule, v), machines=machines, batch=batch)
    m = batch // b
    blocks = L // (p * v)
    costs = SimulatorCosts(forward=Fraction(blocks) * Fraction(FORWARD), backward=2 * blocks * Fraction(FORWARD))
    simulated = simulate(build_schedule(schedule, p, m, v), costs)
    assert result.batch_time == pytest.approx(float(simulated.makespan), rel=1e-12)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_batch_time_equals_the_simulated_makespan(schedule):
    # the V placement: each rank's two chunks' costs, DualPipeV's pairs run one pass after the other
    p, b, batch = 4, 1, 8
    result = estimate(Candidate(1, p, 1, b, schedule, 2), machines=cluster(intra=1e30, inter=1e30), batch=batch)
    blocks = L // (p * 2)
    forward = Fraction(blocks) * Fraction(FORWARD)
    costs = SimulatorCosts(forward=forward, backward=2 * forward, input_backward=forward, weight_backward=forward,
                           overlap=operator.add)
    simulated = simulate(build_schedule(schedule, p, batch // b, 2), costs)
    assert result.batch_time == pytest.approx(float(simulated.makespan), rel=1e-12)


def test_the_v_sends_nothing_at_its_turn_and_keeps_both_embedding_copies_on_the_first_rank():
    vocab_params, p, batch, inter = 5000, 2, 8, 1e6
    profile = synthetic_profile(embedding_params=vocab_params)
    machines = cluster(nodes=2, per_node=1, intra=1e30, inter=inter)
    v_shape = estimate(Candidate(1, p, 1, 1, "zbv", 2), profile, machines, batch=batch)
    looped = estimate(Candidate(1, p, 1, 1, "interleaved", 2), profile, machines, batch=batch)
    hop = E * S * H / inter
    # a rank waits for each tensor it receives across a boundary: under the V 0-1 and 2-3 cross, 1-2 not, so
    # rank 1 receives stage 1's input and stage 2's gradient; looped, 0-1, 1-2 and 2-3 all cross
    assert v_shape.pipeline_comm_time == pytest.approx(batch * 2 * hop)
    assert looped.pipeline_comm_time == pytest.approx(batch * 3 * hop)
    assert v_shape.data_comm_time == 0  # the tied copies are summed on rank 0, not over an embedding group
    per_param = E + GRAD + OPTIMIZER
    first_rank = (L // 2 * PARAMS + 2 * vocab_params) * per_param + 2 * (L // 2) * STASH  # p microbatches
    assert v_shape.memory == first_rank


def test_heavy_head_batch_time_equals_the_simulated_makespan():
    p, b, batch, head = 4, 1, 12, 5e-3
    profile = synthetic_profile(head_forward=head)
    result = estimate(Candidate(1, p, 1, b, "1f1b"), profile, machines=cluster(intra=1e30, inter=1e30), batch=batch)
    blocks = L // p
    forward = [blocks * FORWARD] * p
    backward = [2 * blocks * FORWARD] * p
    forward[-1] += head
    backward[-1] += 2 * head
    simulated = simulate(build_schedule("1f1b", p, batch // b).compute_only(),
                         SimulatorCosts(forward=forward, backward=backward))
    assert result.batch_time == pytest.approx(float(simulated.makespan), rel=1e-12)


def test_the_last_stage_holds_a_copy_of_the_tied_embedding():
    vocab_params = 5000
    profile = synthetic_profile(embedding_params=vocab_params)
    one = estimate(Candidate(1, 1, 1, 1, "1f1b"), profile, batch=4)
    two = estimate(Candidate(1, 2, 1, 1, "1f1b"), profile, batch=4)
    per_param = E + GRAD + OPTIMIZER
    assert one.memory == (L * PARAMS + vocab_params) * per_param + L * STASH
    last_rank = (L // 2 * PARAMS + vocab_params) * per_param + 1 * (L // 2) * STASH  # one microbatch in flight
    first_rank = (L // 2 * PARAMS + vocab_params) * per_param + 2 * (L // 2) * STASH
    assert two.memory == max(first_rank, last_rank)


def test_asynchronous_schedules_untie_the_embedding_instead_of_summing_its_copies():
    vocab_params, p, d = 5000, 2, 2
    profile = synthetic_profile(embedding_params=vocab_params)
    machines = cluster(nodes=2, per_node=2, intra=1e9, inter=1e7)
    flush = estimate(Candidate(1, p, d, 1, "1f1b"), profile, machines, batch=8)
    double = estimate(Candidate(1, p, d, 1, "2bw"), profile, machines, batch=8)
    grads = (L // p * PARAMS + vocab_params) * GRAD  # first and last rank: half the blocks and a vocabulary
    data = 2 * (d - 1) / d * grads / 1e9  # the data-parallel group shares a node
    tied = 2 * (2 - 1) / 2 * vocab_params * GRAD / 1e7  # first and last stage are on different nodes
    assert double.data_comm_time == pytest.approx(data)
    assert flush.data_comm_time == pytest.approx(data + tied)


def test_all_reduces_use_the_reduce_bandwidth_and_latency_per_step():
    d, reduce, latency = 4, 2e8, 1e-3
    result = estimate(Candidate(1, 1, d, 1, "1f1b"), machines=cluster(intra=1e9, reduce=reduce, latency=latency), batch=8)
    assert result.data_comm_time == pytest.approx(2 * (d - 1) / d * L * PARAMS * GRAD / reduce + 2 * (d - 1) * latency)


def test_the_optimizer_step_follows_the_flush_or_runs_in_the_stream_of_backwards():
    per_param, p, m = 1e-6, 2, 4
    profile = synthetic_profile(optimizer=per_param)
    free = cluster(intra=1e30, inter=1e30)
    plain = estimate(Candidate(1, 1, 1, 1, "1f1b"), profile, free, batch=m)
    assert plain.batch_time == pytest.approx(m * 3 * FORWARD * L + L * PARAMS * per_param)
    assert plain.optimizer_time == pytest.approx(L * PARAMS * per_param)
    double = estimate(Candidate(1, p, 1, 1, "2bw"), profile, free, batch=m)
    step = 3 * FORWARD * L / p + L * PARAMS / p * per_param / m  # each microbatch carries 1/m of an update
    assert double.batch_time == pytest.approx(m * step)


def test_processes_sharing_cores_take_at_least_their_total_work_over_the_cores():
    # 4 single-threaded processes on 2 cores: pure data parallelism is bound by its total work,
    # a 4-deep pipeline's bubble is filled by the other ranks' work.
    shared = Cluster(nodes=1, gpus_per_node=4, memory_per_gpu=1e12, intra_node_bandwidth=1e30,
                     inter_node_bandwidth=1e30, shared_cores=2.0)
    batch = 16
    work = batch * 3 * FORWARD * L  # every sample through every block, forward and backward
    data = estimate(Candidate(1, 1, 4, 2, "1f1b"), machines=shared, batch=batch)
    pipe = estimate(Candidate(1, 4, 1, 2, "1f1b"), machines=shared, batch=batch)
    assert data.batch_time == pytest.approx(work / 2)
    assert pipe.batch_time == pytest.approx(max(work / 2, (8 + 3) * 3 * FORWARD * 2 * 2))


def simulated_makespan(schedule, p, m, per_node, transfer_time):
    """The simulator's batch for the synthetic profile's equal stages (b = 1) when a message between
    ranks on different nodes of ``per_node`` takes ``transfer_time`` (the simulator's message model:
    it moves once its send and its receive are both posted, as gloo's and NCCL's do) and others are free."""
    forward = Fraction(L // p) * Fraction(FORWARD)

    def transfer(message):
        kind, stage, _ = message
        other = stage + 1 if kind is ActionKind.F else stage - 1
        return transfer_time if stage // per_node != other // per_node else 0

    costs = SimulatorCosts(forward=forward, backward=2 * forward, message_bytes=transfer, bandwidth=1)
    return float(simulate(build_schedule(schedule, p, m), costs).makespan)


def predicted_makespan(schedule, p, m, per_node, transfer_time):
    inter = E * S * H / transfer_time  # one boundary tensor at b = 1 takes transfer_time between nodes
    machines = cluster(nodes=p // per_node, per_node=per_node, intra=1e30, inter=inter)
    return estimate(Candidate(1, p, 1, 1, schedule), machines=machines, batch=m).batch_time


@pytest.mark.parametrize("p,per_node", [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("ratio", [Fraction(1, 2), 2, 5])  # transfer time over a stage's forward + backward
def test_gpipe_with_slow_links_is_the_simulated_makespan(p, per_node, ratio):
    # A receive is posted just before the compute that consumes it, so a rank waits for each input's
    # transfer: in the forward flow shop rank r's step is its forward plus the transfer from r - 1, in the
    # backward one its backward plus the transfer from r + 1. Exact for any links.
    step = 3 * (L // p) * FORWARD
    m = 2 * p
    assert predicted_makespan("gpipe", p, m, per_node, ratio * step) == pytest.approx(
        simulated_makespan("gpipe", p, m, per_node, ratio * step), rel=1e-9)


@pytest.mark.parametrize("ratio", [Fraction(1, 2), 2, 5])
def test_1f1b_with_slow_links_against_the_simulator(ratio):
    # Two stages across the link, from m = 2p microbatches: exact; each rank waits for one transfer per
    # microbatch, not two (sends overlap compute). Four stages with the link in the middle (2 nodes of 2):
    # the two ranks at the link each wait for one transfer per microbatch. Fill and drain charge every
    # other rank's step once: up to 4% above the simulated batch for fast links; for transfers of several
    # steps, the p - r microbatches 1F1B keeps in flight do not cover the round trip over the link in
    # the warm-up, and the simulated batch is up to 11% longer (at m = p; 4% at m = 4p).
    step = 3 * (L // 2) * FORWARD
    for m in (4, 8, 16):
        assert predicted_makespan("1f1b", 2, m, 1, ratio * step) == pytest.approx(
            simulated_makespan("1f1b", 2, m, 1, ratio * step), rel=1e-9)
    step = 3 * (L // 4) * FORWARD
    for m in (4, 8, 16):
        predicted = predicted_makespan("1f1b", 4, m, 2, ratio * step)
        assert 0.88 <= predicted / simulated_makespan("1f1b", 4, m, 2, ratio * step) <= 1.04


def test_data_parallel_pipelines_take_turns_on_a_shared_uplink():
    # (1, 2, 2) on 2 nodes of 2 sharing one uplink: each replica's boundary has the whole uplink to itself
    # (independent pipelines interleave their transfers), while the batch takes at least the time the
    # uplink needs to carry both replicas' tensors, each direction once per microbatch.
    uplink, m = 1e3, 8  # a transfer takes about 10 steps of a stage
    machines = replace(cluster(nodes=2, per_node=2, intra=1e30, inter=1e30), node_uplink_bandwidth=uplink)
    result = estimate(Candidate(1, 2, 2, 1, "1f1b"), machines=machines, batch=2 * m)
    message = E * S * H / uplink
    assert result.pipeline_comm_time == pytest.approx(m * message)
    assert result.batch_time == pytest.approx(m * 2 * message)  # the shared uplink bounds the batch


def test_sequence_parallelism_splits_the_stash_tensor_parallelism_replicates():
    """At t, each block's split stash is 1/t per rank either way; the rest (norm inputs, dropout masks) is
    whole without sequence parallelism and 1/t with it; the weights and their state are the same."""
    t, b = 4, 2
    plain = estimate(Candidate(t, 1, 1, b, "1f1b"), batch=b)
    split = estimate(Candidate(t, 1, 1, b, "1f1b", sequence_parallel=True), batch=b)
    replicated = L * (STASH - SPLIT_STASH) * b
    assert plain.memory - split.memory == pytest.approx(replicated * (1 - 1 / t))
    at_one = [estimate(Candidate(1, 1, 1, b, "1f1b", sequence_parallel=sp), batch=b).memory for sp in (False, True)]
    assert at_one[0] == at_one[1]
