"""Fused SwiGLU and RoPE equal independent references, for every kernel family.

The references are written differently from the kernels: SwiGLU from separate gate and up
tensors (not the interleaved pairs), RoPE as multiplication of complex numbers by e^{i theta}
(not rotate-half), so a shared mistake cannot hide. Gradients come from autograd through the
references.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import assert_bf16_rounded, assert_fp32_close, grads
from fusion_helpers import eager_backend, family  # noqa: F401 (fixtures)

from megapipe import fusions

pytestmark = pytest.mark.unit

S, B, F_WIDTH = 7, 3, 33  # odd sizes
HEADS, D = 3, 10


def _swiglu_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    gate = (2 * torch.randn(S, B, F_WIDTH, generator=g)).to(dtype)
    up = torch.randn(S, B, F_WIDTH, generator=g).to(dtype)
    grad_out = torch.randn(S, B, F_WIDTH, generator=g).to(dtype)
    return gate, up, grad_out


def _interleave(gate, up):
    return torch.stack((gate, up), dim=-1).flatten(-2).detach().requires_grad_()


def test_swiglu_fp32_matches_reference(family):
    gate, up, g = _swiglu_inputs()
    x = _interleave(gate, up)
    gate, up = gate.requires_grad_(), up.requires_grad_()
    expected = F.silu(gate) * up
    fused = fusions.swiglu(x)
    assert_fp32_close(fused, expected)
    (grad_x,) = grads(fused, g, x)
    grad_gate, grad_up = grads(expected, g, gate, up)
    assert_fp32_close(grad_x, _interleave(grad_gate, grad_up).detach())


def test_swiglu_bf16(family):
    gate, up, g = _swiglu_inputs(torch.bfloat16)
    x = _interleave(gate, up)
    fused = fusions.swiglu(x)
    (grad_x,) = grads(fused, g, x)
    if family == "eager":
        # PyTorch's own bf16 SiLU kernels, as in the unfused path: bit for bit the same
        unfused = fusions.swiglu(x, fused=False)
        assert torch.equal(fused, unfused) and torch.equal(grad_x, grads(unfused, g, x)[0])
        return
    x32 = x.detach().float().requires_grad_()
    expected = fusions.swiglu(x32, fused=False)
    assert_bf16_rounded(fused, expected.detach(), family)
    # Triton computes the gradient in fp32 and rounds it once
    assert_bf16_rounded(grad_x, grads(expected, g.float(), x32)[0], family, roundings=2 if family == "compile" else 1)


def test_bias_swiglu_fp32_matches_reference(family):
    """The first projection's bias, interleaved like the input, added inside SwiGLU; its gradient
    (summed over the 21 tokens) and the input's equal autograd's through separate gate and up."""
    gate, up, g = _swiglu_inputs()
    gen = torch.Generator().manual_seed(2)
    gate_bias, up_bias = torch.randn(F_WIDTH, generator=gen), torch.randn(F_WIDTH, generator=gen)
    x, bias = _interleave(gate, up), _interleave(gate_bias, up_bias)
    fused = fusions.swiglu(x, bias)
    leaves = [t.requires_grad_() for t in (gate, up, gate_bias, up_bias)]
    expected = F.silu(gate + gate_bias) * (up + up_bias)
    assert_fp32_close(fused, expected)
    grad_x, grad_bias = grads(fused, g, x, bias)
    grad_gate, grad_up, grad_gate_bias, grad_up_bias = grads(expected, g, *leaves)
    assert_fp32_close(grad_x, _interleave(grad_gate, grad_up).detach())
    assert_fp32_close(grad_bias, _interleave(grad_gate_bias, grad_up_bias).detach())


def test_bias_swiglu_unfused_is_the_plain_composition(eager_backend):
    gate, up, _ = _swiglu_inputs()
    x, bias = _interleave(gate, up), _interleave(up[0, 0], gate[0, 0])
    assert torch.equal(fusions.swiglu(x, bias, fused=False), fusions.swiglu(x + bias, fused=False))
    with pytest.raises(ValueError, match=r"must be \(66,\)"):
        fusions.swiglu(x, bias[:-2])


def test_swiglu_saves_only_its_inputs(eager_backend):
    gate, up, _ = _swiglu_inputs()
    x, bias = _interleave(gate, up), _interleave(up[0, 0], gate[0, 0])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fusions.swiglu(x, bias)  # neither x + bias nor the sigmoid is kept
    assert [t.data_ptr() for t in saved] == [x.data_ptr(), bias.data_ptr()]


def _rope_reference(x, positions, rotary_dim, base):
    """Channels (j, j + r/2) as the complex number x_j + i x_{j+r/2}, times e^{i p base^(-2j/r)}."""
    half = rotary_dim // 2
    theta = positions.double()[:, None, :, None] * base ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    z = torch.complex(x[..., :half].double(), x[..., half:rotary_dim].double()) * torch.exp(1j * theta)
    return torch.cat((z.real, z.imag, x[..., rotary_dim:].double()), dim=-1).to(x.dtype)


@pytest.mark.parametrize("rotary_dim", [D, 4])  # --rotary-percent 1.0 and 0.4
def test_rope_fp32_matches_complex_rotation(family, rotary_dim):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, HEADS, S, D, generator=gen, requires_grad=True)
    positions = torch.randint(0, 50, (B, S), generator=gen)
    grad_out = torch.randn(B, HEADS, S, D, generator=gen)
    cos, sin = fusions.rotary_tables(positions, rotary_dim, 10000.0)
    fused = fusions.apply_rope(x, cos, sin)
    expected = _rope_reference(x, positions, rotary_dim, 10000.0)
    assert_fp32_close(fused, expected)
    assert_fp32_close(grads(fused, grad_out, x)[0], grads(expected, grad_out, x)[0])


def test_rope_saves_only_the_tables(eager_backend):
    x = torch.randn(B, HEADS, S, D, requires_grad=True)
    cos, sin = fusions.rotary_tables(torch.arange(S).unsqueeze(0), D, 10000.0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fusions.apply_rope(x, cos, sin)
    assert [t.data_ptr() for t in saved] == [cos.data_ptr(), sin.data_ptr()]


def test_unfused_paths_are_the_plain_compositions(eager_backend):
    gate, up, _ = _swiglu_inputs()
    # strided halves may take SiLU's scalar path where contiguous ones take the vector path: ULPs apart
    assert_fp32_close(fusions.swiglu(_interleave(gate, up), fused=False), F.silu(gate) * up)
    x = torch.randn(B, HEADS, S, D)
    cos, sin = fusions.rotary_tables(torch.arange(S).unsqueeze(0), D, 10000.0)
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(fusions.apply_rope(x, cos, sin, fused=False), x * cos + torch.cat((-x2, x1), dim=-1) * sin)
