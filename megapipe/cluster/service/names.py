"""Names users give (job names, worker hosts) are plain text of bounded length wherever they are shown.

A name reaches the service's log lines, ``tools/cluster.py status``, the status page and each
job's log; a newline or another control or format character (a terminal escape, a right-to-left
override) in it could forge lines or hide text in any of them, so such a name is refused.
"""

from __future__ import annotations

import unicodedata

from megapipe.errors import ConfigError

MAX_NAME_CHARACTERS = 64
_HIDDEN = ("Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp")  # control, format, private, surrogate, unassigned, separators


def check_name(what: str, name: str) -> str:
    """``name`` unchanged if it is 1 to ``MAX_NAME_CHARACTERS`` visible characters; ConfigError otherwise."""
    if not name.strip():
        raise ConfigError(f"{what} is empty; give it a short plain name such as small-gpt.")
    if len(name) > MAX_NAME_CHARACTERS:
        raise ConfigError(f"{what} has {len(name)} characters; give one of at most {MAX_NAME_CHARACTERS}.")
    hidden = next((c for c in name if unicodedata.category(c) in _HIDDEN), None)
    if hidden is not None:
        raise ConfigError(f"{what} {name!r} contains the control character U+{ord(hidden):04X}; give a name of "
                          "plain visible characters.")
    return name
