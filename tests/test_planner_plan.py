"""The planner's search: Algorithm 1 against brute force, the set of layouts it considers against the
rules written out here, its choice against every estimate, its errors, and its picks for big GPTs."""

import dataclasses
import itertools
import re

import numpy as np
import pytest

from megapipe.errors import ConfigError
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.profile_partition import fold_ends, partition_profile
from megapipe.planner.launch import torchrun_command
from megapipe.planner.plan import PlanRequest, algorithm1, enumerate_layouts, model_splits, plan, searched_layouts
from megapipe.planner.presets import CLUSTERS, MODELS
from megapipe.planner.profile import ModelShape
from megapipe.planner.units import human_bytes

GIB = 2 ** 30
SMALL = ModelShape("gpt", 8, 64, 4, 32, 128, 256)


def small_cluster(memory=64 * GIB, nodes=2, per_node=4) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=per_node, memory_per_gpu=memory, intra_node_bandwidth=5e10,
                   inter_node_bandwidth=5e9, intra_node_latency=5e-6, inter_node_latency=2e-5)


def small_profile():
    return analytic_gpt_profile(SMALL, 1e12, micro_batch_sizes=(1, 2, 4, 8))


@pytest.mark.unit
def test_algorithm1_returns_the_fastest_choice_that_fits():
    rng = np.random.default_rng(0)
    for _ in range(100):
        n = int(rng.integers(1, 13))
        table = {(d, p): (float(rng.random()), float(rng.random())) if rng.random() < 0.8 else None
                 for d in range(1, n + 1) for p in range(1, n // d + 1)}
        capacity = float(rng.random())
        result = algorithm1(n, lambda d, p: table[(d, p)], lambda d, p, c: c[0], lambda d, p, c: c[1], capacity)
        feasible = [(c[0], k) for k, c in table.items() if c is not None and c[1] <= capacity]
        if not feasible:
            assert result is None
        else:
            assert result[2][0] == max(feasible)[0]
            assert result[2][1] <= capacity


def valid_by_the_rules(shape, devices, batch, max_b, max_v):
    """Every layout written out from the rules: all devices used, the model and batch divided, and
    each schedule's needs (1F1B, ZB-H1, ZB-H2 and 2BW at least p microbatches, PipeDream one per update,
    both interleavings m a multiple of p and v >= 2 chunks, ZBV and DualPipeV v = 2 in a V with at least
    2p - 1 microbatches; one schedule when there is no pipeline; with d > 1 every data-parallel
    sharding level, but parameters sharded only under a flush)."""
    found = set()
    for t, p, d in itertools.product(range(1, devices + 1), repeat=3):
        if t * p * d != devices or shape.num_attention_heads % t or shape.hidden_size % t or shape.ffn_hidden_size % t:
            continue
        for b in range(1, max_b + 1):
            if batch % (d * b):
                continue
            m = batch // (d * b)
            flushing = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "dualpipev")
            for schedule, v in itertools.product(flushing + ("2bw", "pipedream"), range(1, max_v + 1)):
                if shape.num_layers % (p * v) or (p == 1 and (schedule, v) != ("1f1b", 1)):
                    continue
                ok = {"gpipe": v == 1, "1f1b": v == 1 and m >= p, "2bw": v == 1 and m >= p,
                      "zb-h1": v == 1 and m >= p, "zb-h2": v == 1 and m >= p,
                      "pipedream": v == 1 and m == 1, "interleaved": v >= 2 and p >= 2 and m % p == 0,
                      "interleaved-zb": v >= 2 and p >= 2 and m % p == 0,
                      "zbv": v == 2 and m >= 2 * p - 1, "dualpipev": v == 2 and m >= 2 * p - 1}[schedule]
                levels = ["no_shard"] if d == 1 else ["no_shard", "optim", "optim_grads"] + (
                    ["optim_grads_params"] if schedule in flushing else [])
                if ok:
                    found |= {Candidate(t, p, d, b, schedule, v, r, level) for r in (False, True) for level in levels}
    return found


@pytest.mark.unit
@pytest.mark.parametrize("devices,batch", [(8, 16), (8, 12), (4, 8), (6, 6)])
def test_the_search_considers_exactly_the_valid_layouts(devices, batch):
    request = PlanRequest(batch, max_micro_batch_size=8, max_virtual=4)
    assert set(enumerate_layouts(SMALL, devices, request)) == valid_by_the_rules(SMALL, devices, batch, 8, 4)


@pytest.mark.unit
def test_the_plan_is_the_fastest_layout_that_fits():
    profile = small_profile()
    model = PlanCostModel(profile, small_cluster(), Training(32))
    estimates = [model.estimate(layout) for layout in valid_by_the_rules(SMALL, 8, 32, 8, 8)]
    cluster = small_cluster(memory=float(np.median([e.memory for e in estimates])))  # half the layouts fit
    estimates += [model.estimate(layout) for layout in searched_layouts(estimates, cluster)]
    fitting = [e for e in estimates if e.memory <= cluster.usable_memory]
    result = plan(profile, cluster, PlanRequest(32, max_micro_batch_size=8))
    assert result.evaluated == len(estimates)
    assert len(result.ranked) == len(fitting) < len(estimates)
    assert result.best.samples_per_second == max(e.samples_per_second for e in fitting)
    speeds = [e.samples_per_second for e in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    for (d, p), chosen in result.best_by_data_pipeline.items():
        assert chosen.samples_per_second == max(e.samples_per_second for e in fitting
                                                if (e.candidate.data, e.candidate.pipeline) == (d, p))


@pytest.mark.system
def test_the_searched_schedule_is_planned_on_the_fastest_layouts_and_never_slower_than_zb_h1():
    profile = small_profile()
    cluster = small_cluster()
    result = plan(profile, cluster, PlanRequest(32, max_micro_batch_size=8))
    searched = [e for e in result.ranked if e.candidate.schedule == "auto"]
    assert 0 < len(searched) <= 8
    by_layout = {e.candidate: e for e in result.ranked}
    for e in searched:
        zb_h1 = by_layout.get(dataclasses.replace(e.candidate, schedule="zb-h1"))
        if zb_h1 is not None:  # the search starts from ZB-H1 within its memory
            assert e.batch_time <= zb_h1.batch_time * (1 + 1e-9) and e.memory <= zb_h1.memory * (1 + 1e-9)
    command = torchrun_command(searched[0], profile.shape, cluster, 32)
    assert "--pipeline-schedule auto" in command
    forward = [float(t) for t in command.split("--schedule-forward-time ")[1].split()[0].split(",")]
    assert forward == pytest.approx(list(searched[0].rank_times[0]), rel=1e-5)


@pytest.mark.unit
def test_no_configuration_fits_names_the_smallest_requirement():
    profile = small_profile()
    model = PlanCostModel(profile, small_cluster(), Training(32))
    estimates = [model.estimate(layout) for layout in valid_by_the_rules(SMALL, 8, 32, 8, 8)]
    # of the layouts needing the least memory (1F1B and ZB-H1 tie) the fastest is named, then by name
    smallest = min(estimates, key=lambda e: (e.memory, -e.samples_per_second, e.candidate.describe()))
    cluster = small_cluster(memory=0.9 * smallest.memory)
    expected = (f"no configuration fits in {human_bytes(cluster.usable_memory)} per device: the smallest needs "
                f"{human_bytes(smallest.memory)} at {smallest.candidate.describe()}; ")
    assert "MiB" in expected
    with pytest.raises(ConfigError, match=re.escape(expected)):
        plan(profile, cluster, PlanRequest(32, max_micro_batch_size=8))


@pytest.mark.unit
def test_a_batch_no_layout_can_divide():
    shape = ModelShape("gpt", 2, 64, 2, 32, 128, 256)  # t and p at most 2: d is 2, 4 or 8 on 8 devices
    profile = analytic_gpt_profile(shape, 1e12)
    with pytest.raises(ConfigError, match=re.escape("--global-batch-size 3 is not divisible by any data-parallel size "
                                                    "this model allows on 8 devices (2, 4, 8); use a multiple of 2.")):
        plan(profile, small_cluster(), PlanRequest(3))


@pytest.mark.unit
def test_pipedream_partition_of_a_profile_covers_every_block_once():
    profile, cluster = small_profile(), small_cluster(nodes=1, per_node=4)
    result = partition_profile(profile, cluster, 2, Training(2))
    assert result.stages[0].start == 0 and result.stages[-1].end == SMALL.num_layers
    assert sum(s.replicas for s in result.stages) == 4
    costs = profile.costs(2.0)
    units = fold_ends(costs.forward + costs.backward)
    assert units.sum() == pytest.approx((costs.forward + costs.backward).sum())
    assert len(units) == SMALL.num_layers


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gpt-1.3b", "gpt-2.2b", "gpt-3.8b"])
def test_big_gpts_on_64_v100s_get_sensible_plans(name):
    # The seeds: tensor parallelism stays inside a node; 2BW (tensor size 1) runs deep pipelines of
    # 8 (2.2B) and 16 (3.8B) stages on these machines, since whole replicas do not fit in 16 GB.
    cluster = CLUSTERS["v100-16gb-8x8"]
    result = plan(analytic_gpt_profile(MODELS[name], cluster.achieved_flops), cluster, PlanRequest(512))
    assert result.best.candidate.tensor <= cluster.gpus_per_node
    assert result.best.memory <= cluster.usable_memory
    two_bw = [e for e in result.ranked if e.candidate.schedule == "2bw" and e.candidate.tensor == 1]
    assert two_bw[0].candidate.pipeline >= 8
    assert two_bw[0].samples_per_second > max(e.samples_per_second for e in result.ranked
                                              if e.candidate.schedule == "gpipe")  # seed: 2BW up to 3.2x GPipe


@pytest.mark.unit
def test_tensor_sizes_divide_the_experts_width_too():
    # training refuses an expert width (--moe-ffn-hidden-size) that t does not divide; so does the search
    shape = ModelShape("gpt", 4, 64, 4, 32, 128, 256, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6)
    assert {t for t, _, _ in model_splits(shape, 8)} == {1, 2}
    assert {t for t, _, _ in model_splits(dataclasses.replace(shape, moe_ffn_hidden_size=8), 8)} == {1, 2, 4}
