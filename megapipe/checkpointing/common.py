"""The small, layout-independent part of a checkpoint, kept as readable JSON (``common.json``).

It records where training stands (iteration, consumed samples), the learning-rate schedule,
the loss scaler, the layout that wrote the files (to decide whether per-rank random states
still apply), what the tensors include, and the whole run configuration, so a tool can
rebuild the model without the original command line. JSON rather than pickle: it loads under
any PyTorch version and ``torch.load(weights_only=True)`` rules.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch

from megapipe.checkpointing.paths import COMMON
from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError

FORMAT = "megapipe-checkpoint"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """The parallel layout a checkpoint was written with; per-rank random states only fit the same one.

    A run with ``--pipeline-stages`` records its plan too: ``pipeline`` then counts the ranks
    of a pipeline group (every worker under 1F1B-RR) and ``data`` the slices of a batch.
    """

    tensor: int
    pipeline: int
    data: int
    virtual_pipeline: int = 1
    stages: Optional[str] = None  # the stage plan, e.g. "0:2x2,2:4x1"
    placement: str = "looped"  # where the virtual stages live (layout/placement.py): "looped" or "v"
    context: int = 1  # the tensors do not depend on it; the per-rank random states do

    def __str__(self) -> str:
        v = f", v={self.virtual_pipeline}" if self.virtual_pipeline > 1 else ""
        v += " in a V" if self.placement == "v" else ""
        v += f", c={self.context}" if self.context > 1 else ""
        stages = f", stages {self.stages}" if self.stages else ""
        return f"(t, p, d) = ({self.tensor}, {self.pipeline}, {self.data}){v}{stages}"

    @property
    def world_size(self) -> int:
        return self.tensor * self.context * self.pipeline * self.data

    @staticmethod
    def of(ps, stages: Optional[str] = None) -> "SavedLayout":
        """The layout of a run's ParallelState (and its stage plan, written as ``StagePlan.to_text``)."""
        return SavedLayout(ps.tp_size, ps.pp_size, ps.batch_slice[1], ps.virtual_pipeline, stages, ps.placement.value,
                           ps.cp_size)

    @staticmethod
    def of_run(run) -> "SavedLayout":
        """The layout of a ``RunState`` (its process groups and stage plan)."""
        plan = run.config.parallel.stage_plan()
        return SavedLayout.of(run.ps, plan.to_text() if plan is not None else None)


def optimizer_family(name: str) -> str:
    """Optimizers whose state tensors have the same names ('adam' and 'adamw' are one thing here)."""
    return "sgd" if name == "sgd" else "adam"


def plain(value):
    """A config value as JSON: dtypes by name, dataclasses as dicts."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def model_config_from_dict(fields: dict) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: v for k, v in fields.items() if k in known}
    values["params_dtype"] = getattr(torch, values.get("params_dtype", "float32"))
    return ModelConfig(**values)


@dataclasses.dataclass
class Common:
    """Everything in a checkpoint that is not a tensor."""

    kind: str  # "gpt" or "bert"
    iteration: int
    consumed_samples: int
    skipped_iterations: int
    layout: SavedLayout
    config: dict  # the run's Config as plain values
    scheduler: Optional[dict]
    loss_scaler: Optional[dict]
    has_optimizer: bool
    has_rng: bool
    tokenizer: Optional[dict] = None  # build_tokenizer's arguments for the files in tokenizer/ (tokenizer_files.py)
    hf_model_type: Optional[str] = None  # the Hugging Face architecture an import came from
    format: str = FORMAT
    version: int = VERSION

    @property
    def model_config(self) -> ModelConfig:
        return model_config_from_dict(self.config["model"])

    @property
    def optimizer_family(self) -> str:
        return optimizer_family(self.config["optimizer"]["optimizer"])

    def write(self, directory: str) -> None:
        """Write ``common.json`` into ``directory`` and sync it (the directory is synced on publish)."""
        with open(os.path.join(directory, COMMON), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def read(directory: str) -> "Common":
        path = os.path.join(directory, COMMON)
        try:
            with open(path) as f:
                fields = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{directory} is not a checkpoint: it has no {COMMON}.") from None
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path} is damaged ({error.msg} at character {error.pos}).") from None
        return Common.from_fields(fields, directory)

    @staticmethod
    def from_fields(fields: dict, where: str) -> "Common":
        """The value of ``dataclasses.asdict(common)``, checked to be one this megapipe reads (``where`` names it)."""
        if fields.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not a megapipe checkpoint ({COMMON} has format "
                                  f"{fields.get('format')!r}).")
        if fields.get("version", 0) > VERSION:
            raise CheckpointError(f"{where} was written by a newer megapipe (format version {fields['version']}, "
                                  f"this one reads up to {VERSION}); upgrade megapipe to load it.")
        return Common(**{**fields, "layout": SavedLayout(**fields["layout"])})
