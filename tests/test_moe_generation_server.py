"""The text-generation server with a Mixtral's experts split over 2 ranks (torchrun, e = 2).

A small random transformers Mixtral is imported (saved at e = 1) and served with
``--expert-model-parallel-size 2``: each rank loads half of every layer's experts and the tokens
travel to them by all-to-all. Greedy answers equal transformers' ``generate`` token for token. An
expert size that does not divide the experts is refused in one sentence before any process group.
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


def test_a_server_at_expert_size_2_answers_like_transformers(mixtral):
    model, checkpoint = mixtral
    prompts = ["the cat sat", "a dog ran far away and"]
    with serving(checkpoint, "--expert-model-parallel-size", "2", nproc=2) as (url, _):
        status, answer = _put(url, {"prompts": prompts, "tokens_to_generate": 6, "temperature": 0.0})
    assert status == 200
    assert answer["tokens"] == [_expected(model, p, 6) for p in prompts]


def test_an_expert_size_that_does_not_divide_the_experts_is_one_sentence(mixtral):
    parser = argparse.ArgumentParser()
    layout_flags(parser)
    args = parser.parse_args(["--load", mixtral[1], "--expert-model-parallel-size", "3"])
    with pytest.raises(ConfigError, match=r"^--num-experts 4 is not divisible by --expert-model-parallel-size 3;"):
        load_for_inference(args)
