"""Host memory for CPU training: the C library's heap keeps the memory passes free, as a GPU's caching allocator does.

On the CPU, PyTorch allocates tensors with the C library's ``malloc``. glibc gives the free memory at the
top of its heap back to the kernel whenever more than its trim threshold is free, and the next pass then
takes every page back with a fault that zeroes it. A pipeline pass frees megabytes of activations that
the next pass allocates again, and a zero-bubble schedule's BI holds the operands of its weight products
until BW, so its passes allocate above what a whole backward frees: there the faults made BI + BW 4-6%
slower than one B (``benchmarks/bench_split_backward.py``), with the products themselves equally fast.
glibc's ``M_TOP_PAD`` keeps that much free memory at the top of the heap (and grows the heap by as much
beyond each request), so the passes reuse it instead. The pages are the process's own until it exits;
they are touched only once used.

Only with glibc (elsewhere the C library manages its heap its own way), and not when the user set
``MALLOC_TOP_PAD_`` for the process: theirs stands.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

M_TOP_PAD = -2  # glibc's mallopt parameter (malloc.h)
TOP_PAD_BYTES = 256 << 20  # above a pass's allocations at the shapes CPU runs use


@functools.lru_cache(maxsize=None)
def keep_freed_host_memory() -> bool:
    """Ask glibc to keep ``TOP_PAD_BYTES`` of freed memory for reuse (once per process); whether it did."""
    if "MALLOC_TOP_PAD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_TOP_PAD, TOP_PAD_BYTES) != 1:
        logger.info("glibc refused M_TOP_PAD %d; freed host memory goes back to the kernel", TOP_PAD_BYTES)
        return False
    return True
