"""The pieces of context-parallel attention on one process: a block through the fused kernel with its
log-sum-exp against an explicit softmax, the log-sum-exp merge, the kernel calls a block needs, and
c = 1 against ``megapipe.fusions.attention``. Fully masked rows give output 0 and lse -inf and no NaN,
forward or backward. fp32 to 1e-5 of the largest magnitude: only the summation order differs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.context_parallel import blocks, context_attention, kernels
from megapipe.context_parallel.documents import document_calls
from megapipe.context_parallel.merge import merge
from megapipe.context_parallel.plan import block_calls, length
from megapipe.fusions.attention import attention
from megapipe.parallel.context import ContextGroups
from megapipe.testing.fake_device import FAKE_DEVICE, fake_accelerator

pytestmark = pytest.mark.unit

TOL = 1e-5
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def close(a, b, tol=TOL) -> bool:
    return ((a.double() - b.double()).abs().max() <= tol * b.double().abs().max().clamp(min=1)).item()


def finite(lse):
    return lse.masked_fill(lse == float("-inf"), 0)


def explicit(q, k, v, allowed, scale):
    """softmax(scale q k^T) v over the allowed keys, its lse; rows with none: 0 and -inf."""
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1))
    return probs @ v, lse


def inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (6, 10, 10))
    allowed = torch.rand(2, 1, 6, 10, generator=g) > 0.4
    allowed[0, 0, 2] = False  # a query that sees no key of this block
    allowed[1, 0, 5] = False
    return [t.to(device, dtype) for t in (q, k, v)] + [allowed.to(device)]


@pytest.mark.parametrize("device", DEVICES)
def test_block_with_lse_equals_explicit_softmax(device):
    q, k, v, allowed = inputs(device)
    out, lse = kernels.forward(q, k, v, causal=False, allowed=allowed, scale=0.3)
    want, want_lse = explicit(q.cpu(), k.cpu(), v.cpu(), allowed.cpu(), 0.3)
    assert close(out.cpu(), want) and torch.equal(torch.isinf(lse.cpu()), torch.isinf(want_lse))
    assert close(finite(lse.cpu()), finite(want_lse))
    assert (out[0, :, 2] == 0).all() and (lse[0, :, 2] == float("-inf")).all()


@pytest.mark.parametrize("device", DEVICES)
def test_block_backward_equals_autograd_of_explicit_softmax(device):
    q, k, v, allowed = inputs(device)
    leaves = [t.cpu().requires_grad_() for t in (q, k, v)]
    want, _ = explicit(*leaves, allowed.cpu(), 0.3)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dout)
    out, lse = kernels.forward(q, k, v, causal=False, allowed=allowed, scale=0.3)
    grads = kernels.backward(dout.to(device), q, k, v, out, lse, causal=False, allowed=allowed, scale=0.3)
    assert all(torch.isfinite(g).all() for g in grads)
    assert all(close(g.cpu(), w) for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, 2 ** -6)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_causal_block_without_mask(device, dtype, tol):
    """The kernel's own causal mask (on CUDA in bf16: the flash kernel), forward and backward; bf16
    against fp32 maths on the same inputs: a few bf16 roundings (2^-8) of averages of unit values."""
    q, k, v, _ = inputs(device, dtype)
    k, v = k[:, :, :6], v[:, :, :6]
    leaves = [t.cpu().float().requires_grad_() for t in (q, k, v)]
    want, want_lse = explicit(*leaves, torch.ones(6, 6, dtype=torch.bool).tril(), 0.3)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dout)
    out, lse = kernels.forward(q, k, v, causal=True, allowed=None, scale=0.3)
    grads = kernels.backward(dout.to(device, dtype), q, k, v, out, lse, causal=True, allowed=None, scale=0.3)
    assert close(out.cpu(), want, tol) and close(lse.cpu(), want_lse, tol)
    assert all(close(g.cpu(), w, tol) for g, w in zip(grads, want_grads))


def test_merge_of_two_key_blocks_equals_attention_over_both():
    q, k, v, allowed = inputs("cpu")
    allowed[:, :, 4, :5] = False  # row 4 sees nothing in the first block, something in the second
    allowed[:, :, 2] = False     # row 2 sees nothing in either: stays 0 and -inf
    first = explicit(q, k[:, :, :5], v[:, :, :5], allowed[..., :5], 0.3)
    second = explicit(q, k[:, :, 5:], v[:, :, 5:], allowed[..., 5:], 0.3)
    empty = (torch.zeros_like(first[0]), torch.full_like(first[1], float("-inf")))
    out, lse = merge(*merge(*empty, *first), *second)
    want, want_lse = explicit(q, k, v, allowed, 0.3)
    assert close(out, want) and torch.isfinite(out).all()
    assert torch.equal(lse == float("-inf"), want_lse == float("-inf")) and (lse[:, :, 2] == float("-inf")).all()
    assert close(finite(lse), finite(want_lse))


def test_one_rank_equals_fused_attention_with_gqa_and_documents():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, 12, 8, generator=g).requires_grad_() for n in (4, 2, 2))
    documents = torch.tensor([[0] * 7 + [1] * 5, [0] * 12])
    got = context_attention(q, k, v, ContextGroups.single(), seq_length=12, causal=True, scale=0.3,
                            document_ids=documents)
    want = attention(q, k, v, (documents[:, :, None] != documents[:, None, :]).unsqueeze(1), causal=True, scale=0.3)
    dout = torch.randn_like(want)
    assert close(got, want)
    assert all(close(a, b) for a, b in zip(torch.autograd.grad(got, (q, k, v), dout),
                                           torch.autograd.grad(want, (q, k, v), dout)))


def test_runs_on_the_fake_device_without_host_tensors():
    """Masks, positions and accumulators are made on the inputs' device (the fake device raises on a
    host tensor mixed with a device one), forward and backward."""
    with fake_accelerator():
        q = torch.randn(2, 4, 16, 8, device=FAKE_DEVICE, requires_grad=True)
        k, v = (torch.randn(2, 2, 16, 8, device=FAKE_DEVICE, requires_grad=True) for _ in range(2))
        documents = torch.zeros(2, 16, dtype=torch.long, device=FAKE_DEVICE)
        padding = torch.zeros(2, 16, dtype=torch.bool, device=FAKE_DEVICE)
        out = context_attention(q, k, v, ContextGroups.single(), seq_length=16, causal=True, scale=0.3,
                                document_ids=documents, key_padding=padding)
        out.sum().backward()
    assert out.device == FAKE_DEVICE and k.grad.shape == k.shape


@st.composite
def layouts(draw):
    """Two sides of a block: some chunks of a sequence each, in any order."""
    chunks, size = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    ranges = [(i * size, (i + 1) * size) for i in range(chunks)]
    side = st.lists(st.sampled_from(ranges), min_size=1, max_size=chunks, unique=True)
    return tuple(draw(side)), tuple(draw(side))


@settings(max_examples=200, deadline=None)
@given(layouts(), st.booleans())
def test_calls_cover_every_visible_pair_once(sides, causal):
    """The calls of a block cover each (query, key) pair a query may see exactly once; pairs it may not
    see only inside calls that apply the causal mask; blocks nobody sees give no call."""
    q, k = sides
    q_pos = [p for a, b in q for p in range(a, b)]
    k_pos = [p for a, b in k for p in range(a, b)]
    covered = torch.zeros(length(q), length(k), dtype=torch.int64)
    masked_ok = torch.zeros(length(q), length(k), dtype=torch.bool)
    for call in block_calls(q, k, causal):
        covered[call.q[0]:call.q[1], call.k[0]:call.k[1]] += 1
        masked_ok[call.q[0]:call.q[1], call.k[0]:call.k[1]] |= call.causal
        if call.diagonal:
            assert q_pos[call.q[0]:call.q[1]] == k_pos[call.k[0]:call.k[1]]
    visible = torch.tensor([[not causal or kp <= qp for kp in k_pos] for qp in q_pos])
    assert (covered[visible] == 1).all()
    assert (covered[~visible] <= 1).all() and (masked_ok | (covered == 0))[~visible].all()


def test_masks_are_split_by_query_rows_within_the_bound(monkeypatch):
    """With a bound of 40 entries a [2, 12, 12] document and padding mask becomes calls of one query row
    each: every mask the kernels get stays within the bound, and the result is the unsplit one's (fp32:
    only which rows share a kernel call changes, so the key gradients' summation order)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, n, 12, 8, generator=g).requires_grad_() for n in (4, 2, 2))
    documents = torch.tensor([[0] * 7 + [1] * 5, [0] * 3 + [1] * 9])
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 10:] = True

    def run():
        out = context_attention(q, k, v, ContextGroups.single(), seq_length=12, causal=True, scale=0.3,
                                document_ids=documents, key_padding=padding)
        return out, torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    whole = run()
    masks = []
    forward = kernels.forward

    def recording(*args, allowed, **kwargs):
        masks.append(allowed.expand(2, 1, *allowed.shape[2:]).numel())
        return forward(*args, allowed=allowed, **kwargs)

    monkeypatch.setattr(blocks, "MASK_ELEMENTS", 40)
    monkeypatch.setattr(kernels, "forward", recording)
    split = run()
    assert len(masks) > 1 and max(masks) <= 40, masks
    assert close(split[0], whole[0]) and all(close(a, b) for a, b in zip(split[1], whole[1]))


@settings(max_examples=200, deadline=None)
@given(layouts(), st.booleans(), st.lists(st.integers(1, 5), min_size=1, max_size=8), st.integers(1, 2))
def test_document_calls_cover_exactly_the_pairs_of_one_document_without_masks(sides, causal, lengths, batch):
    """With the documents on the host every call is unmasked (full, or causal on a diagonal of equal
    positions, the kernel's own mask) and together they cover each pair a query may see (same document,
    and not after it under causal attention) exactly once, per sequence of the batch."""
    q, k = sides
    seq = max(end for _, end in q + k)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ids = torch.cat([ids, ids.new_full((max(0, seq - len(ids)),), len(lengths))])[:seq]
    documents = torch.stack([ids, ids.flip(0)][:batch])  # the second sequence's documents differ
    q_pos = [p for a, b in q for p in range(a, b)]
    k_pos = [p for a, b in k for p in range(a, b)]
    covered = torch.zeros(batch, length(q), length(k), dtype=torch.int64)
    for row, call in document_calls(q, k, causal, documents):
        rows, keys = call.q[1] - call.q[0], call.k[1] - call.k[0]
        seen = torch.ones(rows, keys, dtype=torch.int64)
        if call.causal:  # the kernel's own mask, on a square of the same positions
            assert call.diagonal and q_pos[call.q[0]:call.q[1]] == k_pos[call.k[0]:call.k[1]]
            seen = seen.tril()
        covered[row, call.q[0]:call.q[1], call.k[0]:call.k[1]] += seen
    for row in range(batch):
        visible = torch.tensor([[documents[row, qp] == documents[row, kp] and (not causal or kp <= qp)
                                 for kp in k_pos] for qp in q_pos])
        assert torch.equal(covered[row], visible.long())


def test_host_documents_reach_the_kernels_without_a_mask(monkeypatch):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, n, 12, 8, generator=g).requires_grad_() for n in (4, 2, 2))
    documents = torch.tensor([[0] * 7 + [1] * 5, [0] * 3 + [1] * 9])
    masks = []
    forward = kernels.forward

    def recording(*args, allowed, **kwargs):
        masks.append(allowed)
        return forward(*args, allowed=allowed, **kwargs)

    monkeypatch.setattr(kernels, "forward", recording)
    got = context_attention(q, k, v, ContextGroups.single(), seq_length=12, causal=True, scale=0.3,
                            document_ids=documents, sequence_documents=documents)
    want = attention(q, k, v, (documents[:, :, None] != documents[:, None, :]).unsqueeze(1), causal=True, scale=0.3)
    assert masks and all(mask is None for mask in masks)
    assert close(got, want)
    assert all(close(a, b) for a, b in zip(torch.autograd.grad(got, (q, k, v), torch.ones_like(got)),
                                           torch.autograd.grad(want, (q, k, v), torch.ones_like(want))))
