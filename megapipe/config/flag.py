"""``flag(default, ...)``: a dataclass field that also says how the command line sets it.

Each configuration field is declared once, with its default; its metadata carries the
Megatron-LM flag name (by default the field's name with dashes, ``micro_batch_size`` ->
``--micro-batch-size``), the help text and argparse details. ``megapipe.cli.flags`` builds
the parser from these fields, so a flag's default is always the field's. ``flag(default,
name=None)`` declares a field that no flag sets (it is derived or fixed by the model family).

Nothing else of megapipe is imported here, so every configuration module can use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

_UNSET = object()


def flag(default: Any = _UNSET, *, name: Optional[str] | object = _UNSET, help: Optional[str] = None,
         aliases: tuple = (), negate: bool = False, choices: Optional[tuple] = None, type: Optional[Callable] = None,
         nargs: Optional[str] = None, metavar: Optional[str] = None, group: Optional[str] = None,
         action: Optional[type] = None, default_factory: Optional[Callable] = None):
    """A dataclass field with its flag.

    ``name``: the flag (``"--lr"``); left out, ``--`` plus the field name with dashes; None: no flag.
    ``negate``: a boolean field that defaults to True and a flag that turns it off (``--no-...``,
    ``--disable-...``). ``group``: the ``--help`` section, when not the dataclass's own. ``action``:
    an argparse action class instead of the one the field's type implies.
    """
    metadata = dict(flag=name, help=help, aliases=aliases, negate=negate, choices=choices, type=type, nargs=nargs,
                    metavar=metavar, group=group, action=action)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field: dataclasses.Field) -> Optional[str]:
    """The flag that sets ``field``, or None."""
    name = field.metadata.get("flag", _UNSET)
    if name is _UNSET:
        return "--" + field.name.replace("_", "-")
    return name


def field_default(field: dataclasses.Field) -> Any:
    """The field's default value (a fresh one for a default factory)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default
