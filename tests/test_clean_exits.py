"""Every successful run exits 0: no rank aborts after its last iteration.

A run's gloo groups, if still alive in the interpreter's teardown, could abort a rank that had
finished ("terminate called without an active exception", exit -6), now and then and more often
on a busy machine; ``megapipe/parallel/teardown.py`` frees them before. Whether one aborts depends
on timing, but its cause does not: a thread still running when the teardown begins. So each
worker runs under ``exit_probe.py``, which reports the threads still alive at that moment, as the
last thing before the teardown, and every worker of every run must report none besides its main
thread (a teardown that leaves one group referenced leaves its gloo threads: the probe sees them
in every run, while the exit code shows them only now and then). The real entry point under
torchrun, two launches at a time, runs each data-parallel sharding level with its overlaps on and
each asynchronous schedule; every run must exit 0 and print no abort. torchrun itself is forked
from a server that has imported torch (``Job(forked=True)``, seconds of CPU less per run); its
workers are new interpreters (``fresh_workers``), since what they do at exit is the subject.
"""

import os
import re
import subprocess
import sys

import pytest

from exit_probe import PREFIX
from launch_helpers import REPO, Job, standalone
from megapipe.config.sharding import SHARDING_STRATEGIES
from megapipe.schedules.catalog import schedule_descriptor, schedule_names

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

RUN_SECONDS = 300
EXIT_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_probe.py")
PROBE_LINE = re.compile(re.escape(PREFIX) + r"(\d+) threads besides the main one: (.*)")
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


def _problems(code: int, output: str, workers: int) -> list[str]:
    """What is wrong with one run of ``workers`` processes under the probe: its exit, an abort, a live thread."""
    reports = PROBE_LINE.findall(output)
    problems = [f"exit {code}"] if code != 0 else []
    problems += ["an abort"] if "terminate called" in output else []
    problems += [f"{len(reports)} exit probe reports for {workers} workers"] if len(reports) != workers else []
    return problems + [f"threads alive at the interpreter's teardown: {names}" for count, names in reports
                       if count != "0"]


def test_every_sharding_level_and_asynchronous_schedule_exits_0_with_no_thread_left():
    failures = []
    for first in range(0, len(CASES), 2):
        jobs = [Job(standalone(2, [EXIT_PROBE, os.path.join(REPO, "pretrain_gpt.py"), *MODEL, *flags]), forked=True,
                    fresh_workers=True) for flags in CASES[first:first + 2]]
        try:
            for job, flags in zip(jobs, CASES[first:first + 2]):
                problems = _problems(job.finish(RUN_SECONDS), job.output(), workers=2)
                if problems:
                    failures.append(f"{' '.join(flags)}: {'; '.join(problems)}\n{job.output()[-2000:]}")
        finally:
            for job in jobs:
                job.close()
    assert not failures, f"{len(failures)} of {len(CASES)} runs failed:\n" + "\n".join(failures)


def test_the_probe_sees_the_gloo_threads_of_a_group_left_referenced(tmp_path):
    """The failure the probe is there for: a group some object still holds keeps its gloo threads through
    ``close_distributed`` into the teardown."""
    script = tmp_path / "keeps_a_group.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {REPO!r})\n"
                      "import torch.distributed as dist\n"
                      "from megapipe.parallel.teardown import close_distributed\n"
                      f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
                      "kept = dist.new_group([0])\n"
                      "close_distributed()\n"
                      "sys.exit(3)\n")
    run = subprocess.run([sys.executable, EXIT_PROBE, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr  # the script's own exit status
    [(count, names)] = PROBE_LINE.findall(run.stderr)
    assert int(count) > 0 and "pt_gloo_runloop" in names, run.stderr
