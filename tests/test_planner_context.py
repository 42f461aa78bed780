"""The planner's context-parallel size c: the layouts it considers against the rules written out here,
its choice against every estimate, activations and compute at 1/c, the key/value exchange and the
cross-node traffic against their closed forms, gradients over d x c, and the launch command that
carries c."""

import dataclasses

import pytest
from test_planner_plan import SMALL, small_cluster, small_profile, valid_by_the_rules

from megapipe.planner.context_costs import activation_bytes_per_rank, exchanges
from megapipe.planner.cost_model import Candidate, PlanCostModel, Training, all_to_all_time, collective_time
from megapipe.planner.launch import torchrun_command
from megapipe.planner.plan import PlanRequest, enumerate_layouts, plan

pytestmark = pytest.mark.unit

SCHEDULES = ("1f1b", "gpipe")
FLUSHING = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "dualpipev")


def with_context(layouts, c: int, comm_type: str = "p2p") -> set:
    """Each candidate of devices / c ranks at context size c: sharded levels wherever c x d > 1."""
    found = set()
    for candidate in layouts:
        levels = ["no_shard"] if c * candidate.data == 1 else ["no_shard", "optim", "optim_grads"] + (
            ["optim_grads_params"] if candidate.schedule in FLUSHING else [])
        found |= {dataclasses.replace(candidate, context=c, cp_comm_type=comm_type, sharding=level) for level in levels}
    return found


@pytest.mark.parametrize("devices,batch", [(8, 16), (4, 8)])
def test_the_search_considers_every_valid_context_size(devices, batch):
    request = PlanRequest(batch, max_micro_batch_size=8, max_virtual=4, context_sizes=(1, 2, 4, 8))
    expected = set()
    for c in (1, 2, 4, 8):  # SMALL's 32 tokens split into 2c chunks for each; c must divide the devices
        if devices % c == 0:
            expected |= with_context(valid_by_the_rules(SMALL, devices // c, batch, 8, 4), c)
    assert set(enumerate_layouts(SMALL, devices, request)) == expected
    a2a = PlanRequest(batch, max_micro_batch_size=8, max_virtual=4, context_sizes=(1, 2, 4, 8), cp_comm_type="a2a")
    assert {(layout.tensor, layout.context) for layout in enumerate_layouts(SMALL, devices, a2a)
            if layout.context > 1} == {(t, c) for t in (1, 2, 4) for c in (2, 4) if (4 // t) % c == 0
                                       and devices % (t * c) == 0}  # each tensor rank's 4 / t heads split c ways


def test_the_plan_is_the_fastest_layout_that_fits_over_every_context_size():
    profile = small_profile()
    request = PlanRequest(16, schedules=SCHEDULES, max_micro_batch_size=4, recompute=(False,), context_sizes=(1, 2, 4))
    model = PlanCostModel(profile, small_cluster(), Training(16))
    estimates = [model.estimate(layout) for layout in enumerate_layouts(SMALL, 8, request)]
    cluster = small_cluster(memory=sorted(e.memory for e in estimates)[len(estimates) // 2])
    fitting = [e for e in estimates if e.memory <= cluster.usable_memory]
    result = plan(profile, cluster, request)
    assert result.evaluated == len(estimates) and len(result.ranked) == len(fitting)
    assert result.best.samples_per_second == max(e.samples_per_second for e in fitting)
    assert {e.candidate.context for e in estimates} == {1, 2, 4}


def test_a_context_rank_computes_and_keeps_one_cth_of_the_sequence():
    profile, cluster = small_profile(), small_cluster()
    model = PlanCostModel(profile, cluster, Training(8))
    whole = model._rank_loads(Candidate(1, 1, 4, 2, "1f1b"))
    split = model._rank_loads(Candidate(1, 1, 2, 2, "1f1b", context=2))
    assert split.stash == pytest.approx(whole.stash / 2, rel=1e-12)
    assert split.compute == pytest.approx(model._rank_loads(Candidate(1, 1, 4, 1, "1f1b")).compute, rel=1e-12)
    for c in (2, 4, 8):  # the README's table: activations per rank at 1/c, exactly, for a 16K sequence
        assert activation_bytes_per_rank(SMALL, 16384, c) * c == pytest.approx(
            activation_bytes_per_rank(SMALL, 16384, 1), rel=1e-12)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_the_key_value_exchange_is_its_closed_form_per_block_and_pass(comm_type):
    profile, cluster = small_profile(), small_cluster()
    model, b, c = PlanCostModel(profile, cluster, Training(8)), 2, 4
    link = cluster.link([0, 1, 2, 3])  # c = 4 context ranks of one node
    kv = 2 * b * SMALL.seq_length / c * SMALL.hidden_size * profile.element_bytes
    step = kv / link.bandwidth + link.latency
    forward, backward = {
        "p2p": ((c - 1) * step, (c - 1) * (2 * kv / link.bandwidth + link.latency)),
        "all_gather": (collective_time("all_gather", c * kv, c, link),
                       collective_time("all_gather", c * kv, c, link) + collective_time("reduce_scatter", c * kv, c,
                                                                                         link)),
        "a2a": (all_to_all_time(2 * kv, c, link), all_to_all_time(2 * kv, c, link)),
    }[comm_type]
    for recompute, again in ((False, 0), (True, 1)):
        candidate = Candidate(1, 1, 2, b, "1f1b", recompute=recompute, context=c, cp_comm_type=comm_type)
        loads = model._rank_loads(candidate)
        assert loads.context[0] == pytest.approx(SMALL.num_layers * (forward + backward + again * forward), rel=1e-12)
        estimate = model.estimate(candidate)
        assert estimate.context_comm_time == pytest.approx(estimate.microbatches * loads.context[0], rel=1e-12)


def test_gradients_are_reduced_and_sharded_over_data_and_context_ranks():
    profile, cluster = small_profile(), small_cluster()
    model = PlanCostModel(profile, cluster, Training(8))
    candidate = Candidate(1, 1, 2, 2, "1f1b", sharding="optim", context=2)
    loads = model._rank_loads(candidate)
    link = model.links(1, 1, 2, 2)[1]
    assert link == cluster.link([0, 1, 2, 3])
    grads = loads.params[0] * 4.0
    assert model._data_parallel_times(candidate, loads, 2)[0] == pytest.approx(
        collective_time("reduce_scatter", grads, 4, link) + collective_time("all_gather", loads.params[0] * 2, 4, link),
        rel=1e-12)
    params = loads.params[0]
    assert model._state_bytes(candidate, params, 0) == pytest.approx(
        2 * (params + params / 4) + 4 * (params + params / 4) + model.optimizer_bytes * params / 4, rel=1e-12)


def test_cross_node_traffic_counts_the_ring_between_nodes():
    """t = 4 fills a node, so each context pair (r, r + 4) of c = 2 spans the two nodes: per block and
    microbatch each of the 4 rings carries one key/value block each way forward and block and gradient
    each way backward."""
    profile, cluster = small_profile(), small_cluster()
    model, b = PlanCostModel(profile, cluster, Training(8)), 2
    candidate = Candidate(4, 1, 1, b, "1f1b", context=2)
    m = 8 // b
    tokens = b * SMALL.seq_length / 2
    kv = 2 * tokens * SMALL.hidden_size / 4 * profile.element_bytes
    assert [e.nbytes for e in exchanges("p2p", 2, tokens, SMALL.hidden_size / 4, profile.element_bytes)] == [kv, 2 * kv]
    traffic = model.traffic(candidate)
    assert traffic.context == pytest.approx(4 * m * SMALL.num_layers * 2 * (kv + 2 * kv), rel=1e-12)
    assert model.traffic(Candidate(4, 1, 2, b, "1f1b")).context == 0.0


def test_the_launch_command_carries_c():
    profile, cluster = small_profile(), small_cluster()
    estimate = PlanCostModel(profile, cluster, Training(8)).estimate(Candidate(2, 1, 2, 2, "1f1b", context=2,
                                                                            cp_comm_type="all_gather"))
    command = torchrun_command(estimate, SMALL, cluster, 8)
    assert "--context-parallel-size 2 --cp-comm-type all_gather --attention-dropout 0" in command
    assert "c=2 (all_gather)" in estimate.candidate.describe()
