"""Megatron-LM checkpoints on disk, read whole and written as ``torch_dist``.

Two formats, both under ``ROOT/latest_checkpointed_iteration.txt`` and ``ROOT/iter_0000010/``:

- ``torch`` (legacy): ``iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt``, one pickle per tensor
  rank TT and pipeline rank PPP holding ``model`` (that rank's ``state_dict``), ``args``,
  ``iteration``, ``optimizer``, ``checkpoint_version``. Reading merges the ranks as Megatron's
  tensor parallelism split them: column-parallel weights (qkv per whole query group, SwiGLU's
  fc1 per half, embeddings per vocabulary slice) along dim 0, row-parallel ones along dim 1,
  layer numbers offset per pipeline stage.
- ``torch_dist``: a PyTorch distributed-checkpoint directory (``.metadata``, ``__*_*.distcp``)
  of Megatron-core's sharded keys (layers stacked along a leading dimension, or one key per
  layer in other versions), with ``common.pt`` (``args``, ``iteration``) and ``metadata.json``.
  It is layout-free: the tensors are stored whole-model.

Both are pickles: convert only checkpoints you trust, as Megatron-LM itself loads them.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.checkpointing.megatron_names import fused_name, local_name, model_config
from megapipe.checkpointing.paths import LATEST, prepare_staging, publish
from megapipe.config import ModelConfig
from megapipe.config.moe import moe_layer_pattern
from megapipe.errors import CheckpointError

LEGACY_FILE = "model_optim_rng.pt"
DIST_COMMON, DIST_METADATA = "common.pt", "metadata.json"
DIST_FORMAT = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
               "common_backend_version": 1}
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MODEL = ("embedding.", "decoder.", "output_layer.")  # the prefixes of Megatron GPT's weight keys
_COLUMN = re.compile(r"(word_embeddings\.weight|output_layer\.weight|linear_qkv\.(weight|bias)|"
                     r"linear_fc1\.(weight|bias))$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")
EXTRA_STATE = "_extra_state"  # a layer's framework state (Transformer Engine's FP8 scales), not a weight
_ATTENTION_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj")


@dataclass
class MegatronCheckpoint:
    """A Megatron checkpoint read whole: its model, where it came from and what it held besides."""

    directory: str
    format: str  # "torch" or "torch_dist"
    config: ModelConfig
    iteration: int
    tensors: dict  # whole tensors, local-spec names, one key per layer
    saved_layout: Optional[tuple[int, int]]  # (t, p) of a legacy checkpoint's files
    has_optimizer: bool

    def describe(self) -> str:
        where = f", (t, p) = {self.saved_layout}" if self.saved_layout else ""
        return f"Megatron-LM {self.format}{where}, iteration {self.iteration}"


def _iteration_dir(path: str) -> str:
    if not os.path.isdir(path):
        raise CheckpointError(f"Megatron checkpoint directory {path} does not exist.")
    names = os.listdir(path)
    if DIST_METADATA in names or any(_RANK_DIR.match(name) for name in names):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(f"{path} is not a Megatron checkpoint: it has no {LATEST}, no {DIST_METADATA} and "
                              "no mp_rank_* directories; name the checkpoint's save directory or one iter_* in it.")
    with open(latest) as f:
        text = f.read().strip()
    directory = os.path.join(path, "release" if text == "release" else f"iter_{int(text):07d}"
                             if text.isdigit() else text)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{latest} names {text!r}, but {directory} does not exist.")
    return directory


def read_megatron(path: str) -> MegatronCheckpoint:
    """The Megatron checkpoint ``path`` names (a save directory or one iter_* directory), every tensor whole."""
    directory = _iteration_dir(path)
    if os.path.isfile(os.path.join(directory, DIST_METADATA)):
        return _read_dist(directory)
    return _read_legacy(directory)


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as error:  # truncated or foreign
        raise CheckpointError(f"{path} cannot be read ({str(error).splitlines()[0]}).") from None


def _iteration(value, directory: str) -> int:
    if isinstance(value, int):
        return value
    digits = re.search(r"iter_(\d+)$", directory.rstrip("/"))
    return int(digits[1]) if digits else 0


def _read_legacy(directory: str) -> MegatronCheckpoint:
    ranks = {}
    for name in os.listdir(directory):
        match = _RANK_DIR.match(name)
        if match:
            ranks[int(match[1]), int(match[2] or 0)] = os.path.join(directory, name, LEGACY_FILE)
    if not ranks:
        raise CheckpointError(f"{directory} holds neither a torch_dist checkpoint ({DIST_METADATA}) nor mp_rank_* "
                              "directories of the torch format; name a complete Megatron checkpoint.")
    t, p = 1 + max(tp for tp, _ in ranks), 1 + max(pp for _, pp in ranks)
    for tp in range(t):
        for pp in range(p):
            if not os.path.isfile(ranks.get((tp, pp), "")):
                raise CheckpointError(f"{directory} lacks {LEGACY_FILE} of tensor rank {tp}, pipeline rank {pp} "
                                      f"(its files span (t, p) = ({t}, {p})); copy the whole checkpoint.")
    first = _load(ranks[0, 0])
    config = model_config(first.get("args"), directory)
    experts = getattr(first.get("args"), "expert_model_parallel_size", 1) or 1
    if experts > 1:
        raise CheckpointError(f"{directory} is a torch-format checkpoint of an expert-parallel run "
                              f"(expert_model_parallel_size={experts}), whose directories megapipe does not read; "
                              "convert it to torch_dist with Megatron-LM first (--ckpt-convert-format).")
    if "model" not in first:
        found = "model0" if "model0" in first else "no 'model'"
        raise CheckpointError(f"{ranks[0, 0]} holds {found}: virtual pipeline stages are not supported; convert "
                              "the checkpoint to torch_dist with Megatron-LM first (--ckpt-convert-format).")
    if config.num_layers % p:
        raise CheckpointError(f"{directory}: {config.num_layers} layers do not split evenly over its {p} pipeline "
                              "stages; megapipe reads even splits only.")
    tensors = {}
    for pp in range(p):
        parts = [first["model"] if (tp, pp) == (0, 0) else _load(ranks[tp, pp])["model"] for tp in range(t)]
        for name, value in parts[0].items():
            if not isinstance(value, torch.Tensor) or name.endswith(EXTRA_STATE):
                continue
            whole = _merge(local_name(name), [part[name] for part in parts], config.swiglu)
            layer = _LAYER.match(name)
            if layer:
                name = f"decoder.layers.{int(layer[1]) + pp * config.num_layers // p}.{layer[2]}"
            tensors[local_name(name)] = whole
    return MegatronCheckpoint(directory, "torch", config, _iteration(first.get("iteration"), directory), tensors,
                              (t, p), first.get("optimizer") is not None)


def _merge(name: str, parts: list[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """One tensor from its tensor-parallel slices (replicated ones: the first)."""
    if len(parts) == 1:
        return parts[0]
    if swiglu and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):  # each rank: [its gate rows; its up rows]
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if _COLUMN.search(name):
        return torch.cat(parts, dim=0)
    if _ROW.search(name):
        return torch.cat(parts, dim=1)
    return parts[0]


def _read_dist(directory: str) -> MegatronCheckpoint:
    common_path = os.path.join(directory, DIST_COMMON)
    if not os.path.isfile(common_path):
        raise CheckpointError(f"{directory} lacks {DIST_COMMON} (the arguments and iteration); copy the whole "
                              "checkpoint.")
    common = _load(common_path)
    config = model_config(common.get("args"), directory)
    reader = dcp.FileSystemReader(directory)
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{directory}: its .metadata cannot be read ({str(error).splitlines()[0]}).") from None
    missing = sorted({info.relative_path for info in metadata.storage_data.values()} - set(os.listdir(directory)))
    if missing:
        raise CheckpointError(f"{directory} is missing {len(missing)} shard file(s) its .metadata names "
                              f"({', '.join(missing[:3])}); copy the whole checkpoint directory.")
    wanted = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
              for key, md in metadata.state_dict_metadata.items()
              if isinstance(md, TensorStorageMetadata) and key.removeprefix("model.").startswith(_MODEL)
              and EXTRA_STATE not in key}
    with warnings.catch_warnings():  # DCP warns that no_dist means one process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    tensors = {}
    for key, value in wanted.items():
        key = key.removeprefix("model.")
        if key.startswith("decoder.layers.") and not _LAYER.match(key):  # stacked: one row per layer
            for i, layer in enumerate(value.unbind(0)):
                tensors[local_name(f"decoder.layers.{i}.{key.removeprefix('decoder.layers.')}")] = layer
        else:
            tensors[local_name(key)] = value
    has_optimizer = any(key.startswith("optimizer.") for key in metadata.state_dict_metadata) or \
        common.get("optimizer") is not None
    return MegatronCheckpoint(directory, "torch_dist", config, _iteration(common.get("iteration"), directory),
                              tensors, None, has_optimizer)


def _linears(args: argparse.Namespace, moe: bool) -> list[tuple[str, Optional[int]]]:
    """Megatron-core's linears of one layer, each with its experts (None: one per layer); an MoE layer's routed
    experts (torch_dist's stacked ``experts.experts``) and shared expert replace the dense MLP's."""
    if not moe:
        return [(name, None) for name in _ATTENTION_LINEARS + ("mlp.linear_fc1", "mlp.linear_fc2")]
    shared = ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"] \
        if args.moe_shared_expert_intermediate_size else []
    return ([(name, None) for name in _ATTENTION_LINEARS + tuple(shared)]
            + [(f"mlp.experts.experts.linear_fc{n}", args.num_experts) for n in (1, 2)])


def _moe_layers(args: argparse.Namespace) -> tuple[bool, ...]:
    """Whether each layer of the model ``args`` describe is an MoE layer."""
    if not args.num_experts:
        return (False,) * args.num_layers
    return moe_layer_pattern(getattr(args, "moe_layer_freq", 1), args.num_layers)


def _stacked(args: argparse.Namespace) -> bool:
    """Whether Megatron-core stacks each layer key over all layers: so it does for models whose layers are all
    alike; one that mixes dense and MoE layers (``moe_layer_freq`` above 1, or a list) keeps one key per layer."""
    freq = getattr(args, "moe_layer_freq", 1)
    return isinstance(freq, int) and freq == 1


def _extra_state_keys(args: argparse.Namespace) -> list[str]:
    """The keys of Megatron-core's (empty) extra state of its linears, one object per layer (and expert), in the
    stacked form (``decoder.layers.{linear}``, sharded over the layers) or one key per layer."""
    keys, stacked = [], _stacked(args)
    for i, moe in enumerate(_moe_layers(args)):
        for module, experts in _linears(args, moe):
            for j in range(experts or 1):
                at, of = ([str(j)], [str(experts)]) if experts else ([], [])
                if stacked:
                    key, at, of = f"decoder.layers.{module}", [str(i), *at], [str(args.num_layers), *of]
                else:
                    key, at, of = f"decoder.layers.{i}.{module}", at or ["0"], of or ["1"]
                keys.append(f"{key}.{EXTRA_STATE}/shard_{'.'.join(at)}_{'.'.join(of)}")
    return keys


def write_dist(root: str, tensors: dict[str, torch.Tensor], args: argparse.Namespace, iteration: int) -> str:
    """Write ``tensors`` (whole, local-spec names, one key per layer) as a Megatron-core ``torch_dist``
    checkpoint under ``root`` (staged, then renamed into place); returns its iter_* directory."""
    layers: dict[str, list] = {}
    state: dict = {}
    stacked = _stacked(args)
    for name, value in tensors.items():
        match = _LAYER.match(name)
        if match and stacked:
            layers.setdefault(fused_name("decoder.layers." + match[2]), []).append((int(match[1]), value))
        else:
            state[fused_name(name)] = value
    for key, rows in layers.items():
        state[key] = torch.stack([value for _, value in sorted(rows, key=lambda row: row[0])])
    # stored as Megatron-core stores its objects: the list of one key's values
    state.update({key: [None] for key in _extra_state_keys(args)})
    if args.untie_embeddings_and_output_weights:
        state[f"output_layer.{EXTRA_STATE}/shard_0_1"] = [None]
    os.makedirs(root, exist_ok=True)
    staging = prepare_staging(root, iteration)
    with warnings.catch_warnings():  # as in _read_dist
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(staging, sync_files=True), no_dist=True)
    with open(os.path.join(staging, DIST_COMMON), "wb") as f:
        torch.save({"args": args, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}, f)
        os.fsync(f.fileno())
    with open(os.path.join(staging, DIST_METADATA), "w") as f:
        json.dump(DIST_FORMAT, f)
        f.flush()
        os.fsync(f.fileno())
    return publish(root, iteration)
