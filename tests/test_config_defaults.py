"""The command line and the configuration dataclasses give the same defaults, and every flag has a field.

A flag whose default differs from its field's means a script and a library caller of the same
"default" run different jobs (the micro-batch size, learning rate and decay style once did).
"""

from __future__ import annotations

import dataclasses

import pytest

from megapipe.config import Config, DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainingConfig
from megapipe.cli.parse import build_parser, parse_config
from megapipe.models.families import FAMILIES

pytestmark = pytest.mark.unit

SCRIPT_KINDS = ("gpt", "bert")
DATACLASSES = {"model": ModelConfig, "parallel": ParallelConfig, "optimizer": OptimizerConfig,
               "training": TrainingConfig, "data": DataConfig}


def _flag_dests(kind: str) -> dict[str, object]:
    """argparse dest -> default of every option of ``pretrain_{kind}.py`` (help excluded)."""
    return {action.dest: action.default for action in build_parser(kind)._actions if action.dest != "help"}


@pytest.mark.parametrize("kind", SCRIPT_KINDS)
def test_an_empty_command_line_gives_the_dataclass_defaults(kind):
    parsed = parse_config(kind, [])
    family = FAMILIES[kind]
    expected = Config(model=ModelConfig(**family.defaults))
    differing = {}
    for section, cls in DATACLASSES.items():
        got, want = getattr(parsed, section), getattr(expected, section)
        differing.update({f"{section}.{f.name}": (getattr(got, f.name), getattr(want, f.name))
                          for f in dataclasses.fields(cls) if getattr(got, f.name) != getattr(want, f.name)})
    assert not differing, f"{kind}: flag default != dataclass default (flag, dataclass): {differing}"


@pytest.mark.parametrize("kind", SCRIPT_KINDS)
def test_every_flag_default_is_its_field_default(kind):
    """Per option: the parser's own default (before any derivation) is the field's default."""
    from megapipe.config.flag import field_default
    from megapipe.cli.flags import FIELD_FLAGS, SECTIONS

    classes = {section: cls for section, cls, _ in SECTIONS}
    defaults = _flag_dests(kind)
    family_defaults = FAMILIES[kind].defaults
    for dest, where in FIELD_FLAGS.items():
        field = {f.name: f for f in dataclasses.fields(classes[where.section])}[where.field]
        want = field_default(field)
        if where.section == "model":
            want = family_defaults.get(where.field, want)
        got = (not defaults[dest]) if where.negate else defaults[dest]
        assert got == want, f"--{dest.replace('_', '-')} defaults to {got!r}, {where.section}.{where.field} to {want!r}"


@pytest.mark.parametrize("kind", SCRIPT_KINDS)
def test_every_flag_maps_to_a_field(kind):
    from megapipe.cli.flags import FIELD_FLAGS, INPUT_FLAGS

    unmapped = sorted(set(_flag_dests(kind)) - set(FIELD_FLAGS) - set(INPUT_FLAGS))
    assert not unmapped, f"flags of pretrain_{kind}.py that set no configuration field: {unmapped}"
    for dest, target in INPUT_FLAGS.items():
        section, _, name = target.partition(".")
        cls = DATACLASSES.get(section)
        assert cls is not None and (not name or name in {f.name for f in dataclasses.fields(cls)}), (dest, target)


@pytest.mark.parametrize("kind", SCRIPT_KINDS)
def test_family_defaults_come_from_the_registry(kind):
    """BERT's epsilon, activation, layout and token types, and GPT's, are its registry entry over ModelConfig."""
    model = parse_config(kind, []).model
    for name, value in FAMILIES[kind].defaults.items():
        assert getattr(model, name) == value, (kind, name)
    assert model == FAMILIES[kind].model_config()


def test_llama_preset_defaults_come_from_the_registry():
    llama = FAMILIES["llama"]
    model = parse_config("gpt", ["--model-preset", "llama-tiny"]).model
    for name, value in llama.defaults.items():
        assert getattr(model, name) == value, name
    assert model.num_query_groups == 2 and model.ffn_hidden_size == 352


def test_explicit_flags_beat_the_family_defaults():
    model = parse_config("bert", ["--layernorm-epsilon", "1e-6"]).model
    assert model.layernorm_epsilon == 1e-6 and model.activation == "gelu"
    model = parse_config("gpt", ["--model-preset", "llama-tiny", "--hidden-dropout", "0.2"]).model
    assert model.hidden_dropout == 0.2 and model.swiglu


def test_exit_signal_handler_reaches_the_operations():
    """--exit-signal-handler (Megatron-LM's name) is on by default and --no-exit-signal-handler turns SIGTERM
    handling off in the operations object that watches for it."""
    import signal

    from megapipe.training.exits import ExitConditions

    assert parse_config("gpt", []).training.exit_on_sigterm
    assert parse_config("gpt", ["--exit-signal-handler"]).training.exit_on_sigterm
    config = parse_config("gpt", ["--no-exit-signal-handler"])
    assert not config.training.exit_on_sigterm
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ops = ExitConditions(config)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and not ops.watched
        ExitConditions(parse_config("gpt", []))
        assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
