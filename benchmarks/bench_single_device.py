"""One GPT training step on one device: megapipe against Hugging Face and megatron-core.

Times a whole training step as real training runs it (``--micro-batches`` forward and backward
passes accumulating gradients, then the optimizer step with gradient clipping) of the same GPT
shape, batch and sequence under each system and prints tokens/s and model FLOPs utilisation
(MFU) of the forward and backward passes and of the whole step, with the ratio to Hugging Face
``GPT2LMHeadModel`` trained the plain way:

- megapipe: bf16 weights with fp32 master weights and fp32 main gradients, fused kernels on;
  with FP8 products (``--fp8-format e4m3`` and ``hybrid``, tensorwise scales: tokens/s and the loss
  after the same steps from the same weights, against the bf16 row; left out, with the reason, on a
  device without FP8 matrix units); then each change turned off in turn (on the shapes of
  ``--ablation-shapes``): gradient accumulation into fp32 main gradients
  (``--no-gradient-accumulation-fusion``), the fused cross-entropy (``--no-cross-entropy-loss-fusion``),
  the elementwise fusions (``--no-bias-gelu-fusion --no-bias-dropout-fusion``; attention stays with
  scaled-dot-product attention, whose explicit alternative would hold the [b, heads, s, s] scores
  of every layer); with selective and with full recomputation; on CUDA each transformer layer
  compiled (``--fusion-backend compile``).
- Hugging Face: fp32 weights under bf16 autocast, fused ``torch.optim.AdamW`` with weight
  decay off for biases and norms, ``clip_grad_norm_`` (what ``Trainer(bf16=True)`` does), SDPA
  attention; ``--hf-precision bf16`` trains bf16 weights instead, ``both`` times both.
- megatron-core: ``GPTModel`` with its fastest layer spec available (Transformer Engine's where
  it is installed, else the local one), Float16Module, DDP and its optimizer
  (``benchmarks/mcore_gpt.py``); where it cannot run, the row gives the reason.

FLOPs per step are model FLOPs, the same formula for every system (``megapipe.models.flops``, seed 002
eq. 4.2 without the recomputation term), so recomputation shows up as lower MFU. On CUDA the
peak is the device's dense bf16 peak (by its exact name, or ``--device-peak-tflops``; without
either MFU is left out); on CPU it is measured: the best bf16 throughput of a large square matmul
with the threads used. On CUDA the phases are timed with device events. Before timing, the script checks in fp32 with dropout off
that megapipe and Hugging Face give the same loss (and gradient norm) from the same weights.

On CPU the systems are interleaved round by round in one process (medians over rounds), so
load from other processes hits them alike, on one thread, timed by that thread's CPU time
(``--clock cpu``: on a shared machine elapsed time mostly measures the other processes; pass
``--threads N`` for several threads and elapsed time). On CUDA, where one model at a time fits,
each system is built, timed and freed in turn, and its peak memory is shown.

    python benchmarks/bench_single_device.py                        # CPU: cpu-small, 2-5 minutes
    python benchmarks/bench_single_device.py --vocab-size 50257     # CPU, GPT-2's vocabulary
    python benchmarks/bench_single_device.py --shape gpt-350m,gpt-1.3b        # CUDA (the default there)
    python benchmarks/bench_single_device.py --shape gpt-1.3b --only megapipe,FP8 --skip-check \
        --warmup 0 --rounds 1 --steps 200     # FP8 against bf16: the loss after 200 steps
"""

from __future__ import annotations

import abc
import contextlib
import gc
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

from harness import cli
from harness.report import print_ruled, write_json
from megapipe import fusions  # noqa: E402
from megapipe.fusions import fp8_mode  # noqa: E402
from megapipe.fusions.backend import activate as activate_backend  # noqa: E402
from megapipe.fusions.fp8_mode import select_fp8  # noqa: E402
from megapipe.config import ModelConfig  # noqa: E402
from megapipe.errors import ConfigError, first_line  # noqa: E402
from megapipe.parallel.launch import DeviceClock, default_device, device_name, peak_memory_gib, release_cached_memory, reset_peak_memory, synchronize
from megapipe.models.families import family_of  # noqa: E402
from megapipe.models.flops import (check_device_peak, device_peak_tflops,  # noqa: E402
                                   head_flops_per_iteration, parameter_count)
from megapipe.models import build_model_chunks  # noqa: E402
from megapipe.models.hf_mapping import gpt2_from_hf  # noqa: E402
from megapipe.models.state_dict import local_state_dict  # noqa: E402
from megapipe.optim import GradBuffers, OptimizerConfig, build_optimizer, finalize_model_grads  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402

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
    """A model with its optimizer; ``build()`` may raise (the row then says why). A training step is
    ``forward_backward`` on each micro-batch (gradients accumulate), then ``optimizer_step``."""

    name = ""
    precision = ""

    @abc.abstractmethod
    def build(self) -> None:
        """Create the model and optimizer."""

    @abc.abstractmethod
    def forward_backward(self, batch: dict, micro_batches: int) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss scaled by 1 / ``micro_batches``; returns the loss."""

    @abc.abstractmethod
    def optimizer_step(self) -> None:
        """Clip, step and zero the accumulated gradients."""

    def free(self) -> None:
        """Drop the model and optimizer (sequential mode on CUDA)."""
        self.__dict__.update({key: None for key in ("model", "optimizer", "grads", "_forward_backward",
                                                    "_optimizer_step", "_teardown") if key in self.__dict__})


class Megapipe(System):
    precision = "bf16 weights, fp32 masters + grads"

    def __init__(self, name: str, shape: Shape, device: torch.device, dropout: float,
                 fusion_backend: Optional[str] = None, fp8: Optional[tuple[str, str]] = None, **overrides):
        """``fusion_backend``: this row's own (else the run's); ``fp8``: (format, recipe) of FP8 products;
        ``overrides``: ModelConfig fields that turn one of megapipe's changes off."""
        self.name, self.shape, self.device, self.dropout, self.overrides = name, shape, device, dropout, overrides
        self.fusion_backend, self.fp8 = fusion_backend, fp8
        if fp8 is not None:
            self.precision = f"FP8 {fp8[0]} {fp8[1]} products, bf16 rest"

    def config(self) -> ModelConfig:
        return model_config(self.shape, torch.bfloat16, self.dropout, **self.overrides)

    def build(self) -> None:
        self.backend, self.recipe = fusions.active_backend(), fp8_mode.active_fp8()
        with self.kernels():  # selecting activates: the choices stay this row's
            if self.fusion_backend is not None:
                self.backend = fusions.select_backend(self.fusion_backend, self.device)
            if self.fp8 is not None:
                self.recipe = select_fp8(*self.fp8, self.device)  # refused where the device cannot
        ps = ParallelState.single()
        self.ps = ps
        config = self.config()
        with self.kernels():
            self.model = build_model_chunks("gpt", config, ps, device=self.device)[0].train()
        self.grads = GradBuffers([self.model], ps, gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        self.optimizer = build_optimizer([self.model], OptimizerConfig(
            lr=LR, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD, bf16=True), ps, self.grads)

    @contextlib.contextmanager
    def kernels(self):
        """This row's fusion backend and FP8 recipe while it builds and runs (the other rows keep theirs)."""
        previous_backend, previous_recipe = activate_backend(self.backend), fp8_mode.activate(self.recipe)
        try:
            yield
        finally:
            activate_backend(previous_backend)
            fp8_mode.activate(previous_recipe)

    def forward_backward(self, batch: dict, micro_batches: int) -> torch.Tensor:
        with self.kernels():
            loss = self.model(None, batch)
            self.optimizer.scale_loss(loss / micro_batches).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        finalize_model_grads([self.model], self.ps, self.grads)
        self.optimizer.step()
        self.optimizer.zero_grad()


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

    def forward_backward(self, batch: dict, micro_batches: int) -> torch.Tensor:
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.mode == "autocast"
                    else contextlib.nullcontext())
        with autocast:
            loss = self.model(input_ids=batch["tokens"], labels=batch["tokens"]).loss
        (loss / micro_batches).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_GRAD)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


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
        self._forward_backward, self._optimizer_step, self._teardown, self.detail = build_mcore_gpt(
            self.shape.num_layers, self.shape.hidden_size, self.shape.heads, self.shape.seq_length, padded,
            self.dropout, LR, WEIGHT_DECAY, CLIP_GRAD, self.device)

    def forward_backward(self, batch: dict, micro_batches: int) -> torch.Tensor:
        return self._forward_backward(batch, micro_batches)

    def optimizer_step(self) -> None:
        self._optimizer_step()

    def free(self) -> None:
        if getattr(self, "_teardown", None) is not None:
            self._teardown()
        super().free()


FP8_ROWS = (("e4m3", "tensorwise"), ("hybrid", "tensorwise"))


def build_systems(shape: Shape, device: torch.device, hf_precision: str, dropout: float,
                  ablations: bool = True) -> list[System]:
    """megapipe, Hugging Face, FP8, then each of megapipe's changes turned off in turn (``ablations``),
    megatron-core: the rows users compare come first, so a run stopped early (a time limit) still has
    them. Where the device has no FP8 matrix units the FP8 rows say so; the compiled-layers row runs on
    CUDA (on a CPU compiling takes longer than the whole benchmark: ``--fusion-backend compile`` times
    it there)."""
    systems: list[System] = [Megapipe("megapipe", shape, device, dropout)]
    for precision in (("autocast", "bf16") if hf_precision == "both" else (hf_precision,)):
        systems.append(HuggingFace(shape, device, dropout, precision))
    systems += [Megapipe(f"megapipe, FP8 {fmt} {recipe}", shape, device, dropout, fp8=(fmt, recipe))
                for fmt, recipe in FP8_ROWS]
    if not ablations:
        return systems
    systems += [
        Megapipe("megapipe, gradient accumulation fusion off", shape, device, dropout,
                 gradient_accumulation_fusion=False),
        Megapipe("megapipe, cross-entropy fusion off", shape, device, dropout, cross_entropy_loss_fusion=False),
        Megapipe("megapipe, elementwise fusions off", shape, device, dropout, bias_gelu_fusion=False,
                 bias_dropout_fusion=False),
        Megapipe("megapipe, selective recompute", shape, device, dropout, recompute_granularity="selective"),
        Megapipe("megapipe, full recompute", shape, device, dropout, recompute_granularity="full",
                 recompute_method="uniform", recompute_num_layers=1),
    ]
    if device.type == "cuda":
        systems.append(Megapipe("megapipe, compiled layers", shape, device, dropout, fusion_backend="compile"))
    systems.append(MegatronCore(shape, device, dropout))
    return systems


def chosen(name: str, words: list[str]) -> bool:
    """``--only``: the row is named one of ``words`` or contains one that is not "megapipe" (which every
    megapipe row contains: alone it names the bf16 row)."""
    return name in words or any(word != "megapipe" and word in name for word in words)


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


def same_maths_line(shape: Shape, device: torch.device) -> str:
    """``check_same_maths``'s line, or why the check is left out (no ``transformers`` on this machine:
    megapipe's rows are still measured)."""
    try:
        import transformers  # noqa: F401 - only asked whether it is there
    except ImportError:
        return "same maths check: left out: transformers is not installed (pip install transformers)"
    return check_same_maths(shape, device)


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
    times: list[float]  # seconds per whole step, one median per round
    pass_times: list[float]  # seconds of the step's forward and backward passes, one median per round
    peak_gib: Optional[float] = None
    error: Optional[str] = None  # it failed: why
    left_out: Optional[str] = None  # this device cannot run it (megapipe refused its flags): why
    final_loss: Optional[float] = None

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def pass_seconds(self) -> float:
        return statistics.median(self.pass_times)


def one_line(error: BaseException) -> str:
    """``Type: message`` on one line, with the innermost megatron-core function it came from."""
    text = first_line(error, 90)
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "megatron" in f.filename.replace("\\", "/")]
    if frames:
        text += f" (in {frames[0].name}, {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    return text


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


class PhaseTimer:
    """Stamps between a step's phases: device events on an accelerator (read once the step is done),
    else ``clock``."""

    def __init__(self, device: torch.device):
        self.device_clock = DeviceClock(device) if device.type != "cpu" else None

    def mark(self):
        return self.device_clock.mark() if self.device_clock is not None else clock()

    def seconds(self, marks: list) -> list[float]:
        return self.device_clock.seconds(marks) if self.device_clock is not None else marks


def timed_steps(system: System, batches: list[dict], steps: int, micro_batches: int,
                device: torch.device) -> tuple[float, float, torch.Tensor]:
    """Medians over ``steps`` training steps of (whole step, its forward and backward passes) in
    seconds, and the last loss."""
    whole, passes, loss = [], [], None
    timer = PhaseTimer(device)
    for i in range(steps):
        synchronize(device)
        marks = [timer.mark()]
        for j in range(micro_batches):
            loss = system.forward_backward(batches[(i * micro_batches + j) % len(batches)], micro_batches)
        marks.append(timer.mark())
        system.optimizer_step()
        marks.append(timer.mark())
        start, passes_done, end = timer.seconds(marks)
        whole.append(end - start)
        passes.append(passes_done - start)
    return statistics.median(whole), statistics.median(passes), loss


def build_and_warm(system: System, batches: list[dict], args, device: torch.device) -> Result:
    """Build ``system`` (its build time printed) and run its warm-up steps: its result, with the one-line
    reason when it cannot run. Each system starts from the same random state, so dropout draws alike."""
    try:
        started = time.perf_counter()
        torch.manual_seed(0)
        system.build()
        synchronize(device)
        print(f"  {system.name}: built in {time.perf_counter() - started:.1f} s", flush=True)
        timed_steps(system, batches, args.warmup, args.micro_batches, device)
        return Result(system, [], [])
    except ConfigError as refusal:  # megapipe refuses this row's flags on this device (FP8 on a CPU)
        system.free()
        return Result(system, [], [], left_out=str(refusal))
    except Exception as error:  # noqa: BLE001 - any failure of a system becomes its row's reason
        system.free()
        gc.collect()
        return Result(system, [], [], error=one_line(error))


def runs(result: Result) -> bool:
    return result.error is None and result.left_out is None


def not_run_line(result: Result) -> str:
    return f"left out: {result.left_out}" if result.left_out is not None else f"not run: {result.error}"


def time_round(result: Result, batches: list[dict], args, device: torch.device) -> None:
    seconds, pass_seconds, loss = timed_steps(result.system, batches, args.steps, args.micro_batches, device)
    result.times.append(seconds)
    result.pass_times.append(pass_seconds)
    result.final_loss = loss.item()


def run_interleaved(systems, batches, args, device, peak_probe: Optional[Callable[[], float]]):
    """Build every system, then time them round-robin ``args.rounds`` times (the CPU way)."""
    results = []
    for system in systems:
        results.append(build_and_warm(system, batches, args, device))
        if not runs(results[-1]):
            print(f"  {system.name}: {not_run_line(results[-1])}", flush=True)
    peaks = []
    for round_ in range(args.rounds):
        started = time.perf_counter()
        for result in results:
            if runs(result):
                time_round(result, batches, args, device)
        if peak_probe is not None:
            peaks.append(peak_probe())
        print(f"  round {round_ + 1}/{args.rounds}: "
              + ", ".join(f"{r.times[-1] * 1e3:.0f}" for r in results if runs(r))
              + f" ms/step ({time.perf_counter() - started:.0f} s)", flush=True)
    return results, max(peaks) if peaks else None


def run_sequential(systems, batches, args, device, after_each: Callable[[list], None]):
    """Build, time and free one system at a time (the CUDA way: several large models do not fit together);
    ``after_each(results so far)`` once each system is done."""
    results = []
    for system in systems:
        reset_peak_memory(device)
        result = build_and_warm(system, batches, args, device)
        try:
            for _ in range(args.rounds if runs(result) else 0):
                time_round(result, batches, args, device)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory in a timed step
            result.error = one_line(error)
        if runs(result):
            result.peak_gib = peak_memory_gib(device) if device.type == "cuda" else None
            print(f"  {system.name}: {result.seconds * 1e3:.1f} ms/step", flush=True)
        else:
            print(f"  {system.name}: {not_run_line(result)}", flush=True)
        system.free()
        gc.collect()
        release_cached_memory(device)
        results.append(result)
        after_each(results)
    return results


def _percent(value: Optional[float]) -> str:
    return f"{value:6.1%}" if value is not None else f"{'-':>6s}"


def table_rows(results: list[Result], shape: Shape, micro_batches: int, flops: float,
               peak_tflops: Optional[float]) -> list[dict]:
    """Every system's figures as plain values (for ``--json`` and the table)."""
    tokens = micro_batches * shape.micro_batch * shape.seq_length
    baseline = next((r for r in results if isinstance(r.system, HuggingFace) and runs(r)), None)
    bf16 = next((r for r in results if r.system.name == "megapipe" and runs(r)), None)
    rows = []
    for r in results:
        if r.left_out is not None:
            rows.append({"system": r.system.name, "left_out": r.left_out})
            continue
        if r.error is not None:
            rows.append({"system": r.system.name, "error": r.error})
            continue
        achieved = flops / r.seconds / 1e12
        rows.append({"system": r.system.name, "precision": r.system.precision, "ms_per_step": r.seconds * 1e3,
                     "passes_ms": r.pass_seconds * 1e3, "tokens_per_s": tokens / r.seconds, "tflops": achieved,
                     "mfu": achieved / peak_tflops if peak_tflops else None,
                     "mfu_passes": flops / r.pass_seconds / 1e12 / peak_tflops if peak_tflops else None,
                     "vs_hf": baseline.seconds / r.seconds if baseline is not None else None,
                     "peak_gib": r.peak_gib, "spread": (max(r.times) - min(r.times)) / r.seconds,
                     "final_loss": r.final_loss})
        if isinstance(r.system, Megapipe) and r.system.fp8 is not None and bf16 is not None:
            rows[-1]["vs_bf16"] = bf16.seconds / r.seconds  # the same steps from the same weights and batches
            rows[-1]["loss_vs_bf16"] = (r.final_loss - bf16.final_loss) / bf16.final_loss
    return rows


def print_table(rows: list[dict], results: list[Result]) -> None:
    show_memory = any(row.get("peak_gib") is not None for row in rows)
    header = (f"{'system':44s} {'precision':36s} {'ms/step':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} "
              f"{'MFU f+b':>7s} {'MFU':>6s} {'vs HF':>6s}" + (f" {'peak GiB':>8s}" if show_memory else ""))
    print_ruled(header)
    for row in rows:
        if "left_out" in row or "error" in row:
            reason = f"left out: {row['left_out']}" if "left_out" in row else f"not run: {row['error']}"
            print(f"{row['system']:44s} {reason}")
            continue
        line = (f"{row['system']:44s} {row['precision']:36s} {row['ms_per_step']:9.1f} {row['tokens_per_s']:10.0f} "
                f"{row['tflops']:8.3f} {_percent(row['mfu_passes']):>7s} {_percent(row['mfu'])} "
                + (f"{row['vs_hf']:6.2f}" if row["vs_hf"] is not None else f"{'-':>6s}"))
        if show_memory:
            line += f" {row['peak_gib']:8.1f}" if row["peak_gib"] is not None else f" {'-':>8s}"
        print(line + (f"   (rounds spread {row['spread']:.0%})" if row["spread"] > 0.15 else ""))
    for row in rows:
        if "loss_vs_bf16" in row:
            print(f"{row['system']}: {row['vs_bf16']:.2f}x bf16's tokens/s; loss after the same steps "
                  f"{row['final_loss']:.4f}, {row['loss_vs_bf16']:+.2%} from bf16's")
    for r in results:
        if isinstance(r.system, MegatronCore) and r.error is None and r.system.detail:
            print(f"megatron-core: {r.system.detail}")


# ---- main -----------------------------------------------------------------------------------------

def parse_args(device: torch.device):
    parser = cli.parser(__doc__)
    parser.add_argument("--shape", default=None,
                        help=f"comma-separated shapes from {', '.join(SHAPES)} "
                             "(default: cpu-small on CPU, gpt-350m,gpt-1.3b on CUDA)")
    parser.add_argument("--ablation-shapes", default=None,
                        help="comma-separated shapes that also get a row per megapipe change turned off "
                             "(default: every shape)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="sequences per micro-batch (default: per shape, " +
                             ", ".join(f"{k} {v.micro_batch}" for k, v in SHAPES.items()) + ")")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches accumulated per optimizer step (default: 8 CUDA, 2 CPU)")
    parser.add_argument("--seq-length", type=int, default=None, help="override the shape's sequence length")
    parser.add_argument("--vocab-size", type=int, default=None, help=f"override the vocabulary (default {GPT2_VOCAB})")
    parser.add_argument("--hf-precision", choices=("autocast", "bf16", "both"), default="autocast",
                        help="Hugging Face: fp32 weights under bf16 autocast (Trainer's bf16=True), bf16 weights, "
                             "or both rows")
    parser.add_argument("--fusion-backend", default="auto", help="megapipe's fusion backend (auto, apex, triton, "
                                                                 "compile, eager)")
    parser.add_argument("--device-peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak, for a device megapipe does not know by name")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per system (default: 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default: 2 CPU, 3 CUDA)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds; the median counts (default: 4 CPU, 3 CUDA)")
    parser.add_argument("--dropout", type=float, default=DROPOUT, help="hidden and attention dropout")
    parser.add_argument("--skip-check", action="store_true", help="skip the fp32 same-loss check")
    parser.add_argument("--sequential", action="store_true",
                        help="time one system after another instead of round-robin (the default on CUDA)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default 1 on CPU: a shared machine oversubscribed by several threads "
                             "per process stalls them at every barrier)")
    parser.add_argument("--only", default=None,
                        help="comma-separated words: time only the rows named one of them or containing one "
                             "(\"megapipe,FP8\": megapipe's bf16 row and its FP8 rows)")
    parser.add_argument("--json", default=None, help="also write every table's rows to this JSON file")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default=None,
                        help="wall: elapsed time; cpu: CPU time of the one compute thread, so load from other "
                             "processes does not count (default: cpu with one CPU thread, else wall)")
    args = parser.parse_args()
    cuda = device.type == "cuda"
    try:
        check_device_peak(args.device_peak_tflops)
    except ValueError as error:
        parser.error(str(error))
    if args.threads is None and not cuda:
        args.threads = 1
    if args.clock is None:
        args.clock = "cpu" if not cuda and args.threads == 1 else "wall"
    if args.clock == "cpu" and (cuda or args.threads != 1):
        parser.error("--clock cpu needs --threads 1 on a CPU device: it counts one thread's CPU time.")
    args.shape = args.shape or ("gpt-350m,gpt-1.3b" if cuda else "cpu-small")
    args.micro_batches = args.micro_batches or (8 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else 2
    args.steps = args.steps if args.steps is not None else (3 if cuda else 2)
    args.rounds = args.rounds if args.rounds is not None else (3 if cuda else 4)
    args.sequential = args.sequential or cuda
    args.ablation_shapes = [name for name in (args.ablation_shapes if args.ablation_shapes is not None
                                              else args.shape).split(",") if name]
    for name in args.shape.split(",") + args.ablation_shapes:
        if name not in SHAPES:
            parser.error(f"--shape {name} is unknown; use one of {', '.join(SHAPES)}.")
    return args


def device_peak(args, device: torch.device) -> tuple[Optional[float], Optional[Callable[[], float]], str]:
    """(peak TFLOP/s or None, the CPU's re-measuring probe or None, how the peak was found)."""
    if device.type == "cpu":
        peak = measure_cpu_peak_tflops()
        return peak, measure_cpu_peak_tflops, (
            f"peak measured: best bf16 2048^3 matmul on {torch.get_num_threads()} thread(s)"
            + ("" if args.sequential else ", re-measured after every round, the best kept") + f"; {args.clock} clock")
    name = device_name(device)
    if args.device_peak_tflops:
        return args.device_peak_tflops, None, f"peak {args.device_peak_tflops:g} TFLOP/s (--device-peak-tflops)"
    peak = device_peak_tflops(name)
    if peak is None:
        return None, None, (f"no dense bf16 peak is known for {name}, so MFU is left out; pass "
                            "--device-peak-tflops N (its data sheet's dense bf16 TFLOP/s)")
    return peak, None, f"peak {peak:.0f} TFLOP/s (dense bf16 of {name})"


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
    name = device_name(device)
    peak, peak_probe, peak_note = device_peak(args, device)
    print(f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"megapipe fusion backend {backend.name} ({backend.reason})")
    report = {"device": name, "torch": torch.__version__, "fusion_backend": backend.name,
              "micro_batches": args.micro_batches, "shapes": {}}

    for shape_name in args.shape.split(","):
        shape = SHAPES[shape_name]
        shape = replace(shape, **{k: v for k, v in (("micro_batch", args.micro_batch_size),
                                                      ("seq_length", args.seq_length),
                                                      ("vocab_size", args.vocab_size)) if v is not None})
        config = model_config(shape, torch.bfloat16, args.dropout)
        sequences = args.micro_batches * shape.micro_batch
        flops = family_of("gpt", config).flops(config, sequences, recompute=False)
        head = head_flops_per_iteration(config, sequences)
        print(f"\n== {shape_name}: {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.heads} heads, "
              f"sequence {shape.seq_length}, {args.micro_batches} micro-batches of {shape.micro_batch} per step, "
              f"vocabulary {shape.vocab_size} (padded {config.padded_vocab_size(1)}), "
              f"{parameter_count(config) / 1e6:.0f}M parameters, dropout {args.dropout}")
        print(f"model FLOPs per step {flops / 1e9:.1f} GFLOP (logit layer {head / flops:.0%}); "
              f"{args.warmup} warm-up steps, then {args.rounds} rounds x {args.steps} timed steps")
        if not args.skip_check:
            print(same_maths_line(shape, device), flush=True)
        batches = [make_batch(shape, device, seed) for seed in range(2)]
        systems = build_systems(shape, device, args.hf_precision, args.dropout,
                                ablations=shape_name in args.ablation_shapes)
        if args.only:
            systems = [system for system in systems if chosen(system.name, args.only.split(","))]

        def report_rows(results, measured=None):
            peak_tflops = max(peak, measured or 0.0) if peak is not None else None
            report["shapes"][shape_name] = table_rows(results, shape, args.micro_batches, flops, peak_tflops)
            write_json(args.json, report)  # so far: a run stopped by a time limit keeps the systems done

        if args.sequential:
            results, measured = run_sequential(systems, batches, args, device, report_rows), None
        else:
            results, measured = run_interleaved(systems, batches, args, device, peak_probe)
        report_rows(results, measured)
        print(f"\nMFU = model FLOPs per second / peak: {peak_note}")
        print_table(report["shapes"][shape_name], results)
        for r in results:
            if runs(r) and not math.isfinite(r.final_loss):
                print(f"warning: {r.system.name} ended with loss {r.final_loss}")
        for system in systems:
            system.free()
    print("\nMFU f+b: the forward and backward passes alone; MFU: the whole step (optimizer step included). "
          "vs HF = Hugging Face step time / this system's step time (> 1: faster than Hugging Face). "
          "Model FLOPs exclude recomputation.")


if __name__ == "__main__":
    main()
