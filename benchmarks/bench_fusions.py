"""The gain of each fused operator on its own, forward + backward (cf. seed 002 section 4.5.8).

For every op at one transformer-layer shape, times the unfused PyTorch composition (the
``--no-*-fusion`` path) and the fused op under each requested backend, and prints a table of
times and unfused/fused ratios. On CPU the default shape is small (s=256, b=4, h=512); with
CUDA it is a GPT-3-like layer slice (s=2048, b=4, h=4096).

    python benchmarks/bench_fusions.py                      # eager and torch.compile kernels
    python benchmarks/bench_fusions.py --backends eager --dtype bfloat16
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.utils import benchmark

from harness import cli
from harness.report import print_ruled
from megapipe import fusions
from megapipe.parallel.launch import default_device
from megapipe.fusions import backend

SHAPES = {"cpu": dict(s=256, b=4, h=512, heads=8), "cuda": dict(s=2048, b=4, h=4096, heads=32)}


def layer_norm_unfused(x, weight, bias, eps=1e-5):
    """LayerNorm from primitive ops: what a fused LayerNorm kernel replaces."""
    mean = x.mean(-1, keepdim=True)
    centered = x - mean
    return centered / torch.sqrt((centered * centered).mean(-1, keepdim=True) + eps) * weight + bias


def make_cases(s, b, h, heads, dtype, device):
    """{op name: (inputs, unfused fn, fused fn)}; each fn maps the inputs to one output tensor."""
    def tensor(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=device)).to(dtype).requires_grad_()

    x4h, bias4h = tensor(s, b, 4 * h), tensor(4 * h)
    xh, biash, residual = tensor(s, b, h), tensor(h), tensor(s, b, h)
    scores = tensor(b, heads, s, s, scale=3.0)
    padding = (torch.arange(s, device=device) >= s - s // 8).view(1, 1, 1, s).expand(b, 1, 1, s)
    q, k, v = (tensor(b, heads, s, h // heads) for _ in range(3))
    norm = fusions.LayerNorm(h, device=device, dtype=dtype)
    scale = (h // heads) ** -0.5
    return {
        "bias+gelu (tanh)": ((x4h, bias4h), lambda x, bb: fusions.bias_gelu(x, bb, "tanh", fused=False),
                             lambda x, bb: fusions.bias_gelu(x, bb, "tanh")),
        "bias+dropout+add": ((xh, biash, residual),
                             lambda x, bb, r: fusions.bias_dropout_add(x, bb, r, 0.1, True, fused=False),
                             lambda x, bb, r: fusions.bias_dropout_add(x, bb, r, 0.1, True)),
        "scale+mask+softmax (padding)": ((scores,),
                                         lambda x: fusions.scale_mask_softmax(x, scale, padding, fused=False),
                                         lambda x: fusions.scale_mask_softmax(x, scale, padding)),
        "scale+mask+softmax (causal)": ((scores,),
                                        lambda x: fusions.scale_mask_softmax(x, scale, causal=True, fused=False),
                                        lambda x: fusions.scale_mask_softmax(x, scale, causal=True)),
        "layernorm": ((xh,), lambda x: layer_norm_unfused(x, norm.weight, norm.bias), norm),
        "attention core (causal, dropout 0.1)": (
            (q, k, v),
            lambda q, k, v: fusions.attention(q, k, v, causal=True, dropout_p=0.1, training=True, fused=False),
            lambda q, k, v: fusions.attention(q, k, v, causal=True, dropout_p=0.1, training=True)),
    }


def forward_backward_timer(fn: Callable, inputs, fusion_backend: backend.FusionBackend) -> benchmark.Timer:
    """A timer of one forward + backward pass under ``fusion_backend``, warmed up (which also compiles)."""
    def step():
        backend.activate(fusion_backend)  # timers of several backends run interleaved
        torch.autograd.grad(fn(*inputs), inputs, grad)

    backend.activate(fusion_backend)
    grad = torch.randn_like(fn(*inputs))

    for _ in range(3):
        step()
    return benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=torch.get_num_threads())


def best_medians(timers: list[benchmark.Timer], rounds: int, min_run_time: float) -> list[float]:
    """Per timer, the smallest median over ``rounds`` interleaved measurements (seconds).

    Interleaving and keeping the best round make the ratios robust to other load on the machine.
    """
    best = [float("inf")] * len(timers)
    for _ in range(rounds):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], timer.blocked_autorange(min_run_time=min_run_time).median)
    return best


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--backends", default=None,
                        help="comma-separated fused backends to time (default: eager,compile on CPU; auto,compile on CUDA)")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds of timed runs per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurements per variant; the best counts")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = default_device()
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    names = (args.backends or ("eager,compile" if device.type == "cpu" else "auto,compile")).split(",")
    shape = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    print(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, threads {torch.get_num_threads()}, "
          f"shape s={shape['s']} b={shape['b']} h={shape['h']} heads={shape['heads']}")

    chosen = [fusions.select_backend(name, device) for name in names]
    for choice in chosen:
        print(f"fusion backend: {choice.name} ({choice.reason})")
    cases = make_cases(**shape, dtype=dtype, device=device)
    header = f"{'op':38s} {'unfused ms':>11s}" + "".join(f" {c.name + ' ms':>12s} {'ratio':>6s}" for c in chosen)
    print_ruled(header)
    for op, (inputs, unfused, fused) in cases.items():
        started = time.perf_counter()
        timers = [forward_backward_timer(unfused, inputs, chosen[0])]
        timers += [forward_backward_timer(fused, inputs, choice) for choice in chosen]
        base, *times = best_medians(timers, args.rounds, args.min_run_time)
        row = f"{op:38s} {base * 1e3:11.3f}" + "".join(f" {t * 1e3:12.3f} {base / t:6.2f}" for t in times)
        print(row + f"   ({time.perf_counter() - started:.0f} s)", flush=True)
    print("ratio = unfused time / fused time (> 1: the fusion helps).")


if __name__ == "__main__":
    main()
