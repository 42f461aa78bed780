"""Writing files and folders atomically: readers (other ranks, later runs, a restarted service) see
the old content or the new, never a part of it.

Each write goes to a temporary name beside the target (same file system, so the rename is atomic),
is synced, and is renamed onto the target; a failed write (a full disk, say) removes its temporary.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Optional


def temporary_sibling(path: str) -> str:
    """A fresh name next to ``path``, ending in ``.tmp`` so that cleaners can recognise leftovers."""
    return f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def fsync_dir(path: str) -> None:
    """Sync a directory, so that the names created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, content: str | bytes, mode: Optional[int] = None) -> None:
    """Replace ``path`` with ``content``, synced; ``mode`` (say 0o600 for a secret) holds from the start."""
    temporary = temporary_sibling(path)
    data = content.encode() if isinstance(content, str) else content
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:  # the old content stays, without a partial copy beside it
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


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
