"""Fused bias+GeLU and bias+dropout+add equal their PyTorch references; backend selection."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import HAS_TRITON, assert_bf16_rounded, assert_fp32_close, grads
from fusion_helpers import eager_backend, family, restore_backend, triton_family  # noqa: F401 (fixtures)

from megapipe import fusions
from megapipe.fusions import backend

pytestmark = pytest.mark.unit

S, B, H = 7, 3, 33  # odd sizes: no dimension is a multiple of a vector width or block


def _inputs(dtype=torch.float32, with_bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(S, B, H, generator=g)).to(dtype).requires_grad_()
    bias = torch.randn(H, generator=g).to(dtype).requires_grad_() if with_bias else None
    residual = torch.randn(S, B, H, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(S, B, H, generator=g).to(dtype)
    return x, bias, residual, grad_out


def _present(*tensors):
    return [t for t in tensors if t is not None]


# ----------------------------------------------------------------------------- backend selection

@pytest.mark.parametrize("requested", ["apex", "triton"])
def test_unavailable_backend_falls_back_to_eager_with_one_log_line(restore_backend, requested, caplog):
    if requested == "triton" and HAS_TRITON and backend.triton_interpret():
        pytest.skip("TRITON_INTERPRET=1 makes triton usable on CPU")
    with caplog.at_level(logging.INFO, logger="megapipe.fusions"):
        chosen = fusions.select_backend(requested, device="cpu")
    why = {"apex": "apex not importable", "triton": "triton needs CUDA" if HAS_TRITON else "triton not importable"}
    assert chosen.name == "eager" and backend.active_backend() is chosen
    assert [r.getMessage() for r in caplog.records] == [f"fusion backend: eager ({requested} requested, but {why[requested]})"]


def test_auto_on_cpu_is_eager_and_says_why(restore_backend, caplog):
    with caplog.at_level(logging.INFO, logger="megapipe.fusions"):
        chosen = fusions.select_backend("auto", device="cpu")
    assert chosen.name == "eager"
    assert [r.getMessage() for r in caplog.records] == [f"fusion backend: eager ({chosen.reason})"]
    assert "apex not importable" in chosen.reason and "torch.compile only on request" in chosen.reason


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown"):
        fusions.select_backend("cudnn", device="cpu")


def test_family_without_kernels_for_an_op_yields_to_eager():
    # apex has no GeLU kernel and no CUDA here; triton cannot run CPU tensors uninterpreted.
    cpu = torch.zeros(1)
    assert backend.FusionBackend("apex", "test").family("bias_gelu", cpu) == "eager"
    assert backend.FusionBackend("apex", "test").family("layer_norm", cpu) == "eager"
    if not backend.triton_interpret():
        assert backend.FusionBackend("triton", "test").family("softmax", cpu) == "eager"


# ----------------------------------------------------------------------------- bias + GeLU

@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_gelu_fp32_matches_pytorch(family, approximate, with_bias):
    x, bias, _, g = _inputs(with_bias=with_bias)
    fused = fusions.bias_gelu(x, bias, approximate)
    expected = F.gelu(x if bias is None else x + bias, approximate=approximate)
    assert_fp32_close(fused, expected)
    for got, want in zip(grads(fused, g, *_present(x, bias)), grads(expected, g, *_present(x, bias))):
        assert_fp32_close(got, want)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_bf16(family, approximate):
    x, bias, _, g = _inputs(torch.bfloat16)
    fused = fusions.bias_gelu(x, bias, approximate)
    grad_x, grad_bias = grads(fused, g, x, bias)
    if family == "eager":
        # PyTorch's own bf16 GeLU kernels, as in the unfused path: the same output and input
        # gradient bit for bit; the bias gradient sums the same values, maybe in another order,
        # so the two roundings may land one ULP apart.
        unfused = fusions.bias_gelu(x, bias, approximate, fused=False)
        unfused_grad_x, unfused_grad_bias = grads(unfused, g, x, bias)
        assert torch.equal(fused, unfused) and torch.equal(grad_x, unfused_grad_x)
        assert_bf16_rounded(grad_bias, unfused_grad_bias.float(), roundings=2)
        return
    x32, b32 = x.detach().float().requires_grad_(), bias.detach().float().requires_grad_()
    expected = F.gelu(x32 + b32, approximate=approximate)
    assert_bf16_rounded(fused, expected.detach(), family)
    for got, want in zip((grad_x, grad_bias), grads(expected, g.float(), x32, b32)):
        assert_bf16_rounded(got, want, family)


def test_unfused_bias_gelu_is_plain_pytorch(eager_backend):
    x, bias, _, _ = _inputs()
    assert torch.equal(fusions.bias_gelu(x, bias, "tanh", fused=False), F.gelu(x + bias, approximate="tanh"))


def test_bias_gelu_saves_only_its_inputs(eager_backend):
    # Megatron's point: the backward pass recomputes x + bias instead of storing it.
    x, bias, _, _ = _inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fusions.bias_gelu(x, bias, "none")
    assert len(saved) == 2 and saved[0] is x and saved[1] is bias


def test_bias_gelu_rejects_unknown_approximation(eager_backend):
    x, bias, _, _ = _inputs()
    with pytest.raises(ValueError, match="approximation"):
        fusions.bias_gelu(x, bias, "sigmoid")


# ----------------------------------------------------------------------------- bias + dropout + add

def _reference_with_mask(x, bias, residual, keep, p):
    """Independent reference: the given keep mask applied by hand."""
    return residual + (x + bias) * keep.to(x.dtype) / (1 - p)


# Triton draws its own Philox mask, not F.dropout's: test_triton_bias_dropout_add_equals_reference_with_its_mask
@pytest.mark.parametrize("family", ["eager", "compile"], indirect=True)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_bias_dropout_add_eval_and_train_fp32(family, p):
    x, bias, residual, g = _inputs()
    for training in (False, True):
        torch.manual_seed(1234)
        fused = fusions.bias_dropout_add(x, bias, residual, p, training)
        state_after_fused = torch.get_rng_state()
        torch.manual_seed(1234)
        unfused = fusions.bias_dropout_add(x, bias, residual, p, training, fused=False)
        torch.manual_seed(1234)
        keep = torch.empty_like(x).bernoulli_(1 - p) if training and p > 0 else torch.ones_like(x)
        expected = _reference_with_mask(x, bias, residual, keep, p if training else 0.0)
        assert_fp32_close(fused, expected)
        assert_fp32_close(unfused, expected)  # F.dropout on CPU draws exactly this mask
        assert torch.equal(state_after_fused, torch.get_rng_state())  # same generator use as F.dropout
        for got, want in zip(grads(fused, g, x, bias, residual), grads(expected, g, x, bias, residual)):
            assert_fp32_close(got, want)


@pytest.mark.parametrize("family", ["eager", "compile"], indirect=True)  # Triton's mask: tested below
def test_bias_dropout_add_bf16(family):
    x, bias, residual, g = _inputs(torch.bfloat16)
    torch.manual_seed(7)
    fused = fusions.bias_dropout_add(x, bias, residual, 0.2, training=True)
    torch.manual_seed(7)
    keep = torch.empty_like(x).bernoulli_(0.8)
    x32, b32, r32 = (t.detach().float().requires_grad_() for t in (x, bias, residual))
    expected = _reference_with_mask(x32, b32, r32, keep, 0.2)
    if family == "eager":
        # F.dropout's own bf16 arithmetic, one rounding fewer. Against the unfused path: the
        # same input and residual gradients bit for bit, the same bias-gradient sum (maybe in
        # another order: one ULP, two roundings, apart), and outputs apart by at most the
        # rounding of the dropped activations that the fused op skips plus one rounding of each
        # result, each at most 2^-8 of its value.
        torch.manual_seed(7)
        unfused = fusions.bias_dropout_add(x, bias, residual, 0.2, training=True, fused=False)
        dropped = ((x32 + b32) * keep / 0.8).detach()
        bound = 2**-8 * (dropped.abs() + 2 * unfused.detach().float().abs())
        assert ((fused.float() - unfused.float()).abs() <= bound).all()
        (grad_x, grad_bias, grad_residual), (want_x, want_bias, want_residual) = (
            grads(fused, g, x, bias, residual), grads(unfused, g, x, bias, residual))
        assert torch.equal(grad_x, want_x) and torch.equal(grad_residual, want_residual)
        assert_bf16_rounded(grad_bias, want_bias.float(), roundings=2)
        return
    assert_bf16_rounded(fused, expected.detach(), family)
    for got, want in zip(grads(fused, g, x, bias, residual), grads(expected, g.float(), x32, b32, r32)):
        assert_bf16_rounded(got, want, family)


def test_bias_dropout_add_saves_only_the_mask(eager_backend):
    # Neither x + bias nor the dropped activations are kept for the backward pass.
    x, bias, residual, _ = _inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fusions.bias_dropout_add(x, bias, residual, 0.1, training=True)
    mask, saved_bias = saved
    assert saved_bias is bias and torch.equal(mask.unique(), torch.tensor([0.0, 1 / 0.9]))  # F.dropout's mask


def test_bias_dropout_add_everything_dropped(family):
    x, bias, residual, g = _inputs()
    out = fusions.bias_dropout_add(x, bias, residual, 1.0, training=True)
    assert torch.equal(out, residual)
    grad_x, grad_bias, grad_residual = grads(out, g, x, bias, residual)
    assert not grad_x.any() and not grad_bias.any() and torch.equal(grad_residual, g)


def test_bias_dropout_add_without_bias(family):
    x, _, residual, g = _inputs()
    out = fusions.bias_dropout_add(x, None, residual, 0.3, training=False)
    assert_fp32_close(out, residual + x)


def _triton_inputs(dtype, with_bias):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 96, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(96, generator=g).to(dtype).requires_grad_() if with_bias else None
    residual = torch.randn(64, 4, 96, generator=g).to(dtype).requires_grad_()
    return x, bias, residual, torch.randn(64, 4, 96, generator=g).to(dtype)


def _triton_keep_mask(shape, p, seed):
    """The mask Triton's kernel draws after ``torch.manual_seed(seed)``: Philox numbers of the seed and
    the flat element index, whatever the dtype or bias; read here by dropping ones onto zeros."""
    torch.manual_seed(seed)
    return fusions.bias_dropout_add(torch.ones(shape), None, torch.zeros(shape), p, training=True) != 0


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_triton_bias_dropout_add_equals_reference_with_its_mask(triton_family, p, dtype, with_bias):
    """Forward and backward equal the reference with the kernel's own mask: every element is dropped
    or scaled by 1/(1-p), and the backward kernel, which draws the mask again from the saved seed,
    drops the same elements as the forward one."""
    x, bias, residual, grad_out = _triton_inputs(dtype, with_bias)
    keep = _triton_keep_mask(x.shape, p, seed=11)
    assert keep.all() if p == 0 else not keep.all()
    torch.manual_seed(11)
    out = fusions.bias_dropout_add(x, bias, residual, p, training=True)
    inputs = _present(x, bias, residual)
    exact = [t.detach().float().requires_grad_() for t in inputs]  # bf16 values are exact in fp32
    expected = _reference_with_mask(exact[0], exact[1] if with_bias else 0.0, exact[-1], keep, p)
    got, want = (out, *grads(out, grad_out, *inputs)), (expected, *grads(expected, grad_out.float(), *exact))
    for actual, reference in zip(got, want):
        if dtype == torch.float32:
            assert_fp32_close(actual, reference)
        else:
            assert_bf16_rounded(actual, reference.detach(), triton_family)


def test_triton_dropout_draws_rate_p_from_the_default_generator(triton_family):
    """The drop rate is p, and the seed comes from the default generator: the same after the same
    ``torch.manual_seed``, another on the next call."""
    p = 0.3
    x, bias, residual, _ = _triton_inputs(torch.float32, with_bias=True)
    keep = _triton_keep_mask(x.shape, p, seed=11)
    # 24576 Bernoulli(0.7) draws: standard deviation of the kept fraction is 0.003; allow 5 sigma.
    assert abs(keep.float().mean().item() - (1 - p)) < 0.015
    torch.manual_seed(11)
    out = fusions.bias_dropout_add(x, bias, residual, p, training=True)
    torch.manual_seed(11)
    assert torch.equal(fusions.bias_dropout_add(x, bias, residual, p, training=True), out)
    assert not torch.equal(fusions.bias_dropout_add(x, bias, residual, p, training=True), out)


def test_bias_dropout_add_rejects_bad_arguments(eager_backend):
    x, bias, residual, _ = _inputs()
    with pytest.raises(ValueError, match="between 0 and 1"):
        fusions.bias_dropout_add(x, bias, residual, 1.5, training=True)
    with pytest.raises(ValueError, match="same shape"):
        fusions.bias_dropout_add(x, bias, residual[:2], 0.1, training=True)
