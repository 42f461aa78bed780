"""Flags that the run's path would not read: refused, or noted when Megatron-LM's scripts pass them by habit.

A flag given must take effect. Each rule names a field, when the run reads it,
and what to do otherwise: a flag whose absence of effect would surprise the user (``--finetune``
without ``--load``) is refused in one sentence; one that Megatron-LM's launch scripts carry for a
path megapipe does not need (``--num-workers`` without ``--hf-dataset``) is said in one note, and
the run goes on. A field at its default is never reported, so only what the user changed counts
(a field whose default is derived, as ``--split``'s, cannot be told apart and has no rule).
The tokenizer's own flags are checked against the tokenizer they name by
``megapipe.data.tokenizer.build.check_tokenizer_files``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

from megapipe.config.flag import field_default, flag_name
from megapipe.config.notes import tell
from megapipe.config.schema import Config, ModelConfig
from megapipe.errors import ConfigError


class Rule(NamedTuple):
    section: str  # the Config attribute holding the field: "model", "parallel", "data" or "training"
    field: str
    reads: Callable[[str, Config], bool]  # (kind, config) -> whether this run reads the field
    only: str  # completes "is read only ..."
    fix: str  # what to do instead (refusals) or why it is harmless (notes)
    refuse: bool


RULES = (
    Rule("model", "bert_binary_head", lambda kind, c: kind == "bert", "by pretrain_bert.py's sentence-order head",
         "drop it", True),
    Rule("parallel", "cp_comm_type", lambda kind, c: c.parallel.context_parallel_size > 1,
         "with --context-parallel-size above 1", "one context rank exchanges nothing", False),
    Rule("parallel", "expert_tensor", lambda kind, c: c.model.num_experts is not None,
         "with --num-experts N (a mixture-of-experts model)", "add --num-experts or drop the flag", True),
    *(Rule("model", field.name, lambda kind, c: c.model.num_experts is not None,
           "with --num-experts N (a mixture-of-experts model)", "add --num-experts or drop the flag", True)
      for field in dataclasses.fields(ModelConfig) if field.name.startswith("moe_")),
    Rule("data", "mask_prob", lambda kind, c: kind == "bert", "by pretrain_bert.py's masked language model",
         "drop it", True),
    Rule("data", "short_seq_prob", lambda kind, c: kind == "bert", "by pretrain_bert.py's sentence pairs",
         "drop it", True),
    Rule("data", "hf_dataset_text_key", lambda kind, c: c.data.hf_dataset is not None, "with --hf-dataset",
         "add --hf-dataset PATH or drop the flag", True),
    Rule("data", "num_workers", lambda kind, c: c.data.hf_dataset is not None, "with --hf-dataset",
         "other data is read from memory-mapped files in the training process", False),
    Rule("training", "finetune", lambda kind, c: c.training.load is not None, "with --load DIR",
         "add --load with the checkpoint to fine-tune", True),
    Rule("training", "no_load_optim", lambda kind, c: c.training.load is not None, "with --load DIR",
         "add --load with the checkpoint to resume", True),
    Rule("training", "no_load_rng", lambda kind, c: c.training.load is not None, "with --load DIR",
         "add --load with the checkpoint to resume", True),
    Rule("training", "override_opt_param_scheduler", lambda kind, c: c.training.load is not None,
         "with --load DIR", "a run that starts afresh follows the flags' schedule anyway", False),
    Rule("training", "use_checkpoint_opt_param_scheduler", lambda kind, c: c.training.load is not None,
         "with --load DIR", "add --load with the checkpoint whose schedule to follow", True),
    Rule("training", "async_save", lambda kind, c: c.training.save is not None, "with --save DIR",
         "nothing is saved without it", False),
    Rule("training", "no_save_optim", lambda kind, c: c.training.save is not None, "with --save DIR",
         "nothing is saved without it", False),
    Rule("training", "non_finite_action", lambda kind, c: c.training.check_for_nan_in_loss_and_grad,
         "with --check-for-nan-in-loss-and-grad", "add that flag or drop this one", True),
    Rule("training", "fp8_recipe", lambda kind, c: c.training.fp8_format is not None, "with --fp8-format",
         "add --fp8-format e4m3 or hybrid, or drop the flag", True),
    Rule("training", "wandb_exp_name", lambda kind, c: c.training.wandb_project is not None,
         "with --wandb-project", "nothing goes to Weights & Biases without it", False),
    Rule("training", "wandb_save_dir", lambda kind, c: c.training.wandb_project is not None,
         "with --wandb-project", "nothing goes to Weights & Biases without it", False),
)


def _field(section: str, name: str) -> dataclasses.Field:
    cls = type(getattr(Config(), section))
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _given(field: dataclasses.Field, value) -> str:
    """The flag as the user wrote it: its name, and its value unless it is a switch."""
    return flag_name(field) if isinstance(value, bool) else f"{flag_name(field)} {value}"


def check_unread_flags(kind: str, config: Config) -> None:
    """Raise ConfigError for the first changed flag this run would ignore that a refusing rule names;
    say one note for each one a noting rule names."""
    for rule in RULES:
        field = _field(rule.section, rule.field)
        value = getattr(getattr(config, rule.section), rule.field)
        if value == field_default(field) or rule.reads(kind, config):
            continue
        text = f"{_given(field, value)} is read only {rule.only}, so this run would ignore it"
        if rule.refuse:
            raise ConfigError(f"{text}; {rule.fix}.")
        tell(f"note: {text} ({rule.fix})")
