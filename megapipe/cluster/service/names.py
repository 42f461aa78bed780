"""Text users give (job names, worker hosts, a job's command) is plain wherever it is shown.

A name reaches the service's log lines, ``tools/cluster.py status``, the status page and each
job's log (so does each word of a job's command); a newline or another control or format
character (a terminal escape, a right-to-left override) in it could forge lines (a ``[cluster]``
line of a job's log, which the service reads back) or hide text in any of them, so it is refused.
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
    return check_plain(what, name, "a name")


def check_plain(what: str, text: str, kind: str = "text") -> str:
    """``text`` unchanged if it has no control or format character; ConfigError naming the first otherwise."""
    hidden = next((c for c in text if unicodedata.category(c) in _HIDDEN), None)
    if hidden is not None:
        raise ConfigError(f"{what} {text!r} contains the control character U+{ord(hidden):04X}; give {kind} of "
                          "plain visible characters.")
    return text
