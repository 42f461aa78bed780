"""The model families the parity tests build: GPT, BERT, a Llama-shaped GPT and its mixture-of-experts twin.

``family_config(kind, **fields)`` gives each family's own options on top of the test's sizes: GPT's and
BERT's defaults from the model-family registry, and for "llama" the Llama options these tests exercise
(grouped-query attention with 2 groups, tied embeddings); ``MODEL_KIND`` is the stage class each family
is built with (a Llama is a GPT with other options).
"""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.models.families import family

MODEL_KIND = {"gpt": "gpt", "bert": "bert", "llama": "gpt", "moe": "gpt"}

# RoPE, SwiGLU, grouped-query attention (2 groups), RMSNorm, no biases
LLAMA = dict(position_embedding_type="rope", swiglu=True, num_query_groups=2, normalization="RMSNorm",
             add_bias_linear=False)


# a Llama whose MLPs are mixtures of 4 experts, 2 per token, with both balancing losses weighing
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)


def family_config(kind: str, **fields) -> ModelConfig:
    """``fields`` (sizes, dropout, and for a Llama any of its options) override the family's."""
    if kind in ("llama", "moe"):
        return ModelConfig(**{**(LLAMA if kind == "llama" else MOE), **fields})
    return family(kind).model_config(**fields)
