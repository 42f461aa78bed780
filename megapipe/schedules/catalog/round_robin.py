"""1F1B-RR without flushes: PipeDream's order over a pipeline whose stages may be replicated
(seed 002 section 2.4.2, Fig 2.7).

Workers are numbered stage by stage; a stage with R replicas runs microbatch i on its
replica i % R, so a microbatch's backward comes back to the worker that ran its forward.
The input stage admits NOAM = ceil(workers / input-stage replicas) microbatches per replica
before its first backward; in general the replicas of stage s warm up with
``(W - 1 - workers of earlier stages) // R_s`` forwards (W workers), which is p - s - 1 in a
straight pipeline and 1, 0 for the "2-1" configuration. Then every worker alternates one
forward of a new microbatch and one backward of an earlier one, and finally drains the
backwards left.
"""

from __future__ import annotations

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind


def warmup_forwards(replicas: tuple[int, ...], stage: int) -> int:
    """Forwards each replica of ``stage`` runs before its first backward."""
    return (sum(replicas) - 1 - sum(replicas[:stage])) // replicas[stage]


def noam(replicas: tuple[int, ...]) -> int:
    """NUM_OPT_ACTIVE_MINIBATCHES: microbatches admitted per input-stage replica (seed 002 L1317)."""
    return -(-sum(replicas) // replicas[0])


def one_f_one_b_round_robin(replicas: tuple[int, ...], num_microbatches: int) -> list[list[Action]]:
    """Per worker, its F and B actions for microbatches 0 .. num_microbatches - 1."""
    lists = []
    for stage, count in enumerate(replicas):
        warmup = warmup_forwards(replicas, stage)
        for replica in range(count):
            own = list(range(replica, num_microbatches, count))
            lead = min(warmup, len(own))
            actions = [Action(ActionKind.F, stage, i) for i in own[:lead]]
            for k, i in enumerate(own[lead:]):
                actions += [Action(ActionKind.F, stage, i), Action(ActionKind.B, stage, own[k])]
            actions += [Action(ActionKind.B, stage, i) for i in own[len(own) - lead:]]
            lists.append(actions)
    return lists


def check_batch_fits_replicas(name: str, replicas: tuple[int, ...], m: int) -> None:
    """Every replica must get the same share of each batch, so that each batch is one call's work."""
    for stage, count in enumerate(replicas):
        if m % count:
            raise ConfigError(f"--pipeline-schedule {name} with {count} replicas of stage {stage} needs the "
                              f"microbatches per batch m={m} to be a multiple of {count}; change "
                              "--global-batch-size or --micro-batch-size.")
