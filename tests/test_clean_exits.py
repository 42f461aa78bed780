"""Every successful run exits 0: no rank aborts after its last iteration.

A run's gloo groups, if still alive in the interpreter's teardown, could abort a rank that had
finished ("terminate called without an active exception", exit -6), now and then and more often
on a busy machine; ``megapipe/parallel/teardown.py`` frees them before. The real entry point
under torchrun, two launches at a time (the load makes the race likelier and the test shorter),
runs each data-parallel sharding level with its overlaps on and each asynchronous schedule, 4
times each: 24 runs, every one must exit 0. torchrun itself is forked from a server that has
imported torch (``Job(forked=True)``, seconds of CPU less per run); its workers, whose exits are
checked, are new interpreters (``fresh_workers``), since what they do at exit is the subject.
"""

import os

import pytest

from launch_helpers import REPO, Job, standalone
from megapipe.config.sharding import SHARDING_STRATEGIES
from megapipe.pipeline.ir.schedules import schedule_descriptor, schedule_names

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

REPEATS = 4
RUN_SECONDS = 300
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--mock-data", "--vocab-size", "64", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "1",
         "--fusion-backend", "eager"]


def _sharding(strategy: str) -> list[str]:
    overlaps = ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if strategy != "no_shard" else [])
    return ["--data-parallel-sharding-strategy", strategy, *overlaps]


def _asynchronous(schedule: str) -> list[str]:
    return ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
            "--untie-embeddings-and-output-weights"]


CASES = ([_sharding(strategy) for strategy in SHARDING_STRATEGIES]
         + [_asynchronous(name) for name in schedule_names() if schedule_descriptor(name).asynchronous])


def test_every_sharding_level_and_asynchronous_schedule_exits_0_every_time():
    assert len(CASES) * REPEATS >= 20
    runs = [case for case in CASES for _ in range(REPEATS)]
    failures = []
    for first in range(0, len(runs), 2):
        jobs = [Job(standalone(2, [os.path.join(REPO, "pretrain_gpt.py"), *MODEL, *flags]), forked=True,
                    fresh_workers=True) for flags in runs[first:first + 2]]
        try:
            for job, flags in zip(jobs, runs[first:first + 2]):
                code = job.finish(RUN_SECONDS)
                if code != 0 or "terminate called" in job.output():
                    failures.append(f"{' '.join(flags)}: exit {code}\n{job.output()[-2000:]}")
        finally:
            for job in jobs:
                job.close()
    assert not failures, f"{len(failures)} of {len(runs)} runs failed:\n" + "\n".join(failures)
