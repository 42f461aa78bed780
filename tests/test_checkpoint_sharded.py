"""Checkpoints of sharded data parallelism: exact resume, and loading into any level and layout.

A sharded optimizer saves whole tensors at their global offsets (each data-parallel group
gathers its shards of the fp32 masters and Adam moments before the write), so the files are
the same as a ``no_shard`` run's and any level or data-parallel size can read them.

Exact resume: at (t, p, d) = (1, 2, 2), ``optim`` (through ``--use-distributed-optimizer``),
``optim_grads`` with overlap, ``optim_grads_params`` and a 2BW run at ``optim_grads`` with
microbatches in flight train 2 steps, save, and a new Trainer loading the checkpoint must
repeat steps 3 and 4 bit for bit (dropout on: the random states come back too).

Resharding: an ``optim`` checkpoint of (1, 2, 2) loads at (1, 1, 4) with ``optim_grads``, at
(2, 2, 1) and as ``no_shard`` at (1, 2, 2); the next two steps' mean losses match the saving
run's within 1e-5 relative (the layouts sum in different orders, ~1e-7; the second step
also checks that the moments came back with their parameters).
"""

import os

import pytest

from checkpoint_helpers import layout_flags, session_cache, train
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.timeout(900)

RTOL = 1e-5
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4"]
RESUME = {
    "optim": layout_flags(1, 2) + ["--use-distributed-optimizer"],
    "optim_grads-overlap": layout_flags(1, 2) + ["--data-parallel-sharding-strategy", "optim_grads",
                                                 "--overlap-grad-reduce", "--overlap-param-gather",
                                                 "--ddp-bucket-size", "20000"],
    "optim_grads_params": layout_flags(1, 2) + ["--data-parallel-sharding-strategy", "optim_grads_params"],
    "2bw-optim_grads": layout_flags(1, 2, "2bw") + ["--data-parallel-sharding-strategy", "optim_grads"],
}
RESHARD_TARGETS = {
    "t1p1d4-optim_grads": layout_flags(1, 1) + ["--data-parallel-sharding-strategy", "optim_grads"],
    "t2p2d1-optim": layout_flags(2, 2) + ["--use-distributed-optimizer"],
    "t1p2d2-no_shard": layout_flags(1, 2),
}


def _logged(trainer, losses):
    return losses if trainer.ps.is_last_stage and trainer.ps.tp_rank == 0 else None


def _world(rank, world_size, root, cache):
    resumed = {}
    for name, flags in RESUME.items():
        directory = os.path.join(root, name)
        _, saving = train(flags + ["--train-iters", "4", "--save", directory, "--save-interval", "2"], cache)
        _, after = train(flags + ["--train-iters", "4", "--load", os.path.join(directory, "iter_0000002")], cache)
        resumed[name] = (saving, after)
    saved = os.path.join(root, "reshard")
    trainer, losses = train(NO_DROPOUT + RESUME["optim"] + ["--save", saved, "--save-interval", "2"], cache)
    resharded = {"saving": _logged(trainer, losses[2:])}
    for name, flags in RESHARD_TARGETS.items():
        trainer, losses = train(NO_DROPOUT + flags + ["--load", os.path.join(saved, "iter_0000002")], cache)
        resharded[name] = _logged(trainer, losses)
    return resumed, resharded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root, cache = str(tmp_path_factory.mktemp("sharded")), session_cache(tmp_path_factory)
    return run_distributed(4, _world, root, cache, timeout=900)


@pytest.mark.parametrize("name", list(RESUME))
def test_sharded_resume_repeats_the_run_bit_for_bit(runs, name):
    for rank, (resumed, _) in enumerate(runs):
        saving, after = resumed[name]
        assert len(saving) == 4 and len(after) == 2
        assert after == saving[2:], f"rank {rank}"


def _step_means(rank_losses):
    return [sum(sum(step, [])) / sum(len(part) for part in step) for step in zip(*rank_losses)]


@pytest.mark.parametrize("layout", list(RESHARD_TARGETS))
def test_optim_checkpoint_loads_at_other_levels_and_layouts(runs, layout):
    expected = _step_means([r["saving"] for _, r in runs if r["saving"] is not None])
    actual = _step_means([r[layout] for _, r in runs if r[layout] is not None])
    assert len(actual) == len(expected) == 2
    assert actual == pytest.approx(expected, rel=RTOL, abs=0)
