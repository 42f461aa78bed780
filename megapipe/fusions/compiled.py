"""torch.compile'd versions of the fused ops' elementwise functions, built once, on first use, and
the kernel pair an elementwise op runs on each backend family.

``dynamic=True`` so one compiled kernel serves every sequence length and batch size instead
of recompiling per shape. Compilation takes seconds, which is why this backend is opt-in.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``fn`` compiled by torch.compile; the same compiled object on every call."""
    return torch.compile(fn, dynamic=True)


def elementwise_kernels(family: str, op: str, formulas: tuple[Callable, Callable],
                        native: tuple[Callable, Callable]) -> tuple[Callable, Callable]:
    """The (forward, backward) kernels of the fused elementwise ``op`` on a backend ``family``: Triton's
    (``triton_elementwise.{op}_forward`` and ``_backward``), the fp32 ``formulas`` compiled, or ``native``."""
    if family == "triton":
        from megapipe.fusions import triton_elementwise

        return getattr(triton_elementwise, f"{op}_forward"), getattr(triton_elementwise, f"{op}_backward")
    if family == "compile":
        return compiled(formulas[0]), compiled(formulas[1])
    return native
