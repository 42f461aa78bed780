"""Data-parallel sharding levels and overlap train exactly like replicated data parallelism.

Reference: the ``no_shard`` run without overlap of the same layout, schedule and data (itself
proven equal to single-process gradient accumulation by ``test_pipeline_training.py`` and the
PipeDream emulator in ``test_async_training.py``). Every sharding level (``optim``,
``optim_grads``, ``optim_grads_params``), with and without ``--overlap-grad-reduce`` and
``--overlap-param-gather``, must give the same per-microbatch losses and the same parameters
after 5 steps of AdamW with clipping by the global norm, which a sharded optimizer computes
from its shards. Tolerance 1e-6 relative to each tensor's largest entry: both sides do the
same elementwise updates; the only rounding difference is the summation order of the norm's
partial sums (and of reduce-scatter vs all-reduce), ~1e-7 relative, which reaches the
weights only through the clipping coefficient.

Memory is counted from the tensors the optimizer and the syncs hold (their storages), and
the overlap from the host-clock record of when each bucket's reduction was issued.
"""

from __future__ import annotations

import datetime
import itertools
import os

import pytest
import torch

from batch_helpers import random_microbatch
from megapipe.cli.parse import parse_config
from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.models import build_model_chunks
from megapipe.models.state_dict import canonical_state_dict, canonical_tensor, local_state_dict
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.schedules.actions import ActionKind
from megapipe.pipeline.engine import PipelineEngine
from megapipe.layout.stage_plan import StagePlan
from megapipe.testing.worlds import run_distributed

RTOL = 1e-6
SEQ, MICRO, STEPS = 8, 2, 5
LEVELS = ("optim", "optim_grads", "optim_grads_params")


def model_config(untied: bool) -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=SEQ,
                       hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                       untie_embeddings_and_output_weights=untied)


def optimizer_config(strategy: str = "no_shard", overlap: bool = False, bucket_size: int = 3000) -> OptimizerConfig:
    """AdamW with clipping; small buckets so that every chunk has several. ``adam_eps`` 1e-3: the
    attention's key bias has a gradient of exactly zero in exact arithmetic (softmax ignores a
    shift), so in fp32 it is rounding noise (~1e-10) that depends on the summation order of the
    reduction; a tiny eps would turn that noise into full-size steps of either sign."""
    sharded = strategy != "no_shard"
    return OptimizerConfig(optimizer="adam", lr=0.01, weight_decay=0.1, clip_grad=0.5, adam_eps=1e-3,
                           data_parallel_sharding_strategy=strategy, ddp_bucket_size=bucket_size,
                           overlap_grad_reduce=overlap, overlap_param_gather=overlap and sharded)


def build(case: tuple, strategy: str, overlap: bool, initial: dict, timeline=None):
    """``case``: (t, p, d, schedule, v, m), or with a stage plan (replicated stages, 1F1B-RR) last."""
    t, p, d, schedule, v, m = case[:6]
    asynchronous = schedule in ("2bw", "pipedream")
    config = model_config(untied=asynchronous)
    if len(case) > 6:
        plan = StagePlan.parse(case[6])
        ps = ParallelState.initialize(t, plan=plan)
        chunks = build_model_chunks("gpt", config, ps, plan.layer_ranges)
    else:
        ps = ParallelState.initialize(tensor=t, pipeline=p, virtual_pipeline=v)
        chunks = build_model_chunks("gpt", config, ps, sequence_parallel=t > 1)
    for chunk in chunks:
        chunk.load_state_dict(local_state_dict(initial[asynchronous], chunk, ps, config))
    engine = PipelineEngine(chunks, ps, optimizer_config(strategy, overlap), schedule, m,
                            (SEQ // t, MICRO, config.hidden_size), timeout=datetime.timedelta(seconds=60),
                            timeline=timeline)
    return config, ps, chunks, engine


def train(case: tuple, strategy: str, overlap: bool, initial: dict):
    m = case[5]
    config, ps, chunks, engine = build(case, strategy, overlap, initial)
    losses = []
    for step in range(STEPS):
        first = ps.batch_slice[0] * m  # 1F1B-RR: every rank sees the whole batch
        batches = [random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=1000 * step + first + i)
                   for i in range(m)]
        losses.append(engine.train_batch(batches).losses)
    if case[3] in ("2bw", "pipedream"):
        losses.append(engine.drain().losses)
    with engine.whole_weights():
        final = {}
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            for name, tensor in chunk.state_dict().items():
                key, full = canonical_tensor(name, tensor, params[name], ps, config)
                final[key] = full.clone()
    return losses, final


def assert_close(actual, expected, what):
    expected, actual = torch.as_tensor(expected), torch.as_tensor(actual)
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda msg: f"{what}: {msg}")


def initial_weights() -> dict:
    """The same starting point for every run: tied (flush schedules) and untied (asynchronous) GPT."""
    out = {}
    for untied in (False, True):
        config = model_config(untied)
        ps = ParallelState.single()
        out[untied] = canonical_state_dict(build_model_chunks("gpt", config, ps), ps, config)
    return out


def check_parity(rank, world_size, cases, variants):
    initial = initial_weights()
    checked = []
    for case in cases:
        ref_losses, ref_final = train(case, "no_shard", False, initial)
        for strategy, overlap in variants:
            if strategy == "optim_grads_params" and case[3] in ("2bw", "pipedream"):
                continue
            what = f"{strategy} overlap={overlap} (t, p, d, schedule, v, m)={case}"
            losses, final = train(case, strategy, overlap, initial)
            for got, expected in zip(losses, ref_losses):
                assert len(got) == len(expected), what
                if expected:  # the last stage
                    assert_close(got, expected, f"{what} losses")
            for name, value in final.items():
                assert_close(value, ref_final[name], f"{what} parameter {name}")
            checked.append(what)
    return checked


ALL_VARIANTS = [("no_shard", True)] + [(level, overlap) for level in LEVELS for overlap in (False, True)]

# (t, p, d, schedule, v, m): every level and overlap setting on each; together they cover
# d in {2, 4}, p in {1, 2}, t in {1, 2} with sequence parallelism, the tied embedding across
# stages, 1F1B, interleaved 1F1B, ZB-H1 (split backward: the last BI and the last BW each end
# their gradients' accumulation), 2BW and PipeDream on parallel pipelines (the replicas of a
# stage are its data-parallel group), and PipeDream's 2-1 plan (one replicated stage, 1F1B-RR).
SUITE = {
    4: [(1, 1, 4, "1f1b", 1, 2), (1, 2, 2, "interleaved", 2, 4), (2, 1, 2, "1f1b", 1, 2),
        (1, 2, 2, "zb-h1", 1, 4), (1, 2, 2, "2bw", 1, 2), (1, 2, 2, "pipedream", 1, 2)],
    3: [(1, 2, 1, "pipedream", 1, 2, "0:2x2,2:4x1")],  # PipeDream's 2-1: stage 0 replicated (1F1B-RR)
}


def full_matrix() -> dict[int, list[tuple]]:
    """Every (t, p, d) with t, p in {1, 2}, d in {2, 4} and t p d <= 8, under every schedule that
    p allows, grouped by world size (MEGAPIPE_FULL_DP_MATRIX=1 runs it; minutes on 2 cores)."""
    cases: dict[int, list[tuple]] = {}
    for t, p, d in itertools.product((1, 2), (1, 2), (2, 4)):
        if t * p * d > 8:
            continue
        schedules = [("1f1b", 1, 2)] + ([("interleaved", 2, 4), ("zb-h1", 1, 4), ("zb-h2", 1, 4), ("2bw", 1, 2),
                                         ("pipedream", 1, 2)] if p > 1 else [])
        cases.setdefault(t * p * d, []).extend((t, p, d, name, v, m) for name, v, m in schedules)
    return cases


CASES = full_matrix() if os.environ.get("MEGAPIPE_FULL_DP_MATRIX") == "1" else SUITE


@pytest.mark.distributed
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", sorted(CASES))
def test_sharding_levels_and_overlap_match_no_shard(world):
    results = run_distributed(world, check_parity, CASES[world], ALL_VARIANTS, timeout=3600)
    expected = sum(len(ALL_VARIANTS) - (2 if case[3] in ("2bw", "pipedream") else 0) for case in CASES[world])
    assert len(results[0]) == expected


def check_memory(rank, world_size):
    """Bytes held by the optimizer and the syncs at each level, after a step, against no_shard."""
    initial = initial_weights()
    case = (1, 1, world_size, "1f1b", 1, 2)
    held = {}
    for strategy in ("no_shard",) + LEVELS:
        config, ps, chunks, engine = build(case, strategy, False, initial)
        batches = [random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=i) for i in range(2)]
        engine.train_batch(batches)
        optimizer = engine.optimizer
        state = sum(t.untyped_storage().nbytes() for s in optimizer.inner.state.values() for t in s.values()
                    if t.dim() > 0)
        held[strategy] = dict(engine.grads[0].held_bytes(), state=state,
                              padding=sum(b.end - b.start for b in engine.syncs[0].buckets)
                              - sum(p.numel() for p in engine.syncs[0].params))
        held[strategy]["numel"] = sum(p.numel() for p in engine.syncs[0].params)
    return held


def two_replicas(rank, world_size):
    return (check_memory(rank, world_size), check_overlap_timeline(rank, world_size),
            check_forward_waits(rank, world_size), check_zero3_layers(rank, world_size))


def check_zero3_layers(rank, world_size):
    """ZeRO-3 at d = 2: through a step after the first, at each layer's start (after its own hook), the weight
    bytes held, which buckets are whole or on their way, and which are freed; and the layers' buckets."""
    initial = initial_weights()
    config, ps, chunks, engine = build((1, 1, world_size, "1f1b", 1, 2), "optim_grads_params", False, initial)
    batches = [random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=i) for i in range(2)]
    engine.train_batch(batches)  # the first forward learns the layers
    sync, weights = engine.syncs[0], engine.passes.unit_weights[0]
    whole = sum(w.numel() * w.element_size() for w in sync.bucket_weights)
    starts = []
    for index, unit in enumerate(weights.units):
        unit.register_forward_pre_hook(lambda module, args, index=index: starts.append(
            (index, sync.held_bytes()["weights"] - sync.weight_shard.numel() * sync.weight_shard.element_size(),
             sorted(set(range(len(sync.buckets))) - sync._released))))
    engine.train_batch(batches)
    return whole, [sorted(sync.bucket_indices(unit.parameters())) for unit in weights.units], starts


def check_forward_waits(rank, world_size):
    """ZeRO-1 with --overlap-param-gather at d = 2: after a step, the order the weight gathers were issued in
    and, through the next forward, each unit's start and each bucket wait (with the buckets still in flight)."""
    initial = initial_weights()
    config, ps, chunks, engine = build((1, 1, world_size, "1f1b", 1, 2), "optim", True, initial)
    batches = [random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=i) for i in range(2)]
    engine.train_batch(batches)  # the first forward learns the units; the step starts the gathers
    sync, units = engine.syncs[0], engine.passes.unit_weights[0].units
    issued = list(sync._weight_works)
    unit_buckets = [sorted(sync.bucket_indices(unit.parameters())) for unit in units]
    events, wait = [], sync.wait_for_buckets

    def recording_wait(indices):
        events.append(("wait", sorted(i for i in indices if i in sync._weight_works)))
        wait(indices)
        events.append(("in flight", sorted(sync._weight_works)))

    sync.wait_for_buckets = recording_wait
    for index, unit in enumerate(units):
        unit.register_forward_pre_hook(lambda module, args, index=index: events.append(("run", index)))
    engine.train_batch(batches)
    first_use = [next(i for i, unit in enumerate(unit_buckets) if bucket in unit) for bucket in issued]
    return issued, first_use, unit_buckets, events


@pytest.fixture(scope="module")
def two_replica_runs():
    """One world of d = 2 for the memory count and the overlap timeline."""
    return run_distributed(2, two_replicas, timeout=300)


@pytest.mark.distributed
def test_memory_per_rank_is_one_over_d(two_replica_runs):
    d = 2
    held = two_replica_runs[0][0]
    numel, padding = held["no_shard"]["numel"], held["optim"]["padding"]
    fp32 = 4
    # optimizer state: two fp32 moments of every element at no_shard, of one d-th (plus padding) when sharded
    assert held["no_shard"]["state"] == 2 * fp32 * numel
    for level in LEVELS:
        assert held[level]["state"] <= 2 * fp32 * (numel + padding) // d
        assert held[level]["state"] >= 2 * fp32 * (numel - padding) // d
    # gradients between steps: the full buffer plus the reduced shard at optim, only the shard above it
    assert held["optim"]["grads"] == fp32 * (numel + padding) + fp32 * (numel + padding) // d
    for level in ("optim_grads", "optim_grads_params"):
        assert held[level]["grads"] == fp32 * (numel + padding) // d
    # weights between passes: whole at every level but the last, which keeps only its shard
    assert held["optim_grads_params"]["weights"] == fp32 * (numel + padding) // d
    assert held["no_shard"]["weights"] == fp32 * numel


def check_overlap_timeline(rank, world_size):
    """A d = 2, p = 1 run with overlap: when each bucket's reduction was issued vs the last backward."""
    initial = initial_weights()
    timeline = Timeline()
    config, ps, chunks, engine = build((1, 1, world_size, "1f1b", 1, 2), "optim", True, initial, timeline)
    for sync in engine.syncs:
        sync.reductions = []
    batches = [random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=i) for i in range(2)]
    engine.train_batch(batches)
    last_backward = [e for e in timeline.events if e.action.kind is ActionKind.B][-1]
    return [(r.bucket, r.started, r.finished) for s in engine.syncs for r in s.reductions], \
        (last_backward.start, last_backward.end), len(engine.syncs[0].buckets)


@pytest.mark.distributed
def test_overlap_starts_bucket_reductions_during_the_last_backward(two_replica_runs):
    for _, (reductions, (b_start, b_end), buckets), *_ in two_replica_runs:
        assert buckets > 2 and len(reductions) == buckets
        during = [r for r in reductions if b_start <= r[1] < b_end]
        # every bucket but the late one (tied embedding) starts inside the last backward
        assert len(during) >= buckets - 1, (reductions, b_start, b_end)
        assert all(r[2] is not None for r in reductions)


@pytest.mark.distributed
def test_overlapped_weight_gathers_are_issued_in_forward_order_and_waited_per_unit(two_replica_runs):
    for _, _, (issued, first_use, unit_buckets, events), _ in two_replica_runs:
        assert len(issued) > 2 and first_use == sorted(first_use)  # the forward's first bucket first
        waited, runs = set(), 0
        for kind, value in events:
            if kind == "wait":
                waited.update(value)
            elif kind == "run":
                assert set(unit_buckets[value]) <= waited, (value, events)  # its weights are whole
                runs += 1
        assert runs == 2 * len(unit_buckets)  # two forwards, every unit in each
        # the first unit started while later buckets were still in flight
        first_run = events.index(("run", 0))
        in_flight = [value for kind, value in events[:first_run] if kind == "in flight"]
        assert in_flight and in_flight[-1], events


@pytest.mark.distributed
def test_zero3_gathers_one_layer_ahead_and_frees_each_layer_after_it(two_replica_runs):
    for *_, (whole, unit_buckets, starts) in two_replica_runs:
        assert len(unit_buckets) > 3 and starts
        forward = [(i, held, present) for i, held, present in starts]
        # every layer holds its own buckets, and the next layer's are whole or on their way when it starts
        for i, held, present in forward:
            assert set(unit_buckets[i]) <= set(present), (i, present)
            if i + 1 < len(unit_buckets):
                assert set(unit_buckets[i + 1]) <= set(present), (i, present)
        # ... and never the whole chunk's: the layers before are freed
        assert max(held for _, held, _ in forward) < whole
        assert any(not set(unit_buckets[i - 1]) & set(present) for i, _, present in forward if i > 1)


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,words", [
    (dict(data_parallel_sharding_strategy="zero9"), "--data-parallel-sharding-strategy zero9 is unknown"),
    (dict(overlap_param_gather=True), "--overlap-param-gather needs a sharded optimizer"),
    (dict(ddp_bucket_size=0), "--ddp-bucket-size 0 must be a positive"),
    (dict(ddp_bucket_size=-5, use_distributed_optimizer=True), "--ddp-bucket-size -5"),
])
def test_bad_data_parallel_flags(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        OptimizerConfig(lr=1e-3, **kwargs).validate()


@pytest.mark.unit
def test_zero3_refuses_asynchronous_schedules():
    config = OptimizerConfig(lr=1e-3, data_parallel_sharding_strategy="optim_grads_params")
    config.validate()
    with pytest.raises(ConfigError, match="optim_grads_params cannot run --pipeline-schedule 2bw"):
        config.check_pipeline_schedule("2bw", asynchronous=True)
    config.check_pipeline_schedule("interleaved", asynchronous=False)


@pytest.mark.unit
def test_use_distributed_optimizer_is_optim():
    assert OptimizerConfig(lr=1e-3, use_distributed_optimizer=True).sharding.strategy == "optim"
    assert OptimizerConfig(lr=1e-3).sharding.strategy == "no_shard"


@pytest.mark.unit
@pytest.mark.parametrize("flags,words", [
    (["--pipeline-schedule", "2bw", "--untie-embeddings-and-output-weights",
      "--data-parallel-sharding-strategy", "optim_grads_params"], "optim_grads_params cannot run --pipeline-schedule 2bw"),
    (["--data-parallel-sharding-strategy", "zero3"], "--data-parallel-sharding-strategy zero3 is unknown"),
    (["--overlap-param-gather"], "--overlap-param-gather needs a sharded optimizer"),
    (["--use-distributed-optimizer", "--ddp-bucket-size", "0"], "--ddp-bucket-size 0"),
])
def test_command_line_refuses_before_any_process_group(flags, words):
    argv = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--micro-batch-size", "2"] + flags
    with pytest.raises(ConfigError, match=words):
        parse_config("gpt", argv, world_size=4)
    assert not torch.distributed.is_initialized()


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sharded_masters_and_loss_scaling_match_no_shard_in_one_process(precision):
    """bf16 and fp16 weights with fp32 masters (fp16: dynamic loss scaling, with a first step that
    overflows and is skipped) step the same at every level on one process, where a sharded
    optimizer steps pieces that cover whole parameters: equal to the bit (no clipping, whose
    norm would sum in another order)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    config = model_config(untied=False)
    config.params_dtype = dtype
    results = {}
    for strategy in ("no_shard",) + LEVELS:
        ps = ParallelState.single()
        chunks = build_model_chunks("gpt", config, ps)
        optim = OptimizerConfig(optimizer="adam", lr=0.01, clip_grad=0.0, data_parallel_sharding_strategy=strategy,
                                ddp_bucket_size=3000, bf16=precision == "bf16", fp16=precision == "fp16",
                                initial_loss_scale=2.0 ** 40, hysteresis=1)
        engine = PipelineEngine(chunks, ps, optim, "1f1b", 2, (SEQ, MICRO, config.hidden_size), dtype=dtype)
        skipped = []
        for step in range(3):
            batches = [random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=10 * step + i) for i in range(2)]
            skipped.append(not engine.train_batch(batches).step.ok)
        with engine.whole_weights():
            results[strategy] = (skipped, [p.detach().clone() for p in chunks[0].parameters()])
    reference_skipped, reference = results.pop("no_shard")
    assert reference_skipped[0] == (precision == "fp16")  # 2^40 overflows fp16 gradients once
    for strategy, (skipped, params) in results.items():
        assert skipped == reference_skipped, strategy
        for got, expected in zip(params, reference):
            assert got.dtype == dtype and torch.equal(got, expected), strategy
