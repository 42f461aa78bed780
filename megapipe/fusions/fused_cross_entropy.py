"""Cross-entropy's per-row sums and its gradient, one read of the logits each (``cross_entropy_loss_fusion``).

The unfused path keeps an fp32 copy of the whole [rows, V/t] logits from forward to backward (the
softmax, then the gradient). Here nothing of that size is made in fp32; per rank, around the
collectives that ``megapipe.tensor_parallel.cross_entropy`` runs over the tensor group:

    stats = row_stats(logits, target, vocab_start)     fp32 [3, rows]: this slice's max m, sum of
                                                       exp(z - m), the target's logit (0 off its rank)
    M = all-reduce MAX of m;  S = all-reduce SUM of sum * exp(m - M);  target logit all-reduce SUM
    loss = log(S) - (z_target - M)
  backward:
    softmax_gradient(logits, target, vocab_start, M, S, grad_loss, out)
        out = (exp(z - M) / S - onehot(target)) * grad_loss, in ``out``'s dtype; ``out`` may be the
        logits themselves, which then hold their own gradient

Under the Triton backend on CUDA the kernels of ``megapipe.fusions.triton_cross_entropy`` do each
step in one pass. Elsewhere the same maths runs in PyTorch over chunks of rows, each turned into fp32
by itself (at most ``CHUNK_BYTES``), through the elementwise parts of ``megapipe.fusions.cross_entropy``
(compiled under the torch.compile backend): at t = 1, whatever the chunks, every number equals the
unfused path's bit for bit (each row sees the same operations in the same order).
"""

from __future__ import annotations

import torch

from megapipe.fusions import cross_entropy as parts
from megapipe.fusions.backend import active_backend

CHUNK_BYTES = 32 * 2 ** 20  # the largest fp32 transient of the PyTorch path: one chunk of rows


def _row_chunks(logits: torch.Tensor):
    """Slices of ``logits``' rows whose fp32 copy fits ``CHUNK_BYTES`` (at least one row each)."""
    rows, cols = logits.shape
    step = max(1, CHUNK_BYTES // (4 * cols))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _triton(logits: torch.Tensor) -> bool:
    return active_backend().family("cross_entropy", logits) == "triton"


def row_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """fp32 [3, rows] for logits [rows, V/t] (unit stride along the vocabulary) and target [rows]: each
    row's max over this slice, sum of ``exp(z - max)`` over it, and target logit (0 off this slice).
    A row of this slice that is all -inf (padding) has max -inf and sum 0."""
    if _triton(logits):
        from megapipe.fusions import triton_cross_entropy

        return triton_cross_entropy.row_stats(logits, target, vocab_start)
    index, in_shard = parts.shard_target(target, vocab_start, vocab_start + logits.shape[-1])
    stats = torch.empty(3, logits.shape[0], dtype=torch.float32, device=logits.device)
    for rows in _row_chunks(logits):
        chunk = logits[rows]
        row_max = chunk.max(dim=-1).values.float()
        picked = chunk.gather(-1, index[rows].unsqueeze(-1)).squeeze(-1).float()
        shift = torch.where(row_max == float("-inf"), 0.0, row_max)
        _, sum_exp = parts.exp_and_sum_(parts.max_shifted_logits(chunk, shift))
        stats[0, rows], stats[1, rows] = row_max, sum_exp
        stats[2, rows] = torch.where(in_shard[rows], picked, 0.0)
    return stats


def softmax_gradient(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, logits_max: torch.Tensor,
                     sum_exp: torch.Tensor, grad_loss: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``(exp(z - logits_max) / sum_exp - onehot(target)) * grad_loss`` (fp32 [rows] each but
    target) into ``out``, rounded once to its dtype; ``out`` may be ``logits``."""
    if _triton(logits):
        from megapipe.fusions import triton_cross_entropy

        return triton_cross_entropy.softmax_gradient(logits, target, vocab_start, logits_max, sum_exp, grad_loss,
                                                     out)
    index, in_shard = parts.shard_target(target, vocab_start, vocab_start + logits.shape[-1])
    for rows in _row_chunks(logits):
        softmax = parts.normalize_exp_(parts.max_shifted_logits(logits[rows], logits_max[rows]).exp_(),
                                       sum_exp[rows])
        out[rows] = parts.softmax_minus_onehot_(softmax, index[rows], in_shard[rows], grad_loss[rows])
    return out
