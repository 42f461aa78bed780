"""Profiles: the measured one against the model's exact sizes, the closed-form one against seed 002's
formulas, the JSON format and its errors, and cluster descriptions."""

import json
import math

import numpy as np
import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.planner.analytic import analytic_gpt_profile, block_params, block_stash_bytes
from megapipe.planner.cluster import Cluster
from megapipe.planner.presets import MODELS, parameter_count
from megapipe.planner.profile import ModelProfile, ModelShape, interpolate
from megapipe.planner.profiler import profile_model

pytestmark = pytest.mark.unit

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, seq_length=16,
              make_vocab_size_divisible_by=32)


@pytest.fixture(scope="module")
def measured():
    torch.set_num_threads(1)
    return profile_model("gpt", ModelConfig(**CONFIG), (1, 2), iterations=2, warmup=1)


def test_measured_profile_has_the_models_exact_sizes(measured):
    config = ModelConfig(**CONFIG)
    s, h, v = config.seq_length, config.hidden_size, config.padded_vocab_size(1)
    shape = measured.shape
    assert [layer.kind for layer in measured.layers] == ["embedding", "block", "block", "head"]
    assert measured.layers[0].params == v * h + s * h
    assert measured.layers[0].split_params == v * h
    for layer, block in enumerate(measured.layers[1:3]):
        assert (block.params, block.split_params) == block_params(shape, layer)  # 12h^2 + 13h, split 12h^2 + 7h
        assert block.output_bytes == (4 * s * 1 * h, 4 * s * 2 * h)  # fp32 [s, b, h]
        assert 0 < block.split_stash_bytes[0] < block.stash_bytes[0]
        assert block.stash_bytes[1] > block.stash_bytes[0]
    assert measured.layers[-1].params == 2 * h  # final norm; the output weight is the tied embedding
    assert measured.output_weight_params == v * h
    # the head keeps the fp32 logits of every vocabulary entry: the part tensor parallelism splits
    assert measured.layers[-1].split_stash_bytes[0] >= 4 * s * v
    for layer in measured.layers:
        assert all(x > 0 for x in layer.forward_s + layer.backward_s + layer.recompute_backward_s)
    assert measured.layers[0].recompute_backward_s == measured.layers[0].backward_s  # only blocks recompute
    assert measured.optimizer_step_s_per_param > 0


def test_profile_round_trips_through_json(measured, tmp_path):
    path = tmp_path / "profile.json"
    measured.save(path)
    assert ModelProfile.load(path, expected=measured.shape) == measured


def test_profile_missing_field_is_named(measured, tmp_path):
    data = measured.to_dict()
    del data["layers"][2]["stash_bytes"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"lacks the field layers\[2\]\.stash_bytes; re-create it"):
        ModelProfile.load(path)
    data = measured.to_dict()
    del data["model"]["hidden_size"]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"lacks the field model\.hidden_size"):
        ModelProfile.load(path)


def test_profile_of_another_model_is_refused(measured, tmp_path):
    path = tmp_path / "profile.json"
    measured.save(path)
    other = ModelShape.from_config("gpt", ModelConfig(**{**CONFIG, "hidden_size": 64}))
    with pytest.raises(ConfigError, match="hidden_size 32, but the model to plan has hidden_size 64"):
        ModelProfile.load(path, expected=other)


def test_interpolation_is_piecewise_linear_and_extends_the_end_segments():
    sizes = np.array([1.0, 2.0, 4.0])
    values = np.array([[3.0], [5.0], [8.0]])  # overhead 1 + 2 per sample, then 1.5 per sample
    assert interpolate(sizes, values, 2.0)[0] == 5.0
    assert interpolate(sizes, values, 3.0)[0] == 6.5
    assert interpolate(sizes, values, 8.0)[0] == 14.0
    assert interpolate(sizes, values, 0.5)[0] == 2.0
    steep = np.array([[1.0], [5.0], [9.0]])  # a noisy first point: the line would cross zero at b = 0.75
    assert interpolate(sizes, steep, 0.5)[0] == 0.5  # its proportional share instead
    assert interpolate(np.array([2.0]), np.array([[6.0]]), 3.0)[0] == 9.0


def test_analytic_profile_follows_eq_4_2_and_the_activation_count():
    shape = ModelShape("gpt", 4, 256, 8, 128, 1000, 1024)
    flops, half = 1e12, 100.0
    profile = analytic_gpt_profile(shape, flops, micro_batch_sizes=(1, 2), half_tokens=half)
    s, h, a, V = 128, 256, 8, 1000
    padded = 1024  # the logits run over the vocabulary padded to a multiple of 128, as the model's family counts
    for index, b in enumerate((1, 2)):
        efficiency = b * s / (b * s + half)
        block = profile.layers[1]
        forward = (24 * b * s * h * h + 4 * b * s * s * h) / (flops * efficiency)
        assert block.forward_s[index] == pytest.approx(forward, rel=1e-12)
        assert block.backward_s[index] == pytest.approx(2 * forward, rel=1e-12)
        assert block.recompute_backward_s[index] == pytest.approx(3 * forward, rel=1e-12)
        head = profile.layers[-1]
        head_seconds = 6 * b * s * h * padded / (flops * efficiency)
        assert head.forward_s[index] + head.backward_s[index] == pytest.approx(head_seconds)
        # 16-bit activations: s b h (34 + 5 a s / h), of which 24 s b h + 5 a s^2 b split by t
        assert block.stash_bytes[index] == s * b * h * (34 + 5 * a * s / h)
        assert block.split_stash_bytes[index] == 24 * s * b * h + 5 * a * s * s * b
    assert block_stash_bytes(shape, 1, 2, 0)[0] == s * h * (34 + 5 * a * s / h)
    total = sum(layer.params for layer in profile.layers)
    assert total == parameter_count(shape) + 2 * h  # eq. 4.3 leaves out the final norm


@pytest.mark.parametrize("tied", [True, False])
def test_analytic_parameters_are_the_models(tied):
    config = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                         untie_embeddings_and_output_weights=not tied)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    profile = analytic_gpt_profile(ModelShape.from_config("gpt", config), 1e12, micro_batch_sizes=(1,))
    assert sum(layer.params for layer in profile.layers) == sum(p.numel() for p in model.parameters())
    assert profile.layers[-1].split_params == (0 if tied else 256 * 64)  # the output weight splits over t


def test_preset_shapes_have_the_named_sizes():
    expected = {"gpt-355m": 0.355e9, "gpt-1.3b": 1.3e9, "gpt-2.2b": 2.2e9, "gpt-3.8b": 3.8e9}
    for name, size in expected.items():
        assert parameter_count(MODELS[name]) == pytest.approx(size, rel=0.04)
    # eq. 4.3 golden values from the seeds' models
    assert parameter_count(ModelShape("gpt", 96, 12288, 96, 2048, 51200, 4 * 12288)) == pytest.approx(174.6e9, rel=2e-3)
    assert parameter_count(ModelShape("gpt", 32, 3840, 32, 2048, 51200, 4 * 3840)) == pytest.approx(5.87e9, rel=2e-3)


def test_cluster_descriptions(tmp_path):
    good = {"nodes": 2, "gpus_per_node": 4, "memory_per_gpu": 16e9, "intra_node_bandwidth": 1e11,
            "inter_node_bandwidth": 1e10}
    cluster = Cluster.from_dict(good)
    assert cluster.num_gpus == 8
    assert cluster.link([0, 3]).bandwidth == 1e11 and cluster.link([3, 4]).bandwidth == 1e10
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({**good, "gpus_per_node": 0}))
    with pytest.raises(ConfigError, match="cluster zero has gpus_per_node 0; it must be a whole number of at least 1"):
        Cluster.load(path)
    with pytest.raises(ConfigError, match="lacks inter_node_bandwidth"):
        Cluster.from_dict({k: v for k, v in good.items() if k != "inter_node_bandwidth"})
    with pytest.raises(ConfigError, match="unknown keys gpus"):
        Cluster.from_dict({**good, "gpus": 3})
    with pytest.raises(ConfigError, match="memory_per_gpu 0"):
        Cluster.from_dict({**good, "memory_per_gpu": 0})
    assert math.isclose(Cluster.from_dict({**good, "reserved_memory": 1e9}).usable_memory, 15e9)


def test_the_profile_tools_defaults_fit_the_default_training_run(tmp_path):
    """The README's recipe: ``tools/profile_model.py --output F`` with no model flags, then the default
    run at p = 2 with ``--pipeline-schedule auto --schedule-profile F``: the run's checks before and
    after the tokenizer gives the vocabulary (``Trainer``) accept the profile."""
    import importlib.util
    from pathlib import Path

    from megapipe.cli.parse import parse_config
    from megapipe.data.rank_data import run_tokenizer
    from megapipe.cli.selection import searched_schedule

    spec = importlib.util.spec_from_file_location("profile_tool", Path(__file__).parents[1] / "tools" / "profile_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = str(tmp_path / "gpt.profile.json")
    assert tool.main(["--output", path, "--iterations", "1", "--warmup", "0"]) == 0
    config = parse_config("gpt", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "auto",
                                  "--schedule-profile", path], world_size=2)
    config.model.vocab_size = run_tokenizer("gpt", config).vocab_size  # as the trainer does
    assert searched_schedule("gpt", config, 2, config.training.num_microbatches(1), 1).schedule.actions
