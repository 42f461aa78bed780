"""How a worker hands its user error to torchrun, and how torchrun reads it back.

torchrun tells every worker where to write why it failed (``TORCHELASTIC_ERROR_FILE``, the file
torch's ``@record`` writes) and reads that file back into the ``ProcessFailure`` of each failed
worker. A worker that stops on a user error writes its sentence there, in torch's format, so the
sentence reaches torchrun even when torchrun stops the worker's peers before they print anything.
When megapipe's hook runs inside torchrun (``torchrun_hook``, which sets ``LAUNCHER_REPORTS`` for
its workers) torchrun prints the sentence once; otherwise the worker prints it, and torchrun's own
report shows it as the failure's traceback.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Optional

from megapipe.errors import USAGE_ERROR

LAUNCHER_REPORTS = "MEGAPIPE_LAUNCHER_REPORTS_USAGE_ERRORS"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
KIND = "megapipe usage error"


def hand_to_launcher(message: str) -> bool:
    """Write ``message`` to this worker's torchrun error file (when there is one); True when torchrun
    will print it, so that the worker must not."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return False
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message, "kind": KIND,
                                                             "timestamp": str(int(time.time()))}}}
    with open(path, "w") as file:
        json.dump(record, file)
    return os.environ.get(LAUNCHER_REPORTS) == "1"


def usage_error_messages(failures: dict) -> Optional[list[str]]:
    """The sentences of a job that failed on user errors alone, each once in rank order, or None.

    ``failures`` maps ranks to torchrun's ``ProcessFailure``s (``exitcode``, ``error_file_data``).
    The job failed on user errors alone when some worker exited with ``USAGE_ERROR`` and every
    other failed worker exited so too or was stopped by torchrun's SIGTERM, which it sends every
    worker once one has failed. Any other failure (a crash, a kill, another exit status) is None:
    torchrun's full report stays.
    """
    codes = {failure.exitcode for failure in failures.values()}
    if USAGE_ERROR not in codes or not codes <= {USAGE_ERROR, -signal.SIGTERM}:
        return None
    messages = []
    for rank in sorted(failures):
        recorded = failures[rank].error_file_data.get("message")
        if isinstance(recorded, dict) and recorded.get("extraInfo", {}).get("kind") == KIND \
                and recorded["message"] not in messages:
            messages.append(recorded["message"])
    return messages
