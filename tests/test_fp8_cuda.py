"""FP8 on a GPU (``-m cuda``): every recipe passes the start-up check with compiled quantisation, the compiled
quantisation gives the eager one's bits, and ``torch._scaled_mm``'s products equal their fp32 emulation on
the same quantised operands. Skipped where no CUDA device exists.

Both sides of a product sum the same exact products of FP8 values (E4M3 x E4M3 and E5M2 x E4M3 products are
exact in fp32) and round the result once to bf16; they differ by the order and precision of the fp32
accumulation (the forward uses Hopper's fast accumulation) and by that rounding: within 2^-7 of each
element plus 2^-7 of the largest, where a wrong scale or layout is off by factors.
"""

import contextlib

import pytest
import torch

from megapipe.acceptance.record import assert_close
from megapipe.fusions import fp8
from megapipe.fusions.backend import compile_problem
from megapipe.fusions.fp8 import FORMATS, RECIPES, Fp8Recipe, compiling_quantisation
from megapipe.fusions.fp8_mode import activate, select_fp8
from megapipe.tensor_parallel.fp8_linear import parallel_linear
from megapipe.tensor_parallel.grad_accumulation import TARGET, MainGradTarget

DEVICE = torch.device("cuda") if torch.cuda.is_available() else None
pytestmark = [pytest.mark.unit, pytest.mark.cuda, pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")]
RECIPE_CASES = [Fp8Recipe(f, r) for f in FORMATS for r in RECIPES]
BOUND = dict(rtol=2 ** -7, scale=2 ** -7)


@pytest.fixture(autouse=True)
def restored():
    previous, compiled = activate(None), compiling_quantisation()
    yield
    activate(previous)
    fp8.compile_quantisation(compiled)


@pytest.mark.parametrize("recipe", RECIPE_CASES, ids=str)
def test_every_recipe_passes_the_start_up_check(recipe):
    assert select_fp8(recipe.format, recipe.recipe, DEVICE) == recipe
    assert compiling_quantisation() == (compile_problem(DEVICE) is None)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rowwise,dim,transposed", [(False, 0, False), (False, 0, True), (True, 1, False),
                                                    (True, 0, True)])
def test_compiled_quantisation_gives_the_eager_bits(dtype, rowwise, dim, transposed):
    if compile_problem(DEVICE) is not None:
        pytest.skip(compile_problem(DEVICE))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(4096, 2048, generator=g, device=DEVICE, dtype=torch.bfloat16)
    x = x * torch.logspace(-4, 4, 2048, device=DEVICE, dtype=torch.bfloat16)
    x = x.t() if transposed else x
    fp8.compile_quantisation(False)
    eager = fp8.quantise(x, dtype, rowwise, dim)
    fp8.compile_quantisation(True)
    compiled = fp8.quantise(x, dtype, rowwise, dim)
    assert torch.equal(compiled.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert torch.equal(compiled.scale, eager.scale)


def _products(recipe, x, w, bias, dy, emulate: bool):
    """(y, dx, dW from the backward, dW added into an fp32 main gradient)."""
    x, w, bias = (t.detach().clone().requires_grad_() for t in (x, w, bias))
    activate(recipe)
    with fp8.emulated() if emulate else contextlib.nullcontext():
        y = parallel_linear(x, w, bias)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        main_grad = torch.zeros(w.shape, device=DEVICE)
        setattr(w, TARGET, MainGradTarget(lambda: main_grad, lambda: None))
        parallel_linear(x, w, bias).backward(dy)
    return y.detach(), dx, dw, main_grad


@pytest.mark.parametrize("recipe", RECIPE_CASES, ids=str)
def test_kernel_products_equal_their_fp32_emulation(recipe):
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulation's fp32 products in fp32
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(4096, 2048, generator=g, device=DEVICE, dtype=torch.bfloat16)
    w = 0.02 * torch.randn(6144, 2048, generator=g, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(6144, generator=g, device=DEVICE, dtype=torch.bfloat16)
    dy = 1e-4 * torch.randn(4096, 6144, generator=g, device=DEVICE, dtype=torch.bfloat16)
    kernel, emulated = _products(recipe, x, w, bias, dy, False), _products(recipe, x, w, bias, dy, True)
    for name, got, want in zip(("y", "dx", "dW", "main_grad"), kernel, emulated):
        assert_close(got, want, **BOUND, what=f"{recipe} {name}")
