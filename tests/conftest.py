"""Test-wide environment: no network waits from Hugging Face, no wandb uploads, and pipeline
messages held to NCCL's rules on gloo (the strict transport of ``pipeline/runtime/p2p.py``), so
every multi-rank run on CPU would also finish on NCCL."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("MEGAPIPE_STRICT_TRANSPORT", "1")
