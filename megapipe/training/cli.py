"""Entry point shared by pretrain_gpt.py and pretrain_bert.py: a user mistake is one line, printed once per
job (not per rank), not a traceback."""

from __future__ import annotations

import sys
from typing import Optional

import torch.distributed as dist

from megapipe.errors import reports_user_errors
from megapipe.parallel.teardown import close_distributed
from megapipe.training.failures import explain_lost_peers, is_lost_peer, report_user_error
from megapipe.training.sigterm import SigtermNotice


@reports_user_errors(report=report_user_error)
def _run(kind: str, argv: list[str], notice: Optional[SigtermNotice] = None) -> int:
    """Pretrain; a failed message or collective whose peer went away becomes the ``PeerLost`` that names it."""
    from megapipe.training.trainer import pretrain

    try:
        pretrain(kind, argv, notice)
        if dist.is_initialized():  # no rank tears its connections down while a peer still uses them
            dist.barrier()
    except Exception as error:
        if not is_lost_peer(error):
            raise
        raise explain_lost_peers(error) from error
    return 0


def main(kind: str, notice: Optional[SigtermNotice] = None) -> None:
    """Run ``pretrain_<kind>.py``; ``notice``: the SIGTERM handler the script installed before importing torch."""
    try:
        code = _run(kind, sys.argv[1:], notice)
    finally:
        close_distributed()  # before the interpreter's teardown (teardown.py says why)
    if code:
        sys.exit(code)
