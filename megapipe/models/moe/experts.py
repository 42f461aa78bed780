"""The experts of one MoE layer, as stacked weights run on tokens sorted by expert.

Weights are stored with the expert dimension first, under the expert's global index:
``experts.fc1.weight`` [E, ffn (x 2 with SwiGLU: (gate, up) pairs), h] and ``experts.fc2.weight``
[E, h, ffn]. Expert rank r of e holds the slice [r E/e, (r+1) E/e) along dim 0 (marked
``expert_parallel``: its gradients are reduced over the expert-data-parallel group) and a
checkpoint reshards between any layouts by slicing that one dimension; expert-tensor parallelism
(``--expert-tensor-parallel-size``: t, the default, or 1) splits the ffn dimension (dim 1 of fc1,
dim 2 of fc2) as the dense MLP does.

The product runs as one grouped matrix product (``torch._grouped_mm``) where this build has it for
the tensors' device and dtype, else as a loop over the experts, each on its contiguous run of the
already permuted tokens (the loop needs the per-expert counts on the host: one synchronisation, none
when the dispatch padded every expert to its capacity);
its weight gradients wait for BW under zero-bubble schedules (``grouped_linear.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.models.moe.grouped_linear import Counts, grouped_linear
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.utils import divide, init_normal_, mark_expert_parallel, mark_tensor_parallel


class _Stacked(nn.Module):
    """One stacked weight, so its key reads ``experts.fc1.weight`` like a linear layer's."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def _expert_weight(shape: tuple[int, ...], std: float, name: str, partition_dim: int, ps: ParallelState,
                   seed: int, dtype, device) -> nn.Parameter:
    """This rank's experts' slice (dim 0, by expert rank) of a stacked weight, split along ``partition_dim``
    by expert-tensor rank, filled with its part of the full (seed, name) weight."""
    local = list(shape)
    local[0] = divide(shape[0], ps.ep_size)
    local[partition_dim] = divide(shape[partition_dim], ps.etp_size)
    rows = (ps.ep_rank * local[0], (ps.ep_rank + 1) * local[0])
    weight = init_normal_(torch.empty(local, dtype=dtype, device=device), shape, std, seed, name, partition_dim,
                          ps.etp_rank, ps.etp_size, rows=rows)
    param = nn.Parameter(weight)
    if ps.etp_size == ps.tp_size:  # split like the dense layers; below t each share of the tensor group
        mark_tensor_parallel(param, partition_dim)  # holds its own copy (whole experts at expert-tensor size 1)
    param.partition_dim = partition_dim  # over the expert-tensor group (``split_over``)
    mark_expert_parallel(param)
    return param


class GroupedExperts(nn.Module):
    """This expert rank's E/e MLPs (SwiGLU or GeLU, no biases) over tokens permuted so each expert's are contiguous."""

    def __init__(self, config: ModelConfig, ps: ParallelState, name: str, seed: int, output_std: float, device=None):
        super().__init__()
        self.config = config
        e, h, f = config.num_experts, config.hidden_size, config.expert_ffn_hidden_size
        width = 2 * f if config.swiglu else f
        common = dict(ps=ps, seed=seed, dtype=config.params_dtype, device=device)
        self.fc1 = _Stacked(_expert_weight((e, width, h), config.init_method_std, f"{name}.fc1.weight", 1, **common))
        self.fc2 = _Stacked(_expert_weight((e, h, f), output_std, f"{name}.fc2.weight", 2, **common))
        self.approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor, counts: Counts) -> torch.Tensor:
        """``x`` [N, h] sorted by expert, ``counts`` [E/e] tokens per local expert (one int: the same for each)
        -> [N, h] (a partial sum under t > 1)."""
        grouped = self.config.moe_grouped_gemm
        h = grouped_linear(x, self.fc1.weight, counts, grouped)
        if self.config.swiglu:
            h = fusions.swiglu(h, fused=self.config.bias_swiglu_fusion)
        else:
            h = fusions.bias_gelu(h, None, self.approximate, fused=self.config.bias_gelu_fusion)
        return grouped_linear(h, self.fc2.weight, counts, grouped)
