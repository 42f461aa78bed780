"""A checkpoint saved with the experts split over 2 expert ranks loads on one process (all experts on one
rank, each under its global index) and training goes on with the losses of the same resume at 2 expert ranks.

A world of 4 (e = 4) is left out: four training processes on the CI's two cores cost more than they show
beyond e = 1, which already reassembles both ranks' slices into whole tensors."""

import pytest
from test_training_cli import TINY, losses, run

from megapipe.checkpointing.paths import LATEST

pytestmark = pytest.mark.system

MOE = ["--num-layers", "2", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-enable-expert-bias", "--moe-shared-expert-intermediate-size", "32"]
SPLIT = ["--expert-model-parallel-size", "2"]


def test_a_checkpoint_saved_at_two_expert_ranks_trains_on_at_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(TINY + MOE + SPLIT + ["--save", str(ckpt), "--save-interval", "3"], nproc=2, cache=tmp_path)
    assert first.returncode == 0, first.stderr
    (ckpt / LATEST).write_text("3")  # resume from the middle of the run
    resumed = {}
    for name, flags, nproc in (("split", SPLIT, 2), ("whole", [], None)):
        result = run(TINY + MOE + flags + ["--load", str(ckpt)], nproc=nproc, cache=tmp_path)
        assert result.returncode == 0, result.stderr
        resumed[name] = losses(result.stdout)
    assert sorted(resumed["whole"]) == [4, 5, 6]
    for i, value in resumed["whole"].items():
        assert value == pytest.approx(resumed["split"][i], rel=1e-5), (i, value, resumed["split"][i])
