"""The tensors of a Hugging Face directory's safetensors files, read one at a time on access.

``model.safetensors`` or the shards a ``model.safetensors.index.json`` names: a key is read
from its file when asked for, so an import holds the source model's tensors only as long as
the conversion needs them, never a whole ``transformers`` model besides.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from megapipe.errors import CheckpointError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def has_safetensors(hf_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(hf_dir, name)) for name in (SINGLE, INDEX))


class SafetensorsFiles(Mapping):
    """A read-only mapping key -> fp32 tensor over one directory's (possibly sharded) safetensors."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.files = dict(json.load(f)["weight_map"])
        else:
            from safetensors import safe_open

            with safe_open(os.path.join(hf_dir, SINGLE), framework="pt") as f:
                self.files = {key: SINGLE for key in f.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self.files:
            raise CheckpointError(f"{self.hf_dir} has no tensor {key!r}; the checkpoint is incomplete.")
        path = os.path.join(self.hf_dir, self.files[key])
        if not os.path.isfile(path):
            raise CheckpointError(f"{self.hf_dir}: shard {self.files[key]} named by {INDEX} is missing.")
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(key).float()

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)
