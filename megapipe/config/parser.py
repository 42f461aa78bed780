"""``FlagParser``: argparse whose mistakes are one-sentence ``ConfigError``s, not the usage text.

An entry point prints a ``ConfigError`` once and exits 2 (``megapipe.errors``); argparse would
print its whole usage (about ninety lines) and a bare "unrecognized arguments". An unknown flag
is named with the closest known ones (difflib), e.g. ``--num-layer`` -> ``--num-layers``.
``given`` tells which flags a command line sets, whatever their values (a ``--model-preset``
yields to those only).
"""

from __future__ import annotations

import argparse
import difflib
from typing import Optional, Sequence

from megapipe.errors import ConfigError


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises ``ConfigError`` with one sentence for every mistake."""

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise ConfigError(f"{unknown_words(unknown, self.known_flags())}; {self.prog} --help lists the flags.")
        return parsed

    def error(self, message: str):
        raise ConfigError(f"{message}; {self.prog} --help lists the flags.")

    def known_flags(self) -> list[str]:
        return [name for action in self._actions for name in action.option_strings]

    def given(self, args: Optional[Sequence[str]] = None) -> set[str]:
        """The dests that ``args`` sets, equal to their default or not: parsed onto a namespace that
        already holds every dest, argparse fills in no default, so what changed was given."""
        unset = object()
        namespace = self.parse_args(args, argparse.Namespace(**{action.dest: unset for action in self._actions}))
        return {dest for dest, value in vars(namespace).items() if value is not unset}


def unknown_words(words: Sequence[str], known: Sequence[str]) -> str:
    """What is wrong with the words argparse could not place: the unknown flags, each with the known
    flags closest to it, or the first stray value when every word is one."""
    flags = [word.split("=", 1)[0] for word in words if word.startswith("-")]
    if not flags:
        return f"unexpected argument {words[0]!r}: it follows no flag that takes a value"
    named = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=2, cutoff=0.8)
        named.append(f"{flag} (did you mean {' or '.join(close)}?)" if close else flag)
    return f"unknown flag{'s' if len(named) > 1 else ''} {', '.join(named)}"
