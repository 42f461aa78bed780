"""A submitted megapipe command line, checked at submission with megapipe's own flag checks.

``pretrain_gpt.py FLAGS...`` (or ``pretrain_bert.py``) is parsed with the training scripts'
parser, so a job that would be refused at start is refused here, before any placement, with
the same sentence. Its ``--train-iters`` is the target; its devices (the scale factor of the
scheduler) are its tensor x pipeline size. The scheduler owns where checkpoints live and the
lease, so those flags may not be given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megapipe.config.parse import build_parser, parse_config
from megapipe.config import Config
from megapipe.errors import ConfigError

SCRIPTS = {"pretrain_gpt.py": "gpt", "pretrain_bert.py": "bert"}
OWNED_FLAGS = ("--save", "--load", "--cluster-lease")


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


def parse_job(command: list) -> JobSpec:
    """Check a submitted command line; ConfigError names the first problem and its fix."""
    if not command:
        raise ConfigError("the job has no command; pass it after --, e.g. -- pretrain_gpt.py --train-iters 100.")
    script, flags = os.path.basename(command[0]), [str(word) for word in command[1:]]
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
    config = parse_config(kind, flags, world_size=args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    return JobSpec(kind, [script] + flags, config)
