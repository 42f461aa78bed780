"""The fused cross-entropy (``--cross-entropy-loss-fusion``) against the unfused path and PyTorch's.

References: the unfused vocabulary-parallel path (``--no-cross-entropy-loss-fusion``) and
``torch.nn.functional.cross_entropy`` in fp64. The logits end in -inf columns, as
``parallel_lm_logits`` pads the vocabulary.

- Eager, t = 1: the chunked path runs the unfused path's own elementwise parts on each chunk of rows
  (same order of operations per row), so loss and gradient equal it bit for bit at every chunk size.
- Triton (its CPU interpreter): each row is summed in blocks with an online max and the exponentials
  come from another library, a few fp32 roundings apart (``assert_fp32_close``: 1e-6 relative); bf16
  gradients are the fp32 value rounded once (``assert_bf16_rounded``).
- Against fp64 PyTorch: a log-sum-exp over at most 9,000 fp32 terms, within 1e-6 relative too.
- Memory, on the fake device at GPT-1.3B's head (8,192 tokens x 50,304, bf16): no fp32 tensor larger
  than one chunk, and nothing but the logits kept from forward to backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import assert_bf16_rounded, assert_fp32_close, eager_backend, family, grads  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megapipe.cli.parse import parse_config
from megapipe.fusions import fused_cross_entropy
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megapipe.testing.fake_device import FAKE_DEVICE, DeviceMemory, fake_accelerator
from model_families import MODEL_KIND, family_config

pytestmark = pytest.mark.unit

ROWS, PADDING = 13, 7


def padded_logits(vocab: int, dtype=torch.float32, seed: int = 0, tokens: tuple = (ROWS,)):
    """Logits [*tokens, vocab] whose last PADDING columns are -inf, targets among the real ones, a loss gradient."""
    g = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(*tokens, vocab, generator=g)
    logits[..., vocab - PADDING:] = float("-inf")
    target = torch.randint(0, vocab - PADDING, tokens, generator=g)
    return logits.to(dtype), target, torch.rand(tokens, generator=g)


def loss_and_grad(logits, target, grad_loss, fused, vocab_start=0):
    leaf = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(leaf, target, None, vocab_start, fused=fused)
    (grad,) = grads(loss, grad_loss, leaf)
    return loss.detach(), grad


def fp64_reference(logits, target, grad_loss):
    leaf = logits.double().requires_grad_()
    loss = F.cross_entropy(leaf, target, reduction="none")
    (grad,) = grads(loss, grad_loss.double(), leaf)
    return loss.detach().float(), grad.float()


@pytest.mark.parametrize("chunk_rows", [1, 5, ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_equals_unfused_bit_for_bit(eager_backend, monkeypatch, chunk_rows, dtype):
    vocab = 50
    monkeypatch.setattr(fused_cross_entropy, "CHUNK_BYTES", chunk_rows * 4 * vocab)
    logits, target, grad_loss = padded_logits(vocab, dtype)
    fused = loss_and_grad(logits, target, grad_loss, fused=True)
    unfused = loss_and_grad(logits, target, grad_loss, fused=False)
    assert fused[1].dtype == dtype
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
    reference = fp64_reference(logits, target, grad_loss)
    assert_fp32_close(fused[0], reference[0])
    if dtype == torch.float32:
        assert_fp32_close(fused[1], reference[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernels_match_the_unfused_path_and_pytorch(family, dtype):
    """9,000 columns: three blocks of the Triton kernels' 4,096, the last one partial."""
    logits, target, grad_loss = padded_logits(9000, dtype, seed=1)
    fused = loss_and_grad(logits, target, grad_loss, fused=True)
    unfused = loss_and_grad(logits, target, grad_loss, fused=False)
    reference = fp64_reference(logits, target, grad_loss)
    assert_fp32_close(fused[0], unfused[0])
    assert_fp32_close(fused[0], reference[0])
    if dtype == torch.float32:
        assert_fp32_close(fused[1], unfused[1])
        assert_fp32_close(fused[1], reference[1])
    else:
        assert_bf16_rounded(fused[1], reference[1], family)


def test_kernel_row_sums_on_a_vocabulary_slice(family):
    """A slice [100, 150) of the vocabulary: the targets outside it give 0 as their logit and a row
    of padding alone gives max -inf and sum 0; the others are the slice's max and sum of exp(z - max)."""
    logits, target, _ = padded_logits(50, seed=2)
    logits[3] = float("-inf")
    target = target + 100 * (torch.arange(ROWS) % 2)  # odd rows' targets in the slice, even rows' below it
    stats = fused_cross_entropy.row_stats(logits, target, 100)
    real = logits[:, :50 - PADDING].double()
    row_max = real.max(-1).values
    sums = (real - row_max.clamp(min=-1e300).unsqueeze(-1)).exp().sum(-1)
    picked = torch.where(target >= 100, logits.gather(-1, (target % 100).unsqueeze(-1)).squeeze(-1), 0.0)
    assert torch.equal(stats[0], row_max.float())
    assert_fp32_close(stats[1], sums.float())
    assert torch.equal(stats[2], picked)
    assert stats[0, 3] == float("-inf") and stats[1, 3] == 0


@pytest.mark.parametrize("transposed", [False, True])
def test_overwriting_the_logits_reuses_their_memory(eager_backend, transposed):
    """Also for logits [b, s, V] handed over as [s, b, V] (the benchmark harness's): their rows are read
    in memory order, without a copy."""
    logits, target, grad_loss = padded_logits(50, tokens=(ROWS, 3))  # [b, s, V]
    x = logits.requires_grad_()
    kept = x * 1.0  # an intermediate of the graph, as the models' logits are
    if transposed:
        kept, target, grad_loss = kept.transpose(0, 1), target.t(), grad_loss.t()
    loss = vocab_parallel_cross_entropy(kept, target, None, 0, overwrite_logits=True)
    (grad,) = grads(loss, grad_loss, kept)
    assert grad.data_ptr() == kept.data_ptr() and grad.stride() == kept.stride()
    unfused = loss_and_grad(x.detach().transpose(0, 1) if transposed else x.detach(), target, grad_loss, fused=False)
    assert torch.equal(loss, unfused[0]) and torch.equal(grad, unfused[1])


def test_a_later_reader_of_overwritten_logits_fails_loudly(eager_backend):
    """A user of the logits whose backward runs after the loss's (made before it) raises instead of
    reading gradients."""
    logits, target, _ = padded_logits(50)
    kept = logits.clone().requires_grad_() * 1.0
    square = (kept * kept).sum()
    loss = vocab_parallel_cross_entropy(kept, target, None, 0, overwrite_logits=True).sum() + square
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class _LargestFloat32(TorchDispatchMode):
    """The most elements of any fp32 tensor an operation returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


def head_memory(fused: bool, tokens: int = 8192, vocab: int = 50304) -> dict:
    """Bytes on the fake device around the loss of bf16 logits [tokens, vocab]: its forward peak and
    its backward peak (each above what existed before), what it keeps from one to the other, and its
    largest fp32 tensor in elements."""
    with fake_accelerator(), DeviceMemory() as memory, _LargestFloat32() as largest:
        logits = torch.empty(tokens, vocab, dtype=torch.bfloat16, device=FAKE_DEVICE)
        logits = (logits * 1.0).requires_grad_()
        target = torch.zeros(tokens, dtype=torch.long, device=FAKE_DEVICE)
        before = memory.current
        memory.reset_peak()
        loss = vocab_parallel_cross_entropy(logits, target, None, 0, fused=fused, overwrite_logits=True)
        forward = memory.peak - before
        kept = memory.current - before
        memory.reset_peak()
        torch.autograd.grad(loss, logits, torch.ones_like(loss))
        backward = memory.peak - before
    return dict(forward=forward, kept=kept, backward=backward, largest_fp32=largest.largest)


def test_no_fp32_copy_of_the_logits_at_gpt_1_3b(eager_backend):
    """Unfused: an fp32 copy and the fp32 shifted logits at once (3.07 GiB), the fp32 softmax kept
    (1.54 GiB), and a bf16 gradient beside it; fused: one chunk at a time (at most three chunks' fp32
    alive across a loop step) and four fp32 numbers per token."""
    tokens, vocab = 8192, 50304
    full = tokens * vocab * 4
    unfused, fused = head_memory(False), head_memory(True)
    assert unfused["largest_fp32"] == tokens * vocab and unfused["forward"] >= 2 * full
    assert unfused["kept"] >= full
    assert fused["largest_fp32"] <= fused_cross_entropy.CHUNK_BYTES // 4
    chunks, per_token = 3 * fused_cross_entropy.CHUNK_BYTES, 64 * tokens
    assert fused["forward"] <= chunks + per_token and fused["backward"] <= chunks + per_token
    assert fused["kept"] <= per_token


def tiny_model_loss_and_grads(kind: str, fusion: bool) -> list[torch.Tensor]:
    config = family_config(kind, num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=8,
                           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=16,
                           cross_entropy_loss_fusion=fusion)
    model = build_model_chunks(MODEL_KIND[kind], config, ParallelState.single())[0]
    g = torch.Generator().manual_seed(5)
    batch = {"tokens": torch.randint(0, 100, (2, 8), generator=g), "labels": torch.randint(0, 100, (2, 8), generator=g),
             "loss_mask": (torch.rand(2, 8, generator=g) > 0.3).float()}
    if kind == "bert":
        batch.update(types=torch.zeros(2, 8, dtype=torch.long), padding_mask=torch.ones(2, 8, dtype=torch.long),
                     is_random=torch.tensor([0, 1]))
    loss = model(None, batch)
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", ["gpt", "bert", "moe"])
def test_flag_chooses_the_path_and_both_train_the_same(eager_backend, monkeypatch, kind):
    """``--no-cross-entropy-loss-fusion`` turns the field off and the unfused path runs; a GPT, a BERT and
    a Llama-shaped MoE compute the same loss and gradients bit for bit either way (the eager fused path is
    the unfused one's maths, row by row)."""
    assert parse_config("gpt", []).model.cross_entropy_loss_fusion
    assert not parse_config("gpt", ["--no-cross-entropy-loss-fusion"]).model.cross_entropy_loss_fusion
    calls = []
    row_stats = fused_cross_entropy.row_stats
    monkeypatch.setattr(fused_cross_entropy, "row_stats", lambda *args: calls.append(args) or row_stats(*args))
    fused = tiny_model_loss_and_grads(kind, True)
    assert len(calls) == 1
    unfused = tiny_model_loss_and_grads(kind, False)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
