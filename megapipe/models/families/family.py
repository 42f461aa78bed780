"""``Family``: everything megapipe knows about one model family, in one registry entry.

A family is a kind of model users train and exchange: its defaults (the ``ModelConfig``
fields that differ from the dataclass's), the stage class that builds it per pipeline stage,
its Hugging Face architectures, its extra flags and ``--model-preset`` shapes, its FLOPs
formula and the names of the losses it logs. The command line, the builders, the Hugging Face import/export and the FLOPs counts
all read the entry; none keeps a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from megapipe.config import ModelConfig
from megapipe.models.flops import flops_per_iteration
from megapipe.models.hf_table import HFMapping
from megapipe.models.loss_parts import lm_loss_only


@dataclass(frozen=True)
class HFArchitecture:
    """One Hugging Face architecture of a family and how megapipe maps it."""

    model_type: str  # transformers' ``model_type`` in config.json
    hf_class: str  # the transformers class whose state dict the mapping reads and writes
    model_config: Callable  # transformers config -> ModelConfig
    weights: HFMapping  # the weight mapping table, walked by import and export alike
    # (ModelConfig, **special-token ids such as eos_token_id) -> transformers config (ValueError when it has no equal)
    hf_config: Callable
    # options whose other values change the maths in ways megapipe does not implement
    unsupported: dict = field(default_factory=dict)
    reads_safetensors: bool = False  # import reads safetensors tensor by tensor instead of from_pretrained


@dataclass(frozen=True)
class Family:
    """A model family's registry entry (``megapipe.models.families.FAMILIES``)."""

    name: str
    kind: str  # the training script and dataset it runs under: "gpt" or "bert"
    stage: type  # the module built per pipeline stage (LanguageModelStage subclass)
    defaults: dict = field(default_factory=dict)  # ModelConfig fields that differ from the dataclass's
    hf: tuple = ()  # its HFArchitecture entries; the first is what it exports as by default
    presets: dict = field(default_factory=dict)  # --model-preset name -> flag values (argparse dests)
    # does a model of this family's kind belong to it (for export); None: every model of the kind
    claims: Optional[Callable[[ModelConfig], bool]] = None
    export_type: Optional[Callable[[ModelConfig], str]] = None  # the Hugging Face model_type it exports as
    add_flags: Optional[Callable] = None  # adds the family's own flags to an argparse group
    model_options: Optional[Callable] = None  # (args, model fields) -> None: folds those flags into the fields
    flops: Callable = flops_per_iteration  # (ModelConfig, global batch, recompute) -> model FLOPs per iteration
    losses: Callable[[ModelConfig], tuple] = lm_loss_only  # the names its losses are logged under, trained-on first

    def model_config(self, **fields) -> ModelConfig:
        """A ``ModelConfig`` of this family: its defaults, then ``fields``."""
        return ModelConfig(**{**self.defaults, **fields})

    def hf_export_type(self, config: ModelConfig) -> str:
        return self.export_type(config) if self.export_type else self.hf[0].model_type
