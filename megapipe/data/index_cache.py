"""Sample indices built once, stored as .npy files and reused by every later run and rank.

Each index lives in its own folder ``<cache_dir>/<kind>-<hash>/``, where the hash covers
everything the index depends on. The folder is written under a temporary name and renamed
into place, so a reader sees a complete index or none; ranks that build the same index at
the same time produce identical folders and the first rename wins.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from typing import Callable, Optional

import numpy as np

from megapipe.atomic_files import publish_directory, temporary_sibling
from megapipe.errors import DataError

DESCRIPTION_FILE = "description.json"


def default_cache_dir(prefix: str, cache_dir: Optional[str]) -> str:
    """``cache_dir`` when given (--data-cache-path), else ``index-cache/`` next to the dataset."""
    return cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


def array_digest(array: np.ndarray) -> str:
    """Short hash of an array's contents, for cache keys."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def cache_path(cache_dir: str, description: dict) -> str:
    text = json.dumps(description, sort_keys=True)
    return os.path.join(cache_dir, f"{description['kind']}-{hashlib.sha256(text.encode()).hexdigest()[:20]}")


def _write(folder: str, description: dict, arrays: dict[str, np.ndarray]) -> None:
    tmp = temporary_sibling(folder)
    os.makedirs(tmp)
    try:
        for name, array in arrays.items():
            np.save(os.path.join(tmp, name + ".npy"), array)
        with open(os.path.join(tmp, DESCRIPTION_FILE), "w") as f:
            json.dump(description, f, indent=1, sort_keys=True)
        publish_directory(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _reported_as_cache_error(cache_dir: str):
    try:
        yield
    except OSError as error:
        raise DataError(f"cannot write the dataset index cache in {cache_dir} ({error.strerror}); "
                        "pass --data-cache-path with a writable folder.") from None


def load_or_build(cache_dir: str, description: dict,
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays cached under ``description`` (a JSON-able dict with a ``kind``), built by ``build()`` if absent.

    Arrays come back as read-only memory maps.
    """
    folder = cache_path(cache_dir, description)
    if not os.path.isdir(folder):
        with _reported_as_cache_error(cache_dir):
            os.makedirs(cache_dir, exist_ok=True)
        arrays = build()
        with _reported_as_cache_error(cache_dir):
            _write(folder, description, arrays)
    return {name[:-4]: np.load(os.path.join(folder, name), mmap_mode="r")
            for name in sorted(os.listdir(folder)) if name.endswith(".npy")}
