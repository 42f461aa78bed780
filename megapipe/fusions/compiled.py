"""torch.compile'd versions of the fused ops' elementwise functions, built once, on first use.

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
