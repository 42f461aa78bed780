"""Configuration: the dataclasses every run is described by, each field with its default and Megatron-LM flag.

``schema.py`` (model, parallelism, data, training) and ``optimizer.py`` hold the dataclasses, each field
with its default and Megatron-LM flag (``flag.py``); ``moe.py`` checks the model's mixture-of-experts fields
and says which layers hold experts; ``parser.py`` is the argparse subclass with one-sentence errors;
``notes.py`` says in one line when flags given override a preset. The command line built from these
(flags, cross-flag checks, ``parse_config``) is ``megapipe.cli``, which sits above models and schedules.
"""

from megapipe.config.optimizer import LR_DECAY_STYLES, OPTIMIZERS, OptimizerConfig
from megapipe.config.schema import (Config, DataConfig, ModelConfig, ParallelConfig, ScheduleSearchConfig,
                                    TrainingConfig, pad_vocab_size)

__all__ = ["Config", "DataConfig", "LR_DECAY_STYLES", "ModelConfig", "OPTIMIZERS", "OptimizerConfig",
           "ParallelConfig", "ScheduleSearchConfig", "TrainingConfig", "pad_vocab_size"]
