"""Publishing files and folders atomically, so readers (other ranks, later runs) see all or nothing."""

from __future__ import annotations

import os
import shutil
import uuid


def temporary_sibling(path: str) -> str:
    """A fresh name next to ``path`` (same file system, so a rename onto ``path`` is atomic)."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def publish_directory(tmp_dir: str, final_dir: str) -> None:
    """Rename a fully written ``tmp_dir`` to ``final_dir``.

    If another process published ``final_dir`` first, its copy is kept and ``tmp_dir`` is
    deleted: builders are deterministic, so both copies are the same.
    """
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not os.path.isdir(final_dir):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
