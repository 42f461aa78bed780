"""A checkpoint loaded for inference on this process's part of a (t, p) layout, with its tokenizer."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import torch

from megapipe.checkpointing.load import load_weights
from megapipe.checkpointing.common import Common
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.parallel.launch import init_distributed
from megapipe.errors import CheckpointError, ConfigError
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState


@dataclass
class LoadedModel:
    chunks: list
    ps: ParallelState
    config: object  # ModelConfig
    tokenizer: Optional[object]  # a tokenizers.Tokenizer from the checkpoint's tokenizer.json, or None


def layout_flags(parser: argparse.ArgumentParser) -> None:
    """The flags inference tools share with training (Megatron-LM names)."""
    parser.add_argument("--load", required=True, help="a --save directory or one iter_* directory")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)


def load_for_inference(args: argparse.Namespace) -> LoadedModel:
    """Join the torchrun world, build this rank's stage and load the checkpoint's weights into it."""
    directory = find_checkpoint(args.load)
    if directory is None:
        raise CheckpointError(f"--load {args.load} holds no checkpoint; pass a --save directory or an iter_* "
                              "directory.")
    common = Common.read(directory)
    if common.kind != "gpt":
        raise ConfigError(f"--load {args.load} holds a {common.kind.upper()} model; generation needs a GPT/Llama "
                          "(causal) model.")
    config = common.model_config
    device = init_distributed()
    ps = ParallelState.initialize(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    chunks = build_model_chunks("gpt", config, ps, device=device)
    load_weights(args.load, "gpt", chunks, ps, config)
    tokenizer = None
    if common.tokenizer is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(common.tokenizer)
    torch.set_grad_enabled(False)
    return LoadedModel(chunks, ps, config, tokenizer)
