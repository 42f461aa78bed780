"""The model-family registry: one entry per family (``family.py``), one file per family.

Adding a family is one file here (a module with its ``FAMILY``) plus its name in ``REGISTERED``
below. A family that claims models of another's kind (Llama is a GPT with other options) names
the models it claims, and ``family_of`` asks such families before the one that takes the rest.
"""

from __future__ import annotations

from importlib import import_module

from megapipe.config import ModelConfig
from megapipe.models.families.family import Family, HFArchitecture

REGISTERED = ("gpt", "bert", "moe", "llama")  # the modules of this package that hold a FAMILY; a family that
# claims models comes before one claiming a wider set (an MoE model is also Llama-shaped)

FAMILIES: dict[str, Family] = {}
for _module in REGISTERED:
    _family = import_module(f"{__name__}.{_module}").FAMILY
    assert _family.name not in FAMILIES, f"two families are named {_family.name}"
    FAMILIES[_family.name] = _family

KINDS = tuple(dict.fromkeys(f.kind for f in FAMILIES.values()))  # the training scripts' model kinds
HF_ARCHITECTURES: dict[str, tuple[Family, HFArchitecture]] = {
    arch.model_type: (family, arch) for family in FAMILIES.values() for arch in family.hf}


def family(name: str) -> Family:
    return FAMILIES[name]


def kind_family(kind: str) -> Family:
    """The family a training script of ``kind`` trains by default (the one named as the kind)."""
    return FAMILIES[kind]


def family_of(kind: str, config: ModelConfig) -> Family:
    """The family a model of ``kind`` with ``config`` belongs to."""
    candidates = sorted((f for f in FAMILIES.values() if f.kind == kind), key=lambda f: f.claims is None)
    return next(f for f in candidates if f.claims is None or f.claims(config))


def presets(kind: str) -> dict[str, tuple[Family, dict]]:
    """``--model-preset`` names of a script's kind -> (family, flag values)."""
    return {name: (f, values) for f in FAMILIES.values() if f.kind == kind for name, values in f.presets.items()}


__all__ = ["FAMILIES", "Family", "HFArchitecture", "HF_ARCHITECTURES", "KINDS", "family", "family_of",
           "kind_family", "presets"]
