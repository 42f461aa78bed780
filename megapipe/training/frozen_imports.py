"""The entry points' imports, made with the garbage collector off and then kept out of its later passes.

Importing torch, ``torch._dynamo`` and megapipe makes about 300,000 long-lived objects, and on the way
they set off half a dozen full collections that find nothing (0.45 s of a 2.3 s start, measured on one
CPU core; every rank of every launch pays it). Afterwards every full collection would walk them all
again, the one ``close_distributed`` makes at the end and those during training, which pause each
rank at its own moment. ``gc.freeze`` moves them to the permanent generation, which no collection
visits; what the run allocates later is collected as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_imports() -> Iterator[None]:
    """Run the block (the entry point's imports) without collections, then freeze what exists."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
