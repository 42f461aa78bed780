"""A checkpoint loaded for inference on this process's part of a (t, p, e) layout (experts split over any
expert-tensor size that divides t), with its tokenizer."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

import torch

from megapipe.checkpointing.load import load_weights
from megapipe.checkpointing.common import Common
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.checkpointing.tokenizer_files import read_tokenizer
from megapipe.data.tokenizer import Tokenizer
from megapipe.data.tokenizer.flags import add_tokenizer_arguments, tokenizer_from_args
from megapipe.config import ParallelConfig
from megapipe.errors import CheckpointError, ConfigError
from megapipe.layout.ranks import RankLayout
from megapipe.models import build_model_chunks
from megapipe.parallel.launch import init_distributed
from megapipe.parallel.state import ParallelState


@dataclass
class LoadedModel:
    chunks: list
    ps: ParallelState
    config: object  # ModelConfig
    tokenizer: Optional[Tokenizer]  # the checkpoint's (or the tokenizer flags'), None when neither has one


def layout_flags(parser: argparse.ArgumentParser) -> None:
    """The flags inference tools share with training (Megatron-LM names); the tokenizer flags are
    for checkpoints saved without a tokenizer (and override the one a checkpoint carries)."""
    parser.add_argument("--load", required=True, help="a --save directory or one iter_* directory")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="training's only: generation refuses any value but 1 (a checkpoint loads at any)")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="ranks each MoE layer's experts are split over (it must divide --num-experts)")
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                        help="ranks each expert's ffn dimension is split over: --tensor-model-parallel-size (the "
                             "default) or a divisor of it, each group of that many tensor ranks taking its share of "
                             "the tokens (docs/moe.md)")
    add_tokenizer_arguments(parser, required=False)


def check_no_context_parallelism(context: int) -> None:
    """Generation decodes one token at a time against a cache of every earlier position; context parallelism
    splits a training sequence into chunks and has no such cache, so inference runs at c = 1."""
    if context != 1:
        raise ConfigError(f"--context-parallel-size {context} is for training: generation, the server and "
                          "evaluation decode over a key-value cache that context parallelism does not split; drop "
                          "the flag (a checkpoint trained at any context size loads at 1).")


def _missing_tokenizer(directory: str, reads_text: str) -> ConfigError:
    return ConfigError(f"{reads_text} needs a tokenizer, and {directory} carries none (it was saved before "
                       "megapipe stored tokenizers in checkpoints); pass the tokenizer "
                       "flags it was trained with, e.g. --tokenizer-type ByteLevelTokenizer for the default data.")


def _tokenizer(args: argparse.Namespace, directory: str, common: Common, vocab_size: int) -> Optional[Tokenizer]:
    """The tokenizer flags' tokenizer if given (it must fit the model's vocabulary), else the checkpoint's."""
    if args.tokenizer_type is None:
        return read_tokenizer(directory, common.tokenizer)
    tokenizer = tokenizer_from_args(args)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"--tokenizer-type {args.tokenizer_type} has {tokenizer.vocab_size} token ids but the model "
                          f"in {directory} knows only {vocab_size}; pass the tokenizer flags it was trained with.")
    return tokenizer


def load_for_inference(args: argparse.Namespace, reads_text: Optional[str] = None) -> LoadedModel:
    """Join the torchrun world, build this rank's stage and load the checkpoint's weights into it.

    ``reads_text`` names what will read text (e.g. "--prompt"): then a missing tokenizer is refused
    first, in one sentence, before any process group exists.
    """
    check_no_context_parallelism(args.context_parallel_size)
    directory = find_checkpoint(args.load)
    if directory is None:
        raise CheckpointError(f"--load {args.load} holds no checkpoint; pass a --save directory or an iter_* "
                              "directory.")
    common = Common.read(directory)
    if common.kind != "gpt":
        raise ConfigError(f"--load {args.load} holds a {common.kind.upper()} model; generation needs a GPT/Llama "
                          "(causal) model.")
    config = common.model_config
    tokenizer = _tokenizer(args, directory, common, config.vocab_size)
    if reads_text and tokenizer is None:
        raise _missing_tokenizer(directory, reads_text)
    t, p, e, etp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                    args.expert_model_parallel_size, args.expert_tensor_parallel_size)
    ParallelConfig(tensor=t, pipeline=p, expert=e, expert_tensor=etp).validate()
    config.validate(t, p, expert_parallel=e)
    RankLayout.for_world(int(os.environ.get("WORLD_SIZE", "1")), t, p, expert=e, expert_tensor=etp)
    device = init_distributed()
    ps = ParallelState.initialize(t, p, expert=e, expert_tensor=etp)
    chunks = build_model_chunks("gpt", config, ps, device=device)
    load_weights(args.load, "gpt", chunks, ps, config)
    torch.set_grad_enabled(False)
    return LoadedModel(chunks, ps, config, tokenizer)
