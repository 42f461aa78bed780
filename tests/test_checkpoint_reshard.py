"""Resharding: a checkpoint saved at (t, p, d) = (2, 2, 1) loads at (1, 4, 1), (4, 1, 1), (1, 1, 4)
and (1, 1, 1), directly and after ``tools/convert_checkpoint.py reshard``.

The original run saves after step 2 and goes on to steps 3 and 4; every other layout loads
that checkpoint and trains steps 3 and 4 on the same global batches. Step 3's loss checks the
weights (the vocabulary is padded to 16 x t rows, so each layout pads and trims differently,
and the tied embedding is split or whole); step 4's loss also checks that the Adam moments
were resharded with their parameters. Dropout is off: random states cannot follow a change
of layout (they are reseeded, as the log says).

Tolerance 1e-6 relative: the layouts compute the same fp32 sums in different orders (matmuls
split over 1, 2 or 4 tensor ranks, partial softmax sums, all-reduces), which moves a loss of
about 5.5 by ~1e-7 (2e-8 relative measured); one Adam step on gradients that differ as little keeps that order.
"""

import os

import pytest

from checkpoint_helpers import layout_flags, train
from megapipe.checkpointing.common import Layout
from megapipe.checkpointing.convert import reshard
from megapipe.testing import run_distributed

RTOL = 1e-6
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4"]
TARGETS = {"t1p4d1": (1, 4), "t4p1d1": (4, 1), "t1p1d4": (1, 1)}


def _logged(trainer, losses):
    """Losses of the ranks that own a distinct slice of the batch's loss (last stage, tensor rank 0)."""
    return losses if trainer.ps.is_last_stage and trainer.ps.tp_rank == 0 else None


def _save_and_reshard_world(rank, world_size, root):
    cache = os.path.join(root, "cache")
    saved = os.path.join(root, "t2p2d1")
    trainer, losses = train(NO_DROPOUT + layout_flags(2, 2) + ["--save", saved, "--save-interval", "2"], cache)
    results = {"t2p2d1": _logged(trainer, losses[2:])}
    for name, (t, p) in TARGETS.items():
        trainer, losses = train(NO_DROPOUT + layout_flags(t, p) + ["--load", os.path.join(saved, "iter_0000002")],
                                cache)
        results[name] = _logged(trainer, losses)
    return results


def _single_process_world(rank, world_size, root):
    cache = os.path.join(root, "cache")
    direct = train(NO_DROPOUT + ["--load", os.path.join(root, "t2p2d1", "iter_0000002")], cache)[1]
    converted = train(NO_DROPOUT + ["--load", os.path.join(root, "converted")], cache)[1]
    return direct, converted


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    results = run_distributed(4, _save_and_reshard_world, root, timeout=600)
    conversion = reshard(os.path.join(root, "t2p2d1", "iter_0000002"), os.path.join(root, "converted"),
                         Layout(1, 1, 1))
    direct, converted = run_distributed(1, _single_process_world, root, timeout=300)[0]
    by_layout = {name: [r[name] for r in results if r[name] is not None] for name in results[0]}
    by_layout["t1p1d1"] = [direct]
    return by_layout, converted, conversion


def _step_means(rank_losses):
    """Mean loss of each step over every microbatch of the global batch (all data-parallel ranks)."""
    steps = zip(*rank_losses)
    return [sum(sum(step, [])) / sum(len(part) for part in step) for step in steps]


@pytest.mark.parametrize("layout", ["t1p4d1", "t4p1d1", "t1p1d4", "t1p1d1"])
def test_next_steps_after_loading_match_the_saving_layout(losses, layout):
    by_layout, _, _ = losses
    expected, actual = _step_means(by_layout["t2p2d1"]), _step_means(by_layout[layout])
    assert len(actual) == len(expected) == 2
    assert actual == pytest.approx(expected, rel=RTOL, abs=0)


def test_offline_reshard_loads_to_the_same_run(losses):
    by_layout, converted, conversion = losses
    assert converted == by_layout["t1p1d1"][0]  # same values, same layout: bit for bit
    assert conversion.source_layout == Layout(2, 2, 1) and conversion.target_layout == Layout(1, 1, 1)
    assert conversion.tensors > 0 and conversion.bytes > 0
