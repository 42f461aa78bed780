"""Error types whose message is one sentence naming the problem and the fix."""


class ConfigError(ValueError):
    """A flag or flag combination the user must change; raised before any process group exists."""


class PipelineTimeout(RuntimeError):
    """A peer did not answer in time; the message names the rank, stage and awaited action."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not fit the model."""


class DataError(ValueError):
    """A data file is missing, corrupt or inconsistent with the tokenizer."""


class ScheduleError(ValueError):
    """A pipeline schedule is malformed; the message names the first bad action and shows the grid."""


class SlurmError(RuntimeError):
    """Slurm refused or lost a job of the Slurm backend, or its commands do not answer."""
