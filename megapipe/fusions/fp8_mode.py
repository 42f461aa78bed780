"""FP8 training chosen at start (``--fp8-format``, ``--fp8-recipe``): checked on the device, then active.

Like the fusion backend, the choice is made once per run by ``select_fp8``, which logs it. FP8 needs
matrix units that multiply FP8 (CUDA compute capability 8.9 or newer: Ada, Hopper, Blackwell) and a torch
whose ``torch._scaled_mm`` runs the recipe's products there; a device without them (a CPU, an older GPU) is
refused in one sentence, and so is a torch whose products fail or give a wrong value when tried once on a
few values with the recipe's types, scales and output types. On CUDA the quantisation (an amax, then a
scaling cast) is compiled by torch.compile where it can generate kernels there, else runs eagerly. Under
``fp8.emulated()`` (tests and benchmarks) every device can. ``active_fp8()`` is what the column- and
row-parallel linears read at each forward (``tensor_parallel/fp8_linear.py``); None runs them in the
parameters' dtype.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megapipe.errors import ConfigError, first_line
from megapipe.fusions.backend import compile_problem
from megapipe.fusions.fp8 import (Fp8Recipe, compile_quantisation, compiling_quantisation, emulating, quantise,
                                  scaled_mm)

logger = logging.getLogger("megapipe.fusions")

_active: Optional[Fp8Recipe] = None


def check_fp8_flags(fp8_format: Optional[str], bf16: bool, num_experts: Optional[int]) -> None:
    """Refuse, in one sentence, the flags FP8 training cannot honour (the device is checked at start)."""
    if fp8_format is None:
        return
    if not bf16:
        raise ConfigError(f"--fp8-format {fp8_format} needs --bf16: its products take and write bf16 activations "
                          "(fp16 with loss scaling and fp32 runs have no FP8 path); add --bf16.")
    if num_experts is not None:
        raise ConfigError(f"--fp8-format {fp8_format} cannot run the experts of --num-experts: their grouped "
                          "products (one per expert, each over however many tokens the router sent it) have no FP8 "
                          "path yet; drop one of the two.")


def select_fp8(fp8_format: Optional[str], fp8_recipe: str, device: torch.device) -> Optional[Fp8Recipe]:
    """Make ``--fp8-format``/``--fp8-recipe`` the active recipe (None: off) after checking ``device`` can run
    it; refused in one sentence where it cannot."""
    recipe = None if fp8_format is None else Fp8Recipe(fp8_format, fp8_recipe)
    if recipe is not None:
        problem = device_problem(recipe, torch.device(device))
        if problem is not None:
            raise ConfigError(f"--fp8-format {fp8_format} needs a GPU with FP8 matrix units (CUDA compute "
                              f"capability 8.9 or newer) and a torch whose torch._scaled_mm runs there, but "
                              f"{problem}; drop --fp8-format.")
        how = "emulated in fp32" if emulating() else \
            f"torch._scaled_mm, {'compiled' if compiling_quantisation() else 'eager'} quantisation"
        logger.info("FP8: %s products in the transformer layers' linears (%s)", recipe, how)
    activate(recipe)
    return recipe


def device_problem(recipe: Fp8Recipe, device: torch.device) -> Optional[str]:
    """Why ``device`` cannot run ``recipe``'s products, or None when it can. On CUDA the quantisation is
    compiled where torch.compile generates kernels and the compiled products pass the check, else eager."""
    if emulating():
        return None
    if device.type != "cuda":
        return f"this run computes on the {device.type}"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}"
    if compile_problem(device) is None:
        compile_quantisation(True)
        problem = _run_problem(recipe, device)
        if problem is None:
            return None
        logger.warning("FP8: compiled quantisation failed on %s (%s); quantising eagerly", device, problem)
    compile_quantisation(False)
    return _run_problem(recipe, device)


def _run_problem(recipe: Fp8Recipe, device: torch.device) -> Optional[str]:
    """Why ``recipe``'s products fail or are wrong on ``device`` when tried once on a few values, or None."""
    a = torch.linspace(-2.0, 2.0, 32 * 48, device=device).view(32, 48)
    b = torch.linspace(-1.0, 3.0, 48 * 16, device=device).view(48, 16)
    forward, gradient = recipe.forward_dtype, recipe.gradient_dtype
    outputs = (torch.bfloat16,) if recipe.rowwise else (torch.bfloat16, torch.float32)
    try:
        for left in sorted({forward, gradient}, key=str):
            qa, qb = quantise(a, left, recipe.rowwise, 1), quantise(b, forward, recipe.rowwise, 0)
            want = qa.dequantised() @ qb.dequantised()
            for out_dtype in outputs:
                got = scaled_mm(qa, qb, out_dtype).float()
                if not torch.allclose(got, want, rtol=2.0 ** -7, atol=1e-3):
                    return f"its torch._scaled_mm gives a wrong {left}-{forward} product with {out_dtype} output"
    except Exception as error:  # noqa: BLE001 - any failure of the check means: this device cannot
        return f"its FP8 products fail for {recipe} ({first_line(error, 160)})"
    return None


def activate(recipe: Optional[Fp8Recipe]) -> Optional[Fp8Recipe]:
    """Make ``recipe`` the one the linears use (None: FP8 off); returns the previous one."""
    global _active
    previous, _active = _active, recipe
    return previous


def active_fp8() -> Optional[Fp8Recipe]:
    """The recipe the column- and row-parallel linears run their products with, or None."""
    return _active
