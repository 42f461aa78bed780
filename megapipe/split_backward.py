"""Whether the backward running now is a split backward's first part (BI: input gradients only).

The executor's BI pass differentiates a stage's graph for its input only and keeps the graph
for the BW pass, which runs it again for the weight gradients. Autograd functions with side
effects read the flag: a recomputed block (``models/recompute.py``) must not accumulate its
weights' gradients during BI, and the vocabulary-parallel cross entropy must not overwrite its
saved softmax, which BW still needs.
"""

from __future__ import annotations

import contextlib
import contextvars

_INPUT_GRADIENTS_ONLY = contextvars.ContextVar("input_gradients_only", default=False)


@contextlib.contextmanager
def input_gradients_only():
    """Mark the backward run inside as a BI pass (see the module docstring)."""
    token = _INPUT_GRADIENTS_ONLY.set(True)
    try:
        yield
    finally:
        _INPUT_GRADIENTS_ONLY.reset(token)


def computing_input_gradients_only() -> bool:
    return _INPUT_GRADIENTS_ONLY.get()
