"""``tell``: one line to the user about how the flags were read (a preset a flag overrides, a flag
that changes nothing, a layout across nodes), on stderr by rank 0 only, so a job says it once."""

from __future__ import annotations

import os
import sys


def tell(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
