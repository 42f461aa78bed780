"""Llama-family model flags (Megatron-LM's names) and ``--model-preset`` shapes.

``llama_flags`` adds the flags to the model group, ``llama_options`` turns them into
``ModelConfig`` fields, and ``apply_preset`` fills in a preset's shape wherever the command
line left a flag at its default (a flag given explicitly wins).
"""

from __future__ import annotations

import argparse

from megapipe.errors import ConfigError

_LLAMA = dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", disable_bias_linear=True,
              untie_embeddings_and_output_weights=True, layernorm_epsilon=1e-5, hidden_dropout=0.0,
              attention_dropout=0.0)

# Shapes of common Llama-family models (vocabulary comes from the tokenizer).
PRESETS = {
    "llama-tiny": dict(_LLAMA, num_layers=4, hidden_size=128, num_attention_heads=8, group_query_attention=True,
                       num_query_groups=2, ffn_hidden_size=352, seq_length=128),
    "llama-1b": dict(_LLAMA, num_layers=16, hidden_size=2048, num_attention_heads=32, group_query_attention=True,
                     num_query_groups=8, ffn_hidden_size=8192, seq_length=2048, rotary_base=500000.0),
    "llama2-7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                      seq_length=4096),
    "llama3-8b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                      num_query_groups=8, ffn_hidden_size=14336, seq_length=8192, rotary_base=500000.0),
    "mistral-7b": dict(_LLAMA, num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                       num_query_groups=8, ffn_hidden_size=14336, seq_length=4096, rotary_base=1000000.0),
    "qwen2-0.5b": dict(_LLAMA, num_layers=24, hidden_size=896, num_attention_heads=14, group_query_attention=True,
                       num_query_groups=2, ffn_hidden_size=4864, seq_length=4096, rotary_base=1000000.0,
                       add_qkv_bias=True, untie_embeddings_and_output_weights=False, layernorm_epsilon=1e-6),
}


def llama_flags(g) -> None:
    g.add_argument("--model-preset", choices=sorted(PRESETS), default=None,
                   help="a Llama-family shape; explicitly given flags override it")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of each head's channels RoPE rotates")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP of width --ffn-hidden-size")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None, help="key/value heads with --group-query-attention")
    g.add_argument("--disable-bias-linear", action="store_true", help="no bias in any linear layer")
    g.add_argument("--add-qkv-bias", action="store_true", help="a QKV bias even with --disable-bias-linear (Qwen2)")


def apply_preset(args: argparse.Namespace, defaults: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every flag still at its default (as in ``defaults``) given the preset's value."""
    if args.model_preset is not None:
        for name, value in PRESETS[args.model_preset].items():
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
    return args


def llama_options(args: argparse.Namespace) -> dict:
    """The ModelConfig fields of the Llama-family flags."""
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention; add it or drop the groups.")
    if args.group_query_attention and args.num_query_groups is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N (the number of key/value heads).")
    return dict(position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                rotary_percent=args.rotary_percent, swiglu=args.swiglu,
                num_query_groups=args.num_query_groups if args.group_query_attention else None,
                add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias,
                bias_swiglu_fusion=not args.no_bias_swiglu_fusion, apply_rope_fusion=not args.no_rope_fusion)
