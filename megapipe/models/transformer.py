"""One transformer layer in the ``[s, b, h]`` layout, split across the tensor group.

Self-attention: column-parallel QKV (each tensor rank owns whole heads, or whole query groups
under grouped-query attention), optional rotary positions, the attention core on the local
heads, a row-parallel output projection. MLP: column-parallel h -> ffn, GeLU or SwiGLU,
row-parallel ffn -> h. Two all-reduces forward and two backward per layer (seed 002 4.2.3).
``post_layernorm`` selects the original BERT arrangement (norm after each residual add)
instead of GPT's pre-norm. With ``--qk-layernorm`` queries and keys are normalised per head
(Qwen3) or over their whole projections (OLMoE) before RoPE. With ``--num-experts`` the layers
``--moe-layer-freq`` picks have a mixture of experts (``models/moe``) instead of the dense MLP.
Under context parallelism (``--context-parallel-size``) the layer holds s/c tokens of each
sequence and only the attention core talks to the other context ranks.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.context_parallel import context_attention
from megapipe.models.common import build_norm, dropout_add, output_std
from megapipe.models.mlp import MLP
from megapipe.models.moe import MoELayer
from megapipe.models.selective import recomputed, recomputed_masks, selective_recomputation
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megapipe.tensor_parallel.utils import divide


class SelfAttention(nn.Module):
    """Multi-head or grouped-query attention, optionally with rotary positions and a KV cache.

    QKV rows are ordered (group, [its query heads, key, value], head_dim): a contiguous split
    over the tensor group gives each rank whole query groups. With one group per head this is
    (head, {q, k, v}, head_dim), GPT-2's and BERT's layout.
    """

    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, sequence_parallel: bool,
                 device=None):
        super().__init__()
        self.config, self.ps = config, ps
        self.local_groups = divide(config.query_groups, ps.tp_size)
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.local_heads = self.local_groups * self.heads_per_group
        common = dict(seed=seed, sequence_parallel=sequence_parallel, dtype=config.params_dtype, device=device)
        qkv_width = (config.num_attention_heads + 2 * config.query_groups) * config.head_dim
        self.qkv = ColumnParallelLinear(config.hidden_size, qkv_width, ps, name=f"{name}.qkv",
                                        init_std=config.init_method_std,
                                        bias=config.add_bias_linear or config.add_qkv_bias, **common)
        self.dense = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, ps,
                                       name=f"{name}.dense", init_std=output_std(config), skip_bias_add=True,
                                       bias=config.add_bias_linear, regathers=self.qkv, **common)
        self.q_norm = self.k_norm = None
        if config.qk_layernorm:  # weights replicated, gradients partial per tensor rank (its heads): summed
            whole = config.qk_layernorm_scope == "projection"
            sizes = (config.hidden_size, config.query_groups * config.head_dim) if whole else (config.head_dim,) * 2
            self.q_norm, self.k_norm = (build_norm(config, device, True, size) for size in sizes)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, causal: bool, rotary=None,
                kv_cache=None):
        """``rotary``: the (cos, sin) tables of the positions; ``kv_cache``: this layer's cache when decoding."""
        qkv = self.qkv(x)  # [s, b, (heads + 2 groups) d / t]
        s, b = qkv.shape[0], qkv.shape[1]
        n, d = self.heads_per_group, self.config.head_dim
        # Views, not indexing: the backward pass concatenates the three gradients once instead of
        # zero-filling a [s, b, 3h] buffer for each and adding them.
        grouped = qkv.view(s, b, self.local_groups, n + 2, d).split((n, 1, 1), dim=3)
        q, k, v = (t.permute(1, 2, 3, 0, 4) for t in grouped)  # [b, groups, n | 1, s, d]
        if self.q_norm is not None:
            q, k = self._qk_norm(q, self.q_norm), self._qk_norm(k, self.k_norm)
        if rotary is not None:
            cos, sin = (table.unsqueeze(1) for table in rotary)  # [b, 1, 1, s, r]: over groups and their heads
            rope = functools.partial(fusions.apply_rope, fused=self.config.apply_rope_fusion)
            q, k = (recomputed(rope, t, cos, sin) for t in (q, k))
        # q [b, heads, s, d]: a view unless several heads share a group and neither RoPE nor a norm rewrote
        # q; k, v [b, groups, s, d], shared by a group's heads. Without a qk-norm, q's memory is in [s, b,
        # heads, d] order, which the flash and cuDNN kernels give their output too: the permute below is then
        # a view as well.
        q, k, v = q.flatten(1, 2), k.squeeze(2), v.squeeze(2)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        context = self.core_attention(q, k, v, attention_mask, causal)  # [b, heads, s, d]
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * d)
        return self.dense(context)

    def _qk_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        """``x`` [b, groups, heads per group, s, d] normalised per head, or over all its heads' channels together."""
        if self.config.qk_layernorm_scope == "head":
            return recomputed(norm, x)
        b, groups, n, s, d = x.shape
        whole = x.permute(0, 3, 1, 2, 4).reshape(b, s, groups * n * d)
        return recomputed(norm, whole).view(b, s, groups, n, d).permute(0, 2, 3, 1, 4)

    def core_attention(self, q, k, v, attention_mask, causal):
        """softmax(q k^T / sqrt(d) + mask) v on the local heads; dropout differs per tensor rank. Under
        context parallelism (``attention_mask`` is then ``ContextMasks``) the queries of this rank's
        tokens attend over the whole sequence through ``megapipe.context_parallel``."""
        if self.ps.cp_size > 1:
            return context_attention(q, k, v, self.ps.context_groups, seq_length=self.config.seq_length,
                                     causal=causal, scale=self.config.head_dim ** -0.5,
                                     key_padding=attention_mask.key_padding,
                                     document_ids=attention_mask.document_ids,
                                     sequence_documents=attention_mask.sequence_documents)
        dropout = self.config.attention_dropout if self.training else 0.0
        with self.ps.tensor_parallel_rng() if dropout > 0 else contextlib.nullcontext():
            return fusions.attention(q, k, v, attention_mask, causal=causal, dropout_p=dropout,
                                     training=self.training, fused=self.config.masked_softmax_fusion)


class TransformerLayer(nn.Module):
    """Attention and MLP blocks with residual connections, dropout and layer norms."""

    def __init__(self, config: ModelConfig, ps: ParallelState, layer_number: int, seed: int,
                 sequence_parallel: bool = False, device=None):
        super().__init__()
        self.config, self.ps, self.sequence_parallel = config, ps, sequence_parallel
        self.layer_number = layer_number
        name = f"layers.{layer_number}"
        self.attention_norm = build_norm(config, device, sequence_parallel)
        self.attention = SelfAttention(config, ps, f"{name}.attention", seed, sequence_parallel, device)
        self.mlp_norm = build_norm(config, device, sequence_parallel)
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(config, ps, f"{name}.mlp", seed, sequence_parallel, output_std(config), device)
        else:
            self.mlp = MLP(config, ps, f"{name}.mlp", seed, sequence_parallel, device)

    def _dropout_add(self, out, bias, residual):
        return dropout_add(out, bias, residual, self.config, self.training, self.ps, self.sequence_parallel)

    def _residual(self, branch_out, residual):
        out, bias = branch_out
        if self.training and self.config.hidden_dropout > 0:
            return recomputed_masks(self._dropout_add, self.ps, out, bias, residual)
        return self._dropout_add(out, bias, residual)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, causal: bool = True,
                rotary=None, kv_cache=None):
        """Under ``--recompute-granularity selective`` the norms' outputs and the dropout masks (and inside the
        blocks RoPE's and the activation's outputs) are recomputed in the backward pass (``models/selective.py``)."""
        with selective_recomputation(self.config.recompute_granularity == "selective" and self.training):
            if self.config.post_layernorm:
                x = recomputed(self.attention_norm,
                               self._residual(self.attention(x, attention_mask, causal, rotary, kv_cache), x))
                return recomputed(self.mlp_norm, self._residual(self.mlp(x), x))
            x = self._residual(self.attention(recomputed(self.attention_norm, x), attention_mask, causal, rotary,
                                              kv_cache), x)
            return self._residual(self.mlp(recomputed(self.mlp_norm, x)), x)
