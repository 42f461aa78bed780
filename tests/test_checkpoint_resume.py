"""Exact resume: train 2 steps, save, start a new Trainer from the checkpoint, train 2 more.

The resumed steps must repeat the original run's steps 3 and 4 bit for bit, per microbatch
loss, for every pipeline schedule at (t, p, d) = (2, 2, 1) and (1, 2, 2). Dropout stays on,
so the losses only match if the random states of every rank (default generator and the
tensor-parallel tracker) come back with the weights, the Adam moments, the learning-rate
schedule and the data position. The new Trainer in the same process re-seeds everything
at construction, so nothing carries over except through the files. One case saves with
--async-save, whose background write must produce the same checkpoint.
"""

import os

import pytest

from checkpoint_helpers import layout_flags, train
from megapipe.testing import run_distributed

SCHEDULES = ["1f1b", "gpipe", "interleaved"]
LAYOUTS = {"t2p2d1": (2, 2), "t1p2d2": (1, 2)}


def resume_cases():
    for layout, (t, p) in LAYOUTS.items():
        for schedule in SCHEDULES:
            extra = ["--async-save"] if (layout, schedule) == ("t1p2d2", "1f1b") else []
            yield f"{layout}-{schedule}", layout_flags(t, p, schedule) + extra


def _resume_world(rank, world_size, root):
    cache = os.path.join(root, "cache")
    results = {}
    for name, flags in resume_cases():
        directory = os.path.join(root, name)
        _, uninterrupted = train(flags + ["--train-iters", "4", "--save", directory, "--save-interval", "2"], cache)
        trainer, resumed = train(flags + ["--train-iters", "4", "--load", os.path.join(directory, "iter_0000002")],
                                 cache)
        results[name] = (uninterrupted, resumed, trainer.ps.is_last_stage)
    return results


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory):
    return run_distributed(4, _resume_world, str(tmp_path_factory.mktemp("resume")), timeout=600)


@pytest.mark.parametrize("name", [name for name, _ in resume_cases()])
def test_resumed_steps_repeat_the_uninterrupted_run_bit_for_bit(resume_results, name):
    for rank, results in enumerate(resume_results):
        uninterrupted, resumed, last_stage = results[name]
        assert len(uninterrupted) == 4 and len(resumed) == 2
        assert resumed == uninterrupted[2:], f"rank {rank}"
        if last_stage:
            assert all(resumed), f"rank {rank} is a last stage but recorded no losses"
