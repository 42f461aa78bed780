"""The fused cross-entropy over vocabulary slices equals the unfused one and PyTorch's at t in {1, 2, 4}.

One world of 4 gloo processes runs every case: t = 1 (each rank alone), t = 2 (two groups of 2) and
t = 4. Every rank holds the same logits [13, 256], of which the last 106 columns are -inf, as
``parallel_lm_logits`` pads a vocabulary of 150 (at t = 4 the last slice is padding alone), takes its
slice, and computes loss and gradient fused and unfused; the slices of the gradient are gathered.

Tolerance: fp32 1e-6 relative (``assert_fp32_close``). The fused path sums each slice relative to its
own max and rescales the sum once by exp(m - M) before the all-reduce, where the unfused one shifts by
M first: a few fp32 roundings of a log-sum-exp over 150 terms. bf16 logits (t = 2): the loss is fp32
arithmetic on the same values (1e-6), the gradient the fp32 one rounded once to bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fusion_helpers import assert_bf16_rounded, assert_fp32_close

from megapipe.fusions import backend
from megapipe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

ROWS, PADDED, VOCAB = 13, 256, 150
CASES = [(1, torch.float32), (2, torch.float32), (4, torch.float32), (2, torch.bfloat16)]


def whole(dtype):
    """The full logits, targets and loss gradient every rank starts from."""
    g = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(ROWS, PADDED, generator=g)
    logits[:, VOCAB:] = float("-inf")
    return logits.to(dtype), torch.randint(0, VOCAB, (ROWS,), generator=g), torch.rand(ROWS, generator=g)


def tensor_groups(rank: int) -> dict:
    """Each t's tensor group of this rank (None at t = 1), made on every rank in the same order."""
    groups = {1: None}
    for t in (2, 4):
        for first in range(0, 4, t):
            made = dist.new_group(list(range(first, first + t)))
            if rank // t * t == first:
                groups[t] = made
    return groups


def sliced_loss_and_grad(logits, target, grad_loss, group, t: int, rank: int, fused: bool):
    """This rank's loss and its gradient slice gathered over the tensor group into [ROWS, PADDED]."""
    width = PADDED // t
    start = rank % t * width
    piece = logits[:, start:start + width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(piece, target, group, start, fused=fused)
    loss.backward(grad_loss)
    pieces = [piece.grad] if group is None else [torch.empty_like(piece.grad) for _ in range(t)]
    if group is not None:
        dist.all_gather(pieces, piece.grad.contiguous(), group=group)
    return loss.detach(), torch.cat(pieces, dim=-1)


def run_cases(rank: int, world_size: int) -> dict:
    backend.activate(backend.FusionBackend("eager", "test"))
    groups = tensor_groups(rank)
    results = {}
    for t, dtype in CASES:
        logits, target, grad_loss = whole(dtype)
        results[t, dtype] = {fused: sliced_loss_and_grad(logits, target, grad_loss, groups[t], t, rank, fused)
                             for fused in (True, False)}
    return results


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(4, run_cases, timeout=240)


def fp32_reference(dtype):
    logits, target, grad_loss = whole(dtype)
    leaf = logits.double().requires_grad_()
    loss = F.cross_entropy(leaf, target, reduction="none")
    loss.backward(grad_loss.double())
    return loss.detach().float(), leaf.grad.float()


@pytest.mark.parametrize("t,dtype", CASES, ids=lambda case: str(case).removeprefix("torch."))
def test_fused_equals_unfused_and_pytorch(world, t, dtype):
    reference_loss, reference_grad = fp32_reference(dtype)
    for rank, results in enumerate(world):
        (loss, grad), (unfused_loss, unfused_grad) = results[t, dtype][True], results[t, dtype][False]
        assert_fp32_close(loss, unfused_loss)
        assert_fp32_close(loss, reference_loss)
        assert grad.dtype == dtype, f"rank {rank}"
        if dtype == torch.float32:
            assert_fp32_close(grad, unfused_grad)
            assert_fp32_close(grad, reference_grad)
        else:
            assert_bf16_rounded(grad, reference_grad)
        assert torch.equal(grad[:, VOCAB:], torch.zeros_like(grad[:, VOCAB:])), f"rank {rank}: padding has no gradient"
