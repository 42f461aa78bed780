"""Pretraining an MoE model with pretrain_gpt.py, and loading its checkpoint with other experts.

One run on one process trains every MoE feature at once (auxiliary and z losses, capacity with
dropping, expert bias, a gated shared expert, a dense layer among MoE ones, the grouped product):
its loss falls and each log line carries the MoE layer's routing statistics. The same run with the
experts split over 2 tensor ranks logs the same losses (1e-5), and so do runs at t = 2 whose experts are
whole (``--expert-tensor-parallel-size 1``) and split over 2 expert ranks, with and without sequence
parallelism, and so does t = 4 with each expert split over 2 tensor ranks (``--expert-tensor-parallel-size 2``)
and the experts over 2 expert ranks, whose checkpoint holds the single process's weights. At t = 2 with whole
experts and no expert parallelism (each tensor rank dispatching half the tokens) the losses are the same again,
and the checkpoint of its third iteration trains on at t = 1 with the single process's losses. Loading a
checkpoint with another
``--num-experts`` stops before training with one sentence naming the flag and both values.
"""

import re

import pytest
import torch
from test_training_cli import TINY, losses, run

from megapipe.checkpointing.offline import read_checkpoint
from megapipe.checkpointing.paths import LATEST

pytestmark = pytest.mark.system

MOE = ["--num-layers", "2", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-z-loss-coeff", "0.001", "--moe-expert-capacity-factor", "1.0", "--moe-router-enable-expert-bias",
       "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-layer-freq", "1,0",
       "--moe-grouped-gemm"]
TENSOR_LAYOUTS = (  # on 2 ranks: the experts' ffn split over both; or whole, one expert rank each, each rank
    ["--tensor-model-parallel-size", "2"],  # dispatching half the tokens (with and without sequence parallelism)
    ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
     "--sequence-parallel"],
)


def test_moe_model_trains_on_any_tensor_size_and_its_checkpoint_names_a_different_expert_count(tmp_path):
    result = run(TINY + MOE + ["--save", str(tmp_path / "ckpt")], cache=tmp_path)
    assert result.returncode == 0, result.stderr
    values = losses(result.stdout)
    assert len(values) == 6 and values[6] < values[1]
    stats = re.findall(r"moe L0 tok (\d+)/(\d+)/(\d+) cv [\d.]+ drop (\d+) aux ([\d.]+)", result.stdout)
    assert len(stats) == 6 and "moe L1" not in result.stdout  # layer 1 is dense
    low, mean, high, dropped, aux = map(float, stats[0])
    assert low <= mean <= high <= 32  # capacity: ceil(2 x 32 tokens x 2 / 4 experts x 1.0) = 32
    assert mean == pytest.approx((2 * 32 * 2 - dropped) / 4, abs=0.5) and aux > 0

    for flags in TENSOR_LAYOUTS:
        parallel = run(TINY + MOE + flags, nproc=2, cache=tmp_path)
        assert parallel.returncode == 0, (flags, parallel.stderr)
        logged = losses(parallel.stdout)
        assert len(logged) == 6, flags
        for i, value in logged.items():  # the same routing, drops and bias updates on both ranks
            assert value == pytest.approx(values[i], rel=1e-5), (flags, i, value, values[i])

    # two shares of the tensor group, each of 2 ranks splitting its experts' ffn, each rank half the experts
    split = ["--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "2", "--expert-model-parallel-size",
             "2", "--save", str(tmp_path / "etp2")]
    four = run(TINY + MOE + split, nproc=4, cache=tmp_path)
    assert four.returncode == 0, four.stderr
    assert losses(four.stdout) == pytest.approx(values, rel=1e-5)
    weights, saved = (read_checkpoint(str(tmp_path / name))[2] for name in ("ckpt", "etp2"))
    for key in (key for key in weights if key.startswith("model/")):
        torch.testing.assert_close(saved[key], weights[key], rtol=0, atol=1e-4)

    # whole experts on each of 2 tensor ranks without expert parallelism, each rank dispatching half the tokens;
    # its checkpoint of iteration 3 trains on at t = 1 as the single process did
    whole = tmp_path / "t2-etp1"
    flags = ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--save", str(whole),
             "--save-interval", "3"]
    two = run(TINY + MOE + flags, nproc=2, cache=tmp_path)
    assert two.returncode == 0, two.stderr
    assert losses(two.stdout) == pytest.approx(values, rel=1e-5)
    (whole / LATEST).write_text("3")
    resumed = run(TINY + MOE + ["--load", str(whole)], cache=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(resumed.stdout) == pytest.approx({i: values[i] for i in (4, 5, 6)}, rel=1e-5)

    other = run(TINY + MOE + ["--num-experts", "8", "--load", str(tmp_path / "ckpt")], cache=tmp_path)
    assert other.returncode == 2
    assert other.stderr.count("error:") == 1 and "(checkpoint vs this run: --num-experts 4 vs 8)" in other.stderr
