"""The dense MLP: h -> ffn -> h, column-parallel then row-parallel over the tensor group."""

from __future__ import annotations

import torch
from torch import nn

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.models.common import output_std
from megapipe.models.selective import recomputed
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """h -> ffn -> h with GeLU, or with SwiGLU: fc1 then writes (gate, up) pairs, 2 ffn wide,
    so a contiguous tensor-parallel split gives each rank matching gate and up rows."""

    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, sequence_parallel: bool,
                 device=None, ffn_hidden_size: int | None = None):
        super().__init__()
        self.config = config
        ffn = ffn_hidden_size or config.ffn_hidden_size
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        common = dict(seed=seed, sequence_parallel=sequence_parallel, dtype=config.params_dtype, device=device,
                      bias=config.add_bias_linear)
        width = 2 * ffn if config.swiglu else ffn
        self.fc1 = ColumnParallelLinear(config.hidden_size, width, ps, name=f"{name}.fc1",
                                        init_std=config.init_method_std, skip_bias_add=True, **common)
        self.fc2 = RowParallelLinear(ffn, config.hidden_size, ps, name=f"{name}.fc2",
                                     init_std=output_std(config), skip_bias_add=True, regathers=self.fc1, **common)

    def forward(self, x: torch.Tensor):
        h, bias = self.fc1(x)
        return self.fc2(recomputed(self.activation, h, bias))  # under selective recomputation: not kept

    def activation(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """GeLU or SwiGLU of ``h + bias``."""
        if self.config.swiglu:
            return fusions.swiglu(h, bias, fused=self.config.bias_swiglu_fusion)
        return fusions.bias_gelu(h, bias, self.approximate, fused=self.config.bias_gelu_fusion)
