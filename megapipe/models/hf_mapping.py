"""Weight mapping between megapipe's canonical state dict and Hugging Face GPT-2 / BERT.

Each family's table (``hf_table.HFMapping``, walked by import and export alike) pairs megapipe
keys with Hugging Face keys and the transform between them; QKV needs a reordering because Hugging Face keeps all queries,
then all keys, then all values, while megapipe keeps (head, {q, k, v}, head_dim) rows so a
contiguous tensor-parallel split gives whole heads. GPT-2's ``Conv1D`` stores weights as
``[in, out]``, hence the transposes.
"""

from __future__ import annotations

import torch

from megapipe.config import ModelConfig
from megapipe.models.hf_table import HFMapping, Rule, rename


def _transposed(config: ModelConfig, t: torch.Tensor) -> tuple:
    return (t.t().contiguous(),)


def qkv_from_separate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """[h_out(, h_in)] x 3 in (q | k | v) order -> megapipe's (head, qkv, head_dim) rows."""
    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)], dim=1)
    return stacked.reshape(-1, *q.shape[1:]).contiguous()


def qkv_to_separate(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_head = qkv.reshape(heads, 3, -1, *qkv.shape[1:])
    return tuple(per_head[:, j].reshape(-1, *qkv.shape[1:]).contiguous() for j in range(3))


# ---- GPT-2 -------------------------------------------------------------------------------------

def _from_c_attn(config: ModelConfig, fused: torch.Tensor) -> tuple:
    """``c_attn``'s weight ([h, 3h], Conv1D) or bias ([3h]), q | k | v -> megapipe's fused qkv."""
    rows = fused.t() if fused.dim() == 2 else fused
    return (qkv_from_separate(*rows.split(config.hidden_size, dim=0), config.num_attention_heads),)


def _to_c_attn(config: ModelConfig, qkv: torch.Tensor) -> tuple:
    rows = torch.cat(qkv_to_separate(qkv, config.num_attention_heads), dim=0)
    return (rows.t().contiguous() if rows.dim() == 2 else rows,)


GPT2_WEIGHTS = HFMapping(
    layer_prefix="transformer.h.{i}.",
    layer=(rename("attention_norm.weight", "ln_1.weight"),
           rename("attention_norm.bias", "ln_1.bias"),
           rename("attention.dense.weight", "attn.c_proj.weight", _transposed),
           rename("attention.dense.bias", "attn.c_proj.bias"),
           rename("mlp_norm.weight", "ln_2.weight"),
           rename("mlp_norm.bias", "ln_2.bias"),
           rename("mlp.fc1.weight", "mlp.c_fc.weight", _transposed),
           rename("mlp.fc1.bias", "mlp.c_fc.bias"),
           rename("mlp.fc2.weight", "mlp.c_proj.weight", _transposed),
           rename("mlp.fc2.bias", "mlp.c_proj.bias"),
           *(Rule((f"attention.qkv.{kind}",), (f"attn.c_attn.{kind}",), _from_c_attn, _to_c_attn)
             for kind in ("weight", "bias"))),
    before=(rename("embedding.word_embeddings.weight", "transformer.wte.weight"),
           rename("embedding.position_embeddings.weight", "transformer.wpe.weight"),
           rename("final_norm.weight", "transformer.ln_f.weight"),
           rename("final_norm.bias", "transformer.ln_f.bias")),
    lm_head="lm_head.weight")
gpt2_from_hf, gpt2_to_hf = GPT2_WEIGHTS.from_hf, GPT2_WEIGHTS.to_hf  # ``GPT2LMHeadModel``'s state dict


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


# ---- BERT --------------------------------------------------------------------------------------

def _qkv_from_separate(config: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return (qkv_from_separate(q, k, v, config.num_attention_heads),)


def _qkv_to_separate(config: ModelConfig, qkv: torch.Tensor) -> tuple:
    return qkv_to_separate(qkv, config.num_attention_heads)


BERT_WEIGHTS = HFMapping(
    layer_prefix="bert.encoder.layer.{i}.",
    layer=(rename("attention.dense.weight", "attention.output.dense.weight"),
           rename("attention.dense.bias", "attention.output.dense.bias"),
           rename("attention_norm.weight", "attention.output.LayerNorm.weight"),
           rename("attention_norm.bias", "attention.output.LayerNorm.bias"),
           rename("mlp.fc1.weight", "intermediate.dense.weight"),
           rename("mlp.fc1.bias", "intermediate.dense.bias"),
           rename("mlp.fc2.weight", "output.dense.weight"),
           rename("mlp.fc2.bias", "output.dense.bias"),
           rename("mlp_norm.weight", "output.LayerNorm.weight"),
           rename("mlp_norm.bias", "output.LayerNorm.bias"),
           *(Rule((f"attention.qkv.{kind}",),
                  tuple(f"attention.self.{name}.{kind}" for name in ("query", "key", "value")),
                  _qkv_from_separate, _qkv_to_separate) for kind in ("weight", "bias"))),
    before=(rename("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
           rename("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
           rename("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
           rename("embedding.norm.weight", "bert.embeddings.LayerNorm.weight"),
           rename("embedding.norm.bias", "bert.embeddings.LayerNorm.bias"),
           rename("pooler.weight", "bert.pooler.dense.weight"),
           rename("pooler.bias", "bert.pooler.dense.bias"),
           rename("lm_transform.weight", "cls.predictions.transform.dense.weight"),
           rename("lm_transform.bias", "cls.predictions.transform.dense.bias"),
           rename("lm_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
           rename("lm_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
           rename("lm_bias", "cls.predictions.bias"),
           rename("binary_head.weight", "cls.seq_relationship.weight"),
           rename("binary_head.bias", "cls.seq_relationship.bias")),
    # the decoder Hugging Face ties to the word embedding: written, never read
    after=(Rule(("embedding.word_embeddings.weight",), ("cls.predictions.decoder.weight",), to_ours=None),
           Rule(("lm_bias",), ("cls.predictions.decoder.bias",), to_ours=None)))
bert_from_hf, bert_to_hf = BERT_WEIGHTS.from_hf, BERT_WEIGHTS.to_hf  # ``BertForPreTraining``'s state dict


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
