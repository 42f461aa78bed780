"""One step of a ring's communication: every tensor of a list sent to the next member and the
same-shaped tensor received from the previous one, posted as one ``batch_isend_irecv`` of matched
send/receive pairs (in the same order on every rank, so it is legal under NCCL's rules as well as
gloo's), waited later so that the compute in between overlaps it."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megapipe.context_parallel.timeline import Timeline
from megapipe.parallel import progress


class Ring:
    """The members of a ring (global ranks, in ring order), this process's place, and its group."""

    def __init__(self, group, ranks: tuple[int, ...], index: int, timeline: Timeline | None = None):
        self.group, self.ranks, self.index, self.timeline = group, ranks, index, timeline

    @property
    def size(self) -> int:
        return len(self.ranks)

    def member(self, step: int) -> int:
        """The ring index of the member whose block this process holds at ``step``."""
        return (self.index - step) % self.size

    @contextmanager
    def computing(self, phase: str, step: int):
        """Record the compute of ``step`` on the timeline, if there is one."""
        start = Timeline.now()
        yield
        if self.timeline is not None:
            self.timeline.add(phase, step, "compute", start)

    def post(self, tensors: list[torch.Tensor], phase: str, step: int) -> Transfer:
        nxt, prev = self.ranks[(self.index + 1) % self.size], self.ranks[(self.index - 1) % self.size]
        # contiguous buffers whatever the strides of what is sent (gloo receives only into contiguous tensors)
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = []
        for tag, (sent, into) in enumerate(zip(tensors, received)):
            ops.append(dist.P2POp(dist.isend, sent.contiguous(), nxt, self.group, tag))
            ops.append(dist.P2POp(dist.irecv, into, prev, self.group, tag))
        start = Timeline.now()
        return Transfer(dist.batch_isend_irecv(ops), ops, received, self.timeline, phase, step, start)


class Transfer:
    def __init__(self, works, ops, received, timeline, phase, step, start):
        self.works, self.ops, self.received = works, ops, received  # ops keep the sent tensors alive
        self.timeline, self.phase, self.step, self.start = timeline, phase, step, start

    def wait(self) -> list[torch.Tensor]:
        with progress.collective(f"the context ring's {self.phase} step {self.step}", self.ops[0].group,
                                 counted=False):
            for work in self.works:
                work.wait()
        if self.timeline is not None:
            self.timeline.add(self.phase, self.step, "transfer", self.start)
        return self.received
