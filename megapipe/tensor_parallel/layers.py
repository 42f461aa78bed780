"""Linear layers and the embedding split across the tensor-parallel group (seed 002 4.2.3).

``ColumnParallelLinear`` splits the output features (weight rows), ``RowParallelLinear`` the
input features (weight columns), ``VocabParallelEmbedding`` the vocabulary. Each rank fills
its slice, on its device, from the blocks of a per-parameter stream that cover it (see
``utils.init_normal_``), so the model is the same function for every tensor size.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.column_input import ColumnInput
from megapipe.tensor_parallel.fp8_linear import parallel_linear, sequence_scattered_linear
from megapipe.tensor_parallel.split_backward import linear
from megapipe.tensor_parallel import mappings
from megapipe.tensor_parallel.lookup import sequence_first_lookup
from megapipe.tensor_parallel.utils import divide, init_normal_, mark_tensor_parallel


def _init_weight(shape, std, seed, name, ps, partition_dim, dtype, device) -> nn.Parameter:
    """This tensor rank's slice of the (seed, name) weight, allocated and filled on ``device``."""
    local = list(shape)
    if partition_dim is not None:
        local[partition_dim] = divide(local[partition_dim], ps.tp_size)
    weight = torch.empty(local, dtype=dtype, device=device)
    return nn.Parameter(init_normal_(weight, shape, std, seed, name, partition_dim, ps.tp_rank, ps.tp_size))


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: each rank computes its slice of the outputs.

    The input enters through f (or, with sequence parallelism, an all-gather along the
    sequence), whose backward collectives run behind the products (``column_input.py``). ``gather_output`` all-gathers the result; ``skip_bias_add`` returns the bias
    separately so the caller can fuse it into the next element-wise op.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, *, name: str, seed: int,
                 init_std: float, bias: bool = True, gather_output: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        self.ps, self.gather_output, self.skip_bias_add = ps, gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.column_input = ColumnInput(ps.tp_group, sequence_parallel)
        local_out = divide(out_features, ps.tp_size)
        self.weight = _init_weight((out_features, in_features), init_std, seed, f"{name}.weight", ps, 0, dtype, device)
        mark_tensor_parallel(self.weight, 0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(local_out, dtype=dtype, device=device))
            mark_tensor_parallel(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        y = parallel_linear(x, self.weight, bias, self.column_input)  # FP8 under --fp8-format
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.ps.tp_group)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: partial products are summed by g (or reduce-scattered).

    The input is expected already split along its last dimension (``input_is_parallel``),
    as it comes out of a column-parallel layer. The bias is a replica, added after the sum.
    ``regathers``: the column-parallel layer whose output feeds this one (through attention or an
    activation), whose sequence-parallel input the backward gathers again from this layer's backward on.
    """

    def __init__(self, in_features: int, out_features: int, ps: ParallelState, *, name: str, seed: int,
                 init_std: float, bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, regathers: Optional[ColumnParallelLinear] = None,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.ps, self.input_is_parallel, self.skip_bias_add = ps, input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        # the column-parallel product before this one in the layer, whose input the backward starts to gather
        # again when this product's output gradient arrives (``column_input.py``)
        self.regathers = None if regathers is None else regathers.column_input
        divide(in_features, ps.tp_size)
        self.weight = _init_weight((out_features, in_features), init_std, seed, f"{name}.weight", ps, 1, dtype, device)
        mark_tensor_parallel(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.ps.tp_group)
        if self.sequence_parallel:  # a collective matmul where the overlap is on (``collective_matmul.py``)
            y = sequence_scattered_linear(x, self.weight, self.ps.tp_group)
        else:
            y = mappings.reduce_from_tensor_parallel_region(parallel_linear(x, self.weight), self.ps.tp_group)
        if self.regathers is not None:
            self.regathers.regather_early(y)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the padded vocabulary) are split across the tensor group.

    Each rank looks up the ids in its range, zeroes the others, and g sums the partial
    embeddings. Ids ``[b, s]`` give ``[s, b, h]``, written in that order (``lookup.py``). With
    ``reduce_scatter`` (sequence parallelism) the sum is reduce-scattered along the sequence instead.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ps: ParallelState, *, name: str, seed: int,
                 init_std: float, dtype=torch.float32, device=None):
        super().__init__()
        self.ps = ps
        self.num_embeddings = num_embeddings
        per_rank = divide(num_embeddings, ps.tp_size)
        self.vocab_start = ps.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = _init_weight((num_embeddings, embedding_dim), init_std, seed, f"{name}.weight", ps, 0,
                                   dtype, device)
        mark_tensor_parallel(self.weight, 0)

    def forward(self, ids: torch.Tensor, reduce_scatter: bool = False) -> torch.Tensor:
        if self.ps.tp_size == 1:
            return sequence_first_lookup(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = sequence_first_lookup(local_ids, self.weight).masked_fill(outside.t().unsqueeze(-1), 0.0)
        if reduce_scatter:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.ps.tp_group)
        return mappings.reduce_from_tensor_parallel_region(partial, self.ps.tp_group)


def parallel_lm_logits(hidden: torch.Tensor, word_embeddings: torch.Tensor, ps: ParallelState, vocab_size: int,
                       bias: Optional[torch.Tensor] = None, sequence_parallel: bool = False) -> torch.Tensor:
    """Logits over this rank's vocabulary slice; never materialises the full vocabulary.

    Rows past the real ``vocab_size`` (padding for divisibility) get -inf, so the padding
    never takes probability mass and the model computes the same function for every t.
    """
    logits = linear(hidden, word_embeddings, bias, ColumnInput(ps.tp_group, sequence_parallel))
    per_rank = word_embeddings.shape[0]
    first_padded = vocab_size - ps.tp_rank * per_rank
    if first_padded < per_rank:  # in place: the matmul's backward does not need its output
        logits[..., max(first_padded, 0):] = float("-inf")
    return logits
