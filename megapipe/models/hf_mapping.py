"""Weight mapping between megapipe's canonical state dict and Hugging Face GPT-2 / BERT.

Each table row pairs a megapipe key with a Hugging Face key (``{i}`` is the layer index) and
the transform between them; QKV needs a reordering because Hugging Face keeps all queries,
then all keys, then all values, while megapipe keeps (head, {q, k, v}, head_dim) rows so a
contiguous tensor-parallel split gives whole heads. GPT-2's ``Conv1D`` stores weights as
``[in, out]``, hence the transposes.
"""

from __future__ import annotations

from typing import Callable

import torch

from megapipe.config import ModelConfig


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def qkv_from_separate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """[h_out(, h_in)] x 3 in (q | k | v) order -> megapipe's (head, qkv, head_dim) rows."""
    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return stacked.reshape(-1, *q.shape[1:]).contiguous()


def qkv_to_separate(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_head = qkv.reshape(heads, 3, -1, *qkv.shape[1:])
    return tuple(per_head[:, j].reshape(-1, *qkv.shape[1:]).contiguous() for j in range(3))


# ---- GPT-2 -------------------------------------------------------------------------------------

_GPT2_LAYER: list[tuple[str, str, Callable, Callable]] = [
    ("attention_norm.weight", "ln_1.weight", _identity, _identity),
    ("attention_norm.bias", "ln_1.bias", _identity, _identity),
    ("attention.dense.weight", "attn.c_proj.weight", _transpose, _transpose),
    ("attention.dense.bias", "attn.c_proj.bias", _identity, _identity),
    ("mlp_norm.weight", "ln_2.weight", _identity, _identity),
    ("mlp_norm.bias", "ln_2.bias", _identity, _identity),
    ("mlp.fc1.weight", "mlp.c_fc.weight", _transpose, _transpose),
    ("mlp.fc1.bias", "mlp.c_fc.bias", _identity, _identity),
    ("mlp.fc2.weight", "mlp.c_proj.weight", _transpose, _transpose),
    ("mlp.fc2.bias", "mlp.c_proj.bias", _identity, _identity),
]
_GPT2_GLOBAL = [
    ("embedding.word_embeddings.weight", "transformer.wte.weight"),
    ("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    ("final_norm.weight", "transformer.ln_f.weight"),
    ("final_norm.bias", "transformer.ln_f.bias"),
]


def gpt2_model_config(hf_config, **overrides) -> ModelConfig:
    """A megapipe ModelConfig equal to a ``transformers.GPT2Config``."""
    if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"GPT-2 activation {hf_config.activation_function} is not supported")
    fields = dict(num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
                  num_attention_heads=hf_config.n_head, vocab_size=hf_config.vocab_size,
                  seq_length=hf_config.n_positions, max_position_embeddings=hf_config.n_positions,
                  ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
                  layernorm_epsilon=hf_config.layer_norm_epsilon,
                  activation="gelu" if hf_config.activation_function == "gelu" else "gelu_tanh",
                  hidden_dropout=hf_config.resid_pdrop, attention_dropout=hf_config.attn_pdrop,
                  init_method_std=hf_config.initializer_range,
                  untie_embeddings_and_output_weights=not getattr(hf_config, "tie_word_embeddings", True))
    fields.update(overrides)
    return ModelConfig(**fields)


def gpt2_from_hf(hf_state: dict, config: ModelConfig) -> dict:
    """Canonical megapipe GPT state dict from a ``GPT2LMHeadModel`` state dict."""
    out = {ours: hf_state[theirs] for ours, theirs in _GPT2_GLOBAL}
    heads, h = config.num_attention_heads, config.hidden_size
    for i in range(config.num_layers):
        prefix = f"transformer.h.{i}."
        for ours, theirs, to_ours, _ in _GPT2_LAYER:
            out[f"layers.{i}.{ours}"] = to_ours(hf_state[prefix + theirs])
        w = hf_state[prefix + "attn.c_attn.weight"].t()  # [3h, h]: q | k | v
        b = hf_state[prefix + "attn.c_attn.bias"]
        out[f"layers.{i}.attention.qkv.weight"] = qkv_from_separate(*w.split(h, dim=0), heads)
        out[f"layers.{i}.attention.qkv.bias"] = qkv_from_separate(*b.split(h, dim=0), heads)
    if config.untie_embeddings_and_output_weights:
        out["output_embedding.weight"] = hf_state["lm_head.weight"]
    return {k: v.clone() for k, v in out.items()}


def gpt2_to_hf(state: dict, config: ModelConfig) -> dict:
    """``GPT2LMHeadModel`` state dict from a canonical megapipe GPT state dict."""
    out = {theirs: state[ours] for ours, theirs in _GPT2_GLOBAL}
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        prefix = f"transformer.h.{i}."
        for ours, theirs, _, to_theirs in _GPT2_LAYER:
            out[prefix + theirs] = to_theirs(state[f"layers.{i}.{ours}"])
        q, k, v = qkv_to_separate(state[f"layers.{i}.attention.qkv.weight"], heads)
        out[prefix + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t().contiguous()
        out[prefix + "attn.c_attn.bias"] = torch.cat(qkv_to_separate(state[f"layers.{i}.attention.qkv.bias"], heads))
    out["lm_head.weight"] = state.get("output_embedding.weight", state["embedding.word_embeddings.weight"])
    return {k: v.clone() for k, v in out.items()}


# ---- BERT --------------------------------------------------------------------------------------

_BERT_LAYER = [
    ("attention.dense.weight", "attention.output.dense.weight"),
    ("attention.dense.bias", "attention.output.dense.bias"),
    ("attention_norm.weight", "attention.output.LayerNorm.weight"),
    ("attention_norm.bias", "attention.output.LayerNorm.bias"),
    ("mlp.fc1.weight", "intermediate.dense.weight"),
    ("mlp.fc1.bias", "intermediate.dense.bias"),
    ("mlp.fc2.weight", "output.dense.weight"),
    ("mlp.fc2.bias", "output.dense.bias"),
    ("mlp_norm.weight", "output.LayerNorm.weight"),
    ("mlp_norm.bias", "output.LayerNorm.bias"),
]
_BERT_GLOBAL = [
    ("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
    ("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
    ("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
    ("embedding.norm.weight", "bert.embeddings.LayerNorm.weight"),
    ("embedding.norm.bias", "bert.embeddings.LayerNorm.bias"),
    ("pooler.weight", "bert.pooler.dense.weight"),
    ("pooler.bias", "bert.pooler.dense.bias"),
    ("lm_transform.weight", "cls.predictions.transform.dense.weight"),
    ("lm_transform.bias", "cls.predictions.transform.dense.bias"),
    ("lm_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("lm_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("lm_bias", "cls.predictions.bias"),
    ("binary_head.weight", "cls.seq_relationship.weight"),
    ("binary_head.bias", "cls.seq_relationship.bias"),
]


def bert_fields(hf_config) -> dict:
    """The ModelConfig fields a ``transformers.BertConfig`` gives (the BERT family adds its defaults)."""
    if hf_config.hidden_act not in ("gelu", "gelu_new"):
        raise ValueError(f"BERT activation {hf_config.hidden_act} is not supported")
    fields = dict(num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
                  num_attention_heads=hf_config.num_attention_heads, vocab_size=hf_config.vocab_size,
                  seq_length=hf_config.max_position_embeddings,
                  max_position_embeddings=hf_config.max_position_embeddings,
                  ffn_hidden_size=hf_config.intermediate_size, layernorm_epsilon=hf_config.layer_norm_eps,
                  activation="gelu" if hf_config.hidden_act == "gelu" else "gelu_tanh",
                  hidden_dropout=hf_config.hidden_dropout_prob,
                  attention_dropout=hf_config.attention_probs_dropout_prob,
                  init_method_std=hf_config.initializer_range, num_tokentypes=hf_config.type_vocab_size)
    return fields


def bert_from_hf(hf_state: dict, config: ModelConfig) -> dict:
    """Canonical megapipe BERT state dict from a ``BertForPreTraining`` state dict."""
    out = {ours: hf_state[theirs] for ours, theirs in _BERT_GLOBAL}
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        prefix = f"bert.encoder.layer.{i}."
        for ours, theirs in _BERT_LAYER:
            out[f"layers.{i}.{ours}"] = hf_state[prefix + theirs]
        for kind in ("weight", "bias"):
            q, k, v = (hf_state[f"{prefix}attention.self.{name}.{kind}"] for name in ("query", "key", "value"))
            out[f"layers.{i}.attention.qkv.{kind}"] = qkv_from_separate(q, k, v, heads)
    return {k: v.clone() for k, v in out.items()}


def bert_to_hf(state: dict, config: ModelConfig) -> dict:
    """``BertForPreTraining`` state dict from a canonical megapipe BERT state dict."""
    out = {theirs: state[ours] for ours, theirs in _BERT_GLOBAL}
    heads = config.num_attention_heads
    for i in range(config.num_layers):
        prefix = f"bert.encoder.layer.{i}."
        for ours, theirs in _BERT_LAYER:
            out[prefix + theirs] = state[f"layers.{i}.{ours}"]
        for kind in ("weight", "bias"):
            for name, tensor in zip(("query", "key", "value"),
                                    qkv_to_separate(state[f"layers.{i}.attention.qkv.{kind}"], heads)):
                out[f"{prefix}attention.self.{name}.{kind}"] = tensor
    out["cls.predictions.decoder.weight"] = state["embedding.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = state["lm_bias"]
    return {k: v.clone() for k, v in out.items()}


# ---- transformers configs of megapipe models ----------------------------------------------------

def _hf_activation(config: ModelConfig) -> str:
    if config.normalization != "LayerNorm":
        raise ValueError(f"a {config.normalization} model has no equal: Hugging Face GPT-2 and BERT use LayerNorm")
    return {"gelu": "gelu", "gelu_tanh": "gelu_new"}[config.activation]


def gpt2_hf_config(config: ModelConfig, **token_ids):
    """The ``transformers.GPT2Config`` of a megapipe GPT, with ``token_ids`` (bos_token_id ...)
    (ValueError when it has no equal)."""
    import transformers

    act = _hf_activation(config)
    if config.post_layernorm:
        raise ValueError("a GPT with post-layernorm has no equal: Hugging Face GPT-2 normalises first")
    return transformers.GPT2Config(n_layer=config.num_layers, n_embd=config.hidden_size,
                                   n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
                                   n_positions=config.max_position_embeddings, vocab_size=config.vocab_size,
                                   layer_norm_epsilon=config.layernorm_epsilon, activation_function=act,
                                   resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                                   attn_pdrop=config.attention_dropout, initializer_range=config.init_method_std,
                                   tie_word_embeddings=not config.untie_embeddings_and_output_weights, **token_ids)


def bert_hf_config(config: ModelConfig, **token_ids):
    """The ``transformers.BertConfig`` of a megapipe BERT, with ``token_ids`` (bos_token_id ...)
    (ValueError when it has no equal)."""
    import transformers

    act = _hf_activation(config)
    if not (config.post_layernorm and config.bert_binary_head and config.num_tokentypes):
        raise ValueError("BertForPreTraining needs post-layernorm, the binary head and token types")
    return transformers.BertConfig(num_hidden_layers=config.num_layers, hidden_size=config.hidden_size,
                                   num_attention_heads=config.num_attention_heads,
                                   intermediate_size=config.ffn_hidden_size, type_vocab_size=config.num_tokentypes,
                                   layer_norm_eps=config.layernorm_epsilon, hidden_act=act,
                                   hidden_dropout_prob=config.hidden_dropout,
                                   attention_probs_dropout_prob=config.attention_dropout,
                                   vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
                                   initializer_range=config.init_method_std, **token_ids)
