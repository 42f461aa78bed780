"""The planner's expert-parallel size e for MoE models: the layouts it considers against the rules written
out here, its choice against every estimate, the token exchange and the experts' memory against their
closed forms, the expert gradients reduced over the expert-data ranks only, e > 1 chosen when only it
fits, the launch command that carries e, and --overlap-moe-expert-parallel-comm searched on and off: its
pairs' hidden all-to-alls against the slot-by-slot brute force and the simulator."""

import dataclasses
import functools

import pytest
from test_planner_cli import TOOL, run, write_cluster
from test_planner_plan import SMALL, small_cluster, valid_by_the_rules

from megapipe.errors import ConfigError
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.catalog import build_schedule, overlapped_schedule
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import Candidate, PlanCostModel, Training, all_to_all_time, collective_time
from megapipe.planner.launch import torchrun_command
from megapipe.planner.plan import PlanRequest, enumerate_layouts, plan
from megapipe.planner.profile import ModelProfile

pytestmark = pytest.mark.unit

MOE = dataclasses.replace(SMALL, num_experts=4, moe_router_topk=2)
SCHEDULES = ("1f1b", "gpipe")


def moe_profile(shape=MOE):
    return analytic_gpt_profile(shape, 1e12, micro_batch_sizes=(1, 2, 4))


def overlap_accepted(candidate: Candidate, batch: int) -> bool:
    """Whether --overlap-moe-expert-parallel-comm runs ``candidate``: e > 1, no recomputation, a flush schedule
    whose overlapped lists the flag accepts."""
    if candidate.expert == 1 or candidate.recompute or candidate.schedule in ("2bw", "pipedream"):
        return False
    return pairs_accepted(candidate.schedule, candidate.pipeline, batch // (candidate.data * candidate.micro_batch_size),
                          candidate.virtual)


@functools.lru_cache(maxsize=None)
def pairs_accepted(schedule: str, p: int, m: int, v: int) -> bool:
    try:
        overlapped_schedule(build_schedule(schedule, p, m, v))
    except ConfigError:
        return False
    return True


def with_expert_sizes(layouts, experts: int, batch: int) -> set:
    """Each layout at every e dividing the experts and every expert-tensor size etp dividing t with etp x e
    dividing t x d (etp = t written None), and again with the expert all-to-alls
    overlapped where the flag accepts it."""
    sized = {dataclasses.replace(layout, expert=e, expert_tensor=None if etp == layout.tensor else etp)
             for layout in layouts for e in range(1, experts + 1) for etp in range(1, layout.tensor + 1)
             if experts % e == 0 and layout.tensor % etp == 0 and (layout.tensor * layout.data) % (etp * e) == 0}
    return sized | {dataclasses.replace(layout, overlap_moe_comm=True) for layout in sized
                    if overlap_accepted(layout, batch)}


@pytest.mark.parametrize("devices,batch", [(8, 16), (4, 8)])
def test_the_search_considers_every_valid_expert_size(devices, batch):
    request = PlanRequest(batch, max_micro_batch_size=8, max_virtual=4)
    found = set(enumerate_layouts(MOE, devices, request))
    assert found == with_expert_sizes(valid_by_the_rules(MOE, devices, batch, 8, 4), MOE.num_experts, batch)
    assert max(layout.expert for layout in found) == 4
    assert {layout.expert_tensor for layout in found if layout.expert_tensor is not None} == {1, 2}  # below t
    assert {layout.schedule for layout in found if layout.overlap_moe_comm} >= {"1f1b", "dualpipev"}
    assert {layout.expert for layout in enumerate_layouts(SMALL, devices, request)} == {1}


def test_the_plan_is_the_fastest_layout_that_fits_over_every_expert_size():
    profile, request = moe_profile(), PlanRequest(16, schedules=SCHEDULES, max_micro_batch_size=4, recompute=(False,))
    model = PlanCostModel(profile, small_cluster(), Training(16))
    estimates = [model.estimate(layout) for layout in enumerate_layouts(MOE, 8, request)]
    cluster = small_cluster(memory=sorted(e.memory for e in estimates)[len(estimates) // 2])
    fitting = [e for e in estimates if e.memory <= cluster.usable_memory]
    result = plan(profile, cluster, request)
    assert result.evaluated == len(estimates) and len(result.ranked) == len(fitting)
    assert result.best.samples_per_second == max(e.samples_per_second for e in fitting)


@pytest.mark.parametrize("freq", [1, 2, (0, 1, 1, 0, 0, 0, 0, 1)])
def test_the_token_exchange_is_two_all_to_alls_per_moe_block_and_pass(freq):
    shape = dataclasses.replace(MOE, moe_layer_freq=freq)
    profile, cluster = moe_profile(shape), small_cluster()
    model, b = PlanCostModel(profile, cluster, Training(8)), 2
    m = 8 // (2 * b)
    link = cluster.link([0, 1])  # e = 2 over the two data-parallel replicas of one node
    one = all_to_all_time(b * MOE.seq_length * MOE.moe_router_topk * MOE.hidden_size * profile.element_bytes, 2, link)
    for recompute, per_block in ((False, 4), (True, 6)):
        candidate = Candidate(1, 1, 2, b, "1f1b", recompute=recompute, expert=2)
        assert model.estimate(candidate).expert_comm_time == pytest.approx(m * len(shape.moe_layers) * per_block * one)
        assert model.estimate(dataclasses.replace(candidate, expert=1)).expert_comm_time == 0.0
    assert one == pytest.approx(b * 32 * 2 * 64 * 2 / 2 / link.bandwidth + link.latency)


@pytest.mark.parametrize("sharding,data,freq", [("no_shard", 2, 1), ("optim", 2, 1), ("optim_grads_params", 4, 1),
                                                ("no_shard", 2, (1, 0, 0, 0, 0, 0, 1, 1))])
def test_each_rank_holds_one_eth_of_the_experts_and_their_state(sharding, data, freq):
    shape = dataclasses.replace(MOE, moe_layer_freq=freq)
    profile = moe_profile(shape)
    training = Training(8)
    model = PlanCostModel(profile, small_cluster(), training)
    candidate = Candidate(1, 1, data, 1, "1f1b", sharding=sharding, expert=2)
    element, grads, optimizer = profile.element_bytes, training.grad_bytes_per_param, training.optimizer_bytes(2)
    experts = MOE.expert_params_per_block * len(shape.moe_layers)
    saved = model.estimate(dataclasses.replace(candidate, expert=1)).memory - model.estimate(candidate).memory
    held = experts / 2  # by each of the e = 2 expert ranks
    if sharding == "no_shard":
        expected = (experts - held) * (element + grads + optimizer)
    else:  # each state's shard: 1/d of all experts at e = 1, e/d of the held half (1/(d/e)) at e = 2
        shard_saved = experts / data - held * 2 / data
        expected = (experts - held) * element + element * shard_saved + grads * (experts - held + shard_saved) + optimizer * shard_saved
    assert saved == pytest.approx(expected)
    assert expected > 0


def test_an_moe_model_too_big_for_one_expert_rank_gets_e_above_1():
    # 2 layers and 2 heads: t and p split it at most twice each, so 8 devices hold d >= 2 replicas
    big = dataclasses.replace(MOE, num_layers=2, num_attention_heads=2, num_experts=8, moe_ffn_hidden_size=1024)
    profile, request = moe_profile(big), PlanRequest(16, schedules=SCHEDULES, max_micro_batch_size=4)
    model = PlanCostModel(profile, small_cluster(), Training(16))
    estimates = [model.estimate(layout) for layout in enumerate_layouts(big, 8, request)]
    smallest_at_one = min(e.memory for e in estimates if e.candidate.expert == 1)
    assert any(e.memory < smallest_at_one for e in estimates)
    result = plan(profile, small_cluster(memory=smallest_at_one * 0.99), request)
    assert result.best.candidate.expert > 1
    assert all(e.candidate.expert > 1 for e in result.ranked)
    command = torchrun_command(result.best, big, small_cluster(), 16)
    assert f"--expert-model-parallel-size {result.best.candidate.expert}" in command
    assert "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024" in command


def test_a_dense_profile_written_before_the_moe_fields_still_loads():
    document = moe_profile(SMALL).to_dict()
    for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq"):
        del document["model"][name]
    assert ModelProfile.from_dict(document).shape == SMALL


@pytest.mark.parametrize("freq", [1, 4])
def test_expert_gradients_are_reduced_over_the_expert_data_ranks_only(freq):
    shape = dataclasses.replace(MOE, moe_layer_freq=freq)
    profile, cluster = moe_profile(shape), small_cluster()
    model, training = PlanCostModel(profile, cluster, Training(8)), Training(8)
    link, grads = cluster.link([0, 1]), training.grad_bytes_per_param
    dense = model.estimate(Candidate(1, 1, 2, 1, "1f1b")).data_comm_time
    everything = sum(layer.params for layer in profile.layers)  # one stage: no second copy of the embedding
    assert dense == pytest.approx(collective_time("all_reduce", everything * grads, 2, link))
    experts = MOE.expert_params_per_block * len(shape.moe_layers)  # at e = d = 2 each expert lives on one rank
    expected = collective_time("all_reduce", (everything - experts) * grads, 2, link)
    assert model.estimate(Candidate(1, 1, 2, 1, "1f1b", expert=2)).data_comm_time == pytest.approx(expected)


def pair_by_slots(forward: float, backward: float, exchange: float, layers: int) -> float:
    """An overlapped pair written out slot by slot (docs/moe.md): the backward's first attention segment
    alone, per MoE layer forward attention | backward combine, forward dispatch | backward experts, forward
    experts | backward dispatch, forward combine | backward attention, then the forward's last attention
    alone; each pass's compute over its 2L + 1 segments, its all-to-alls over its 2L."""
    f, b, x = forward / (2 * layers + 1), backward / (2 * layers + 1), exchange / (2 * layers)
    return b + layers * (max(f, x) + max(x, b) + max(f, x) + max(x, b)) + f


def slow_expert_cluster(nodes: int = 4):
    """Each device its own node on slow links: the all-to-alls a visible share of a step."""
    return Cluster(nodes=nodes, gpus_per_node=1, memory_per_gpu=64 * 2 ** 30, intra_node_bandwidth=5e10,
                   inter_node_bandwidth=2e8, intra_node_latency=5e-6, inter_node_latency=2e-5)


def test_1f1b_pairs_hide_the_all_to_alls_as_the_slots_say():
    profile = moe_profile()
    model = PlanCostModel(profile, slow_expert_cluster(), Training(8))
    off = model.estimate(Candidate(1, 1, 2, 1, "1f1b", expert=2))
    on = model.estimate(Candidate(1, 1, 2, 1, "1f1b", expert=2, overlap_moe_comm=True))
    m, x = on.microbatches, on.expert_comm_total / (2 * on.microbatches)  # one pass's all-to-alls
    (forward,), (backward,) = on.rank_times
    pair = pair_by_slots(forward - x, backward - x, x, MOE.num_layers)
    # what the m - 1 pairs do not hide stays exposed; with the flag off all of it is
    assert on.expert_comm_time == pytest.approx(on.expert_comm_total - (m - 1) * (forward + backward - pair))
    assert on.expert_comm_total == off.expert_comm_total == off.expert_comm_time > on.expert_comm_time > 0
    # F0, then m - 1 pairs F(j+1) & B(j), then B(m-1): one rank, nothing to wait for
    assert on.batch_time - on.data_comm_time - on.optimizer_time == pytest.approx(forward + (m - 1) * pair + backward)
    assert off.batch_time - off.data_comm_time - off.optimizer_time == pytest.approx(m * (forward + backward))
    assert off.batch_time - on.batch_time == pytest.approx((m - 1) * (forward + backward - pair))
    assert on.batch_time < off.batch_time and on.rank_times == off.rank_times
    stash = on.memory - off.memory  # one microbatch more in flight, as Megatron's combined 1F1B holds
    assert stash == pytest.approx(model.estimate(Candidate(1, 1, 2, 2, "1f1b", expert=2)).memory - off.memory)
    assert stash > 0


def test_dualpipev_pairs_cost_what_the_simulator_charges():
    profile = moe_profile()
    model = PlanCostModel(profile, slow_expert_cluster(), Training(8))
    candidate = Candidate(1, 2, 2, 1, "dualpipev", virtual=2, expert=2, overlap_moe_comm=True)
    on, off = model.estimate(candidate), model.estimate(dataclasses.replace(candidate, overlap_moe_comm=False))
    forwards, backs = on.stage_times
    assert on.rank_times == (tuple(forwards[s] + forwards[3 - s] for s in range(2)),  # stage s on rank s (down
                             tuple(backs[s] + backs[3 - s] for s in range(2)))      # the V) or 2p - 1 - s
    x = on.expert_comm_total / (4 * on.microbatches)  # one pass's all-to-alls on each stage (equal blocks)
    costs = CostModel(forward=tuple(f - x for f in forwards), backward=tuple(b - x for b in backs),
                      input_backward=tuple((b - x) / 2 for b in backs), weight_backward=tuple((b - x) / 2 for b in backs),
                      expert_comm=x, moe_layers=MOE.num_layers // 4, hide_expert_comm=True)
    lists = overlapped_schedule(build_schedule("dualpipev", 2, on.microbatches, 2))
    expected = simulate(lists, costs)
    assert on.batch_time - on.data_comm_time - on.optimizer_time == pytest.approx(float(expected.makespan))
    assert on.batch_time < off.batch_time
    assert 0 < on.expert_comm_time < on.expert_comm_total == off.expert_comm_time == off.expert_comm_total


def test_the_plan_overlaps_the_all_to_alls_when_it_pays_and_the_command_says_so():
    profile = moe_profile()
    request = PlanRequest(8, schedules=("1f1b",), micro_batch_sizes=(1,), recompute=(False,), shardings=("no_shard",))
    result = plan(profile, slow_expert_cluster(nodes=2), request)  # e = 2 only at d = 2, p = 1
    fastest = next(e for e in result.ranked if e.candidate.expert > 1)
    assert fastest.candidate.overlap_moe_comm
    twin = next(e for e in result.ranked if e.candidate == dataclasses.replace(fastest.candidate, overlap_moe_comm=False))
    assert twin.samples_per_second < fastest.samples_per_second
    assert "--overlap-moe-expert-parallel-comm" in torchrun_command(fastest, MOE, slow_expert_cluster(), 8)
    assert "--overlap-moe-expert-parallel-comm" not in torchrun_command(twin, MOE, slow_expert_cluster(), 8)


def test_the_table_shows_the_all_to_alls_and_the_share_no_pair_hides(tmp_path, capsys):
    cluster = write_cluster(tmp_path / "cluster.json", nodes=2, gpus_per_node=1, memory_per_gpu=2 ** 34,
                            inter_node_bandwidth=2e8, inter_node_latency=2e-5)
    shape = ["--num-layers", 8, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32,
             "--vocab-size", 128, "--num-experts", 4]
    code, out, err = run(shape + ["--cluster", cluster, "--global-batch-size", 8, "--schedules", "1f1b",
                                  "--no-recompute", "--top", 1000], capsys)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line[:3].strip().isdigit()]
    shares = {row[4]: row[-4] for row in rows if row[4] in ("1", "2", "2&")}  # e, and the exposed share
    assert shares["1"] == "-" and shares["2"] == "100%"
    assert 0 < int(shares["2&"].rstrip("%")) < 100
    on = PlanCostModel(moe_profile(), slow_expert_cluster(), Training(8)).estimate(
        Candidate(1, 1, 2, 1, "1f1b", expert=2, overlap_moe_comm=True))
    share = f"{on.expert_comm_time / on.expert_comm_total:.0%}"
    assert TOOL.expert_comm_line(on) == (f"expert all-to-alls: {on.expert_comm_total:.4g} s per batch on the slowest "
                                         f"rank, {on.expert_comm_time:.4g} s of it exposed ({share}; pairs hide the "
                                         "rest behind the other microbatch's compute)")
