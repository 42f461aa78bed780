"""A Hugging Face weight mapping held as data, and the one walk that applies it in either direction.

A family's table is a list of rules: which megapipe tensors (``ours``) correspond to which Hugging
Face tensors (``theirs``) and the transform each way. Layer rules name tensors relative to
``layers.{i}.`` and to the table's ``layer_prefix``; ``when`` keeps a rule to the models and layers
that have those tensors. Import and export walk the same rules, so a name or a transform is written
once. The output layer is the one asymmetric tensor (imported when untied, exported always, as the
word embedding when tied), hence ``lm_head``. Both directions work on whole (unsharded) tensors;
``megapipe.models.state_dict`` splits them for tensor and pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megapipe.config import ModelConfig

# (ModelConfig, *tensors) -> the tensors of the other side, in the rule's order
Transform = Callable[..., tuple]


def same(config: ModelConfig, *tensors: torch.Tensor) -> tuple:
    return tensors


def always(config: ModelConfig, layer: Optional[int]) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """megapipe tensors ``ours`` <-> Hugging Face tensors ``theirs``."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    to_ours: Optional[Transform] = same  # None: exported only (a copy Hugging Face keeps and megapipe does not)
    to_theirs: Transform = same
    when: Callable[[ModelConfig, Optional[int]], bool] = always  # (config, layer; None model-wide) -> applies


def rename(ours: str, theirs: str, transform: Transform = same, when=always) -> Rule:
    """A one-to-one rule whose transform is its own inverse (the same tensor, or a transpose)."""
    return Rule((ours,), (theirs,), transform, transform, when)


@dataclass(frozen=True)
class HFMapping:
    """A family's table: per-layer rules, model-wide ones walked before and after the layers (so the
    tensors come in the order the mapping always gave them), and the output layer's name."""

    layer_prefix: str  # Hugging Face's prefix of layer {i}'s tensors
    layer: tuple[Rule, ...]
    before: tuple[Rule, ...]  # embeddings, final norm, heads
    after: tuple[Rule, ...] = ()
    lm_head: Optional[str] = None  # Hugging Face's output layer, when it has one of GPT's kind

    def rules(self, config: ModelConfig) -> Iterator[tuple[Rule, tuple[str, ...], tuple[str, ...]]]:
        """(rule, megapipe names, Hugging Face names) of every rule that applies to ``config``."""
        yield from ((rule, rule.ours, rule.theirs) for rule in self.before if rule.when(config, None))
        for i in range(config.num_layers):
            prefix = self.layer_prefix.format(i=i)
            for rule in self.layer:
                if rule.when(config, i):
                    yield rule, tuple(f"layers.{i}.{name}" for name in rule.ours), tuple(
                        prefix + name for name in rule.theirs)
        yield from ((rule, rule.ours, rule.theirs) for rule in self.after if rule.when(config, None))

    def from_hf(self, hf_state, config: ModelConfig) -> dict:
        """Canonical megapipe state dict from a Hugging Face state dict (any mapping that loads on access)."""
        out = {}
        for rule, ours, theirs in self.rules(config):
            if rule.to_ours is not None:
                out.update(zip(ours, rule.to_ours(config, *(hf_state[name] for name in theirs)), strict=True))
        if self.lm_head and config.untie_embeddings_and_output_weights:
            out["output_embedding.weight"] = hf_state[self.lm_head]
        return {k: v.clone() for k, v in out.items()}

    def to_hf(self, state: dict, config: ModelConfig) -> dict:
        """Hugging Face state dict from a canonical megapipe state dict."""
        out = {}
        for rule, ours, theirs in self.rules(config):
            out.update(zip(theirs, rule.to_theirs(config, *(state[name] for name in ours)), strict=True))
        if self.lm_head:
            out[self.lm_head] = state.get("output_embedding.weight", state["embedding.word_embeddings.weight"])
        return {k: v.clone() for k, v in out.items()}
