"""Entry point shared by pretrain_gpt.py and pretrain_bert.py: a user mistake is one line, not a traceback."""

from __future__ import annotations

import sys

import torch.distributed as dist

from megapipe.errors import CheckpointError, ConfigError, DataError, PipelineTimeout


def main(kind: str) -> None:
    from megapipe.training import pretrain

    try:
        pretrain(kind, sys.argv[1:])
    except (ConfigError, DataError, CheckpointError, PipelineTimeout) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
