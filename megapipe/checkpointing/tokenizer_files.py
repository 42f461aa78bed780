"""The tokenizer a checkpoint carries: its files in ``iter_N/tokenizer/``, rebuilt by whoever reads the checkpoint.

Every save writes the run's tokenizer (``Tokenizer.save``) into the staging directory before
it is published, so the tokenizer appears atomically with the tensors; ``common.json``'s
``tokenizer`` holds the ``build_tokenizer`` arguments that load it, paths relative to
``tokenizer/``. Generation, the server, scoring and Hugging Face export rebuild it from there.
"""

from __future__ import annotations

import os
from typing import Optional

from megapipe.atomic_files import fsync_dir
from megapipe.data.tokenizer import Tokenizer, build_tokenizer
from megapipe.data.tokenizer.build import FILE_ARGUMENTS

TOKENIZER_DIR = "tokenizer"


def write_tokenizer(tokenizer: Optional[Tokenizer], checkpoint_dir: str) -> Optional[dict]:
    """Write ``tokenizer``'s files into ``checkpoint_dir/tokenizer`` (synced) and return what
    ``common.json`` records; None when the run has no tokenizer."""
    if tokenizer is None:
        return None
    directory = os.path.join(checkpoint_dir, TOKENIZER_DIR)
    os.makedirs(directory, exist_ok=True)
    spec = tokenizer.save(directory)
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb+") as f:
            os.fsync(f.fileno())
    fsync_dir(directory)
    if not os.listdir(directory):  # the byte-level and null tokenizers have no files
        os.rmdir(directory)
    return spec


def read_tokenizer(checkpoint_dir: str, spec) -> Optional[Tokenizer]:
    """The tokenizer ``checkpoint_dir`` carries, from ``spec`` (its ``common.json``'s ``tokenizer``), or
    None for a checkpoint saved without one.

    Imports by megapipe versions before this one kept only a tokenizer.json's text there; they
    count as saved without one (the tools then ask for the tokenizer flags).
    """
    if not isinstance(spec, dict):
        return None
    arguments = {flag: os.path.join(checkpoint_dir, TOKENIZER_DIR, value) if flag in FILE_ARGUMENTS else value
                 for flag, value in spec.items() if flag != "tokenizer_type"}
    return build_tokenizer(spec["tokenizer_type"], **arguments)
