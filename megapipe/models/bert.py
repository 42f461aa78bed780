"""BERT: bidirectional encoder with a padding mask, a masked-LM head and a binary
(sentence-order or next-sentence) head, laid out as the original BERT (post-LayerNorm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.loss_parts import LM_LOSS, with_parts
from megapipe.models.common import build_norm, replicated_linear
from megapipe.models.sequence_loss import first_rank_loss, sequence_mean
from megapipe.models.stage import LanguageModelStage
from megapipe.tensor_parallel import mappings
from megapipe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapipe.tensor_parallel.layers import parallel_lm_logits
from megapipe.tensor_parallel.utils import mark_tensor_parallel

LOSSES = (LM_LOSS, "sop loss")  # masked LM, then the binary head's (sentence order or next sentence)


def losses(config: ModelConfig) -> tuple[str, ...]:
    """The losses a BERT logs: masked LM and, with its binary head, the binary head's."""
    return LOSSES if config.bert_binary_head else LOSSES[:1]


class BERTStage(LanguageModelStage):
    """Batch keys: ``tokens``, ``types``, ``padding_mask`` (1 = real token) [b, s]; on the last
    stage ``labels`` (-1 where not predicted), ``loss_mask`` [b, s] and ``is_random`` [b].

    Under context parallelism ``s`` is this rank's s/c tokens and the losses are the whole sequence's
    (``megapipe.models.sequence_loss``). The last stage returns LM loss + binary loss (each attached as a part for logging, see
    ``megapipe.models.loss_parts``), or without labels the pair
    (LM logits ``[b, s, V/t]``, binary logits ``[b, 2]``).
    """

    causal = False

    def build_head(self, seed: int, device) -> None:
        config, h = self.config, self.config.hidden_size
        self.final_norm = None if config.post_layernorm else build_norm(config, device)
        self.pooler = replicated_linear(h, h, config, "pooler", seed, device)
        self.lm_transform = replicated_linear(h, h, config, "lm_head.dense", seed, device)
        self.lm_norm = build_norm(config, device)
        self.lm_bias = nn.Parameter(torch.zeros(config.padded_vocab_size(self.ps.tp_size) // self.ps.tp_size,
                                                dtype=config.params_dtype, device=device))
        mark_tensor_parallel(self.lm_bias, 0)
        self.binary_head = replicated_linear(h, 2, config, "binary_head", seed, device) \
            if config.bert_binary_head else None

    def key_padding(self, batch: dict) -> torch.Tensor:
        return batch["padding_mask"] == 0

    def head(self, hidden: torch.Tensor, batch: dict):
        if self.sequence_parallel:  # the heads need the first token and every position
            hidden = mappings.gather_from_sequence_parallel_region(hidden, self.ps.tp_group, grad_is_partial=False)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        approximate = "tanh" if self.config.activation == "gelu_tanh" else "none"
        x = self.lm_norm(F.gelu(self.lm_transform(hidden), approximate=approximate))
        lm_logits = parallel_lm_logits(x, self.output_weight(), self.ps,
                                       self.config.vocab_size, bias=self.lm_bias)  # [s, b, V/t]
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(torch.tanh(self.pooler(hidden[0])))
        if "labels" not in batch:
            return lm_logits.transpose(0, 1), binary_logits
        labels = batch["labels"].clamp(min=0).transpose(0, 1)
        vocab_start = self.ps.tp_rank * lm_logits.shape[-1]
        losses = vocab_parallel_cross_entropy(lm_logits, labels, self.ps.tp_group, vocab_start,
                                              fused=self.config.cross_entropy_loss_fusion,
                                              overwrite_logits=True).transpose(0, 1)
        lm_loss = sequence_mean(losses, batch["loss_mask"], self.ps)
        if binary_logits is None:
            return lm_loss
        # [CLS] is position 0: under context parallelism only context rank 0's first token
        sop_loss = first_rank_loss(F.cross_entropy(binary_logits.float(), batch["is_random"]), self.ps)
        return with_parts(lm_loss + sop_loss, dict(zip(LOSSES, (lm_loss, sop_loss))))
