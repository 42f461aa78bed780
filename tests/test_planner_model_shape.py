"""The planner prices the shape the model family describes: a Llama is not a GPT of the same size.

FLOPs are checked against a count of the matrix products by hand and against the family's
``flops``; a GPT profile is refused for a Llama; the cluster service's re-layout prices the job's
own shape.
"""

import dataclasses
import json

import pytest

from megapipe.cluster.service.job_spec import parse_job
from megapipe.cluster.service.relayout import _shape
from megapipe.config import ModelConfig
from megapipe.cli.parse import parse_config
from megapipe.errors import ConfigError
from megapipe.models.families import family, family_of
from megapipe.models.shape import ModelShape
from megapipe.planner import analytic
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import Candidate, PlanCostModel, Training, model_flops_per_sample
from megapipe.planner.profile import ModelProfile

pytestmark = pytest.mark.unit

SIZES = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=160, seq_length=32, vocab_size=1000)
LLAMA = family("llama").model_config(num_query_groups=2, **SIZES)
GPT = ModelConfig(**SIZES, untie_embeddings_and_output_weights=True)  # a Llama's untied head, a GPT's layers


def shapes() -> tuple[ModelShape, ModelShape]:
    return ModelShape.from_config("gpt", LLAMA), ModelShape.from_config("gpt", GPT)


def test_llama_flops_are_the_matrix_products_counted_by_hand():
    """Per token and layer, forward, with h = 64, 2 key/value heads of 16 (h_kv = 32), f = 160, s = 32:
    query 2 h h = 8192, keys and values 2 x 2 h h_kv = 8192, scores q k^T 2 s h = 4096, scores x values
    2 s h = 4096, output projection 2 h h = 8192, SwiGLU gate and up 2 x 2 h f = 40960, down 2 f h = 20480:
    92160. The logits: 2 h V with V = 1000 padded to 1024: 131072. A training step runs 3 passes (forward,
    and a backward of twice its cost), 4 with full recomputation (the logits are never recomputed); over
    the 32 tokens of a sample and 2 layers."""
    per_token_layer = 8192 + 8192 + 4096 + 4096 + 8192 + 40960 + 20480
    logits = 2 * 64 * 1024
    for recompute, passes in ((False, 3), (True, 4)):
        by_hand = 32 * (passes * 2 * per_token_layer + 3 * logits)
        assert family_of("gpt", LLAMA).flops(LLAMA, 1, recompute) == by_hand
        assert ModelShape.from_config("gpt", LLAMA).flops_per_sample(recompute) == by_hand


@pytest.mark.parametrize("config", [LLAMA, GPT], ids=["llama", "gpt"])
def test_every_planner_flops_figure_is_the_familys(config):
    shape = ModelShape.from_config("gpt", config)
    profile = analytic_gpt_profile(shape, 1e12, micro_batch_sizes=(1, 2))
    layers = sum(analytic.block_forward_flops(shape, 1, layer) for layer in range(shape.num_layers))
    for recompute, passes in ((False, 3), (True, 4)):
        flops = family_of("gpt", config).flops(config, 1, recompute)
        assert model_flops_per_sample(profile, recompute) == flops
        assert passes * layers + 3 * analytic.head_forward_flops(shape, 1) == flops


def test_a_llama_and_a_gpt_of_the_same_size_cost_differently():
    """Same layers, width, heads and ffn: the Llama's SwiGLU adds a third ffn matrix and its two key/value
    heads halve the key and value projections, so its blocks take longer and hold more parameters; the
    estimates differ."""
    llama, gpt = shapes()
    assert (llama.swiglu, llama.query_groups, llama.normalization) == (True, 2, "RMSNorm")
    assert (gpt.swiglu, gpt.query_groups, gpt.normalization) == (False, 4, "LayerNorm")
    h, f, h_kv = 64, 160, 32
    llama_block = analytic.block_forward_flops(llama, 1, 0)
    gpt_block = analytic.block_forward_flops(gpt, 1, 0)
    assert llama_block - gpt_block == 32 * (2 * h * f - 2 * 2 * h * (h - h_kv))  # one more ffn matrix, smaller k, v
    assert analytic.block_params(llama, 0)[0] == h * (h + 2 * h_kv) + h * h + 3 * h * f + 2 * h  # no biases
    # the activation's input is SwiGLU's gate and up (2 f wide) and keys and values are h_kv wide
    e, s = 2, 32
    core = analytic.attention_core_bytes(llama, 1, e)
    assert analytic.block_stash_bytes(llama, 1, e, 0)[1] == e * s * (h + 2 * h_kv + h) + e * s * 3 * f + core
    cluster = Cluster(nodes=1, gpus_per_node=2, memory_per_gpu=2 ** 34, intra_node_bandwidth=1e10,
                      inter_node_bandwidth=1e9)
    candidate = Candidate(1, 2, 1, 2, "1f1b")
    llama_estimate, gpt_estimate = (PlanCostModel(analytic_gpt_profile(shape, 1e12, micro_batch_sizes=(1, 2, 4)),
                                                  cluster, Training(8)).estimate(candidate) for shape in (llama, gpt))
    assert llama_estimate.samples_per_second < gpt_estimate.samples_per_second
    assert llama_estimate.memory > gpt_estimate.memory  # the third ffn matrix and its wider activation


def test_a_gpt_profile_is_refused_for_a_llama_of_the_same_size(tmp_path):
    """The profile of a GPT with llama-tiny's sizes and untied head (the profile's vocabulary is taken)."""
    path = tmp_path / "gpt.json"
    gpt_tiny = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=8, ffn_hidden_size=352, seq_length=128,
                           vocab_size=50, untie_embeddings_and_output_weights=True)
    analytic_gpt_profile(ModelShape.from_config("gpt", gpt_tiny), 1e12).save(path)
    llama_flags = ["--model-preset", "llama-tiny", "--mock-data", "--vocab-size", "1000", "--micro-batch-size", "1",
                   "--global-batch-size", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto",
                   "--schedule-profile", str(path)]
    with pytest.raises(ConfigError) as refused:
        parse_config("gpt", llama_flags, world_size=2)
    assert str(refused.value) == (f"profile {path} was measured for a model with swiglu False, but the model to plan "
                                  "has swiglu True; profile this model with tools/profile_model.py.")


def test_a_profile_older_than_the_shape_fields_reads_as_a_gpt(tmp_path):
    data = analytic_gpt_profile(ModelShape.from_config("gpt", GPT), 1e12, micro_batch_sizes=(1,)).to_dict()
    first_fields = ("kind", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                    "ffn_hidden_size", "tied_embeddings")
    data["model"] = {name: data["model"][name] for name in first_fields}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert ModelProfile.load(path, ModelShape.from_config("gpt", GPT)).shape == ModelShape.from_config("gpt", GPT)
    with pytest.raises(ConfigError, match="profile this model with tools/profile_model.py"):
        ModelProfile.load(path, ModelShape.from_config("gpt", LLAMA))


def test_relayout_prices_the_jobs_own_shape():
    """A Llama job: its SwiGLU width (352, not 4h), two key/value heads and untied head, and the vocabulary of
    the run's tokenizer (--mock-data's 1000 ids and an end-of-document id)."""
    spec = parse_job(["pretrain_gpt.py", "--model-preset", "llama-tiny", "--mock-data", "--vocab-size", "1000",
                      "--micro-batch-size", "1", "--global-batch-size", "4"])
    shape = _shape(spec)
    assert shape == ModelShape.from_config("gpt", dataclasses.replace(spec.config.model, vocab_size=1001))
    assert (shape.ffn_hidden_size, shape.query_groups, shape.swiglu, shape.tied_embeddings) == (352, 2, True, False)
    assert shape.padded_vocab_size == 1024
