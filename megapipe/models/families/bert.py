"""BERT: a bidirectional encoder laid out as the original (post-LayerNorm), with token types, a
masked-LM head and a binary (sentence-order) head."""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.models import hf_mapping
from megapipe.models.bert import BERTStage, losses
from megapipe.models.families.family import Family, HFArchitecture

# what a BERT differs in from ModelConfig's defaults (Megatron's BERT: exact GeLU, epsilon 1e-12)
DEFAULTS = dict(layernorm_epsilon=1e-12, activation="gelu", post_layernorm=True, num_tokentypes=2)


def bert_model_config(hf_config, **overrides) -> ModelConfig:
    """A megapipe ModelConfig equal to a ``transformers.BertConfig``."""
    return ModelConfig(**{**DEFAULTS, "bert_binary_head": True, **hf_mapping.bert_fields(hf_config), **overrides})


BERT = HFArchitecture("bert", "BertForPreTraining", bert_model_config, hf_mapping.BERT_WEIGHTS,
                      hf_mapping.bert_hf_config, unsupported={"is_decoder": False, "add_cross_attention": False})

FAMILY = Family(name="bert", kind="bert", stage=BERTStage, defaults=DEFAULTS, hf=(BERT,), losses=losses)
