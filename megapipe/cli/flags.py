"""The command line, generated from the configuration dataclasses' fields (Megatron-LM's flag names).

Every field declared with a flag (``megapipe.config.flag``) becomes one argparse option whose
default is the field's default, or, for the model, the default of the script's model family
(``megapipe.models.families``: BERT's epsilon is 1e-12). ``FIELD_FLAGS`` records where each
option's value goes. The few options that are not one field are listed in ``INPUT_FLAGS`` with
the field they fold into.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, NamedTuple, Optional

from megapipe.config.flag import field_default, flag_name
from megapipe.config.optimizer import OptimizerConfig
from megapipe.config.parser import FlagParser
from megapipe.config.schema import DataConfig, ModelConfig, ParallelConfig, ScheduleSearchConfig, TrainingConfig

# (path in Config, dataclass, --help section) in the order of --help
SECTIONS = (
    ("model", ModelConfig, "model"),
    ("parallel", ParallelConfig, "parallelism"),
    ("parallel.schedule_search", ScheduleSearchConfig, "parallelism"),
    ("optimizer", OptimizerConfig, "optimizer and precision"),
    ("training", TrainingConfig, "training"),
    ("data", DataConfig, "data"),
)
GROUPS = ("model", "mixture of experts", "parallelism", "optimizer and precision", "training", "data",
          "kernels and memory")

# options that are not one field: argparse dest -> the field (path.name) their value folds into
INPUT_FLAGS = {
    "num_layers_per_virtual_pipeline_stage": "parallel.virtual_pipeline",
    "group_query_attention": "model.num_query_groups",  # the Llama family's switch
    "model_preset": "model",  # a model family's shape: every model field it names
}


class FieldFlag(NamedTuple):
    """Where one option's value goes."""

    section: str  # path in Config ("model", "parallel.schedule_search" ...)
    field: str  # the dataclass field
    negate: bool  # the option turns the field off


def _fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if flag_name(f) is not None]


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


FIELD_FLAGS: dict[str, FieldFlag] = {
    _dest(flag_name(f)): FieldFlag(section, f.name, f.metadata.get("negate", False))
    for section, cls, _ in SECTIONS for f in _fields(cls)}


def _value_type(cls, f: dataclasses.Field):
    """The argparse type of a field from its annotation: int, float or str (Optional[...] unwrapped)."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if args else hint
    return hint if hint in (int, float, str) else None


def _add_field(group, cls, f: dataclasses.Field, default: Any) -> None:
    meta = f.metadata
    names = (flag_name(f), *meta.get("aliases", ()))
    options = dict(dest=_dest(flag_name(f)), help=meta.get("help"))
    if meta.get("negate"):
        assert default is True, f"{names[0]} turns {f.name} off, so the field must default to True"
        options.update(action="store_true")
    elif meta.get("action") is not None:
        options.update(action=meta["action"], default=default)
    elif isinstance(default, bool):
        assert default is False, f"{names[0]} is a switch, so {f.name} must default to False"
        options.update(action="store_true")
    else:
        options.update(default=default, type=meta.get("type") or _value_type(cls, f))
        for key in ("choices", "nargs", "metavar"):
            if meta.get(key) is not None:
                options[key] = meta[key]
    group.add_argument(*names, **options)


def build_parser(kind: str) -> FlagParser:
    """The flags of ``pretrain_{kind}.py``: one per configuration field, plus ``INPUT_FLAGS``."""
    from megapipe.models.families import FAMILIES, kind_family, presets

    parser = FlagParser(prog=f"pretrain_{kind}.py", description=f"Pretrain a {kind.upper()} model with tensor, "
                        "pipeline and data parallelism (Megatron-LM flag names).", allow_abbrev=False)
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    family_defaults = kind_family(kind).defaults
    for section, cls, group in SECTIONS:
        for f in _fields(cls):
            default = family_defaults.get(f.name, field_default(f)) if section == "model" else field_default(f)
            _add_field(groups[f.metadata.get("group") or group], cls, f, default)
    groups["parallelism"].add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                                       help="layers per model chunk for the interleaved schedule")
    for family in FAMILIES.values():
        if family.add_flags is not None:
            family.add_flags(groups["model"])
    names = presets(kind)
    if names:
        groups["model"].add_argument("--model-preset", choices=sorted(names), default=None,
                                     help="a model family's shape; explicitly given flags override it")
    return parser


def section_values(args: argparse.Namespace, section: str) -> dict:
    """The fields of one configuration section that the parsed flags set."""
    return {flag.field: (not getattr(args, dest)) if flag.negate else getattr(args, dest)
            for dest, flag in FIELD_FLAGS.items() if flag.section == section}


def apply_preset(args: argparse.Namespace, given: set[str], kind: str) -> tuple[Optional[Any], Optional[str]]:
    """Give every flag the command line did not give (``given``: argparse dests) the ``--model-preset``'s
    value; returns the preset's family (None without a preset) and, when a given flag differs from the
    preset, the one line that says the given flags win and which sizes the preset still sets."""
    from megapipe.models.families import presets

    name = getattr(args, "model_preset", None)
    if name is None:
        return None, None
    family, values = presets(kind)[name]
    overridden = [dest for dest in values if dest in given and getattr(args, dest) != values[dest]]
    for dest in values.keys() - given:
        setattr(args, dest, values[dest])
    if not overridden:
        return family, None
    kept = [dest for dest in values if dest not in given and type(values[dest]) is int]  # the rest of its shape

    def listed(dests: list[str], source: dict) -> str:
        return ", ".join(f"--{dest.replace('_', '-')} {source[dest]}" for dest in dests)

    line = (f"note: the flags given win over --model-preset {name}: {listed(overridden, vars(args))} (the preset's "
            f"{listed(overridden, values)})")
    return family, line + (f"; it still sets {listed(kept, values)}" if kept else "")
