"""Checkpoint directories on disk and the atomic steps that publish one.

``DIR/iter_0000100/`` holds one checkpoint; ``DIR/latest_checkpointed_iteration.txt`` (the
name Megatron uses) holds the number of the newest complete one. A save writes into
``iter_0000100.tmp``, syncs it, renames it into place and only then rewrites the pointer
(write a temporary file, sync, ``os.replace``), so a crash at any moment leaves the previous
checkpoint and the pointer to it intact.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from megapipe.atomic_files import fsync_dir, write_atomically
from megapipe.errors import CheckpointError

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.json"
METADATA = ".metadata"
STAGING_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + STAGING_SUFFIX


def read_latest(root: str) -> Optional[int]:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None when there is none."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number but holds {text[:40]!r}; "
                              "point it at a complete iter_* directory or delete it.")
    return int(text)


def prepare_staging(root: str, iteration: int) -> str:
    """An empty staging directory for ``iteration`` (a leftover of a killed save is discarded)."""
    staging = staging_dir(root, iteration)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def publish(root: str, iteration: int) -> str:
    """Move the synced staging directory into place and point ``latest`` at it.

    Saving an iteration that already has a directory (e.g. at SIGTERM right after a periodic
    save) sets the old one aside as ``.replaced`` for the moment between the two renames;
    :func:`find_checkpoint` falls back to it if a crash strikes exactly then.
    """
    staging, final = staging_dir(root, iteration), iteration_dir(root, iteration)
    fsync_dir(staging)
    replaced = final + REPLACED_SUFFIX
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staging, final)
    fsync_dir(root)
    write_atomically(os.path.join(root, LATEST), f"{iteration}\n")
    _remove_leftovers(root)
    return final


def _remove_leftovers(root: str) -> None:
    """What saves killed before they completed left behind, once ``latest`` names a newer checkpoint:
    staging directories, checkpoints set aside as ``.replaced`` and temporary copies of ``latest``."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("iter_") and name.endswith((STAGING_SUFFIX, REPLACED_SUFFIX)):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(f"{LATEST}.") and name.endswith(STAGING_SUFFIX):
            os.remove(path)


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMMON)) and os.path.isfile(os.path.join(path, METADATA))


def find_checkpoint(path: str) -> Optional[str]:
    """The checkpoint ``--load PATH`` means: PATH's latest one, or PATH itself if it is an iter_* directory.

    None when PATH exists but holds no checkpoint yet; raises when PATH is missing or
    ``latest`` names a directory that is not a complete checkpoint.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist.")
    if is_checkpoint(path):
        return path
    iteration = read_latest(path)
    if iteration is None:
        return None
    for candidate in (iteration_dir(path, iteration), iteration_dir(path, iteration) + REPLACED_SUFFIX):
        if is_checkpoint(candidate):
            return candidate
    raise CheckpointError(f"{os.path.join(path, LATEST)} names iteration {iteration}, but "
                          f"{iteration_dir(path, iteration)} is not a complete checkpoint (no {COMMON} or "
                          f"{METADATA}); point {LATEST} at an older iter_* directory.")
