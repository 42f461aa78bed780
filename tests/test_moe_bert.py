"""pretrain_bert.py with MoE layers (``--num-experts``) and their experts split over 2 expert ranks logs the
single process's masked-LM and sentence-order losses within 1e-5 (no capacity, auxiliary loss on)."""

import pytest
from test_training_cli import TINY, losses, run

pytestmark = pytest.mark.system

MOE = ["--num-layers", "2", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01"]


def test_bert_with_experts_at_two_expert_ranks_logs_the_single_process_losses(tmp_path):
    runs = [run(TINY + MOE + flags, nproc=nproc, cache=tmp_path, script="pretrain_bert.py")
            for flags, nproc in (([], None), (["--expert-model-parallel-size", "2"], 2))]
    for result in runs:
        assert result.returncode == 0, result.stderr
    assert "moe L1 tok" in runs[1].stdout  # the layers are MoE layers
    for name in ("lm loss", "sop loss"):
        expected, got = (losses(result.stdout, name) for result in runs)
        assert len(got) == 6 and got.keys() == expected.keys(), name
        for i, value in got.items():
            assert value == pytest.approx(expected[i], rel=1e-5), (name, i, value, expected[i])
