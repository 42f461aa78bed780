"""Input embedding of the first pipeline stage: words (vocab-parallel), learned positions (unless
RoPE or no positions), token types."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.common import build_norm
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel import mappings
from megapipe.tensor_parallel.layers import VocabParallelEmbedding
from megapipe.tensor_parallel.lookup import sequence_first_lookup
from megapipe.tensor_parallel.utils import init_normal_


def _replicated_embedding(num: int, dim: int, config: ModelConfig, name: str, seed: int, device) -> nn.Embedding:
    emb = nn.Embedding(num, dim, device=device, dtype=config.params_dtype)
    init_normal_(emb.weight, (num, dim), config.init_method_std, seed, f"{name}.weight")
    return emb


class Embedding(nn.Module):
    """Token ids ``[b, s]`` -> hidden states ``[s, b, h]`` (a sequence slice under sequence parallelism).

    Every lookup writes its rows in ``[s, b, h]`` order (``tensor_parallel/lookup.py``), so the sum needs no
    transposing copy. With ``post_layernorm`` (original BERT) a LayerNorm follows the sum, as in BERT.
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, seed: int, sequence_parallel: bool, device=None):
        super().__init__()
        self.config, self.ps, self.sequence_parallel = config, ps, sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size(ps.tp_size), config.hidden_size, ps,
                                                      name="embedding.word_embeddings", seed=seed,
                                                      init_std=config.init_method_std, dtype=config.params_dtype,
                                                      device=device)
        self.position_embeddings = (_replicated_embedding(config.max_position_embeddings, config.hidden_size, config,
                                                          "embedding.position_embeddings", seed, device)
                                    if config.position_embedding_type == "learned_absolute" else None)
        self.tokentype_embeddings = (_replicated_embedding(config.num_tokentypes, config.hidden_size, config,
                                                           "embedding.tokentype_embeddings", seed, device)
                                     if config.num_tokentypes else None)
        self.norm = build_norm(config, device, sequence_parallel) if config.post_layernorm else None

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [s, b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            x = x + sequence_first_lookup(position_ids, self.position_embeddings.weight)
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                tokentype_ids = torch.zeros_like(tokens)
            x = x + sequence_first_lookup(tokentype_ids, self.tokentype_embeddings.weight)
        if self.sequence_parallel:
            x = mappings.scatter_to_sequence_parallel_region(x, self.ps.tp_group)
        if self.norm is not None:
            x = self.norm(x)
        if self.training and self.config.hidden_dropout > 0:
            if self.sequence_parallel:
                with self.ps.tensor_parallel_rng():
                    x = F.dropout(x, self.config.hidden_dropout)
            else:
                x = F.dropout(x, self.config.hidden_dropout)
        return x
