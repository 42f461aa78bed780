"""Offline conversions behind ``tools/convert_checkpoint.py``: reshard, import and export Hugging Face and
Megatron-LM.

Each returns a ``Conversion`` that says what it did: source and target (with layouts), how
many tensors and bytes it wrote.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch

from megapipe.checkpointing.common import Common, SavedLayout, plain
from megapipe.checkpointing.hf import export_hf, import_hf
from megapipe.checkpointing.megatron_files import read_megatron, write_dist
from megapipe.checkpointing.megatron_names import from_megatron, megatron_args, to_megatron
from megapipe.checkpointing.offline import read_checkpoint, write_checkpoint
from megapipe.checkpointing.state import MASTER, is_rank_local, model_key, optimizer_key
from megapipe.checkpointing.tokenizer_files import read_tokenizer
from megapipe.config import Config, ModelConfig
from megapipe.errors import CheckpointError, ConfigError
from megapipe.data.tokenizer import Tokenizer


@dataclass
class Conversion:
    source: str
    source_layout: Optional[SavedLayout]  # None for another framework's checkpoint
    target: str
    target_layout: Optional[SavedLayout]
    tensors: int
    bytes: int
    dropped_in_flight: bool = False  # the source held an asynchronous pipeline's in-flight state
    initialized_heads: list = dataclasses.field(default_factory=list)  # heads the source lacked, freshly initialised
    foreign: str = "Hugging Face"  # what the side without a layout is
    fresh_optimizer: str = ""  # why the source's optimizer state was not carried over, when it had one

    def lines(self) -> list[str]:
        def where(path, layout):
            return f"{path} ({layout})" if layout is not None else f"{path} ({self.foreign})"
        lines = [f"source:  {where(self.source, self.source_layout)}",
                 f"target:  {where(self.target, self.target_layout)}",
                 f"tensors: {self.tensors}",
                 f"bytes:   {self.bytes} ({self.bytes / 2 ** 20:.1f} MiB)"]
        if self.dropped_in_flight:
            lines.append("dropped: the microbatches the source's PipeDream/2BW pipeline had in flight (they belong to "
                         "its layout); a run from the target starts with an empty pipeline")
        if self.initialized_heads:
            lines.append(f"initialised: {', '.join(self.initialized_heads)} (absent from the source; random weights)")
        if self.fresh_optimizer:
            lines.append(f"optimizer: not carried over ({self.fresh_optimizer}); a run from the target starts a "
                         "fresh optimizer")
        return lines


def _size(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _written(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a checkpoint written from ``tensors`` holds: random states and in-flight pipeline state are dropped."""
    return {key: value for key, value in tensors.items() if not is_rank_local(key)}


def reshard(source: str, target: str, layout: SavedLayout) -> Conversion:
    """Rewrite a checkpoint (weights, optimizer state, schedule) as ``layout``'s ranks would save it."""
    path, common, tensors = read_checkpoint(source)
    in_flight = any(key.startswith("inflight/") for key in tensors)
    tensors = _written(tensors)
    written = write_checkpoint(target, common, tensors, layout, read_tokenizer(path, common.tokenizer))
    return Conversion(path, common.layout, written, layout, len(tensors), _size(tensors), in_flight)


def import_hf_checkpoint(hf_dir: str, target: str, layout: SavedLayout,
                         initialize_missing_heads: bool = False) -> Conversion:
    """A megapipe checkpoint (weights only, iteration 0) of a Hugging Face directory, with its tokenizer;
    the architecture name goes into the checkpoint's metadata."""
    imported = import_hf(hf_dir, initialize_missing_heads)
    written = _write_imported(target, layout, imported.kind, imported.config, imported.canonical, imported.tokenizer,
                              imported.model_type)
    return Conversion(os.path.abspath(hf_dir), None, written, layout, len(imported.canonical),
                      _size(imported.canonical), initialized_heads=imported.initialized_heads)


def _write_imported(target: str, layout: SavedLayout, kind: str, config: ModelConfig, canonical: dict,
                    tokenizer: Optional[Tokenizer], hf_model_type: Optional[str] = None) -> str:
    """A megapipe checkpoint (weights only, iteration 0) of another framework's model, written as ``layout``."""
    tensors = {model_key(name): value for name, value in canonical.items()}
    common = Common(kind=kind, iteration=0, consumed_samples=0, skipped_iterations=0, layout=layout,
                    config=plain(Config(model=config)), scheduler=None, loss_scaler=None,
                    has_optimizer=False, has_rng=False, hf_model_type=hf_model_type)
    return write_checkpoint(target, common, tensors, layout, tokenizer)


def _weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights by canonical name: the fp32 masters where it has them."""
    names = [key.removeprefix("model/") for key in tensors if key.startswith("model/")]
    return {name: tensors.get(optimizer_key(name, MASTER), tensors[model_key(name)]) for name in names}


def export_hf_checkpoint(source: str, hf_dir: str, max_shard_size: str = "5GB") -> Conversion:
    """A Hugging Face directory of a megapipe checkpoint's weights (fp32 masters when present), as the
    architecture it was imported from (else the one its options match), with its tokenizer."""
    path, common, tensors = read_checkpoint(source)
    canonical = _weights(tensors)
    export_hf(common.kind, common.model_config, canonical, hf_dir, common.hf_model_type,
              read_tokenizer(path, common.tokenizer), max_shard_size)
    return Conversion(path, common.layout, os.path.abspath(hf_dir), None, len(canonical), _size(canonical))


MEGATRON_OPTIMIZER = "Megatron keeps optimizer state in its own layout of parameter groups and buffers"


def import_megatron_checkpoint(source: str, target: str, layout: SavedLayout,
                               vocab_size: Optional[int] = None) -> Conversion:
    """A megapipe checkpoint (weights only, iteration 0) of a Megatron-LM GPT or Llama-style checkpoint in
    ``torch`` (any (t, p) it was saved with) or ``torch_dist`` format; the model shape comes from its arguments.

    ``vocab_size``: the tokenizer's, when the arguments keep only the padded size; the rows past it are padding.
    """
    megatron = read_megatron(source)
    config = megatron.config
    if vocab_size is not None:
        if not 0 < vocab_size <= config.vocab_size:
            raise ConfigError(f"--vocab-size {vocab_size} must be between 1 and the checkpoint's {config.vocab_size} "
                              "embedding rows.")
        config = dataclasses.replace(config, vocab_size=vocab_size)
    canonical = from_megatron(megatron.tensors, config, megatron.directory)
    written = _write_imported(target, layout, "gpt", config, canonical, None)
    return Conversion(megatron.directory, None, written, layout, len(canonical), _size(canonical),
                      foreign=megatron.describe(),
                      fresh_optimizer=MEGATRON_OPTIMIZER if megatron.has_optimizer else "")


def export_megatron_checkpoint(source: str, target: str) -> Conversion:
    """A Megatron-core ``torch_dist`` checkpoint (weights and model arguments, at the source's iteration) of a
    megapipe GPT checkpoint's weights (fp32 masters when present)."""
    path, common, tensors = read_checkpoint(source)
    if common.kind != "gpt":
        raise CheckpointError(f"{path} holds a {common.kind.upper()} model; export-megatron writes GPT and "
                              "Llama-style models only.")
    config = common.model_config
    megatron = to_megatron(_weights(tensors), config)
    written = write_dist(target, megatron, megatron_args(config), common.iteration)
    return Conversion(path, common.layout, written, None, len(megatron), _size(megatron),
                      foreign="Megatron-LM torch_dist",
                      fresh_optimizer="Megatron reads only its own optimizer layout" if common.has_optimizer else "")
