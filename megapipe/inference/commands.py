"""Rank 0 drives, the other ranks follow: one command at a time, broadcast from global rank 0 and run
by every rank together (the generation server and the evaluation harness adapter both work this way).

A command is ("generate", prompts, params), ("score", pairs) or ("stop",); prompts and pairs are
token ids, already checked on rank 0.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from megapipe.inference.deadline import Deadline
from megapipe.inference.generation import generate
from megapipe.inference.loading import LoadedModel
from megapipe.inference.scoring import score_continuations


def run(loaded: LoadedModel, command: tuple, deadline: Deadline):
    """Run one broadcast command on this rank: (new tokens, cut at the deadline) or the scores."""
    if command[0] == "generate":
        tokens = generate(loaded.chunks, loaded.ps, loaded.config, command[1], command[2], deadline=deadline)
        return tokens, deadline.cut
    return score_continuations(loaded.chunks, loaded.ps, loaded.config, command[1])


def broadcast(command) -> tuple:
    """Rank 0's ``command`` on every rank (the others pass None)."""
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def lead(loaded: LoadedModel, command: tuple, deadline: Optional[Deadline] = None):
    """Rank 0: run ``command`` on every rank; its result on rank 0."""
    return run(loaded, broadcast(command), deadline or Deadline())


def follow(loaded: LoadedModel) -> None:
    """Ranks other than 0: run what rank 0 broadcasts until it says stop (rank 0 alone keeps the clock)."""
    while True:
        command = broadcast(None)
        if command[0] == "stop":
            return
        run(loaded, command, Deadline())
