"""PipeDream (weight stashing, vertical sync, 1F1B-RR) and PipeDream-2BW train exactly as the
sequential emulator of seed 002 Table 7.1 says (``pipedream_emulator.py``), alone and with
tensor (t=2) and data (d=2, parallel pipelines) parallelism, on p = 2 and 4 stages and on the
replicated "2-1" configuration, and with MoE layers whose experts are split over the parallel
pipelines (e=2); the weight stores hold the versions the papers predict.

Each run trains 3 batches of m = p microbatches and drains, i.e. 3p >= 2m + p microbatches
(PipeDream: as many updates per stage; 2BW: 3 updates, the last two on 1-stale weights).
Tolerance: fp32, 1e-5 relative to each tensor's largest entry. Both sides do the same
arithmetic up to summation order (matmuls split over tensor ranks, all-reduces, gradients
summed in main_grad after dividing the loss versus summed then divided), about 1e-7
relative per update; SGD with momentum is linear in the gradient and AdamW's first steps
move every weight by about lr, so a dozen updates stay well below 1e-5.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from batch_helpers import random_microbatch
from megapipe.config import ModelConfig
from megapipe.data.context_batch import context_share
from megapipe.models import build_model_chunks
from megapipe.models.families import family
from megapipe.models.state_dict import canonical_state_dict, canonical_tensor, local_state_dict
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.schedules.catalog.round_robin import warmup_forwards
from megapipe.layout.stage_plan import StagePlan
from megapipe.testing.worlds import run_distributed
from pipedream_emulator import emulate, stashing, two_bw, vertical_sync

pytestmark = pytest.mark.distributed

RTOL = 1e-5
SLOW_WORLD = pytest.mark.timeout(900)  # a busy 2-core machine runs these worlds several times slower than an idle one
SEQ, MICRO, LAYERS, BATCHES, LR = 4, 2, 4, 3, 0.05


@dataclass(frozen=True)
class Case:
    kind: str
    schedule: str
    p: int
    t: int = 1
    d: int = 1
    v: int = 1  # model chunks per rank (2BW with interleaving)
    e: int = 1  # expert ranks: above 1, MoE layers whose experts are split over the data-parallel pipelines
    vertical_sync: bool = False
    plan: Optional[str] = None  # --pipeline-stages, for replicated stages (1F1B-RR)
    optimizer: str = "sgd"
    drain_after: Optional[int] = None  # drain after this many batches, then go on (as evaluate() does)
    c: int = 1  # context ranks (ring attention): each trains on its two chunks of every sequence

    @property
    def m(self) -> int:
        return self.p

    @property
    def stage_plan(self) -> StagePlan:
        if self.plan is not None:
            return StagePlan.parse(self.plan)
        stages = self.p * self.v
        per = LAYERS // stages
        return StagePlan.parse(",".join(f"{s * per}:{(s + 1) * per}x{self.d}" for s in range(stages)))

    def __str__(self) -> str:
        sync = "+vsync" if self.vertical_sync else ""
        return (f"{self.kind} {self.schedule}{sync} p={self.p} v={self.v} t={self.t} c={self.c} d={self.d} e={self.e} "
                f"{self.plan or ''} {self.optimizer}")


MOE = dict(num_experts=4, moe_router_topk=2, add_bias_linear=False, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)


def model_config(kind: str, experts: int = 1) -> ModelConfig:
    """The test model; with ``experts`` > 1 its MLPs are MoE layers (auxiliary and z losses on)."""
    common = dict(num_layers=LAYERS, hidden_size=16, num_attention_heads=2, vocab_size=29, seq_length=SEQ,
                  hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                  untie_embeddings_and_output_weights=True, **(MOE if experts > 1 else {}))
    return family(kind).model_config(**common)


def optimizer_config(case: Case) -> OptimizerConfig:
    if case.optimizer == "adamw":
        return OptimizerConfig(optimizer="adamw", lr=LR / 50, weight_decay=0.0, clip_grad=0.0)
    return OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.9, weight_decay=0.0, clip_grad=0.0)


def reference_optimizer(case: Case):
    if case.optimizer == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=LR / 50, weight_decay=0.0)
    return lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)


def microbatch(kind: str, config: ModelConfig, index: int) -> dict:
    return random_microbatch(kind, config.vocab_size, MICRO, SEQ, seed=7919 * index + 1)


# ---------------------------------------------------------------------------------- the rules

def round_robin_stashing(replicas: tuple[int, ...]):
    """Weight stashing under 1F1B-RR: replica k % R of stage s runs its (k // R)-th microbatch after
    w_s warm-up forwards (NOAM), each backward followed by an update averaged over the R replicas,
    so it sees floor(k / R) - w_s updates. In a straight pipeline w_s = p - 1 - s: Table 7.1."""
    warm = [warmup_forwards(replicas, s) for s in range(len(replicas))]
    return (lambda s, k: max(k // replicas[s] - warm[s], 0)), (lambda s, k: k // replicas[s])


def rules(case: Case):
    """Version and update-group rules over global microbatch ids; with d parallel pipelines,
    pipeline j runs ids j, j + d, ... and every update averages one microbatch of each."""
    if case.plan is not None:
        return round_robin_stashing(case.stage_plan.replicas)
    if case.schedule == "2bw":
        version, group = two_bw(case.m)
    else:
        version, group = (vertical_sync if case.vertical_sync else stashing)(case.p)
    if case.drain_after is not None:
        version, group = restarted(version, group, case.drain_after * case.m)
    return (lambda s, k: version(s, k // case.d)), (lambda s, k: group(s, k // case.d))


def restarted(version, group, first: int):
    """After a drain the pipeline starts again from microbatch ``first``, on the versions the
    drain left (all ``group(s, first - 1) + 1`` updates applied), with the rules counted anew."""
    def version_after(s, k):
        return version(s, k) if k < first else group(s, first - 1) + 1 + version(s, k - first)

    def group_after(s, k):
        return group(s, k) if k < first else group(s, first - 1) + 1 + group(s, k - first)
    return version_after, group_after


def emulated(case: Case):
    config = model_config(case.kind, case.e)
    ps = ParallelState.single()
    model = build_model_chunks(case.kind, config, ps)[0]
    initial = canonical_state_dict([model], ps, config)
    total = BATCHES * case.m * case.d
    losses, final, _ = emulate(model, case.stage_plan.layer_ranges, rules(case),
                               [microbatch(case.kind, config, k) for k in range(total)], reference_optimizer(case))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(final[name])
    return initial, losses, canonical_state_dict([model], ps, config)


# ---------------------------------------------------------------------------------- the pipelined runs

_STATES: dict = {}  # one ParallelState per layout and process: building groups costs seconds on a busy machine


def build(case: Case, config: ModelConfig):
    key = (case.t, case.c, case.p, case.v, case.e, case.plan)
    if case.plan is None:
        ps = _STATES.get(key) or _STATES.setdefault(
            key, ParallelState.initialize(tensor=case.t, pipeline=case.p, virtual_pipeline=case.v, expert=case.e,
                                          context=case.c))
        return ps, build_model_chunks(case.kind, config, ps)
    plan = case.stage_plan
    ps = _STATES.get(key) or _STATES.setdefault(key, ParallelState.initialize(case.t, plan=plan))
    return ps, build_model_chunks(case.kind, config, ps, plan.layer_ranges)


def global_id(case: Case, ps: ParallelState, local: int) -> int:
    return local if case.plan is not None else local * case.d + ps.dp_rank


def pipelined(case: Case, initial: dict) -> dict:
    config = model_config(case.kind, case.e)
    ps, chunks = build(case, config)
    for chunk in chunks:
        chunk.load_state_dict(local_state_dict(initial, chunk, ps, config))
    versions: dict = {}
    engine = PipelineEngine(chunks, ps, optimizer_config(case), case.schedule, case.m,
                            (SEQ // case.c, MICRO, config.hidden_size), vertical_sync=case.vertical_sync,
                            versions_used=versions, timeout=datetime.timedelta(seconds=60))
    last = engine.schedule.num_stages - 1
    losses = {}
    for w in range(BATCHES):
        local = range(w * case.m, (w + 1) * case.m)
        if w == case.drain_after:
            engine.drain()
        result = engine.train_batch([context_share(microbatch(case.kind, config, global_id(case, ps, i)), SEQ, ps)
                                     for i in local])
        if ps.is_last_stage:
            ran = [global_id(case, ps, i) for i in local if engine.schedule.rank_of(last, i) == ps.pp_rank]
            losses.update(zip(ran, result.losses))
    engine.drain()
    final = {}
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for name, tensor in chunk.state_dict().items():
            key, full = canonical_tensor(name, tensor, params[name], ps, config)
            final[key] = full.numpy()  # by value: tensors would cross processes as shared memory
    held = engine.schedule.stages_on_rank(ps.pp_rank)
    return dict(losses=losses, final=final, versions=versions, peaks=[s.peak_versions for s in engine.stores],
                stages_held=held, stages=engine.schedule.num_stages)


def flush_peaks(p: int) -> list[int]:
    """Versions a 1F1B (flush) stage ever holds: read from its store."""
    config, case = model_config("gpt"), Case("gpt", "1f1b", p)
    ps, chunks = build(case, config)
    engine = PipelineEngine(chunks, ps, optimizer_config(case), "1f1b", p,
                            (SEQ, MICRO, config.hidden_size), timeout=datetime.timedelta(seconds=60))
    for w in range(2):
        engine.train_batch([microbatch("gpt", config, w * p + j) for j in range(p)])
    return [store.peak_versions for store in engine.stores]


def run_world(rank, world_size, cases, initials, flush_p):
    results = [pipelined(case, initial) for case, initial in zip(cases, initials)]
    return results, (flush_peaks(flush_p) if flush_p else None)


# ---------------------------------------------------------------------------------- checks

def assert_close(actual, expected, what):
    expected, actual = torch.as_tensor(expected), torch.as_tensor(actual)
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


def check_case(case: Case, per_rank: list[dict], expected_losses, expected_final):
    seen = set()
    for result in per_rank:
        seen.update(result["losses"])  # every context rank of a last stage reports the whole sequence's losses
        for k, loss in result["losses"].items():
            assert_close(loss, expected_losses[k], f"{case}: loss of microbatch {k}")
        for name, value in result["final"].items():
            assert_close(value, expected_final[name], f"{case}: parameter {name} of stages {result['stages_held']}")
    assert sorted(seen) == list(range(len(expected_losses))), f"{case}: losses of microbatches {sorted(seen)}"
    for result in per_rank:
        held, stages = result["stages_held"], result["stages"]
        if case.schedule == "2bw":
            assert result["peaks"] == [2] * len(held), f"{case}: stages {held} held {result['peaks']} versions"
            if case.drain_after is None:  # (after a drain the ids start again; the emulator checks that run)
                check_two_bw_versions(case, result)
        elif case.plan is None and not case.vertical_sync:  # stage s of a straight pipeline: p - s versions
            assert result["peaks"] == [stages - s for s in held], f"{case}: {held} held {result['peaks']} versions"


def check_two_bw_versions(case: Case, result: dict):
    """Microbatch k (1-indexed) used version max(floor((k-1)/m) - 1, 0) for both passes, every pass."""
    expected = {(kind, stage, k): max(k // case.m - 1, 0)
                for kind in ("F", "B") for stage in result["stages_held"] for k in range(BATCHES * case.m)}
    assert result["versions"] == expected, f"{case}: versions used {result['versions']}"


def run_cases(world: int, cases: list[Case], flush_p: int = 0, timeout: float = 800):
    references = [emulated(case) for case in cases]
    results = run_distributed(world, run_world, cases, [initial for initial, _, _ in references], flush_p,
                              timeout=timeout)
    for index, case in enumerate(cases):
        _, expected_losses, expected_final = references[index]
        check_case(case, [results[rank][0][index] for rank in range(world)], expected_losses, expected_final)
    return [peaks for _, peaks in results]


@SLOW_WORLD
def test_two_stages_and_interleaved_2bw():
    run_cases(2, [Case("gpt", "pipedream", 2), Case("gpt", "pipedream", 2, vertical_sync=True),
                  Case("gpt", "2bw", 2), Case("bert", "2bw", 2, optimizer="adamw"), Case("gpt", "2bw", 2, v=2),
                  Case("gpt", "pipedream", 2, drain_after=1), Case("gpt", "2bw", 2, drain_after=2)])


@SLOW_WORLD
def test_four_stages_and_parallel_pipelines_and_tensor_parallel_on_four_ranks():
    cases = [Case("gpt", "pipedream", 4), Case("gpt", "pipedream", 4, vertical_sync=True), Case("gpt", "2bw", 4),
             Case("gpt", "pipedream", 2, t=2), Case("gpt", "2bw", 2, t=2),
             Case("gpt", "pipedream", 2, d=2), Case("bert", "2bw", 2, d=2)]
    flush = run_cases(4, cases, flush_p=4)
    assert flush == [[1]] * 4  # a flush schedule keeps one version on every stage


@SLOW_WORLD
def test_replicated_two_one_configuration_runs_round_robin():
    # "2-1": the first two layers on two workers (even and odd microbatches), the rest on one.
    run_cases(3, [Case("gpt", "pipedream", 2, plan="0:2x2,2:4x1"), Case("bert", "pipedream", 2, plan="0:1x2,1:4x1")])


@SLOW_WORLD
def test_eight_ranks_tensor_and_data_parallel_with_four_stages():
    run_cases(8, [Case("gpt", "pipedream", 4, t=2), Case("gpt", "2bw", 4, d=2), Case("gpt", "2bw", 2, t=2, d=2)],
              timeout=800)


@SLOW_WORLD
def test_experts_split_over_two_parallel_pipelines():
    # every MoE layer's 4 experts over the 2 data-parallel pipelines of each stage (e = 2)
    run_cases(4, [Case("gpt", "pipedream", 2, d=2, e=2), Case("gpt", "2bw", 2, d=2, e=2)])
