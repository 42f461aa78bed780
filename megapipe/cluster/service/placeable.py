"""Why a job cannot be placed on the cluster as it is: the one requirement no worker type meets.

A job runs on ``devices`` (its tensor x pipeline size) accelerators of one type, on one host or
spread over several. The round mechanism skips a job that no type has that many of, so without
a word it would stay queued forever; ``status`` and the status page show this sentence instead,
and submission answers it at once (``submit --strict`` refuses such a job: ``Unplaceable``).
"""

from __future__ import annotations

from typing import Optional

from megapipe.cluster.core.cluster_spec import devices_text
from megapipe.errors import ConfigError


class Unplaceable(ConfigError):
    """``submit --strict`` of a job no registered worker type can hold now; the HTTP API answers it with 409
    (the request is well formed, the cluster as it is cannot run it), and nothing is journaled or queued."""


def unplaceable_reason(devices: int, devices_by_type: dict, queued: bool = True) -> Optional[str]:
    """One sentence naming the requirement and the fix, or None when some worker type can hold the job.
    ``queued``: the job is in the queue, so a smaller one replaces it by a cancel first (else it was
    refused at submission, and there is nothing to cancel)."""
    if not devices_by_type:
        return ("no worker is registered (none has joined yet, or all were lost); start one with tools/cluster.py "
                "worker --scheduler HOST:PORT --secret-file SECRET --devices TYPE:N.")
    if devices <= max(devices_by_type.values()):
        return None
    have = devices_text(devices_by_type)
    resubmit = "cancel it and submit it" if queued else "submit it"
    return (f"it needs {devices} devices of one type (--tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size) but no worker type has that many (the workers have {have}); "
            f"start workers with --devices TYPE:N adding up to {devices} of one type, or {resubmit} "
            f"with a tensor x pipeline size of at most {max(devices_by_type.values())}.")
