"""How context-parallel ranks exchange keys and values, and the flags that choose it, checked.

``--cp-comm-type`` (Megatron-LM's names): ``p2p`` passes key/value blocks around a ring of the c
ranks; ``all_gather`` gathers them once per layer; ``a2a`` (Ulysses) trades the sequence split for a
split over heads (each tensor rank's heads and query groups must divide by c: checked with the
attention's other settings in ``megapipe/context_parallel/checks.py``); ``a2a+p2p`` does an
all-to-all inside groups of ``--hierarchical-context-parallel-sizes``' first entry (consecutive
context ranks) and a ring across them, of the second entry's size. Pure arithmetic, no processes.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megapipe.errors import ConfigError

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def check_comm_type(context: int, comm_type: str, hierarchical: Optional[Sequence[int]]) -> None:
    """One sentence naming the flags when the comm type or the hierarchical sizes do not fit c."""
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {comm_type} is unknown; use one of {', '.join(COMM_TYPES)}.")
    if hierarchical is None:
        if comm_type == "a2a+p2p":
            raise ConfigError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A R (the all-to-all "
                              f"size and the ring size, A x R = --context-parallel-size {context}); add it.")
        return
    if comm_type != "a2a+p2p":
        raise ConfigError(f"--hierarchical-context-parallel-sizes applies only to --cp-comm-type a2a+p2p, not "
                          f"{comm_type}; drop the sizes or use a2a+p2p.")
    sizes = tuple(hierarchical)
    if len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != context:
        raise ConfigError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} must be two sizes, the "
                          f"all-to-all's and the ring's, whose product is --context-parallel-size {context}.")
