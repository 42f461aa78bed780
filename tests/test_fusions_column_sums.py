"""Parameter gradients summed over tokens inside the Triton backward kernels (``triton_column_sums``).

LayerNorm/RMSNorm weight and bias gradients and the bias gradients of bias-GeLU, bias-dropout-add
and bias-SwiGLU come from per-program fp32 partial sums and one small kernel that adds them, in
Triton's CPU interpreter. Enough rows are used that several programs each sum a run of row tiles,
the last one a shorter run; the references are fp64 sums of fp64 terms.

Tolerances. Summing n fp32 numbers in any order errs by at most (n - 1) u sum|term| (u = 2^-24, the
classical bound for recursive summation; blocked and tree orders stay within it). Each term also
carries the few ULP of its own fp32 formula: 8 ULP of ``magnitude``, an upper bound of the term's size
and of the error its inputs carry (for a norm, |g| (|xhat| + max|x| / std), the second part from the
row's mean). A bf16 result adds one rounding: half a bf16 ULP, 2^-8 relative, or a whole ULP in
the interpreter, which truncates (2^-7). That bound holds whatever the signs; in fp32 the sums are
also held to ``assert_fp32_close`` (8 ULP of the largest column sum), since errors of terms of either
sign grow like sqrt(n) u rather than n u (measured: 1.4e-7 of the largest at 300 rows). Input gradients are per-row formulas: fp32 within the
8-ULP ``assert_fp32_close``, bf16 the fp32 value rounded once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fusion_helpers import assert_bf16_rounded, assert_fp32_close, grads
from fusion_helpers import triton_family  # noqa: F401 (fixture)

from megapipe import fusions

pytestmark = pytest.mark.unit

ROWS, EPS = 300, 1e-5  # 300 rows: 10 tiles of 32 rows at width 96 (3 programs: 4, 4 and 2 tiles)
U = 2.0**-24


def _randn(*shape, seed, scale=1.0, shift=0.0):
    return shift + scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_column_sums(actual, expected64, magnitude64, n_rows):
    """``actual`` (fp32 or bf16) against the fp64 column sums ``expected64``; ``magnitude64`` bounds each
    column's terms summed (see the module's docstring)."""
    bound = (n_rows + 8) * U * magnitude64
    if actual.dtype == torch.bfloat16:
        bound = bound + 2.0**-7 * expected64.abs()
    else:  # rounding errors of terms of either sign grow like sqrt(n), not n: within 8 ULP of the largest sum too
        assert_fp32_close(actual, expected64.float())
    error = (actual.double() - expected64).abs()
    assert (error <= bound).all(), f"largest error {error.max().item():.3g}, its bound {bound[error.argmax()].item():.3g}"


def _partial_rows(monkeypatch, module):
    """Records the number of partial rows each ``column_sums`` call of ``module`` adds."""
    seen = []
    original = module.column_sums

    def recording(partials, *args):
        seen.append(partials.shape[0])
        return original(partials, *args)

    monkeypatch.setattr(module, "column_sums", recording)
    return seen


def _norm64(x64, weight64, bias64, rms):
    """LayerNorm (or RMSNorm) in fp64; also xhat and 1/std for the tolerances."""
    centered = x64 if rms else x64 - x64.mean(-1, keepdim=True)
    rstd = 1.0 / torch.sqrt((centered * centered).mean(-1, keepdim=True) + EPS)
    xhat = centered * rstd
    return xhat * weight64 + (0.0 if rms else bias64), xhat, rstd


@pytest.mark.parametrize("width", [96, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_weight_gradients_sum_partials_of_several_programs(triton_family, monkeypatch, kind, dtype, width):
    from megapipe.fusions import triton_norms

    rms = kind == "RMSNorm"
    x = _randn(ROWS, width, seed=0, scale=2.0, shift=1.5).to(dtype).requires_grad_()
    g = _randn(ROWS, width, seed=1).to(dtype)
    weight = _randn(width, seed=2).to(dtype).requires_grad_()
    bias = None if rms else _randn(width, seed=3).to(dtype).requires_grad_()
    params = [weight] if rms else [weight, bias]
    partial_rows = _partial_rows(monkeypatch, triton_norms)
    out = fusions.rms_norm(x, weight, EPS) if rms else fusions.layer_norm(x, weight, bias, EPS)
    got = grads(out, g, x, *params)
    assert partial_rows == [3]  # 10 tiles of 32 rows (width 96) or 5 of 64 (width 33): runs of 4 or 2 tiles

    x64, g64 = x.detach().double().requires_grad_(), g.double()  # bf16 values are exact in fp64
    params64 = [p.detach().double() for p in params]
    expected, xhat, rstd = _norm64(x64, params64[0], None if rms else params64[1], rms)
    (grad_x64,) = grads(expected, g64, x64)
    if dtype == torch.float32:
        assert_fp32_close(got[0], grad_x64.float())
    else:
        assert_bf16_rounded(got[0], grad_x64.float(), triton_family)
    xhat, row_scale = xhat.detach(), x64.detach().abs().amax(-1, keepdim=True) * rstd.detach()
    assert_column_sums(got[1], (g64 * xhat).sum(0), (g64.abs() * (xhat.abs() + row_scale)).sum(0), ROWS)
    if not rms:
        assert_column_sums(got[2], g64.sum(0), g64.abs().sum(0), ROWS)


def _bias_op_cases(width):
    """(name, f(x, bias), its fp64 reference, x's width): each op whose bias gradient the kernel sums."""
    return [
        ("bias_gelu", lambda x, b: fusions.bias_gelu(x, b, "tanh"), lambda x, b: F.gelu(x + b, approximate="tanh"),
         width),
        ("bias_dropout_add", lambda x, b: fusions.bias_dropout_add(x, b, torch.zeros_like(x), 0.0, True),
         lambda x, b: x + b, width),
        ("bias_swiglu", fusions.swiglu,
         lambda x, b: F.silu((x + b)[..., 0::2]) * (x + b)[..., 1::2], 2 * width),
    ]


@pytest.mark.parametrize("width", [96, 300])  # 300: two column blocks, the second one partly outside
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(3), ids=["bias_gelu", "bias_dropout_add", "bias_swiglu"])
def test_bias_gradient_is_summed_by_the_backward_kernel(triton_family, monkeypatch, case, dtype, width):
    from megapipe.fusions import triton_elementwise

    _, op, reference, x_width = _bias_op_cases(width)[case]
    x = _randn(ROWS, x_width, seed=4, scale=2.0).to(dtype).requires_grad_()
    bias = _randn(x_width, seed=5).to(dtype).requires_grad_()
    partial_rows = _partial_rows(monkeypatch, triton_elementwise)
    out = op(x, bias)
    g = _randn(*out.shape, seed=6).to(dtype)
    grad_x, grad_bias = grads(out, g, x, bias)
    assert len(partial_rows) == 1 and 1 < partial_rows[0] <= 4  # several programs, the interpreter's 4 at most

    x64, bias64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    grad_x64, grad_bias64 = grads(reference(x64, bias64), g.double(), x64, bias64)
    if dtype == torch.float32:
        assert_fp32_close(grad_x, grad_x64.float())
    else:
        assert_bf16_rounded(grad_x, grad_x64.float(), triton_family)
    assert_column_sums(grad_bias, grad_bias64, grad_x64.abs().sum(0), ROWS)


def test_split_rows_covers_every_tile_once_in_power_of_two_runs():
    pytest.importorskip("triton")
    from megapipe.fusions.triton_column_sums import split_rows

    for tiles in (0, 1, 5, 10, 512, 4096):
        for wanted in (1, 3, 4, 264, 1056):
            programs, each = split_rows(tiles, wanted)
            assert each & (each - 1) == 0 and programs <= max(wanted, 1)
            assert (programs - 1) * each < max(tiles, 1) <= programs * each  # no empty program, no tile left
    assert split_rows(4096, 264) == (256, 16)  # LayerNorm backward at 8192 tokens, width 2048, on 132 multiprocessors
