"""LayerNorm/RMSNorm modules and the vocab-parallel cross-entropy parts against fp64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import assert_bf16_rounded, assert_fp32_close, grads
from fusion_helpers import eager_backend, family  # noqa: F401 (fixtures)

from megapipe import fusions
from megapipe.fusions import cross_entropy as ce

pytestmark = pytest.mark.unit

S, B, H = 7, 3, 96
EPS = 1e-5


def _norm_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (1.5 + 2 * torch.randn(S, B, H, generator=g)).to(dtype).requires_grad_()
    return x, torch.randn(S, B, H, generator=g).to(dtype)


def _layer_norm_reference(x, weight, bias):
    """Textbook LayerNorm in fp64: biased variance over the last dimension."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * weight.double() + bias.double()


def _rms_norm_reference(x, weight):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight.double()


def _random_affine(norm, seed=4):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return norm


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_fp32_matches_fp64_reference(family, kind):
    norm = _random_affine(getattr(fusions, kind)(H, eps=EPS))
    x, g = _norm_inputs()
    out = norm(x)
    x64 = x.detach().double().requires_grad_()
    params64 = [p.detach().double().requires_grad_() for p in norm.parameters()]
    reference = _layer_norm_reference if kind == "LayerNorm" else _rms_norm_reference
    expected = reference(x64, *params64)
    # A normalization is a reduction over h=96 values: its rounding is a few ULP of fp32 at the
    # tensor's scale, which the 1e-6 bound covers; the weight/bias gradients sum 21 rows.
    assert_fp32_close(out, expected.float())
    for got, want in zip(grads(out, g, x, *norm.parameters()), grads(expected, g.double(), x64, *params64)):
        assert_fp32_close(got, want.float())


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_bf16_is_fp32_rounded_once(family, kind):
    norm = _random_affine(getattr(fusions, kind)(H, eps=EPS, dtype=torch.bfloat16))
    x, g = _norm_inputs(torch.bfloat16)
    out = norm(x)
    reference = _layer_norm_reference if kind == "LayerNorm" else _rms_norm_reference
    x64 = x.detach().double().requires_grad_()  # bf16 values are exact in fp64
    params64 = [p.detach().double().requires_grad_() for p in norm.parameters()]
    expected = reference(x64, *params64)
    assert_bf16_rounded(out, expected.float().detach(), family)
    if family == "eager":
        return  # PyTorch's bf16 LayerNorm backward on CPU is less exact (input gradient 1e-2 apart, measured)
    # The kernels compute the gradients in fp32 from the bf16 inputs and round each once.
    for got, want in zip(grads(out, g, x, *norm.parameters()), grads(expected, g.double(), x64, *params64)):
        assert_bf16_rounded(got, want.float(), family)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_state_dict_matches_torch_module(eager_backend, kind):
    ours = _random_affine(getattr(fusions, kind)(H, eps=EPS))
    theirs = getattr(torch.nn, kind)(H, eps=EPS)
    theirs.load_state_dict(ours.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x, _ = _norm_inputs()
    assert_fp32_close(ours(x), theirs(x))


# ----------------------------------------------------------------------------- cross-entropy parts

VOCAB, TOKENS = 50, 21


def _sharded_cross_entropy(logits, target, shards):
    """Vocab-parallel cross-entropy over ``shards`` slices, the collectives done by hand."""
    slices = logits.chunk(shards, dim=-1)
    starts = [0]
    for piece in slices:
        starts.append(starts[-1] + piece.size(-1))
    logits_max = torch.stack([piece.max(-1).values for piece in slices]).max(0).values  # all-reduce MAX
    parts = []
    for piece, start, end in zip(slices, starts, starts[1:]):
        shifted = ce.max_shifted_logits(piece, logits_max)
        index, in_shard = ce.shard_target(target, start, end)
        parts.append((shifted, index, in_shard, ce.target_logit(shifted, index, in_shard), *ce.exp_and_sum_(shifted)))
    predicted = sum(part[3] for part in parts)  # all-reduce SUM
    sum_exp = sum(part[5] for part in parts)  # all-reduce SUM
    loss = ce.loss_from_sums(sum_exp, predicted)
    softmaxes = [ce.normalize_exp_(part[4], sum_exp) for part in parts]
    return loss, softmaxes, parts


@pytest.mark.parametrize("shards", [1, 2, 5])
def test_cross_entropy_parts_match_pytorch(family, shards):
    if family == "triton":
        pytest.skip("cross-entropy parts have eager and compiled kernels only")
    g = torch.Generator().manual_seed(6)
    logits = (4 * torch.randn(TOKENS, VOCAB, generator=g)).requires_grad_()
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    grad_loss = torch.rand(TOKENS, generator=g)
    loss, softmaxes, parts = _sharded_cross_entropy(logits.detach(), target, shards)
    expected = F.cross_entropy(logits, target, reduction="none")
    # log-sum-exp over 50 terms in fp32: a few ULP of the loss.
    assert_fp32_close(loss, expected.detach())
    grad_shards = [ce.softmax_minus_onehot_(sm, part[1], part[2], grad_loss) for sm, part in zip(softmaxes, parts)]
    (want,) = grads(expected, grad_loss, logits)
    assert_fp32_close(torch.cat(grad_shards, dim=-1), want)


def test_cross_entropy_parts_take_bf16_logits_and_answer_in_fp32(eager_backend):
    g = torch.Generator().manual_seed(8)
    logits = (4 * torch.randn(TOKENS, VOCAB, generator=g)).bfloat16()
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    loss, _, _ = _sharded_cross_entropy(logits, target, 2)
    assert loss.dtype == torch.float32
    assert_fp32_close(loss, F.cross_entropy(logits.float(), target, reduction="none"))
