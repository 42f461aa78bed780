"""The step-time model (``megapipe.testing.step_model``): what it counts on the fake device against the
analytic counts, how it prices kernels on a GPU, and the sentence an unknown GPU gets."""

import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megapipe.errors import ConfigError
from megapipe.models.flops import flops_per_iteration
from megapipe.testing import step_model
from megapipe.testing.fake_device import FAKE_DEVICE, fake_accelerator
from megapipe.testing.op_costs import OpCost, OpCosts
from megapipe.testing.step_model import Efficiency, calibrate, count_step, gpu_part, step_seconds

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_a_step_has_the_analytic_flops_of_its_matrix_products_and_attention(bench):
    """A tiny GPT's step (2 micro-batches of 2 sequences): its matrix products add up to the model FLOPs of
    ``megapipe.models.flops`` less attention, exactly (integer counts of the same products); attention's
    forward is the analytic 4 t s h per layer, and its backward 2.5 times that (torch's count of the flash
    backward includes the recomputed scores), so 3.5 where the analytic count has 3 passes."""
    shape, micro_batches = bench.Shape(2, 64, 4, 32, 2, vocab_size=256), 2
    system = bench.Megapipe("megapipe", shape, FAKE_DEVICE, dropout=0.1)
    ops = count_step(system, lambda seed: bench.make_batch(shape, FAKE_DEVICE, seed), micro_batches)
    tokens = micro_batches * shape.micro_batch * shape.seq_length
    attention = 4 * tokens * shape.seq_length * shape.hidden_size * shape.num_layers
    analytic = flops_per_iteration(system.config(), micro_batches * shape.micro_batch, recompute=False)
    assert sum(op.flops for op in ops if op.category == "matmul") == analytic - 3 * attention
    assert sum(op.flops for op in ops if op.category == "attention") == 3.5 * attention
    assert {op.phase for op in ops} == {"micro-batch 0", "micro-batch 1", "optimizer"}
    assert all(op.flops == 0 for op in ops if op.category not in ("matmul", "attention"))


def test_one_linear_moves_its_operands_and_result_once():
    """``F.linear`` of x [t, h] and a bf16 weight [o, h] with its bias: one kernel reading t h + o h + o and
    writing t o elements of 2 bytes, 2 t h o FLOPs."""
    t, h, o = 48, 32, 80
    with fake_accelerator(), OpCosts() as costs:
        x = torch.empty(t, h, dtype=torch.bfloat16, device=FAKE_DEVICE)
        weight = torch.empty(o, h, dtype=torch.bfloat16, device=FAKE_DEVICE)
        bias = torch.empty(o, dtype=torch.bfloat16, device=FAKE_DEVICE)
        costs.ops.clear()
        F.linear(x, weight, bias)
    [op] = [op for op in costs.ops if op.kernels]
    elements = t * h + o * h + o + t * o
    assert (op.category, op.flops, op.bytes, op.allocations) == ("matmul", 2 * t * h * o, 2 * elements, 1)


def test_an_fp8_product_counts_its_flops_at_the_fp8_peak():
    """``torch._scaled_mm`` of FP8 operands: 2 m k n FLOPs, one byte an operand element, priced at twice the
    bf16 peak on Hopper."""
    m, k, n = 64, 32, 48
    with fake_accelerator(), OpCosts() as costs:
        a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=FAKE_DEVICE)
        b = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=FAKE_DEVICE).t()
        scale = torch.ones((), device=FAKE_DEVICE)
        costs.ops.clear()
        torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    [op] = [op for op in costs.ops if op.kernels]
    assert (op.category, op.fp8, op.flops, op.bytes) == ("matmul", True, 2 * m * k * n, m * k + k * n + 8 + 2 * m * n)
    gpu, efficiency = gpu_part("h100"), Efficiency(matmul=0.5, attention=0.5, memory=1.0, launch=0.0)
    assert step_model.kernel_seconds(op, gpu, efficiency) == max(2 * m * k * n / (2 * 989e12 * 0.5), op.bytes / 3.35e12)


def test_fp8_quantisation_counts_as_the_two_kernels_a_gpu_compiles_it_into():
    """Tensorwise quantisation of a bf16 [m, k] operand under ``gpu_kernels``: the amax reads it once and
    writes one bf16 number; the scaling cast reads it and that amax once and writes m k bytes of FP8 and an
    fp32 scale. Eagerly (no patches) it is many more kernels, which a GPU never runs."""
    from megapipe.fusions import fp8

    m, k = 64, 32
    with fake_accelerator(), OpCosts() as costs, step_model.gpu_kernels(costs):
        x = torch.empty(m, k, dtype=torch.bfloat16, device=FAKE_DEVICE)
        costs.ops.clear()
        fp8.quantise(x, torch.float8_e4m3fn, rowwise=False)
    assert [(op.op, op.bytes) for op in costs.ops if op.kernels] == [
        ("fp8 amax", 2 * m * k + 2), ("fp8 scaled_cast", 2 * m * k + 2 + m * k + 4)]
    with fake_accelerator(), OpCosts() as eager:
        x = torch.empty(m, k, dtype=torch.bfloat16, device=FAKE_DEVICE)
        eager.ops.clear()
        fp8.quantise(x, torch.float8_e4m3fn, rowwise=False)
    assert sum(op.kernels for op in eager.ops) > 2


def test_a_fused_kernel_reads_its_inputs_and_writes_its_result_once():
    """``one_kernel`` over a chain of three elementwise operators with intermediates: one kernel, one read of
    each input (x read twice counts once), one write; the intermediates neither move bytes nor allocate."""
    with fake_accelerator(), OpCosts() as costs:
        x = torch.empty(64, 16, device=FAKE_DEVICE)
        bias = torch.empty(16, device=FAKE_DEVICE)
        costs.ops.clear()
        fused = costs.one_kernel(lambda a, b: (a + b).mul(2.0) * a, "elementwise", "fused")
        fused(x, bias)
    [op] = costs.ops
    assert (op.op, op.kernels, op.bytes, op.allocations, op.allocated) == ("fused", 1, 4 * (64 * 16 * 2 + 16), 1,
                                                                           4 * 64 * 16)


def _ops() -> list[OpCost]:
    """A compute-bound product, a memory-bound elementwise kernel, attention and an allocation only."""
    return [OpCost("mm", "matmul", "", 10 ** 12, 10 ** 8, 1, 1, 0, False),
            OpCost("add", "elementwise", "", 0, 10 ** 10, 1, 1, 0, False),
            OpCost("flash", "attention", "", 10 ** 12, 10 ** 8, 1, 1, 0, False),
            OpCost("empty", "elementwise", "", 0, 0, 0, 1, 0, False)]


@pytest.mark.parametrize("constant", ["matmul", "attention", "memory", "launch"])
def test_the_predicted_time_is_monotone_in_each_constant(constant):
    """Higher efficiencies never predict a longer step, a dearer launch never a shorter one, and with both
    the compute-bound and the memory-bound kernel the change is strict."""
    gpu = gpu_part("h100")
    base = dict(matmul=0.5, attention=0.5, memory=0.5, launch=1e-6)
    times = [step_seconds(_ops(), gpu, Efficiency(**{**base, constant: value}))
             for value in ((0.2, 0.4, 0.6, 0.8, 1.0) if constant != "launch" else (0.0, 1e-6, 1e-5))]
    direction = 1 if constant == "launch" else -1
    assert all(direction * (later - earlier) > 0 for earlier, later in zip(times, times[1:]))


def test_the_figures_of_a_kernel_are_the_larger_of_compute_and_traffic_plus_launch():
    gpu = gpu_part("h200")
    efficiency = Efficiency(matmul=0.5, attention=0.25, memory=0.8, launch=3e-6)
    mm, add, flash, empty = (step_model.kernel_seconds(op, gpu, efficiency) for op in _ops())
    assert (gpu.peak, gpu.bandwidth) == (989e12, 4.8e12)
    assert mm == pytest.approx(1e12 / (989e12 * 0.5) + 3e-6, rel=1e-12)
    assert add == pytest.approx(1e10 / (4.8e12 * 0.8) + 3e-6, rel=1e-12)
    assert flash == pytest.approx(1e12 / (989e12 * 0.25) + 3e-6, rel=1e-12)
    assert empty == 0.0


def test_calibration_recovers_the_efficiencies_that_made_the_times():
    """Two steps of different mixes timed with known efficiencies: the fit finds them to its grid's 1e-3."""
    gpu, truth = gpu_part("h100"), Efficiency(matmul=0.71, attention=0.71, memory=0.63, launch=2e-6)
    steps = [_ops(), [op._replace(bytes=op.bytes * 3) for op in _ops()]]
    fitted = calibrate([(ops, step_seconds(ops, gpu, truth)) for ops in steps], gpu, launch=2e-6)
    assert fitted.matmul == pytest.approx(0.71, abs=1e-3) and fitted.memory == pytest.approx(0.63, abs=1e-3)


def test_an_unknown_gpu_gets_one_sentence_naming_the_flags():
    with pytest.raises(ConfigError, match=r"--device b300 is not a GPU the step model knows .*"
                                          r"--device-peak-tflops and --device-bandwidth"):
        gpu_part("b300")
    assert gpu_part("b300", peak_tflops=2500, bandwidth_tbs=8) == step_model.GPU("b300", 2.5e15, 8e12)
    assert gpu_part("H100", bandwidth_tbs=2.0).bandwidth == 2e12  # a known part with one figure replaced


def test_every_fused_kernel_named_exists():
    """``FUSED_KERNELS`` names functions of megapipe's fusions; a renamed one would silently count as eager."""
    for category, module, names in step_model.FUSED_KERNELS.values():
        for name in names:
            owner = importlib.import_module(module)
            for part in name.split("."):
                owner = getattr(owner, part)
            assert callable(owner), f"{module}.{name}"


@pytest.fixture(scope="module")
def step_bench():
    """``benchmarks/bench_step_model.py`` as a module (``sys.path`` as it was afterwards)."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("bench_step_model")
    finally:
        sys.path[:] = saved


def test_a_switch_this_megapipe_lacks_makes_its_row_not_available(step_bench):
    assert step_bench.row_settings(("--no-such-switch",)) == (
        None, None, "not available in this megapipe (unknown flag --no-such-switch)")
    assert step_bench.row_settings(("--recompute-granularity", "selective")) == (
        {"recompute_granularity": "selective"}, {}, None)
    assert step_bench.row_settings(("--no-bias-gelu-fusion",)) == ({"bias_gelu_fusion": False}, {}, None)
