"""Stragglers named: each rank's own work per step, compared across the ranks doing the same work.

A rank's own work is its main thread's CPU time, split by phase as the rank moves through them
(``parallel/progress.py``): the forward and backward passes, the optimizer step, and the loop around
them (data, bookkeeping, logging). CPU time, not wall time: a rank waiting for a slow peer, or taken
off its core by another process, spends no CPU, so neither makes it look slow; a slower core, or more
work, does. Time waiting on communication is left out for the same reason: a rank waits because
another is late, so its waits say nothing of itself. (On a GPU the host's CPU time measures the host's
share only; the device's kernels are not in it.)

Every ``--straggler-check-interval`` iterations the ranks all-gather their per-phase medians over the
window, on a gloo group of their own and without waiting (the next iteration reads the result), and
compare each rank with its peers: the ranks of the same pipeline stage (its tensor, context and
data-parallel peers), which run the same layers on the same shapes. A rank whose work exceeds its
peers' median by more than ``--straggler-threshold`` of it in two windows running (one slow window is
noise: a burst of other work on the host, a page fault storm) is named with its host and the phase
where most of the excess lies. A stage held by one rank has nothing to compare with and is not judged. Each
straggler is printed once until it recovers, and rank 0 reports the current ones to the cluster
scheduler with its lease (``lease/client.py``), which shows them in the job's status.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.parallel import progress
from megapipe.parallel.progress import PROGRESS
from megapipe.pipeline.executor import OPTIMIZER, PASSES

LOOP = "the loop"
PHASES = (PASSES, OPTIMIZER, LOOP)


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    phase: str  # where most of its excess lies (``PHASES``)
    seconds: float  # its median work per step, all phases
    peers_seconds: float  # its peers' median

    @property
    def slower(self) -> float:
        return self.seconds / self.peers_seconds - 1

    def sentence(self, first: int, last: int) -> str:
        return (f"rank {self.rank} (host {self.host}) is {self.slower:.0%} slower than its stage's other ranks, "
                f"most of it in {self.phase}: {1e3 * self.seconds:.0f} ms of work per step against "
                f"{1e3 * self.peers_seconds:.0f} ms (CPU time, medians over the windows of iterations "
                f"{first}-{last}).")

    def to_json(self) -> dict:
        return dict(asdict(self), slower=round(self.slower, 3))


class StragglerCheck:
    """Notes this rank's steps and every ``interval`` iterations finds the stragglers (collective on every rank)."""

    def __init__(self, stage: int, interval: int, threshold: float):
        self.interval, self.threshold = interval, threshold
        self.group = dist.new_group(backend="gloo")  # every rank makes it: a collective of its own, on the CPU
        self.world = dist.get_world_size()
        hosts: list[Optional[tuple[int, str]]] = [None] * self.world
        dist.all_gather_object(hosts, (stage, socket.gethostname()), group=self.group)
        self.stages, self.hosts = [h[0] for h in hosts], [h[1] for h in hosts]
        self.steps: list[list[float]] = []  # per step of the window: CPU seconds per phase
        self.named: set[int] = set()  # printed and not yet recovered
        self.current: list[Straggler] = []
        self._start: dict = {}
        self._pending: Optional[tuple] = None  # the all-gather started at the last check, read at the next call
        self._suspects: set[int] = set()  # the ranks slow in the last window

    def begin(self) -> None:
        progress.action("the loop: reading the next batch", LOOP)
        self._start = dict(PROGRESS.cpu)

    def end(self) -> None:
        progress.action("the loop: after the pipeline step", LOOP)
        self.steps.append([PROGRESS.cpu.get(phase, 0.0) - self._start.get(phase, 0.0) for phase in PHASES])

    def check(self, iteration: int) -> list[str]:
        """The sentences of the stragglers newly found. Every ``interval``-th iteration the window's medians are
        all-gathered without waiting; the iteration after reads them (the gather has long finished), so no
        rank waits for another at an iteration boundary. Collective: every rank calls it every iteration."""
        sentences = []
        if self._pending is not None:
            work, gathered, last = self._pending
            work.wait()
            self._pending = None
            found = find_stragglers([g.tolist() for g in gathered], self.stages, self.hosts, self.threshold)
            self.current = [s for s in found if s.rank in self._suspects]  # slow in two windows running
            self._suspects = {s.rank for s in found}
            sentences = [s.sentence(last - 2 * self.interval + 1, last) for s in self.current
                         if s.rank not in self.named]
            self.named = {s.rank for s in self.current}
        if iteration % self.interval == 0 and self.steps:
            mine = torch.tensor([statistics.median(step[k] for step in self.steps) for k in range(len(PHASES))],
                                dtype=torch.float64)
            gathered = [torch.zeros(len(PHASES), dtype=torch.float64) for _ in range(self.world)]
            self._pending = (dist.all_gather(gathered, mine, group=self.group, async_op=True), gathered, iteration)
            self.steps = []
        return sentences


def find_stragglers(times: list[list[float]], stages: list[int], hosts: list[str],
                    threshold: float) -> list[Straggler]:
    """The ranks whose work per step (``times[r]``: CPU seconds per phase of ``PHASES``) exceeds the median of
    their stage's other ranks by more than ``threshold`` of it, each with the phase of its largest excess."""
    found = []
    for rank, (stage, host) in enumerate(zip(stages, hosts)):
        peers = [times[r] for r in range(len(times)) if stages[r] == stage and r != rank]
        if not peers:
            continue
        reference = [statistics.median(p[k] for p in peers) for k in range(len(PHASES))]
        total, peers_total = sum(times[rank]), sum(reference)
        if peers_total > 0 and total > (1 + threshold) * peers_total:
            excess = [mine - theirs for mine, theirs in zip(times[rank], reference)]
            found.append(Straggler(rank, host, PHASES[excess.index(max(excess))], total, peers_total))
    return found
