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


class PeerLost(RuntimeError):
    """A peer process or host went away (or its link was cut); the message names who was lost."""

    def __init__(self, message: str, store_reachable: bool = True):
        super().__init__(message)
        self.store_reachable = store_reachable


def first_line(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``error`` on one line of at most ``limit`` characters, for a summary or a
    reason shown next to other text."""
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."
