"""The checks of ``--fault-tolerant-replicas``: what a run of replicas that lose and regain members needs.

The survivors of a loss train the same global batch with more microbatches each, so every width from
one replica to all of them must split the batch into whole microbatches that the schedule can run;
the schedule's lists are rebuilt for each width, so it must be a named flush schedule.
"""

from __future__ import annotations

import math
import re

from megapipe.cli.selection import AUTO
from megapipe.config.schema import Config
from megapipe.errors import ConfigError, UserError
from megapipe.schedules.catalog import build_schedule, schedule_descriptor

ADDRESS = re.compile(r"[^\s:]+:\d{1,5}")


def replica_flags_alone(config: Config) -> None:
    """The replica flags without ``--fault-tolerant-replicas`` are a mistake, not ignored."""
    t = config.training
    if t.fault_tolerant_replicas is None and (t.replica_id is not None or t.lighthouse is not None):
        raise ConfigError("--replica-id and --lighthouse belong to --fault-tolerant-replicas N; add it, or drop them.")


def check_fault_tolerant_replicas(config: Config, pipeline: int, data: int) -> None:
    """One sentence for what a run of ``--fault-tolerant-replicas`` cannot do (``data``: the d inside a replica)."""
    t, par = config.training, config.parallel
    replica_flags_alone(config)
    replicas = t.fault_tolerant_replicas
    if replicas is None:
        return
    if replicas < 1:
        raise ConfigError(f"--fault-tolerant-replicas {replicas} must be at least 1.")
    if t.replica_id is None or not 0 <= t.replica_id < replicas:
        raise ConfigError(f"--fault-tolerant-replicas {replicas} needs --replica-id K with K from 0 to {replicas - 1} "
                          f"(got {t.replica_id}): each replica's command names which one it is.")
    if t.lighthouse is None or not ADDRESS.fullmatch(t.lighthouse):
        raise ConfigError(f"--fault-tolerant-replicas needs --lighthouse HOST:PORT (got {t.lighthouse}): the address "
                          "of python -m megapipe.replicas.lighthouse, which decides each step's quorum.")
    if t.replica_timeout_seconds <= 0:
        raise ConfigError(f"--replica-timeout-seconds {t.replica_timeout_seconds:g} must be above 0.")
    name = par.pipeline_schedule
    if par.schedule_file is not None or name == AUTO:
        raise ConfigError("--fault-tolerant-replicas needs a named flush schedule (--pipeline-schedule NAME): its "
                          "lists are rebuilt for the microbatches of each number of replicas, "
                          f"which {'a schedule file' if name != AUTO else '--pipeline-schedule auto'} cannot give.")
    if schedule_descriptor(name).asynchronous:
        raise ConfigError(f"--fault-tolerant-replicas cannot run --pipeline-schedule {name}: PipeDream and 2BW update "
                          "without a flush and keep microbatches in flight across steps, so there is no step "
                          "boundary where the replicas can agree and a lost replica's step be discarded; use a flush "
                          "schedule.")
    if config.optimizer.enable_optimizer_post_validation:
        raise ConfigError("--fault-tolerant-replicas cannot run with --enable-optimizer-post-validation: its eager "
                          "step would be taken before the replicas know whether every one of them finished the step.")
    per_replica = t.micro_batch_size * data
    for width in range(replicas, 0, -1):
        fits = per_replica * math.lcm(*range(1, replicas + 1))
        if t.global_batch_size % (per_replica * width):
            raise ConfigError(f"--global-batch-size {t.global_batch_size} cannot be split over {width} surviving "
                              f"replica(s) of --micro-batch-size {t.micro_batch_size} x d={data}: with "
                              f"--fault-tolerant-replicas {replicas} every width from 1 to {replicas} must divide "
                              f"it; use a multiple of {fits}.")
        m = t.global_batch_size // (per_replica * width)
        try:
            build_schedule(name, pipeline, m, par.virtual_pipeline)
        except UserError as error:
            raise ConfigError(f"{width} surviving replica(s) would run {m} microbatch(es) each, which --pipeline-schedule "
                              f"{name} cannot: {error}") from None
