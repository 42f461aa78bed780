"""A checkpoint saved with the experts split over 2 expert ranks resumes bit for bit at 2 (the routers'
expert biases, buffers moved outside the gradient, are part of it), and loads on one process (all experts
on one rank, each under its global index), on 4 expert ranks (one expert each) and at t = 2 with whole experts
on 2 expert ranks (--expert-tensor-parallel-size 1), where training goes on with the same losses within 1e-5
(the same sums in another order)."""

import pytest
from test_training_cli import TINY, losses, run

from megapipe.checkpointing.paths import LATEST

pytestmark = pytest.mark.system

MOE = ["--num-layers", "2", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-enable-expert-bias", "--moe-shared-expert-intermediate-size", "32"]
SPLIT = ["--expert-model-parallel-size", "2"]


def test_a_checkpoint_saved_at_two_expert_ranks_trains_on_at_one_and_four(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(TINY + MOE + SPLIT + ["--save", str(ckpt), "--save-interval", "3"], nproc=2, cache=tmp_path)
    assert first.returncode == 0, first.stderr
    (ckpt / LATEST).write_text("3")  # resume from the middle of the run
    resumed = {}
    for name, flags, nproc in (("split", SPLIT, 2), ("whole", [], None),
                               ("e4", ["--expert-model-parallel-size", "4"], 4),
                               ("t2-etp1", SPLIT + ["--tensor-model-parallel-size", "2",
                                                    "--expert-tensor-parallel-size", "1"], 2)):
        result = run(TINY + MOE + flags + ["--load", str(ckpt)], nproc=nproc, cache=tmp_path)
        assert result.returncode == 0, result.stderr
        resumed[name] = losses(result.stdout)
    unbroken = losses(first.stdout)
    assert resumed["split"] == {i: unbroken[i] for i in (4, 5, 6)}
    for name in ("whole", "e4", "t2-etp1"):
        assert sorted(resumed[name]) == [4, 5, 6], name
        for i, value in resumed[name].items():
            assert value == pytest.approx(resumed["split"][i], rel=1e-5), (name, i, value, resumed["split"][i])
