"""``pretrain_gpt.py --hf-dataset``: preempted and resumed, a run sees what an uninterrupted run sees.

A saved Hugging Face dataset small enough (178 tokens an epoch) that the resumed position lies
several epochs into its stream. An uninterrupted run of 12 iterations, tokenising in 2 worker
processes; the same run preempted as a scheduler does it, SIGTERM to every process of the job
(its workers too, which must keep tokenising until the run has saved and exited), after its
second iteration; its checkpoint resumed to 12 (tokenising in the training process: the worker
count must not change the stream), whose losses must equal the uninterrupted run's bit for bit;
and the same checkpoint resumed at data-parallel degree 2 (torchrun, 1 worker each), which must
train on the same global batches: its losses equal the uninterrupted run's up to the order of the
fp32 sums (rtol 1e-5; a stream one token off moves the loss by 5e-4 relative). Exact losses come
from the TensorBoard events (fp32 values), not from the log's 7 printed digits. Dropout is off:
random states do not follow a change of layout.
"""

import os
import re
import signal
import sys

import numpy as np
import pytest

from launch_helpers import REPO, Job, standalone

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]
datasets = pytest.importorskip("datasets")

ITERATIONS = 12
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS), "--log-interval", "1",
        "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--fusion-backend", "eager", "--split", "90,5,5", "--lr-warmup-iters", "0"]


def start(tmp_path, name: str, flags: list[str], nproc: int = 1) -> Job:
    """pretrain_gpt.py (under torchrun for ``nproc`` > 1) logging its losses to TensorBoard as ``name``."""
    script = [os.path.join(REPO, "pretrain_gpt.py"), *TINY, "--hf-dataset", str(tmp_path / "dataset"),
              "--data-cache-path", str(tmp_path / "cache"), "--tensorboard-dir", str(tmp_path / name), *flags]
    return Job(standalone(nproc, script) if nproc > 1 else [sys.executable, *script], forked=True)


def finished(tmp_path, name: str, job: Job) -> dict[int, float]:
    """{iteration: lm loss} as TensorBoard holds it, once ``job`` has exited 0."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    try:
        assert job.finish(240) == 0, job.output()[-3000:]
    finally:
        job.close()
    events = EventAccumulator(str(tmp_path / name))
    events.Reload()
    return {event.step: event.value for event in events.Scalars("train/lm loss")}


def test_a_preempted_and_resumed_run_sees_the_samples_of_an_uninterrupted_one(tmp_path):
    texts = [f"{k} {'abcdefghij'[k % 10] * (k % 9)}." for k in range(24)]  # the train split: 22 documents
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "dataset"))
    checkpoints = str(tmp_path / "checkpoints")
    uninterrupted = finished(tmp_path, "uninterrupted", start(tmp_path, "uninterrupted", ["--num-workers", "2"]))
    job = start(tmp_path, "preempted", ["--num-workers", "2", "--save", checkpoints])
    job.wait_for(r"iteration\s+2/", 120)
    os.killpg(job.proc.pid, signal.SIGTERM)  # the job's process group: the training process and its workers
    preempted = finished(tmp_path, "preempted", job)
    stop = int(re.search(r"exiting on SIGTERM at iteration (\d+)", job.output())[1])
    assert 2 <= stop < ITERATIONS, job.output()[-3000:]
    resumed = finished(tmp_path, "resumed", start(tmp_path, "resumed", ["--num-workers", "0", "--load", checkpoints]))
    wider = finished(tmp_path, "wider", start(tmp_path, "wider", ["--num-workers", "1", "--load", checkpoints], 2))
    after = range(stop + 1, ITERATIONS + 1)
    assert sorted(uninterrupted) == list(range(1, ITERATIONS + 1))
    assert preempted == {i: uninterrupted[i] for i in range(1, stop + 1)}
    assert resumed == {i: uninterrupted[i] for i in after}  # bit for bit (fp32)
    assert sorted(wider) == list(after)
    np.testing.assert_allclose([wider[i] for i in after], [uninterrupted[i] for i in after], rtol=1e-5)
