"""Configuration: the dataclasses every run is described by, the flags generated from them, the checks.

``schema.py`` (model, parallelism, data, training) and ``optimizer.py`` hold the dataclasses,
each field with its default and Megatron-LM flag (``flag.py``); ``moe.py`` checks the model's
mixture-of-experts fields and says which layers hold experts; ``flags.py`` builds the
parser from them (a ``parser.FlagParser``: one-sentence errors, which flags were given);
``parse.py`` turns flags into a validated ``Config`` (``parse_config``), saying in one line
(``notes.py``) when flags given override a preset or leave one model chunk per rank.
Importing this package gives the dataclasses only; ``megapipe.config.parse`` brings the
command line (it reads the model-family registry).
"""

from megapipe.config.optimizer import LR_DECAY_STYLES, OPTIMIZERS, OptimizerConfig
from megapipe.config.schema import (Config, DataConfig, ModelConfig, ParallelConfig, ScheduleSearchConfig,
                                    TrainingConfig, pad_vocab_size)

__all__ = ["Config", "DataConfig", "LR_DECAY_STYLES", "ModelConfig", "OPTIMIZERS", "OptimizerConfig",
           "ParallelConfig", "ScheduleSearchConfig", "TrainingConfig", "pad_vocab_size"]
