"""Entry point shared by pretrain_gpt.py and pretrain_bert.py: a user mistake is one line, printed once per
job (not per rank), not a traceback."""

from __future__ import annotations

import sys

import torch.distributed as dist

from megapipe.errors import CheckpointError, ConfigError, DataError
from megapipe.training.failures import explain_lost_peers, is_lost_peer, report_user_error


def main(kind: str) -> None:
    from megapipe.training.trainer import pretrain

    try:
        pretrain(kind, sys.argv[1:])
        if dist.is_initialized():  # no rank tears its connections down while a peer still uses them
            dist.barrier()
    except (ConfigError, DataError, CheckpointError) as error:
        report_user_error(error)
        sys.exit(2)
    except Exception as error:
        if not is_lost_peer(error):
            raise
        report_user_error(explain_lost_peers(error))
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
