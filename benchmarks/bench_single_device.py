"""One GPT training step on one device: megapipe against Hugging Face and megatron-core.

Times a whole training step (forward, backward, optimizer step with gradient clipping) of the
same GPT shape, batch and sequence under each system and prints tokens/s and model FLOPs
utilisation (MFU), with the ratio to Hugging Face ``GPT2LMHeadModel`` trained the plain way:

- megapipe: bf16 weights with fp32 master weights and fp32 main gradients, fused kernels on;
  the same with every fusion off (``--no-bias-gelu-fusion --no-bias-dropout-fusion
  --no-masked-softmax-fusion``); with selective recomputation; with full recomputation.
- Hugging Face: fp32 weights under bf16 autocast, fused ``torch.optim.AdamW`` with weight
  decay off for biases and norms, ``clip_grad_norm_`` (what ``Trainer(bf16=True)`` does), SDPA
  attention; ``--hf-precision bf16`` trains bf16 weights instead, ``both`` times both.
- megatron-core: ``GPTModel`` with its local layer spec, Float16Module, DDP and its optimizer
  (``benchmarks/mcore_gpt.py``); where it cannot run, the row gives the reason.

FLOPs per step are model FLOPs, the same formula for every system (``megapipe.flops``, seed 002
eq. 4.2 without the recomputation term), so recomputation shows up as lower MFU. On CUDA the
peak is the device's dense bf16 peak; on CPU it is measured: the best bf16 throughput of a large
square matmul with the threads used. Before timing, the script checks in fp32 with dropout off
that megapipe and Hugging Face give the same loss (and gradient norm) from the same weights.

On CPU the systems are interleaved round by round in one process (medians over rounds), so
load from other processes hits them alike, on one thread, timed by that thread's CPU time
(``--clock cpu``: on a shared machine elapsed time mostly measures the other processes; pass
``--threads N`` for several threads and elapsed time). On CUDA, where one model at a time fits,
each system is built, timed and freed in turn, and its peak memory is shown.

    python benchmarks/bench_single_device.py                        # CPU: cpu-small, 2-5 minutes
    python benchmarks/bench_single_device.py --vocab-size 50257     # CPU, GPT-2's vocabulary
    python benchmarks/bench_single_device.py --shape gpt-350m,gpt-1.3b        # CUDA (the default there)
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import gc
import json
import logging
import math
import os
import statistics
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from megapipe import fusions  # noqa: E402
from megapipe.config import ModelConfig  # noqa: E402
from megapipe.distributed import default_device, peak_memory_gib, synchronize  # noqa: E402
from megapipe.flops import device_peak_tflops, flops_per_iteration, parameter_count  # noqa: E402
from megapipe.models import build_model_chunks  # noqa: E402
from megapipe.models.hf_mapping import gpt2_from_hf  # noqa: E402
from megapipe.models.state_dict import local_state_dict  # noqa: E402
from megapipe.optim import GradBuffers, OptimizerConfig, build_optimizer, finalize_model_grads  # noqa: E402
from megapipe.parallel_state import ParallelState  # noqa: E402

LR, WEIGHT_DECAY, CLIP_GRAD, DROPOUT = 1e-4, 0.01, 1.0, 0.1
GPT2_VOCAB = 50257


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    heads: int
    seq_length: int
    micro_batch: int
    vocab_size: int = GPT2_VOCAB


# On CPU GPT-2's 50257-word vocabulary would make the logit layer of a 256-wide model ~80% of the
# FLOPs and most of the time (memory-bound softmax over [b, s, V] in fp32); the CPU shapes keep
# it near its share in GPT-2 small (~30%) so the transformer layers are measured too.
SHAPES = {
    "cpu-small": Shape(4, 256, 4, 256, 8, vocab_size=8192),
    "cpu-medium": Shape(6, 512, 8, 512, 4, vocab_size=16384),
    "gpt-350m": Shape(24, 1024, 16, 2048, 8),
    "gpt-1.3b": Shape(24, 2048, 16, 2048, 4),
}


def model_config(shape: Shape, dtype: torch.dtype, dropout: float, **overrides) -> ModelConfig:
    """megapipe's GPT of ``shape``: GPT-2's layout (tanh GeLU, tied embeddings, vocabulary padded to 128)."""
    return ModelConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                       num_attention_heads=shape.heads, vocab_size=shape.vocab_size, seq_length=shape.seq_length,
                       hidden_dropout=dropout, attention_dropout=dropout, params_dtype=dtype, **overrides)


def hf_model(shape: Shape, dropout: float, device: torch.device):
    """Hugging Face ``GPT2LMHeadModel`` of ``shape`` (fp32, SDPA attention), initialised on ``device``."""
    import transformers

    transformers.logging.set_verbosity_error()
    last = min(shape.vocab_size, GPT2_VOCAB) - 1  # GPT-2's <|endoftext|>, or the last id of a smaller vocabulary
    config = transformers.GPT2Config(n_layer=shape.num_layers, n_embd=shape.hidden_size, n_head=shape.heads,
                                     vocab_size=shape.vocab_size, n_positions=shape.seq_length,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=last, eos_token_id=last)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return transformers.GPT2LMHeadModel(config)


def make_batch(shape: Shape, device: torch.device, seed: int) -> dict:
    """Random tokens; megapipe's labels are the next tokens with the last position masked, which
    is exactly what Hugging Face computes from ``labels=tokens`` (it shifts internally)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_length), generator=generator)
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    loss_mask[:, -1] = 0.0
    batch = {"tokens": tokens, "labels": tokens.roll(-1, dims=1), "loss_mask": loss_mask}
    return {key: value.to(device) for key, value in batch.items()}


# ---- the systems ---------------------------------------------------------------------------------

class System(abc.ABC):
    """A model with its optimizer; ``build()`` may raise (the row then says why), ``step(batch)`` trains once."""

    name = ""
    precision = ""

    @abc.abstractmethod
    def build(self) -> None:
        """Create the model and optimizer."""

    @abc.abstractmethod
    def step(self, batch: dict) -> torch.Tensor:
        """One training step; returns the loss."""

    def free(self) -> None:
        """Drop the model and optimizer (sequential mode on CUDA)."""
        self.__dict__.update({key: None for key in ("model", "optimizer", "grads", "_step", "_teardown")
                              if key in self.__dict__})


class Megapipe(System):
    precision = "bf16 weights, fp32 masters + grads"

    def __init__(self, name: str, shape: Shape, device: torch.device, dropout: float, **overrides):
        self.name, self.shape, self.device, self.dropout, self.overrides = name, shape, device, dropout, overrides

    def config(self) -> ModelConfig:
        return model_config(self.shape, torch.bfloat16, self.dropout, **self.overrides)

    def build(self) -> None:
        ps = ParallelState.single()
        self.ps = ps
        self.model = build_model_chunks("gpt", self.config(), ps, device=self.device)[0].train()
        self.grads = GradBuffers([self.model], ps)
        self.optimizer = build_optimizer([self.model], OptimizerConfig(
            lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, bf16=True), ps, self.grads)

    def step(self, batch: dict) -> torch.Tensor:
        loss = self.model(None, batch)
        self.optimizer.scale_loss(loss).backward()
        finalize_model_grads([self.model], self.ps, self.grads)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()


class HuggingFace(System):
    """GPT2LMHeadModel trained as ``transformers.Trainer`` would, written out as a plain loop."""

    def __init__(self, shape: Shape, device: torch.device, dropout: float, precision: str):
        self.shape, self.device, self.dropout, self.mode = shape, device, dropout, precision
        self.name = "Hugging Face GPT2LMHeadModel" + (" (bf16 weights)" if precision == "bf16" else "")
        self.precision = "fp32 weights, bf16 autocast" if precision == "autocast" else "bf16 weights and AdamW"

    def build(self) -> None:
        self.model = hf_model(self.shape, self.dropout, self.device).train()
        if self.mode == "bf16":
            self.model.to(torch.bfloat16)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]  # Trainer: no decay for bias, LayerNorm
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=LR, fused=True)

    def step(self, batch: dict) -> torch.Tensor:
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.mode == "autocast"
                    else contextlib.nullcontext())
        with autocast:
            loss = self.model(input_ids=batch["tokens"], labels=batch["tokens"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_GRAD)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class MegatronCore(System):
    name = "megatron-core GPTModel"
    precision = "bf16 weights, fp32 masters + grads"

    def __init__(self, shape: Shape, device: torch.device, dropout: float):
        self.shape, self.device, self.dropout = shape, device, dropout
        self.detail = ""

    def build(self) -> None:
        try:
            from benchmarks.mcore_gpt import build_mcore_gpt, mcore_version
        except ImportError:  # run as a script: benchmarks/ itself is on the path
            from mcore_gpt import build_mcore_gpt, mcore_version

        version = mcore_version()
        if version is None:
            raise ImportError("megatron-core is not installed (pip install megatron-core)")
        self.name = f"megatron-core {version} GPTModel"
        padded = model_config(self.shape, torch.bfloat16, self.dropout).padded_vocab_size(1)
        self._step, self._teardown, self.detail = build_mcore_gpt(
            self.shape.num_layers, self.shape.hidden_size, self.shape.heads, self.shape.seq_length, padded,
            self.dropout, LR, WEIGHT_DECAY, CLIP_GRAD, self.device)

    def step(self, batch: dict) -> torch.Tensor:
        return self._step(batch)

    def free(self) -> None:
        if getattr(self, "_teardown", None) is not None:
            self._teardown()
        super().free()


def build_systems(shape: Shape, device: torch.device, hf_precision: str, dropout: float) -> list[System]:
    systems: list[System] = [
        Megapipe("megapipe", shape, device, dropout),
        Megapipe("megapipe, fusions off", shape, device, dropout, bias_gelu_fusion=False,
                 bias_dropout_fusion=False, masked_softmax_fusion=False),
        Megapipe("megapipe, selective recompute", shape, device, dropout, recompute_granularity="selective"),
        Megapipe("megapipe, full recompute", shape, device, dropout, recompute_granularity="full",
                 recompute_method="uniform", recompute_num_layers=1),
    ]
    for precision in (("autocast", "bf16") if hf_precision == "both" else (hf_precision,)):
        systems.append(HuggingFace(shape, device, dropout, precision))
    systems.append(MegatronCore(shape, device, dropout))
    return systems


# ---- checks and measurements ----------------------------------------------------------------------

def check_same_maths(shape: Shape, device: torch.device) -> str:
    """megapipe and Hugging Face from the same weights, fp32, dropout off: loss and gradient norm of one step."""
    torch.manual_seed(0)
    hf = hf_model(shape, 0.0, device)
    config = model_config(shape, torch.float32, 0.0)
    ps = ParallelState.single()
    ours = build_model_chunks("gpt", config, ps, device=device)[0]
    ours.load_state_dict(local_state_dict(gpt2_from_hf(hf.state_dict(), config), ours, ps, config))
    batch = make_batch(replace(shape, micro_batch=min(shape.micro_batch, 2)), device, seed=123)
    hf_loss = hf(input_ids=batch["tokens"], labels=batch["tokens"]).loss
    hf_loss.backward()
    our_loss = ours(None, batch)
    our_loss.backward()

    def grad_norm(model):
        return torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()])).item()

    hf_norm, our_norm = grad_norm(hf), grad_norm(ours)
    loss_diff = abs(hf_loss.item() - our_loss.item()) / abs(hf_loss.item())
    norm_diff = abs(hf_norm - our_norm) / hf_norm
    ok = loss_diff < 1e-5 and norm_diff < 1e-4
    summary = (f"same maths check (fp32, dropout off, same weights): loss megapipe {our_loss.item():.6f} vs "
               f"Hugging Face {hf_loss.item():.6f} (rel. diff {loss_diff:.1e}); gradient norm {our_norm:.6f} vs "
               f"{hf_norm:.6f} (rel. diff {norm_diff:.1e}): {'OK' if ok else 'MISMATCH'}")
    del hf, ours
    gc.collect()
    if not ok:
        raise SystemExit(summary)
    return summary


def measure_cpu_peak_tflops(seconds: float = 1.0, n: int = 2048) -> float:
    """Best bf16 TFLOP/s of an n x n x n matmul with the current threads over ``seconds``."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    out = torch.empty(n, n, dtype=torch.bfloat16)
    torch.mm(a, b, out=out)
    best = math.inf
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = clock()
        torch.mm(a, b, out=out)
        best = min(best, clock() - start)
    return 2 * n ** 3 / best / 1e12


@dataclass
class Result:
    system: System
    times: list[float]  # seconds per step, one median per round
    peak_gib: Optional[float] = None
    error: Optional[str] = None
    final_loss: Optional[float] = None

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def one_line(error: BaseException) -> str:
    """``Type: message`` on one line, with the innermost megatron-core function it came from."""
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    text = text if len(text) <= 90 else text[:87] + "..."
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "megatron" in f.filename.replace("\\", "/")]
    if frames:
        text += f" (in {frames[0].name}, {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    return text


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


def timed_steps(system: System, batches: list[dict], steps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """Median seconds of ``steps`` steps (each synchronised) and the last loss."""
    times = []
    loss = None
    for i in range(steps):
        synchronize(device)
        start = clock()
        loss = system.step(batches[i % len(batches)])
        synchronize(device)
        times.append(clock() - start)
    return statistics.median(times), loss


def build_and_warm(system: System, batches: list[dict], warmup: int, device: torch.device) -> Optional[str]:
    """Build ``system`` and run its warm-up steps; the one-line reason when it cannot run."""
    try:
        system.build()
        timed_steps(system, batches, warmup, device)
        return None
    except Exception as error:  # noqa: BLE001 - any failure of a system becomes its row's reason
        system.free()
        gc.collect()
        return one_line(error)


def run_interleaved(systems, batches, args, device, peak_probe: Optional[Callable[[], float]]):
    """Build every system, then time them round-robin ``args.rounds`` times (the CPU way)."""
    results = []
    for system in systems:
        started = time.perf_counter()
        error = build_and_warm(system, batches, args.warmup, device)
        results.append(Result(system, [], error=error))
        print(f"  built {system.name}: {'ok' if error is None else error} ({time.perf_counter() - started:.0f} s)",
              flush=True)
    peaks = []
    for round_ in range(args.rounds):
        started = time.perf_counter()
        for result in results:
            if result.error is None:
                seconds, loss = timed_steps(result.system, batches, args.steps, device)
                result.times.append(seconds)
                result.final_loss = loss.item()
        if peak_probe is not None:
            peaks.append(peak_probe())
        print(f"  round {round_ + 1}/{args.rounds}: "
              + ", ".join(f"{r.times[-1] * 1e3:.0f}" for r in results if r.error is None)
              + f" ms/step ({time.perf_counter() - started:.0f} s)", flush=True)
    return results, max(peaks) if peaks else None


def run_sequential(systems, batches, args, device):
    """Build, time and free one system at a time (the CUDA way: several large models do not fit together)."""
    results = []
    for system in systems:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        result = Result(system, [], error=build_and_warm(system, batches, args.warmup, device))
        try:
            for _ in range(args.rounds if result.error is None else 0):
                seconds, loss = timed_steps(system, batches, args.steps, device)
                result.times.append(seconds)
                result.final_loss = loss.item()
        except Exception as error:  # noqa: BLE001 - e.g. out of memory in a timed step
            result.error = one_line(error)
        if result.error is None:
            result.peak_gib = peak_memory_gib(device) if device.type == "cuda" else None
            print(f"  {system.name}: {result.seconds * 1e3:.1f} ms/step", flush=True)
        else:
            print(f"  {system.name}: not run: {result.error}", flush=True)
        system.free()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(result)
    return results


def print_table(results: list[Result], shape: Shape, flops: float, peak_tflops: float,
                device: torch.device) -> list[dict]:
    """Print the shape's table; return its rows as plain values (for ``--json``)."""
    tokens = shape.micro_batch * shape.seq_length
    rows = []
    baseline = next((r for r in results if isinstance(r.system, HuggingFace) and r.error is None), None)
    show_memory = any(r.peak_gib is not None for r in results)
    header = (f"{'system':44s} {'precision':36s} {'ms/step':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} "
              f"{'vs HF':>6s}" + (f" {'peak GiB':>8s}" if show_memory else ""))
    print(header)
    print("-" * len(header))
    for r in results:
        if r.error is not None:
            print(f"{r.system.name:44s} not run: {r.error}")
            rows.append({"system": r.system.name, "error": r.error})
            continue
        achieved = flops / r.seconds / 1e12
        ratio = f"{baseline.seconds / r.seconds:6.2f}" if baseline is not None else f"{'-':>6s}"
        rows.append({"system": r.system.name, "precision": r.system.precision, "ms_per_step": r.seconds * 1e3,
                     "tokens_per_s": tokens / r.seconds, "tflops": achieved, "mfu": achieved / peak_tflops,
                     "vs_hf": baseline.seconds / r.seconds if baseline is not None else None,
                     "peak_gib": r.peak_gib})
        row = (f"{r.system.name:44s} {r.system.precision:36s} {r.seconds * 1e3:9.1f} {tokens / r.seconds:10.0f} "
               f"{achieved:8.3f} {achieved / peak_tflops:6.1%} {ratio}")
        if show_memory:
            row += f" {r.peak_gib:8.1f}" if r.peak_gib is not None else f" {'-':>8s}"
        spread = (max(r.times) - min(r.times)) / r.seconds if len(r.times) > 1 else 0.0
        print(row + (f"   (rounds spread {spread:.0%})" if spread > 0.15 else ""))
    for r in results:
        if isinstance(r.system, MegatronCore) and r.error is None and r.system.detail:
            print(f"megatron-core: {r.system.detail}")
    return rows


# ---- main -----------------------------------------------------------------------------------------

def parse_args(device: torch.device):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default=None,
                        help=f"comma-separated shapes from {', '.join(SHAPES)} "
                             "(default: cpu-small on CPU, gpt-350m,gpt-1.3b on CUDA)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="sequences per step (default: per shape, " +
                             ", ".join(f"{k} {v.micro_batch}" for k, v in SHAPES.items()) + ")")
    parser.add_argument("--seq-length", type=int, default=None, help="override the shape's sequence length")
    parser.add_argument("--vocab-size", type=int, default=None, help=f"override the vocabulary (default {GPT2_VOCAB})")
    parser.add_argument("--hf-precision", choices=("autocast", "bf16", "both"), default="autocast",
                        help="Hugging Face: fp32 weights under bf16 autocast (Trainer's bf16=True), bf16 weights, "
                             "or both rows")
    parser.add_argument("--fusion-backend", default="auto", help="megapipe's fusion backend (auto, apex, triton, "
                                                                 "compile, eager)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per system (default: 2 CPU, 5 CUDA)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default: 2 CPU, 10 CUDA)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds; the median counts (default: 4 CPU, 3 CUDA)")
    parser.add_argument("--dropout", type=float, default=DROPOUT, help="hidden and attention dropout")
    parser.add_argument("--skip-check", action="store_true", help="skip the fp32 same-loss check")
    parser.add_argument("--sequential", action="store_true",
                        help="time one system after another instead of round-robin (the default on CUDA)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default 1 on CPU: a shared machine oversubscribed by several threads "
                             "per process stalls them at every barrier)")
    parser.add_argument("--json", default=None, help="also write every table's rows to this JSON file")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default=None,
                        help="wall: elapsed time; cpu: CPU time of the one compute thread, so load from other "
                             "processes does not count (default: cpu with one CPU thread, else wall)")
    args = parser.parse_args()
    cuda = device.type == "cuda"
    if args.threads is None and not cuda:
        args.threads = 1
    if args.clock is None:
        args.clock = "cpu" if not cuda and args.threads == 1 else "wall"
    if args.clock == "cpu" and (cuda or args.threads != 1):
        parser.error("--clock cpu needs --threads 1 on a CPU device: it counts one thread's CPU time.")
    args.shape = args.shape or ("gpt-350m,gpt-1.3b" if cuda else "cpu-small")
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    args.steps = args.steps if args.steps is not None else (10 if cuda else 2)
    args.rounds = args.rounds if args.rounds is not None else (3 if cuda else 4)
    args.sequential = args.sequential or cuda
    for name in args.shape.split(","):
        if name not in SHAPES:
            parser.error(f"--shape {name} is unknown; use one of {', '.join(SHAPES)}.")
    return args


def main() -> None:
    device = default_device()
    args = parse_args(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*|.*Apex.*|.*apex.*")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    backend = fusions.select_backend(args.fusion_backend, device)

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = device_peak_tflops(name)
        if peak is None:
            raise SystemExit(f"no known bf16 peak for {name}; add it to megapipe.flops.KNOWN_PEAK_TFLOPS.")
        peak_note = f"peak {peak:.0f} TFLOP/s (dense bf16 of {name})"
        peak_probe = None
    else:
        name = "CPU"
        peak_probe = measure_cpu_peak_tflops
        peak = peak_probe()
        peak_note = (f"peak measured: best bf16 2048^3 matmul on {torch.get_num_threads()} thread(s)"
                     + ("" if args.sequential else ", re-measured after every round, the best kept")
                     + f"; {args.clock} clock")
    print(f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"megapipe fusion backend {backend.name} ({backend.reason})")
    report = {"device": name, "torch": torch.__version__, "fusion_backend": backend.name, "shapes": {}}

    for shape_name in args.shape.split(","):
        shape = SHAPES[shape_name]
        shape = replace(shape, **{k: v for k, v in (("micro_batch", args.micro_batch_size),
                                                      ("seq_length", args.seq_length),
                                                      ("vocab_size", args.vocab_size)) if v is not None})
        config = model_config(shape, torch.bfloat16, args.dropout)
        flops = flops_per_iteration(config, shape.micro_batch, recompute=False)
        head = 6 * shape.micro_batch * shape.seq_length * shape.hidden_size * config.padded_vocab_size(1)
        print(f"\n== {shape_name}: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.heads} heads, "
              f"sequence {shape.seq_length}, micro-batch {shape.micro_batch}, vocabulary {shape.vocab_size} "
              f"(padded {config.padded_vocab_size(1)}), {parameter_count(config) / 1e6:.0f}M parameters, "
              f"dropout {args.dropout}")
        print(f"model FLOPs per step {flops / 1e9:.1f} GFLOP (logit layer {head / flops:.0%}); "
              f"{args.warmup} warm-up steps, then {args.rounds} rounds x {args.steps} timed steps")
        if not args.skip_check:
            print(check_same_maths(shape, device), flush=True)
        batches = [make_batch(shape, device, seed) for seed in range(2)]
        systems = build_systems(shape, device, args.hf_precision, args.dropout)
        if args.sequential:
            results, measured = run_sequential(systems, batches, args, device), None
        else:
            results, measured = run_interleaved(systems, batches, args, device, peak_probe)
        peak_tflops = max(peak, measured or 0.0)
        print(f"\nMFU = model FLOPs per second / {peak_tflops:.3f} TFLOP/s: {peak_note}")
        report["shapes"][shape_name] = print_table(results, shape, flops, peak_tflops, device)
        for r in results:
            if r.error is None and not math.isfinite(r.final_loss):
                print(f"warning: {r.system.name} ended with loss {r.final_loss}")
        for system in systems:
            system.free()
    print("\nvs HF = Hugging Face step time / this system's step time (> 1: faster than Hugging Face). "
          "Model FLOPs exclude recomputation.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
