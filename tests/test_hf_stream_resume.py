"""``pretrain_gpt.py --hf-dataset``: stopped and resumed, a run sees what an uninterrupted run sees.

A saved Hugging Face dataset small enough (178 tokens an epoch) that the resumed position, sample
24 (token 384), lies in the third epoch of its stream. An uninterrupted run of 6 iterations
(tokenising in 2 worker processes); a run stopped at iteration 3 (``--exit-interval 3 --save``);
its checkpoint resumed to 6 (tokenising in the training process: the worker count must not change
the stream), whose losses must equal the uninterrupted run's bit for bit; and the same checkpoint
resumed at data-parallel degree 2 (torchrun, 1 worker each), which must train on the same global
batches: its losses equal the uninterrupted run's up to the order of the fp32 sums (rtol 1e-5; a
stream one token off moves the loss by 5e-4 relative). Exact losses come from the TensorBoard
events (fp32 values), not from the log's 7 printed digits. Dropout is off: random states do not
follow a change of layout.
"""

import os
import sys

import numpy as np
import pytest

from launch_helpers import REPO, Job, standalone

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]
datasets = pytest.importorskip("datasets")

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--log-interval", "1",
        "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--fusion-backend", "eager", "--split", "90,5,5", "--lr-warmup-iters", "0"]


def run(tmp_path, name: str, flags: list[str], nproc: int = 1) -> dict[int, float]:
    """Run pretrain_gpt.py (torchrun for ``nproc`` > 1); {iteration: lm loss} as TensorBoard holds it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = [os.path.join(REPO, "pretrain_gpt.py"), *TINY, "--hf-dataset", str(tmp_path / "dataset"),
              "--data-cache-path", str(tmp_path / "cache"), "--tensorboard-dir", str(tmp_path / name), *flags]
    job = Job(standalone(nproc, script) if nproc > 1 else [sys.executable, *script])
    try:
        assert job.finish(240) == 0, job.output()[-3000:]
    finally:
        job.close()
    events = EventAccumulator(str(tmp_path / name))
    events.Reload()
    return {event.step: event.value for event in events.Scalars("train/lm loss")}


def test_a_resumed_run_sees_the_samples_of_an_uninterrupted_one(tmp_path):
    texts = [f"{k} {'abcdefghij'[k % 10] * (k % 9)}." for k in range(24)]  # the train split: 22 documents
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "dataset"))
    checkpoints = str(tmp_path / "checkpoints")
    uninterrupted = run(tmp_path, "uninterrupted", ["--num-workers", "2"])
    stopped = run(tmp_path, "stopped", ["--num-workers", "2", "--save", checkpoints, "--exit-interval", "3"])
    resumed = run(tmp_path, "resumed", ["--num-workers", "0", "--load", checkpoints])
    wider = run(tmp_path, "wider", ["--num-workers", "1", "--load", checkpoints], nproc=2)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    assert stopped == {i: uninterrupted[i] for i in (1, 2, 3)}
    assert resumed == {i: uninterrupted[i] for i in (4, 5, 6)}  # bit for bit (fp32)
    assert sorted(wider) == [4, 5, 6]
    np.testing.assert_allclose([wider[i] for i in (4, 5, 6)], [uninterrupted[i] for i in (4, 5, 6)], rtol=1e-5)
