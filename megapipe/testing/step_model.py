"""A step-time model: one training step counted on the fake device, priced on a named GPU.

``count_step`` runs a whole training step (``micro_batches`` forward and backward passes, then
the optimizer step) on fake tensors and records every operator's FLOPs and bytes
(``megapipe.testing.op_costs``), the kernels a GPU would run in place of the fake device's:

- attention is the flash-attention operator (the fake device's ``scaled_dot_product_attention``
  would pick the math kernel and its [s, s] scores; the H100 measured runs cuDNN's, the same
  FLOPs and bytes);
- the optimizer is torch's fused AdamW, as ``build_inner_optimizer`` picks on CUDA;
- each fused operator that the GPU's fusion backend (Triton, the one the H100 image selects)
  runs as one kernel each way counts as that one kernel (``op_costs.one_kernel``), not as the
  chain of eager operators it falls back to on the fake device: ``FUSED_KERNELS`` names the Python
  functions that are each one kernel there (an autograd function's ``forward`` and ``backward``,
  or a plain function), used only where ``OPS_BY_FAMILY`` says that backend has the operator. A
  fused kernel written as a custom operator needs no entry: it is one operator already.

``step_seconds`` prices the counted kernels on a ``GPU``: each takes
max(FLOPs / (peak x efficiency), bytes / (bandwidth x memory efficiency)) plus a launch
overhead; a matrix product's peak is the dense bf16 one (FP8 inputs: the FP8 one). Attention is
compute-bound with an efficiency of its own, of ``torch.utils.flop_counter``'s full-matrix count
(the causal half a flash kernel skips is in it; its backward counts 2.5 forwards); two measured
steps cannot separate it from the matrix products', so the fit gives both one value, which puts
attention at 10% of GPT-1.3B's step against 12% in the H100's profile. ``CALIBRATED`` holds the
constants fitted to the measured H100 steps (``calibrate``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence
from unittest import mock

import torch
import torch.nn.functional as F

from megapipe.errors import ConfigError
from megapipe.fusions.backend import OPS_BY_FAMILY
from megapipe.models.flops import device_peak_tflops
from megapipe.testing.fake_device import FAKE_DEVICE, fake_accelerator
from megapipe.testing.op_costs import CATEGORIES, OpCost, OpCosts

GPU_FUSION_BACKEND = "triton"  # what select_backend("auto") picks on the H100 image (no apex there)
# fused operator -> (its category, module, the functions that are each one kernel on the GPU)
FUSED_KERNELS = {
    "bias_gelu": ("elementwise", "megapipe.fusions.bias_gelu", ("_BiasGeLU.forward", "_BiasGeLU.backward")),
    "bias_dropout_add": ("elementwise", "megapipe.fusions.bias_dropout_add",
                         ("_BiasDropoutAdd.forward", "_BiasDropoutAdd.backward")),
    "softmax": ("elementwise", "megapipe.fusions.softmax",
                ("_ScaleMaskSoftmax.forward", "_ScaleMaskSoftmax.backward")),
    "swiglu": ("elementwise", "megapipe.fusions.swiglu", ("_SwiGLU.forward", "_SwiGLU.backward")),
    "cross_entropy": ("cross-entropy", "megapipe.fusions.fused_cross_entropy", ("row_stats", "softmax_gradient")),
}


@dataclass(frozen=True)
class GPU:
    """A GPU part: dense bf16 peak (FLOP/s; Hopper's dense FP8 peak is twice it) and HBM bandwidth (bytes/s)."""

    name: str
    peak: float
    bandwidth: float

    @property
    def fp8_peak(self) -> float:
        return 2 * self.peak


# --device name -> (part, the name megapipe.models.flops knows its bf16 peak by, HBM bytes/s)
PARTS = {"h100": ("H100 SXM", "H100", 3.35e12), "h200": ("H200", "H200", 4.8e12)}


def gpu_part(name: str, peak_tflops: float | None = None, bandwidth_tbs: float | None = None) -> GPU:
    """The GPU ``name`` (``PARTS``), its figures replaced by the ones given; any name with both given."""
    known = PARTS.get(name.lower())
    if known is None and (peak_tflops is None or bandwidth_tbs is None):
        raise ConfigError(f"--device {name} is not a GPU the step model knows ({', '.join(PARTS)}); give its "
                          "dense bf16 peak and HBM bandwidth with --device-peak-tflops and --device-bandwidth "
                          "(TB/s).")
    for flag, value in (("--device-peak-tflops", peak_tflops), ("--device-bandwidth", bandwidth_tbs)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} {value:g} must be above 0.")
    part, peak_name, bandwidth = known or (name, None, None)
    peak = peak_tflops * 1e12 if peak_tflops is not None else device_peak_tflops(peak_name) * 1e12
    return GPU(part, peak, bandwidth_tbs * 1e12 if bandwidth_tbs is not None else bandwidth)


@dataclass(frozen=True)
class Efficiency:
    """Shares of the peaks a kernel reaches: matrix products, attention (of its full-matrix FLOPs) and
    memory traffic, and the fixed cost of each kernel launch in seconds."""

    matmul: float
    attention: float
    memory: float
    launch: float


# ``calibrate``d to the steps and forward-backward passes bench_single_device.py measured on one H100 at
# commit 2568abb (GPT-1.3B 1321 and 1296 ms, GPT-350M 1049 and 1044 ms; within 0.4%) with a launch fixed
# at 2 microseconds; the variants measured there and not fitted (fusions off, selective and full
# recomputation) come out within 6% (``python benchmarks/bench_step_model.py --calibrate`` at that commit).
CALIBRATED = Efficiency(matmul=0.746, attention=0.746, memory=0.570, launch=2e-6)


def kernel_seconds(op: OpCost, gpu: GPU, efficiency: Efficiency) -> float:
    """One kernel on ``gpu``: compute or memory time, whichever is longer, plus its launch."""
    if not op.kernels:
        return 0.0
    compute = efficiency.attention if op.category == "attention" else efficiency.matmul
    peak = gpu.fp8_peak if op.fp8 else gpu.peak
    return max(op.flops / (peak * compute), op.bytes / (gpu.bandwidth * efficiency.memory)) + efficiency.launch


def step_seconds(ops: Iterable[OpCost], gpu: GPU, efficiency: Efficiency) -> float:
    return sum(kernel_seconds(op, gpu, efficiency) for op in ops)


def seconds_by_category(ops: Iterable[OpCost], gpu: GPU, efficiency: Efficiency) -> dict[str, float]:
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for op in ops:
        seconds[op.category] += kernel_seconds(op, gpu, efficiency)
    return seconds


def calibrate(targets: Sequence[tuple[Sequence[OpCost], float]], gpu: GPU, launch: float) -> Efficiency:
    """The matmul and memory efficiencies whose predictions of ``targets`` (counted kernels, measured
    seconds) on ``gpu`` come closest, in the least squares of the log-ratios; attention takes the matmul's
    efficiency and each kernel costs ``launch`` seconds, fixed beforehand: the measured steps fit equally
    well from 0 to 4 microseconds a launch, each with its own memory efficiency, so they cannot tell
    the two apart. A 21 x 21 grid over [0, 1]^2, narrowed five times around its best point."""
    import numpy as np

    arrays = []
    for ops, seconds in targets:
        kernels = [op for op in ops if op.kernels]
        peaks = np.array([gpu.fp8_peak if op.fp8 else gpu.peak for op in kernels])
        arrays.append((np.array([op.flops for op in kernels], dtype=float) / peaks,
                       np.array([op.bytes for op in kernels], dtype=float) / gpu.bandwidth,
                       len(kernels) * launch, seconds))

    def misfit(matmul: float, memory: float) -> float:
        return sum((math.log((np.maximum(compute / matmul, traffic / memory).sum() + launches) / seconds)) ** 2
                   for compute, traffic, launches, seconds in arrays)

    centre, width = (0.5, 0.5), 0.5
    for _ in range(6):
        axes = [np.clip(np.linspace(c - width, c + width, 21), 0.01, 1.0) for c in centre]
        centre = min(((a, b) for a in axes[0] for b in axes[1]), key=lambda point: misfit(*point))
        width /= 5
    matmul, memory = (round(float(value), 3) for value in centre)
    return Efficiency(matmul=matmul, attention=matmul, memory=memory, launch=launch)


def _one_kernel_patches(costs: OpCosts, backend: str) -> Iterator[contextlib.AbstractContextManager]:
    """Patches making each of ``FUSED_KERNELS`` that ``backend`` has, where this megapipe has it, one kernel:
    an autograd function's ``forward`` and ``backward``, or a function wherever a megapipe module holds it."""
    for op, (category, module_name, names) in FUSED_KERNELS.items():
        if op not in OPS_BY_FAMILY[backend] or importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        for name in names:
            owner_name, _, attribute = name.rpartition(".")
            owner = getattr(module, owner_name, None) if owner_name else module
            original = getattr(owner, attribute, None)
            if original is None:
                continue
            kernel = costs.one_kernel(original, category, f"{op} {attribute}")
            if owner_name:
                yield mock.patch.object(owner, attribute, staticmethod(kernel))
                continue
            for holder in [m for n, m in sys.modules.items() if n.startswith("megapipe")]:
                if getattr(holder, attribute, None) is original:
                    yield mock.patch.object(holder, attribute, kernel)


def _fp8_quantisation_patches(costs: OpCosts) -> Iterator[contextlib.AbstractContextManager]:
    """FP8 quantisation as a GPU runs it, compiled (``fusions.fp8.compile_quantisation``): the amax one kernel,
    the scaling cast another, where this megapipe has FP8."""
    if importlib.util.find_spec("megapipe.fusions.fp8") is None:
        return
    fp8 = importlib.import_module("megapipe.fusions.fp8")
    for attribute in ("_amax", "_scaled_cast"):
        kernel = costs.one_kernel(getattr(fp8, attribute), "copies", f"fp8 {attribute.strip('_')}")
        yield mock.patch.object(fp8, attribute, kernel)


_SDPA = F.scaled_dot_product_attention


def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **options):
    """``scaled_dot_product_attention`` as a GPU runs GPT's (no mask, as many key as query heads): the flash kernel."""
    if attn_mask is not None or k.size(1) != q.size(1):
        return _SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **options)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]



@contextlib.contextmanager
def gpu_kernels(costs: OpCosts, backend: str = GPU_FUSION_BACKEND) -> Iterator[None]:
    """Inside ``fake_accelerator``: the fake device runs (and ``costs`` counts) the kernels a GPU runs."""
    foreach_utils = importlib.import_module("torch.utils._foreach_utils")
    supported = foreach_utils._get_fused_kernels_supported_devices
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", flash_attention))
        for name in ("torch.utils._foreach_utils", "torch.optim.optimizer", "megapipe.optim.optimizer"):
            module = importlib.import_module(name)  # where the fused kernels' devices are asked: AdamW's on the device
            if hasattr(module, "_get_fused_kernels_supported_devices"):
                stack.enter_context(mock.patch.object(module, "_get_fused_kernels_supported_devices",
                                                      lambda: [*supported(), FAKE_DEVICE.type]))
        for patch in list(_one_kernel_patches(costs, backend)):
            stack.enter_context(patch)
        for patch in list(_fp8_quantisation_patches(costs)):
            stack.enter_context(patch)
        yield


def count_step(system, make_batch: Callable[[int], dict], micro_batches: int) -> list[OpCost]:
    """The kernels of one training step of ``system`` (``build()``, ``forward_backward(batch, m)``,
    ``optimizer_step()``, as ``benchmarks/bench_single_device.py``'s systems) on the fake device.

    ``make_batch(seed)`` gives one micro-batch on ``FAKE_DEVICE``. A first step, not counted, creates what
    the optimizer keeps (Adam's moments); the counted one runs ``micro_batches`` micro-batches, each
    recorded in phase "micro-batch i", and the optimizer step in phase "optimizer".
    """
    costs = OpCosts()
    with fake_accelerator(), gpu_kernels(costs):
        system.build()
        batches = [make_batch(seed) for seed in range(2)]
        system.forward_backward(batches[0], 1)
        system.optimizer_step()
        with costs:
            for index in range(micro_batches):
                with costs.phase(f"micro-batch {index}"):
                    system.forward_backward(batches[index % 2], micro_batches)
            with costs.phase("optimizer"):
                system.optimizer_step()
    return costs.ops


def per_micro_batch(ops: Sequence[OpCost], micro_batches: int) -> dict[str, float]:
    """Kernels, allocations, allocated and moved bytes per forward and backward pass (the optimizer's apart)."""
    passes = [op for op in ops if op.phase != "optimizer"]
    return {"kernels": sum(op.kernels for op in passes) / micro_batches,
            "allocations": sum(op.allocations for op in passes) / micro_batches,
            "allocated": sum(op.allocated for op in passes) / micro_batches,
            "bytes": sum(op.bytes for op in passes) / micro_batches}
