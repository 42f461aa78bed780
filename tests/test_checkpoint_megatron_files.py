"""Megatron checkpoints without Megatron-core: a legacy torch checkpoint written from a megapipe model's weights
(one rank, or split over (t, p) = (2, 2) under Transformer Engine's names) converts to megapipe, out to
torch_dist (layers stacked, or one key per layer as other versions write) and back in bit for bit; what
megapipe cannot read is one sentence and writes nothing; --use-checkpoint-args takes the imported shape.
(tests/test_checkpoint_megatron.py checks the maths against Megatron-core itself.)"""

import argparse
import dataclasses
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint_helpers import convert_tool
from megatron_core_helpers import save_legacy
from megapipe.checkpointing.common import SavedLayout
from megapipe.checkpointing.convert import export_megatron_checkpoint, import_megatron_checkpoint
from megapipe.checkpointing.megatron_names import fused_name, megatron_args, to_megatron
from megapipe.checkpointing.offline import read_checkpoint
from megapipe.config import ModelConfig
from megapipe.cli.checkpoint_args import SHAPE
from megapipe.cli.parse import config_from_argv
from megapipe.errors import CheckpointError, ConfigError
from megapipe.models import build_model_chunks
from megapipe.models.state_dict import canonical_name
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

CONFIG = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
                     vocab_size=128, seq_length=8, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                     add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _canonical(config: ModelConfig) -> dict:
    torch.manual_seed(0)
    chunk = build_model_chunks("gpt", config, ParallelState.single())[0]
    return {canonical_name(name, p): p.detach().clone() for name, p in chunk.named_parameters()}


def _legacy(root, config: ModelConfig, args: argparse.Namespace, tensors=None) -> str:
    """A one-rank legacy torch checkpoint of ``tensors`` (default: a fresh model's) under ``root``."""
    tensors = to_megatron(_canonical(config), config) if tensors is None else tensors
    os.makedirs(root / "iter_0000005" / "mp_rank_00")
    torch.save({"model": tensors, "args": args, "iteration": 5, "checkpoint_version": 3.0},
               root / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    return str(root)


def test_weights_go_through_torch_and_torch_dist_unchanged(tmp_path):
    source = _legacy(tmp_path / "legacy", CONFIG, megatron_args(CONFIG))
    import_megatron_checkpoint(source, str(tmp_path / "a"), SavedLayout(2, 1, 1))
    export_megatron_checkpoint(str(tmp_path / "a"), str(tmp_path / "dist"))
    import_megatron_checkpoint(str(tmp_path / "dist"), str(tmp_path / "b"), SavedLayout(1, 2, 1))
    original = _canonical(CONFIG)
    _, common, back = read_checkpoint(str(tmp_path / "b"))
    assert sorted(back) == sorted(f"model/{name}" for name in original)
    for name, value in original.items():
        assert torch.equal(back[f"model/{name}"], value), name
    config = common.model_config
    for field in ("num_layers", "hidden_size", "num_query_groups", "ffn_hidden_size", "swiglu", "normalization",
                  "position_embedding_type", "add_bias_linear", "untie_embeddings_and_output_weights", "vocab_size"):
        assert getattr(config, field) == getattr(CONFIG, field), field


@pytest.mark.parametrize("change, message", [
    (dict(multi_latent_attention=True),
     r"is a Megatron model with multi-latent attention \(multi_latent_attention=True\), which megapipe does not have"),
    (dict(position_embedding_type="yarn"), r"uses position embedding 'yarn', which megapipe does not have"),
    (dict(num_experts=8, moe_router_topk_scaling_factor=2.5),
     r"with scaled routing weights \(moe_router_topk_scaling_factor=2.5\)"),
    (dict(num_experts=8, expert_model_parallel_size=2),
     r"is a torch-format checkpoint of an expert-parallel run \(expert_model_parallel_size=2\)"),
])
def test_a_model_megapipe_lacks_is_one_sentence_and_writes_nothing(tmp_path, change, message):
    args = argparse.Namespace(**{**vars(megatron_args(CONFIG)), **change})
    source = _legacy(tmp_path / "legacy", CONFIG, args)
    with pytest.raises(CheckpointError, match=message):
        import_megatron_checkpoint(source, str(tmp_path / "out"), SavedLayout(1, 1, 1))
    assert not (tmp_path / "out").exists()


def test_an_moe_model_mixing_dense_layers_exports_its_layer_pattern_as_megatron_lm_parses_it():
    config = ModelConfig(**{**vars(CONFIG), "num_experts": 4, "moe_layer_freq": 2})
    assert megatron_args(config).moe_layer_freq == 2
    pattern = (0,) + (1,) * (config.num_layers - 1)
    assert megatron_args(dataclasses.replace(config, moe_layer_freq=pattern)).moe_layer_freq == list(pattern)


def test_a_tensor_without_a_place_is_named(tmp_path):
    tensors = to_megatron(_canonical(CONFIG), CONFIG)
    tensors["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 16)
    source = _legacy(tmp_path / "legacy", CONFIG, megatron_args(CONFIG), tensors)
    with pytest.raises(CheckpointError, match=r"holds 1 tensors megapipe has no place for \(first: "
                                              r"decoder.layers.0.mlp.router.weight\)"):
        import_megatron_checkpoint(source, str(tmp_path / "out"), SavedLayout(1, 1, 1))


def test_missing_files_are_named(tmp_path):
    source = _legacy(tmp_path / "legacy", CONFIG, megatron_args(CONFIG))
    import_megatron_checkpoint(source, str(tmp_path / "a"), SavedLayout(1, 1, 1))
    export_megatron_checkpoint(str(tmp_path / "a"), str(tmp_path / "dist"))
    shard = next(name for name in os.listdir(tmp_path / "dist" / "iter_0000000") if name.endswith(".distcp"))
    os.remove(tmp_path / "dist" / "iter_0000000" / shard)
    with pytest.raises(CheckpointError, match=rf"is missing 1 shard file\(s\) its .metadata names \({shard}\); copy"):
        import_megatron_checkpoint(str(tmp_path / "dist"), str(tmp_path / "b"), SavedLayout(1, 1, 1))
    assert not (tmp_path / "b").exists()
    os.rename(tmp_path / "legacy" / "iter_0000005" / "mp_rank_00", tmp_path / "legacy" / "iter_0000005" / "mp_rank_01")
    os.makedirs(tmp_path / "legacy" / "iter_0000005" / "mp_rank_00")
    with pytest.raises(CheckpointError, match=r"lacks model_optim_rng.pt of tensor rank 0, pipeline rank 0 \(its "
                                              r"files span \(t, p\) = \(2, 1\)\)"):
        import_megatron_checkpoint(source, str(tmp_path / "b"), SavedLayout(1, 1, 1))
    with pytest.raises(CheckpointError, match="is not a Megatron checkpoint: it has no latest_checkpointed_iteration"):
        import_megatron_checkpoint(str(tmp_path), str(tmp_path / "b"), SavedLayout(1, 1, 1))
    os.makedirs(tmp_path / "empty" / "iter_0000001")
    (tmp_path / "empty" / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(CheckpointError, match=r"iter_0000001 holds neither a torch_dist checkpoint \(metadata.json\)"):
        import_megatron_checkpoint(str(tmp_path / "empty"), str(tmp_path / "b"), SavedLayout(1, 1, 1))


def test_use_checkpoint_args_takes_the_imported_shape_and_refuses_a_contradiction(tmp_path):
    source = _legacy(tmp_path / "legacy", CONFIG, megatron_args(CONFIG))
    ckpt = str(tmp_path / "ckpt")
    import_megatron_checkpoint(source, ckpt, SavedLayout(1, 1, 1))
    flags = ["--load", ckpt, "--use-checkpoint-args", "--seq-length", "8"]
    model = config_from_argv("gpt", flags + ["--hidden-size", "16", "--disable-bias-linear"]).model
    assert {field: getattr(model, field) for field in SHAPE} == {field: getattr(CONFIG, field) for field in SHAPE}
    assert config_from_argv("gpt", ["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-model-parallel-size",
                                    "1"] + flags).parallel.virtual_pipeline == 2
    with pytest.raises(ConfigError, match=r"--hidden-size gives hidden_size 64 but the checkpoint .* has 16, and "
                                          r"--use-checkpoint-args takes the model's shape from it; drop the flag"):
        config_from_argv("gpt", flags + ["--hidden-size", "64"])
    with pytest.raises(ConfigError, match=r"--num-query-groups gives num_query_groups 4 but .* has 2"):
        config_from_argv("gpt", flags + ["--group-query-attention", "--num-query-groups", "4"])
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load DIR"):
        config_from_argv("gpt", ["--use-checkpoint-args"])


def test_convert_tool_imports_and_exports_megatron_and_errors_in_one_line(tmp_path, capsys):
    tool = convert_tool()
    source = _legacy(tmp_path / "legacy", CONFIG, megatron_args(CONFIG))
    assert tool.main(["import-megatron", source, str(tmp_path / "ckpt"), "--vocab-size", "100",
                      "--tensor-model-parallel-size", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"source:  {tmp_path / 'legacy' / 'iter_0000005'} (Megatron-LM torch, (t, p) = (1, 1), " \
                         "iteration 5)"
    assert printed[1] == f"target:  {tmp_path / 'ckpt' / 'iter_0000000'} ((t, p, d) = (2, 1, 1))"
    _, common, tensors = read_checkpoint(str(tmp_path / "ckpt"))
    assert common.model_config.vocab_size == 100 and tensors["model/output_embedding.weight"].shape == (100, 16)
    assert tool.main(["export-megatron", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == f"target:  {tmp_path / 'out' / 'iter_0000000'} (Megatron-LM " \
                                                      "torch_dist)"
    assert sorted(os.listdir(tmp_path / "out")) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert tool.main(["import-megatron", source, str(tmp_path / "bad"), "--vocab-size", "129"]) == 2
    assert capsys.readouterr().err == "error: --vocab-size 129 must be between 1 and the checkpoint's 128 embedding " \
                                      "rows.\n"
    assert not (tmp_path / "bad").exists()


class _StateOnly:
    """What ``save_legacy`` asks of a Megatron-core model: its state_dict."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_transformer_engine_names_split_over_ranks_and_per_layer_torch_dist_keys_read_alike(tmp_path):
    original = _canonical(CONFIG)
    state = {fused_name(name): value for name, value in to_megatron(original, CONFIG).items()}
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in state
    state["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.zeros(5, dtype=torch.uint8)
    save_legacy(_StateOnly(state), megatron_args(CONFIG), str(tmp_path / "te"), t=2, p=2)
    import_megatron_checkpoint(str(tmp_path / "te"), str(tmp_path / "a"), SavedLayout(1, 1, 1))
    export_megatron_checkpoint(str(tmp_path / "a"), str(tmp_path / "stacked"))
    stacked, per_layer = tmp_path / "stacked" / "iter_0000000", tmp_path / "per-layer" / "iter_0000000"
    tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for key, md in dcp.FileSystemReader(str(stacked)).read_metadata().state_dict_metadata.items()
               if "_extra_state" not in key}
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(stacked)), no_dist=True)
    unstacked = {}
    for key, value in tensors.items():
        rows = enumerate(value.unbind(0)) if key.startswith("decoder.layers.") else [(None, value)]
        for i, row in rows:
            unstacked[key if i is None else key.replace("decoder.layers.", f"decoder.layers.{i}.")] = row.clone()
    dcp.save(unstacked, storage_writer=dcp.FileSystemWriter(str(per_layer)), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(stacked / name, per_layer / name)
    import_megatron_checkpoint(str(per_layer), str(tmp_path / "b"), SavedLayout(1, 1, 1))
    for directory in ("a", "b"):
        _, _, back = read_checkpoint(str(tmp_path / directory))
        assert sorted(back) == sorted(f"model/{name}" for name in original), directory
        for name, value in original.items():
            assert torch.equal(back[f"model/{name}"], value), (directory, name)
