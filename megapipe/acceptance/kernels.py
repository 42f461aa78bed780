"""Every fused kernel family on the device against eager PyTorch, forward and backward, fp32 and bf16.

Each op runs once with a family's kernels (``fused=True`` under that backend) and once as the plain
PyTorch composition (``fused=False`` under eager), from the same inputs and output gradient. On a
dry run the only family is eager's own fused path. Dropout at p = 0.1 is checked apart: the kept
fraction within five standard deviations of 0.9, and the backward's mask equal to the forward's.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from megapipe import fusions
from megapipe.acceptance.record import Context, Record, assert_close
from megapipe.fusions import backend
from megapipe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

# Kernels sum in another order than eager PyTorch. In fp32 results differ by the rounding of
# reductions over up to a few thousand elements (~sqrt(n) ULP, under 1e-5 of the largest term):
# 1e-5 relative to each element plus 1e-5 of the tensor's largest magnitude (for sums that cancel,
# such as bias gradients). In bf16 both sides are the exact value after at most two roundings to
# bf16 (2 x 2^-8 relative), so they differ by at most 2^-6, plus the same allowance at bf16's scale.
TOLERANCES = {torch.float32: dict(rtol=1e-5, scale=1e-5), torch.bfloat16: dict(rtol=2 ** -6, scale=2 ** -6)}
DROPOUT = 0.1


def _ops(device: torch.device, dtype: torch.dtype, small: bool) -> list[tuple[str, str, tuple, Callable]]:
    """(name, the backend's name of the op, inputs, f(fused, *inputs)) of every fused op, on ``device``
    in ``dtype``."""
    g = torch.Generator(device=device).manual_seed(0)
    s, b, h = (32, 2, 128) if small else (256, 4, 1024)
    heads, sq, vocab = (4, 32, 512) if small else (16, 256, 50304)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_()

    x, residual, bias, weight = randn(s, b, h), randn(s, b, h), randn(h), randn(h)
    scores = randn(b, heads, sq, sq)
    padding = torch.zeros(b, 1, 1, sq, dtype=torch.bool, device=device)
    padding[-1, ..., sq * 3 // 4:] = True
    q = randn(b, heads, sq, h // heads)
    cos, sin = fusions.rotary_tables(torch.arange(sq, device=device).expand(b, sq), h // heads, 10000.0, dtype)
    logits = randn(s * b, vocab)
    target = torch.randint(0, vocab, (s * b,), generator=g, device=device)
    return [
        ("bias_gelu", "bias_gelu", (x, bias),
         lambda fused, x, b_: fusions.bias_gelu(x, b_, approximate="tanh", fused=fused)),
        ("bias_dropout_add p=0", "bias_dropout_add", (x, bias, residual),
         lambda fused, x, b_, r: fusions.bias_dropout_add(x, b_, r, 0.0, True, fused=fused)),
        ("scale_mask_softmax", "softmax", (scores,),
         lambda fused, s_: fusions.scale_mask_softmax(s_, 0.125, padding, causal=True, fused=fused)),
        ("layer_norm", "layer_norm", (x, weight, bias), lambda fused, x, w, b_: fusions.layer_norm(x, w, b_, 1e-5)),
        ("rms_norm", "rms_norm", (x, weight), lambda fused, x, w: fusions.rms_norm(x, w, 1e-5)),
        ("cross_entropy", "cross_entropy", (logits,),
         lambda fused, l_: (vocab_parallel_cross_entropy(l_, target, None, 0) if fused
                            else F.cross_entropy(l_.float(), target, reduction="none"))),
        ("rope", "rope", (q,), lambda fused, q_: fusions.apply_rope(q_, cos, sin, fused=fused)),
        ("swiglu", "swiglu", (x,), lambda fused, x: fusions.swiglu(x, fused=fused)),
        ("bias_swiglu", "swiglu", (x, bias), lambda fused, x, b_: fusions.swiglu(x, b_, fused=fused)),
    ]


def _forward_backward(op, fused: bool, inputs, grad_out=None):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = op(fused, *inputs)
    grad_out = torch.randn_like(out) if grad_out is None else grad_out
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in inputs], grad_out


def _families(device: torch.device, dry_run: bool) -> list[str]:
    if dry_run:
        return ["eager"]
    return [name for name in ("triton", "compile", "apex") if backend._why_not(name, device) is None]


def _implements(family: str, op: str) -> bool:
    return family == "eager" or op in backend.OPS_BY_FAMILY[family]


def _compare(family: str, op, inputs, dtype) -> str:
    previous = backend.activate(backend.FusionBackend(family, "acceptance"))
    try:
        got, grad_out = _forward_backward(op, True, inputs)
        backend.activate(backend.FusionBackend("eager", "reference"))
        want, _ = _forward_backward(op, False, inputs, grad_out)
    finally:
        backend.activate(previous)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, **TOLERANCES[dtype], what="output" if i == 0 else f"gradient of input {i - 1}")
    return f"{len(got)} tensors within tolerance"


def _check_dropout(family: str, device: torch.device, dtype: torch.dtype) -> str:
    """x = 1, no bias, residual 0: the output is 1/(1-p) where kept and 0 where dropped, and the
    gradient of x for an output gradient of 1 must be the same tensor."""
    n = 1 << 20
    x = torch.ones(n // 1024, 1024, device=device, dtype=dtype, requires_grad=True)
    residual = torch.zeros_like(x)
    previous = backend.activate(backend.FusionBackend(family, "acceptance"))
    try:
        out = fusions.bias_dropout_add(x, None, residual, DROPOUT, True, fused=True)
        out.backward(torch.ones_like(out))
    finally:
        backend.activate(previous)
    kept = out != 0
    fraction = kept.float().mean().item()
    sigma = math.sqrt(DROPOUT * (1 - DROPOUT) / n)
    assert abs(fraction - (1 - DROPOUT)) < 5 * sigma, f"kept fraction {fraction:.5f}, expected 0.9 +- {5 * sigma:.5f}"
    assert torch.equal(x.grad != 0, kept), "the backward dropped other elements than the forward"
    assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - DROPOUT)).float(), **TOLERANCES[dtype], what="scale")
    return f"kept {fraction:.4f}, backward mask equal to the forward's"


def run(record: Record, context: Context) -> None:
    device = context.device
    for family in _families(context.device, context.dry_run):
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"{family} {str(dtype).removeprefix('torch.')}"
            for name, key, inputs, op in _ops(device, dtype, small=context.dry_run):
                if _implements(family, key):
                    record.check(f"{tag} {name}", lambda: _compare(family, op, inputs, dtype))
            if _implements(family, "bias_dropout_add"):
                record.check(f"{tag} bias_dropout_add p={DROPOUT}", lambda: _check_dropout(family, device, dtype))
