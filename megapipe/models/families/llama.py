"""Llama (and Mistral, Qwen2): a GPT with rotary positions, SwiGLU, RMSNorm, grouped-query attention and no
biases. It trains under ``pretrain_gpt.py``; ``--model-preset`` picks one of the shapes below.

The shape flags themselves (``--position-embedding-type``, ``--swiglu``, ``--num-query-groups`` ...)
are ``ModelConfig`` fields, so any GPT can use them; this entry adds Megatron-LM's
``--group-query-attention`` switch, the presets and the Hugging Face mapping. A preset fills in
every flag the command line did not give (a flag given wins, even at the script's default).
"""

from __future__ import annotations

import argparse

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.models import hf_llama
from megapipe.models.families.family import Family, HFArchitecture
from megapipe.models.gpt import GPTStage

# what a Llama differs in from ModelConfig's defaults
DEFAULTS = dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                untie_embeddings_and_output_weights=True, layernorm_epsilon=1e-5, hidden_dropout=0.0,
                attention_dropout=0.0)

# the same, as the flags (argparse dests) a preset sets
FLAGS = dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", disable_bias_linear=True,
             untie_embeddings_and_output_weights=True, layernorm_epsilon=1e-5, hidden_dropout=0.0,
             attention_dropout=0.0)

# Shapes of common Llama-family models (vocabulary comes from the tokenizer).
PRESETS = {
    "llama-tiny": dict(FLAGS, num_layers=4, hidden_size=128, num_attention_heads=8, group_query_attention=True,
                       num_query_groups=2, ffn_hidden_size=352, seq_length=128),
    "llama-1b": dict(FLAGS, num_layers=16, hidden_size=2048, num_attention_heads=32, group_query_attention=True,
                     num_query_groups=8, ffn_hidden_size=8192, seq_length=2048, rotary_base=500000.0),
    "llama2-7b": dict(FLAGS, num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                      seq_length=4096),
    "llama3-8b": dict(FLAGS, num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                      num_query_groups=8, ffn_hidden_size=14336, seq_length=8192, rotary_base=500000.0),
    "mistral-7b": dict(FLAGS, num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                       num_query_groups=8, ffn_hidden_size=14336, seq_length=4096, rotary_base=1000000.0),
    "qwen2-0.5b": dict(FLAGS, num_layers=24, hidden_size=896, num_attention_heads=14, group_query_attention=True,
                       num_query_groups=2, ffn_hidden_size=4864, seq_length=4096, rotary_base=1000000.0,
                       add_qkv_bias=True, untie_embeddings_and_output_weights=False, layernorm_epsilon=1e-6),
}


def add_flags(g) -> None:
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")


def model_options(args: argparse.Namespace, fields: dict) -> None:
    """Fold ``--group-query-attention`` into ``num_query_groups`` (None: one key/value head per head)."""
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention; add it or drop the groups.")
    if args.group_query_attention and args.num_query_groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N (the number of key/value heads).")
    fields["num_query_groups"] = args.num_query_groups if args.group_query_attention else None


def claims(config: ModelConfig) -> bool:
    return config.swiglu or config.position_embedding_type == "rope"


def export_type(config: ModelConfig) -> str:
    return "qwen2" if config.add_qkv_bias else "llama"


def llama_model_config(hf_config, **overrides) -> ModelConfig:
    """A megapipe ModelConfig equal to a Llama, Mistral or Qwen2 transformers config."""
    return ModelConfig(**{**DEFAULTS, **hf_llama.llama_fields(hf_config), **overrides})


def _architecture(model_type: str) -> HFArchitecture:
    hf_class, _ = hf_llama.LLAMA_FAMILY[model_type]
    return HFArchitecture(model_type, hf_class, llama_model_config, hf_llama.LLAMA_WEIGHTS,
                          lambda config, **token_ids: hf_llama.llama_hf_config(model_type, config, **token_ids),
                          unsupported={"attention_bias": False, "mlp_bias": False}, reads_safetensors=True)


FAMILY = Family(name="llama", kind="gpt", stage=GPTStage, defaults=DEFAULTS,
                hf=tuple(_architecture(model_type) for model_type in hf_llama.LLAMA_FAMILY), presets=PRESETS,
                claims=claims, export_type=export_type, add_flags=add_flags, model_options=model_options)
