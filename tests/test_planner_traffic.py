"""The cross-node traffic model against bytes counted by hand from the rank order.

The hand counts take 2 nodes of 2 devices (ranks 0, 1 on node 0; 2, 3 on node 1), a boundary
tensor of A bytes, W gradient bytes per rank and m microbatches. The wire measurement of the
same layouts is ``benchmarks/bench_traffic.py`` (within 1.5% of these formulas there).
"""

import pytest

from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.profile import ModelShape
from megapipe.planner.traffic import TrafficInputs, crossing_links, cross_node_traffic, link_bytes

pytestmark = pytest.mark.unit

A, W, M = 1000.0, 5000.0, 4


def _node(rank: int) -> int:
    return rank // 2


def _traffic(t, p, d, backend="gloo", **overrides):
    values = dict(tensor=t, pipeline=p, data=d, virtual=1, microbatches=M, boundary_bytes=A,
                  rank_params=[W / 4] * p, tied_params=0.0, element_bytes=4, grad_bytes=4.0, blocks_per_rank=[2] * p,
                  logit_values=10.0)
    values.update(overrides)
    return cross_node_traffic(TrafficInputs(**values), _node, backend)


def test_ring_volumes_and_crossings():
    assert link_bytes("all_reduce", 100, 4) == 150 and link_bytes("all_gather", 100, 4) == 75
    assert link_bytes("reduce_scatter", 100, 4, "nccl") == 75
    assert link_bytes("reduce_scatter", 100, 4, "gloo") == 150  # gloo all-reduces and keeps a slice
    assert link_bytes("all_reduce", 100, 1) == 0
    assert crossing_links([0, 1, 2, 3], _node) == 2 and crossing_links([0, 2], _node) == 2
    assert crossing_links([0, 1], _node) == 0 and crossing_links([0, 2, 1, 3], _node) == 4


def test_each_layout_on_two_nodes_of_two():
    # data parallel over all 4: a ring 0-1-2-3-0 crosses twice, each link 2 (3/4) W
    assert _traffic(1, 1, 4).total == pytest.approx(2 * 1.5 * W)
    # pipeline across, data inside: 2 pipelines x m microbatches x (activation + gradient)
    assert _traffic(1, 2, 2) .pipeline == 2 * M * 2 * A and _traffic(1, 2, 2).data == 0
    # tensor inside, pipeline across: scatter/gather sends 1/t per tensor rank, so A per microbatch and
    # direction; without it each tensor rank sends A
    sg, whole = _traffic(2, 2, 1), _traffic(2, 2, 1, scatter_gather=False)
    assert sg.pipeline == M * 2 * A and whole.pipeline == 2 * sg.pipeline and sg.tensor == 0
    # tensor inside, data across: two groups {0, 2} and {1, 3} of two, each member sending W
    assert _traffic(2, 1, 2).data == pytest.approx(2 * 2 * W)
    # ZeRO-1 on gloo: the reduce-scatter moves an all-reduce's bytes, then the fp32 weights are gathered
    assert _traffic(1, 1, 4, sharding="optim").data == pytest.approx(2 * (1.5 * W + 0.75 * W))
    assert _traffic(1, 1, 4, "nccl", sharding="optim").data == pytest.approx(2 * (0.75 * W + 0.75 * W))
    # ZeRO-3 gathers before each forward and backward instead of after the step
    assert _traffic(1, 1, 4, sharding="optim_grads_params").data == pytest.approx(2 * (1.5 + 2 * M * 0.75) * W)
    # a tied embedding of E gradient bytes: each of the d first/last pairs exchanges E both ways
    assert _traffic(1, 2, 2, tied_params=100.0).embedding == 2 * 2 * 400.0
    # a pipeline of 4: only the boundary between ranks 1 and 2 crosses
    assert _traffic(1, 4, 1).pipeline == M * 2 * A
    # everything inside one node: nothing crosses
    assert _traffic(2, 1, 1).total == 0 and _traffic(1, 2, 1).total == 0


def test_tensor_groups_across_nodes_carry_the_layers_all_reduces():
    one_stage = _traffic(4, 1, 1)
    # per microbatch: 4 per block x 2 blocks + embedding + head = 10 all-reduces of A, and the cross
    # entropy's 3 of 10 fp32 values; ring 0-1-2-3 crosses twice
    assert one_stage.tensor == pytest.approx(2 * M * (10 * 1.5 * A + 3 * 1.5 * 40))


def test_the_cost_model_reports_what_its_layout_sends():
    shape = ModelShape("gpt", 4, 64, 4, 32, 512, 256, True)
    profile = analytic_gpt_profile(shape, 1e12, (2,), dtype="float32")
    cluster = Cluster(nodes=2, gpus_per_node=2, memory_per_gpu=1e10, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=1e8, backend="gloo")
    model = PlanCostModel(profile, cluster, Training(8))
    boundary = 2 * 32 * 64 * 4
    estimate = model.estimate(Candidate(2, 2, 1, 2, "1f1b"))
    assert estimate.traffic.pipeline == 4 * 2 * boundary  # m = 4, scatter/gather: one tensor per direction
    assert estimate.traffic.embedding == 2 * 2 * (512 * 64 // 2) * 4  # 2 tensor ranks, each V/t x h both ways
    assert model.estimate(Candidate(2, 2, 1, 2, "pipedream")).traffic.embedding == 0  # PipeDream unties it


def test_a_shared_node_uplink_is_split_between_the_flows_leaving_a_node():
    cluster = Cluster(nodes=2, gpus_per_node=2, memory_per_gpu=1e10, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=80.0, node_uplink_bandwidth=100.0)
    assert cluster.group_link([[0, 1, 2, 3]]).bandwidth == 80  # ring 0-1-2-3: one flow leaves each node, at its
    #                                                             device's own 80, below the uplink's 100
    assert cluster.group_link([[0, 2], [1, 3]]).bandwidth == 50  # two groups leave node 0 together
    assert cluster.group_link([[0, 1], [2, 3]]).bandwidth == 1e9  # inside the nodes
    own_nics = Cluster(nodes=2, gpus_per_node=2, memory_per_gpu=1e10, intra_node_bandwidth=1e9,
                       inter_node_bandwidth=50.0)
    assert own_nics.group_link([[0, 1, 2, 3]]).bandwidth == 50  # each device has its own link
    assert own_nics.group_link([[0, 2], [1, 3]]).bandwidth == 50


def test_hopper_presets_are_eight_gpu_nodes():
    from megapipe.planner.presets import cluster_preset

    for name in ("h100-80gb-8x8", "h200-141gb-8x8"):
        cluster = cluster_preset(name)
        assert (cluster.nodes, cluster.gpus_per_node, cluster.peak_flops) == (8, 8, 989e12)
        assert cluster.intra_node_bandwidth > cluster.inter_node_bandwidth
    assert cluster_preset("h200-141gb-1x8").memory_per_gpu > cluster_preset("h100-80gb-1x8").memory_per_gpu


def test_the_v_placement_sends_each_boundary_from_its_own_rank_and_no_embedding_sum():
    from megapipe.layout.placement import Placement

    # p = 4 on 4 nodes of one rank each would cross everywhere; here ranks 1 and 2 are on different
    # nodes: under V stages 1->2 and 5->6 cross between them (down and back up), 3->4 stays on rank 3
    v_shape = _traffic(1, 4, 1, virtual=2, tied_params=100.0, placement=Placement.V)
    assert v_shape.pipeline == 2 * M * 2 * A and v_shape.embedding == 0  # first and last stage on rank 0
    # looped, v = 2: stages 1->2 and 5->6 cross too, and the wrap 3->4 goes from rank 3 (node 1) to rank 0 (node 0)
    looped = _traffic(1, 4, 1, virtual=2, tied_params=100.0)
    assert looped.pipeline == 3 * M * 2 * A and looped.embedding == 2 * 400.0


def test_expert_all_to_alls_cross_where_an_expert_group_spans_nodes():
    # d = 4, e = 2: expert groups {0, 1} (node 0) and {2, 3} (node 1) stay inside a node
    assert _traffic(1, 1, 4, expert=2, moe_blocks_per_rank=[2], routed_token_bytes=A).expert == 0
    # e = 4: each member sends A / 4 to each of 3 others, 2 of them on the other node; 4 exchanges per block
    spanning = _traffic(1, 1, 4, expert=4, moe_blocks_per_rank=[2], routed_token_bytes=A)
    assert spanning.expert == M * 4 * 2 * (4 * 2) * A / 4
    assert spanning.total == spanning.data + spanning.expert
    recomputed = _traffic(1, 1, 4, expert=4, moe_blocks_per_rank=[2], routed_token_bytes=A, recompute=True)
    assert recomputed.expert == spanning.expert * 6 / 4  # the recomputed forward exchanges again


def test_expert_gradients_are_reduced_over_their_expert_data_group():
    # d = 4, e = 2: of W / 4 parameters per rank, X are this rank's experts. The others are all-reduced
    # over {0, 1, 2, 3} (2 crossing links, 2 (3/4) of them each); the experts over the expert-data
    # groups {0, 2} and {1, 3} (each a ring of two across the nodes: 2 crossing links, all of its 4 X bytes on each)
    X = 200.0
    mixed = _traffic(1, 1, 4, expert=2, moe_blocks_per_rank=[2], routed_token_bytes=A, rank_expert_params=[X])
    assert mixed.data == pytest.approx(2 * 1.5 * (W / 4 - X) * 4 + 2 * 2 * 1.0 * X * 4)
