"""When a generation must stop early, decided on one rank and agreed by every rank that runs it.

The ranks generate collectively, so no rank may stop alone: a stage that stops while another
sends it the next step waits forever. Only global rank 0 (the first stage's first tensor rank)
reads its clock; the others hold a ``Deadline`` without a time. The first stage asks
``reached`` once per decode round, before it starts the round's microbatches; with tensor
parallelism the first tensor rank broadcasts its decision to the stage's other tensor ranks (one
one-element broadcast per round, only for a request that carries a deadline, at the point where the
round reads the device anyway). Once the first stage agrees to stop, it takes the answers still in
flight and sends the stop header that ends every generation: the later stages learn the decision
from the per-step message they already wait for. Every row keeps the tokens chosen so far, the same
on every rank, and ``cut`` says that the answer is shorter than asked.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megapipe.parallel.state import ParallelState


class Deadline:
    """``at``: the ``clock`` time (host seconds) after which no new round starts; None on the ranks
    that follow rank 0's decision."""

    def __init__(self, at: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        self.at, self.clock, self.cut = at, clock, False

    def reached(self, ps: ParallelState, device: torch.device) -> bool:
        """Whether to stop before this round, the same answer on every tensor rank of the first stage."""
        stop = self.at is not None and self.clock() >= self.at
        if ps.tp_size > 1:
            flag = torch.tensor([int(stop)], dtype=torch.long, device=device)
            dist.broadcast(flag, src=ps.members["tensor"][0], group=ps.tp_group)
            stop = bool(flag.item())
        self.cut = self.cut or stop
        return stop
