"""Fused scale+mask+softmax and the attention core equal independent fp64 references."""

from __future__ import annotations

import logging

import pytest
import torch
from fusion_helpers import assert_bf16_rounded, assert_fp32_close, grads
from fusion_helpers import eager_backend, family  # noqa: F401 (fixtures)

from megapipe import fusions
from megapipe.fusions import softmax as softmax_module

pytestmark = pytest.mark.unit

B, HEADS, SQ, SK = 3, 3, 7, 9
SCALE = 0.37


def _scores(dtype=torch.float32, sq=SQ, sk=SK, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = (3 * torch.randn(B, HEADS, sq, sk, generator=g)).to(dtype).requires_grad_()
    return scores, torch.randn(B, HEADS, sq, sk, generator=g).to(dtype)


def _padding_mask(sq=SQ, sk=SK, seed=1):
    """[b, 1, sq, sk]: random masked keys, and whole rows masked (padding queries)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, 1, sq, sk, generator=g) < 0.4
    mask[0, 0, 2, :] = True
    mask[2, 0, sq - 1, :] = True
    return mask


def _key_padding_mask(sk=SK):
    """[b, 1, 1, sk]: the last keys of each sequence are padding (BERT)."""
    lengths = torch.tensor([sk, sk - 3, 2])
    return (torch.arange(sk) >= lengths[:, None]).view(B, 1, 1, sk)


def _reference(scores, scale, mask, causal):
    """fp64 softmax over the unmasked keys of each row, 0 elsewhere and in fully masked rows.

    Written independently of the module: -inf fill, torch.softmax, then NaN rows set to 0.
    """
    x = scores.double() * scale
    sq, sk = x.shape[-2:]
    masked = torch.zeros(sq, sk, dtype=torch.bool)
    if causal:
        masked = masked | (torch.arange(sk)[None, :] > torch.arange(sq)[:, None])
    if mask is not None:
        masked = masked | mask
    probs = torch.softmax(x.masked_fill(masked, float("-inf")), dim=-1)
    return torch.where(masked.all(-1, keepdim=True), 0.0, probs)


MASKS = {
    "none": (lambda: None, False),
    "padding": (_padding_mask, False),
    "key_padding": (_key_padding_mask, False),
    "causal": (lambda: None, True),
    "causal_and_padding": (_key_padding_mask, True),
    "2d_mask": (lambda: torch.rand(SQ, SK, generator=torch.Generator().manual_seed(5)) < 0.5, False),
}


@pytest.mark.parametrize("case", sorted(MASKS))
@pytest.mark.parametrize("fused", [True, False])
def test_softmax_fp32_matches_fp64_reference(family, case, fused):
    make_mask, causal = MASKS[case]
    mask = make_mask()
    scores, g = _scores()
    probs = fusions.scale_mask_softmax(scores, SCALE, mask, causal, fused=fused)
    s64 = scores.detach().double().requires_grad_()
    expected = _reference(s64, SCALE, mask, causal)
    assert_fp32_close(probs, expected.float())
    (got,), (want,) = grads(probs, g, scores), grads(expected, g.double(), s64)
    assert torch.isfinite(want).all()
    assert_fp32_close(got, want.float())


def test_fully_masked_rows_are_zero_with_zero_gradient(family):
    scores, g = _scores()
    mask = _padding_mask()
    for fused in (True, False):
        probs = fusions.scale_mask_softmax(scores, SCALE, mask, fused=fused)
        (grad,) = grads(probs, g, scores)
        assert torch.equal(probs[0, :, 2], torch.zeros_like(probs[0, :, 2]))
        assert torch.equal(grad[0, :, 2], torch.zeros_like(grad[0, :, 2]))
        assert torch.isfinite(probs).all() and torch.isfinite(grad).all()
        assert not probs.masked_select(mask.expand_as(probs)).any()  # masked keys: exactly 0


@pytest.mark.parametrize("case", sorted(MASKS))
def test_softmax_bf16_fused_is_fp32_rounded_once(family, case):
    make_mask, causal = MASKS[case]
    mask = make_mask()
    scores, g = _scores(torch.bfloat16)
    probs = fusions.scale_mask_softmax(scores, SCALE, mask, causal)
    expected = _reference(scores.detach().double(), SCALE, mask, causal).float()
    assert_bf16_rounded(probs, expected, family)
    # The backward pass reads the saved bf16 probabilities, as Megatron's kernel does: it is
    # the fp32 value of scale * p * (g - sum(g p)) on those probabilities, rounded once (twice
    # on the eager backend: PyTorch's softmax backward kernel, then the scale).
    p, g32 = probs.detach().float(), g.float()
    expected_grad = SCALE * p * (g32 - (g32 * p).sum(-1, keepdim=True))
    (got,) = grads(probs, g, scores)
    assert_bf16_rounded(got, expected_grad, family, roundings=2 if family == "eager" else 1)


@pytest.mark.parametrize("softmax_in_fp32", [True, False])
def test_unfused_bf16_softmax_precision_follows_the_flag(eager_backend, softmax_in_fp32):
    scores, _ = _scores(torch.bfloat16)
    probs = fusions.scale_mask_softmax(scores, SCALE, _padding_mask(), fused=False, softmax_in_fp32=softmax_in_fp32)
    expected = _reference(scores.detach().double(), SCALE, _padding_mask(), False).float()
    error = (probs.float() - expected).abs().max().item()
    # fp32 softmax rounds once (half a bf16 ULP of probabilities <= 1: 2^-9); computing in
    # bf16 rounds scores, exponentials and sums, which costs measurably more.
    assert error <= 2**-9 if softmax_in_fp32 else error > 2**-9


def test_causal_with_more_keys_than_queries_is_aligned_top_left(eager_backend):
    scores, g = _scores(sq=5, sk=8)
    probs = fusions.scale_mask_softmax(scores, SCALE, causal=True)
    assert_fp32_close(probs, _reference(scores.detach(), SCALE, None, True).float())
    assert not probs[..., 0, 1:].any() and probs[..., 4, 5:].sum() == 0


def test_mask_errors_are_clear(eager_backend):
    scores, _ = _scores()
    with pytest.raises(TypeError, match="boolean"):
        fusions.scale_mask_softmax(scores, SCALE, torch.zeros(B, 1, SQ, SK))
    with pytest.raises(ValueError, match="does not broadcast"):
        fusions.scale_mask_softmax(scores, SCALE, torch.zeros(B, 2, SQ, SK, dtype=torch.bool))


def test_rows_too_long_for_the_kernel_fall_back_with_one_log_line(monkeypatch, caplog):
    class TritonEverywhere:
        def family(self, op, tensor):
            return "triton"

    monkeypatch.setattr(softmax_module, "active_backend", lambda: TritonEverywhere())
    monkeypatch.setattr(softmax_module, "TRITON_MAX_KEYS", SK - 1)
    scores, _ = _scores()
    with caplog.at_level(logging.WARNING, logger="megapipe.fusions"):
        probs = fusions.scale_mask_softmax(scores, SCALE, _padding_mask())
        fusions.scale_mask_softmax(scores, SCALE, _padding_mask())
    assert_fp32_close(probs, _reference(scores.detach(), SCALE, _padding_mask(), False).float())
    assert [r.getMessage() for r in caplog.records] == [
        f"fused softmax: rows of {SK} keys exceed the Triton kernel's {SK - 1}; using the eager fused softmax"]


# ----------------------------------------------------------------------------- attention

def _qkv(dtype=torch.float32, sq=SQ, sk=SQ, d=8, seed=2):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, HEADS, s, d, generator=g).to(dtype).requires_grad_() for s in (sq, sk, sk))
    return q, k, v, torch.randn(B, HEADS, sq, d, generator=g).to(dtype)


def _attention_reference(q, k, v, mask, causal, scale):
    probs = _reference(torch.matmul(q.double(), k.double().transpose(-1, -2)), scale, mask, causal)
    return torch.matmul(probs, v.double())


ATTENTION_MASKS = {  # self-attention: sq == sk
    "none": (lambda: None, False),
    "padding": (lambda: _padding_mask(SQ, SQ), False),
    "causal": (lambda: None, True),
    "causal_and_padding": (lambda: _key_padding_mask(SQ), True),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_MASKS))
@pytest.mark.parametrize("path", ["sdpa", "fused_softmax", "unfused"])
def test_attention_fp32_matches_fp64_reference(eager_backend, case, path):
    make_mask, causal = ATTENTION_MASKS[case]
    mask = make_mask()
    q, k, v, g = _qkv()
    out = fusions.attention(q, k, v, mask, causal, fused=path != "unfused", sdpa=path == "sdpa")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _attention_reference(q64, k64, v64, mask, causal, 8**-0.5)
    # Two matmuls of length d=8 and sk=7 around the softmax: a few more roundings than an
    # elementwise op, still within 1e-6 of the tensor's scale.
    assert_fp32_close(out, expected.float())
    for got, want in zip(grads(out, g, q, k, v), grads(expected, g.double(), q64, k64, v64)):
        assert_fp32_close(got, want.float())


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_dropout_draws_the_same_mask_as_explicit_dropout_on_cpu(eager_backend, causal):
    q, k, v, g = _qkv()
    mask = None if causal else _padding_mask(SQ, SQ)
    results = []
    for sdpa in (True, False):
        torch.manual_seed(99)
        out = fusions.attention(q, k, v, mask, causal, dropout_p=0.3, training=True, fused=True, sdpa=sdpa)
        results.append((out, grads(out, g, q, k, v), torch.get_rng_state()))
    (out_a, grads_a, state_a), (out_b, grads_b, state_b) = results
    assert torch.equal(state_a, state_b)
    assert_fp32_close(out_a, out_b)
    for got, want in zip(grads_a, grads_b):
        assert_fp32_close(got, want)
    torch.manual_seed(99)
    without = fusions.attention(q, k, v, mask, causal, dropout_p=0.3, training=False)
    assert not torch.allclose(without, out_a)  # dropout did act in training mode


@pytest.mark.parametrize("path", ["sdpa", "fused_softmax"])
def test_attention_bf16_close_to_fp64(eager_backend, path):
    q, k, v, _ = _qkv(torch.bfloat16)
    mask = _padding_mask(SQ, SQ)
    out = fusions.attention(q, k, v, mask, sdpa=path == "sdpa")
    expected = _attention_reference(q.detach(), k.detach(), v.detach(), mask, False, 8**-0.5).float()
    # bf16 inputs are exact; the result passes through at most three bf16 roundings (scores,
    # probabilities, output), each at most 2^-8 relative to values of this tensor's scale.
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=3 * 2**-8 * expected.abs().max().item())


# a prompt (with a fully masked query row), and one decoded position over a longer cache
@pytest.mark.parametrize("sq,mask_kind", [(SQ, "padding"), (SQ, "key_padding"), (1, "key_padding")])
def test_grouped_query_attention_matches_repeated_keys(eager_backend, sq, mask_kind):
    """4 query heads over 2 key/value heads: SDPA (query heads folded into rows of their group)
    equals the fp64 reference with each key/value head repeated for its queries."""
    heads, groups, d = 4, 2, 8
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, heads, sq, d, generator=g).requires_grad_()
    k, v = (torch.randn(B, groups, SK, d, generator=g).requires_grad_() for _ in range(2))
    grad_out = torch.randn(B, heads, sq, d, generator=g)
    mask = _padding_mask(sq, SK) if mask_kind == "padding" else _key_padding_mask(SK)
    out = fusions.attention(q, k, v, mask)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _attention_reference(q64, k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1), mask, False,
                                    d**-0.5)
    assert_fp32_close(out, expected.float())  # as the full-head case above
    for got, want in zip(grads(out, grad_out, q, k, v), grads(expected, grad_out.double(), q64, k64, v64)):
        assert_fp32_close(got, want.float())
