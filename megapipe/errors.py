"""Errors a user can fix, each a one-sentence message naming the problem and the fix, and the one way
every entry point reports them: ``error: <message>`` printed once, exit status 2, no traceback."""

from __future__ import annotations

import functools
import sys
from typing import Callable

USAGE_ERROR = 2
"""Exit status of every entry point for a ``UserError`` (argparse's for a bad command line)."""


class UserError(Exception):
    """Something the user can fix (a flag, a file, a host); ``str(error)`` says what and how."""


class ConfigError(UserError, ValueError):
    """A flag or flag combination the user must change; raised before any process group exists."""


class PipelineTimeout(RuntimeError):
    """A peer did not answer in time; the message names the rank, stage and awaited action."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, corrupt or does not fit the model."""


class DataError(UserError, ValueError):
    """A data file is missing, corrupt or inconsistent with the tokenizer."""


class ScheduleError(UserError, ValueError):
    """A pipeline schedule is malformed; the message names the first bad action and shows the grid."""


class SlurmError(UserError, RuntimeError):
    """Slurm refused or lost a job of the Slurm backend, or its commands do not answer."""


class NonFiniteError(UserError, ArithmeticError):
    """A NaN or Inf in the loss or the gradients stopped the run (``--check-for-nan-in-loss-and-grad``);
    the message names the iteration and the rank."""


class PeerLost(UserError, RuntimeError):
    """A peer process or host went away (or its link was cut); the message names who was lost."""

    def __init__(self, message: str, store_reachable: bool = True):
        super().__init__(message)
        self.store_reachable = store_reachable


def print_error(error: UserError | str) -> None:
    print(f"error: {error}", file=sys.stderr, flush=True)


def reports_user_errors(main: Callable | None = None, *, report: Callable[[UserError], None] = print_error):
    """Decorate an entry point's ``main``: a ``UserError`` it raises is reported once (``report``,
    by default ``error: <message>`` on stderr) and ``main`` returns ``USAGE_ERROR`` instead of
    raising, so ``sys.exit(main())`` exits 2 and tests can call ``main(argv)`` directly."""
    if main is None:
        return functools.partial(reports_user_errors, report=report)

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            report(error)
            return USAGE_ERROR

    return run


def first_line(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``error`` on one line of at most ``limit`` characters, for a summary or a
    reason shown next to other text."""
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."
