"""The text-generation server with a Mixtral's experts split over 2 ranks (torchrun, e = 2) that are also its
2 tensor ranks (t = 2, whole experts: ``--expert-tensor-parallel-size 1``).

A small random transformers Mixtral is imported (saved at e = 1) and served with
``--expert-model-parallel-size 2``: each rank loads half of every layer's experts whole, takes half of
the tokens (the whole of a one-sequence decoding step on one rank, none on the other) to them by
all-to-all, and the halves' outputs are summed over the tensor group. Greedy answers, for two prompts
at once and for one, equal transformers' ``generate`` token for token. An expert size that does not
divide the experts, and an expert-tensor size that does not divide t, are refused in one sentence
before any process group.
"""

import argparse

import pytest
from server_helpers import serving, tiny_checkpoint
from test_generation_server import _expected, _put

from megapipe.errors import ConfigError
from megapipe.inference.loading import layout_flags, load_for_inference

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("moe-server"), "mixtral")


def test_a_server_at_expert_size_2_with_whole_experts_on_2_tensor_ranks_answers_like_transformers(mixtral):
    model, checkpoint = mixtral
    prompts = ["the cat sat", "a dog ran far away and"]
    layout = ("--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
              "--expert-tensor-parallel-size", "1")
    with serving(checkpoint, *layout, nproc=2) as (url, _):
        answers = [_put(url, {"prompts": batch, "tokens_to_generate": 6, "temperature": 0.0})
                   for batch in (prompts, prompts[:1])]
    for batch, (status, answer) in zip((prompts, prompts[:1]), answers):
        assert status == 200
        assert answer["tokens"] == [_expected(model, p, 6) for p in batch]


@pytest.mark.parametrize("flags, message", [
    (("--expert-model-parallel-size", "3"), r"^--num-experts 4 is not divisible by --expert-model-parallel-size 3;"),
    (("--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "3"),
     r"^--expert-tensor-parallel-size 3 does not divide --tensor-model-parallel-size 2:"),
])
def test_expert_sizes_that_do_not_fit_are_one_sentence(mixtral, flags, message):
    parser = argparse.ArgumentParser()
    layout_flags(parser)
    args = parser.parse_args(["--load", mixtral[1], *flags])
    with pytest.raises(ConfigError, match=message):
        load_for_inference(args)
