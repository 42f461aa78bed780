"""A submitted megapipe command line, checked at submission with megapipe's own flag checks.

``pretrain_gpt.py FLAGS...`` (or ``pretrain_bert.py``) is parsed with the training scripts'
parser, so a job that would be refused at start is refused here, before any placement, with
the same sentence. Its ``--train-iters`` is the target; its devices (the scale factor of the
scheduler) are its tensor x pipeline size. The scheduler owns where checkpoints live and the
lease, so those flags may not be given; the flags that need a checkpoint directory (``--save-interval``)
are checked as if ``--save`` were given, since the scheduler gives it at every launch. Every path
the job names must lie inside the scheduler's allowed roots (``job_paths.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megapipe.cluster.service.job_paths import check_paths
from megapipe.cluster.service.names import check_plain
from megapipe.cli.parse import build_parser, parse_config
from megapipe.config import Config
from megapipe.errors import ConfigError

SCRIPTS = {"pretrain_gpt.py": "gpt", "pretrain_bert.py": "bert"}
OWNED_FLAGS = ("--save", "--load", "--cluster-lease")
SCHEDULER_SAVE = "scheduler-owned"  # stands for the --save each launch is given, in the submission's checks


@dataclass
class JobSpec:
    kind: str
    command: list  # [script, flags...] as submitted
    config: Config

    @property
    def target_iters(self) -> int:
        return self.config.training.train_iters

    @property
    def devices(self) -> int:
        return self.config.parallel.tensor * self.config.parallel.pipeline


def parse_job(command: list, roots: Optional[tuple] = None) -> JobSpec:
    """Check a submitted command line; ConfigError names the first problem and its fix. ``roots``: the real
    paths every path flag must lie inside (None: not checked, for a journal's jobs, checked when submitted)."""
    if not command:
        raise ConfigError("the job has no command; pass it after --, e.g. -- pretrain_gpt.py --train-iters 100.")
    script, flags = os.path.basename(command[0]), [str(word) for word in command[1:]]
    for index, word in enumerate(flags, start=1):  # the command is written to the job's log, line by line
        check_plain(f"word {index} of the job's command", word)
    if script not in SCRIPTS:
        raise ConfigError(f"the job's command starts with {command[0]!r}; start it with one of "
                          f"{', '.join(SCRIPTS)}.")
    for flag in flags:
        if flag.split("=")[0] in OWNED_FLAGS:
            raise ConfigError(f"{flag.split('=')[0]} is set by the scheduler for every allocation of the job; "
                              "drop it from the submitted command.")
    kind = SCRIPTS[script]
    if "--pipeline-stages" in flags:
        raise ConfigError("--pipeline-stages fixes the stages to a device count, but the scheduler re-plans the layout "
                          "on every allocation; give --tensor-model-parallel-size and "
                          "--pipeline-model-parallel-size instead.")
    args = build_parser(kind).parse_args(flags)  # a bad flag is the training script's own ConfigError
    if roots is not None:
        check_paths(args, roots)  # before parse_config, which may read schedule and profile files
    world_size = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    config = parse_config(kind, flags + ["--save", SCHEDULER_SAVE], world_size=world_size)
    return JobSpec(kind, [script] + flags, config)
