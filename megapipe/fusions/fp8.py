"""FP8 matrix products: the formats, quantisation with dynamic scales, and ``torch._scaled_mm`` or its emulation.

A product ``a @ b`` in FP8 takes each operand as FP8 values and a dequantisation scale (``Quantised``):
``a ~ a.data * a.scale``. The formats are Megatron-LM's ``--fp8-format``: ``e4m3`` uses E4M3 (largest 448,
3 mantissa bits) for activations, weights and output gradients; ``hybrid`` uses E4M3 forward and E5M2
(largest 57344, 2 mantissa bits, 8 more binades) for the gradients of the backward pass. The recipes are
``--fp8-recipe``: ``tensorwise`` gives each operand one scale from the amax of the current tensor;
``rowwise`` one per row of the left operand and per column of the right one (each reduced over the
contraction dimension), which ``torch._scaled_mm`` applies to its fp32 accumulators.

Scales are powers of two, 2^floor(log2(max / amax)) (``_scaled_cast``). Scaling by a power of two is exact in
fp32 and bf16, so the FP8 values are the format's rounding of the input whatever dtype it comes in,
dequantising is exact, and an fp32 emulation of the product (dequantise, multiply in fp32) equals the FP8
product up to the order of its fp32 additions. The cost is at most one binade of headroom below the format's
maximum, as with torchao's power-of-two option. A non-finite input gives a non-finite product, so the NaN/Inf
checks still see it.

``torch._scaled_mm`` needs its left operand row-major, its right one column-major and the contraction and
output widths multiples of 16: ``scaled_mm`` makes the copies and pads with zeros (exact) where an operand is
not so. ``emulated()`` runs every product as the fp32 emulation instead, on any device: the switch tests and
benchmarks use to run the FP8 path on a CPU. It is not a user option: ``fp8_mode`` refuses ``--fp8-format``
on a device without FP8 matrix units.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

FORMATS = {"e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn), "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2)}
RECIPES = ("tensorwise", "rowwise")
ALIGNMENT = 16  # torch._scaled_mm's multiple for the contraction and output widths
_SMALLEST_AMAX = 2.0 ** -100  # below it a tensor counts as zero: keeps scales within fp32's normal range
_EXPONENT_BITS = 0x7F800000  # of an fp32: masking the rest rounds a positive number down to a power of two


@dataclass(frozen=True)
class Fp8Recipe:
    """``--fp8-format`` and ``--fp8-recipe``: which FP8 types each pass uses and how scales are chosen."""

    format: str
    recipe: str = "tensorwise"

    def __post_init__(self):
        if self.format not in FORMATS or self.recipe not in RECIPES:
            raise ValueError(f"FP8 format {self.format!r} / recipe {self.recipe!r} is unknown; use a format of "
                             f"{', '.join(FORMATS)} and a recipe of {', '.join(RECIPES)}.")

    @property
    def forward_dtype(self) -> torch.dtype:
        """Of the activations and weights."""
        return FORMATS[self.format][0]

    @property
    def gradient_dtype(self) -> torch.dtype:
        """Of the output gradients in the backward pass."""
        return FORMATS[self.format][1]

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    def __str__(self) -> str:
        return f"{self.format} {self.recipe}"


@dataclass(frozen=True)
class Quantised:
    """FP8 values and the fp32 scale that dequantises them: a 0-d tensor, or 1 wide along the contraction
    dimension (rowwise)."""

    data: torch.Tensor
    scale: torch.Tensor

    def t(self) -> "Quantised":
        return Quantised(self.data.t(), self.scale.t())

    def dequantised(self) -> torch.Tensor:
        return self.data.float() * self.scale


def quantise(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, contraction_dim: int = 0) -> Quantised:
    """``x`` in FP8 ``dtype`` with a power-of-two scale: one for the tensor, or (``rowwise``) one per slice
    across ``contraction_dim``; compiled into two kernels where ``compile_quantisation`` turned that on."""
    quantiser = _quantise if _compiled is None or _emulating else _compiled
    return Quantised(*quantiser(x.detach(), dtype, rowwise, contraction_dim))


def _quantise(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, contraction_dim: int):
    """(FP8 values, dequantisation scale): the amax, then one scaling cast."""
    return _scaled_cast(x, _amax(x, rowwise, contraction_dim), dtype)


def _amax(x: torch.Tensor, rowwise: bool, contraction_dim: int) -> torch.Tensor:
    if rowwise:
        return torch.linalg.vector_norm(x, math.inf, dim=contraction_dim, keepdim=True)
    return torch.linalg.vector_norm(x, math.inf)


def _scaled_cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    """``x`` times 2^floor(log2(max / amax)) in FP8, and the reciprocal of that power of two. The ratio is taken
    in fp32 and its mantissa dropped, so the scaled amax lies within the format's maximum (or 2^-24 of it
    beyond, where the ratio rounded up to a power of two, which the cast rounds back to the maximum). A zero
    amax counts as 2^-100; an infinite one makes every value NaN, a NaN one keeps its NaNs."""
    ratio = torch.finfo(dtype).max / amax.float().clamp(min=_SMALLEST_AMAX)
    factor = (ratio.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    return (x * factor.to(x.dtype)).to(dtype), factor.reciprocal()


_compiled = None


def compile_quantisation(on: bool) -> None:
    """Run ``quantise`` through torch.compile (its amax and its scaling cast one kernel each, where eager
    PyTorch launches nine) or eagerly."""
    global _compiled
    _compiled = torch.compile(_quantise, dynamic=True) if on else None


def compiling_quantisation() -> bool:
    return _compiled is not None


_emulating = False


@contextlib.contextmanager
def emulated():
    """Within it, every FP8 product is its fp32 emulation, on any device (tests and benchmarks only)."""
    global _emulating
    previous, _emulating = _emulating, True
    try:
        yield
    finally:
        _emulating = previous


def emulating() -> bool:
    return _emulating


def scaled_mm(a: Quantised, b: Quantised, out_dtype: torch.dtype, fast_accumulation: bool = False) -> torch.Tensor:
    """``a @ b`` [M, N] in ``out_dtype`` from FP8 operands a [M, K] and b [K, N]; ``fast_accumulation`` lets
    Hopper's FP8 units skip the periodic promotion of their accumulators (torchao uses it forward only)."""
    if _emulating:
        return (a.dequantised() @ b.dequantised()).to(out_dtype)
    n = b.data.shape[1]
    a_data, b_data, b_scale = _aligned(a.data, b.data, b.scale)
    out = torch._scaled_mm(a_data.contiguous(), b_data.t().contiguous().t(), a.scale.contiguous(),
                           b_scale.contiguous(), out_dtype=out_dtype, use_fast_accum=fast_accumulation)
    return out if out.shape[1] == n else out[:, :n]


def _aligned(a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor):
    """a [M, K], b [K, N] and b's scale zero-padded (ones for a rowwise scale) to K and N multiples of 16."""
    k, n = b.shape
    pad_k, pad_n = -k % ALIGNMENT, -n % ALIGNMENT
    if pad_k:
        a, b = _padded(a, 1, pad_k), _padded(b, 0, pad_k)
    if pad_n:
        b = _padded(b, 1, pad_n)
        if b_scale.dim() == 2:
            b_scale = torch.cat([b_scale, b_scale.new_ones(1, pad_n)], dim=1)
    return a, b, b_scale


def _padded(x: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] += extra
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out

