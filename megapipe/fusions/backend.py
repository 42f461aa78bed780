"""Which kernel family runs the fused operators: apex, Triton, torch.compile or eager PyTorch.

One backend is chosen at start-up by ``select_backend`` and logged in one line with the reason.
Each fused op then asks ``active_backend().family(op, tensor)`` which kernel family to use for
that tensor: a backend only names a preference order, and a family that cannot run an op on a
tensor's device (apex has no GeLU kernel, Triton needs CUDA tensors) yields to the next one,
ending with eager PyTorch, so a choice never produces a wrong result or an error.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass

import torch

logger = logging.getLogger("megapipe.fusions")

BACKENDS = ("apex", "triton", "compile", "eager")

# The ops each kernel family implements; "eager" implements all of them.
OPS_BY_FAMILY = {
    "apex": frozenset({"layer_norm", "rms_norm"}),
    "triton": frozenset({"bias_gelu", "bias_dropout_add", "softmax", "layer_norm", "rms_norm"}),
    "compile": frozenset({"bias_gelu", "bias_dropout_add", "softmax", "cross_entropy"}),
}


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run, slowly, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def apex_problem() -> str | None:
    """Why apex's fused kernels cannot be used, or None when they can."""
    if importlib.util.find_spec("apex") is None:
        return "apex not importable"
    if importlib.util.find_spec("fused_layer_norm_cuda") is None:
        return "apex has no CUDA extensions"
    return None


def triton_problem() -> str | None:
    """Why Triton kernels cannot be used, or None when they can (on CUDA, or interpreted)."""
    if importlib.util.find_spec("triton") is None:
        return "triton not importable"
    return None


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot generate kernels for ``device``, or None when it can."""
    if device.type == "cuda":  # inductor writes Triton kernels for CUDA
        return None if triton_problem() is None else "torch.compile on CUDA needs triton"
    if device.type == "cpu" and not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")):
        return "torch.compile on CPU needs a C++ compiler"
    return None


def _family_runs_on(family: str, device: torch.device) -> bool:
    if family == "apex":
        return device.type == "cuda" and apex_problem() is None
    if family == "triton":
        return triton_problem() is None and (device.type == "cuda" or (device.type == "cpu" and triton_interpret()))
    if family == "compile":
        return compile_problem(device) is None
    return True


@dataclass(frozen=True)
class FusionBackend:
    """The chosen backend: its name, why it was chosen, and the order of families it tries."""

    name: str
    reason: str

    def preference(self) -> tuple[str, ...]:
        # apex only has normalization kernels; its elementwise and softmax ops come from Triton.
        order = {"apex": ("apex", "triton"), "triton": ("triton",), "compile": ("compile",)}.get(self.name, ())
        return order + ("eager",)

    def family(self, op: str, tensor: torch.Tensor) -> str:
        """The first family in this backend's order that implements ``op`` on ``tensor``'s device."""
        for family in self.preference():
            if family == "eager":
                return family
            if op in OPS_BY_FAMILY[family] and _family_runs_on(family, tensor.device):
                return family
            if family == self.name and op in OPS_BY_FAMILY[family]:
                log_once(f"fusion backend {self.name} cannot run {op} on {tensor.device.type} tensors; "
                         f"using the next backend for it")
        return "eager"


def _why_not(name: str, device: torch.device) -> str | None:
    if name == "apex":
        problem = apex_problem()
        return problem or (None if device.type == "cuda" else "apex needs CUDA")
    if name == "triton":
        problem = triton_problem()
        if problem:
            return problem
        if device.type == "cuda" or (device.type == "cpu" and triton_interpret()):
            return None
        return "triton needs CUDA"
    if name == "compile":
        return compile_problem(device)
    return None


def _auto(device: torch.device) -> FusionBackend:
    reasons = []
    for name in ("apex", "triton"):
        problem = _why_not(name, device)
        if problem is None:
            return FusionBackend(name, f"{name} available on {device.type}")
        reasons.append(problem)
    if device.type == "cuda" and compile_problem(device) is None:
        return FusionBackend("compile", ", ".join(reasons))
    reasons.append("torch.compile only on request")
    return FusionBackend("eager", ", ".join(reasons))


_active: FusionBackend | None = None


def select_backend(requested: str | None = None, device: torch.device | str | None = None) -> FusionBackend:
    """Choose the fusion backend for ``device``, make it the active one and log one line.

    ``requested`` is one of "auto" (default), "apex", "triton", "compile", "eager". A requested
    backend that cannot run here falls back to what "auto" would choose, and the log line says
    why. Never raises for an unavailable backend.
    """
    from megapipe.distributed import default_device

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
