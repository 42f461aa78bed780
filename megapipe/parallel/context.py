"""The process groups one context-parallel attention needs, as the attention kernels receive them.

``ParallelState`` builds this for a run (``--context-parallel-size``, ``--cp-comm-type``,
``--hierarchical-context-parallel-sizes``); the kernels of ``megapipe.context_parallel`` read only
this, so they can be tested with groups made by hand. The context ranks of one group are listed in
context-index order: member k holds chunks k and 2c-1-k of every sequence (``layout/context.py``).
Under ``a2a+p2p`` the c ranks form ``ring_size`` groups of ``a2a_size`` consecutive context ranks:
keys and values are exchanged all-to-all inside each (over heads), and passed around a ring
across them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ContextGroups:
    group: Any                          # the c context ranks (a process group; None when c = 1)
    ranks: tuple[int, ...]              # their global ranks, in context-index order
    index: int                          # this process's context index, 0 .. c-1
    comm_type: str = "p2p"
    a2a_group: Optional[Any] = None     # a2a+p2p: this rank's group of a2a_size consecutive context ranks
    a2a_ranks: tuple[int, ...] = ()
    ring_group: Optional[Any] = None    # a2a+p2p: the ranks with this rank's position in every a2a group
    ring_ranks: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @staticmethod
    def single() -> "ContextGroups":
        """No context parallelism: one rank holds the whole sequence."""
        return ContextGroups(None, (0,), 0)
