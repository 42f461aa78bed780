"""FP8 against bf16 for the four linears of one GPT-1.3B layer, forward + backward (``--fp8-format``).

At 8,192 tokens (sequence 2048 x micro-batch 4) and hidden size 2048, the QKV (2048 -> 6144), attention
output (2048 -> 2048), fc1 (2048 -> 8192) and fc2 (8192 -> 2048) products run through megapipe's linear
in bf16, then under each FP8 format and recipe as the trainer runs them (``select_fp8``: checked on the
device, quantisation compiled where torch.compile can). Prints milliseconds per layer, the speed-up over
bf16 and the TFLOP/s of the products (6 x tokens x in x out per linear).

    python benchmarks/bench_fp8_linear.py            # on a GPU with FP8 matrix units
    python benchmarks/bench_fp8_linear.py --emulate  # the FP8 path through its fp32 emulation, small shapes,
                                                     # on any device: shows it runs; its times mean nothing
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from harness import cli
from harness.report import print_ruled
from megapipe.errors import ConfigError, reports_user_errors
from megapipe.fusions import fp8
from megapipe.fusions.fp8_mode import activate, select_fp8
from megapipe.tensor_parallel.fp8_linear import parallel_linear

RECIPES = [(None, "tensorwise"), ("e4m3", "tensorwise"), ("e4m3", "rowwise"), ("hybrid", "tensorwise"),
           ("hybrid", "rowwise")]


def layer_linears(tokens: int, hidden: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """(input, weight, output gradient) of each of a layer's four linears, bf16."""
    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)]
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    return [(randn(tokens, n_in).requires_grad_(), randn(n_out, n_in, scale=0.02).requires_grad_(),
             randn(tokens, n_out, scale=1e-4)) for n_in, n_out in shapes]


def seconds_per_layer(linears, device: torch.device, iterations: int) -> float:
    def step():
        for x, w, dy in linears:
            x.grad = w.grad = None
            parallel_linear(x, w).backward(dy)

    for _ in range(3):  # warm-up: compilation, cuBLAS heuristics
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iterations


@reports_user_errors
def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--emulate", action="store_true", help="the fp32 emulation of the FP8 products, small "
                                                                "shapes (a CPU, or a GPU without FP8 units)")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.emulate:
        raise ConfigError("this benchmark times FP8 products on a GPU and none is here; --emulate runs their fp32 "
                          "emulation on the CPU instead.")
    tokens, hidden = (256, 128) if args.emulate else (8192, 2048)
    linears = layer_linears(tokens, hidden, device)
    flops = sum(6 * tokens * w.shape[0] * w.shape[1] for _, w, _ in linears)
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {tokens} tokens, "
          f"hidden {hidden}{', FP8 products emulated in fp32' if args.emulate else ''}")
    print_ruled(f"{'products':<22}{'ms/layer':>10}{'vs bf16':>9}{'TFLOP/s':>9}")
    baseline = None
    with fp8.emulated() if args.emulate else contextlib.nullcontext():
        for fp8_format, fp8_recipe in RECIPES:
            recipe = select_fp8(fp8_format, fp8_recipe, device)  # refused in one sentence where it cannot run
            seconds = seconds_per_layer(linears, device, args.iterations)
            baseline = baseline or seconds
            name = "bf16" if recipe is None else f"FP8 {recipe}"
            print(f"{name:<22}{1e3 * seconds:>10.2f}{baseline / seconds:>8.2f}x{flops / seconds / 1e12:>9.1f}")
    activate(None)


if __name__ == "__main__":
    sys.exit(main())
