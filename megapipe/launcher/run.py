"""``megapipe-run``: torchrun, with a job that failed on user errors alone ending in their sentences.

torchrun's ``main`` turns any failed worker into a ``ChildFailedError`` traceback of some 55 lines,
after its worker logger's lines about the failed worker and the SIGTERMs sent to the others; a
worker cannot silence what its parent prints. ``megapipe-run`` (a console script of megapipe's,
also ``python -m megapipe.launcher.run``) takes torchrun's arguments as they are and runs torchrun's
own ``main`` in its process, with torchrun's ``launch_agent`` wrapped: the wrapper holds back the
worker logger's warnings while the workers run; when the job failed on user errors alone
(``usage_error_messages``) it drops them, prints each sentence once and exits with ``USAGE_ERROR``;
on any other outcome it lets them through in order and torchrun reports as it always does. Plain
``torchrun`` still works: each job's sentence is then printed once by a worker, among torchrun's
lines. Nothing runs in any other process; it relies only on torch's public pieces:
``launch_agent``, ``ChildFailedError.failures`` and the error files.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Optional

from megapipe.errors import USAGE_ERROR, print_error
from megapipe.launcher.usage_errors import LAUNCHER_REPORTS, usage_error_messages

WORKER_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # logs failed workers and the SIGTERMs


def main(argv: Optional[list[str]] = None) -> None:
    """Run torchrun on ``argv`` (default: this command's arguments), reporting user errors as one sentence."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.run import main as torchrun

    os.environ[LAUNCHER_REPORTS] = "1"  # the workers leave their sentence to this process
    launch_agent = launcher.launch_agent
    launcher.launch_agent = functools.partial(reporting_user_errors, launch_agent)
    try:
        torchrun(sys.argv[1:] if argv is None else argv)
    finally:
        launcher.launch_agent = launch_agent


def reporting_user_errors(launch_agent, *args, **kwargs):
    """``launch_agent(*args, **kwargs)``, ending a job that failed on user errors alone with their
    sentences and ``USAGE_ERROR``, and leaving every other outcome to torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    held = _HeldRecords(logging.getLogger(WORKER_LOGGER))
    try:
        return launch_agent(*args, **kwargs)
    except ChildFailedError as failed:
        messages = usage_error_messages(failed.failures)
        if messages is None:
            raise
        held.drop()
        for message in messages:
            print_error(message)
        raise SystemExit(USAGE_ERROR) from None
    finally:
        held.release()


class _HeldRecords(logging.Filter):
    """Holds back a logger's warnings and errors until ``release`` logs them (or ``drop`` forgets them)."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.records = logger, []
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.records.append(record)
        return False

    def drop(self) -> None:
        self.records.clear()

    def release(self) -> None:
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)
        self.records.clear()


if __name__ == "__main__":
    main()
