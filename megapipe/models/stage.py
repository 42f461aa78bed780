"""A pipeline stage of a language model: a contiguous range of transformer layers, the
embedding when it is the first stage and the task head when it is the last.

Layers are registered under their global index (``layers.5``), so the state dicts of all
stages of all ranks merge into the state dict of the whole model, whatever the split.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.layout.context import chunk_ranges
from megapipe.models.embedding import Embedding
from megapipe.models.masking import ContextMasks, dense_mask
from megapipe.models.recompute import checkpoint, recompute_groups
from megapipe.models.transformer import TransformerLayer
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.grad_accumulation import SUMMED_BY_AUTOGRAD
from megapipe.tensor_parallel.layers import _init_weight
from megapipe.tensor_parallel.utils import mark_tensor_parallel


class OutputEmbedding(nn.Module):
    """The output projection of a last stage that does not hold the input embedding.

    Tied: a copy of the word embedding (same initial values) whose gradient is summed with
    the first stage's over the embedding group. Untied: an independent weight.
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, seed: int, tied: bool, device=None):
        super().__init__()
        name = "embedding.word_embeddings" if tied else "output_layer"
        self.weight = _init_weight((config.padded_vocab_size(ps.tp_size), config.hidden_size),
                                   config.init_method_std, seed, f"{name}.weight", ps, 0, config.params_dtype, device)
        mark_tensor_parallel(self.weight, 0)
        self.weight.shared_embedding = tied


class LanguageModelStage(nn.Module, abc.ABC):
    """Runs ``hidden -> hidden`` for its layers; the first stage starts from token ids.

    ``forward(hidden, batch)`` takes the previous stage's output (ignored on the first
    stage) and the microbatch dict; the last stage returns what its head returns.
    """

    causal = True

    def __init__(self, config: ModelConfig, ps: ParallelState, layer_start: int, layer_end: int,
                 pre_process: bool, post_process: bool, seed: int = 1234, sequence_parallel: bool = False,
                 device=None):
        super().__init__()
        self.config, self.ps = config, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel
        self.layer_range = (layer_start, layer_end)
        self.embedding = Embedding(config, ps, seed, sequence_parallel, device) if pre_process else None
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(config, ps, i, seed, sequence_parallel, device)
            for i in range(layer_start, layer_end)})
        self.output_embedding = None
        if post_process and (not pre_process or config.untie_embeddings_and_output_weights):
            self.output_embedding = OutputEmbedding(config, ps, seed,
                                                    tied=not config.untie_embeddings_and_output_weights,
                                                    device=device)
        if pre_process and not post_process and not config.untie_embeddings_and_output_weights:
            self.embedding.word_embeddings.weight.tied_embedding = True  # its twin lives on the last stage
        if pre_process and post_process and not config.untie_embeddings_and_output_weights:
            # the lookup and the output layer both use it: autograd sums their gradients, as without the fusion
            setattr(self.embedding.word_embeddings.weight, SUMMED_BY_AUTOGRAD, True)
        if post_process:
            self.build_head(seed, device)

    def output_weight(self) -> torch.Tensor:
        """The vocab-parallel weight that turns hidden states into logits."""
        if self.output_embedding is not None:
            return self.output_embedding.weight
        return self.embedding.word_embeddings.weight

    def key_padding(self, batch: dict) -> torch.Tensor | None:
        """``[b, s]``, True where a token is padding that no query may attend to (None: no padding)."""
        return None

    def attention_mask(self, batch: dict) -> torch.Tensor | None:
        """Boolean mask broadcastable to ``[b, heads, s, s]``, True where attention is not allowed:
        padded keys and, for packed documents, keys of other documents."""
        return dense_mask(self.key_padding(batch), batch.get("document_ids"))

    def masking(self, batch: dict):
        """What the attention of every layer takes: ``attention_mask``, or per-token ``ContextMasks``
        under context parallelism (no rank builds a mask over the whole sequence)."""
        if self.ps.cp_size > 1:
            return ContextMasks(self.key_padding(batch), batch.get("document_ids"), batch.get("sequence_documents"))
        return self.attention_mask(batch)

    def positions(self, batch: dict, device) -> torch.Tensor | None:
        """``position_ids`` [b, s] of the batch (reset per document, or inference's); else under context
        parallelism the global positions of this rank's tokens [1, s/c]; else None (0..s-1)."""
        positions = batch.get("position_ids")
        if positions is None and self.ps.cp_size > 1:
            ranges = chunk_ranges(self.config.seq_length, self.ps.cp_size, self.ps.cp_rank)
            positions = torch.cat([torch.arange(a, b, device=device) for a, b in ranges]).unsqueeze(0)
        return positions

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor | None):
        """RoPE's (cos, sin) tables for ``positions`` [b, s] (None: 0..s-1), or None without RoPE."""
        if self.config.position_embedding_type != "rope":
            return None
        if positions is None:
            s = hidden.shape[0] * (self.ps.tp_size if self.sequence_parallel else 1)
            positions = torch.arange(s, device=hidden.device).unsqueeze(0)
        return fusions.rotary_tables(positions, self.config.rotary_dim, self.config.rotary_base, hidden.dtype)

    def forward(self, hidden: torch.Tensor | None, batch: dict):
        """With ``attention_mask`` in the batch (inference), that mask replaces the causal one;
        with ``kv_cache`` the layers attend over the cached keys and values too."""
        device = batch["tokens"].device if self.pre_process else hidden.device
        positions = self.positions(batch, device)
        if self.pre_process:
            hidden = self.embedding(batch["tokens"], positions, batch.get("types"))
        mask = self.masking(batch)
        causal = self.causal and "attention_mask" not in batch
        rotary = self.rotary(hidden, positions)
        cache = batch.get("kv_cache")
        layers = list(self.layers.values())
        for start, end, recompute in recompute_groups(self.config, len(layers)):
            run = self._layer_run(layers[start:end], mask, causal, rotary, cache)
            hidden = checkpoint(run, self.ps, hidden) if recompute and self.training else run(hidden)
        if self.post_process:
            return self.head(hidden, batch)
        return hidden

    def _layer_run(self, layers: list, mask, causal: bool, rotary, cache):
        def run(hidden):
            for layer in layers:
                layer_cache = cache.layer(layer.layer_number) if cache is not None else None
                hidden = layer(hidden, mask, causal, rotary, layer_cache)
            return hidden
        return run

    @abc.abstractmethod
    def build_head(self, seed: int, device) -> None:
        """Adds the last stage's head modules (after the layers, so parameters keep their order)."""

    @abc.abstractmethod
    def head(self, hidden: torch.Tensor, batch: dict):
        """The last stage's task head: the loss, or the logits without labels."""
