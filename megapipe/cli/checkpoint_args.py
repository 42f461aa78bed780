"""``--use-checkpoint-args`` (Megatron-LM's flag): the model's shape comes from the ``--load`` checkpoint.

The checkpoint's ``common.json`` holds the model configuration it was trained (or imported) with;
every shape field below is taken from it. A shape flag given on the command line must agree:
one that contradicts the checkpoint is refused in one sentence rather than silently overridden
either way. A Megatron-LM checkpoint is read through ``tools/convert_checkpoint.py
import-megatron`` first, which turns its ``args`` into the same configuration.
"""

from __future__ import annotations

import dataclasses

from megapipe.checkpointing.common import Common
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.cli.flags import FIELD_FLAGS, INPUT_FLAGS
from megapipe.config.schema import Config
from megapipe.errors import ConfigError

# the ModelConfig fields the checkpoint decides (the tokenizer still gives the vocabulary)
SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
         "max_position_embeddings", "position_embedding_type", "normalization", "activation", "post_layernorm",
         "swiglu", "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "rotary_base",
         "rotary_percent", "layernorm_epsilon", "make_vocab_size_divisible_by", "num_tokentypes", "bert_binary_head")


def _given_fields(given: set[str]) -> dict[str, str]:
    """Model field -> the flag the command line set it with (its own flag rather than a switch folded into it)."""
    fields = {}
    for dest in sorted(given, key=lambda dest: (dest in FIELD_FLAGS, dest)):
        target = FIELD_FLAGS[dest].field if dest in FIELD_FLAGS and FIELD_FLAGS[dest].section == "model" else \
            INPUT_FLAGS.get(dest, "").removeprefix("model.")
        if target:
            fields[target] = "--" + dest.replace("_", "-")
    return fields


def use_checkpoint_args(config: Config, given: set[str]) -> None:
    """Set ``config.model``'s shape to the --load checkpoint's; ``given``: the argparse dests the command line set."""
    load = config.training.load
    if load is None:
        raise ConfigError("--use-checkpoint-args needs --load DIR, the checkpoint whose model shape to take.")
    directory = find_checkpoint(load)
    if directory is None:
        raise ConfigError(f"--use-checkpoint-args: {load} holds no checkpoint yet to take the model shape from.")
    saved = Common.read(directory).model_config
    flags = _given_fields(given)
    for field in SHAPE:
        mine, theirs = getattr(config.model, field), getattr(saved, field)
        if field in flags and mine != theirs:
            raise ConfigError(f"{flags[field]} gives {field} {mine!r} but the checkpoint {directory} has {theirs!r}, "
                              "and --use-checkpoint-args takes the model's shape from it; drop the flag or "
                              "--use-checkpoint-args.")
    config.model = dataclasses.replace(config.model, **{field: getattr(saved, field) for field in SHAPE})
