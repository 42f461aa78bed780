"""Inside torchrun: a job whose workers all stopped on a user error ends with the sentence alone.

torchrun's ``main`` turns any failed worker into a ``ChildFailedError`` traceback of some 55 lines,
after its worker logger's lines about the failed worker and the SIGTERMs sent to the others; a
worker cannot silence what its parent prints. ``install`` (run at interpreter start-up by the
``.pth`` line ``site_hook`` writes, and only in a torchrun process) wraps torchrun's
``launch_agent`` once ``torch.distributed.launcher.api`` is imported, by ``torchrun`` and by
``python -m torch.distributed.run`` alike. The wrapper holds back the worker logger's warnings
while the workers run; when the job failed on user errors alone (``usage_error_messages``) it
drops them, prints each sentence once and exits with ``USAGE_ERROR``; on any other outcome it
lets them through in order and torchrun reports as it always does. It relies only on torch's
public pieces: ``launch_agent``, ``ChildFailedError.failures`` and the error files.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys

from megapipe.errors import USAGE_ERROR, print_error
from megapipe.launcher.usage_errors import LAUNCHER_REPORTS, usage_error_messages

LAUNCHER_MODULE = "torch.distributed.launcher.api"
WORKER_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # logs failed workers and the SIGTERMs
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def is_torchrun(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process is torchrun: its script, or ``python -m torch.distributed.run``."""
    if argv and os.path.basename(argv[0]) == "torchrun":
        return True
    return any(orig_argv[i] == "-m" and orig_argv[i + 1] in TORCHRUN_MODULES for i in range(len(orig_argv) - 1))


def install() -> None:
    """In a torchrun process, wrap ``launch_agent`` when torch loads it and tell the workers that
    torchrun prints their user errors; elsewhere nothing."""
    if not is_torchrun(sys.argv, sys.orig_argv):
        return
    os.environ[LAUNCHER_REPORTS] = "1"
    sys.meta_path.insert(0, _WrapOnImport())


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed.launcher.api`` through the other finders and wraps its
    ``launch_agent`` right after the module has run, before anyone calls it."""

    def find_spec(self, name, path=None, target=None):
        if name != LAUNCHER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.launch_agent = functools.partial(reporting_user_errors, module.launch_agent)

        spec.loader.exec_module = exec_module
        return spec


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
