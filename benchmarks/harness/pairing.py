"""Systems side by side: each step between two barriers (a noisy machine then slows each alike),
the systems taking turns in an order rotated every round."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def timed(step: Callable[[], T], barriers: bool = True) -> tuple[float, float, T]:
    """Wall seconds of ``step()`` between two barriers (none in a single process: ``barriers=False``),
    this process's CPU seconds in it, and its result."""
    if barriers:
        dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = step()
    cpu = time.process_time() - cpu_start
    if barriers:
        dist.barrier()
    return time.perf_counter() - start, cpu, result


def rotated(names: Sequence[str], shift: int) -> list[str]:
    """``names`` starting at ``shift`` (modulo their number): round ``r``'s order."""
    shift %= len(names)
    return list(names[shift:]) + list(names[:shift])


def take_turns(names: Iterable[str], rounds: int, run: Callable[[str, int], T]) -> dict[str, list[T]]:
    """``run(name, round)`` for every name in every round, the order rotated each round; the results per name."""
    names = list(names)
    results: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            results[name].append(run(name, r))
    return results
