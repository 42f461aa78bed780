"""What a submitted job may read and write: every flag naming a file, inside the scheduler's allowed roots.

A submitted command runs with the agents' (or Slurm's) rights, so each path it names (datasets,
tokenizer files, log and record destinations, schedules and profiles) must resolve, symlinks
followed (``os.path.realpath``), strictly inside one of ``serve --allowed-paths`` roots (by
default the work dir's ``files/``). Paths are absolute: a relative one would resolve against
wherever the ranks start. Datasets are prefixes, so their ``.bin`` and ``.idx`` are checked too.
"""

from __future__ import annotations

import os

from megapipe.data.blended_dataset import parse_data_path
from megapipe.errors import ConfigError

# every flag of megapipe/config/schema.py whose value names a file or directory (--save, --load and
# --pipeline-stages are refused before this: the scheduler owns them, or they cannot be re-planned)
PATH_FLAGS = ("--data-path", "--hf-dataset", "--vocab-file", "--merge-file", "--tokenizer-model", "--data-cache-path",
              "--wandb-save-dir", "--tensorboard-dir", "--record-timeline", "--schedule-file", "--schedule-profile")
DATASET_SUFFIXES = ("", ".bin", ".idx")


def resolved_roots(roots) -> tuple[str, ...]:
    """The roots as real absolute paths (what a job's paths are compared with)."""
    return tuple(os.path.realpath(os.path.abspath(root)) for root in roots)


def check_paths(args, roots: tuple[str, ...]) -> None:
    """ConfigError naming the flag, the path and the roots for the first path of ``args`` outside ``roots``."""
    for flag in PATH_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if flag == "--data-path":
            paths = [prefix + suffix for _, prefix in parse_data_path(value) for suffix in DATASET_SUFFIXES] \
                if value else []
        else:
            paths = [] if value is None else [value]
        for path in paths:
            _check(flag, path, roots)


def _check(flag: str, path: str, roots: tuple[str, ...]) -> None:
    where = ", ".join(roots)
    if not os.path.isabs(path):
        raise ConfigError(f"{flag} {path} is a relative path; give an absolute path inside {where}.")
    real = os.path.realpath(path)
    if not any(real.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
        really = f" (really {real})" if real != path else ""
        raise ConfigError(f"{flag} {path}{really} is outside the paths this scheduler allows ({where}); move it "
                          "under one of them or start serve with --allowed-paths naming its directory.")
