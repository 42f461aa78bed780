"""Optimizer post-validation trains exactly like the synchronous step, rollbacks included.

One world of 4 processes runs every check (under the strict transport the suite sets): GPT
(tied embeddings) at (t, p, d) = (1, 4, 1), (1, 2, 2) with the optimizer sharded over the two
replicas (ZeRO-1, and ZeRO-3) and (2, 2, 1), zb-h2 and 1f1b, and at p = 2 zbv (the V placement:
both copies of the tied embedding on rank 0), AdamW with a
warm-up (so the learning rate changes every step and a redo must use the old one). Each case
trains the same initial weights on the same microbatches twice, with the synchronous step and
with ``--enable-optimizer-post-validation``, and compares the per-microbatch losses of every
step and every parameter after the last one with ``torch.equal``, for three settings:

* ``--clip-grad`` far above every norm: nothing is amended, and the eager steps alone must be
  the synchronous steps bit for bit;
* ``--clip-grad`` between the norms the run meets, so that some steps clip and others do not;
* fp16 with dynamic loss scaling from a scale that overflows in a later step (the second):
  that step is skipped and the scale halved, and the steps after it are not skipped.

Host reads (``test_runtime_costs``'s count) of a step without amendment: none synchronously, one
(the verdict) with post-validation, on every rank. The rollbacks are counted after every call:
the step k the synchronous run clipped or skipped (its norm above ``--clip-grad`` within the
conservative margin, or its skip flag) is redone during call k + 1, or by the final ``drain``
for the last step, and no other step is. The same world checks the exit agreement of
post-validation: a SIGTERM on one rank stops every rank one iteration later, with no barrier.
"""

import contextlib
import datetime
import re
from types import SimpleNamespace

import pytest
import torch

from megapipe.cli.parse import parse_config
from megapipe.errors import ConfigError
from batch_helpers import random_microbatch
from model_families import MODEL_KIND, family_config
from megapipe.parallel.launch import counting_synchronisations
from megapipe.models import build_model_chunks
from megapipe.training.exits import ExitConditions
from megapipe.models.state_dict import canonical_state_dict, local_state_dict
from megapipe.optim import LRScheduler, OptimizerConfig
from megapipe.optim.clip import CLIP_EPSILON
from megapipe.optim.post_validation import AMEND_MARGIN
from megapipe.parallel.state import ParallelState
from megapipe.schedules.catalog import schedule_descriptor
from megapipe.pipeline.engine import PipelineEngine
from megapipe.layout.placement import Placement
from megapipe.testing.worlds import run_distributed
from test_training_cli import TINY, run

SEQ, MICRO, M, STEPS = 8, 2, 4, 5
LAYOUTS = [(1, 4, 1, "no_shard"), (1, 2, 2, "optim"), (1, 2, 2, "optim_grads_params"), (2, 2, 1, "no_shard")]
SCHEDULES = ["zb-h2", "1f1b"]
V_SCHEDULE = "zbv"  # also at p = 2 without ZeRO-3 (zbv needs m >= 2p - 1): tied embedding on rank 0 only


def schedules_of(p: int, sharding: str) -> list[str]:
    return SCHEDULES + ([V_SCHEDULE] if p == 2 and sharding != "optim_grads_params" else [])
NO_CLIP = 1e6


def model_config(fp16: bool):
    return family_config("gpt", num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=SEQ,
                         hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8,
                         params_dtype=torch.float16 if fp16 else torch.float32)


def optimizer_config(clip_grad: float, fp16: bool, post_validation: bool, sharding: str) -> OptimizerConfig:
    # from 2**18 the fp16 gradients of this model overflow at the second step; halved, the scale fits
    return OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=clip_grad, lr_warmup_iters=3,
                           lr_decay_style="linear", fp16=fp16, initial_loss_scale=2.0 ** 18, hysteresis=1,
                           data_parallel_sharding_strategy=sharding, enable_optimizer_post_validation=post_validation)


def train(t, p, d, sharding, schedule, initial, clip_grad, fp16, post_validation):
    """Per step: (losses on this rank, the step's settled results); the final weights; rollbacks after each call."""
    config = model_config(fp16)
    spec = schedule_descriptor(schedule)
    ps = ParallelState.initialize(tensor=t, pipeline=p, virtual_pipeline=2 if spec.placement is Placement.V else 1,
                                  placement=spec.placement)
    chunks = build_model_chunks(MODEL_KIND["gpt"], config, ps)
    for chunk in chunks:
        chunk.load_state_dict(local_state_dict(initial, chunk, ps, config))
    opt_config = optimizer_config(clip_grad, fp16, post_validation, sharding)
    engine = PipelineEngine(chunks, ps, opt_config, schedule, M, (SEQ, MICRO, config.hidden_size),
                            dtype=config.params_dtype, timeout=datetime.timedelta(seconds=60))
    scheduler = LRScheduler(engine.optimizer, opt_config, STEPS)
    losses, settled, rollbacks, reads = [], [], [], []
    for step in range(STEPS):
        batches = [random_microbatch(MODEL_KIND["gpt"], config.vocab_size, MICRO, SEQ,
                                     seed=1000 * step + ps.dp_rank * M + i) for i in range(M)]
        with counting_synchronisations(torch.device("cpu")) if step == 2 else contextlib.nullcontext([]) as found:
            result = engine.train_batch(batches)
        reads += found
        scheduler.step()
        losses.append(torch.stack(result.batch.loss_tensors) if result.batch.loss_tensors else None)
        settled += result.settled
        rollbacks.append(engine.validation.rollbacks if post_validation else 0)
    settled += engine.drain().settled
    rollbacks.append(engine.validation.rollbacks if post_validation else 0)
    outcomes = [(bool(s.skipped_flag), float(s.norm)) for s in settled]
    with engine.whole_weights():  # ZeRO-3 releases them between passes
        final = canonical_state_dict(chunks, ps, config)
    return ps, losses, final, outcomes, rollbacks, len(reads)


def expected_rollbacks(outcomes, clip_grad):
    """Rollbacks after each call when step k of the synchronous run (outcomes[k]) needed an amendment."""
    amended = [skipped or (norm + CLIP_EPSILON) * (1 + AMEND_MARGIN) > clip_grad for skipped, norm in outcomes]
    counts = [0] + [sum(amended[:k]) for k in range(1, STEPS)]  # call k redoes step k - 1
    return counts + [sum(amended)], amended


def lagged_exit_reasons(rank):
    """Rank 1 gets SIGTERM during iteration 1: every rank agrees on it one boundary later."""
    no_limits = SimpleNamespace(training=SimpleNamespace(exit_interval=None, exit_duration_in_mins=None,
                                                         exit_on_sigterm=True, cluster_lease=None,
                                                         exit_signal_grace_seconds=None,
                                                         collective_timeout=datetime.timedelta(minutes=1)))
    conditions = ExitConditions(no_limits)
    reasons = []
    for iteration in (1, 2, 3):
        conditions.sigterm = conditions.sigterm or (rank == 1 and iteration == 1)
        reasons.append(conditions.reason(iteration))
    conditions.close()
    return reasons


def check_post_validation(rank, world_size):
    exits = lagged_exit_reasons(rank)
    reference = build_model_chunks(MODEL_KIND["gpt"], model_config(False), ParallelState.single())
    initial = canonical_state_dict(reference, ParallelState.single(), model_config(False))
    report = []
    for t, p, d, sharding in LAYOUTS:
        for schedule in schedules_of(p, sharding):
            clip_between = None
            for setting in ("no clipping", "clipping", "fp16 overflow"):
                fp16 = setting == "fp16 overflow"
                clip = NO_CLIP if setting != "clipping" else clip_between
                what = f"{schedule} t={t} p={p} d={d} {sharding} {setting} (clip {clip:g})"
                sync = train(t, p, d, sharding, schedule, initial, clip, fp16, False)
                post = train(t, p, d, sharding, schedule, initial, clip, fp16, True)
                ps, sync_losses, sync_final, outcomes, _, sync_reads = sync
                _, post_losses, post_final, post_outcomes, rollbacks, post_reads = post
                for step, (a, b) in enumerate(zip(sync_losses, post_losses)):
                    same = (a is None) == (b is None) and (a is None or torch.equal(a, b))
                    assert same, f"{what}: losses of step {step}"
                for name, value in sync_final.items():
                    assert torch.equal(value, post_final[name]), f"{what}: parameter {name}"
                expected, amended = expected_rollbacks(outcomes, clip)
                assert rollbacks == expected, f"{what}: rollbacks after each call {rollbacks}, expected {expected}"
                assert [s for s, _ in post_outcomes] == [s for s, _ in outcomes], f"{what}: skipped steps"
                if setting == "no clipping":
                    assert not any(amended), what
                    # the verdict on the previous step is the one host read of a step (none without)
                    assert (sync_reads, post_reads) == (0, 1), f"{what}: host reads {sync_reads}, {post_reads}"
                    norms = sorted(norm for _, norm in outcomes)
                    clip_between = (norms[1] + norms[2]) / 2  # two steps above it, three below
                elif setting == "clipping":
                    assert 0 < sum(amended) < STEPS, f"{what}: clipping should trigger in some steps only: {outcomes}"
                else:
                    assert any(s for s, _ in outcomes) and not outcomes[-1][0], f"{what}: expected a skip: {outcomes}"
                report.append((what, rollbacks[-1]))
    return exits, report


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_post_validation_equals_synchronous_step():
    results = run_distributed(4, check_post_validation, timeout=600)
    for exits, report in results:
        assert exits == [None, "SIGTERM at iteration 2", "SIGTERM at iteration 3"]
        assert report == results[0][1] and len(report) == 3 * sum(len(schedules_of(p, sharding)) for _, p, _, sharding in LAYOUTS)


@pytest.mark.unit
@pytest.mark.parametrize("argv, world_size, message", [
    ([], 1, "--enable-optimizer-post-validation needs --pipeline-model-parallel-size of at least 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", "--untie-embeddings-and-output-weights"],
     2, "--enable-optimizer-post-validation cannot run --pipeline-schedule 2bw"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "pipedream",
      "--untie-embeddings-and-output-weights"], 2, "--enable-optimizer-post-validation cannot run --pipeline-schedule "
                                                   "pipedream"),
    (["--pipeline-stages", "0:1x2,1:4x1", "--pipeline-schedule", "pipedream", "--untie-embeddings-and-output-weights",
      "--global-batch-size", "16"], 3, "cannot run a --pipeline-stages plan with replicated stages"),
])
def test_post_validation_refuses_what_it_cannot_run(argv, world_size, message):
    with pytest.raises(ConfigError, match=message):
        parse_config("gpt", ["--enable-optimizer-post-validation", "--num-layers", "4"] + argv, world_size=world_size)


@pytest.mark.system
def test_training_script_with_post_validation_logs_what_the_synchronous_step_logs(tmp_path):
    """pretrain_gpt.py at p = 2, zb-h2, --clip-grad below every norm (each step redone), an
    evaluation and an exit that saves: the same losses, gradient norms and skip counts; the
    post-validated run's lines list the steps it redid (each known one iteration later, when it
    is validated) and its summary all five."""
    args = TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h2", "--clip-grad", "0.3",
                   "--eval-interval", "3", "--exit-interval", "5"]
    logs, amended, summaries = {}, {}, {}
    for flags in ([], ["--enable-optimizer-post-validation"]):
        done = run(args + flags + ["--save", str(tmp_path / str(len(flags)))], nproc=2, cache=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "exiting on --exit-interval 5 at iteration 5" in done.stdout
        logs[len(flags)] = [line.split("| tokens/s")[0].split("lm loss")[1] for line in done.stdout.splitlines()
                            if line.strip().startswith("iteration")]
        amended[len(flags)] = re.findall(r"\| amended steps: ([^|]*) \|", done.stdout)
        summaries[len(flags)] = re.findall(r"post-validation amended .*", done.stdout)
    assert len(logs[0]) == 5 and logs[0] == logs[1]
    assert amended == {0: [], 1: ["none", "1", "2", "3", "4"]}
    assert summaries == {0: [], 1: ["post-validation amended 5 of 5 steps: iterations 1, 2, 3, 4, 5"]}
