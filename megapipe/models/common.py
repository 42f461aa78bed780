"""Small pieces the model files share: norms, dropout + residual add, replicated linears."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.utils import init_normal_


def output_std(config: ModelConfig) -> float:
    """Residual-branch outputs start smaller, as in GPT-2 and Megatron: std / sqrt(2 L)."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


def build_norm(config: ModelConfig, device=None, sequence_parallel: bool = False,
               size: int | None = None) -> nn.Module:
    """LayerNorm or RMSNorm over the hidden size (or ``size`` channels; the fusion backend's kernel); marked
    when its gradient is partial on each tensor rank (it sees only a sequence slice, or only some heads)."""
    norm_class = fusions.RMSNorm if config.normalization == "RMSNorm" else fusions.LayerNorm
    norm = norm_class(size or config.hidden_size, eps=config.layernorm_epsilon, device=device,
                      dtype=config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel
    return norm


def dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, config: ModelConfig,
                training: bool, ps: ParallelState, sequence_parallel: bool) -> torch.Tensor:
    """residual + dropout(x + bias), fused unless ``--no-bias-dropout-fusion``.

    The residual stream is replicated across tensor ranks, so its dropout mask must be the
    same on each (default generator); under sequence parallelism each rank holds a different
    slice, so the mask comes from the per-rank stream.
    """
    p = config.hidden_dropout
    per_rank = sequence_parallel and training and p > 0
    with ps.tensor_parallel_rng() if per_rank else contextlib.nullcontext():
        return fusions.bias_dropout_add(x, bias, residual, p, training, fused=config.bias_dropout_fusion)


def replicated_linear(in_features: int, out_features: int, config: ModelConfig, name: str, seed: int,
                      device=None) -> nn.Linear:
    """An ``nn.Linear`` held whole by every tensor rank, initialised from its own stream."""
    layer = nn.Linear(in_features, out_features, device=device, dtype=config.params_dtype)
    init_normal_(layer.weight, (out_features, in_features), config.init_method_std, seed, f"{name}.weight")
    with torch.no_grad():
        layer.bias.zero_()
    return layer
