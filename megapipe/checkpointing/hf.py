"""Hugging Face GPT-2 and BERT directories (``save_pretrained`` output) <-> canonical megapipe tensors.

Import reads any weights format ``from_pretrained`` reads (safetensors or ``.bin``, sharded
or not) and refuses what megapipe cannot compute identically: other architectures, and
GPT-2/BERT options that change the maths. Export writes ``config.json`` and safetensors
through ``save_pretrained`` of a model that received every weight, so what it writes is
exactly what ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import torch

from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError
from megapipe.models import hf_mapping


@dataclass(frozen=True)
class Architecture:
    kind: str  # megapipe's model kind
    hf_class: str  # the transformers class whose state dict the mapping reads and writes
    model_config: Callable  # transformers config -> ModelConfig
    from_hf: Callable
    to_hf: Callable


ARCHITECTURES = {
    "gpt2": Architecture("gpt", "GPT2LMHeadModel", hf_mapping.gpt2_model_config, hf_mapping.gpt2_from_hf,
                         hf_mapping.gpt2_to_hf),
    "bert": Architecture("bert", "BertForPreTraining", hf_mapping.bert_model_config, hf_mapping.bert_from_hf,
                         hf_mapping.bert_to_hf),
}

# Options whose non-default values change the computation in ways megapipe does not implement.
UNSUPPORTED_OPTIONS = {
    "gpt2": {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
             "add_cross_attention": False},
    "bert": {"is_decoder": False, "add_cross_attention": False},
}


def _architecture(hf_dir: str) -> tuple[str, Architecture]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model directory: it has no config.json.")
    with open(path) as f:
        fields = json.load(f)
    model_type = fields.get("model_type")
    if model_type not in ARCHITECTURES:
        names = ", ".join(fields.get("architectures") or []) or "no architectures listed"
        raise CheckpointError(f"{hf_dir} holds a {model_type!r} model ({names}); only GPT-2 (model_type 'gpt2') and "
                              "BERT ('bert') checkpoints can be imported.")
    return model_type, ARCHITECTURES[model_type]


def _check_options(model_type: str, hf_config, hf_dir: str) -> None:
    for option, expected in UNSUPPORTED_OPTIONS[model_type].items():
        if getattr(hf_config, option, expected) != expected:
            raise CheckpointError(f"{hf_dir}: {model_type} with {option}={getattr(hf_config, option)!r} is not "
                                  f"supported; megapipe computes {option}={expected!r}.")
    position = getattr(hf_config, "position_embedding_type", None)
    if model_type == "bert" and position not in (None, "absolute"):
        raise CheckpointError(f"{hf_dir}: BERT with position_embedding_type={position!r} is not supported; "
                              "megapipe uses absolute position embeddings.")


def import_hf(hf_dir: str) -> tuple[str, ModelConfig, dict[str, torch.Tensor]]:
    """(megapipe kind, ModelConfig, canonical state dict) of a Hugging Face GPT-2 or BERT directory."""
    import transformers

    model_type, arch = _architecture(hf_dir)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    _check_options(model_type, hf_config, hf_dir)
    try:
        config = arch.model_config(hf_config)
    except ValueError as error:
        raise CheckpointError(f"{hf_dir}: {error}.") from None
    try:
        model, info = getattr(transformers, arch.hf_class).from_pretrained(hf_dir, output_loading_info=True,
                                                                           dtype=torch.float32)
    except (OSError, ValueError) as error:
        reason = str(error).splitlines()[0].rstrip(".")
        raise CheckpointError(f"{hf_dir}: the weights cannot be read ({reason}).") from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise CheckpointError(f"{hf_dir} lacks {len(missing)} weights a {arch.hf_class} needs (first: {missing[0]}); "
                              "it was probably saved from a model without the pretraining heads.")
    return arch.kind, config, arch.from_hf(model.state_dict(), config)


def hf_config_of(kind: str, config: ModelConfig):
    """The transformers config of a megapipe model, or CheckpointError when Hugging Face has no equal."""
    import transformers

    if config.normalization != "LayerNorm":
        raise CheckpointError(f"cannot export a {config.normalization} model: Hugging Face GPT-2 and BERT use "
                              "LayerNorm.")
    act = {"gelu": "gelu", "gelu_tanh": "gelu_new"}[config.activation]
    if kind == "gpt":
        if config.post_layernorm:
            raise CheckpointError("cannot export a GPT with post-layernorm: Hugging Face GPT-2 normalises first.")
        return transformers.GPT2Config(n_layer=config.num_layers, n_embd=config.hidden_size,
                                       n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
                                       n_positions=config.max_position_embeddings, vocab_size=config.vocab_size,
                                       layer_norm_epsilon=config.layernorm_epsilon, activation_function=act,
                                       resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                                       attn_pdrop=config.attention_dropout, initializer_range=config.init_method_std,
                                       tie_word_embeddings=not config.untie_embeddings_and_output_weights)
    if not (config.post_layernorm and config.bert_binary_head and config.num_tokentypes):
        raise CheckpointError("cannot export this BERT: BertForPreTraining needs post-layernorm, the binary head and "
                              "token types.")
    return transformers.BertConfig(num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
                                   num_attention_heads=config.num_attention_heads,
                                   intermediate_size=config.ffn_hidden_size, type_vocab_size=config.num_tokentypes,
                                   layer_norm_eps=config.layernorm_epsilon, hidden_act=act,
                                   hidden_dropout_prob=config.hidden_dropout,
                                   attention_probs_dropout_prob=config.attention_dropout,
                                   vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
                                   initializer_range=config.init_method_std)


def export_hf(kind: str, config: ModelConfig, canonical: dict[str, torch.Tensor], hf_dir: str) -> None:
    """Write ``canonical`` (megapipe names, whole tensors) as a Hugging Face directory."""
    import transformers

    model_type = next(name for name, arch in ARCHITECTURES.items() if arch.kind == kind)
    arch = ARCHITECTURES[model_type]
    model = getattr(transformers, arch.hf_class)(hf_config_of(kind, config))
    state = {key: value.float() for key, value in arch.to_hf(canonical, config).items()}
    model.load_state_dict(state, strict=True)
    model.save_pretrained(hf_dir)
