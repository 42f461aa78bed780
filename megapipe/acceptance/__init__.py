"""GPU acceptance in one short run: every number that matters from one window on a GPU machine.

``bash tools/gpu_check.sh`` (``python -m megapipe.acceptance``) runs the steps below in order, each
in a process of its own with its own deadline, so a step that fails, hangs or crashes the process
costs only its own budget and the next step still runs. It writes a one-page ``summary.md``, the
raw output of every step (``steps.log``) and the checks as data (``results.json``) to one folder.
``--dry-run`` runs every step that can run without a GPU on the CPU, with small shapes, so a GPU
window is never spent finding a mistake a CPU would have found.

Each step is a module with ``run(record, context)``; ``record`` keeps each check as
it is made (a step cut short by its deadline still reports what it did). The steps check CUDA
itself (its kernels, versions and attention backends), so unlike the library they name it directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # the module whose run(record, context) is the step
    budget_seconds: int  # on a GPU; --dry-run scales it for the CPU
    what: str


_STEPS = (  # name, budget in seconds on a GPU, what it checks; the module is megapipe.acceptance.<name>
    ("stack", 12, "torch, CUDA, cuDNN, NCCL, Triton, C compiler, optional packages, device peak, fusion backend "
                  "chosen by running it"),
    ("kernels", 75, "every fused kernel family against eager in fp32 and bf16, forward and backward: bias-GeLU, "
                    "bias-dropout-add (p = 0; p = 0.1 kept fraction and backward mask), softmax, LayerNorm, RMSNorm, "
                    "cross-entropy, RoPE, SwiGLU with and without bias"),
    ("attention", 18, "scaled-dot-product attention forced to the flash and cuDNN kernels on megapipe's own q/k/v "
                      "(MHA and GQA, causal, dropout), and the kernel the model takes by default"),
    ("training", 45, "pretrain_gpt.py on one GPU with each fusion backend (losses fall, Triton's first loss equals "
                     "eager's) and a Llama-shaped run (RMSNorm, SwiGLU, RoPE, GQA, untied, full recomputation with "
                     "dropout)"),
    ("syncs", 17, "host synchronisations of whole training iterations outside log intervals (0)"),
    ("checkpoint", 37, "--async-save, then --load: the resumed losses equal the uninterrupted run's"),
    ("generation", 40, "tools/generate.py, greedy and sampled with a repetition penalty, repeatable for a seed"),
    ("zero", 27, "ZeRO-1 and ZeRO-3 at d = 2 on this machine's torch with the GPU hidden (gloo): losses equal to "
                 "unsharded data parallelism"),
    ("benchmark", 209, "benchmarks/bench_single_device.py: GPT-350M and GPT-1.3B, sequence 2048, bf16, 8 "
                       "micro-batches per step, against Hugging Face, FP8 against bf16 (speed and loss), and at "
                       "GPT-1.3B each of megapipe's changes turned off"),
)
STEPS = tuple(Step(name, f"megapipe.acceptance.{name}", budget, what) for name, budget, what in _STEPS)

_MULTI_STEPS = (  # ``--multi``: a node of several GPUs (written for 8), in one ten-minute window too
    ("multi_parity", 300, "every synchronous schedule at p = 2 and 4, t = 2 and n with sequence parallelism, c = 2 "
                          "(ring and all-to-all), e = 2 with grouped experts, ZeRO-1 and ZeRO-3 at d = n: fp32 "
                          "losses within 1e-5 of one GPU's"),
    ("multi_speed", 180, "ZeRO-1 vs unsharded at d = n, tensor-parallel overlap at t = n, expert all-to-all "
                         "overlap at e = n: step times with their aims"),
)
MULTI_STEPS = tuple(Step(name, f"megapipe.acceptance.{name}", budget, what) for name, budget, what in _MULTI_STEPS)
