"""On the CPU the C library's heap keeps the memory a pass frees for the next (``parallel/host_memory.py``).

Each case runs in a fresh interpreter (the setting is the process's): 64 MiB of 64 KiB tensors, which
glibc places on its heap, are made and freed; glibc's ``mallinfo2`` then reports how much free memory
sits at the heap's top (``keepcost``). Without the setting glibc trims it back to the kernel, so the
next pass would fault every page in again; with it the 64 MiB stay. A ``MALLOC_TOP_PAD_`` the user set
is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import ctypes, sys, torch
from megapipe.parallel.host_memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else None
working_set = [torch.ones(16 * 1024) for _ in range(1024)]
del working_set
print(kept, libc.mallinfo2().keepcost)
"""


def probe(mode: str, **env) -> tuple[str, int]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    kept, keepcost = result.stdout.split()
    return kept, int(keepcost)


def test_freed_memory_stays_on_the_heap_with_the_setting_and_goes_back_without():
    kept, with_setting = probe("keep")
    _, without = probe("none")
    assert kept == "True"
    assert with_setting >= 64 << 20 > without


def test_a_top_pad_the_user_set_is_left_alone():
    kept, _ = probe("keep", MALLOC_TOP_PAD_="0")
    assert kept == "False"
