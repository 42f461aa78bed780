"""Which kernel family runs the fused operators: apex, Triton, torch.compile or eager PyTorch.

One backend is chosen at start-up by ``select_backend`` and logged in one line with the reason.
Each fused op then asks ``active_backend().family(op, tensor)`` which kernel family to use for
that tensor: a backend only names a preference order, and a family that cannot run an op on a
tensor's device (apex has no GeLU kernel, Triton needs CUDA tensors) yields to the next one,
ending with eager PyTorch, so a choice never produces a wrong result or an error.

A family counts as available on CUDA only once one small kernel of it has compiled, launched and
given the right value (``run_problem``), so a package that imports but cannot run there (a Triton
without a C compiler, an apex built for another torch) is passed over, with the reason, at start-up
rather than failing at the first layer. torch.compile is tried the same way, on the CPU too.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass

import torch

from megapipe.errors import ConfigError, first_line

logger = logging.getLogger("megapipe.fusions")

BACKENDS = ("apex", "triton", "compile", "eager")

# The ops each kernel family implements; "eager" implements all of them.
OPS_BY_FAMILY = {
    "apex": frozenset({"layer_norm", "rms_norm"}),
    "triton": frozenset({"bias_gelu", "bias_dropout_add", "softmax", "layer_norm", "rms_norm", "cross_entropy",
                         "swiglu"}),
    "compile": frozenset({"bias_gelu", "bias_dropout_add", "softmax", "cross_entropy", "swiglu", "rope"}),
}


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run, slowly, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _probe_apex(device: torch.device) -> None:
    """apex's fused LayerNorm on a few values: its CUDA extension must load, launch and be right."""
    import torch.nn.functional as F
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    x = torch.linspace(-1.0, 1.0, 16, device=device).view(2, 8)
    weight, bias = torch.full((8,), 2.0, device=device), torch.full((8,), 0.5, device=device)
    got = fused_layer_norm_affine(x, weight, bias, weight.shape, 1e-5)
    if not torch.allclose(got, F.layer_norm(x, weight.shape, weight, bias, 1e-5), rtol=1e-4, atol=1e-5):
        raise RuntimeError("its LayerNorm gave a wrong result")


def _probe_triton(device: torch.device) -> None:
    """megapipe's Triton bias-GeLU on one element: Triton must compile it (a C compiler and Python's
    headers build the launcher), launch it on ``device`` and get it right."""
    from megapipe.fusions import triton_elementwise

    x, bias = torch.full((1, 1), 0.75, device=device), torch.full((1,), 0.25, device=device)
    got = triton_elementwise.bias_gelu_forward(x, bias, "tanh")
    if not torch.allclose(got, torch.nn.functional.gelu(x + bias, approximate="tanh"), rtol=1e-5, atol=1e-6):
        raise RuntimeError("its bias-GeLU kernel gave a wrong result")


def _probe_compile(device: torch.device) -> None:
    """A small function with its backward through torch.compile: its compiler (a C++ compiler on a CPU,
    Triton on CUDA) must build, run and be right."""
    x = torch.linspace(-1.0, 1.0, 8, device=device, requires_grad=True)
    got = torch.compile(lambda t: torch.sigmoid(t) * t, dynamic=False)(x)
    got.sum().backward()
    want = torch.sigmoid(x.detach()) * x.detach()
    if not torch.allclose(got.detach(), want, rtol=1e-5, atol=1e-6) or x.grad is None:
        raise RuntimeError("its compiled SiLU gave a wrong result")


_PROBES = {"apex": _probe_apex, "triton": _probe_triton, "compile": _probe_compile}


@functools.cache
def importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@functools.cache
def run_problem(family: str, device: torch.device) -> str | None:
    """Why ``family``'s kernels fail on ``device`` when run once (None when they ran and were right).

    Finding a package is not enough: a Triton without a C compiler or Python headers on the image,
    or an apex built for another torch or CUDA, imports and then fails at its first kernel.
    """
    try:
        _PROBES[family](device)
    except Exception as error:  # noqa: BLE001 - any failure of the probe means: do not use this family
        return f"{family} imports but fails to run ({first_line(error, 160)})"
    return None


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot generate kernels for this device, or None when it can (tried once)."""
    if device.type == "cuda":  # inductor writes Triton kernels for CUDA
        problem = _why_not("triton", device)
        if problem is not None:
            return f"torch.compile on CUDA needs a working triton ({problem})"
    if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")):
        return "torch.compile on CPU needs a C++ compiler"
    return run_problem("compile", device) if device.type in ("cpu", "cuda") else None


def _why_not(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run kernels on ``device``, or None when it can."""
    if name == "compile":
        return compile_problem(device)
    if name not in _PROBES:
        return None
    if not importable(name):
        return f"{name} not importable"
    if device.type == "cuda":
        return run_problem(name, device)
    if name == "triton" and device.type == "cpu" and triton_interpret():
        return None
    return f"{name} needs CUDA"


@dataclass(frozen=True)
class FusionBackend:
    """The chosen backend: its name, why it was chosen, and the order of families it tries."""

    name: str
    reason: str

    def preference(self) -> tuple[str, ...]:
        """The kernel families tried before eager; apex has only normalization kernels, so its
        elementwise and softmax ops come from Triton."""
        return {"apex": ("apex", "triton"), "triton": ("triton",), "compile": ("compile",)}.get(self.name, ())

    def family(self, op: str, tensor: torch.Tensor) -> str:
        """The first family in this backend's order that implements ``op`` on ``tensor``'s device; inside a
        region torch.compile traces (a compiled layer, ``models/compiled_layers.py``), PyTorch's own
        kernels, which the compiler fuses with their neighbours."""
        if torch.compiler.is_compiling():
            return "eager"
        for family in self.preference():
            if op not in OPS_BY_FAMILY[family]:
                continue
            if _why_not(family, tensor.device) is None:
                return family
            if family == self.name:
                log_once(f"fusion backend {self.name} cannot run {op} on {tensor.device.type} tensors; "
                         f"using the next backend for it")
        return "eager"


def _auto(device: torch.device) -> FusionBackend:
    """apex, else Triton, else eager, with the reasons the better ones were passed over."""
    reasons = []
    for name in ("apex", "triton"):
        problem = _why_not(name, device)
        if problem is None:
            return FusionBackend(name, f"{name} available on {device.type}")
        reasons.append(problem)
    # torch.compile is never the automatic choice: on CUDA it needs Triton, which would have
    # been chosen above, and on CPU its seconds of compilation per op rarely pay off.
    reasons.append("torch.compile only on request")
    return FusionBackend("eager", ", ".join(reasons))


_active: FusionBackend | None = None


def select_backend(requested: str | None = None, device: torch.device | str | None = None) -> FusionBackend:
    """Choose the fusion backend for ``device``, make it the active one and log one line.

    ``requested`` is one of "auto" (default), "apex", "triton", "compile", "eager". A requested
    backend that cannot run here falls back to what "auto" would choose, and the log line says
    why; except "compile", which changes what runs (each transformer layer compiled,
    ``models/compiled_layers.py``) and is refused in one sentence where it cannot compile.
    """
    from megapipe.parallel.launch import default_device

    requested = requested or "auto"
    if requested not in BACKENDS + ("auto",):
        raise ValueError(f"fusion backend {requested!r} is unknown; use one of auto, {', '.join(BACKENDS)}.")
    device = torch.device(device) if device is not None else default_device()
    if requested == "auto":
        chosen = _auto(device)
    else:
        problem = _why_not(requested, device)
        if problem is None:
            chosen = FusionBackend(requested, "requested")
        elif requested == "compile":
            raise ConfigError(f"--fusion-backend compile cannot run on {device.type}: {problem}; use --fusion-backend "
                              "auto, triton or eager.")
        else:
            fallback = _auto(device)
            chosen = FusionBackend(fallback.name, f"{requested} requested, but {problem}"
                                   + ("" if fallback.name == "eager" else f"; {fallback.reason}"))
    logger.info("fusion backend: %s (%s)", chosen.name, chosen.reason)
    activate(chosen)
    return chosen


def activate(backend: FusionBackend | None) -> FusionBackend | None:
    """Make ``backend`` the one fused ops use (None: choose again on first use); returns the previous one."""
    global _active
    previous, _active = _active, backend
    return previous


def active_backend() -> FusionBackend:
    """The backend fused ops use; chosen automatically on first use if nobody chose one."""
    return _active if _active is not None else select_backend("auto")


_logged: set[str] = set()


def log_once(message: str) -> None:
    """Log a fallback once per process, so a per-call decision does not flood the log."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)
