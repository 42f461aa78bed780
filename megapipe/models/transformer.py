"""One transformer layer in the ``[s, b, h]`` layout, split across the tensor group.

Self-attention: column-parallel QKV (each tensor rank owns whole heads), the attention core
on the local heads, a row-parallel output projection. MLP: column-parallel h -> ffn, GeLU,
row-parallel ffn -> h. Two all-reduces forward and two backward per layer (seed 002 4.2.3).
``post_layernorm`` selects the original BERT arrangement (norm after each residual add)
instead of GPT's pre-norm.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.models.common import build_norm, dropout_add
from megapipe.models.recompute import checkpoint
from megapipe.parallel_state import ParallelState
from megapipe.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megapipe.tensor_parallel.utils import divide


def _output_std(config: ModelConfig) -> float:
    """Residual-branch outputs start smaller, as in GPT-2 and Megatron: std / sqrt(2 L)."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, sequence_parallel: bool,
                 device=None):
        super().__init__()
        self.config, self.ps = config, ps
        self.local_heads = divide(config.num_attention_heads, ps.tp_size)
        common = dict(seed=seed, sequence_parallel=sequence_parallel, dtype=config.params_dtype, device=device)
        # QKV rows are ordered (head, {q, k, v}, head_dim): a contiguous split gives whole heads.
        self.qkv = ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size, ps, name=f"{name}.qkv",
                                        init_std=config.init_method_std, **common)
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, ps, name=f"{name}.dense",
                                       init_std=_output_std(config), skip_bias_add=True, **common)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None, causal: bool):
        qkv = self.qkv(x)  # [s, b, 3 h / t]
        s, b = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.view(s, b, self.local_heads, 3, self.config.head_dim).permute(3, 1, 2, 0, 4).unbind(0)
        if self.config.recompute_granularity == "selective" and self.training:
            context = checkpoint(lambda q_, k_, v_: self.core_attention(q_, k_, v_, attention_mask, causal),
                                 self.ps, q, k, v)
        else:
            context = self.core_attention(q, k, v, attention_mask, causal)  # [b, heads, s, d]
        context = context.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.config.head_dim)
        return self.dense(context)

    def core_attention(self, q, k, v, attention_mask, causal):
        """softmax(q k^T / sqrt(d) + mask) v on the local heads; dropout differs per tensor rank."""
        dropout = self.config.attention_dropout if self.training else 0.0
        with self.ps.tensor_parallel_rng() if dropout > 0 else contextlib.nullcontext():
            return fusions.attention(q, k, v, attention_mask, causal=causal, dropout_p=dropout,
                                     training=self.training, fused=self.config.masked_softmax_fusion)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, sequence_parallel: bool,
                 device=None):
        super().__init__()
        self.config = config
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        common = dict(seed=seed, sequence_parallel=sequence_parallel, dtype=config.params_dtype, device=device)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, ps, name=f"{name}.fc1",
                                        init_std=config.init_method_std, skip_bias_add=True, **common)
        self.fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, ps, name=f"{name}.fc2",
                                     init_std=_output_std(config), skip_bias_add=True, **common)

    def forward(self, x: torch.Tensor):
        h, bias = self.fc1(x)
        h = fusions.bias_gelu(h, bias, self.approximate, fused=self.config.bias_gelu_fusion)
        return self.fc2(h)


class TransformerLayer(nn.Module):
    """Attention and MLP blocks with residual connections, dropout and layer norms."""

    def __init__(self, config: ModelConfig, ps: ParallelState, layer_number: int, seed: int,
                 sequence_parallel: bool = False, device=None):
        super().__init__()
        self.config, self.ps, self.sequence_parallel = config, ps, sequence_parallel
        name = f"layers.{layer_number}"
        self.attention_norm = build_norm(config, device, sequence_parallel)
        self.attention = SelfAttention(config, ps, f"{name}.attention", seed, sequence_parallel, device)
        self.mlp_norm = build_norm(config, device, sequence_parallel)
        self.mlp = MLP(config, ps, f"{name}.mlp", seed, sequence_parallel, device)

    def _residual(self, branch_out, residual):
        out, bias = branch_out
        return dropout_add(out, bias, residual, self.config, self.training, self.ps, self.sequence_parallel)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, causal: bool = True):
        if self.config.post_layernorm:
            x = self.attention_norm(self._residual(self.attention(x, attention_mask, causal), x))
            return self.mlp_norm(self._residual(self.mlp(x), x))
        x = self._residual(self.attention(self.attention_norm(x), attention_mask, causal), x)
        return self._residual(self.mlp(self.mlp_norm(x)), x)
