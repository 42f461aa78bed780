"""Which pipeline rank holds each virtual stage, and as which of its model chunks.

A model cut into p * v virtual stages runs on p pipeline ranks, v chunks per rank, in one of
two placements:

* ``looped`` (Megatron's interleaving): stage s is chunk s // p of rank s % p, so rank r holds
  r, r + p, r + 2p, ... and the model loops over the ranks v times (16 layers, p = 4, v = 2:
  rank 0 holds layers 1, 2, 9, 10). Without interleaving (v = 1) stage = rank.
* ``v`` (the V shape of ZBV, V-Half, V-Min and DualPipeV; Qi et al., "Pipeline Parallelism with
  Controllable Memory", 2024): v = 2 and rank r holds stage r as chunk 0 and stage 2p - 1 - r as
  chunk 1. The model goes down the ranks and back up: stages p - 1 and p share the last rank
  (no message between them) and the last stage is on rank 0 with the first, so the loss is
  computed where the input embedding lives.

A stage plan may instead replicate stages (PipeDream's "2-1" plan): workers are numbered stage by
stage, so replica r of stage s is worker ``sum(replicas[:s]) + r`` (``first_worker``,
``stage_of_worker``).

Pure arithmetic, shared by the schedule IR, the parallel state, model building and checkpoints.
"""

from __future__ import annotations

from enum import Enum

from megapipe.errors import ConfigError


class Placement(str, Enum):
    """A placement compares equal to its text, so the functions below take either."""

    LOOPED = "looped"
    V = "v"


def rank_of_stage(placement: Placement, p: int, stage: int) -> int:
    """The pipeline rank that holds virtual ``stage``."""
    if placement == Placement.V:
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def chunk_of_stage(p: int, stage: int) -> int:
    """Which of its rank's chunks ``stage`` is, in either placement (0 for the first the model reaches)."""
    return stage // p


def stage_of_chunk(placement: Placement, p: int, rank: int, chunk: int) -> int:
    """The virtual stage that chunk ``chunk`` of pipeline rank ``rank`` holds."""
    if placement == Placement.V:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stages_of_rank(placement: Placement, p: int, v: int, rank: int) -> list[int]:
    """The virtual stages ``rank`` holds, in chunk order."""
    return [stage_of_chunk(placement, p, rank, chunk) for chunk in range(v)]


def check_placement(placement: Placement, v: int, schedule: str) -> None:
    """The V placement holds exactly two chunks per rank."""
    if placement == Placement.V and v != 2:
        raise ConfigError(f"--pipeline-schedule {schedule} places two model chunks per rank in a V, but this run has "
                          f"v={v}; set --num-layers-per-virtual-pipeline-stage to --num-layers / "
                          "(2 x --pipeline-model-parallel-size) so that v = 2.")


def first_worker(replicas: tuple[int, ...], stage: int) -> int:
    """The worker of replica 0 of ``stage``."""
    return sum(replicas[:stage])


def stage_of_worker(replicas: tuple[int, ...], worker: int) -> int:
    """The stage ``worker`` holds a replica of."""
    first = 0
    for stage, count in enumerate(replicas):
        if worker < first + count:
            return stage
        first += count
    raise ValueError(f"worker {worker} is outside the stage replicas {list(replicas)}")
