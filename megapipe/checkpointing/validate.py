"""Checks that a checkpoint fits this run, made on every rank before anything is read.

Each rank checks the blocks it will ask for (present, same global shape); the ranks then
share their verdicts and the names of the weights they hold, so all of them raise the same
sentence, naming the first tensor that does not fit, or none does. A model is therefore never
half loaded: either every check passes and every read succeeds, or nothing is copied.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megapipe.checkpointing.shards import Shard
from megapipe.checkpointing.state import model_key
from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError

# Model settings that change tensor shapes, with the flag that sets each.
SHAPE_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
               "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
               "vocab_size": "vocabulary size", "max_position_embeddings": "--max-position-embeddings",
               "num_tokentypes": "token types", "untie_embeddings_and_output_weights":
               "--untie-embeddings-and-output-weights", "bert_binary_head": "--bert-no-binary-head",
               "normalization": "--normalization", "num_experts": "--num-experts",
               "moe_ffn_hidden_size": "--moe-ffn-hidden-size"}


def first_shape_problem(wanted: dict[str, Shard], saved: dict) -> Optional[str]:
    """The first block this rank wants that the checkpoint lacks or holds with another global shape."""
    for key, shard in wanted.items():
        if key not in saved:
            return f"it has no tensor {key!r}, which this model needs"
        saved_shape = tuple(saved[key].size)
        if saved_shape != tuple(shard.global_shape):
            return (f"tensor {key!r} has shape {list(saved_shape)} in the checkpoint but "
                    f"{list(shard.global_shape)} in this model")
    return None


def shape_differences(saved: ModelConfig, current: ModelConfig) -> str:
    """The shape-setting flags in which the checkpoint's model and this one differ, as a short phrase,
    with the fix a resuming user most likely wants: the checkpoint's shape (``--use-checkpoint-args``)
    or, for the vocabulary, the tokenizer it was trained with."""
    moved = [name for name in SHAPE_FLAGS if getattr(saved, name) != getattr(current, name)]
    if not moved:
        return ""
    diffs = ", ".join(f"{SHAPE_FLAGS[name]} {getattr(saved, name)} vs {getattr(current, name)}" for name in moved)
    fixes = []
    if set(moved) - {"vocab_size"}:
        fixes.append("add --use-checkpoint-args to take the model's shape from the checkpoint")
    if "vocab_size" in moved:
        fixes.append("pass the tokenizer flags (--tokenizer-type and its files) the checkpoint was trained with")
    return f" (checkpoint vs this run: {diffs}); {' and '.join(fixes)}"


def agree_on_fit(source: str, wanted: dict[str, Shard], param_names: list[str], saved: dict,
                 saved_config: ModelConfig, config: ModelConfig) -> None:
    """Raise the same CheckpointError on every rank if any rank's blocks do not fit.

    ``param_names``: the canonical names of this rank's parameters; a saved weight that no
    rank holds means the checkpoint's model is larger than this one.
    """
    problem = first_shape_problem(wanted, saved)
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (problem, param_names))
    problem = next((p for p, _ in verdicts if p is not None), None)
    if problem is None:
        needed = {model_key(name) for _, names in verdicts for name in names}
        extra = next((key for key in saved if key.startswith(model_key("")) and key not in needed), None)
        if extra is not None:
            problem = f"it holds tensor {extra!r}, which this model does not have"
    if problem is not None:
        raise CheckpointError(f"{source} does not fit this model: {problem}"
                              f"{shape_differences(saved_config, config)}.")
