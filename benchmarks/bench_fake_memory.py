"""Peak device memory of a GPT training step without a GPU, next to the planner's memory model.

The step is ``bench_single_device.py``'s megapipe system (bf16 weights, fp32 master weights and
main gradients, Adam, gradient clipping; dropout on), run twice on fake accelerator tensors
(``megapipe.testing.fake_device``): no kernel runs, but every storage the step creates on the device is
counted from its creation until its last user lets it go, so the peak is what the caching
allocator would have to hold (before its rounding to blocks and its fragmentation). The second
step counts Adam's moments, created by the first. Attention and Adam run as on a CUDA device: the
fake device's ``scaled_dot_product_attention`` would pick the math kernel, which holds the [s, s]
scores, so the step calls the flash-attention operator a GPU picks for these bf16 shapes instead,
and Adam is torch's fused kernel, as megapipe picks it on a GPU (``fake_device.flash_attention``,
``fused_optimizers``). The planner's MEMORY(.) for the same shape, micro-batch and schedule (one
device, closed-form bf16 profile of flash attention) stands beside it.

    python benchmarks/bench_fake_memory.py                       # gpt-350m and gpt-1.3b at sequence 2048
    python benchmarks/bench_fake_memory.py --shape gpt-1.3b --micro-batch-size 2
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from harness import cli
from harness.report import print_ruled
from bench_single_device import SHAPES, Megapipe, make_batch
from megapipe.testing.fake_device import (FAKE_DEVICE, DeviceMemory, fake_accelerator, flash_attention,
                                          fused_optimizers)
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.presets import cluster_preset
from megapipe.planner.profile import ModelShape
from megapipe.planner.units import GIB

VARIANTS = {"no recomputation": {}, "selective recomputation": dict(recompute_granularity="selective"),
            "full recomputation": dict(recompute_granularity="full", recompute_method="uniform",
                                       recompute_num_layers=1)}


def measured_peak(shape, overrides: dict) -> float:
    """Peak bytes on the device over two training steps of megapipe on fake tensors."""
    with fake_accelerator(), fused_optimizers(), DeviceMemory() as memory, flash_attention():
        system = Megapipe("megapipe", shape, FAKE_DEVICE, dropout=0.1, **overrides)
        system.build()
        for seed in range(2):
            system.forward_backward(make_batch(shape, FAKE_DEVICE, seed), 1)
            system.optimizer_step()
    return memory.peak


def planned_peak(shape, granularity: str | None) -> float:
    """The planner's MEMORY(.) of the same model, micro-batch and schedule on one device, recomputing at
    ``granularity`` (None, "selective" or "full")."""
    config = Megapipe("megapipe", shape, FAKE_DEVICE, dropout=0.1).config()
    model = ModelShape.from_config("gpt", replace(config, vocab_size=config.padded_vocab_size(1)))
    profile = analytic_gpt_profile(model, achieved_flops=1e14, micro_batch_sizes=(shape.micro_batch,),
                                   dtype="bfloat16", selective=granularity == "selective", flash=True)
    costs = PlanCostModel(profile, cluster_preset("a100-80gb-1x8"), Training(global_batch_size=shape.micro_batch))
    return costs.estimate(Candidate(1, 1, 1, shape.micro_batch, "1f1b", recompute=granularity == "full")).memory


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--shape", default="gpt-350m,gpt-1.3b", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the shape's")
    args = parser.parse_args()
    header = f"{'model':10s} {'micro-batch':>11s} {'variant':23s} {'fake device GiB':>15s} {'planner GiB':>11s} " \
             f"{'planner/fake':>12s}"
    print(f"torch {torch.__version__}; sequence lengths and micro-batches as bench_single_device.py")
    print_ruled(header)
    for name in args.shape.split(","):
        shape = SHAPES[name]
        if args.micro_batch_size:
            shape = replace(shape, micro_batch=args.micro_batch_size)
        for variant, overrides in VARIANTS.items():
            started = time.perf_counter()
            fake = measured_peak(shape, overrides)
            planned = planned_peak(shape, overrides.get("recompute_granularity"))
            print(f"{name:10s} {shape.micro_batch:11d} {variant:23s} {fake / GIB:15.2f} {planned / GIB:11.2f} "
                  f"{planned / fake:12.2f}   ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
