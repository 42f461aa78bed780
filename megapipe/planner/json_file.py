"""Reading the planner's JSON inputs (cluster descriptions, profiles) with one sentence for each way a file fails."""

from __future__ import annotations

import json
from pathlib import Path

from megapipe.errors import ConfigError


def read_json(path: str | Path, name: str, missing_fix: str, invalid_fix: str) -> object:
    """The value in JSON file ``path``, which errors call ``name`` (e.g. "profile"); a ConfigError with
    ``missing_fix`` when it does not exist and ``invalid_fix`` when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{name} {path} does not exist; {missing_fix}.") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{name} {path} is not valid JSON ({error.msg} at line {error.lineno}); "
                          f"{invalid_fix}.") from None
