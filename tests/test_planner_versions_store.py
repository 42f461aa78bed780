"""The planner's weight-version counts against the version stores of real pipelines.

``weight_versions(schedule, p, rank)`` (megapipe.planner.schedule_costs) says how many copies of
its weights pipeline rank ``rank`` (0-indexed, rank 0 holds the embedding) keeps: 1 for a flush
schedule (1F1B), at most 2 for PipeDream-2BW, and p - r on rank r of a straight PipeDream
pipeline (weight stashing, one version per input in flight). Elsewhere the planner is checked
against the version tags of the schedules' actions; here it is checked against what the weights
actually held: one 4-rank gloo world (p = 4, m = 4, one chunk per rank) trains a tiny GPT with
"1f1b", "2bw" and "pipedream" in turn, 3 batches each and a drain, and every rank reports its
``WeightVersionStore``'s ``peak_versions``, ``version_bytes`` and ``peak_bytes``. For every rank:

* ``peak_versions == weight_versions(schedule, 4, rank)``;
* ``peak_bytes == weight_versions(schedule, 4, rank) * version_bytes``;
* the planner's weight term of MEMORY(.) for the same layout (``PlanCostModel``: rank r's parameters
  times the element size, times ``weight_versions``) equals ``version_bytes`` and ``peak_bytes``.
  The planner plans the model as the user gives it, with a tied output embedding, and counts the
  last stage's copy (or, for 2BW and PipeDream, its untied output embedding) of the same size;
  the run uses an untied model for every schedule, which the asynchronous ones require, so both
  sides hold the same parameters. The vocabulary (64) is already a multiple of the padding unit,
  so the padded and the planned vocabularies agree.

Every quantity is an integer (versions, bytes of fp32 parameters), so the comparisons are exact.
Three batches of m = p microbatches are enough to reach each schedule's steady state: PipeDream's
rank 0 has its p inputs in flight from the p-th microbatch on, and 2BW overlaps two versions from
the second batch on.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.profile import ModelShape
from megapipe.planner.schedule_costs import weight_versions
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

P = M = 4
SEQ, MICRO, BATCHES = 8, 2, 3
SCHEDULES = ("1f1b", "2bw", "pipedream")


def model_config() -> ModelConfig:
    return ModelConfig(num_layers=P, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=SEQ,
                       hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                       untie_embeddings_and_output_weights=True)


def microbatch(config: ModelConfig, index: int) -> dict:
    g = torch.Generator().manual_seed(7919 * index + 1)
    return {"tokens": torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=g),
            "labels": torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=g),
            "loss_mask": torch.ones(MICRO, SEQ)}


def train_all_schedules(rank, world_size):
    """Per schedule, this rank's stores: (peak_versions, version_bytes, peak_bytes, updates), as plain ints."""
    config = model_config()
    ps = ParallelState.initialize(tensor=1, pipeline=P)  # once for the world: groups are expensive
    optimizer = OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9, weight_decay=0.0, clip_grad=0.0)
    reports = {}
    for name in SCHEDULES:
        chunks = build_model_chunks("gpt", config, ps)
        engine = PipelineEngine(chunks, ps, optimizer, name, M, (SEQ, MICRO, config.hidden_size),
                                timeout=datetime.timedelta(seconds=60))
        for batch in range(BATCHES):
            engine.train_batch([microbatch(config, batch * M + j) for j in range(M)])
        engine.drain()
        reports[name] = [(int(s.peak_versions), int(s.version_bytes), int(s.peak_bytes), int(s.live_version))
                         for s in engine.stores]
    return reports


def planned_weight_bytes(name: str) -> list[tuple[int, int]]:
    """Per rank, the planner's bytes of one weight version and of all its versions (MEMORY(.)'s weight term)."""
    config = model_config()
    shape = ModelShape.from_config("gpt", config)
    shape = ModelShape(shape.kind, shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.seq_length,
                       shape.vocab_size, shape.ffn_hidden_size, tied_embeddings=True)  # the model as planned
    profile = analytic_gpt_profile(shape, achieved_flops=1e12, micro_batch_sizes=(MICRO,), dtype="float32")
    cluster = Cluster(nodes=1, gpus_per_node=P, memory_per_gpu=1e12, intra_node_bandwidth=1e10,
                      inter_node_bandwidth=1e10)
    loads = PlanCostModel(profile, cluster, Training(M * MICRO))._rank_loads(Candidate(1, P, 1, MICRO, name))
    result = []
    for r in range(P):
        per_version = loads.params[r] * profile.element_bytes
        assert per_version == int(per_version)
        result.append((int(per_version), int(per_version) * weight_versions(name, P, r)))
    return result


@pytest.mark.timeout(240)
def test_planned_weight_versions_are_what_the_version_stores_hold():
    results = run_distributed(P, train_all_schedules, timeout=200)
    assert [weight_versions("pipedream", P, r) for r in range(P)] == [4, 3, 2, 1]  # p - s on stage s
    for name in SCHEDULES:
        planned = planned_weight_bytes(name)
        for rank in range(P):
            (peak, version_bytes, peak_bytes, updates), = results[rank][name]  # one chunk per rank
            expected = weight_versions(name, P, rank)
            where = f"{name}, rank {rank}"
            assert peak == expected, f"{where}: the store held {peak} versions, the planner says {expected}"
            assert peak_bytes == expected * version_bytes, f"{where}: {peak_bytes} bytes at peak"
            assert planned[rank] == (version_bytes, peak_bytes), \
                f"{where}: planner bytes (one version, all) {planned[rank]}, store {(version_bytes, peak_bytes)}"
            # the stores did train: one update per batch, PipeDream one per microbatch
            assert updates == BATCHES * (M if name == "pipedream" else 1), f"{where}: {updates} updates"
