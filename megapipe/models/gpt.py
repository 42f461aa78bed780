"""GPT: causal language model with learned absolute positions and (by default) tied embeddings."""

from __future__ import annotations

import torch

from megapipe.models.common import build_norm
from megapipe.models.sequence_loss import sequence_mean
from megapipe.models.stage import LanguageModelStage
from megapipe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapipe.tensor_parallel.layers import parallel_lm_logits


class GPTStage(LanguageModelStage):
    """Batch keys: ``tokens`` [b, s]; on the last stage ``labels`` and ``loss_mask`` [b, s]; for packed
    documents ``position_ids`` and ``document_ids`` [b, s]. Under context parallelism every ``s`` is this
    rank's s/c tokens.

    The last stage returns the mean loss over ``loss_mask`` of the whole sequence or, without labels, the logits
    ``[b, s, V/t]`` of this rank's vocabulary slice (``[b, 1, V/t]`` with ``last_logits_only``).
    """

    causal = True

    def build_head(self, seed: int, device) -> None:
        self.final_norm = build_norm(self.config, device, self.sequence_parallel)

    def attention_mask(self, batch: dict) -> torch.Tensor | None:
        """Inference passes its own mask (padding and causality over the cached positions); training's
        is the packed documents' (``--reset-attention-mask``), if any."""
        return batch["attention_mask"] if "attention_mask" in batch else super().attention_mask(batch)

    def head(self, hidden: torch.Tensor, batch: dict):
        if batch.get("last_logits_only"):  # decoding needs the next-token logits only
            hidden = hidden[-1:]
        hidden = self.final_norm(hidden)
        logits = parallel_lm_logits(hidden, self.output_weight(), self.ps, self.config.vocab_size,
                                    sequence_parallel=self.sequence_parallel)  # [s, b, V/t]
        if "labels" not in batch:
            return logits.transpose(0, 1)
        vocab_start = self.ps.tp_rank * logits.shape[-1]
        losses = vocab_parallel_cross_entropy(logits, batch["labels"].transpose(0, 1), self.ps.tp_group, vocab_start,
                                              fused=self.config.cross_entropy_loss_fusion, overwrite_logits=True)
        return sequence_mean(losses.transpose(0, 1), batch["loss_mask"], self.ps)
