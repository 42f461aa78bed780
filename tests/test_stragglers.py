"""Stragglers (``training/stragglers.py``): a rank slowed by 30% is named (rank, host, phase) within 20 steps, and
a clean run of 200 steps names no one; the rule on constructed times.

The world: two data-parallel replicas (identical work) training through ``Trainer.train_iteration`` with
``--straggler-check-interval 5``. The slowed rank's delay is injected in each of its forward passes: a
busy loop of 30% of the CPU time of the forward and its backward (three forwards' worth), as a slower
core would take.
"""

from __future__ import annotations

import socket
import time

import pytest

from megapipe.cli.parse import parse_run
from megapipe.testing.worlds import run_distributed
from megapipe.training.stragglers import Straggler, find_stragglers
from megapipe.training.trainer import Trainer

FLAGS = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", "500",
         "--eval-iters", "0", "--log-interval", "1000", "--straggler-check-interval", "5"]


def slowed(forward):
    """``forward`` taking 30% more CPU time than it and its backward (about 3 forwards) take: the injected fault."""
    def slower(*args, **kwargs):
        started = time.thread_time()
        result = forward(*args, **kwargs)
        end = time.thread_time() + 0.3 * 3 * (time.thread_time() - started)
        while time.thread_time() < end:
            pass
        return result
    return slower


def train(rank: int, world_size: int, iterations: int, slow_rank: int) -> list[str]:
    trainer = Trainer(parse_run("gpt", FLAGS + ["--train-iters", str(iterations + 1)], world_size=world_size))
    printed = []
    trainer.logger.print = printed.append
    if rank == slow_rank:
        for chunk in trainer.chunks:
            chunk.forward = slowed(chunk.forward)
    batches = trainer.train_batches()
    for _ in range(iterations):
        assert trainer.train_iteration(batches) is None
    return [line for line in printed if line.startswith("straggler: ")]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_slowed_by_30_percent_is_named_within_20_steps():
    lines = run_distributed(2, train, 20, 1, timeout=240)
    assert lines[0] == lines[1]  # every rank reaches the same verdict
    assert len(lines[0]) == 1, lines[0]  # once, not at every check
    assert lines[0][0].startswith(f"straggler: rank 1 (host {socket.gethostname()}) is ")
    assert " slower than its stage's other ranks, most of it in forward and backward passes: " in lines[0][0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_clean_run_of_200_steps_names_no_one():
    assert run_distributed(2, train, 200, -1, timeout=240) == [[], []]


@pytest.mark.unit
def test_the_slow_rank_is_named_with_the_phase_of_its_excess():
    times = [[1.0, 0.2, 0.05], [1.3, 0.21, 0.05], [1.5, 0.2, 0.05], [1.5, 0.2, 0.05]]  # stages 0 (ranks 0, 1), 1
    found = find_stragglers(times, [0, 0, 1, 1], ["a", "b", "c", "d"], 0.2)
    assert found == [Straggler(1, "b", "forward and backward passes", 1.56, 1.25)]
    assert found[0].sentence(11, 20) == (
        "rank 1 (host b) is 25% slower than its stage's other ranks, most of it in forward and backward passes: "
        "1560 ms of work per step against 1250 ms (CPU time, medians over the windows of iterations 11-20).")
    assert find_stragglers([[1.0, 0.2, 0.0], [1.0, 0.6, 0.0]], [0, 0], ["a", "b"], 0.2)[0].phase == \
        "the optimizer step"


@pytest.mark.unit
def test_within_the_threshold_or_alone_on_a_stage_no_one_is_named():
    assert find_stragglers([[1.0, 0.1, 0.0], [1.2, 0.1, 0.0]], [0, 0], ["a", "b"], 0.2) == []  # 1.3 < 1.2 x 1.1
    assert find_stragglers([[1.0, 0.1, 0.0], [3.0, 0.1, 0.0]], [0, 1], ["a", "b"], 0.2) == []  # different stages
