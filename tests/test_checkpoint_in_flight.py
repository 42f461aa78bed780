"""Asynchronous pipelines resume with their microbatches in flight, in the layouts where that state
is richest: interleaved 2BW (tensors handed between a rank's own chunks, messages that wrap
around the pipeline), PipeDream's "2-1" plan under 1F1B-RR (replicated first stage, every rank
reads the whole batch), and PipeDream with vertical sync on 4 stages (3 versions stashed on
the first stage, version tags that travel with each microbatch).

Each case trains 4 steps without saving, then 4 steps saving at step 2, then resumes from that
checkpoint for steps 3-4: the saving run must equal the run that never saved, and the resumed
steps must equal its steps 3-4, per microbatch loss and bit for bit (dropout on: the replayed
forwards need their own random states, and the run its own). ``test_checkpoint_resume.py``
covers the straight pipelines with tensor and data parallelism.
"""

import os

import pytest

from checkpoint_helpers import layout_flags, session_cache, train
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.timeout(600)

CASES = {
    "2bw-interleaved": (2, layout_flags(1, 2, "2bw") + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    "pipedream-2-1": (3, ["--pipeline-stages", "0:1x2,1:4x1", "--pipeline-schedule", "pipedream",
                          "--untie-embeddings-and-output-weights"]),
    "pipedream-vertical-sync-p4": (4, layout_flags(1, 4, "pipedream") + ["--pipedream-vertical-sync"]),
}


def _three_runs(rank, world_size, root, cache, flags):
    never_saved = train(flags + ["--train-iters", "4"], cache)[1]
    directory = os.path.join(root, "ckpt")
    saving = train(flags + ["--train-iters", "4", "--save", directory, "--save-interval", "2"], cache)[1]
    in_flight = []
    resumed = train(flags + ["--train-iters", "4", "--load", os.path.join(directory, "iter_0000002")], cache,
                    after_load=lambda trainer: in_flight.append(len(trainer.engine.executor.state.saved)))[1]
    return never_saved, saving, resumed, in_flight[0]


@pytest.mark.parametrize("name", list(CASES))
def test_resume_with_microbatches_in_flight_repeats_the_run_that_never_saved(name, tmp_path, tmp_path_factory):
    world, flags = CASES[name]
    ranks = run_distributed(world, _three_runs, str(tmp_path), session_cache(tmp_path_factory), flags, timeout=500)
    for rank, (never_saved, saving, resumed, _) in enumerate(ranks):
        assert saving == never_saved, f"rank {rank}: saving a checkpoint changed the run"
        assert len(resumed) == 2 and resumed == never_saved[2:], f"rank {rank}"
    assert any(losses for _, _, resumed, _ in ranks for losses in resumed)  # a last stage logged them
    assert max(in_flight for *_, in_flight in ranks) > 0  # forwards were replayed, not a drained pipeline
