"""FP8 training (``--fp8-format``, ``--fp8-recipe``) on a CPU, against an independent float64 reference.

The reference quantises on its own: the scale is 2^-k with k = floor(log2(max / amax)) (the quotient in fp32,
the logarithm in float64), the FP8 values are torch's cast of the scaled values, and products are float64
matrix products of the dequantised operands. Then:

* ``quantise`` gives the reference's FP8 values bit for bit and its scales exactly, from fp32 and bf16.
* The linear's forward, input gradient and weight gradient under ``fp8.emulated()`` equal the reference's
  for both formats and both recipes within the bound of an fp32 dot product of length K,
  ``|error| <= K * 2^-24 * (|A| @ |B|)`` elementwise (the operands are exact in both; only the order and
  rounding of fp32 additions differ); the bias gradient is the sum of the unquantised output gradients.
* The kernel path (the CPU's ``torch._scaled_mm``, with widths that need padding to multiples of 16) gives
  the same products as the emulation within the same bound.
* Zero-bubble's BI defers the FP8 weight gradient and BW computes the same bits; with gradient-accumulation
  fusion it goes into ``main_grad``; in a whole engine the linears' main gradients under zb-h1 equal 1F1B's
  bit for bit.
* A tiny GPT trains in bf16 under emulation with losses within 3% of the bf16 run's; the state dict is
  the same in format, and a model without FP8 loads it.
* On the fake accelerator the kernel path runs a bf16 GPT's step with no extra host waits, and tensorwise
  keeps fewer bytes for the backward.
* Flags and devices are refused in one sentence each.
"""

from __future__ import annotations

import math

import pytest
import torch

from batch_helpers import random_microbatch
from fake_device_helpers import S, model_config as fake_model_config
from megapipe.cli.parse import parse_config
from megapipe.config.schema import TrainingConfig
from megapipe.errors import ConfigError
from megapipe.fusions import fp8
from megapipe.fusions.fp8 import FORMATS, RECIPES, Fp8Recipe, quantise, scaled_mm
from megapipe.fusions.fp8_mode import activate, active_fp8, select_fp8
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.tensor_parallel.fp8_linear import parallel_linear
from megapipe.tensor_parallel.grad_accumulation import TARGET, MainGradTarget
from megapipe.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients
from megapipe.testing.fake_device import FAKE_DEVICE, DeviceMemory, fake_accelerator
from test_pipeline_training import model_config

pytestmark = pytest.mark.unit

RECIPE_CASES = [Fp8Recipe(f, r) for f in FORMATS for r in RECIPES]
U32 = 2.0 ** -24  # fp32's unit roundoff


@pytest.fixture
def recipe_off():
    """Leaves the active recipe as it was found."""
    previous = activate(None)
    yield
    activate(previous)


def reference_quantise(t: torch.Tensor, dtype: torch.dtype, reduce_dim=None):
    """(dequantised float64 values, the fp8 values, the dequantisation scale): the scale is 2^-k for
    k = floor(log2(max / amax)), the ratio an fp32 quotient, its logarithm taken in float64."""
    t64 = t.detach().double()
    amax = t64.abs().amax() if reduce_dim is None else t64.abs().amax(dim=reduce_dim, keepdim=True)
    ratio = torch.tensor(torch.finfo(dtype).max) / amax.float()  # amax of fp32 or bf16 values: exact in fp32
    k = torch.floor(torch.log2(ratio.double()))
    values = (t64 * 2.0 ** k).float().to(dtype)  # exact in fp32: a power-of-two multiple of an fp32 value
    return values.double() * 2.0 ** -k, values, 2.0 ** -k


def within_fp32_dot_bound(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``got`` equals float64 ``a @ b`` within an fp32 dot product's error bound, elementwise."""
    want, bound = a @ b, (a.shape[1] + 2) * U32 * (a.abs() @ b.abs())
    assert got.shape == want.shape
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, float(excess.max())


def operands(seed: int, tokens: int = 24, features: int = 40, outputs: int = 24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=g)
    x[3] *= 40.0  # an outlier row: rowwise and tensorwise scales differ
    return (x.requires_grad_(), (0.1 * torch.randn(outputs, features, generator=g)).requires_grad_(),
            torch.randn(outputs, generator=g).requires_grad_(), torch.randn(tokens, outputs, generator=g) * 1e-3)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rowwise", [False, True])
def test_quantise_equals_the_reference_bit_for_bit(dtype, source, rowwise):
    x = (operands(0)[0].detach() * torch.logspace(-6, 3, 40)).to(source)  # columns over nine decades
    got = quantise(x, dtype, rowwise, 1)
    _, values, scale = reference_quantise(x, dtype, 1 if rowwise else None)
    assert torch.equal(got.data.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(got.scale.double(), scale)
    assert got.scale.shape == ((x.shape[0], 1) if rowwise else ())
    ratio = x.double().abs().amax(1 if rowwise else None) / got.scale.double().squeeze()
    top = torch.finfo(dtype).max
    assert (ratio <= top * (1 + U32)).all() and (ratio > top / 2).all()  # the largest power of two that fits


def test_non_finite_inputs_give_non_finite_products():
    x, w = torch.ones(16, 16), torch.ones(16, 16)
    x[2, 3] = math.inf
    with fp8.emulated():
        for rowwise in (False, True):
            a, b = quantise(x, torch.float8_e4m3fn, rowwise, 1), quantise(w, torch.float8_e4m3fn, rowwise, 0)
            out = scaled_mm(a, b, torch.float32)
            assert not out[2].isfinite().any()
            assert out[0].isfinite().all() == rowwise  # tensorwise: one scale, every row is lost with it


def fp8_linear_grads(recipe: Fp8Recipe, x, w, bias, dy):
    """(y, dx, dW, dbias) of the FP8 linear under emulation."""
    activate(recipe)
    with fp8.emulated():
        y = parallel_linear(x, w, bias)
        dx, dw, db = torch.autograd.grad(y, (x, w, bias), dy)
    return y, dx, dw, db


@pytest.mark.parametrize("recipe", RECIPE_CASES, ids=str)
def test_linear_forward_and_backward_equal_the_float64_reference(recipe, recipe_off):
    x, w, bias, dy = operands(1)
    y, dx, dw, db = fp8_linear_grads(recipe, x, w, bias, dy)
    rows = 1 if recipe.rowwise else None  # rowwise: each operand reduced over its contraction dimension
    cols = 0 if recipe.rowwise else None
    forward, gradient = recipe.forward_dtype, recipe.gradient_dtype
    xq, wq = reference_quantise(x, forward, rows)[0], reference_quantise(w.t(), forward, cols)[0]
    within_fp32_dot_bound(y - bias.detach(), xq, wq)
    dyq, wq_dx = reference_quantise(dy, gradient, rows)[0], reference_quantise(w, forward, cols)[0]
    within_fp32_dot_bound(dx, dyq, wq_dx)
    dyq_t, xq_dw = reference_quantise(dy.t(), gradient, rows)[0], reference_quantise(x, forward, cols)[0]
    within_fp32_dot_bound(dw, dyq_t, xq_dw)
    assert torch.equal(db, dy.sum(0))
    # the FP8 products are the quantised ones: far from exact, close to the fp32 linear
    exact = x.detach() @ w.detach().t()
    assert 1e-3 < float((y.detach() - bias.detach() - exact).norm() / exact.norm()) < 0.1


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("shape", [(24, 48, 32), (20, 40, 24)])  # (M, K, N); the second needs padding
def test_kernel_path_equals_the_emulation(rowwise, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(2)
    a = quantise(torch.randn(m, k, generator=g), torch.float8_e5m2, rowwise, 1)
    b = quantise(torch.randn(k, n, generator=g), torch.float8_e4m3fn, rowwise, 0)
    try:
        got = scaled_mm(a, b, torch.float32)
    except (RuntimeError, NotImplementedError) as error:  # torch 2.11's CPU kernel is tensorwise only
        pytest.skip(f"this torch's CPU torch._scaled_mm cannot: {str(error).splitlines()[0][:80]}")
    within_fp32_dot_bound(got, a.dequantised().double(), b.dequantised().double())


@pytest.mark.parametrize("recipe", RECIPE_CASES, ids=str)
def test_weight_gradient_is_deferred_to_bw_and_fused_into_main_grad(recipe, recipe_off):
    x, w, bias, dy = operands(3)
    _, _, dw, _ = fp8_linear_grads(recipe, x, w, bias, dy)
    with fp8.emulated():
        deferred = []
        with deferring_weight_gradients(deferred):
            parallel_linear(x, w, bias).backward(dy)
        assert w.grad is None and len(deferred) == 1 and x.grad is not None
        apply_weight_gradients(deferred)
        assert torch.equal(w.grad, dw)
        main_grad, closed = torch.zeros_like(w), []
        setattr(w, TARGET, MainGradTarget(lambda: main_grad, lambda: closed.append(True)))
        w.grad = None
        parallel_linear(x, w, bias).backward(dy)
        delattr(w, TARGET)
    assert w.grad is None and torch.equal(main_grad, dw)


def test_parallel_linears_follow_the_active_recipe(recipe_off):
    ps, x = ParallelState.single(), torch.randn(5, 3, 32)
    column = ColumnParallelLinear(32, 48, ps, name="c", seed=1, init_std=0.1)
    row = RowParallelLinear(48, 32, ps, name="r", seed=1, init_std=0.1)
    plain = row(column(x))
    assert torch.allclose(plain, torch.nn.functional.linear(torch.nn.functional.linear(x, column.weight,
                                                            column.bias), row.weight, row.bias), atol=1e-6)
    activate(Fp8Recipe("e4m3"))
    with fp8.emulated():
        quantised = row(column(x))
        x_q = quantise(x.reshape(-1, 32), torch.float8_e4m3fn, False, 1)
        w_q = quantise(column.weight.t(), torch.float8_e4m3fn, False, 0)
        h = scaled_mm(x_q, w_q, torch.float32) + column.bias
        h_q, v_q = quantise(h, torch.float8_e4m3fn, False, 1), quantise(row.weight.t(), torch.float8_e4m3fn, False, 0)
        want = (scaled_mm(h_q, v_q, torch.float32) + row.bias).view(5, 3, 32)
    assert torch.equal(quantised, want) and not torch.equal(quantised, plain)


def engine_run(recipe, schedule: str, dtype: torch.dtype, steps: int, num_layers: int = 2):
    """(losses per step, main gradients of the last step) of a p = d = 1 engine on 4 fixed microbatches."""
    activate(recipe)
    torch.manual_seed(0)
    config = model_config("gpt", num_layers=num_layers, dtype=dtype)
    ps = ParallelState.single()
    chunks = build_model_chunks("gpt", config, ps)
    optimizer = OptimizerConfig(lr=1e-2, bf16=dtype == torch.bfloat16, weight_decay=0.0, clip_grad=1.0)
    engine = PipelineEngine(chunks, ps, optimizer, schedule, 4, (config.seq_length, 2, config.hidden_size),
                            dtype=dtype)
    batches = [random_microbatch("gpt", config.vocab_size, 2, config.seq_length, seed=i) for i in range(4)]
    opt, grads, losses = engine.optimizers[0], [], []
    step = opt.step

    def recording_step(*args, **kwargs):
        names = {id(param): name for name, param in chunks[0].named_parameters()}
        grads[:] = [(names[id(param)], grad.clone()) for param, grad in zip(opt.model_params, opt.main_grads)]
        return step(*args, **kwargs)

    opt.step = recording_step
    with fp8.emulated():
        for _ in range(steps):
            losses.append(sum(engine.train_batch(batches).losses) / len(batches))
    return losses, grads, chunks


def test_zero_bubble_defers_the_fp8_weight_gradients(recipe_off):
    """zb-h1's BW computes the FP8 linears' weight gradients that 1F1B's backward does, bit for bit; the
    other parameters' gradients (embeddings, norms) differ by the order of fp32 additions, as without FP8."""
    recipe = Fp8Recipe("hybrid", "rowwise")
    _, one_f_one_b, chunks = engine_run(recipe, "1f1b", torch.float32, steps=2)
    _, zero_bubble, _ = engine_run(recipe, "zb-h1", torch.float32, steps=2)
    linears = {f"{name}.weight" for name, module in chunks[0].named_modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear))}
    assert len(linears) == 8 and len(one_f_one_b) == len(zero_bubble)
    for (name, a), (other, b) in zip(one_f_one_b, zero_bubble):
        assert name == other
        if name in linears:
            assert torch.equal(a, b), name
        else:
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max())), name


def test_tiny_gpt_trains_in_fp8_close_to_bf16_and_its_state_loads_without_fp8(recipe_off):
    """Losses of 12 steps on the same 4 microbatches (the model learns them by heart): bf16's fall by more
    than half; FP8's stay within 3% of bf16's at every step. (bf16's are within 0.4% of fp32's; FP8 rounds
    each operand to 2^-4 (E4M3) or 2^-3 (E5M2) of itself, 16-32 times bf16's 2^-8.)"""
    bf16, _, _ = engine_run(None, "1f1b", torch.bfloat16, steps=12)
    for recipe in (Fp8Recipe("e4m3"), Fp8Recipe("hybrid", "rowwise")):
        ours, _, chunks = engine_run(recipe, "1f1b", torch.bfloat16, steps=12)
        assert bf16[-1] < 0.5 * bf16[0]
        assert max(abs(a - b) / b for a, b in zip(ours, bf16)) < 0.03, (recipe, ours, bf16)
    state = chunks[0].state_dict()
    activate(None)
    plain = build_model_chunks("gpt", model_config("gpt", num_layers=2, dtype=torch.bfloat16),
                               ParallelState.single())[0]
    reference = plain.state_dict()
    assert {k: (v.dtype, v.shape) for k, v in state.items()} == {k: (v.dtype, v.shape) for k, v in reference.items()}
    plain.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), state.values()))


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4"]


@pytest.mark.parametrize("flags,words", [
    (["--fp8-format", "e4m3"], "needs --bf16"),
    (["--fp8-format", "hybrid", "--fp16"], "needs --bf16"),
    (["--fp8-format", "e4m3", "--bf16", "--num-experts", "4"], "experts"),
    (["--fp8-recipe", "rowwise"], "--fp8-format"),
])
def test_flags_fp8_cannot_honour_are_refused(flags, words):
    with pytest.raises(ConfigError, match=words) as refused:
        parse_config("gpt", TINY + flags)
    assert str(refused.value).count(". ") == 0  # one sentence


def test_flags_parse_and_match_the_recipes():
    config = parse_config("gpt", TINY + ["--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--bf16"])
    assert (config.training.fp8_format, config.training.fp8_recipe) == ("hybrid", "rowwise")
    assert parse_config("gpt", TINY).training.fp8_format is None
    fields = {f.name: f for f in TrainingConfig.__dataclass_fields__.values()}
    assert tuple(fields["fp8_format"].metadata["choices"]) == tuple(FORMATS)
    assert tuple(fields["fp8_recipe"].metadata["choices"]) == RECIPES


def test_a_device_without_fp8_units_is_refused_and_emulation_is_accepted(recipe_off):
    with pytest.raises(ConfigError, match="computes on the cpu; drop --fp8-format"):
        select_fp8("e4m3", "tensorwise", torch.device("cpu"))
    assert active_fp8() is None
    assert select_fp8(None, "tensorwise", torch.device("cpu")) is None
    with fp8.emulated():
        assert select_fp8("hybrid", "rowwise", torch.device("cpu")) == Fp8Recipe("hybrid", "rowwise")
    assert active_fp8() == Fp8Recipe("hybrid", "rowwise")


def fake_device_step(recipe) -> tuple[int, int]:
    """(bytes a bf16 two-layer GPT keeps from its forward for its backward, host reads of its step) on the
    fake accelerator, whose ``torch._scaled_mm`` is its meta kernel: the kernel path, not the emulation."""
    activate(recipe)
    config = fake_model_config("gpt", "bf16", hidden_dropout=0.0, attention_dropout=0.0)
    with fake_accelerator() as reads:
        ps = ParallelState.single()
        ps.seed(1234, FAKE_DEVICE)
        model = build_model_chunks("gpt", config, ps, device=FAKE_DEVICE)[0]
        tokens = torch.randint(0, config.vocab_size, (4, S), device=FAKE_DEVICE)
        with DeviceMemory() as memory:
            loss = model(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(4, S, device=FAKE_DEVICE)})
            kept = memory.current
            loss.backward()
    return kept, reads.count


def test_fp8_step_on_the_fake_accelerator(recipe_off):
    """No host/device mixing and no extra host waits; tensorwise keeps each linear's input in FP8 (half a bf16
    one's bytes) where nothing else keeps it; rowwise keeps the bf16 input, as bf16 does."""
    bf16, tensorwise, rowwise = (fake_device_step(r) for r in (None, Fp8Recipe("e4m3"), Fp8Recipe("hybrid", "rowwise")))
    assert tensorwise[1] == rowwise[1] == bf16[1]
    assert tensorwise[0] < bf16[0] == rowwise[0]
