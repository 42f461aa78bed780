"""Resuming training from checkpoints, in the same layout (bit for bit) and in others.

Exact resume: train 2 steps, save, start a new Trainer from the checkpoint, train 2 more.
The resumed steps must repeat the original run's steps 3 and 4 bit for bit, per microbatch
loss, for every pipeline schedule at (t, p, d) = (2, 2, 1) and (1, 2, 2). PipeDream and 2BW
never drain: the checkpoint holds what their pipeline has in flight (forwards awaiting their
backwards, stashed weight versions, accumulated gradients), the resumed run replays those
forwards, and both the saving run and the resumed one must equal a run that never saved.
Dropout stays on, so the losses only match if the random states of every rank (default
generator and the tensor-parallel tracker) come back with the weights, the Adam moments, the
learning-rate schedule and the data position. The new Trainer in the same process re-seeds
everything at construction, so nothing carries over except through the files. Two cases (a
flush and a 2BW one) save with --async-save, whose background write must produce the same
checkpoint; an fp16 run of one process also needs its fp32 master weights and dynamic loss
scaler back.

ZBV (the V placement, whose first rank holds both copies of the tied embedding) resumes bit for
bit at (2, 2, 1).

Resharding: a checkpoint saved at (2, 2, 1) loads at (1, 4, 1), (4, 1, 1), (1, 1, 4) and
(1, 1, 1), directly and after ``tools/convert_checkpoint.py reshard``; and across placements:
it loads into ZBV's V at (2, 2, 1), and a checkpoint ZBV saved loads into the looped
interleaving. Every layout trains
steps 3 and 4 on the same global batches as the saving run. Step 3's loss checks the weights
(the vocabulary is padded to 16 x t rows, so each layout pads and trims differently, and the
tied embedding is split or whole); step 4's also checks that the Adam moments were resharded
with their parameters. Dropout is off there: random states cannot follow a change of layout
(they are reseeded, as the log says). Tolerance 1e-6 relative: the layouts compute the same
fp32 sums in different orders (matmuls split over 1, 2 or 4 tensor ranks, partial softmax
sums, all-reduces), which moves a loss of about 5.5 by ~1e-7 (2e-8 relative measured), and
one Adam step on gradients that differ as little keeps that order.

All 4-rank runs share one spawned world; the (1, 1, 1) runs share a world of one.
"""

import os

import pytest
import torch

from checkpoint_helpers import layout_flags, session_cache, train

from megapipe.checkpointing.common import SavedLayout
from megapipe.checkpointing.convert import reshard
from megapipe.checkpointing.offline import rank_pieces, read_checkpoint
from megapipe.checkpointing.state import is_rank_local
from megapipe.testing.worlds import run_distributed

# one world runs 24 short trainings: minutes on a busy 2-core machine, beyond the suite's 300 s default
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCHEDULES = ["1f1b", "gpipe", "interleaved", "zb-h1", "pipedream", "2bw"]
LAYOUTS = {"t2p2d1": (2, 2), "t1p2d2": (1, 2)}
RTOL = 1e-6
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "4"]
RESHARD_TARGETS = {"t1p4d1": (1, 4), "t4p1d1": (4, 1), "t1p1d4": (1, 1)}


def resume_cases():
    for layout, (t, p) in LAYOUTS.items():
        for schedule in SCHEDULES:
            extra = ["--async-save"] if (layout, schedule) in (("t1p2d2", "1f1b"), ("t2p2d1", "2bw")) else []
            yield f"{layout}-{schedule}", layout_flags(t, p, schedule) + extra
    yield "t2p2d1-zbv", layout_flags(2, 2, "zbv")  # m = 4 (d = 2 would leave 2, below ZBV's least 2p - 1)


ASYNCHRONOUS = ("pipedream", "2bw")


def _resume(root, cache):
    results = {}
    for name, flags in resume_cases():
        directory = os.path.join(root, name)
        _, saving = train(flags + ["--train-iters", "4", "--save", directory, "--save-interval", "2"], cache)
        loaded = []
        trainer, resumed = train(flags + ["--train-iters", "4", "--load", os.path.join(directory, "iter_0000002")],
                                 cache, after_load=lambda t: loaded.append(len(t.engine.executor.state.saved)))
        never_saved = train(flags + ["--train-iters", "4"], cache)[1] if name.endswith(ASYNCHRONOUS) else saving
        results[name] = (never_saved, saving, resumed, trainer.ps.is_last_stage, loaded[0])
    return results


def _dropped_in_flight(root, cache):
    """A PipeDream checkpoint loaded with another global batch: its in-flight microbatches cannot
    continue, so the pipeline starts empty (and says so) and training goes on."""
    loaded = []
    flags = layout_flags(1, 2, "pipedream") + ["--train-iters", "4", "--global-batch-size", "16"]
    _, losses = train(flags + ["--load", os.path.join(root, "t1p2d2-pipedream", "iter_0000002")], cache,
                      after_load=lambda t: loaded.append(t.engine.executor.calls))
    return loaded[0], losses


def _logged(trainer, losses):
    """Losses of the ranks that own a distinct slice of the batch's loss (last stage, tensor rank 0)."""
    return losses if trainer.ps.is_last_stage and trainer.ps.tp_rank == 0 else None


def _reshard(root, cache):
    saved = os.path.join(root, "t2p2d1")
    trainer, losses = train(NO_DROPOUT + layout_flags(2, 2) + ["--save", saved, "--save-interval", "2"], cache)
    results = {"t2p2d1": _logged(trainer, losses[2:])}
    for name, (t, p) in RESHARD_TARGETS.items():
        trainer, losses = train(NO_DROPOUT + layout_flags(t, p) + ["--load", os.path.join(saved, "iter_0000002")],
                                cache)
        results[name] = _logged(trainer, losses)
    # the V placement: a looped checkpoint loads into it, and its own checkpoint into the looped interleaving
    trainer, losses = train(NO_DROPOUT + layout_flags(2, 2, "zbv") + ["--load", os.path.join(saved, "iter_0000002")],
                            cache)
    results["t2p2d1-v-from-looped"] = _logged(trainer, losses)
    saved_v = os.path.join(root, "t2p2d1-v")
    trainer, losses = train(NO_DROPOUT + layout_flags(2, 2, "zbv") + ["--save", saved_v, "--save-interval", "2"],
                            cache)
    results["t2p2d1-v"] = _logged(trainer, losses[2:])
    trainer, losses = train(NO_DROPOUT + layout_flags(2, 2, "interleaved") +
                            ["--load", os.path.join(saved_v, "iter_0000002")], cache)
    results["t2p2d1-looped-from-v"] = _logged(trainer, losses)
    return results


def _four_rank_world(rank, world_size, root, cache):
    resumed = _resume(os.path.join(root, "resume"), cache)
    return resumed, _reshard(os.path.join(root, "reshard"), cache), _dropped_in_flight(os.path.join(root, "resume"),
                                                                                       cache)


def _one_rank_world(rank, world_size, root, cache):
    direct = train(NO_DROPOUT + ["--load", os.path.join(root, "reshard", "t2p2d1", "iter_0000002")], cache)[1]
    converted = train(NO_DROPOUT + ["--load", os.path.join(root, "converted")], cache)[1]
    fp16 = os.path.join(root, "fp16")  # fp32 masters and the dynamic loss scaler come back too
    flags = ["--fp16", "--initial-loss-scale", "1024", "--train-iters", "4"]
    uninterrupted = train(flags + ["--save", fp16, "--save-interval", "2"], cache)[1]
    resumed = train(flags + ["--load", os.path.join(fp16, "iter_0000002")], cache)[1]
    return direct, converted, (uninterrupted, uninterrupted, resumed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root, cache = str(tmp_path_factory.mktemp("resume")), session_cache(tmp_path_factory)
    four = run_distributed(4, _four_rank_world, root, cache, timeout=900)
    conversion = reshard(os.path.join(root, "reshard", "t2p2d1", "iter_0000002"), os.path.join(root, "converted"),
                         SavedLayout(1, 1, 1))
    direct, converted, fp16 = run_distributed(1, _one_rank_world, root, cache, timeout=600)[0]
    resumed = {name: [resume[name] for resume, _, _ in four] for name in four[0][0]}  # case -> per-rank results
    resumed["fp16"] = [fp16 + (True, 0)]
    by_layout = {name: [r[name] for _, r, _ in four if r[name] is not None] for name in four[0][1]}
    by_layout["t1p1d1"] = [direct]
    dropped = [d for _, _, d in four]
    return resumed, by_layout, converted, conversion, dropped, root


@pytest.mark.parametrize("name", [name for name, _ in resume_cases()] + ["fp16"])
def test_resumed_steps_repeat_the_uninterrupted_run_bit_for_bit(runs, name):
    for rank, (never_saved, saving, resumed, last_stage, _) in enumerate(runs[0][name]):
        assert len(never_saved) == 4 and len(resumed) == 2
        assert saving == never_saved, f"rank {rank}: saving a checkpoint changed the run"
        assert resumed == never_saved[2:], f"rank {rank}"
        if last_stage:
            assert all(resumed), f"rank {rank} is a last stage but recorded no losses"


@pytest.mark.parametrize("name", [name for name, _ in resume_cases() if name.endswith(ASYNCHRONOUS)])
def test_asynchronous_checkpoints_resume_with_forwards_in_flight(runs, name):
    # a first stage holds forwards whose backwards come in the next batch; they were replayed
    in_flight = [loaded for _, _, _, _, loaded in runs[0][name]]
    assert max(in_flight) > 0, in_flight


def test_in_flight_microbatches_of_another_batch_split_are_dropped_and_training_goes_on(runs):
    for calls_after_load, losses in runs[4]:
        assert calls_after_load == 0  # the pipeline starts empty
        assert len(losses) == 2


def _step_means(rank_losses):
    """Mean loss of each step over every microbatch of the global batch (all data-parallel ranks)."""
    return [sum(sum(step, [])) / sum(len(part) for part in step) for step in zip(*rank_losses)]


@pytest.mark.parametrize("layout", ["t1p4d1", "t4p1d1", "t1p1d4", "t1p1d1", "t2p2d1-v-from-looped", "t2p2d1-v",
                                    "t2p2d1-looped-from-v"])
def test_next_steps_after_loading_in_another_layout_match_the_saving_layout(runs, layout):
    by_layout = runs[1]
    expected, actual = _step_means(by_layout["t2p2d1"]), _step_means(by_layout[layout])
    assert len(actual) == len(expected) == 2
    assert actual == pytest.approx(expected, rel=RTOL, abs=0)


def test_offline_reshard_loads_to_the_same_run(runs):
    _, by_layout, converted, conversion, _, _ = runs
    assert converted == by_layout["t1p1d1"][0]  # same values, same layout: bit for bit
    assert conversion.source_layout == SavedLayout(2, 2, 1) and conversion.target_layout == SavedLayout(1, 1, 1)
    assert conversion.tensors > 0 and conversion.bytes > 0


def test_offline_reshard_between_placements_keeps_every_tensor(runs, tmp_path):
    # ZBV's checkpoint (V: rank 0 saves stages 0 and 3, i.e. layers 0 and 3 and both tied copies as one
    # tensor) rewritten for the looped interleaving and back: every tensor, optimizer state included, as saved
    source = os.path.join(runs[5], "reshard", "t2p2d1-v", "iter_0000002")
    _, common, saved = read_checkpoint(source)
    assert common.layout == SavedLayout(2, 2, 1, 2, placement="v")
    def layers_of_rank0(layout):
        pieces = rank_pieces(common.kind, common.model_config, layout, 0, saved)
        return {int(key.split(".")[1]) for key in pieces if key.startswith("model/layers.")}

    assert layers_of_rank0(common.layout) == {0, 3}  # the V: stages 0 and 2p - 1
    assert layers_of_rank0(SavedLayout(2, 2, 1, 2)) == {0, 2}  # looped: stages 0 and p
    looped = reshard(source, str(tmp_path / "looped"), SavedLayout(2, 2, 1, 2)).target
    back = reshard(looped, str(tmp_path / "v"), SavedLayout(2, 2, 1, 2, placement="v")).target
    _, _, round_trip = read_checkpoint(back)
    kept = {key for key in saved if not is_rank_local(key)}
    assert set(round_trip) == kept
    for key in kept:
        assert torch.equal(round_trip[key], saved[key]), key
